// Portable family of the int4 capability (any CPU; also what FASTDL_CPU_ISA=scalar runs): the same loop nest as
// int4_stream.h, one weight at a time, the same fp32 operations per weight (x * (u - z), then the group sum times s).
#include "int4_kernels.h"

#include <algorithm>
#include <cmath>

namespace fastdl {
namespace int4 {
namespace {

void stream_scalar(const Int4Args &a, int64_t n0, int64_t n1) {
    const int64_t groups = a.K / a.group, rowb = a.K / 2;
    for (int64_t m = 0; m < a.M; ++m) {
        const float *x = a.x + m * a.ldx;
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t *q = a.q + n * rowb;
            float tot = 0.f;
            for (int64_t g = 0; g < groups; ++g) {
                const int z = a.zeros ? a.zeros[n * groups + g] : 8;
                float acc = 0.f;
                for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
                    const int64_t b = k / 32, i = k % 32;
                    const uint8_t byte = q[b * 16 + (i & 15)];
                    const int u = i < 16 ? (byte & 0x0F) : (byte >> 4);
                    acc += x[k] * static_cast<float>(u - z);
                }
                tot += acc * half_to_float(a.scales[n * groups + g]);
            }
            a.out[m * a.ldo + n] = tot + (a.bias ? a.bias[n] : 0.f);
        }
    }
}

void quantize_scalar(const QuantX &p, int64_t m0, int64_t m1) {
    const int64_t groups = p.K / p.group, ldg = (groups + 7) / 8 * 8; // (rows of sx / sumx padded, int4_kernels.h)
    for (int64_t m = m0; m < m1; ++m)
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = p.x + m * p.ldx + g * p.group;
            int8_t *qg = p.qx + m * p.K + g * p.group;
            const int64_t mg = m * ldg + g;
            float amax = 0.f;
            bool finite = true;
            for (int64_t k = 0; k < p.group; ++k) {
                finite = finite && xg[k] - xg[k] == 0.f;
                amax = std::max(amax, std::fabs(xg[k]));
            }
            int32_t sum = 0;
            const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
            for (int64_t k = 0; k < p.group; ++k) {
                const float v = inv == 0.f ? 0.f : std::nearbyint(std::min(127.f, std::max(-127.f, xg[k] * inv)));
                qg[k] = static_cast<int8_t>(v);
                sum += qg[k];
            }
            p.sx[mg] = !finite ? std::nanf("") : amax > 0.f ? amax / 127.f : 0.f;
            p.sumx[mg] = sum;
        }
}

void a8_scalar(const A8Args &a, int64_t n0, int64_t n1) {
    const int64_t groups = a.K / a.group, rowb = a.K / 2, ldg = (groups + 7) / 8 * 8;
    for (int64_t m = 0; m < a.M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t *q = a.q + n * rowb;
            float tot = 0.f;
            for (int64_t g = 0; g < groups; ++g) {
                const int32_t z = a.zeros ? a.zeros[n * groups + g] : 8;
                int32_t acc = 0;
                for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k) {
                    const uint8_t byte = q[(k / 32) * 16 + (k % 32 & 15)];
                    acc += static_cast<int32_t>(k % 32 < 16 ? (byte & 0x0F) : (byte >> 4)) * a.qx[m * a.K + k];
                }
                acc -= z * a.sumx[m * ldg + g];
                tot += static_cast<float>(acc) * (half_to_float(a.scales[n * groups + g]) * a.sx[m * ldg + g]);
            }
            a.out[m * a.ldo + n] = tot + (a.bias ? a.bias[n] : 0.f);
        }
}

} // namespace

const Kernels *kernels_scalar() {
    static const Kernels k{"scalar", &stream_scalar, &quantize_scalar, &a8_scalar};
    return &k;
}

} // namespace int4
} // namespace fastdl
