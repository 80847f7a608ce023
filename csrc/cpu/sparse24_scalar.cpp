// 2:4 sparsity, portable kernels (FASTDL_CPU_ISA=scalar, non-x86 CPUs): the reference loops the SIMD levels are
// tested against. Plain C++ compiled with the project's generic flags; threading is done by the caller on row ranges.
#include "sparse24_kernels.h"

#include <type_traits>

namespace fastdl {
namespace sparse24 {
namespace scalar {
namespace {

using namespace detail;

// Row kernels of the table (KIND: 0 = F32, 1 = BF16, 2 = F16; BYTES: the element size; 16-bit elements are moved as
// bits).
template <int KIND> void compress_row(const void *w, int64_t K, void *vals, uint8_t *meta, bool *mask) {
    using U = std::conditional_t<KIND == 0, uint32_t, uint16_t>;
    for (int64_t g = 0; g < K / 4; ++g)
        compress_group(static_cast<const U *>(w) + 4 * g, g, KIND, static_cast<U *>(vals), meta, mask);
}

template <int BYTES> bool decompress_row(const void *vals, const uint8_t *meta, int64_t K, void *out) {
    using U = std::conditional_t<BYTES == 4, uint32_t, uint16_t>;
    if (!meta_rows_ok(meta, K, 1, meta_bytes_ok))
        return false;
    for (int64_t g = 0; g < K / 4; ++g)
        decompress_group(static_cast<const U *>(vals), meta, g, static_cast<U *>(out));
    return true;
}

// XT: x / out element (float or uint16_t = bf16), VT: values element. Each group's kept positions and values are
// decoded once per weight row and block of up to 8 rows of x.
template <typename XT, typename VT> bool linear(const LinearArgs &a, int64_t n0, int64_t n1) {
    constexpr int MB = 8;
    const XT *x = static_cast<const XT *>(a.x);
    const VT *v = static_cast<const VT *>(a.values);
    XT *out = static_cast<XT *>(a.out);
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    const bool round_w = sizeof(XT) == 2 && sizeof(VT) == 4; // W is rounded to x's dtype (the contract)
    for (int64_t n = n0; n < n1; ++n) {
        const VT *vr = v + n * half;
        const uint8_t *mr = a.meta + n * mb;
        if (!meta_rows_ok(mr, a.K, 1, meta_bytes_ok))
            return false;
        const float b = a.bias ? a.bias[n] : 0.f;
        for (int64_t m0 = 0; m0 < a.M; m0 += MB) {
            const int rows = static_cast<int>(std::min<int64_t>(MB, a.M - m0));
            float acc[MB] = {};
            for (int64_t g = 0; g < a.K / 4; ++g) {
                int p0, p1;
                kept_positions(meta_nibble(mr, g), p0, p1);
                float w0 = to_f32(vr[2 * g]), w1 = to_f32(vr[2 * g + 1]);
                if (round_w) {
                    w0 = bf16_to_f32(f32_to_bf16(w0));
                    w1 = bf16_to_f32(f32_to_bf16(w1));
                }
                for (int i = 0; i < rows; ++i) {
                    const XT *xg = x + (m0 + i) * a.ldx + 4 * g;
                    acc[i] += to_f32(xg[p0]) * w0 + to_f32(xg[p1]) * w1;
                }
            }
            for (int i = 0; i < rows; ++i)
                store_out(out + (m0 + i) * a.ldo + n, acc[i] + b);
        }
    }
    return true;
}

bool decompress_rows_f32(DType vdt, const void *values, const uint8_t *meta, int64_t K, int64_t r0, int64_t r1,
                         float *out) {
    const int64_t half = K / 2, mb = (K + 7) / 8;
    for (int64_t r = r0; r < r1; ++r) {
        const uint8_t *mr = meta + r * mb;
        if (!meta_rows_ok(mr, K, 1, meta_bytes_ok))
            return false;
        float *o = out + r * K;
        for (int64_t g = 0; g < K / 4; ++g) {
            int p0, p1;
            kept_positions(meta_nibble(mr, g), p0, p1);
            const int64_t e = r * half + 2 * g;
            float w0, w1;
            if (vdt == DType::F32) {
                w0 = static_cast<const float *>(values)[e];
                w1 = static_cast<const float *>(values)[e + 1];
            } else {
                w0 = bf16_to_f32(static_cast<const uint16_t *>(values)[e]);
                w1 = bf16_to_f32(static_cast<const uint16_t *>(values)[e + 1]);
            }
            o[4 * g] = o[4 * g + 1] = o[4 * g + 2] = o[4 * g + 3] = 0.f;
            o[4 * g + p0] = w0;
            o[4 * g + p1] = w1;
        }
    }
    return true;
}

} // namespace
} // namespace scalar

// Every (x, values) dtype pair read directly, split by the default 24 columns; the dense route from the first row of
// x (sparse24.cpp, dense_route_min_rows).
const Kernels *kernels_scalar() {
    using namespace scalar;
    static const Kernels k = [] {
        Kernels t;
        t.linear[0][0].rows = linear<float, float>;
        t.linear[0][1].rows = linear<float, uint16_t>;
        t.linear[1][0].rows = linear<uint16_t, float>;
        t.linear[1][1].rows = linear<uint16_t, uint16_t>;
        t.dense_min_rows = 1;
        t.rows = {{compress_row<0>, compress_row<1>, compress_row<2>}, {decompress_row<2>, decompress_row<4>}};
        t.decompress_rows_f32 = decompress_rows_f32;
        t.name = cpu::level_name(cpu::kScalar);
        return t;
    }();
    return &k;
}

} // namespace sparse24
} // namespace fastdl
