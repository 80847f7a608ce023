// AVX2 + FMA + F16C kernels of the fused linear layer (Haswell, AMD Zen 1-3 and later): the family of CPUs without
// AVX-512, where PyTorch's own bf16 matmul is a slow path. Every product runs on fp32 FMAs; bf16 operands are read in
// their stored dtype and widened in registers (a 16-bit shift, exact), fp32 master weights with bf16 x are rounded to
// bf16 (RNE, like autocast's weight cast) on the way - never a converted copy of the weight.
//   fgemm_*:  a packed-panel GEMM (6 x 16 register tiles, K blocks of 256, B blocks packed into L2 per strip of 64
//             columns, the epilogue on each strip while it is in L2) for the forward (x times the weight^T) and both
//             backward products;
//   stream_*: small-M forward kernels that stream the weight rows once (inner products, horizontal sums at the end);
//   simd_epilogue / simd_dpre_pass (fused_linear_epilogue.h over Avx2Vec): the vectorised elementwise passes (exp,
//             sigmoid, rational gelu: ~1e-6 relative).
// No torch headers; the ISA is enabled per function with target attributes and the table is only chosen
// (fused_linear.cpp) when cpu_isa.h reports AVX2 + FMA + F16C.
#include "fused_linear_kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#define FA_X86 1
#include <immintrin.h>
#else
#define FA_X86 0
#endif

