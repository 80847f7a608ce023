// AVX-512 kernels of the fused linear layer (two families, see kernels_avx512 / kernels_avx512_bf16 at the end):
// epilogue, backward elementwise pass, fp32 FMA kernels (AVX-512 F) and the bf16 GEMM / small-M kernels (vdpbf16ps,
// AVX512_BF16). This translation unit includes no torch headers and is compiled with the generic project flags;
// AVX-512 code is enabled per function with target attributes, and its table is only chosen (fused_linear.cpp) when
// cpu_isa.h reports the level.
#include "fused_linear_kernels.h"

#include "cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define FL_X86 1
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#else
#define FL_X86 0
#endif

namespace fastdl {
namespace fused_linear {

namespace {
// Number of k pairs per packed A panel, rounded up to whole 16 x 16 transposes.
inline int64_t packed_kp(int64_t K) {
    return ((K + 1) / 2 + 15) / 16 * 16;
}
} // namespace

#if FL_X86
// ============================================================================================================
// AVX-512 helpers
// ============================================================================================================
#define FL_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#define FL_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512bf16")))
#define FL_INLINE inline __attribute__((always_inline))

namespace {
FL_AVX512 FL_INLINE __mmask16 mask16(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u);
}
FL_AVX512 FL_INLINE __mmask32 mask32(int64_t n) {
    return n >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : n <= 0 ? 0 : static_cast<__mmask32>((1u << n) - 1u);
}

FL_AVX512 FL_INLINE __m512 v_load(const void *p, DType dt, int64_t i, __mmask16 m) {
    if (dt == DType::F32)
        return _mm512_maskz_loadu_ps(m, static_cast<const float *>(p) + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t *>(p) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(m, h), 16));
}

// fp32 -> bf16 round-to-nearest-even with NaN -> 0x7FC0, bit-identical to the scalar f32_to_bf16 (vcvtneps2bf16
// would flush denormals, so the integer form is used for outputs).
FL_AVX512 FL_INLINE __m256i v_to_bf16(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

FL_AVX512 FL_INLINE void v_store(void *p, DType dt, int64_t i, __m512 v, __mmask16 m) {
    if (dt == DType::F32)
        _mm512_mask_storeu_ps(static_cast<float *>(p) + i, m, v);
    else
        _mm256_mask_storeu_epi16(static_cast<uint16_t *>(p) + i, m, v_to_bf16(v));
}

// ------------------------------------------------------------------------------------------------------------
// The vector traits of this level (fused_linear_simd.h, fused_linear_epilogue.h): 16 fp32 lanes and their mask
// registers. Its own parts of the vector math (the activations dominate the epilogue and the backward pass, and for a
// short K the whole layer: M = 4096, K = 64, N = 512 gelu), accurate to ~1e-6 relative, fitted for these kernels (see
// also fused_linear_avx2.cpp): erfc's Q of degree 7 (5.8e-7) for gelu, 1 / d as vrcp14ps + one Newton step instead of
// vdivps, exp's 2^n applied with vscalefps. Cycles per 16 elements on one core (Zen 4): gelu 36 -> 29 (silu 18,
// gelu_tanh 23: unchanged within noise).
// ------------------------------------------------------------------------------------------------------------
#define FL_SIMD FL_AVX512
#include "fused_linear_simd.h"

struct Avx512Vec {
    using Vec = __m512;
    using Mask = __mmask16;
    static constexpr int kLanes = 16;
    static constexpr uintptr_t kStreamAlign = 64;
    static FL_AVX512 FL_INLINE Mask mask(int64_t n) { return mask16(n); }
    static FL_AVX512 FL_INLINE bool full(Mask m) { return m == 0xFFFF; }
    static FL_AVX512 FL_INLINE Vec loadf(const float *p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
    static FL_AVX512 FL_INLINE void storef(float *p, Vec v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
    static FL_AVX512 FL_INLINE Vec load(const void *p, DType dt, int64_t i, Mask m) { return v_load(p, dt, i, m); }
    static FL_AVX512 FL_INLINE void store(void *p, DType dt, int64_t i, Vec v, Mask m) { v_store(p, dt, i, v, m); }
    static FL_AVX512 FL_INLINE Vec round_bf16(Vec v) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v_to_bf16(v)), 16));
    }
    static FL_AVX512 FL_INLINE void stream(float *p, Vec v) { _mm512_stream_ps(p, v); }
    static FL_AVX512 FL_INLINE void fence() { _mm_sfence(); }
    static FL_AVX512 FL_INLINE void zero(float *p, int64_t n) {
        for (int64_t j = 0; j < n; j += 16)
            _mm512_mask_storeu_ps(p + j, mask16(n - j), _mm512_setzero_ps());
    }
    static FL_AVX512 FL_INLINE Vec set1(float f) { return _mm512_set1_ps(f); }
    static FL_AVX512 FL_INLINE Vec setzero() { return _mm512_setzero_ps(); }
    static FL_AVX512 FL_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
    static FL_AVX512 FL_INLINE Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
    static FL_AVX512 FL_INLINE Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
    static FL_AVX512 FL_INLINE Vec round(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
    static FL_AVX512 FL_INLINE Vec neg_abs(Vec v) { return _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)); }
    static FL_AVX512 FL_INLINE Vec blend_neg(Vec z, Vec a, Vec b) {
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), a, b);
    }
    static FL_AVX512 FL_INLINE Vec pos_mask(Vec p, Vec v) {
        return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_GT_OQ), v);
    }
    static FL_AVX512 FL_INLINE Vec rcp_approx(Vec d) { return _mm512_rcp14_ps(d); } // vrcp14ps: 14 bits
    // exp(x) (exp_poly) for x clamped to [-104, 88], 2^n applied with vscalefps (NaN kept: vmaxps / vminps return the
    // second operand when one is NaN).
    static FL_AVX512 FL_INLINE Vec exp_neg(Vec x) {
        __m512 n;
        const __m512 p =
            exp_poly<Avx512Vec>(_mm512_min_ps(_mm512_set1_ps(88.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x)), n);
        return _mm512_scalef_ps(p, n);
    }
    // Phi(x) = 0.5 erfc(-x / sqrt2) and exp(-x^2 / 2): with a = |x| / sqrt2, erfc(a) = t exp(-a^2) Q(t),
    // t = 1 / (1 + 0.4 a), Q of degree 7 (0.5 Q is evaluated: its coefficients halved); the relative accuracy holds in
    // the tails. Beyond |x| = 14.5 both results are 0 in fp32 and are set to 0 (NaN is kept).
    static FL_AVX512 FL_INLINE Vec phi(Vec x, Vec &gauss) {
        const __m512 ax = _mm512_min_ps(_mm512_set1_ps(14.5f), _mm512_abs_ps(x));
        const __m512 t = rcp<Avx512Vec>(_mm512_fmadd_ps(ax, _mm512_set1_ps(0.4f * kSqrt1_2), _mm512_set1_ps(1.f)));
        __m512 e = exp_neg(_mm512_mul_ps(ax, _mm512_mul_ps(ax, _mm512_set1_ps(-0.5f))));
        e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(ax, _mm512_set1_ps(14.5f), _CMP_LT_OQ), e);
        gauss = e;
        __m512 q = _mm512_set1_ps(0.5f * 0.05051371082663536f);
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * -0.2890283167362213f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.48907604813575745f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * -0.17893093824386597f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.29553842544555664f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.1778354048728943f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.22952547669410706f));
        q = _mm512_fmadd_ps(q, t, _mm512_set1_ps(0.5f * 0.22546973824501038f));
        const __m512 half_erfc = _mm512_mul_ps(_mm512_mul_ps(t, e), q);
        const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_mask_blend_ps(neg, _mm512_sub_ps(_mm512_set1_ps(1.f), half_erfc), half_erfc);
    }
    static FL_AVX512 FL_INLINE Vec gelu(Vec x) {
        __m512 gauss;
        return _mm512_mul_ps(x, phi(x, gauss));
    }
    static FL_AVX512 FL_INLINE Vec gelu_grad(Vec p) { // Phi(p) + p phi(p)
        __m512 gauss;
        const __m512 ph = phi(p, gauss);
        return _mm512_fmadd_ps(_mm512_mul_ps(p, gauss), _mm512_set1_ps(kInvSqrt2Pi), ph);
    }
    static FL_AVX512 FL_INLINE float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
    // The 16 x 16 dword transposes of the bf16 packing (fused_linear_simd.h's transpose over __m512i).
    static FL_AVX512 FL_INLINE __m512i unpacklo32(__m512i a, __m512i b) { return _mm512_unpacklo_epi32(a, b); }
    static FL_AVX512 FL_INLINE __m512i unpackhi32(__m512i a, __m512i b) { return _mm512_unpackhi_epi32(a, b); }
    static FL_AVX512 FL_INLINE __m512i unpacklo64(__m512i a, __m512i b) { return _mm512_unpacklo_epi64(a, b); }
    static FL_AVX512 FL_INLINE __m512i unpackhi64(__m512i a, __m512i b) { return _mm512_unpackhi_epi64(a, b); }
    static FL_AVX512 FL_INLINE void transpose_lanes(__m512i (&r)[16], __m512i (&t)[16]) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            t[q + 0] = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x88);
            t[q + 4] = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xdd);
            t[q + 8] = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x88);
            t[q + 12] = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xdd);
        }
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            r[q + 0] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0x88);
            r[q + 4] = _mm512_shuffle_i32x4(t[q + 4], t[q + 12], 0x88);
            r[q + 8] = _mm512_shuffle_i32x4(t[q], t[q + 8], 0xdd);
            r[q + 12] = _mm512_shuffle_i32x4(t[q + 4], t[q + 12], 0xdd);
        }
    }
};

#include "fused_linear_epilogue.h"
#undef FL_SIMD

// The AVX512_BF16 family is a level of its own: its kernels use fused_linear_simd.h compiled for it (a template
// compiled for AVX-512 F cannot inline their vdpbf16ps steps).
namespace bf16 {
#define FL_SIMD FL_AVX512BF16
#include "fused_linear_simd.h"
#undef FL_SIMD
} // namespace bf16

