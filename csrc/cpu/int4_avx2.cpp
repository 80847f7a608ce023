// AVX2 + FMA + F16C family of the int4 capability: the streaming kernel of int4_stream.h over 256-bit vectors.
// No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <memory>

#define I4_SIMD __attribute__((target("avx2,fma,f16c")))

#include "int4_simd_common.h"

namespace fastdl {
namespace int4 {
namespace {

// 16 packed bytes -> 32 values u - z: low nibbles are k 0..15, high nibbles k 16..31 (int4_kernels.h); the byte
// subtraction is exact (|u - z| <= 15), then 8 bytes at a time are sign-extended and converted (exact).
struct Avx2Traits : I4Common256, I4Float<Ymm> {
    using Z = __m128i;
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
    static I4_SIMD inline F set1(float v) { return _mm256_set1_ps(v); }
    static constexpr int stream_cols(int) { return 1; } // 16 registers: one weight row at a time (int4_stream.h)
    static constexpr int kTileM = 3, kTileN = 3;        // i4_tiles' register tile (9 accumulators)
    static I4_SIMD inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    // the 8 lanes reduced by op (add or max), halving the width three times
    template <class Op> static I4_SIMD inline float reduce(F v, Op op) {
        __m128 r = op(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        r = op(r, _mm_movehl_ps(r, r));
        return _mm_cvtss_f32(op(r, _mm_movehdup_ps(r)));
    }
    static I4_SIMD inline float hsum(F v) {
        return reduce(v, [](__m128 a, __m128 b) I4_SIMD { return _mm_add_ps(a, b); });
    }
    // W4A8
    // vpmaddubsw: u (0..15) x q_x (-127..127), pair sums <= 3810 (no saturation); vpmaddwd with ones: 4 per lane
    static I4_SIMD inline I dot(I acc, I u, const int8_t *x) {
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x)));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
    static I4_SIMD inline F abs(F v) { return _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
    static I4_SIMD inline F max(F a, F b) { return _mm256_max_ps(a, b); }
    static I4_SIMD inline float hmax(F v) {
        return reduce(v, [](__m128 a, __m128 b) I4_SIMD { return _mm_max_ps(a, b); });
    }
    static I4_SIMD inline F roundc(F v) {
        v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
        return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    static I4_SIMD inline void store_q(int8_t *dst, F v, int) {
        const __m256i i = _mm256_cvtps_epi32(v);
        const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i *>(dst), _mm_packs_epi16(h, h));
    }
};

#include "int4_stream.h"

} // namespace

// Route (thread CPU time, one Zen 4 core capped at AVX2, 4096 x 4096, groups of 128, fp32 x, ms): stream / tiles at
// M = 3 3.26 / 4.68, 4 3.80 / 6.06; tiles / fgemm at M = 8 5.29 / 17.1, 16 14.0 / 20.1, 32 15.3 / 25.8, 64 37.4 /
// 37.2, 128 97.6 / 51.9, 512 293 / 230 (the 3 x 3 register tile of 16 registers loads 6 vectors per 9 FMAs; fgemm's
// packed panels reuse each load). Stream up to 4 rows, tiles up to 64, fgemm above.
const Kernels *kernels_avx2() {
    static const Kernels k{
        "avx2", &i4_stream<Avx2Traits>, &i4a8_quantize<Avx2Traits>, &i4a8<Avx2Traits>, &i4_tiles<Avx2Traits>, 4, 64};
    return &k;
}

} // namespace int4
} // namespace fastdl

#endif