namespace fastdl {
namespace fused_linear {

int64_t fgemm_packed_a_floats(int64_t M, int64_t K) {
    return (M + kFgMR - 1) / kFgMR * kFgMR * ((K + kFgKC - 1) / kFgKC * kFgKC) + 8;
}

namespace {
// Rows mode: the fp32 sums of a super block of rows x all the block's columns stay in the workspace, at most
// kFgRowsCBytes (the rows of a super block are chosen to fit).
constexpr int64_t kFgRowsCBytes = int64_t{4} << 20;
inline int64_t fgemm_cols_pad(int64_t cols) {
    return (cols + kFgNC - 1) / kFgNC * kFgNC;
}
// Strips over the whole K for B trans (whole rows of the weight read in order) and for B rows with a short K (a strip
// then touches at most 512 rows of B, within the TLB's reach: grad_weight, whose K is the batch, M = 128, K = N =
// 4096, 1 thread: 65 -> 57 ms); K blocks over all columns otherwise (see fgemm_block_rows).
inline bool fgemm_strip_mode(const FgemmArgs &g) {
    return g.b.trans || g.K <= 512;
}
inline int64_t fgemm_rows_ms(int64_t cols) {
    return std::max<int64_t>(kFgMR, kFgRowsCBytes / (4 * fgemm_cols_pad(cols)) / kFgMR * kFgMR);
}
} // namespace

size_t fgemm_workspace_bytes(const FgemmArgs &g, int64_t rows, int64_t cols) {
    if (fgemm_strip_mode(g)) // B strip over the whole K + the sums of kFgMS rows x one strip
        return 64 + sizeof(float) * ((g.K + kFgKC - 1) / kFgKC * kFgKC * kFgNC + kFgMS * kFgNC);
    const int64_t cp = fgemm_cols_pad(cols), ms = std::min(fgemm_rows_ms(cols), (rows + kFgMR - 1) / kFgMR * kFgMR);
    return 64 + sizeof(float) * (kFgKC * cp + ms * cp); // one K block of B for all columns + the sums
}

#if FA_X86
#define FA __attribute__((target("avx2,fma,f16c")))
#define FA_INLINE inline __attribute__((always_inline))

namespace {

// ------------------------------------------------------------------------------------------------------------
// Loads and stores of 8 elements (fp32 or bf16), the last ones masked: n valid elements (n >= 8: all).
// ------------------------------------------------------------------------------------------------------------
FA FA_INLINE __m256i mask8(int64_t n) {
    const int v = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

FA FA_INLINE __m256 widen_bf16(__m128i h) { // 8 bf16 -> 8 fp32 (exact)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

FA FA_INLINE __m128i load_h8(const uint16_t *h, int64_t n) {
    if (n >= 8)
        return _mm_loadu_si128(reinterpret_cast<const __m128i *>(h));
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (n > 0)
        std::memcpy(t, h, 2 * n);
    return _mm_load_si128(reinterpret_cast<const __m128i *>(t));
}

FA FA_INLINE __m256 v_load(const void *p, DType dt, int64_t i, int64_t n) {
    if (dt == DType::F32) {
        const float *f = static_cast<const float *>(p) + i;
        return n >= 8 ? _mm256_loadu_ps(f) : _mm256_maskload_ps(f, mask8(n));
    }
    return widen_bf16(load_h8(static_cast<const uint16_t *>(p) + i, n));
}

FA FA_INLINE __m256 v_loadf(const float *f, int64_t n) {
    return n >= 8 ? _mm256_loadu_ps(f) : _mm256_maskload_ps(f, mask8(n));
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7FC0 (bit-identical to f32_to_bf16), in the low 16 bits of each
// dword.
FA FA_INLINE __m256i v_bf16_bits(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// v rounded to bf16 precision (RNE, NaN -> quiet NaN), kept in fp32: autocast's cast of an fp32 master weight.
FA FA_INLINE __m256 v_round_bf16(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(v_bf16_bits(v), 16));
}

FA FA_INLINE __m128i v_to_bf16(__m256 v) {
    const __m256i r = v_bf16_bits(v); // each dword <= 0xFFFF: the unsigned saturating pack keeps it
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

FA FA_INLINE void v_store(void *p, DType dt, int64_t i, __m256 v, int64_t n) {
    if (dt == DType::F32) {
        float *f = static_cast<float *>(p) + i;
        if (n >= 8)
            _mm256_storeu_ps(f, v);
        else if (n > 0)
            _mm256_maskstore_ps(f, mask8(n), v);
        return;
    }
    uint16_t *h = static_cast<uint16_t *>(p) + i;
    const __m128i b = v_to_bf16(v);
    if (n >= 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i *>(h), b);
    } else if (n > 0) {
        alignas(16) uint16_t t[8];
        _mm_store_si128(reinterpret_cast<__m128i *>(t), b);
        std::memcpy(h, t, 2 * n);
    }
}

// ------------------------------------------------------------------------------------------------------------
// Vector math. The activations dominate the epilogue, and for a short K the whole layer (M = 4096, K = 64, N = 512
// gelu: the GEMM ~2.5 ms, gelu on the 2M outputs ~2 ms on one core), so the level's own parts of them (below; the rest
// is fused_linear_simd.h's) are cheaper forms of the AVX-512 kernels', fitted for this file, accurate to ~1e-6
// relative: exp's 2^n built in the exponent bits for arguments clamped to >= -87.3 (the result stays normal; below
// e^-87.3 = 1.2e-38 the activations' results are 0 or denormal in fp32 anyway), 1 / d as vrcpps + one Newton step
// (~1e-7) instead of vdivps, gelu and its derivative as odd rational functions (no exp: v_gelu, v_gelu_grad). Cycles
// per 8 elements on one core (Zen 4, AVX2): silu 17 -> 13, gelu_tanh 20 -> 16 (PyTorch's AVX2 gelu: ~25); gelu
// (Zen 2): 17.8 with erfc and exp, 9.0 as a rational function.
// ------------------------------------------------------------------------------------------------------------
// x P(x^2) / Q(x^2), P and Q by Horner (the coefficients highest power first); vdivps for the quotient: it runs
// beside the FMA pipes (Zen 2, L1-resident loop: gelu 9.0 cycles per 8 elements with vdivps, 11.2 with vrcpps + a
// Newton step).
template <size_t NP, size_t NQ>
FA FA_INLINE __m256 v_odd_rational(__m256 x, const float (&p)[NP], const float (&q)[NQ]) {
    const __m256 u = _mm256_mul_ps(x, x);
    __m256 a = _mm256_set1_ps(p[0]), b = _mm256_set1_ps(q[0]);
#pragma GCC unroll 8
    for (size_t i = 1; i < NP; ++i)
        a = _mm256_fmadd_ps(a, u, _mm256_set1_ps(p[i]));
#pragma GCC unroll 8
    for (size_t i = 1; i < NQ; ++i)
        b = _mm256_fmadd_ps(b, u, _mm256_set1_ps(q[i]));
    return _mm256_div_ps(_mm256_mul_ps(x, a), b);
}

// gelu(x) = 0.5 x (1 + erf(z)), z = x / sqrt2, erf(z) = z P(z^2) / Q(z^2) with P, Q of degree 5, minimax-fitted for
// this file on [0, 3.92] (beyond it erf rounds to 1 in fp32; fit error 1e-8, 3.5e-7 evaluated in fp32): no exp, no
// erfc. z is clamped to +-4, where the quotient evaluates to 1.00000012, and the quotient to [-1, 1] (near the end of
// the range it wobbles an ulp around 1): erf is exactly +-1 for |x| >= 5.66, so gelu(x) is exactly 0 below -5.66
// however large |x| (0.5 x times a residue would be -3e22 at -1e30) and exactly x above 5.66. 2x cheaper than the
// erfc form (Zen 2, one core: 17.8 -> 9.0 cycles per 8 elements; at M = 4096, K = 64, N = 512 the gelu was a third of
// the layer). Error against float64 on [-12, 12]: 7.8e-7 absolute, relative 1.7e-7 for x > 0 (PyTorch's AVX2 F.gelu:
// 3.8e-7, 4.5e-7); for x < 0 the sum 1 + erf cancels as in PyTorch's (relative 7.6e-5 on [-3, 0), PyTorch's 6.1e-5,
// at most 7.8e-7 absolute). NaN propagates.
constexpr float kGeluErfP[] = {1.9859765e-06f, 0.000289733434f, 0.00403526146f,
                               0.0535846278f,  0.196866021f,    1.12837911f};
constexpr float kGeluErfQ[] = {3.76781718e-05f, 0.0012254942f, 0.0155128287f, 0.116762616f, 0.507799208f, 1.f};
FA FA_INLINE __m256 v_gelu(__m256 x) {
    __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(kSqrt1_2));
    z = _mm256_min_ps(_mm256_set1_ps(4.f), _mm256_max_ps(_mm256_set1_ps(-4.f), z)); // NaN: the second operand
    __m256 e = v_odd_rational(z, kGeluErfP, kGeluErfQ);
    e = _mm256_min_ps(_mm256_set1_ps(1.f), _mm256_max_ps(_mm256_set1_ps(-1.f), e));
    const __m256 hx = _mm256_mul_ps(x, _mm256_set1_ps(0.5f));
    return _mm256_fmadd_ps(hx, e, hx);
}

// gelu'(x) = Phi(x) + x phi(x) = 0.5 + x P(x^2) / Q(x^2) (Phi - 0.5 and x phi are odd), P, Q of degree 5
// minimax-fitted for this file on [0, 5.8]: 3.3e-7 absolute against float64 (PyTorch's gelu_backward: 2.6e-7), no
// exp. x is clamped to +-5.70104885, a point where the quotient evaluates to exactly 0.5: the derivative is then
// exactly 1 above it and exactly 0 below its negative (the true values are within 2e-7 of those). At +-inf the result
// is NaN, as PyTorch's gelu_backward (x phi(x) = inf * 0) and the other levels give: + x * 0, one FMA.
constexpr float kGeluGradP[] = {1.92888123e-07f, 3.5955698e-05f, 1.90868432e-05f,
                                0.0142302709f,   -0.0310028512f, 0.797885239f};
constexpr float kGeluGradQ[] = {8.95178437e-06f, 0.000192013817f, 0.00352232414f, 0.0409778282f, 0.294484675f, 1.f};
FA FA_INLINE __m256 v_gelu_grad(__m256 x) {
    constexpr float kClamp = 5.70104885f;
    const __m256 c = _mm256_min_ps(_mm256_set1_ps(kClamp), _mm256_max_ps(_mm256_set1_ps(-kClamp), x));
    const __m256 d = _mm256_add_ps(_mm256_set1_ps(0.5f), v_odd_rational(c, kGeluGradP, kGeluGradQ));
    return _mm256_fmadd_ps(x, _mm256_setzero_ps(), d); // d + x * 0: NaN at x = +-inf, d (exactly) elsewhere
}

// ------------------------------------------------------------------------------------------------------------
// The vector traits of this level (fused_linear_simd.h, fused_linear_epilogue.h): 8 fp32 lanes, the last ones masked
// by a count of valid lanes.
// ------------------------------------------------------------------------------------------------------------
#define FL_SIMD FA
#include "fused_linear_simd.h"

struct Avx2Vec {
    using Vec = __m256;
    using Mask = int64_t; // valid lanes (>= 8: all)
    static constexpr int kLanes = 8;
    static constexpr uintptr_t kStreamAlign = 32;
    static FA FA_INLINE Mask mask(int64_t n) { return n; }
    static FA FA_INLINE bool full(Mask n) { return n >= 8; }
    static FA FA_INLINE Vec loadf(const float *p, Mask n) { return v_loadf(p, n); }
    static FA FA_INLINE void storef(float *p, Vec v, Mask n) { v_store(p, DType::F32, 0, v, n); }
    static FA FA_INLINE Vec load(const void *p, DType dt, int64_t i, Mask n) { return v_load(p, dt, i, n); }
    static FA FA_INLINE void store(void *p, DType dt, int64_t i, Vec v, Mask n) { v_store(p, dt, i, v, n); }
    static FA FA_INLINE Vec round_bf16(Vec v) { return v_round_bf16(v); }
    static FA FA_INLINE void stream(float *p, Vec v) { _mm256_stream_ps(p, v); }
    static FA FA_INLINE void fence() { _mm_sfence(); }
    static FA FA_INLINE void zero(float *p, int64_t n) { std::fill(p, p + n, 0.f); }
    static FA FA_INLINE Vec set1(float f) { return _mm256_set1_ps(f); }
    static FA FA_INLINE Vec setzero() { return _mm256_setzero_ps(); }
    static FA FA_INLINE Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
    static FA FA_INLINE Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
    static FA FA_INLINE Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
    static FA FA_INLINE Vec round(Vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static FA FA_INLINE Vec neg_abs(Vec v) { return _mm256_or_ps(v, _mm256_set1_ps(-0.f)); }
    static FA FA_INLINE Vec blend_neg(Vec z, Vec a, Vec b) {
        return _mm256_blendv_ps(a, b, _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
    }
    static FA FA_INLINE Vec pos_mask(Vec p, Vec v) {
        return _mm256_and_ps(_mm256_cmp_ps(p, _mm256_setzero_ps(), _CMP_GT_OQ), v);
    }
    static FA FA_INLINE Vec rcp_approx(Vec d) { return _mm256_rcp_ps(d); } // vrcpps: 12 bits
    // exp(x) for x <= 0 (exp_poly). NaN is kept (vmaxps returns the second operand when one is NaN). Below -87.3
    // (where 2^n would leave the normal range) the result is 0, not the clamp's e^-87.3 = 1.2e-38: otherwise
    // silu(-1e38) = -1e38 * 1.2e-38 = -1.22 and silu(-inf) = -inf instead of PyTorch's -0 and NaN (issue 34); the true
    // e^x there is below 1.2e-38, so silu is off by at most 1.3e-36 absolute.
    static FA FA_INLINE Vec exp_neg(Vec x) {
        const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ); // false for NaN
        __m256 n;
        const __m256 p = exp_poly<Avx2Vec>(_mm256_max_ps(_mm256_set1_ps(-87.3f), x), n);
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e))); // n in [-126, 0]: 2^n is normal
    }
    static FA FA_INLINE Vec gelu(Vec x) { return v_gelu(x); }
    static FA FA_INLINE Vec gelu_grad(Vec x) { return v_gelu_grad(x); }
    static FA FA_INLINE float hsum(Vec v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static FA FA_INLINE Vec unpacklo32(Vec a, Vec b) { return _mm256_unpacklo_ps(a, b); }
    static FA FA_INLINE Vec unpackhi32(Vec a, Vec b) { return _mm256_unpackhi_ps(a, b); }
    static FA FA_INLINE Vec unpacklo64(Vec a, Vec b) { return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)); }
    static FA FA_INLINE Vec unpackhi64(Vec a, Vec b) { return _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)); }
    static FA FA_INLINE void transpose_lanes(Vec (&r)[8], Vec (&)[8]) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
            const __m256 a = r[q], b = r[4 + q];
            r[q] = _mm256_permute2f128_ps(a, b, 0x20);
            r[q + 4] = _mm256_permute2f128_ps(a, b, 0x31);
        }
    }
};