// ------------------------------------------------------------------------------------------------------------
// bf16 GEMM. Packed formats (one dword = two bf16 consecutive along the reduction dim, as vdpbf16ps pairs them):
//   A: panels of kGemmMR rows: ap[(panel * kpt + kp) * MR + r] = (A[i][2kp], A[i][2kp+1]), i = panel * MR + r
//   B: one panel of kGemmNR columns per K block: bp[kp * NR + j] = (B[2kp][j], B[2kp+1][j])
// Out-of-range rows / columns / k are packed as zeros, so the micro kernel never needs masks.
// ------------------------------------------------------------------------------------------------------------
// 16 dwords = 32 consecutive elements of a row (bf16, or fp32 rounded to bf16 with vcvtne2ps2bf16, the RNE
// rounding autocast uses), zero beyond `rem` valid elements.
FL_AVX512BF16 FL_INLINE __m512i load_pairs(const void *base, DType dt, int64_t off, int64_t rem) {
    if (rem <= 0)
        return _mm512_setzero_si512();
    if (dt == DType::BF16)
        return _mm512_maskz_loadu_epi16(mask32(rem), static_cast<const uint16_t *>(base) + off);
    const float *f = static_cast<const float *>(base) + off;
    const __m512 lo = _mm512_maskz_loadu_ps(mask16(rem), f);
    const __m512 hi = _mm512_maskz_loadu_ps(mask16(rem - 16), f + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// 16 consecutive elements of two rows interleaved: dword j = (r0[j], r1[j]); zero beyond `rem` columns.
FL_AVX512BF16 FL_INLINE __m512i interleave_rows(const void *r0, const void *r1, DType dt, int64_t rem) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                         5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __mmask16 m = mask16(rem);
    __m512i v;
    if (dt == DType::BF16) {
        const __m256i lo = _mm256_maskz_loadu_epi16(m, r0);
        const __m256i hi = r1 ? _mm256_maskz_loadu_epi16(m, r1) : _mm256_setzero_si256();
        v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
        const __m512 lo = _mm512_maskz_loadu_ps(m, r0);
        const __m512 hi = r1 ? _mm512_maskz_loadu_ps(m, r1) : _mm512_setzero_ps();
        v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    }
    return _mm512_permutexvar_epi16(idx, v);
}

// Packs B[k0 : k0 + kc][j0 : j0 + NR] into bp, B[k][j] = b[k * ld + j] (kc even unless the block ends at K):
// rows 2kp and 2kp + 1 interleaved, fp32 rounded to bf16 on the way.
FL_AVX512BF16 void pack_b(const GemmOperand &b, int64_t N, int64_t K, int64_t j0, int64_t k0, int64_t kc,
                          uint32_t *bp) {
    const int64_t kpn = (kc + 1) / 2;
    const int64_t k_end = std::min(K, k0 + kc);
    const size_t esz = b.dtype == DType::F32 ? 4 : 2;
    const char *base = static_cast<const char *>(b.ptr);
    for (int64_t kp = 0; kp < kpn; ++kp) {
        const int64_t k = k0 + 2 * kp;
        const char *r0 = base + (k * b.ld + j0) * esz;
        const char *r1 = k + 1 < k_end ? r0 + b.ld * esz : nullptr;
        for (int g = 0; g < kGemmNR / 16; ++g)
            _mm512_storeu_si512(
                bp + kp * kGemmNR + 16 * g,
                interleave_rows(r0 + 16 * g * esz, r1 ? r1 + 16 * g * esz : nullptr, b.dtype, N - j0 - 16 * g));
    }
}

// Micro kernel: c[MR][NR] (+)= sum_kp A-panel x B-panel. 24 zmm accumulators, 3 B vectors and one broadcast: each
// k pair costs 3 loads + 8 broadcasts for 24 vdpbf16ps, which keeps both FMA pipes busy (measured ~500 GFLOP/s per
// Zen 5 core with B in L1, ~97% of the vdpbf16ps peak).
FL_AVX512BF16 void micro_kernel(int64_t kpn, const uint32_t *ap, const uint32_t *bp, float *c, bool accumulate) {
    __m512 acc[kGemmMR][3];
#pragma GCC unroll 8
    for (int i = 0; i < kGemmMR; ++i)
#pragma GCC unroll 3
        for (int j = 0; j < 3; ++j)
            acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * kGemmNR + 16 * j) : _mm512_setzero_ps();
    for (int64_t kp = 0; kp < kpn; ++kp) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + kp * kGemmNR);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + kp * kGemmNR + 16);
        const __m512bh b2 = (__m512bh)_mm512_loadu_si512(bp + kp * kGemmNR + 32);
#pragma GCC unroll 8
        for (int i = 0; i < kGemmMR; ++i) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[kp * kGemmMR + i]));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, b1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], a, b2);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < kGemmMR; ++i)
#pragma GCC unroll 3
        for (int j = 0; j < 3; ++j)
            _mm512_storeu_ps(c + i * kGemmNR + 16 * j, acc[i][j]);
}

FL_AVX512BF16 void pack_a_avx512bf16(const GemmOperand &a, int64_t M, int64_t K, int64_t panel0, int64_t panel1,
                                     uint16_t *ap16) {
    uint32_t *ap = reinterpret_cast<uint32_t *>(ap16);
    const int64_t kpt = packed_kp(K);
    const uint16_t *src = static_cast<const uint16_t *>(a.ptr);
    if (a.trans) {
        // A[i][k] = a[k * lda + i]: interleave source rows 2kp, 2kp + 1 over 16 consecutive i. Blocks of 16 k pairs
        // (32 source rows) are walked row-wise over all the panels, so the source is read in memory order (walking
        // 359 rows per 16 columns ran at ~20 GB/s: M = 359, N = 512, K = 64 grad_weight 73 -> 42 us).
        for (int64_t kp0 = 0; kp0 < kpt; kp0 += 16)
            for (int64_t p = panel0; p < panel1; p += 2) {
                const bool two = p + 1 < panel1;
                const int64_t i0 = p * kGemmMR;
                const int64_t wi = std::min<int64_t>(M - i0, two ? 16 : kGemmMR);
                uint32_t *out0 = ap + p * kpt * kGemmMR;
                uint32_t *out1 = out0 + kpt * kGemmMR;
                for (int64_t kp = kp0; kp < kp0 + 16; ++kp) {
                    const int64_t k = 2 * kp;
                    __m512i v = _mm512_setzero_si512();
                    if (k < K)
                        v = interleave_rows(src + k * a.ld + i0, k + 1 < K ? src + (k + 1) * a.ld + i0 : nullptr,
                                            DType::BF16, wi);
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out0 + kp * kGemmMR), _mm512_castsi512_si256(v));
                    if (two)
                        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out1 + kp * kGemmMR),
                                            _mm512_extracti64x4_epi64(v, 1));
                }
            }
        return;
    }
    for (int64_t p = panel0; p < panel1; p += 2) { // two panels (16 rows) at a time
        const bool two = p + 1 < panel1;
        const int64_t i0 = p * kGemmMR;
        uint32_t *out0 = ap + p * kpt * kGemmMR;
        uint32_t *out1 = out0 + kpt * kGemmMR;
        { // A[i][k] = a[i * lda + k]: transpose 16 rows x 16 dwords
            for (int64_t kp0 = 0; kp0 < kpt; kp0 += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; ++i) {
                    const bool ok = i0 + i < M && (i < kGemmMR || two);
                    r[i] = ok ? load_pairs(src, DType::BF16, (i0 + i) * a.ld + 2 * kp0, K - 2 * kp0)
                              : _mm512_setzero_si512();
                }
                transpose<Avx512Vec>(r);
                for (int q = 0; q < 16; ++q) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i *>(out0 + (kp0 + q) * kGemmMR),
                                        _mm512_castsi512_si256(r[q]));
                    if (two)
                        _mm256_storeu_si256(reinterpret_cast<__m256i *>(out1 + (kp0 + q) * kGemmMR),
                                            _mm512_extracti64x4_epi64(r[q], 1));
                }
            }
        }
    }
}

FL_AVX512BF16 void gemm_tile_avx512bf16(const uint16_t *ap16, const GemmOperand &b, int64_t M, int64_t N, int64_t K,
                                        int64_t m0, int64_t j0, const Epilogue &epi, void *workspace) {
    const uint32_t *ap = reinterpret_cast<const uint32_t *>(ap16);
    uint32_t *bp = static_cast<uint32_t *>(workspace);
    float *cp = reinterpret_cast<float *>(bp + kGemmKC / 2 * kGemmNR);
    const int64_t rows = std::min<int64_t>(kGemmMC, M - m0);
    const int64_t panels = (rows + kGemmMR - 1) / kGemmMR;
    const int64_t kpt = packed_kp(K);
    if (K == 0)
        std::memset(cp, 0, sizeof(float) * panels * kGemmMR * kGemmNR);
    for (int64_t k0 = 0; k0 < K; k0 += kGemmKC) {
        const int64_t kc = std::min<int64_t>(kGemmKC, K - k0);
        pack_b(b, N, K, j0, k0, kc, bp);
        const int64_t kpn = (kc + 1) / 2;
        for (int64_t pi = 0; pi < panels; ++pi)
            micro_kernel(kpn, ap + ((m0 / kGemmMR + pi) * kpt + k0 / 2) * kGemmMR, bp, cp + pi * kGemmMR * kGemmNR,
                         k0 > 0);
    }
    simd_epilogue<Avx512Vec>(epi, cp, kGemmNR, m0, rows, j0, std::min<int64_t>(kGemmNR, N - j0));
}

