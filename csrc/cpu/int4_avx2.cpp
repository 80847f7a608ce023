// AVX2 + FMA + F16C family of the int4 capability: the streaming kernel of int4_stream.h over 256-bit vectors.
// No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#define I4_SIMD __attribute__((target("avx2,fma,f16c")))

namespace fastdl {
namespace int4 {
namespace {

// 16 packed bytes -> 32 values u - z: low nibbles are k 0..15, high nibbles k 16..31 (int4_kernels.h); the byte
// subtraction is exact (|u - z| <= 15), then 8 bytes at a time are sign-extended and converted (exact).
struct Avx2Traits {
    using F = __m256;
    using Z = __m128i;
    static constexpr int kLanes = 8;
    static I4_SIMD inline Z zp(int z) { return _mm_set1_epi8(static_cast<char>(z)); }
    static I4_SIMD inline void codes(const uint8_t *p, Z z, F (&w)[4]) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        const __m128i m = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m), z);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), z);
        w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    }
    static I4_SIMD inline F zero() { return _mm256_setzero_ps(); }
    static I4_SIMD inline F set1(float v) { return _mm256_set1_ps(v); }
    static I4_SIMD inline F loadx(const float *p) { return _mm256_loadu_ps(p); }
    static I4_SIMD inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static I4_SIMD inline F add(F a, F b) { return _mm256_add_ps(a, b); }
    static I4_SIMD inline float hsum(F v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static I4_SIMD inline float half(uint16_t h) { return _cvtsh_ss(h); }
};

#include "int4_stream.h"

I4_SIMD void stream_avx2(const Int4Args &a, int64_t n0, int64_t n1) {
    i4_stream<Avx2Traits>(a, n0, n1);
}

} // namespace

const Kernels *kernels_avx2() {
    static const Kernels k{"avx2", &stream_avx2};
    return &k;
}

} // namespace int4
} // namespace fastdl

#else

namespace fastdl {
namespace int4 {
const Kernels *kernels_avx2() {
    return nullptr;
}
} // namespace int4
} // namespace fastdl

#endif