#include "fused_linear_epilogue.h"
#undef FL_SIMD

// ------------------------------------------------------------------------------------------------------------
// fgemm: packed-panel fp32 GEMM (see kernels.h). Layouts:
//   A: ap[((kb * P) + i) * KC * MR + k * MR + r] = A[i * MR + r][kb * KC + k], P = ceil(M / MR) panels: the panels of
//      one K block are contiguous, in the order the micro kernels walk them.
//   B block (one strip of NC columns, one K block): bp[(jr * KC + k) * NR + j] = B[pc + k][nc + jr * NR + j].
// Out-of-range rows / columns are packed as zeros; k beyond K is never read (the micro kernel runs kc steps).
// ------------------------------------------------------------------------------------------------------------

// 8 elements of an operand row as fp32 (n valid, zeros beyond), fp32 values optionally rounded to bf16.
FA FA_INLINE __m256 load_operand(const void *p, DType dt, int64_t i, int64_t n, bool round) {
    const __m256 v = v_load(p, dt, i, n);
    return (round && dt == DType::F32) ? v_round_bf16(v) : v;
}

FA void fgemm_pack_a_avx2(const FgemmArgs &g, int64_t panel0, int64_t panel1, float *ap) {
    const int64_t M = g.M, K = g.K, P = (M + kFgMR - 1) / kFgMR;
    const GemmOperand &a = g.a;
    const size_t esz = a.dtype == DType::F32 ? 4 : 2;
    const char *base = static_cast<const char *>(a.ptr);
    if (a.trans) { // A[i][k] = a[k * lda + i]: 6 contiguous elements of a row of a per k and panel
        // Rows of a are walked in chunks of 16 across all the panels (each row read once, while in L1), not panel by
        // panel over all of K, which read every row once per panel from L3 or DRAM. A full 8-element load where the
        // row has 2 more elements (a partial bf16 load goes through a stack copy). The transposed dpre of
        // grad_weight, Zen 2, 2 threads, grad_weight time, 4096 x 64 x 512: bf16 4.81 -> 2.88 ms (the full loads),
        // fp32 3.06 -> 2.66-2.90 ms (the row chunks; three runs); 64 x 64 x 512 bf16 163 -> 55-90 us.
        constexpr int64_t kChunk = 16;
        for (int64_t pc = 0; pc < K; pc += kFgKC) {
            const int64_t kc = std::min(kFgKC, K - pc);
            for (int64_t k0 = 0; k0 < kc; k0 += kChunk) {
                const int64_t k1 = std::min(kc, k0 + kChunk);
                for (int64_t i = panel0; i < panel1; ++i) {
                    const int64_t i0 = i * kFgMR, rows = std::min<int64_t>(kFgMR, M - i0);
                    const int64_t n = rows == kFgMR && i0 + 8 <= a.ld ? 8 : rows;
                    float *dst = ap + ((pc / kFgKC) * P + i) * kFgKC * kFgMR;
                    for (int64_t k = k0; k < k1; ++k) {
                        const __m256 v = v_load(base + ((pc + k) * a.ld + i0) * esz, a.dtype, 0, n);
                        _mm_storeu_ps(dst + k * kFgMR, _mm256_castps256_ps128(v));
                        _mm_storel_pi(reinterpret_cast<__m64 *>(dst + k * kFgMR + 4), _mm256_extractf128_ps(v, 1));
                    }
                }
            }
        }
        return;
    }
    for (int64_t i = panel0; i < panel1; ++i) {
        const int64_t i0 = i * kFgMR, rows = std::min<int64_t>(kFgMR, M - i0);
        for (int64_t pc = 0; pc < K; pc += kFgKC) {
            const int64_t kc = std::min(kFgKC, K - pc);
            float *dst = ap + ((pc / kFgKC) * P + i) * kFgKC * kFgMR;
            // A[i][k] = a[i * lda + k]: 6 rows x 8 k transposed in registers (2 zero rows)
            for (int64_t k = 0; k < kc; k += 8) {
                __m256 r[8];
#pragma GCC unroll 6
                for (int q = 0; q < kFgMR; ++q)
                    r[q] =
                        q < rows ? v_load(base + (i0 + q) * a.ld * esz, a.dtype, pc + k, kc - k) : _mm256_setzero_ps();
                r[6] = r[7] = _mm256_setzero_ps();
                transpose<Avx2Vec>(r);
                const int64_t kn = std::min<int64_t>(8, kc - k);
                for (int64_t q = 0; q < kn; ++q) {
                    _mm_storeu_ps(dst + (k + q) * kFgMR, _mm256_castps256_ps128(r[q]));
                    _mm_storel_pi(reinterpret_cast<__m64 *>(dst + (k + q) * kFgMR + 4), _mm256_extractf128_ps(r[q], 1));
                }
            }
        }
    }
}

// 8 k of an int8 weight row (n valid, zeros beyond) dequantized: q * group code (exact) * the row's scale.
FA FA_INLINE __m256 load_int8_weight(const Int8Weight &w, int64_t j, int64_t k, int64_t n) {
    const int8_t *src = w.q + j * w.ldq + k;
    __m128i b8;
    if (n >= 8) {
        b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(src));
    } else { // tail: no byte past the row is read
        alignas(16) int8_t t[16] = {};
        std::memcpy(t, src, static_cast<size_t>(n));
        b8 = _mm_load_si128(reinterpret_cast<const __m128i *>(t));
    }
    __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
    if (w.group) // k is a multiple of 8, groups of 16: one code
        v = _mm256_mul_ps(v, _mm256_set1_ps(static_cast<float>(w.group[j * w.ldg + k / 16])));
    return _mm256_mul_ps(v, _mm256_set1_ps(w.scale[j]));
}