// ------------------------------------------------------------------------------------------------------------
// Packed-B GEMM ("pb", see kernels.h): the B operand (a narrow layer's weight, or x) is packed per call (each thread
// its panels) into 48-column panels of k pairs, pb[(panel * kpt + kp) * 48 + j] = (B[2kp][j], B[2kp + 1][j]), and the
// micro kernel runs the whole reduction with 8 x 48 accumulators: per k pair 3 panel loads, 8 broadcast A dwords (read
// in place from A's rows when the reduction dim is contiguous there: no packing of x / dpre), 24 vdpbf16ps. The C tile
// goes through an L1 buffer to the epilogue; nothing else is written.
// ------------------------------------------------------------------------------------------------------------
// The 8 x (16 NV) fp32 C tile of the pb / pbf micro kernels: loaded from (or zeroed for) the L1 buffer c, stored back.
template <int NV> FL_AVX512 inline void c_tile_load(__m512 (&acc)[kGemmMR][NV], const float *c, bool accumulate) {
#pragma GCC unroll 8
    for (int i = 0; i < kGemmMR; ++i)
#pragma GCC unroll 3
        for (int j = 0; j < NV; ++j)
            acc[i][j] = accumulate ? _mm512_load_ps(c + i * kGemmNR + 16 * j) : _mm512_setzero_ps();
}

template <int NV> FL_AVX512 inline void c_tile_store(const __m512 (&acc)[kGemmMR][NV], float *c) {
#pragma GCC unroll 8
    for (int i = 0; i < kGemmMR; ++i)
#pragma GCC unroll 3
        for (int j = 0; j < NV; ++j)
            _mm512_store_ps(c + i * kGemmNR + 16 * j, acc[i][j]);
}

// A rows read in place: rows past `rows` repeat the last valid row (their results are not stored).
inline void a_row_ptrs(const char *(&ar)[kGemmMR], const char *a, int64_t rows, int64_t lda_bytes) {
#pragma GCC unroll 8
    for (int i = 0; i < kGemmMR; ++i)
        ar[i] = a + std::min<int64_t>(i, rows - 1) * lda_bytes;
}

// One k pair of an RW x (16 NV) bf16 tile: NV vectors of k pairs loaded at bk, then per row i the A pair pair_of(i)
// (two bf16 in a dword) broadcast against them.
template <int RW, int NV, typename PairOf>
FL_AVX512BF16 FL_INLINE void kpair_bf16(__m512 (&acc)[RW][NV], const uint32_t *bk, PairOf pair_of) {
    __m512bh b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
        b[j] = (__m512bh)_mm512_loadu_si512(bk + 16 * j);
#pragma GCC unroll 24
    for (int i = 0; i < RW; ++i) {
        const __m512bh av = (__m512bh)_mm512_set1_epi32(pair_of(i));
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j)
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av, b[j]);
    }
}

template <int NV, bool PACKED_A>
FL_AVX512BF16 void pb_micro(const char *a, int64_t lda_bytes, int64_t rows, int64_t kpn, bool odd, const uint32_t *bp,
                            float *c, bool accumulate) {
    __m512 acc[kGemmMR][NV];
    c_tile_load<NV>(acc, c, accumulate);
    const char *ar[kGemmMR];
    a_row_ptrs(ar, a, rows, lda_bytes);
    for (int64_t kp = 0; kp < kpn; ++kp) {
        kpair_bf16(acc, bp + kp * kGemmNR, [&](int i) {
            int32_t pair;
            if constexpr (PACKED_A)
                pair = reinterpret_cast<const int32_t *>(a)[kp * kGemmMR + i];
            else
                std::memcpy(&pair, ar[i] + 4 * kp, 4);
            return pair;
        });
    }
    if (!PACKED_A && odd) { // odd reduction length: the last element of each A row pairs with zero
        kpair_bf16(acc, bp + kpn * kGemmNR, [&](int i) {
            uint16_t last;
            std::memcpy(&last, ar[i] + 4 * kpn, 2);
            return static_cast<int32_t>(last);
        });
    }
    c_tile_store<NV>(acc, c);
}

// A = src^T (A[i][k] = a[k * lda + i], e.g. grad_weight's dpre^T), read without packing: per k pair the 8 values of
// source rows 2kp and 2kp + 1 (16 B each) are interleaved into 8 dwords on the stack and broadcast from there (2
// loads, 2 unpacks, 2 stores per 24 vdpbf16ps). Columns past `rows` are read as zeros.
template <int NV>
FL_AVX512BF16 void pb_micro_cols(const uint16_t *a, int64_t lda, int64_t rows, int64_t kpn, bool odd,
                                 const uint32_t *bp, float *c, bool accumulate) {
    __m512 acc[kGemmMR][NV];
    c_tile_load<NV>(acc, c, accumulate);
    const __mmask8 rm = static_cast<__mmask8>(rows >= 8 ? 0xFF : (1u << rows) - 1u);
    alignas(32) uint32_t pr[kGemmMR];
    for (int64_t kp = 0; kp < kpn + (odd ? 1 : 0); ++kp) {
        const uint16_t *r0 = a + 2 * kp * lda;
        const __m128i x0 = _mm_maskz_loadu_epi16(rm, r0);
        const __m128i x1 = kp < kpn ? _mm_maskz_loadu_epi16(rm, r0 + lda) : _mm_setzero_si128();
        _mm_store_si128(reinterpret_cast<__m128i *>(pr), _mm_unpacklo_epi16(x0, x1));
        _mm_store_si128(reinterpret_cast<__m128i *>(pr + 4), _mm_unpackhi_epi16(x0, x1));
        kpair_bf16(acc, bp + kp * kGemmNR, [&](int i) { return static_cast<int32_t>(pr[i]); });
    }
    c_tile_store<NV>(acc, c);
}

template <PbA AM>
FL_AVX512BF16 void pb_micro_nv(int64_t nv, const char *a, int64_t lda, int64_t rows, int64_t kpn, bool odd,
                               const uint32_t *bp, float *c, bool accumulate) {
    bf16::by_count<3>(nv, [&](auto NV) FL_AVX512BF16 {
        if constexpr (AM == PbA::Cols)
            pb_micro_cols<NV>(reinterpret_cast<const uint16_t *>(a), lda, rows, kpn, odd, bp, c, accumulate);
        else
            pb_micro<NV, AM == PbA::Packed>(a, lda * 2, rows, kpn, odd, bp, c, accumulate);
    });
}

// Reductions up to kPbKC k pairs run in one pass per 8 x 48 tile, into a kPbMB x 48 L1 buffer that goes through the
// epilogue every kPbMB rows. Longer ones (grad_weight: the reduction is the batch) are blocked: kPbKB pairs of the
// panel (24 KB) stay in L1 while the kPbMB rows of a sub-block accumulate in that buffer (M = 4096 grad_weight
// streamed its 400 KB panels from L3 per 8 rows: 11 % slower than the packed GEMM).
constexpr int64_t kPbKC = 256, kPbKB = 128, kPbMB = 64;

template <PbA AM>
FL_AVX512BF16 void pb_block_avx512bf16(const void *a, int64_t lda, int64_t K, const uint32_t *bpp, int64_t N,
                                       int64_t m0, int64_t m1, int64_t j0, const Epilogue &epi) {
    alignas(64) float cbuf[kPbMB * kGemmNR];
    const int64_t cols = std::min<int64_t>(kGemmNR, N - j0), nv = (cols + 15) / 16;
    const int64_t kpn = AM == PbA::Packed ? (K + 1) / 2 : K / 2;
    const bool odd = AM != PbA::Packed && (K & 1);
    Epilogue e = epi;
    e.fence = false;                         // streamed stores are fenced once below, not per tile
    auto a_at = [&](int64_t m, int64_t kp) { // A rows m.., from k pair kp on
        if constexpr (AM == PbA::Packed)
            return reinterpret_cast<const char *>(static_cast<const uint32_t *>(a) +
                                                  ((m / kGemmMR) * packed_kp(K) + kp) * kGemmMR);
        else if constexpr (AM == PbA::Cols)
            return reinterpret_cast<const char *>(static_cast<const uint16_t *>(a) + 2 * kp * lda + m);
        else
            return static_cast<const char *>(a) + m * lda * 2 + 4 * kp;
    };
    // One pass over K per 8 rows when K fits (kPbKC pairs), else kPbKB-pair blocks accumulated in cbuf; the epilogue
    // per kPbMB rows. (K == 0: one pass of zero length, which zeroes the C tile.)
    const int64_t kblk = kpn <= kPbKC ? std::max<int64_t>(kpn, 1) : kPbKB;
    for (int64_t ms = m0; ms < m1; ms += kPbMB) {
        const int64_t me = std::min(m1, ms + kPbMB);
        for (int64_t kb = 0; kb == 0 || kb < kpn; kb += kblk) {
            const int64_t kn = std::min(kblk, kpn - kb);
            for (int64_t m = ms; m < me; m += kGemmMR)
                pb_micro_nv<AM>(nv, a_at(m, kb), lda, std::min<int64_t>(kGemmMR, me - m), kn, odd && kb + kn == kpn,
                                bpp + kb * kGemmNR, cbuf + (m - ms) * kGemmNR, kb > 0);
        }
        simd_epilogue<Avx512Vec>(e, cbuf, kGemmNR, ms, me - ms, j0, cols);
    }
    if (epi.stream && epi.fence)
        _mm_sfence();
}

// 16 rows of 16 dwords transposed in registers and stored as 16 rows of 16 dwords, ld apart.
FL_AVX512 FL_INLINE void store_transposed(__m512i (&r)[16], void *out, int64_t ld) {
    transpose<Avx512Vec>(r);
    for (int q = 0; q < 16; ++q)
        _mm512_storeu_si512(static_cast<uint32_t *>(out) + q * ld, r[q]);
}

// B panels [panel0, panel1) from a weight (B[k][n] = w[n][k], [N, K] row-major), kpt dwords (k pairs, or k) per panel
// row, in blocks of 16 weight rows x 16 dwords: block(n0, d0, out) packs rows n0.. from dword d0 on into out.
template <class Block>
FL_INLINE void for_wt_blocks(int64_t kpt, int64_t panel0, int64_t panel1, uint32_t *bp, const Block &block) {
    for (int64_t p = panel0; p < panel1; ++p)
        for (int g = 0; g < kGemmNR / 16; ++g)
            for (int64_t d0 = 0; d0 < kpt; d0 += 16)
                block(p * kGemmNR + 16 * g, d0, bp + ((p - panel0) * kpt + d0) * kGemmNR + 16 * g);
}

