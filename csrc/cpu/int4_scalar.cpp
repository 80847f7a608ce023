// Portable family of the int4 capability (any CPU; also what FASTDL_CPU_ISA=scalar runs): the same loop nest as
// int4_stream.h, one weight at a time, the same fp32 operations per weight (x * (u - z), then the group sum times s).
#include "int4_kernels.h"

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

} // namespace

const Kernels *kernels_scalar() {
    static const Kernels k{"scalar", &stream_scalar};
    return &k;
}

} // namespace int4
} // namespace fastdl