// 8 k (k % 8 == 0, K % 32 == 0) of an int4 weight row dequantized: (u - z) * s, exact. In a 32-k block, k 0..15 are
// the low nibbles of its 16 bytes and k 16..31 the high ones (int4_kernels.h).
FA FA_INLINE __m256 load_int4_weight(const Int4Weight &w, int64_t K, int64_t j, int64_t k) {
    const int64_t groups = K / w.group, g = k / w.group, i = k % 32;
    const uint8_t *src = w.q + j * (K / 2) + (k / 32) * 16 + (i & 15);
    __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(src));
    if (i >= 16)
        b8 = _mm_srli_epi16(b8, 4);
    const int z = w.zeros ? w.zeros[j * groups + g] : 8;
    b8 = _mm_sub_epi8(_mm_and_si128(b8, _mm_set1_epi8(0x0F)), _mm_set1_epi8(static_cast<char>(z)));
    const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8));
    return _mm256_mul_ps(v, _mm256_set1_ps(_cvtsh_ss(w.scales[j * groups + g])));
}

// The columns [nc, nc + 16 * njr) of B over the whole K into the strip buffer bp (layout above): B trans 8 weight rows
// at a time, each read over its whole K in order; B rows row by row (only for short K: see fgemm_strip_mode). Not
// inlined into its one caller, fgemm_block_strips: inlined there, 64 x 4096 x 4096 bf16 gelu forward ran 6 % slower
// (Zen 4 capped to AVX2, 1 thread, 25.4 -> 27.1 ms).
FA __attribute__((noinline)) void fgemm_pack_b(const FgemmArgs &g, int64_t nc, int64_t njr, float *bp) {
    const GemmOperand &b = g.b;
    const int64_t N = g.N, K = g.K;
    const size_t esz = b.dtype == DType::F32 ? 4 : 2;
    const char *base = static_cast<const char *>(b.ptr);
    const bool rnd = g.round_b && b.dtype == DType::F32;
    auto at = [&](int64_t jr, int64_t k) {
        return bp + (((k / kFgKC) * kFgStripPanels + jr) * kFgKC + k % kFgKC) * kFgNR;
    };
    if (!b.trans) { // B[k][j] = b[k * ldb + j]: 16 contiguous elements per k and micro panel
        for (int64_t k = 0; k < K; ++k) {
            const char *row = base + (k * b.ld + nc) * esz;
            for (int64_t jr = 0; jr < njr; ++jr) {
                const int64_t nv = N - nc - jr * kFgNR;
                float *dst = at(jr, k);
                _mm256_store_ps(dst, load_operand(row, b.dtype, jr * kFgNR, nv, rnd));
                _mm256_store_ps(dst + 8, load_operand(row, b.dtype, jr * kFgNR + 8, nv - 8, rnd));
            }
        }
        return;
    }
    // B[k][j] = b[j * ldb + k] (weight rows j): 8 rows x 8 k transposed in registers
    for (int64_t jr = 0; jr < njr; ++jr)
        for (int h = 0; h < 2; ++h) {
            const int64_t j0 = nc + jr * kFgNR + 8 * h, rows = std::min<int64_t>(8, N - j0);
            for (int64_t k = 0; k < K; k += 8) {
                __m256 r[8];
#pragma GCC unroll 8
                for (int q = 0; q < 8; ++q)
                    r[q] = q >= rows ? _mm256_setzero_ps()
                           : g.bq.q  ? load_int8_weight(g.bq, j0 + q, k, K - k)
                           : g.b4.q  ? load_int4_weight(g.b4, K, j0 + q, k)
                                     : load_operand(base + (j0 + q) * b.ld * esz, b.dtype, k, K - k, rnd);
                transpose<Avx2Vec>(r);
                float *dst = at(jr, k) + 8 * h;
                const int64_t kn = std::min<int64_t>(8, K - k);
                for (int64_t q = 0; q < kn; ++q)
                    _mm256_store_ps(dst + q * kFgNR, r[q]);
            }
        }
}