// B[k][n] = w[n][k] (the forward's weight, [N, K] row-major): 16 weight rows x 16 k pairs transposed in registers.
FL_AVX512BF16 void pb_pack_wt_avx512bf16(const void *w, DType dt, int64_t ldw, int64_t N, int64_t K, int64_t panel0,
                                         int64_t panel1, uint32_t *bp) {
    const size_t esz = dt == DType::F32 ? 4 : 2;
    const char *base = static_cast<const char *>(w);
    for_wt_blocks(pb_kpt(K), panel0, panel1, bp, [&](int64_t n0, int64_t kp0, uint32_t *out) FL_AVX512BF16 {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) // k pairs: bf16, or fp32 rounded to bf16
            r[i] =
                n0 + i < N ? load_pairs(base + (n0 + i) * ldw * esz, dt, 2 * kp0, K - 2 * kp0) : _mm512_setzero_si512();
        store_transposed(r, out, kGemmNR);
    });
}

// fp32 variant (FMA, AVX-512 F): panels of single k, pb[(panel * kpt + k) * 48 + j] = B[k][j] (kpt = K rounded up
// to 16), 8 x 48 accumulators, per k 3 panel loads, 8 broadcast A floats, 24 FMAs. Packed A (grad_weight, whose A is
// dpre^T): panels of 8 rows, ap[(panel * K + k) * 8 + r] = A[8 panel + r][k] - each is a plain copy of 8 floats of a
// dpre row. MKL's sgemm ran at ~190 GFLOP/s on these narrow shapes on the dev machine (2 threads).
template <int NV, bool PACKED_A>
FL_AVX512 void pbf_micro(const char *a, int64_t lda_bytes, int64_t rows, int64_t kn, const float *bp, float *c,
                         bool accumulate) {
    __m512 acc[kGemmMR][NV];
    c_tile_load<NV>(acc, c, accumulate);
    const char *ar[kGemmMR];
    a_row_ptrs(ar, a, rows, lda_bytes);
    for (int64_t k = 0; k < kn; ++k) {
        __m512 b[NV];
#pragma GCC unroll 3
        for (int j = 0; j < NV; ++j)
            b[j] = _mm512_loadu_ps(bp + k * kGemmNR + 16 * j);
#pragma GCC unroll 8
        for (int i = 0; i < kGemmMR; ++i) {
            float v;
            if constexpr (PACKED_A)
                v = reinterpret_cast<const float *>(a)[k * kGemmMR + i];
            else
                std::memcpy(&v, ar[i] + 4 * k, 4);
            const __m512 av = _mm512_set1_ps(v);
#pragma GCC unroll 3
            for (int j = 0; j < NV; ++j)
                acc[i][j] = _mm512_fmadd_ps(av, b[j], acc[i][j]);
        }
    }
    c_tile_store<NV>(acc, c);
}

template <bool PACKED_A>
FL_AVX512 void pbf_block_avx512(const void *a, int64_t lda, int64_t K, const float *bpp, int64_t N, int64_t m0,
                                int64_t m1, int64_t j0, const Epilogue &epi) {
    alignas(64) float cbuf[kPbMB * kGemmNR];
    const int64_t cols = std::min<int64_t>(kGemmNR, N - j0), nv = (cols + 15) / 16;
    Epilogue e = epi;
    e.fence = false;
    auto a_rows = [&](int64_t m, int64_t k) {
        return PACKED_A
                   ? reinterpret_cast<const char *>(static_cast<const float *>(a) + ((m / kGemmMR) * K + k) * kGemmMR)
                   : static_cast<const char *>(a) + (m * lda + k) * 4;
    };
    const int64_t kblk = K <= kPbKC ? std::max<int64_t>(K, 1) : kPbKB; // as in pb_block_avx512bf16
    for (int64_t ms = m0; ms < m1; ms += kPbMB) {
        const int64_t me = std::min(m1, ms + kPbMB);
        for (int64_t kb = 0; kb == 0 || kb < K; kb += kblk) {
            const int64_t kn = std::min(kblk, K - kb);
            for (int64_t m = ms; m < me; m += kGemmMR)
                by_count<3>(nv, [&](auto NV) FL_AVX512 {
                    pbf_micro<NV, PACKED_A>(a_rows(m, kb), lda * 4, std::min<int64_t>(kGemmMR, me - m), kn,
                                            bpp + kb * kGemmNR, cbuf + (m - ms) * kGemmNR, kb > 0);
                });
        }
        simd_epilogue<Avx512Vec>(e, cbuf, kGemmNR, ms, me - ms, j0, cols);
    }
    if (epi.stream && epi.fence)
        _mm_sfence();
}

// 16 weight elements as fp32: fp32 as stored (W = F32), bf16 widened (W = BF16), or fp32 rounded to bf16 precision
// (W = F32 with ROUND: RNE, NaN stays NaN; autocast's weight cast, kept in fp32).
template <DType W, bool ROUND> FL_AVX512 FL_INLINE __m512 load_w16(const void *w, int64_t i, __mmask16 m) {
    const __m512 v = v_load(w, W, i, m);
    if constexpr (!ROUND)
        return v;
    const __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                       _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v);
}

// B[k][n] = w[n][k] as fp32 (load_w16): blocks of 16 x 16 elements.
template <DType W, bool ROUND>
FL_AVX512 void pbf_pack_wt_avx512(const void *w, int64_t ldw, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                                  float *bp) {
    const auto block = [&](int64_t n0, int64_t k0, uint32_t *out) FL_AVX512 {
        const __mmask16 m = mask16(K - k0);
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
            r[i] =
                _mm512_castps_si512(n0 + i < N ? load_w16<W, ROUND>(w, (n0 + i) * ldw + k0, m) : _mm512_setzero_ps());
        store_transposed(r, out, kGemmNR);
    };
    for_wt_blocks(pb_kpt(K, DType::F32), panel0, panel1, reinterpret_cast<uint32_t *>(bp), block);
}

// 16 k of an int8 weight row j dequantized as fgemm does it (fused_linear_avx2.cpp's load_int8_weight):
// (q * group code) * the row's scale, both products exact or rounded the same way; m: the valid k.
FL_AVX512 FL_INLINE __m512 load_int8_w16(const Int8Weight &w, int64_t j, int64_t k, __mmask16 m) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w.q + j * w.ldq + k)));
    if (w.group) // k is a multiple of 16, groups of 16: one code
        v = _mm512_mul_ps(v, _mm512_set1_ps(static_cast<float>(w.group[j * w.ldg + k / 16])));
    return _mm512_mul_ps(v, _mm512_set1_ps(w.scale[j]));
}

// 16 k (k % 16 == 0, K % 32 == 0) of an int4 weight row j dequantized: (u - z) * s, exact (load_int4_weight there). In
// a 32-k block, k 0..15 are the low nibbles of its 16 bytes and k 16..31 the high ones (int4_kernels.h).
FL_AVX512 FL_INLINE __m512 load_int4_w16(const Int4Weight &w, int64_t K, int64_t j, int64_t k) {
    const int64_t groups = K / w.group, g = k / w.group;
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(w.q + j * (K / 2) + (k / 32) * 16));
    if (k % 32 >= 16)
        b = _mm_srli_epi16(b, 4);
    const int z = w.zeros ? w.zeros[j * groups + g] : 8;
    b = _mm_sub_epi8(_mm_and_si128(b, _mm_set1_epi8(0x0F)), _mm_set1_epi8(static_cast<char>(z)));
    const __m512 s = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(w.scales[j * groups + g])));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s);
}

// 16 k (k % 16 == 0, K % 16 == 0) of a 2:4 weight row j decompressed: its 8 kept values of these 16 positions expanded
// under the 16-bit mask of meta bytes k / 8, k / 8 + 1 (valid meta: 8 bits set), bf16 values widened, fp32 values
// rounded to bf16 with ROUND.
template <DType V, bool ROUND>
FL_AVX512 FL_INLINE __m512 load_sparse24_w16(const Sparse24Weight &w, int64_t K, int64_t j, int64_t k) {
    uint16_t m;
    std::memcpy(&m, w.meta + j * (K / 8) + k / 8, 2);
    const __m512 v = load_w16<V, ROUND>(w.values, j * (K / 2) + k / 2, 0xFF);
    return _mm512_maskz_expand_ps(static_cast<__mmask16>(m), v);
}

// B[k][n] = the weight row n at k, dequantized (Int8Weight, FMT = 0; Int4Weight, 1) or decompressed (Sparse24Weight
// with bf16 values, 2; fp32, 3; fp32 rounded to bf16, 4): blocks of 16 x 16.
template <int FMT>
FL_AVX512 void pbf_pack_quant(const Int8Weight &w8, const Int4Weight &w4, const Sparse24Weight &s24, int64_t N,
                              int64_t K, int64_t panel0, int64_t panel1, uint32_t *bp) {
    const auto block = [&](int64_t n0, int64_t k0, uint32_t *out) FL_AVX512 {
        const __mmask16 m = mask16(K - k0);
        __m512i r[16];
        for (int i = 0; i < 16; ++i) {
            __m512 v = _mm512_setzero_ps();
            if (n0 + i < N) {
                if constexpr (FMT == 0)
                    v = load_int8_w16(w8, n0 + i, k0, m);
                else if constexpr (FMT == 1)
                    v = load_int4_w16(w4, K, n0 + i, k0);
                else if constexpr (FMT == 2)
                    v = load_sparse24_w16<DType::BF16, false>(s24, K, n0 + i, k0);
                else if constexpr (FMT == 3)
                    v = load_sparse24_w16<DType::F32, false>(s24, K, n0 + i, k0);
                else
                    v = load_sparse24_w16<DType::F32, true>(s24, K, n0 + i, k0);
            }
            r[i] = _mm512_castps_si512(v);
        }
        store_transposed(r, out, kGemmNR);
    };
    for_wt_blocks(pb_kpt(K, DType::F32), panel0, panel1, bp, block);
}

