// AVX-512 family of the int4 capability: the streaming kernel of int4_stream.h over 512-bit vectors (one 16-byte
// load -> two vectors of 16 weights). No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <memory>

#define I4_SIMD __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")))

#include "int4_simd_common.h"

namespace fastdl {
namespace int4 {
namespace {

// 16 packed bytes -> 32 values u - z with one table lookup per 16 weights: the bytes widened to 32-bit lanes
// (vpmovzxbd), then vpermps picks table[u] = u - z from a 16-float register, reading only the low 4 bits of each lane
// (the low nibble as it is, the high one after a 4-bit shift). 4 zmm instructions per 32 weights instead of 4 zmm
// (sign-extend + convert) and 6 xmm (mask, shift, subtract): the float kernel at M = 1 is bound by this step.
struct Avx512Traits : I4Common256, I4Float<Zmm> {
    using Z = __m512; // the table u -> u - z (exact small integers)
    static I4_SIMD inline Z zp(int z) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        return _mm512_sub_ps(iota, _mm512_set1_ps(static_cast<float>(z)));
    }
    static I4_SIMD inline void codes(const uint8_t *p, Z table, F (&w)[2]) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        w[0] = _mm512_permutexvar_ps(v, table);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
    }
    static I4_SIMD inline F set1(float v) { return _mm512_set1_ps(v); }
    static constexpr int kTileM = 4, kTileN = 6; // i4_tiles' register tile (24 accumulators)
    static I4_SIMD inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static I4_SIMD inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
    // W4A8: 256-bit vpdpbusd (AVX512-VNNI + VL), u (0..15, unsigned) x q_x (signed), 4 products per lane, exact
    static I4_SIMD inline I dot(I acc, I u, const int8_t *x) {
        return _mm256_dpbusd_epi32(acc, u, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x)));
    }
    static I4_SIMD inline F abs(F v) { return _mm512_abs_ps(v); }
    static I4_SIMD inline F max(F a, F b) { return _mm512_max_ps(a, b); }
    static I4_SIMD inline float hmax(F v) { return _mm512_reduce_max_ps(v); }
    static I4_SIMD inline F roundc(F v) {
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    static I4_SIMD inline void store_q(int8_t *dst, F v, int) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
    }
};

#include "int4_stream.h"

// Weight rows [n0, n1) into bf16 for int4.cpp's bf16 route: each 32 codes become two fp32 vectors (u - z) * s (exact)
// and one vcvtne2ps2bf16 (round to nearest even). Compiled for AVX512_BF16 as well: the route runs only where
// fused_linear's family has it (has_bf16_dot).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c"))) void
dequant_rows_bf16(const Int4Args &a, int64_t n0, int64_t n1, uint16_t *dst) {
    const int64_t groups = a.K / a.group, blocks = a.group / 32;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *q = a.q + n * (a.K / 2);
        const uint16_t *s = a.scales + n * groups;
        const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
        uint16_t *d = dst + (n - n0) * a.K;
        for (int64_t g = 0; g < groups; ++g) {
            const auto table = Avx512Traits::zp(zr ? zr[g] : 8);
            const __m512 sv = _mm512_set1_ps(Avx512Traits::half(s[g]));
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t k = (g * blocks + b) * 32;
                __m512 w[2];
                Avx512Traits::codes(q + k / 2, table, w);
                const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_mul_ps(w[1], sv), _mm512_mul_ps(w[0], sv));
                _mm512_storeu_si512(d + k, reinterpret_cast<const __m512i &>(r));
            }
        }
    }
}

} // namespace

// Route (thread CPU time, one Zen 4 core, 4096 x 4096, groups of 128, fp32 x, ms): stream / tiles at M = 1 1.40 /
// 2.13, 2 1.94 / 2.31, 3 3.07 / 2.77, 4 3.68 / 2.76; tiles / fgemm at M = 8 4.39 / 13.6, 16 7.31 / 16.5, 128 42.1 /
// 51.0, 512 179 / 246, 1024 362 / 417. Tiles from 3 rows, at every M.
const Kernels *kernels_avx512() {
    static const Kernels k{"avx512_vnni",       &i4_stream<Avx512Traits>, &i4a8_quantize<Avx512Traits>,
                           &i4a8<Avx512Traits>, &i4_tiles<Avx512Traits>,  2,
                           INT64_MAX,           &dequant_rows_bf16};
    return &k;
}

} // namespace int4
} // namespace fastdl

#endif