// C[6][16] = cin + sum_k A-panel[k][6] x B-panel[k][16] (cin: the sums of the previous K blocks, row stride ldc, or
// null for zeros): 12 ymm accumulators, per k 2 B loads, 6 broadcasts, 12 FMAs.
FA FA_INLINE void fgemm_accumulate(__m256 (&c0)[kFgMR], __m256 (&c1)[kFgMR], const float *cin, int64_t ldc, int64_t kc,
                                   const float *a, const float *b) {
#pragma GCC unroll 6
    for (int r = 0; r < kFgMR; ++r) {
        c0[r] = cin ? _mm256_load_ps(cin + r * ldc) : _mm256_setzero_ps();
        c1[r] = cin ? _mm256_load_ps(cin + r * ldc + 8) : _mm256_setzero_ps();
    }
#pragma GCC unroll 2
    for (int64_t k = 0; k < kc; ++k) {
        const __m256 b0 = _mm256_load_ps(b + k * kFgNR), b1 = _mm256_load_ps(b + k * kFgNR + 8);
#pragma GCC unroll 6
        for (int r = 0; r < kFgMR; ++r) {
            const __m256 av = _mm256_broadcast_ss(a + k * kFgMR + r);
            c0[r] = _mm256_fmadd_ps(av, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(av, b1, c1[r]);
        }
    }
}

FA void fgemm_micro(int64_t kc, const float *a, const float *b, float *c, int64_t ldc, bool accumulate) {
    __m256 c0[kFgMR], c1[kFgMR];
    fgemm_accumulate(c0, c1, accumulate ? c : nullptr, ldc, kc, a, b);
#pragma GCC unroll 6
    for (int r = 0; r < kFgMR; ++r) {
        _mm256_store_ps(c + r * ldc, c0[r]);
        _mm256_store_ps(c + r * ldc + 8, c1[r]);
    }
}

// The last K block of a full 6 x 16 tile with the epilogue applied in registers (rows row0.., columns col0..): the
// output stores are spread over the computation instead of one burst per strip afterwards (M = 4096, K = 64, N = 512
// fp32, bias only: 3.58 -> 3.23 ms, gelu 5.25 -> 4.95 ms on one core). cin: the sums of the previous K blocks, or null.
template <Act A>
FA void fgemm_micro_epi(int64_t kc, const float *a, const float *b, const float *cin, int64_t ldc, const Epilogue &e,
                        int64_t row0, int64_t col0) {
    __m256 c0[kFgMR], c1[kFgMR];
    fgemm_accumulate(c0, c1, cin, ldc, kc, a, b);
    if (e.bias) {
        const __m256 b0 = _mm256_loadu_ps(e.bias + col0), b1 = _mm256_loadu_ps(e.bias + col0 + 8);
#pragma GCC unroll 6
        for (int r = 0; r < kFgMR; ++r) {
            c0[r] = _mm256_add_ps(c0[r], b0);
            c1[r] = _mm256_add_ps(c1[r], b1);
        }
    }
    if (e.pre)
#pragma GCC unroll 6
        for (int r = 0; r < kFgMR; ++r) {
            v_store(e.pre, e.out_dtype, (row0 + r) * e.ld_pre + col0, c0[r], 8);
            v_store(e.pre, e.out_dtype, (row0 + r) * e.ld_pre + col0 + 8, c1[r], 8);
        }
#pragma GCC unroll 6
    for (int r = 0; r < kFgMR; ++r) {
        c0[r] = act<Avx2Vec, A>(c0[r]);
        c1[r] = act<Avx2Vec, A>(c1[r]);
    }
#pragma GCC unroll 6
    for (int r = 0; r < kFgMR; ++r) {
        const int64_t o = (row0 + r) * e.ld_out + col0;
        if (e.res) {
            const int64_t q = (row0 + r) * e.ld_res + col0;
            c0[r] = _mm256_add_ps(c0[r], v_load(e.res, e.res_dtype, q, 8));
            c1[r] = _mm256_add_ps(c1[r], v_load(e.res, e.res_dtype, q + 8, 8));
        }
        float *dst = static_cast<float *>(e.out) + o;
        if (e.stream && e.out_dtype == DType::F32 && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
            _mm256_stream_ps(dst, c0[r]);
            _mm256_stream_ps(dst + 8, c1[r]);
        } else {
            v_store(e.out, e.out_dtype, o, c0[r], 8);
            v_store(e.out, e.out_dtype, o + 8, c1[r], 8);
        }
    }
}

using MicroEpiFn = void (*)(int64_t, const float *, const float *, const float *, int64_t, const Epilogue &, int64_t,
                            int64_t);
MicroEpiFn micro_epi_for(Act a) {
    switch (a) {
    case Act::Relu:
        return fgemm_micro_epi<Act::Relu>;
    case Act::Gelu:
        return fgemm_micro_epi<Act::Gelu>;
    case Act::GeluTanh:
        return fgemm_micro_epi<Act::GeluTanh>;
    case Act::Silu:
        return fgemm_micro_epi<Act::Silu>;
    default:
        return fgemm_micro_epi<Act::None>;
    }
}

// One 6 x 16 tile (rows i.. of [.., me), micro panel jr of a strip of ncw columns starting at column col0) for K block
// [pc, pc + kc): the last block of a full tile goes through the register epilogue, a partial one through the buffer.
FA FA_INLINE void fgemm_tile(int64_t kc, const float *ai, const float *bj, float *ct, int64_t ldc, bool first,
                             bool last, const Epilogue &e, MicroEpiFn epi, int64_t i, int64_t me, int64_t col0,
                             int64_t cols) {
    const int64_t rows = std::min<int64_t>(kFgMR, me - i), cw = std::min<int64_t>(kFgNR, cols);
    if (last && rows == kFgMR && cw == kFgNR)
        return epi(kc, ai, bj, first ? nullptr : ct, ldc, e, i, col0);
    fgemm_micro(kc, ai, bj, ct, ldc, !first);
    if (last)
        simd_epilogue<Avx2Vec>(e, ct, ldc, i, rows, col0, cw);
}

// Strip mode: per strip of kFgNC columns, B packed over the whole K, then every super block of kFgMS rows runs the K
// blocks with its sums in the workspace; the epilogue per (super block, strip). B is read and packed once.
FA void fgemm_block_strips(const FgemmArgs &g, const float *ap, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                           const Epilogue &e, float *ws) {
    float *cb = ws;
    float *bp = cb + kFgMS * kFgNC;
    const MicroEpiFn epi = micro_epi_for(e.act);
    const int64_t K = g.K, P = (g.M + kFgMR - 1) / kFgMR;
    for (int64_t nc = n0; nc < n1; nc += kFgNC) {
        const int64_t ncw = std::min(kFgNC, n1 - nc), njr = (ncw + kFgNR - 1) / kFgNR;
        fgemm_pack_b(g, nc, njr, bp);
        for (int64_t ms = m0; ms < m1; ms += kFgMS) {
            const int64_t me = std::min(m1, ms + kFgMS);
            for (int64_t pc = 0; pc < K; pc += kFgKC) {
                const int64_t kc = std::min(kFgKC, K - pc), kb = pc / kFgKC;
                const float *bk = bp + kb * kFgStripPanels * kFgKC * kFgNR;
                // micro panel outer: its 16 KB of B stay in L1 while the A panels stream from L2 (4 B per FMA-cycle
                // instead of 11 for B; 512 x 384 x 384 gelu -1.5 %, 128 x 4096 x 4096 -2 to -5 %)
                for (int64_t jr = 0; jr < njr; ++jr)
                    for (int64_t i = ms; i < me; i += kFgMR)
                        fgemm_tile(kc, ap + (kb * P + i / kFgMR) * kFgKC * kFgMR, bk + jr * kFgKC * kFgNR,
                                   cb + (i - ms) * kFgNC + jr * kFgNR, kFgNC, pc == 0, pc + kFgKC >= K, e, epi, i, me,
                                   nc + jr * kFgNR, ncw - jr * kFgNR);
            }
        }
    }
}

// B rows (B[k][j] = b[k * ldb + j]: the backward's weight and x): K blocks outermost, each packed for all the block's
// columns [n0, n1) row segment by row segment, the sums of a super block of rows x all columns in the workspace.
// (Packing one strip over the whole K read 256 B of each of the N weight rows per strip - for grad_x 4096 rows 16 KB
// apart - and missed the TLB on every row: M = 6, K = N = 4096 grad_x 18 ms for ~2.5 ms of arithmetic.)
// Layout of a packed K block: bp[((s * kFgStripPanels + jr) * kFgKC + k) * kFgNR + j], s = strip of kFgNC columns.
FA void fgemm_block_rows(const FgemmArgs &g, const float *ap, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                         const Epilogue &e, float *ws) {
    const GemmOperand &b = g.b;
    const int64_t K = g.K, P = (g.M + kFgMR - 1) / kFgMR, cols = n1 - n0, cp = fgemm_cols_pad(cols);
    const int64_t msz = std::min(fgemm_rows_ms(cols), (m1 - m0 + kFgMR - 1) / kFgMR * kFgMR);
    float *cb = ws;
    float *bp = cb + msz * cp;
    const size_t esz = b.dtype == DType::F32 ? 4 : 2;
    const bool rnd = g.round_b && b.dtype == DType::F32;
    const int64_t units = (cols + kFgNR - 1) / kFgNR, strips = cp / kFgNC;
    const MicroEpiFn epi = micro_epi_for(e.act);
    for (int64_t ms = m0; ms < m1; ms += msz) {
        const int64_t me = std::min(m1, ms + msz);
        for (int64_t pc = 0; pc < K; pc += kFgKC) {
            const int64_t kc = std::min(kFgKC, K - pc), kb = pc / kFgKC;
            for (int64_t k = 0; k < kc; ++k) {
                const char *row = static_cast<const char *>(b.ptr) + ((pc + k) * b.ld + n0) * esz;
                for (int64_t u = 0; u < units; ++u) {
                    float *dst = bp + (u * kFgKC + k) * kFgNR; // (s * 4 + jr) == u
                    _mm256_store_ps(dst, load_operand(row, b.dtype, u * kFgNR, cols - u * kFgNR, rnd));
                    _mm256_store_ps(dst + 8, load_operand(row, b.dtype, u * kFgNR + 8, cols - u * kFgNR - 8, rnd));
                }
            }
            for (int64_t st = 0; st < strips; ++st) {
                const int64_t njr = std::min<int64_t>(kFgStripPanels, units - st * kFgStripPanels);
                for (int64_t jr = 0; jr < njr; ++jr) {
                    const int64_t c = st * kFgNC + jr * kFgNR;
                    for (int64_t i = ms; i < me; i += kFgMR)
                        fgemm_tile(kc, ap + (kb * P + i / kFgMR) * kFgKC * kFgMR,
                                   bp + (st * kFgStripPanels + jr) * kFgKC * kFgNR, cb + (i - ms) * cp + c, cp, pc == 0,
                                   pc + kFgKC >= K, e, epi, i, me, n0 + c, cols - c);
                }
            }
        }
    }
}

FA void fgemm_block_avx2(const FgemmArgs &g, const float *ap, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                         const Epilogue &epi, void *workspace) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    Epilogue e = epi;
    e.fence = false; // streamed stores are fenced once at the end
    if (fgemm_strip_mode(g))
        fgemm_block_strips(g, ap, m0, m1, n0, n1, e, reinterpret_cast<float *>(p));
    else
        fgemm_block_rows(g, ap, m0, m1, n0, n1, e, reinterpret_cast<float *>(p));
    if (epi.stream && epi.fence)
        _mm_sfence();
}