// B[k][n] = b[k * ld + n]: rows of 48 floats copied (zero past N).
// (B fp32 as stored, bf16 widened, or fp32 rounded to bf16: load_w16.)
template <DType W, bool ROUND>
FL_AVX512 void pbf_pack_rows_avx512(const void *b, int64_t ld, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                                    float *bp) {
    const int64_t kpt = pb_kpt(K, DType::F32);
    for (int64_t p = panel0; p < panel1; ++p) {
        const int64_t j0 = p * kGemmNR;
        float *out = bp + (p - panel0) * kpt * kGemmNR;
        for (int64_t k = 0; k < K; ++k)
#pragma GCC unroll 3
            for (int g = 0; g < 3; ++g)
                _mm512_storeu_ps(out + k * kGemmNR + 16 * g,
                                 load_w16<W, ROUND>(b, k * ld + j0 + 16 * g, mask16(N - j0 - 16 * g)));
    }
}

// A[i][k] = src[k * ld + i] (i < rows) packed in panels of 8 rows: ap[(panel * K + k) * 8 + r].
FL_AVX512 void pbf_pack_a_avx512(const float *src, int64_t ld, int64_t rows, int64_t K, int64_t panel0, int64_t panel1,
                                 float *ap) {
    for (int64_t p = panel0; p < panel1; ++p) {
        const __mmask16 m = mask16(rows - p * kGemmMR) & 0xFF;
        for (int64_t k = 0; k < K; ++k)
            _mm256_storeu_ps(ap + (p * K + k) * kGemmMR,
                             _mm512_castps512_ps256(_mm512_maskz_loadu_ps(m, src + k * ld + p * kGemmMR)));
    }
}

// ------------------------------------------------------------------------------------------------------------
// Small-M forward (bf16: where fwd_bf16_inner says, x rows 8 at a time; fp32: 4 at a time): inner products of x rows
// with weight rows (both contiguous along K), MT x R accumulators of 16 lanes, horizontal sums at the end. No packing:
// at M = 1 the weight read is the whole cost, so each weight byte is loaded exactly once and R rows are streamed
// concurrently (K = N = 4096 bf16, 2 threads: 0.34 ms, ~100 GB/s, the DRAM bandwidth of the dev machine). fp32 weights
// are rounded to bf16 in registers (vcvtne2ps2bf16, RNE).
// ------------------------------------------------------------------------------------------------------------
template <bool WF32, bool TAIL> FL_AVX512BF16 FL_INLINE __m512bh load_w32(const void *w, int64_t off, int64_t rem) {
    if constexpr (WF32) {
        const float *f = static_cast<const float *>(w) + off;
        if constexpr (!TAIL)
            return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f));
        return _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(mask16(rem - 16), f + 16),
                                   _mm512_maskz_loadu_ps(mask16(rem), f));
    } else {
        const uint16_t *h = static_cast<const uint16_t *>(w) + off;
        if constexpr (!TAIL)
            return (__m512bh)_mm512_loadu_si512(h);
        return (__m512bh)_mm512_maskz_loadu_epi16(mask32(rem), h);
    }
}

// One 32-wide k step of an MT x R tile (TAIL: only rem < 32 elements are valid, the rest is zero-filled).
template <int MT, int R, bool WF32> struct SmallStepBf16 : DotRows<uint16_t, void> {
    template <bool TAIL> FL_AVX512BF16 FL_INLINE void run(__m512 (&acc)[MT][R], int64_t k, int64_t rem) const {
        __m512bh wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            wv[r] = load_w32<WF32, TAIL>(w, r * ldw + k, rem);
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
            const __m512bh xv = load_w32<false, TAIL>(x, m * ldx + k, rem);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
                acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
};

template <int MT, int R, bool WF32>
FL_AVX512BF16 void small_tile_bf16(const uint16_t *x, int64_t ldx, const void *w, int64_t ldw, int64_t K, float *c,
                                   int64_t ldc) {
    bf16::dot_tile<Avx512Vec, MT, R, 32>(SmallStepBf16<MT, R, WF32>{{x, ldx, w, ldw}}, K, c, ldc);
}

// The fp32 step: 16 k.
template <int MT, int R> struct SmallStepF32 : DotRows<float, float> {
    template <bool TAIL> FL_AVX512 FL_INLINE void run(__m512 (&acc)[MT][R], int64_t k, int64_t rem) const {
        const __mmask16 msk = TAIL ? mask16(rem) : static_cast<__mmask16>(0xFFFF);
        __m512 wv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            wv[r] = TAIL ? _mm512_maskz_loadu_ps(msk, w + r * ldw + k) : _mm512_loadu_ps(w + r * ldw + k);
#pragma GCC unroll 4
        for (int m = 0; m < MT; ++m) {
            const __m512 xv = TAIL ? _mm512_maskz_loadu_ps(msk, x + m * ldx + k) : _mm512_loadu_ps(x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r)
                acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
        }
    }
};

// R (weight rows per tile) by MT: MT * R + R + 1 <= 32 zmm registers.
template <int MT> constexpr int small_r() {
    return MT <= 2 ? 8 : MT <= 4 ? 6 : MT <= 6 ? 4 : 3;
}

template <int MT>
FL_AVX512BF16 void small_rows_bf16(const uint16_t *x, int64_t ldx, const void *w, bool wf32, int64_t ldw, int64_t K,
                                   int64_t nrows, float *c, int64_t ldc) {
    const size_t esz = wf32 ? 4 : 2;
    const char *wb = static_cast<const char *>(w);
    by_row_tiles<small_r<MT>()>(nrows, [&](int64_t r, auto R) FL_AVX512BF16 {
        if (wf32)
            small_tile_bf16<MT, R, true>(x, ldx, wb + r * ldw * esz, ldw, K, c + r, ldc);
        else
            small_tile_bf16<MT, R, false>(x, ldx, wb + r * ldw * esz, ldw, K, c + r, ldc);
    });
}

// The x rows [m, m + mt) (mt = 1-4) against nrows fp32 weight rows.
FL_AVX512 void small_rows_f32(int64_t mt, const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t K,
                              int64_t nrows, float *c, int64_t ldc) {
    by_count<4>(mt, [&](auto MT) FL_AVX512 {
        by_row_tiles<small_r<MT>()>(nrows, [&](int64_t r, auto R) FL_AVX512 {
            dot_tile<Avx512Vec, MT, R, 16>(SmallStepF32<MT, R>{{x, ldx, w + r * ldw, ldw}}, K, c + r, ldc);
        });
    });
}

// Other M: "weight-stationary broadcast" kernel, the GEMM micro kernel with the roles swapped. x is packed once per
// call as x^T pairs in chunks of 64 rows, xt[kp][m] = (x[m][2kp], x[m][2kp+1]) (J = 1..4 vectors of 16 m lanes,
// zero-padded), and a tile of RW weight rows runs over the whole K with RW x J accumulators: per k pair, J xt loads
// and RW x J vdpbf16ps whose other operand is a dword of the weight row broadcast straight from memory. The weight is
// read in place (fp32 rows are first rounded to a bf16 copy, 12 rows at a time): no packing, no horizontal sums, no
// partial sums in memory, and the GEMM's B-panel transposes (15-17 % of its time at M = 128) disappear.
// Tiles: 12 rows x 1-2 vectors, 8 x 3, 6 x 4 (24 rows ran out of general registers for the row pointers).
// Single core, K = N = 4096, M = 16: inner products (4 x 6 tiles, horizontal sums) 2.4 ms, K-blocked inner products
// 2.1 ms, this kernel 1.6 ms. 2 threads: M = 128: 4.7 ms (910 GFLOP/s, ~90 % of the vdpbf16ps peak) vs 5.6 ms for
// the packed GEMM and 5.7 ms for oneDNN; M = 512: 19.2 ms, same as the GEMM.
template <int RW, int J>
FL_AVX512BF16 void wstat_tile(const char *w, int64_t ldw_bytes, const uint32_t *xt, int64_t K, float *c, int64_t ldc,
                              int64_t M, int64_t rows) {
    __m512 acc[RW][J];
    bf16::zero_tile<Avx512Vec>(acc);
    const int64_t kpn = K / 2; // whole pairs; an odd last element is handled below
    for (int64_t kp = 0; kp < kpn; ++kp) {
        if ((kp & 15) == 0) // a new cache line per weight row every 16 k pairs: prefetch 1 KB ahead (M = 16: -6 %)
#pragma GCC unroll 24
            for (int i = 0; i < RW; ++i)
                _mm_prefetch(w + i * ldw_bytes + kp * 4 + 1024, _MM_HINT_T0);
        kpair_bf16(acc, xt + kp * J * 16, [&](int i) {
            int32_t pair;
            std::memcpy(&pair, w + i * ldw_bytes + kp * 4, 4);
            return pair;
        });
    }
    if (K & 1) { // last element of each row paired with a zero (never read past the row)
        kpair_bf16(acc, xt + kpn * J * 16, [&](int i) {
            uint16_t last;
            std::memcpy(&last, w + i * ldw_bytes + (K - 1) * 2, 2);
            return static_cast<int32_t>(last);
        });
    }
    // acc[i][j] lane l = result (m = 16 j + l, n = i): scatter into the M x 48 block (rows >= `rows` are padding).
    alignas(64) float tmp[16];
    for (int i = 0; i < RW; ++i) {
        if (i >= rows)
            break;
        for (int j = 0; j < J; ++j) {
            _mm512_store_ps(tmp, acc[i][j]);
            for (int64_t l = 0; l < 16 && 16 * j + l < M; ++l)
                c[(16 * j + l) * ldc + i] = tmp[l];
        }
    }
}

constexpr int64_t kFwdF32MaxM = 64; // largest M of the fp32 forward kernel

// bf16 forward, inner products (small_rows_bf16, x rows 8 at a time) or the broadcast kernel (wstat): the broadcast
// kernel's accumulators are 16 x rows wide, so at M = 5-12 and 17-24 a third to half of its lanes are padding. Inner
// products when M <= 12, 17 <= M <= 24, or 13 <= M <= 16 with K >= 1024. Zen 4, 1 thread, bf16 + gelu, us, broadcast
// -> inner (eager oneDNN in brackets): M = 8: 384^2 39.5 -> 27.3 (49.4) | 1536^2 393 -> 210 (319) | 384 -> 1536 126
// -> 83 (114) | 1536 -> 384 111 -> 65 (106); M = 12: 1536^2 376 -> 304 | 4096^2 ms 4.0 -> 2.7; M = 20: 1536^2 717
// -> 494 (577) | 4096^2 ms 5.3 -> 4.1; M = 24: 384 -> 1536 232 -> 216 | 1536^2 727 -> 594; M = 16: 4096^2 ms 4.1 ->
// 3.3, but 384^2 41.3 vs 44.8 and 384 -> 1536 136 vs 150 kept; M = 32: 1536^2 742 vs 782 kept.
inline bool fwd_bf16_inner(int64_t M, int64_t K) {
    return M <= 12 || (M > 16 && M <= 24) || (M <= 16 && K >= 1024);
}

// Column block of the small-M path: 48 weight rows (multiple of R = 6, 8 and of the wstat tiles 6, 8, 12).
constexpr int64_t kFwdNB = 48;
constexpr int64_t kXtChunk = 64;           // m rows per x^T chunk (J <= 4 vectors of 16 lanes)
constexpr int64_t kXtSuper = kFwdRowBlock; // m rows per pass over the weight (see fwd_bf16)

// k pairs per x^T chunk (+ overrun of the last 16 x 16 transpose) and dwords per chunk.
inline int64_t xt_kp(int64_t K) {
    return (K + 1) / 2 + 16;
}
inline int64_t xt_chunk_dwords(int64_t K) {
    return xt_kp(K) * kXtChunk;
}

struct FwdWorkspace {
    float *cbuf;     // [min(M, 256)][kFwdNB] fp32 results before the epilogue
    uint16_t *wconv; // [12][K] weight rows rounded to bf16 (fp32 weights)
    uint32_t *xt;    // x^T pairs of one row block: kFwdRowBlock / kXtChunk chunks of xt_chunk_dwords(K)
};

inline FwdWorkspace fwd_workspace(void *workspace, int64_t M, int64_t K) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    FwdWorkspace ws;
    ws.cbuf = reinterpret_cast<float *>(p);
    ws.wconv = reinterpret_cast<uint16_t *>(ws.cbuf + std::max<int64_t>(std::min(M, kFwdRowBlock), 1) * kFwdNB);
    ws.xt = reinterpret_cast<uint32_t *>(ws.wconv + (12 * K + 31) / 32 * 32);
    return ws;
}

