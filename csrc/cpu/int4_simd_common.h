// What the AVX2 and AVX-512 traits of the int4 kernels share: I4Common256 (int4_stream.h's W4A8 part runs 256-bit
// integer code in both) and I4Float (the fp32 operations written once over the vector type). Included by each
// family's file after it defines I4_SIMD, and inherited by its traits. In an unnamed namespace: each translation unit
// compiles these for its own target, so no copy may stand for another unit's (as an inline function of one name would).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// The fp32 vector operations that need no intrinsic, written once over the vector type V::F (Ymm: __m256, Zmm:
// __m512; a tag, as a vector type given as a template argument would lose its may_alias attribute): these are GCC
// vector types, whose + and * are what _mm256_add_ps / _mm512_add_ps and the _mul_ps are defined as, {} is setzero,
// and a memcpy of one vector is the unaligned load / store (vmovups) of loadu / storeu.
struct Ymm {
    using F = __m256;
};
struct Zmm {
    using F = __m512;
};
template <class V> struct I4Float {
    using F = typename V::F;
    static constexpr int kLanes = sizeof(F) / sizeof(float);
    static I4_SIMD inline F zero() { return F{}; }
    static I4_SIMD inline F add(F a, F b) { return a + b; }
    static I4_SIMD inline F mul(F a, F b) { return a * b; }
    static I4_SIMD inline F loadx(const float *p) {
        F v;
        std::memcpy(&v, p, sizeof(F));
        return v;
    }
    static I4_SIMD inline void store(float *p, F v) { std::memcpy(p, &v, sizeof(F)); }
};

struct I4Common256 {
    using I = __m256i;
    // 16 packed bytes -> the 32 codes u (unsigned bytes) in k order: low nibbles (k 0..15), then high (k 16..31)
    static I4_SIMD inline I codes_u8(const uint8_t *p) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        const __m128i m = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    }
    static I4_SIMD inline I izero() { return _mm256_setzero_si256(); }
    static I4_SIMD inline float half(uint16_t h) { return _cvtsh_ss(h); }
    static I4_SIMD inline void half8(const uint16_t *p, float *dst) {
        _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))));
    }
    static I4_SIMD inline void times_u8(const float *a, const uint8_t *b, float *dst) {
        const __m256 bf =
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(b))));
        _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_loadu_ps(a), bf));
    }
};

} // namespace