// ------------------------------------------------------------------------------------------------------------
// Small-M forward: inner products of the M x rows with weight rows streamed once (each weight byte loaded once, R
// rows in flight), MT x R accumulators, horizontal sums at the end. x is converted once per call into the workspace
// as fp32, in the lane order the weight is widened in: a bf16 weight vector of 16 elements is split by unpacklo /
// unpackhi with zero (elements 0-3 8-11 | 4-7 12-15), so x is stored in that order per 16 elements; fp32 weights
// (rounded to bf16 for bf16 x) keep the natural order.
// ------------------------------------------------------------------------------------------------------------
// Weight element types of the broadcast / streaming kernels.
enum WType : int { kWF32 = 0, kWBF16 = 1, kWF32Round = 2 };

constexpr int64_t kStreamNB = 48; // weight rows per epilogue block

inline int64_t stream_kp(int64_t K) { // K rounded up to whole 16-element steps
    return (K + 15) / 16 * 16;
}

FA void stream_pack_x(const void *x, DType xd, int64_t ldx, int64_t M, int64_t K, bool permute, float *xp) {
    const int64_t kp = stream_kp(K);
    for (int64_t m = 0; m < M; ++m) {
        const char *row = static_cast<const char *>(x) + m * ldx * (xd == DType::F32 ? 4 : 2);
        float *dst = xp + m * kp;
        for (int64_t k = 0; k < kp; k += 16) {
            const __m256 a = v_load(row, xd, k, K - k), b = v_load(row, xd, k + 8, K - k - 8);
            if (permute) { // (0-3 8-11 | 4-7 12-15)
                _mm256_store_ps(dst + k, _mm256_permute2f128_ps(a, b, 0x20));
                _mm256_store_ps(dst + k + 8, _mm256_permute2f128_ps(a, b, 0x31));
            } else {
                _mm256_store_ps(dst + k, a);
                _mm256_store_ps(dst + k + 8, b);
            }
        }
    }
}

// WT: 0 = fp32 weight, 1 = bf16 weight, 2 = fp32 weight rounded to bf16. One 16-element step of an MT x R tile (TAIL:
// only rem < 16 elements are valid; the weight beyond them is never read and x is zero-padded).
// x: the packed x rows (stream_pack_x, row stride kp), w / ldw: the weight rows and their stride in bytes.
template <int MT, int R, int WT> struct StreamStep : DotRows<float, char> {
    template <bool TAIL> FA FA_INLINE void run(__m256 (&acc)[MT][R], int64_t k, int64_t rem) const {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            __m256 lo, hi;
            if constexpr (WT == kWBF16) {
                const uint16_t *h = reinterpret_cast<const uint16_t *>(w + r * ldw) + k;
                __m256i v;
                if constexpr (TAIL) {
                    alignas(32) uint16_t t[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
                    std::memcpy(t, h, 2 * rem);
                    v = _mm256_load_si256(reinterpret_cast<const __m256i *>(t));
                } else {
                    v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(h));
                }
                lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
                hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
            } else {
                const float *f = reinterpret_cast<const float *>(w + r * ldw) + k;
                lo = TAIL ? v_loadf(f, rem) : _mm256_loadu_ps(f);
                hi = TAIL ? v_loadf(f + 8, rem - 8) : _mm256_loadu_ps(f + 8);
                if constexpr (WT == kWF32Round) {
                    lo = v_round_bf16(lo);
                    hi = v_round_bf16(hi);
                }
            }
#pragma GCC unroll 4
            for (int m = 0; m < MT; ++m) {
                acc[m][r] = _mm256_fmadd_ps(_mm256_load_ps(x + m * ldx + k), lo, acc[m][r]);
                acc[m][r] = _mm256_fmadd_ps(_mm256_load_ps(x + m * ldx + k + 8), hi, acc[m][r]);
            }
        }
    }
};

// (Software prefetching 512 B - 4 KB ahead in every row: no gain at 512 B, 15-30 % slower beyond; M = 1, K = 11008,
// N = 4096 bf16 streams ~21 GB/s on one core, eager fp32 F.linear ~19 GB/s.)
template <int MT, int R, int WT>
FA void stream_tile(const float *xp, int64_t K, const char *w, int64_t ldw_bytes, float *c, int64_t ldc) {
    dot_tile<Avx2Vec, MT, R, 16>(StreamStep<MT, R, WT>{{xp, stream_kp(K), w, ldw_bytes}}, K, c, ldc);
}

// R (weight rows per tile) by MT: MT * R accumulators + the weight vectors within 16 ymm registers.
template <int MT> constexpr int stream_r() {
    return MT == 1 ? 8 : MT == 2 ? 4 : MT == 3 ? 4 : 3;
}

// The nrows weight rows at w against mt (1-4) rows of x.
template <int WT>
FA void stream_rows(int64_t mt, const float *xp, int64_t K, const char *w, int64_t ldw_bytes, int64_t nrows, float *c,
                    int64_t ldc) {
    by_count<4>(mt, [&](auto MT) FA {
        by_row_tiles<stream_r<MT>()>(nrows, [&](int64_t r, auto R) FA {
            stream_tile<MT, R, WT>(xp, K, w + r * ldw_bytes, ldw_bytes, c + r, ldc);
        });
    });
}

constexpr int64_t kStreamMaxM = 4;

size_t stream_workspace_bytes(int64_t M, int64_t K) {
    return 64 + sizeof(float) * (M * kStreamNB + M * stream_kp(K));
}

// x in xd (bf16 or fp32); w bf16 or fp32 (rounded to bf16 when x is bf16).
FA void stream_forward(const void *x, DType xd, int64_t ldx, int64_t M, const void *w, DType wd, int64_t ldw, int64_t K,
                       int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    float *cb = reinterpret_cast<float *>(p);
    float *xp = cb + M * kStreamNB;
    const int wt = wd == DType::BF16 ? kWBF16 : xd == DType::BF16 ? kWF32Round : kWF32;
    stream_pack_x(x, xd, ldx, M, K, wt == kWBF16, xp);
    const int64_t kp = stream_kp(K);
    const size_t esz = wd == DType::F32 ? 4 : 2;
    for (int64_t nb = n0; nb < n1; nb += kStreamNB) {
        const int64_t nr = std::min(kStreamNB, n1 - nb);
        const char *wrows = static_cast<const char *>(w) + nb * ldw * esz;
        for (int64_t m = 0; m < M; m += 4) {
            const int64_t mt = std::min<int64_t>(4, M - m);
            const float *xm = xp + m * kp;
            float *cm = cb + m * kStreamNB;
            if (wt == kWBF16)
                stream_rows<kWBF16>(mt, xm, K, wrows, ldw * esz, nr, cm, kStreamNB);
            else if (wt == kWF32Round)
                stream_rows<kWF32Round>(mt, xm, K, wrows, ldw * esz, nr, cm, kStreamNB);
            else
                stream_rows<kWF32>(mt, xm, K, wrows, ldw * esz, nr, cm, kStreamNB);
        }
        simd_epilogue<Avx2Vec>(epi, cb, kStreamNB, 0, M, nb, nr);
    }
}