// x^T chunk c (rows 64c ...): xt[kp][16 J] = (x[m][2kp], x[m][2kp + 1]), zero past the chunk's rows.
FL_AVX512BF16 void pack_xt_chunk(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int64_t c, uint32_t *xt) {
    const int64_t m0 = c * kXtChunk, rows = std::min(kXtChunk, M - m0);
    const int J = static_cast<int>((rows + 15) / 16);
    uint32_t *out = xt + c * xt_chunk_dwords(K);
    const int64_t kpn = (K + 1) / 2;
    for (int j = 0; j < J; ++j)
        for (int64_t kp0 = 0; kp0 < kpn; kp0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; ++i) {
                const int64_t m = 16 * j + i;
                r[i] = m < rows ? load_pairs(x + (m0 + m) * ldx, DType::BF16, 2 * kp0, K - 2 * kp0)
                                : _mm512_setzero_si512();
            }
            store_transposed(r, out + (kp0 * J + j) * 16, J * 16);
        }
}

// Runs one x^T chunk (J vectors) against the RW weight rows at wt, results into c (rows m, column 0..RW).
template <int RW>
FL_AVX512BF16 void wstat_chunk(const char *wt, int64_t ldb, const uint32_t *xt, int64_t K, int64_t M, int64_t c,
                               float *cbuf, int64_t col, int64_t rows) {
    const int64_t m0 = c * kXtChunk, mr = std::min(kXtChunk, M - m0);
    const uint32_t *xc = xt + c * xt_chunk_dwords(K);
    float *out = cbuf + m0 * kFwdNB + col;
    bf16::by_count<4>((mr + 15) / 16,
                      [&](auto J) FL_AVX512BF16 { wstat_tile<RW, J>(wt, ldb, xc, K, out, kFwdNB, mr, rows); });
}

// All x^T chunks against nr weight rows, RW rows at a time (each RW-row slice of the weight is read from memory
// once and then from L1/L2 for the other chunks).
template <int RW>
FL_AVX512BF16 void wstat_block(const FwdWorkspace &ws, const uint32_t *xt, int64_t M, const void *w, bool wf32,
                               int64_t ldw, int64_t K, int64_t nr) {
    const int64_t chunks = (M + kXtChunk - 1) / kXtChunk;
    for (int64_t t0 = 0; t0 < nr; t0 += RW) {
        const int64_t rows = std::min<int64_t>(RW, nr - t0);
        const char *wt;
        int64_t ldb, col = t0;
        if (wf32) { // round the tile's rows to bf16 once (RNE, like autocast); padding rows repeat the last row
            for (int64_t i = 0; i < RW; ++i) {
                const float *src = static_cast<const float *>(w) + (t0 + std::min(i, rows - 1)) * ldw;
                for (int64_t k = 0; k < K; k += 32)
                    _mm512_mask_storeu_epi16(ws.wconv + i * K + k, mask32(K - k),
                                             (__m512i)load_w32<true, true>(src, k, K - k));
            }
            wt = reinterpret_cast<const char *>(ws.wconv);
            ldb = K * 2;
        } else {
            ldb = ldw * 2;
            wt = static_cast<const char *>(w) + t0 * ldb;
            if (rows < RW) {
                if (nr < RW) { // fewer rows than one tile: one row at a time
                    for (int64_t i = 0; i < rows; ++i)
                        for (int64_t c = 0; c < chunks; ++c)
                            wstat_chunk<1>(wt + i * ldb, ldb, xt, K, M, c, ws.cbuf, t0 + i, 1);
                    continue;
                }
                wt -= (RW - rows) * ldb; // tail tile: redo the last RW rows (recomputes a few outputs)
                col -= RW - rows;
            }
        }
        for (int64_t c = 0; c < chunks; ++c)
            wstat_chunk<RW>(wt, ldb, xt, K, M, c, ws.cbuf, col, wf32 ? rows : RW);
    }
}

// small_rows_bf16<MT> by MT - 1.
using SmallRowsBf16 = void (*)(const uint16_t *, int64_t, const void *, bool, int64_t, int64_t, int64_t, float *,
                               int64_t);
constexpr SmallRowsBf16 kSmallRowsBf16[8] = {small_rows_bf16<1>, small_rows_bf16<2>, small_rows_bf16<3>,
                                             small_rows_bf16<4>, small_rows_bf16<5>, small_rows_bf16<6>,
                                             small_rows_bf16<7>, small_rows_bf16<8>};

FL_AVX512BF16 void fwd_bf16(const uint16_t *x, int64_t ldx, int64_t M, const void *w, bool wf32, int64_t ldw, int64_t K,
                            int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    const FwdWorkspace ws = fwd_workspace(workspace, M, K);
    const size_t esz = wf32 ? 4 : 2;
    if (fwd_bf16_inner(M, K)) { // every weight byte loaded from memory once (fp32 weights rounded in registers)
        for (int64_t nb = n0; nb < n1; nb += kFwdNB) {
            const int64_t nr = std::min(kFwdNB, n1 - nb);
            const void *wrows = static_cast<const char *>(w) + nb * ldw * esz;
            for (int64_t m = 0; m < M; m += 8) // x rows 8 at a time: the block's weight rows from L1/L2 again
                kSmallRowsBf16[std::min<int64_t>(8, M - m) - 1](x + m * ldx, ldx, wrows, wf32, ldw, K, nr,
                                                                ws.cbuf + m * kFwdNB, kFwdNB);
            simd_epilogue<Avx512Vec>(epi, ws.cbuf, kFwdNB, 0, M, nb, nr);
        }
        return;
    }
    // Broadcast kernel, x rows in blocks of kFwdRowBlock: the block's x^T (kFwdRowBlock x K bf16, 2 MB for K = 4096)
    // is packed here (each thread packs the blocks it works on: x is small next to the weight slice it meets) and
    // re-read from L2/L3 by every weight tile; the weight slice is read once per row block.
    for (int64_t ms = m0; ms < m1; ms += kXtSuper) {
        const int64_t rows = std::min(kXtSuper, m1 - ms);
        for (int64_t c = 0; c * kXtChunk < rows; ++c)
            pack_xt_chunk(x + ms * ldx, ldx, rows, K, c, ws.xt);
        const uint32_t *xs = ws.xt;
        for (int64_t nb = n0; nb < n1; nb += kFwdNB) {
            const int64_t nr = std::min(kFwdNB, n1 - nb);
            const void *wrows = static_cast<const char *>(w) + nb * ldw * esz;
            // weight tile height by accumulator count: 12 x 1-2 vectors, 8 x 3, 6 x 4
            if (rows <= 32)
                wstat_block<12>(ws, xs, rows, wrows, wf32, ldw, K, nr);
            else if (rows <= 48)
                wstat_block<8>(ws, xs, rows, wrows, wf32, ldw, K, nr);
            else
                wstat_block<6>(ws, xs, rows, wrows, wf32, ldw, K, nr);
            simd_epilogue<Avx512Vec>(epi, ws.cbuf, kFwdNB, ms, rows, nb, nr);
        }
    }
}

