// AVX-512 family of the int4 capability: the streaming kernel of int4_stream.h over 512-bit vectors (one 16-byte
// load -> two vectors of 16 weights). No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#define I4_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))

namespace fastdl {
namespace int4 {
namespace {

struct Avx512Traits {
    using F = __m512;
    using Z = __m128i;
    static constexpr int kLanes = 16;
    static I4_SIMD inline Z zp(int z) { return _mm_set1_epi8(static_cast<char>(z)); }
    static I4_SIMD inline void codes(const uint8_t *p, Z z, F (&w)[2]) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        const __m128i m = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m), z);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m), z);
        w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
        w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
    }
    static I4_SIMD inline F zero() { return _mm512_setzero_ps(); }
    static I4_SIMD inline F set1(float v) { return _mm512_set1_ps(v); }
    static I4_SIMD inline F loadx(const float *p) { return _mm512_loadu_ps(p); }
    static I4_SIMD inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static I4_SIMD inline F add(F a, F b) { return _mm512_add_ps(a, b); }
    static I4_SIMD inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
    static I4_SIMD inline float half(uint16_t h) { return _cvtsh_ss(h); }
};

#include "int4_stream.h"

I4_SIMD void stream_avx512(const Int4Args &a, int64_t n0, int64_t n1) {
    i4_stream<Avx512Traits>(a, n0, n1);
}

} // namespace

const Kernels *kernels_avx512() {
    static const Kernels k{"avx512", &stream_avx512};
    return &k;
}

} // namespace int4
} // namespace fastdl

#else

namespace fastdl {
namespace int4 {
const Kernels *kernels_avx512() {
    return nullptr;
}
} // namespace int4
} // namespace fastdl

#endif
