// Portable family of the int4 capability (any CPU; also what FASTDL_CPU_ISA=scalar runs): the same loop nest as
// int4_stream.h, one weight at a time, the same fp32 operations per weight (x * (u - z), then the group sum times s).
#include "int4_kernels.h"

#include <algorithm>
#include <cmath>

namespace fastdl {
namespace int4 {
namespace {

// Code u of input feature k in a packed weight row (int4_kernels.h: 32-k blocks, low nibbles first).
inline int code_at(const uint8_t *row, int64_t k) {
    const uint8_t byte = row[(k / 32) * 16 + (k % 32 & 15)];
    return k % 32 < 16 ? (byte & 0x0F) : (byte >> 4);
}

// out[m][n] = sum over groups g of group(m, n, g, z, s) + bias[n], for every row m of x and weight row n in [n0, n1):
// the loop nest both ops share (Args: Int4Args or A8Args).
template <class Args, class Group> void rows_scalar(const Args &a, int64_t n0, int64_t n1, const Group &group) {
    const int64_t groups = a.K / a.group;
    for (int64_t m = 0; m < a.M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
            const uint8_t *q = a.q + n * (a.K / 2);
            float tot = 0.f;
            for (int64_t g = 0; g < groups; ++g)
                tot += group(m, q, g, a.zeros ? a.zeros[n * groups + g] : 8, half_to_float(a.scales[n * groups + g]));
            a.out[m * a.ldo + n] = tot + (a.bias ? a.bias[n] : 0.f);
        }
}

void stream_scalar(const Int4Args &a, int64_t n0, int64_t n1) {
    rows_scalar(a, n0, n1, [&](int64_t m, const uint8_t *q, int64_t g, int z, float s) {
        const float *x = a.x + m * a.ldx;
        float acc = 0.f;
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k)
            acc += x[k] * static_cast<float>(code_at(q, k) - z);
        return acc * s;
    });
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
    const int64_t ldg = (a.K / a.group + 7) / 8 * 8;
    rows_scalar(a, n0, n1, [&](int64_t m, const uint8_t *q, int64_t g, int z, float s) {
        int32_t acc = 0;
        for (int64_t k = g * a.group; k < (g + 1) * a.group; ++k)
            acc += code_at(q, k) * a.qx[m * a.K + k];
        acc -= z * a.sumx[m * ldg + g];
        return static_cast<float>(acc) * (s * a.sx[m * ldg + g]);
    });
}

} // namespace

const Kernels *kernels_scalar() {
    static const Kernels k{"scalar", &stream_scalar, &quantize_scalar, &a8_scalar};
    return &k;
}

} // namespace int4
} // namespace fastdl