FL_AVX512 void fwd_small_f32(const float *x, int64_t ldx, int64_t M, const float *w, int64_t ldw, int64_t K, int64_t n0,
                             int64_t n1, const Epilogue &epi, void *workspace) {
    float *cbuf = fwd_workspace(workspace, M, K).cbuf;
    for (int64_t nb = n0; nb < n1; nb += kFwdNB) {
        const int64_t nr = std::min(kFwdNB, n1 - nb);
        const float *wrows = w + nb * ldw;
        for (int64_t m = 0; m < M; m += 4)
            small_rows_f32(std::min<int64_t>(4, M - m), x + m * ldx, ldx, wrows, ldw, K, nr, cbuf + m * kFwdNB, kFwdNB);
        simd_epilogue<Avx512Vec>(epi, cbuf, kFwdNB, 0, M, nb, nr);
    }
}
// ------------------------------------------------------------------------------------------------------------
// Small-M backward, grad_x = dpre @ w for the columns [k0, k1): the weight is streamed row by row (16 rows at a
// time, each row contiguous over the thread's columns) and the fp32 sums of all M rows stay in an L1/L2 buffer.
// Pairs of weight rows are interleaved in registers (fp32 rows rounded to bf16 on the way) so that vdpbf16ps pairs
// them with a broadcast dword (dpre[m][n], dpre[m][n + 1]). Reading column strips instead (the packed GEMM's B
// panels) touches 48 floats per weight row per strip and ran at ~25 GB/s.
// ------------------------------------------------------------------------------------------------------------
// One block of 16 weight rows x 3 column vectors: the 8 interleaved row pairs x 3 vectors stay in 24 registers
// while every m row accumulates 24 vdpbf16ps (broadcast dwords read straight from dpre).
FL_AVX512BF16 void grad_x_block_full(const uint16_t *d, int64_t ldd, int64_t M, const char *w, bool wf32,
                                     int64_t ldw_bytes, int64_t n0, int64_t kbyte, __m512 *acc, int64_t nv) {
    __m512bh wp[8][3];
    const DType dt = wf32 ? DType::F32 : DType::BF16;
    const int64_t vb = wf32 ? 64 : 32; // bytes per 16 columns
#pragma GCC unroll 8
    for (int p = 0; p < 8; ++p) {
        const char *r0 = w + (n0 + 2 * p) * ldw_bytes + kbyte;
#pragma GCC unroll 3
        for (int j = 0; j < 3; ++j)
            wp[p][j] = (__m512bh)interleave_rows(r0 + j * vb, r0 + ldw_bytes + j * vb, dt, 16);
    }
    for (int64_t m = 0; m < M; ++m) {
        const uint16_t *dm = d + m * ldd + n0;
        __m512 a0 = acc[m * nv], a1 = acc[m * nv + 1], a2 = acc[m * nv + 2];
#pragma GCC unroll 8
        for (int p = 0; p < 8; ++p) {
            int32_t pair;
            std::memcpy(&pair, dm + 2 * p, 4);
            const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            a0 = _mm512_dpbf16_ps(a0, b, wp[p][0]);
            a1 = _mm512_dpbf16_ps(a1, b, wp[p][1]);
            a2 = _mm512_dpbf16_ps(a2, b, wp[p][2]);
        }
        acc[m * nv] = a0;
        acc[m * nv + 1] = a1;
        acc[m * nv + 2] = a2;
    }
}

FL_AVX512BF16 void small_grad_x_bf16(const uint16_t *d, int64_t ldd, int64_t M, const void *w, bool wf32, int64_t ldw,
                                     int64_t N, int64_t k0, int64_t k1, __m512 *acc, uint16_t *gx, int64_t ldgx) {
    const int64_t kw = k1 - k0, nv = (kw + 15) / 16;
    const int64_t esz = wf32 ? 4 : 2;
    const char *wb = static_cast<const char *>(w);
    for (int64_t i = 0; i < M * nv; ++i)
        acc[i] = _mm512_setzero_ps();
    for (int64_t n0 = 0; n0 < N; n0 += 16) {
        const int64_t np = std::min<int64_t>(8, (N - n0 + 1) / 2); // row pairs in this block
        int64_t v = 0;
        if (n0 + 16 <= N) // full block: 3 column vectors at a time
            for (; v + 3 <= nv && 16 * (v + 3) <= kw; v += 3)
                grad_x_block_full(d, ldd, M, wb, wf32, ldw * esz, n0, (k0 + 16 * v) * esz, acc + v, nv);
        for (; v < nv; ++v) { // generic: one vector, partial pairs / columns
            const int64_t k = k0 + 16 * v;
            __m512bh wp[8];
            for (int64_t p = 0; p < np; ++p) {
                const int64_t n = n0 + 2 * p;
                const char *r0 = wb + (n * ldw + k) * esz;
                wp[p] = (__m512bh)interleave_rows(r0, n + 1 < N ? r0 + ldw * esz : nullptr,
                                                  wf32 ? DType::F32 : DType::BF16, k1 - k);
            }
            for (int64_t m = 0; m < M; ++m) {
                const uint16_t *dm = d + m * ldd + n0;
                __m512 a = acc[m * nv + v];
                for (int64_t p = 0; p < np; ++p) {
                    uint32_t pair = dm[2 * p];
                    if (n0 + 2 * p + 1 < N) // the last row of an odd N pairs with zero
                        pair |= static_cast<uint32_t>(dm[2 * p + 1]) << 16;
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi32(static_cast<int>(pair)), wp[p]);
                }
                acc[m * nv + v] = a;
            }
        }
    }
    for (int64_t m = 0; m < M; ++m)
        for (int64_t v = 0; v < nv; ++v)
            _mm256_mask_storeu_epi16(gx + m * ldgx + k0 + 16 * v, mask16(kw - 16 * v), v_to_bf16(acc[m * nv + v]));
}

// Small-M backward, grad_w[n][k] = sum_m dpre[m][n] x[m][k] for the rows [n0, n1): a rank-M update written row by
// row (sequential stores, the output is the whole cost at M = 1). x is packed once as row pairs interleaved,
// xi[p][k] = (x[2p][k], x[2p + 1][k]), so each output vector costs ceil(M / 2) vdpbf16ps with the broadcast dword
// (dpre[2p][n], dpre[2p + 1][n]). (The packed GEMM wrote 48-column strips of 512 rows: 4.3 ms -> see the report.)
FL_AVX512BF16 void pack_x_pairs(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int64_t ldxi, uint32_t *xi) {
    for (int64_t p = 0; p < (M + 1) / 2; ++p) {
        const uint16_t *r0 = x + 2 * p * ldx;
        const uint16_t *r1 = 2 * p + 1 < M ? r0 + ldx : nullptr;
        for (int64_t k = 0; k < K; k += 16)
            _mm512_storeu_si512(xi + p * ldxi + k, interleave_rows(r0 + k, r1 ? r1 + k : nullptr, DType::BF16, K - k));
    }
}

FL_AVX512BF16 void small_grad_w_bf16(const uint16_t *d, int64_t ldd, const uint32_t *xi, int64_t ldxi, int64_t M,
                                     int64_t K, int64_t n0, int64_t n1, void *gw, DType out_dtype, int64_t ldgw) {
    const int64_t mp = (M + 1) / 2;
    // Column chunks keep the xi slice in L1 (<= 32 KB): M = 16 streamed 8 x 64 B from L2 per output vector otherwise.
    const int64_t kch = std::max<int64_t>(256, (32768 / (4 * mp)) / 16 * 16);
    // fp32 output: non-temporal stores, the output is not read back soon and needs no read-for-ownership traffic
    // (single core, M = 1, K = N = 4096: 2.9 ms -> 1.5 ms).
    const bool stream = out_dtype == DType::F32;
    for (int64_t kc0 = 0; kc0 < K; kc0 += kch) {
        const int64_t kc1 = std::min(K, kc0 + kch);
        for (int64_t n = n0; n < n1; ++n) {
            __m512bh a[kSmallGradXMax / 2];
            for (int64_t p = 0; p < mp; ++p) {
                uint32_t pair = d[2 * p * ldd + n];
                if (2 * p + 1 < M)
                    pair |= static_cast<uint32_t>(d[(2 * p + 1) * ldd + n]) << 16;
                a[p] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
            }
            int64_t k = kc0;
            float *row = static_cast<float *>(gw) + n * ldgw;
            if (stream && reinterpret_cast<uintptr_t>(row + k) % 64 == 0)
                for (; k + 64 <= kc1; k += 64) { // 4 independent accumulation chains
                    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
                    for (int64_t p = 0; p < mp; ++p) {
                        const uint32_t *src = xi + p * ldxi + k;
                        c0 = _mm512_dpbf16_ps(c0, a[p], (__m512bh)_mm512_loadu_si512(src));
                        c1 = _mm512_dpbf16_ps(c1, a[p], (__m512bh)_mm512_loadu_si512(src + 16));
                        c2 = _mm512_dpbf16_ps(c2, a[p], (__m512bh)_mm512_loadu_si512(src + 32));
                        c3 = _mm512_dpbf16_ps(c3, a[p], (__m512bh)_mm512_loadu_si512(src + 48));
                    }
                    _mm512_stream_ps(row + k, c0);
                    _mm512_stream_ps(row + k + 16, c1);
                    _mm512_stream_ps(row + k + 32, c2);
                    _mm512_stream_ps(row + k + 48, c3);
                }
            for (; k < kc1; k += 16) {
                __m512 acc = _mm512_setzero_ps();
                for (int64_t p = 0; p < mp; ++p)
                    acc = _mm512_dpbf16_ps(acc, a[p], (__m512bh)_mm512_loadu_si512(xi + p * ldxi + k));
                float *dst = static_cast<float *>(gw) + n * ldgw + k;
                if (stream && k + 16 <= K && reinterpret_cast<uintptr_t>(dst) % 64 == 0)
                    _mm512_stream_ps(dst, acc);
                else
                    v_store(gw, out_dtype, n * ldgw + k, acc, mask16(K - k));
            }
        }
    }
    if (stream)
        _mm_sfence();
}
} // namespace
#endif // FL_X86

