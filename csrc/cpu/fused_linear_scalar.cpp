// Portable kernels of the fused linear layer: the epilogue and the backward elementwise pass in plain C++ (the scalar
// family; its GEMMs go through ATen, see fused_linear.cpp), and the portable helpers every family shares.
#include "fused_linear_kernels.h"

#include <algorithm>

namespace fastdl {
namespace fused_linear {
namespace {

inline float load_scalar(const void *p, DType dt, int64_t i) {
    return dt == DType::F32 ? static_cast<const float *>(p)[i] : bf16_to_f32(static_cast<const uint16_t *>(p)[i]);
}

inline void store_scalar(void *p, DType dt, int64_t i, float v) {
    if (dt == DType::F32)
        static_cast<float *>(p)[i] = v;
    else
        static_cast<uint16_t *>(p)[i] = f32_to_bf16(v);
}

// sigmoid(z) and 1 - sigmoid(z) without cancellation or overflow (the form of the vector kernels' v_sigmoid).
inline float sigmoid_scalar(float z, float *oms = nullptr) {
    const float e = std::exp(-std::fabs(z)), r = 1.f / (1.f + e);
    if (oms)
        *oms = z < 0.f ? r : e * r;
    return z < 0.f ? e * r : r;
}

inline float act_scalar(Act a, float x) {
    switch (a) {
    case Act::None:
        return x;
    case Act::Relu:
        return (x > 0.f || std::isnan(x)) ? x : 0.f;
    case Act::Gelu:
        return 0.5f * x * std::erfc(-x * kSqrt1_2);
    case Act::GeluTanh: // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): no cancellation for negative x
        return x * sigmoid_scalar(2.f * kSqrt2OverPi * (x + kGeluTanhC * x * x * x));
    case Act::Silu:
        return x * sigmoid_scalar(x);
    }
    return x;
}

inline float act_grad_scalar(Act a, float p) {
    switch (a) {
    case Act::None:
        return 1.f;
    case Act::Relu:
        return p > 0.f ? 1.f : 0.f;
    case Act::Gelu:
        return 0.5f * std::erfc(-p * kSqrt1_2) + p * std::exp(-0.5f * p * p) * kInvSqrt2Pi;
    case Act::GeluTanh: {
        float oms;
        const float s = sigmoid_scalar(2.f * kSqrt2OverPi * (p + kGeluTanhC * p * p * p), &oms);
        return s + 2.f * p * s * oms * kSqrt2OverPi * (1.f + 3.f * kGeluTanhC * p * p);
    }
    case Act::Silu: {
        float oms;
        const float s = sigmoid_scalar(p, &oms);
        return s * (1.f + p * oms);
    }
    }
    return 1.f;
}

void epilogue_scalar(const Epilogue &e, const float *acc, int64_t ld_acc, int64_t row0, int64_t rows, int64_t col0,
                     int64_t cols) {
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t r = row0 + i;
        for (int64_t j = 0; j < cols; ++j) {
            const int64_t c = col0 + j;
            float v = acc[i * ld_acc + j];
            if (e.bias)
                v += e.bias[c];
            if (e.pre)
                store_scalar(e.pre, e.out_dtype, r * e.ld_pre + c, v);
            v = act_scalar(e.act, v);
            if (e.res)
                v += load_scalar(e.res, e.res_dtype, r * e.ld_res + c);
            store_scalar(e.out, e.out_dtype, r * e.ld_out + c, v);
        }
    }
}

void dpre_pass_scalar(const DpreArgs &a, int64_t row0, int64_t row1, int64_t col0, int64_t col1, float *partial,
                      int64_t ld_partial) {
    for (int64_t r0 = row0; r0 < row1; r0 += kDpreRows) {
        float *part = partial ? partial + (r0 / kDpreRows) * ld_partial : nullptr;
        if (part)
            std::fill(part + col0, part + col1, 0.f);
        for (int64_t r = r0; r < std::min(row1, r0 + kDpreRows); ++r)
            for (int64_t c = col0; c < col1; ++c) {
                float d = load_scalar(a.g, a.g_dtype, r * a.ld_g + c);
                if (a.act != Act::None)
                    d *= act_grad_scalar(a.act, load_scalar(a.p, a.p_dtype, r * a.ld_p + c));
                if (part)
                    part[c] += d;
                if (a.dpre)
                    store_scalar(a.dpre, a.dpre_dtype, r * a.ld_dpre + c,
                                 a.dpre_round_bf16 ? bf16_to_f32(f32_to_bf16(d)) : d);
            }
    }
}

} // namespace

void dpre_sum_blocks(const float *partial, int64_t ld_partial, int64_t blocks, int64_t col0, int64_t col1,
                     float *grad_bias) {
    for (int64_t c = col0; c < col1; ++c)
        grad_bias[c] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) // block order: the same sum for any split of the pass
        for (int64_t c = col0; c < col1; ++c)
            grad_bias[c] += partial[b * ld_partial + c];
}

#if !(defined(__x86_64__) || defined(_M_X64))
// No SIMD family outside x86 (fused_linear_avx512.cpp and fused_linear_avx2.cpp define these on x86).
const Kernels *kernels_avx512_bf16() {
    return nullptr;
}
const Kernels *kernels_avx512() {
    return nullptr;
}
const Kernels *kernels_avx2() {
    return nullptr;
}
#endif

namespace {
Kernels make_scalar() {
    Kernels t;
    t.name = "scalar";
    t.epilogue = epilogue_scalar;
    t.dpre_pass = dpre_pass_scalar;
    return t;
}
} // namespace

const Kernels *kernels_scalar() {
    return cached_table<make_scalar>();
}

} // namespace fused_linear
} // namespace fastdl
