// What the AVX2 and AVX-512 traits of the int4 kernels share (int4_stream.h's W4A8 part runs 256-bit integer code in
// both): included by each family's file after it defines I4_SIMD, and inherited by its traits.
#pragma once

#include <immintrin.h>

#include <cstdint>

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
};
