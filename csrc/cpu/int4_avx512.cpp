// AVX-512 family of the int4 capability: the streaming kernel of int4_stream.h over 512-bit vectors (one 16-byte
// load -> two vectors of 16 weights). No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#define I4_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

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
    // W4A8: 256-bit vpdpbusd (AVX512-VNNI + VL), u (0..15, unsigned) x q_x (signed), 4 products per lane, exact
    using I = __m256i;
    static I4_SIMD inline I codes_u8(const uint8_t *p) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        const __m128i m = _mm_set1_epi8(0x0F);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
    }
    static I4_SIMD inline I dot(I acc, I u, const int8_t *x) {
        return _mm256_dpbusd_epi32(acc, u, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x)));
    }
    static I4_SIMD inline I izero() { return _mm256_setzero_si256(); }
    static I4_SIMD inline F abs(F v) { return _mm512_abs_ps(v); }
    static I4_SIMD inline F max(F a, F b) { return _mm512_max_ps(a, b); }
    static I4_SIMD inline float hmax(F v) { return _mm512_reduce_max_ps(v); }
    static I4_SIMD inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static I4_SIMD inline F roundc(F v) {
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    static I4_SIMD inline void store_q(int8_t *dst, F v, int) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
};

#include "int4_stream.h"

} // namespace

const Kernels *kernels_avx512() {
    static const Kernels k{"avx512_vnni", &i4_stream<Avx512Traits>, &i4a8_quantize<Avx512Traits>, &i4a8<Avx512Traits>};
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