// ------------------------------------------------------------------------------------------------------------
// Mid-M forward (kStreamMaxM < M <= kBcastMaxM): the weight rows are read in place, each once, and their elements are
// broadcast against x^T, packed once per call as vectors of 8 m (xt[(k * J + j) * 8 + l] = x[8 j + l][k], zero past
// M): a tile of RW weight rows x J vectors of m, RW * J accumulators, per k J x^T loads, RW broadcasts, RW * J FMAs -
// no packing of the weight (the fgemm's transposes of the weight cost ~25 % at M = 16) and no horizontal sums. A bf16
// weight element is broadcast from the dword holding its pair: << 16 for the even one, & 0xFFFF0000 for the odd one
// (exact). fp32 master weights with bf16 x are rounded to bf16 tile by tile into the workspace first.
// ------------------------------------------------------------------------------------------------------------
constexpr int64_t kBcastMaxM = 32;

FA void bcast_pack_xt(const void *x, DType xd, int64_t ldx, int64_t M, int64_t K, float *xt) {
    const int J = static_cast<int>((M + 7) / 8);
    const size_t esz = xd == DType::F32 ? 4 : 2;
    for (int j = 0; j < J; ++j)
        for (int64_t k = 0; k < K; k += 8) {
            __m256 r[8];
#pragma GCC unroll 8
            for (int q = 0; q < 8; ++q) {
                const int64_t m = 8 * j + q;
                r[q] = m < M ? v_load(static_cast<const char *>(x) + m * ldx * esz, xd, k, K - k) : _mm256_setzero_ps();
            }
            transpose<Avx2Vec>(r);
            const int64_t kn = std::min<int64_t>(8, K - k);
            for (int64_t q = 0; q < kn; ++q)
                _mm256_store_ps(xt + ((k + q) * J + j) * 8, r[q]);
        }
}

// acc[i][j] lane l = result (m = 8 j + l, n = i): through a buffer (fully unrolled stores - an indexed access would
// make GCC keep the accumulators in memory inside the K loop), then scattered into c (rows m < M).
template <int RW, int J> FA FA_INLINE void bcast_scatter(const __m256 (&acc)[RW][J], float *c, int64_t ldc, int64_t M) {
    alignas(32) float tmp[RW * J * 8];
#pragma GCC unroll 8
    for (int i = 0; i < RW; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j)
            _mm256_store_ps(tmp + (i * J + j) * 8, acc[i][j]);
    for (int i = 0; i < RW; ++i)
        for (int64_t m = 0; m < std::min<int64_t>(M, 8 * J); ++m)
            c[m * ldc + i] = tmp[(i * J + m / 8) * 8 + m % 8];
}

// bf16 weight element k as fp32: the dword at element k - 1 with its low half cleared (one AND, no shift: vector shifts
// share the FMA ports on some cores); element 0 (FIRST) is read as the low half of the first pair, shifted, so no
// byte before a row is ever read.
template <bool FIRST> FA FA_INLINE __m256 bcast_even(const char *wi, int64_t kp, __m256 hmask) {
    int32_t pr;
    if constexpr (FIRST) {
        std::memcpy(&pr, wi, 4);
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(pr), 16));
    } else {
        std::memcpy(&pr, wi + kp * 4 - 2, 4);
        return _mm256_and_ps(_mm256_castsi256_ps(_mm256_set1_epi32(pr)), hmask);
    }
}

