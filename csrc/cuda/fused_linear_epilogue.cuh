// Device-side helpers for the fused linear op (fastdl_cpp::fused_linear / fused_linear_backward):
// storage types, fp32 conversions, vectorised loads/stores and the activation functions with their derivatives.
// Header-only, no torch includes; everything lives in namespace fastdl::fused_linear.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "activation.h" // fastdl::Act

namespace fastdl::fused_linear {

// 16-bit storage types carried as raw bits: no dependence on the __CUDA_NO_*_CONVERSIONS__ macros torch sets.
struct bf16_t {
    uint16_t bits;
};
struct f16_t {
    uint16_t bits;
};
static_assert(sizeof(bf16_t) == 2 && sizeof(f16_t) == 2, "16-bit storage types must be 2 bytes");

__device__ __forceinline__ float to_float(float v) {
    return v;
}
__device__ __forceinline__ float to_float(bf16_t v) {
    return __uint_as_float(static_cast<uint32_t>(v.bits) << 16);
}
__device__ __forceinline__ float to_float(f16_t v) {
    return __half2float(__ushort_as_half(v.bits));
}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) {
    return v;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float v) {
    return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
}
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float v) {
    return f16_t{__half_as_ushort(__float2half_rn(v))};
}

// Raw 32-bit word <-> element helpers (little endian; 16-bit element j sits in bits 16*(j&1) of word j/2).
template <typename T> __device__ __forceinline__ float word_elem(const uint32_t *w, int j) {
    if constexpr (sizeof(T) == 4) {
        return __uint_as_float(w[j]);
    } else {
        return to_float(T{static_cast<uint16_t>((w[j >> 1] >> ((j & 1) * 16)) & 0xffffu)});
    }
}
template <typename T> __device__ __forceinline__ uint32_t elem_bits(float v) {
    if constexpr (sizeof(T) == 4) {
        return __float_as_uint(v);
    } else {
        return static_cast<uint32_t>(from_float<T>(v).bits);
    }
}

// Byte alignment a pointer must have for a V-element vector access of T (16-byte accesses at most).
template <typename T, int V> constexpr int vec_align() {
    return static_cast<int>(sizeof(T)) * V >= 16 ? 16 : static_cast<int>(sizeof(T)) * V;
}

// Load V consecutive elements of T starting at p (aligned to vec_align<T, V>()) as fp32.
template <typename T, int V> __device__ __forceinline__ void load_vec(const T *p, float (&out)[V]) {
    constexpr int BYTES = static_cast<int>(sizeof(T)) * V;
    if constexpr (BYTES >= 16) {
        static_assert(BYTES % 16 == 0, "vector size must be a multiple of 16 bytes");
        constexpr int NQ = BYTES / 16;
        uint32_t w[NQ * 4];
        const uint4 *q = reinterpret_cast<const uint4 *>(p);
#pragma unroll
        for (int i = 0; i < NQ; ++i) {
            const uint4 t = q[i];
            w[4 * i + 0] = t.x;
            w[4 * i + 1] = t.y;
            w[4 * i + 2] = t.z;
            w[4 * i + 3] = t.w;
        }
#pragma unroll
        for (int j = 0; j < V; ++j)
            out[j] = word_elem<T>(w, j);
    } else if constexpr (BYTES == 8) {
        const uint2 t = *reinterpret_cast<const uint2 *>(p);
        const uint32_t w[2] = {t.x, t.y};
#pragma unroll
        for (int j = 0; j < V; ++j)
            out[j] = word_elem<T>(w, j);
    } else if constexpr (BYTES == 4) {
        const uint32_t w[1] = {*reinterpret_cast<const uint32_t *>(p)};
#pragma unroll
        for (int j = 0; j < V; ++j)
            out[j] = word_elem<T>(w, j);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
            out[j] = to_float(p[j]);
    }
}

// Store V fp32 values, rounded to T (round to nearest even), at p (aligned to vec_align<T, V>()).
template <typename T, int V> __device__ __forceinline__ void store_vec(T *p, const float (&v)[V]) {
    constexpr int BYTES = static_cast<int>(sizeof(T)) * V;
    if constexpr (BYTES >= 16) {
        static_assert(BYTES % 16 == 0, "vector size must be a multiple of 16 bytes");
        constexpr int NW = BYTES / 4;
        uint32_t w[NW];
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int j = 0; j < V; ++j)
                w[j] = elem_bits<T>(v[j]);
        } else {
#pragma unroll
            for (int i = 0; i < NW; ++i)
                w[i] = elem_bits<T>(v[2 * i]) | (elem_bits<T>(v[2 * i + 1]) << 16);
        }
        uint4 *q = reinterpret_cast<uint4 *>(p);
#pragma unroll
        for (int i = 0; i < NW / 4; ++i)
            q[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j)
            p[j] = from_float<T>(v[j]);
    }
}

constexpr float kSqrt2OverPi = 0.7978845608028654f; // sqrt(2/pi)
constexpr float kInvSqrt2 = 0.7071067811865476f;    // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1/sqrt(2*pi)
constexpr float kGeluCoeff = 0.044715f;

// Activation evaluated in fp32 (full-precision libdevice functions; no fast-math intrinsics).
template <int ACT> __device__ __forceinline__ float act_fwd(float p) {
    if constexpr (ACT == static_cast<int>(Act::Relu)) {
        return p <= 0.f ? 0.f : p; // NaN propagates like torch.relu
    } else if constexpr (ACT == static_cast<int>(Act::Gelu)) {
        return 0.5f * p * (1.f + erff(p * kInvSqrt2));
    } else if constexpr (ACT == static_cast<int>(Act::GeluTanh)) {
        const float u = kSqrt2OverPi * (p + kGeluCoeff * p * p * p);
        return 0.5f * p * (1.f + tanhf(u));
    } else if constexpr (ACT == static_cast<int>(Act::Silu)) {
        return p / (1.f + expf(-p));
    } else {
        return p;
    }
}

// d act / d p evaluated in fp32.
template <int ACT> __device__ __forceinline__ float act_grad(float p) {
    if constexpr (ACT == static_cast<int>(Act::Relu)) {
        return p > 0.f ? 1.f : 0.f;
    } else if constexpr (ACT == static_cast<int>(Act::Gelu)) {
        return 0.5f * (1.f + erff(p * kInvSqrt2)) + p * expf(-0.5f * p * p) * kInvSqrt2Pi;
    } else if constexpr (ACT == static_cast<int>(Act::GeluTanh)) {
        const float p2 = p * p;
        const float t = tanhf(kSqrt2OverPi * (p + kGeluCoeff * p2 * p));
        return 0.5f * (1.f + t) + 0.5f * p * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * p2);
    } else if constexpr (ACT == static_cast<int>(Act::Silu)) {
        const float s = 1.f / (1.f + expf(-p));
        return s * (1.f + p * (1.f - s));
    } else {
        return 1.f;
    }
}

} // namespace fastdl::fused_linear