// ============================================================================================================
// Kernel tables
// ============================================================================================================
int64_t gemm_packed_a_elems(int64_t M, int64_t K) {
    const int64_t panels = (M + kGemmMR - 1) / kGemmMR;
    return panels * kGemmMR * packed_kp(K) * 2;
}

size_t gemm_workspace_bytes() {
    return sizeof(uint32_t) * kGemmKC / 2 * kGemmNR + sizeof(float) * kGemmMC * kGemmNR;
}

size_t small_grad_x_workspace_bytes(int64_t M, int64_t k_cols) {
    return 64 + 64 * static_cast<size_t>(M) * ((k_cols + 15) / 16);
}

size_t small_grad_w_workspace_bytes(int64_t M, int64_t K) {
    return 64 + sizeof(uint32_t) * static_cast<size_t>((M + 1) / 2) * ((K + 15) / 16 * 16);
}

#if FL_X86
namespace {
// alignment + results (min(M, 256) x 48 fp32) + 12 weight rows rounded to bf16 + x^T of one row block (broadcast
// kernel)
size_t fwd_workspace_avx512(int64_t M, int64_t K) {
    const int64_t rows = std::max<int64_t>(std::min(M, kFwdRowBlock), 1);
    const int64_t chunks = fwd_bf16_inner(M, K) ? 0 : (rows + kXtChunk - 1) / kXtChunk;
    return 64 + sizeof(float) * rows * kFwdNB + sizeof(uint16_t) * ((12 * K + 31) / 32 * 32) +
           sizeof(uint32_t) * chunks * xt_chunk_dwords(K);
}

FL_AVX512BF16 void fwd_bf16_entry(const void *x, int64_t ldx, int64_t M, const void *w, DType w_dtype, int64_t ldw,
                                  int64_t K, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Epilogue &epi,
                                  void *workspace) {
    fwd_bf16(static_cast<const uint16_t *>(x), ldx, M, w, w_dtype == DType::F32, ldw, K, m0, m1, n0, n1, epi,
             workspace);
}

FL_AVX512 void fwd_f32_entry(const void *x, int64_t ldx, int64_t M, const void *w, DType, int64_t ldw, int64_t K,
                             int64_t, int64_t, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    fwd_small_f32(static_cast<const float *>(x), ldx, M, static_cast<const float *>(w), ldw, K, n0, n1, epi, workspace);
}

FL_AVX512BF16 void pb_pack_wt_bf16(const void *w, DType w_dtype, bool, int64_t ldw, int64_t N, int64_t K,
                                   int64_t panel0, int64_t panel1, uint32_t *bp) {
    pb_pack_wt_avx512bf16(w, w_dtype, ldw, N, K, panel0, panel1, bp);
}

FL_AVX512BF16 void pb_pack_rows_bf16(const GemmOperand &b, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                                     uint32_t *bp) {
    for (int64_t p = panel0; p < panel1; ++p)
        pack_b(b, N, K, p * kGemmNR, 0, K, bp + (p - panel0) * pb_kpt(K) * kGemmNR);
}

FL_AVX512BF16 void pb_block_bf16(const void *a, int64_t lda, PbA mode, int64_t K, const uint32_t *panel, int64_t N,
                                 int64_t m0, int64_t m1, int64_t j0, const Epilogue &epi) {
    switch (mode) {
    case PbA::Packed:
        return pb_block_avx512bf16<PbA::Packed>(a, lda, K, panel, N, m0, m1, j0, epi);
    case PbA::Cols:
        return pb_block_avx512bf16<PbA::Cols>(a, lda, K, panel, N, m0, m1, j0, epi);
    default:
        return pb_block_avx512bf16<PbA::Rows>(a, lda, K, panel, N, m0, m1, j0, epi);
    }
}

// fp32 pb: A rows or packed, fp32; weights / the backward's B operands (pack_rows) fp32, or for the bf16 forward and
// backward of the AVX-512 F family (x and dpre in fp32 from the glue) bf16 or fp32 rounded to bf16.
FL_AVX512 void pb_pack_wt_f32(const void *w, DType w_dtype, bool round_bf16, int64_t ldw, int64_t N, int64_t K,
                              int64_t panel0, int64_t panel1, uint32_t *bp) {
    float *out = reinterpret_cast<float *>(bp);
    if (w_dtype == DType::BF16)
        return pbf_pack_wt_avx512<DType::BF16, false>(w, ldw, N, K, panel0, panel1, out);
    if (round_bf16)
        return pbf_pack_wt_avx512<DType::F32, true>(w, ldw, N, K, panel0, panel1, out);
    pbf_pack_wt_avx512<DType::F32, false>(w, ldw, N, K, panel0, panel1, out);
}

FL_AVX512 void pb_pack_rows_f32(const GemmOperand &b, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                                uint32_t *bp) {
    float *out = reinterpret_cast<float *>(bp);
    if (b.dtype == DType::BF16)
        return pbf_pack_rows_avx512<DType::BF16, false>(b.ptr, b.ld, N, K, panel0, panel1, out);
    if (b.round_bf16)
        return pbf_pack_rows_avx512<DType::F32, true>(b.ptr, b.ld, N, K, panel0, panel1, out);
    pbf_pack_rows_avx512<DType::F32, false>(b.ptr, b.ld, N, K, panel0, panel1, out);
}

FL_AVX512 void pb_pack_quant_f32(const Int8Weight &w8, const Int4Weight &w4, const Sparse24Weight &s24, int64_t N,
                                 int64_t K, int64_t panel0, int64_t panel1, uint32_t *bp) {
    const int fmt = w4.q ? 1 : !s24.values ? 0 : s24.vdt == DType::BF16 ? 2 : s24.round_bf16 ? 4 : 3;
    switch (fmt) {
    case 0:
        return pbf_pack_quant<0>(w8, w4, s24, N, K, panel0, panel1, bp);
    case 1:
        return pbf_pack_quant<1>(w8, w4, s24, N, K, panel0, panel1, bp);
    case 2:
        return pbf_pack_quant<2>(w8, w4, s24, N, K, panel0, panel1, bp);
    case 3:
        return pbf_pack_quant<3>(w8, w4, s24, N, K, panel0, panel1, bp);
    default:
        return pbf_pack_quant<4>(w8, w4, s24, N, K, panel0, panel1, bp);
    }
}

FL_AVX512 void pb_block_f32(const void *a, int64_t lda, PbA mode, int64_t K, const uint32_t *panel, int64_t N,
                            int64_t m0, int64_t m1, int64_t j0, const Epilogue &epi) {
    const float *pf = reinterpret_cast<const float *>(panel);
    if (mode == PbA::Packed)
        return pbf_block_avx512<true>(a, lda, K, pf, N, m0, m1, j0, epi);
    return pbf_block_avx512<false>(a, lda, K, pf, N, m0, m1, j0, epi);
}

FL_AVX512BF16 void small_grad_x_entry(const void *dpre, int64_t ldd, int64_t M, const void *w, DType w_dtype,
                                      int64_t ldw, int64_t N, int64_t k0, int64_t k1, void *gx, int64_t ldgx,
                                      void *workspace) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    small_grad_x_bf16(static_cast<const uint16_t *>(dpre), ldd, M, w, w_dtype == DType::F32, ldw, N, k0, k1,
                      reinterpret_cast<__m512 *>(p), static_cast<uint16_t *>(gx), ldgx);
}

FL_AVX512BF16 void small_grad_w_entry(const void *dpre, int64_t ldd, const void *x, int64_t ldx, int64_t M, int64_t K,
                                      int64_t n0, int64_t n1, void *gw, DType out_dtype, int64_t ldgw,
                                      void *workspace) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    uint32_t *xi = reinterpret_cast<uint32_t *>(p);
    const int64_t ldxi = (K + 15) / 16 * 16;
    pack_x_pairs(static_cast<const uint16_t *>(x), ldx, M, K, ldxi, xi);
    small_grad_w_bf16(static_cast<const uint16_t *>(dpre), ldd, xi, ldxi, M, K, n0, n1, gw, out_dtype, ldgw);
}

// AVX-512 F: the vectorised elementwise passes and the fp32 kernels; bf16 runs the AVX2 family's kernels (fp32 FMA on
// operands widened in registers), which every AVX-512 CPU can run.
Kernels make_avx512() {
    const Kernels *avx2 = kernels_avx2();
    Kernels t = avx2 ? *avx2 : Kernels{};
    t.name = "avx512";
    t.epilogue = simd_epilogue<Avx512Vec>;
    t.dpre_pass = simd_dpre_pass<Avx512Vec>;
    t.fwd_f32 = FwdKernel{fwd_f32_entry, fwd_workspace_avx512, kFwdF32MaxM, INT64_MAX};
    t.pb_f32 = PbKernels{pb_pack_wt_f32, pb_pack_rows_f32, pb_block_f32, pbf_pack_a_avx512, pb_pack_quant_f32};
    return t;
}

Kernels make_avx512_bf16() {
    Kernels t = make_avx512();
    t.name = "avx512_bf16";
    t.fwd_bf16 = FwdKernel{fwd_bf16_entry, fwd_workspace_avx512, INT64_MAX, 24}; // (the inner-product path: whole M)
    t.pb_bf16 = PbKernels{pb_pack_wt_bf16, pb_pack_rows_bf16, pb_block_bf16, nullptr};
    t.gemm_bf16 = Bf16Gemm{pack_a_avx512bf16, gemm_tile_avx512bf16};
    t.small_bf16 = SmallBackward{small_grad_x_entry, small_grad_w_entry};
    return t;
}
} // namespace

const Kernels *kernels_avx512() {
    return cached_table<make_avx512>();
}

const Kernels *kernels_avx512_bf16() {
    return cached_table<make_avx512_bf16>();
}
#endif // FL_X86 (other builds: fused_linear_scalar.cpp)

} // namespace fused_linear
} // namespace fastdl