template <int RW, int J, bool FIRST>
FA FA_INLINE void bcast_kpair(__m256 (&acc)[RW][J], const char *w, int64_t ldw_bytes, const float *xt, int64_t kp,
                              __m256 hmask) {
    const float *x0 = xt + 2 * kp * J * 8;
    __m256 xv[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
        xv[j] = _mm256_load_ps(x0 + 8 * j);
#pragma GCC unroll 8
    for (int i = 0; i < RW; ++i) {
        const __m256 a = bcast_even<FIRST>(w + i * ldw_bytes, kp, hmask);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j)
            acc[i][j] = _mm256_fmadd_ps(a, xv[j], acc[i][j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
        xv[j] = _mm256_load_ps(x0 + J * 8 + 8 * j);
#pragma GCC unroll 8
    for (int i = 0; i < RW; ++i) {
        int32_t pr;
        std::memcpy(&pr, w + i * ldw_bytes + kp * 4, 4);
        const __m256 a = _mm256_and_ps(_mm256_castsi256_ps(_mm256_set1_epi32(pr)), hmask);
#pragma GCC unroll 4
        for (int j = 0; j < J; ++j)
            acc[i][j] = _mm256_fmadd_ps(a, xv[j], acc[i][j]);
    }
}

// RW weight rows at w (row stride ldw_bytes) against all of x^T; results into c (m rows x RW columns, ldc). WT:
// kWF32 (fp32 elements broadcast from the rows), kWBF16 (bf16, see bcast_kpair), kWF32Round (fp32 rows rounded to
// bf16 16 elements at a time into an L1 buffer on the stack, then broadcast from there: rounding whole rows into a
// workspace first streamed it through L2, M = 16, K = N = 4096: 45 -> 60 GFLOP/s on one core).
template <int RW, int J, int WT>
FA void bcast_tile(const char *w, int64_t ldw_bytes, const float *xt, int64_t K, float *c, int64_t ldc, int64_t M) {
    __m256 acc[RW][J];
    zero_tile<Avx2Vec>(acc);
    // Blocks of 16 k pairs / k: the prefetch (1 KB ahead in every row) sits outside the inner loop - a test inside it
    // made GCC keep the accumulators on the stack.
    if constexpr (WT == kWBF16) {
        const __m256 hmask = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
        const int64_t kpn = K / 2;
        if (kpn > 0)
            bcast_kpair<RW, J, true>(acc, w, ldw_bytes, xt, 0, hmask);
        for (int64_t kb = 1; kb < kpn; kb += 16) {
#pragma GCC unroll 8
            for (int i = 0; i < RW; ++i)
                _mm_prefetch(w + i * ldw_bytes + kb * 4 + 1024, _MM_HINT_T0);
            const int64_t ke = std::min(kpn, kb + 16);
            for (int64_t kp = kb; kp < ke; ++kp)
                bcast_kpair<RW, J, false>(acc, w, ldw_bytes, xt, kp, hmask);
        }
        if (K & 1) { // the last element of each row
            const float *x0 = xt + (K - 1) * J * 8;
#pragma GCC unroll 8
            for (int i = 0; i < RW; ++i) {
                uint16_t h;
                std::memcpy(&h, w + i * ldw_bytes + (K - 1) * 2, 2);
                const __m256 a = _mm256_set1_ps(bf16_to_f32(h));
#pragma GCC unroll 4
                for (int j = 0; j < J; ++j)
                    acc[i][j] = _mm256_fmadd_ps(a, _mm256_load_ps(x0 + 8 * j), acc[i][j]);
            }
        }
    } else {
        alignas(32) float wr[WT == kWF32Round ? RW * 16 : 1];
        for (int64_t kb = 0; kb < K; kb += 16) {
            const int64_t ke = std::min(K, kb + 16);
            const float *src[RW];
            if constexpr (WT == kWF32Round) {
#pragma GCC unroll 8
                for (int i = 0; i < RW; ++i) {
                    const float *f = reinterpret_cast<const float *>(w + i * ldw_bytes) + kb;
                    _mm_prefetch(reinterpret_cast<const char *>(f) + 1024, _MM_HINT_T0);
                    _mm256_store_ps(wr + 16 * i, v_round_bf16(v_loadf(f, ke - kb)));
                    _mm256_store_ps(wr + 16 * i + 8, v_round_bf16(v_loadf(f + 8, ke - kb - 8)));
                }
            } else {
#pragma GCC unroll 8
                for (int i = 0; i < RW; ++i)
                    _mm_prefetch(w + i * ldw_bytes + kb * 4 + 1024, _MM_HINT_T0);
            }
#pragma GCC unroll 8
            for (int i = 0; i < RW; ++i) // the chunk's first element of each row
                src[i] = WT == kWF32Round ? wr + 16 * i : reinterpret_cast<const float *>(w + i * ldw_bytes) + kb;
            for (int64_t k = 0; k < ke - kb; ++k) {
                __m256 xv[J];
#pragma GCC unroll 4
                for (int j = 0; j < J; ++j)
                    xv[j] = _mm256_load_ps(xt + ((kb + k) * J + j) * 8);
#pragma GCC unroll 8
                for (int i = 0; i < RW; ++i) {
                    const __m256 a = _mm256_broadcast_ss(src[i] + k);
#pragma GCC unroll 4
                    for (int j = 0; j < J; ++j)
                        acc[i][j] = _mm256_fmadd_ps(a, xv[j], acc[i][j]);
                }
            }
        }
    }
    bcast_scatter<RW, J>(acc, c, ldc, M);
}

// Tile heights by J: RW * J accumulators + J x^T vectors + a temporary (+ the bf16 mask) within the 16 ymm registers
// (bf16, J = 2 with 6 rows spilled two accumulators).
template <int J, int WT> constexpr int bcast_rw() {
    return J == 1 ? 8 : J == 2 ? (WT == kWBF16 ? 5 : 6) : J == 3 ? 3 : 2;
}

// nr (<= kStreamNB) weight rows from w against x^T (J = 1-4 vectors of 8 m) into c[m][0..nr). A last partial tile is
// computed as the last RW rows (recomputing a few columns, with the same results).
template <int WT>
FA void bcast_rows(int64_t J, const char *w, int64_t ldw_bytes, const float *xt, int64_t K, int64_t M, int64_t nr,
                   float *c, int64_t ldc) {
    by_count<4>(J, [&](auto JV) FA {
        constexpr int RW = bcast_rw<JV, WT>();
        if (nr < RW) {
            for (int64_t t = 0; t < nr; ++t)
                bcast_tile<1, JV, WT>(w + t * ldw_bytes, ldw_bytes, xt, K, c + t, ldc, M);
            return;
        }
        for (int64_t t0 = 0; t0 < nr; t0 += RW) {
            const int64_t t = std::min(t0, nr - RW);
            bcast_tile<RW, JV, WT>(w + t * ldw_bytes, ldw_bytes, xt, K, c + t, ldc, M);
        }
    });
}

size_t bcast_workspace_bytes(int64_t M, int64_t K) {
    const int64_t J = (M + 7) / 8;
    return 64 + sizeof(float) * (M * kStreamNB + K * J * 8);
}

FA void bcast_forward(const void *x, DType xd, int64_t ldx, int64_t M, const void *w, DType wd, int64_t ldw, int64_t K,
                      int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    char *p = static_cast<char *>(workspace);
    p += (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    float *cb = reinterpret_cast<float *>(p);
    const int64_t J = (M + 7) / 8;
    float *xt = cb + M * kStreamNB;
    bcast_pack_xt(x, xd, ldx, M, K, xt);
    const int wt = wd == DType::BF16 ? kWBF16 : xd == DType::BF16 ? kWF32Round : kWF32;
    const int64_t ldb = ldw * (wd == DType::F32 ? 4 : 2);
    for (int64_t nb = n0; nb < n1; nb += kStreamNB) {
        const int64_t nr = std::min(kStreamNB, n1 - nb);
        const char *wrows = static_cast<const char *>(w) + nb * ldb;
        if (wt == kWBF16)
            bcast_rows<kWBF16>(J, wrows, ldb, xt, K, M, nr, cb, kStreamNB);
        else if (wt == kWF32Round)
            bcast_rows<kWF32Round>(J, wrows, ldb, xt, K, M, nr, cb, kStreamNB);
        else
            bcast_rows<kWF32>(J, wrows, ldb, xt, K, M, nr, cb, kStreamNB);
        simd_epilogue<Avx2Vec>(epi, cb, kStreamNB, 0, M, nb, nr);
    }
}

// The forward entries: weight streaming up to kStreamMaxM rows, the broadcast kernel above.
size_t fwd_workspace_avx2(int64_t M, int64_t K) {
    return M <= kStreamMaxM ? stream_workspace_bytes(M, K) : bcast_workspace_bytes(M, K);
}

FA void fwd_avx2(const void *x, DType xd, int64_t ldx, int64_t M, const void *w, DType wd, int64_t ldw, int64_t K,
                 int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    if (M <= kStreamMaxM)
        return stream_forward(x, xd, ldx, M, w, wd, ldw, K, n0, n1, epi, workspace);
    bcast_forward(x, xd, ldx, M, w, wd, ldw, K, n0, n1, epi, workspace);
}

FA void fwd_bf16_entry(const void *x, int64_t ldx, int64_t M, const void *w, DType w_dtype, int64_t ldw, int64_t K,
                       int64_t, int64_t, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    fwd_avx2(x, DType::BF16, ldx, M, w, w_dtype, ldw, K, n0, n1, epi, workspace);
}

FA void fwd_f32_entry(const void *x, int64_t ldx, int64_t M, const void *w, DType, int64_t ldw, int64_t K, int64_t,
                      int64_t, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) {
    fwd_avx2(x, DType::F32, ldx, M, w, DType::F32, ldw, K, n0, n1, epi, workspace);
}

Kernels make_avx2() {
    Kernels t;
    t.name = "avx2";
    t.epilogue = simd_epilogue<Avx2Vec>;
    t.dpre_pass = simd_dpre_pass<Avx2Vec>;
    t.fwd_bf16 = FwdKernel{fwd_bf16_entry, fwd_workspace_avx2, kBcastMaxM, INT64_MAX};
    t.fwd_f32 = FwdKernel{fwd_f32_entry, fwd_workspace_avx2, kBcastMaxM, INT64_MAX};
    t.fgemm = Fgemm{fgemm_pack_a_avx2, fgemm_block_avx2};
    return t;
}

} // namespace

const Kernels *kernels_avx2() {
    return cached_table<make_avx2>();
}
#endif // FA_X86 (other builds: fused_linear_scalar.cpp)

} // namespace fused_linear
} // namespace fastdl
