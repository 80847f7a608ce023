// AVX2 kernels of the int8 capability, for x86 CPUs without AVX512-VNNI. No torch headers; every function enables
// AVX2 + FMA + F16C with a target attribute and int8.cpp checks cpuid before calling in.
//
// W8A8 without VNNI: vpmaddubsw (u8 x s8 -> s16 pair sums) with the sign trick (see avx2_tile), exact for every
// activation in [-127, 127] and every weight; the per-token quantisation of float A is fused into the packing of A.
#include "../static_dispatch.h"
#include "int8_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <memory>

#define FDL_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace fastdl {
namespace int8 {
namespace {

// 8 consecutive values as fp32 (exact conversions). The tail variant copies the first n into a zeroed buffer, so no
// byte past the end is read.
template <DType DT> FDL_AVX2 inline __m256 load8(const void *p) {
    if constexpr (DT == DType::F32) {
        return _mm256_loadu_ps(static_cast<const float *>(p));
    } else if constexpr (DT == DType::BF16) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else {
        return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i *>(p)));
    }
}

template <DType DT> FDL_AVX2 inline __m256 load8_tail(const void *p, int64_t n) {
    alignas(32) char buf[32] = {};
    std::memcpy(buf, p, static_cast<size_t>(n * elem_size<DT>()));
    return load8<DT>(buf);
}

// fp32 -> bf16 bits (round to nearest even, NaN -> 0x7fc0) in the low 128 bits.
FDL_AVX2 inline __m128i to_bf16(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    return _mm256_castsi256_si128(r);
}

// Store the first n (<= 8) lanes of f as dt.
FDL_AVX2 inline void store8(void *p, __m256 f, DType dt, int64_t n) {
    alignas(32) char buf[32];
    int64_t es = 2;
    if (dt == DType::F32) {
        es = 4;
        if (n == 8) {
            _mm256_storeu_ps(static_cast<float *>(p), f);
            return;
        }
        _mm256_store_ps(reinterpret_cast<float *>(buf), f);
    } else {
        const __m128i h = dt == DType::BF16 ? to_bf16(f) : _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
        if (n == 8) {
            _mm_storeu_si128(static_cast<__m128i *>(p), h);
            return;
        }
        _mm_store_si128(reinterpret_cast<__m128i *>(buf), h);
    }
    std::memcpy(p, buf, static_cast<size_t>(n * es));
}

// Keeps v in a register as it is: the multiply before it and the add after it cannot be fused into an FMA.
FDL_AVX2 inline __m256 no_fma(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

// ------------------------------------------------------------------------------------------- per-token quantisation
// amax as the bits of |x| (integer order = float order; NaN / Inf >= 0x7f800000): see int8_avx512.cpp.
template <DType DT> FDL_AVX2 uint32_t amax_bits(const void *row, int64_t K) {
    const char *p = static_cast<const char *>(row);
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    __m256i m0 = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(load8<DT>(p + k * elem_size<DT>())), abs_mask));
    }
    if (k < K) {
        const __m256 t = load8_tail<DT>(p + k * elem_size<DT>(), K - k);
        m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(t), abs_mask));
    }
    alignas(32) uint32_t v[8];
    _mm256_store_si256(reinterpret_cast<__m256i *>(v), m0);
    uint32_t m = 0;
    for (int i = 0; i < 8; ++i) {
        m = v[i] > m ? v[i] : m;
    }
    return m;
}

// q = clamp(rne(x * inv), -127, 127) as int32 lanes, NaN products -> 0 (vmaxps returns its second operand for NaN, so
// the clamp leaves no NaN and the mask restores 0).
FDL_AVX2 inline __m256i quant8(__m256 x, __m256 inv) {
    __m256 p = _mm256_mul_ps(x, inv);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    p = _mm256_min_ps(_mm256_max_ps(p, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256i q = _mm256_cvttps_epi32(_mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm256_andnot_si256(nan, q);
}

// 16 int32 lanes (two vectors, each in [-127, 127]) -> 16 int8 in order.
FDL_AVX2 inline __m128i to_i8(__m256i q0, __m256i q1) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// Quantise k in [k0, k1) of a row into int8 at dst (Xor: the A offset, 0 in this family: int8_pack_a.h).
template <DType DT, int Xor>
FDL_AVX2 void quant_row(const void *row, int64_t k0, int64_t k1, float inv_s, uint8_t *dst) {
    static_assert(Xor == 0, "the AVX2 kernels take A as int8");
    const char *p = static_cast<const char *>(row);
    const __m256 inv = _mm256_set1_ps(inv_s);
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        const __m256 x0 = load8<DT>(p + k * elem_size<DT>());
        const __m256 x1 = load8<DT>(p + (k + 8) * elem_size<DT>());
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + (k - k0)), to_i8(quant8(x0, inv), quant8(x1, inv)));
    }
    if (k < k1) {
        const int64_t n = k1 - k;
        const __m256 x0 = n >= 8 ? load8<DT>(p + k * elem_size<DT>()) : load8_tail<DT>(p + k * elem_size<DT>(), n);
        const __m256 x1 = n > 8 ? load8_tail<DT>(p + (k + 8) * elem_size<DT>(), n - 8) : _mm256_setzero_ps();
        alignas(16) int8_t buf[16];
        _mm_store_si128(reinterpret_cast<__m128i *>(buf), to_i8(quant8(x0, inv), quant8(x1, inv)));
        std::memcpy(dst + (k - k0), buf, static_cast<size_t>(n));
    }
}

// The 7-bit mode (u7_params in int8_kernels.h). lo = min(0, min x), hi = max(0, max x) of a finite row: the
// accumulators start at 0 and the zero-filled tail changes neither.
template <DType DT> FDL_AVX2 void range_of(const void *row, int64_t K, float *lo, float *hi) {
    const char *p = static_cast<const char *>(row);
    __m256 mn = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 x = load8<DT>(p + k * elem_size<DT>());
        mn = _mm256_min_ps(mn, x);
        mx = _mm256_max_ps(mx, x);
    }
    if (k < K) {
        const __m256 x = load8_tail<DT>(p + k * elem_size<DT>(), K - k);
        mn = _mm256_min_ps(mn, x);
        mx = _mm256_max_ps(mx, x);
    }
    alignas(32) float a[8], b[8];
    _mm256_store_ps(a, mn);
    _mm256_store_ps(b, mx);
    float l = 0.0f, h = 0.0f;
    for (int i = 0; i < 8; ++i) {
        l = a[i] < l ? a[i] : l;
        h = b[i] > h ? b[i] : h;
    }
    *lo = l;
    *hi = h;
}

// q - zsub as int32 lanes, q = clamp(rint(x * inv) + z, 0, 127) (x finite, inv finite: no NaN, |x * inv| <= ~127).
FDL_AVX2 inline __m256i quant7(__m256 x, __m256 inv, __m256 zf, __m256i zsub) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(r, zf), _mm256_setzero_ps()), _mm256_set1_ps(127.0f));
    return _mm256_sub_epi32(_mm256_cvttps_epi32(q), zsub);
}

// k in [k0, k1) of a row as the bytes q - zsub (in [-127, 127]); a row with inv = 0 stores 0 (u7_params).
template <DType DT, int Xor>
FDL_AVX2 void quant_row_u7(const void *row, int64_t k0, int64_t k1, float inv_s, int32_t z, int32_t zsub,
                           uint8_t *dst) {
    static_assert(Xor == 0, "the AVX2 kernels take A as int8");
    if (inv_s == 0.0f) {
        std::memset(dst, 0, static_cast<size_t>(k1 - k0));
        return;
    }
    const char *p = static_cast<const char *>(row);
    const __m256 inv = _mm256_set1_ps(inv_s), zf = _mm256_set1_ps(static_cast<float>(z));
    const __m256i zs = _mm256_set1_epi32(zsub);
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        const __m256 x0 = load8<DT>(p + k * elem_size<DT>());
        const __m256 x1 = load8<DT>(p + (k + 8) * elem_size<DT>());
        _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + (k - k0)),
                         to_i8(quant7(x0, inv, zf, zs), quant7(x1, inv, zf, zs)));
    }
    if (k < k1) {
        const int64_t n = k1 - k;
        const __m256 x0 = n >= 8 ? load8<DT>(p + k * elem_size<DT>()) : load8_tail<DT>(p + k * elem_size<DT>(), n);
        const __m256 x1 = n > 8 ? load8_tail<DT>(p + (k + 8) * elem_size<DT>(), n - 8) : _mm256_setzero_ps();
        alignas(16) int8_t buf[16];
        _mm_store_si128(reinterpret_cast<__m128i *>(buf), to_i8(quant7(x0, inv, zf, zs), quant7(x1, inv, zf, zs)));
        std::memcpy(dst + (k - k0), buf, static_cast<size_t>(n));
    }
}

// ---------------------------------------------------------------------------------------------------- pack A
// int8 A block (a as it is: the sign trick below needs no +128 shift and no compensation), rows of kc bytes,
// padding (k >= K) 0. int8 A must not hold -128 (see Kernels::a_min; int8_mm splits such an A in two).
constexpr int kAOffset = 0;

void pack_a_int8(const APack &p) {
    const int8_t *src = static_cast<const int8_t *>(p.src);
    const int64_t k1 = imin(p.K, p.k0 + p.kc);
    for (int64_t r = 0; r < p.rows; ++r) {
        uint8_t *d = static_cast<uint8_t *>(p.dst) + r * p.ldd;
        if (k1 > p.k0) {
            std::memcpy(d, src + r * p.ld + p.k0, static_cast<size_t>(k1 - p.k0));
        }
        pad_a_row(d, p.k0, k1, p.kc, kAOffset);
    }
}

// quantize_rows and pack_a (float rows quantised on the fly, int8 rows by pack_a_int8); the weight-only dot form's
// driver (over the traits Avx2Wo below)
#define I8_SIMD FDL_AVX2
#include "int8_pack_a.h"
#include "int8_weight_only.h"
#undef I8_SIMD

// --------------------------------------------------------------------------------------------------------- GEMM
// Exact int8 x int8 with vpmaddubsw (u8 x s8 -> s16 pair sums, saturating) by the sign trick: for a weight vector b
// and a broadcast activation quad a, u = |b| (vpabsb: an unsigned byte <= 128) and s = a * sign(b) (vpsignb: 0 where
// b = 0), so u * s = a * b and each pair sum is at most 2 * 128 * 127 = 32512 < 32767 for a in [-127, 127]: never
// saturates, for every weight including -128. vpmaddwd by ones then adds the two pairs of a column into int32.
// |b| is taken once per weight vector and used by the MR rows of the tile. Per k-quad and row: 2 x (vpsignb,
// vpmaddubsw, vpmaddwd, vpaddd) for 64 MACs, of which 2 x 2 multiplies.
// Tile: MR = 4 rows x 16 columns (one VNNI block, two ymm of 8 columns x 4 k): 8 accumulators + 2 |b| + the
// broadcast + temporaries + ones within the 16 ymm. Accumulator lanes are whole column sums (no horizontal add).
constexpr int kMR = 4;

// a * sign(*b) (vpsignb) with b read from memory: written in asm so that the compiler does not keep the two weight
// vectors of a k-quad in registers for the MR rows (with them, 16 ymm were not enough and GCC spilled accumulators).
FDL_AVX2 inline __m256i sign_by(__m256i a, const __m256i *b) {
    __m256i r;
    __asm__("vpsignb %2, %1, %0" : "=x"(r) : "x"(a), "m"(*b));
    return r;
}

// U7 (gemm_block_u7): A holds the 7-bit codes q in [0, 127], the unsigned operand of vpmaddubsw as they are: each
// pair sum is at most 2 * 127 * 128 = 32512 in magnitude, exact for every weight, and a k-quad and row costs 2 x
// (vpmaddubsw, vpmaddwd, vpaddd), no vpsignb. The epilogue subtracts z * sum_k B[n, k] (the row's zero point times
// comp[n] / 128, exact while |comp| < 2^31: int8.cpp takes this kernel for K < 2^17 only), so the int32 result is
// sum_k (q - z) B[n, k], the same as gemm_block on a = q - z.
template <int MR, bool U7 = false>
FDL_AVX2 void avx2_tile(const GemmBlock &g, int64_t r0, int64_t c0, const int8_t *pf) {
    __m256i acc[MR][2];
    if (g.first) {
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            acc[i][0] = _mm256_setzero_si256();
            acc[i][1] = _mm256_setzero_si256();
        }
    } else {
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            const int32_t *part = g.partial + (r0 + i) * g.ldp + c0;
            acc[i][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(part));
            acc[i][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(part + 8));
        }
    }
    const int8_t *a = static_cast<const int8_t *>(g.a) + r0 * g.lda;
    const int8_t *b = g.b + (c0 / 16) * g.b_stride;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t nq = g.kc / 4;
    for (int64_t q = 0; q < nq; ++q) {
        const __m256i *bq = reinterpret_cast<const __m256i *>(b + q * 64);
        if (pf) {
            _mm_prefetch(reinterpret_cast<const char *>(pf + q * 64), _MM_HINT_T0);
        }
        if constexpr (U7) {
            const __m256i b0 = _mm256_loadu_si256(bq), b1 = _mm256_loadu_si256(bq + 1);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) {
                const __m256i av = _mm256_set1_epi32(a_quad(a + i * g.lda, q));
                acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(av, b0), ones));
                acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(av, b1), ones));
            }
            continue;
        }
        const __m256i u0 = _mm256_abs_epi8(_mm256_loadu_si256(bq)), u1 = _mm256_abs_epi8(_mm256_loadu_si256(bq + 1));
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
            const __m256i av = _mm256_set1_epi32(a_quad(a + i * g.lda, q));
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, sign_by(av, bq)), ones));
            acc[i][1] =
                _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, sign_by(av, bq + 1)), ones));
        }
    }
    // The accumulators go to memory once, here: indexing them by a loop variable below would make GCC keep the whole
    // array in memory during the k loop too.
    alignas(32) int32_t res[MR][16];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
        _mm256_store_si256(reinterpret_cast<__m256i *>(res[i]), acc[i][0]);
        _mm256_store_si256(reinterpret_cast<__m256i *>(res[i] + 8), acc[i][1]);
    }
    for (int i = 0; i < MR; ++i) {
        const int64_t r = r0 + i;
        for (int h = 0; h < 2; ++h) {
            const int64_t col = c0 + 8 * h;
            __m256i sum = _mm256_load_si256(reinterpret_cast<const __m256i *>(res[i] + 8 * h));
            if (!g.last) {
                _mm256_storeu_si256(reinterpret_cast<__m256i *>(g.partial + r * g.ldp + col), sum);
                continue;
            }
            if (col >= g.n_valid) {
                break;
            }
            if constexpr (U7) { // comp has a whole 16-column block: 8 lanes from col are in it
                const __m256i colsum =
                    _mm256_srai_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(g.comp + col)), 7);
                sum = _mm256_sub_epi32(sum, _mm256_mullo_epi32(colsum, _mm256_set1_epi32(g.a_zero[r])));
            }
            const int64_t n = imin(8, g.n_valid - col);
            if (g.out_dtype == DType::I32) {
                store8(static_cast<int32_t *>(g.out) + r * g.ldo + col, _mm256_castsi256_ps(sum), DType::F32, n);
                continue;
            }
            __m256 bs, bias = _mm256_setzero_ps();
            if (n == 8) {
                bs = _mm256_loadu_ps(g.b_scale + col);
                if (g.bias) {
                    bias = _mm256_loadu_ps(g.bias + col);
                }
            } else {
                alignas(32) float bsb[8] = {}, bb[8] = {};
                std::memcpy(bsb, g.b_scale + col, static_cast<size_t>(4 * n));
                if (g.bias) {
                    std::memcpy(bb, g.bias + col, static_cast<size_t>(4 * n));
                }
                bs = _mm256_load_ps(bsb);
                bias = _mm256_load_ps(bb);
            }
            __m256 f = _mm256_cvtepi32_ps(sum);
            f = no_fma(_mm256_mul_ps(f, _mm256_set1_ps(g.a_scale[r])));
            f = no_fma(_mm256_mul_ps(f, bs));
            if (g.bias) { // no bias: no "+ 0", which would turn -0 into +0
                f = _mm256_add_ps(f, bias);
            }
            const int64_t es = g.out_dtype == DType::F32 ? 4 : 2;
            store8(static_cast<char *>(g.out) + (r * g.ldo + col) * es, f, g.out_dtype, n);
        }
    }
}

template <bool U7> void gemm_block_t(const GemmBlock &g) {
    // 16-column block outer: its B slice (16 x kc bytes, 64 KiB at kc = 4096) is reused from L2 by every row tile.
    // The first row tile also prefetches the next block's slice, one line per k-quad, so that the next block does
    // not start with a wait for L3 / DRAM. Zen 4 capped at AVX2, one core, K = N = 4096, weights in L3, GMAC/s
    // without -> with: M = 1 21.2 -> 25.5, M = 4 45.8 -> 47.9, M = 16 43.5 -> 55.5, M = 128 55.6 -> 56.3.
    for (int64_t c0 = 0; c0 < g.cols; c0 += 16) {
        const int8_t *next = c0 + 16 < g.cols ? g.b + (c0 / 16 + 1) * g.b_stride : nullptr;
        int64_t r0 = 0;
        for (; r0 + kMR <= g.rows; r0 += kMR) {
            avx2_tile<kMR, U7>(g, r0, c0, r0 == 0 ? next : nullptr);
        }
        const int8_t *pf = r0 == 0 ? next : nullptr;
        if (r0 < g.rows) { // the last 1 .. kMR - 1 rows
            with_count<1, kMR - 1>(static_cast<int>(g.rows - r0),
                                   [&](auto R) { avx2_tile<decltype(R)::value, U7>(g, r0, c0, pf); });
        }
    }
}

void gemm_block(const GemmBlock &g) {
    gemm_block_t<false>(g);
}

void gemm_block_u7(const GemmBlock &g) {
    gemm_block_t<true>(g);
}

// ------------------------------------------------------------------------------------------------- weight-only
// fp32 FMA on dot products: MB = 1 row x NB = 8 w rows, or MB = 2 x NB = 6 (8-12 accumulators, within 16 ymm).
// Grouped: the weights of group k / 16 are multiplied by its code (fp32, exact: |d| <= 127 * 255) before the FMA.
// The codes are converted to fp32 once per kWoCols w rows (wo_codes) in the layout of int8_kernels.h (code_at).

// 8 k (k + 8 <= K); Grouped: c[j * kCodeChunk] is the code of their group for w row j.
template <int MB, int NB, bool Grouped>
FDL_AVX2 inline void wo_step(const float *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t k, const float *c,
                             __m256 (&acc)[MB][NB]) {
    __m256 xv[MB];
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
        xv[i] = _mm256_loadu_ps(x + i * ldx + k);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
        int64_t w8;
        std::memcpy(&w8, w + j * ldw + k, 8);
        __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(w8)));
        if constexpr (Grouped) {
            wv = _mm256_mul_ps(wv, _mm256_broadcast_ss(c + j * kCodeChunk));
        }
#pragma GCC unroll 2
        for (int i = 0; i < MB; ++i) {
            acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
}

// Horizontal sums of 4 accumulators: lanes 0..3 of the result.
FDL_AVX2 inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// One row, one whole group (16 k from k, a multiple of 16) of NB w rows: the products of the group are summed first
// and multiplied by the code once (t = x0 w0 + x1 w1, acc += t * code: 5 floating-point operations per 16 weights
// instead of 6 with the code multiplied into each 8 converted weights; M = 1, one core, ms: K = N = 4096 1.60 ->
// 1.55, 4096 -> 11008 4.67 -> 4.40, 11008 -> 4096 4.25 -> 3.90).
template <int NB>
FDL_AVX2 inline void wo_group1(const float *x, const int8_t *w, int64_t ldw, int64_t k, const float *c,
                               __m256 (&acc)[NB]) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
        // Two 8-byte loads, each folded into vpmovsxbd's memory operand, instead of one 16-byte load and a vpunpckhqdq
        // (one shuffle less per 16 weights).
        const int8_t *wj = w + j * ldw + k;
        const __m256 w0 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(wj))));
        const __m256 w1 =
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(wj + 8))));
        const __m256 t = _mm256_fmadd_ps(x1, w1, _mm256_mul_ps(x0, w0));
        acc[j] = _mm256_fmadd_ps(t, _mm256_broadcast_ss(c + j * kCodeChunk), acc[j]);
    }
}

template <int MB, int NB, bool Grouped>
FDL_AVX2 void wo_tile(const WeightOnly &p, int64_t m0, int64_t n0, const float *codes, LinePrefetch pf) {
    __m256 acc[MB][NB] = {}; // zeros
    const float *x = static_cast<const float *>(p.x) + m0 * p.ldx;
    const int8_t *w = p.w + n0 * p.ldw;
    int64_t k = 0;
    if constexpr (Grouped) {
        if constexpr (MB == 1) {
            for (; k + 16 <= p.K; k += 16) {
                pf.step();
                pf.step();
                wo_group1<NB>(x, w, p.ldw, k, code_at(codes, k >> 4), acc[0]);
            }
        }
        for (; k + 8 <= p.K; k += 8) {
            pf.step();
            wo_step<MB, NB, true>(x, p.ldx, w, p.ldw, k, code_at(codes, k >> 4), acc);
        }
    } else {
        for (; k + 8 <= p.K; k += 8) {
            pf.step();
            wo_step<MB, NB, false>(x, p.ldx, w, p.ldw, k, nullptr, acc);
        }
    }
    // Horizontal sums 4 accumulators at a time (vhaddps), then the K tail in scalar code. Unrolled: with constant
    // indices acc stays in registers (else it lives in memory too, and with groups every float load of a code, which
    // might alias it, made GCC store the accumulators first).
    alignas(32) float s[MB][8] = {};
    const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int i = 0; i < MB; ++i) {
#pragma GCC unroll 2
        for (int j0 = 0; j0 < NB; j0 += 4) {
            const __m256 a0 = acc[i][j0];
            const __m256 a1 = j0 + 1 < NB ? acc[i][j0 + 1 < NB ? j0 + 1 : 0] : zero;
            const __m256 a2 = j0 + 2 < NB ? acc[i][j0 + 2 < NB ? j0 + 2 : 0] : zero;
            const __m256 a3 = j0 + 3 < NB ? acc[i][j0 + 3 < NB ? j0 + 3 : 0] : zero;
            _mm_store_ps(s[i] + j0, hsum4(a0, a1, a2, a3));
        }
        if (k < p.K) {
            for (int j = 0; j < NB; ++j) {
                float t = s[i][j];
                for (int64_t kk = k; kk < p.K; ++kk) { // K tail
                    const float wf = static_cast<float>(w[j * p.ldw + kk]);
                    t += x[i * p.ldx + kk] * (Grouped ? wf * code_at(codes, kk / 16)[j * kCodeChunk] : wf);
                }
                s[i][j] = t;
            }
        }
    }
    alignas(32) float ws[8] = {}, bias[8] = {};
    std::memcpy(ws, p.w_scale + n0, 4 * NB);
    if (p.bias) {
        std::memcpy(bias, p.bias + n0, 4 * NB);
    }
    const int64_t es = p.out_dtype == DType::F32 ? 4 : 2;
    for (int i = 0; i < MB; ++i) {
        __m256 f = _mm256_mul_ps(_mm256_load_ps(s[i]), _mm256_load_ps(ws));
        if (p.bias) {
            f = _mm256_add_ps(f, _mm256_load_ps(bias));
        }
        store8(static_cast<char *>(p.out) + ((m0 + i) * p.ldo + n0) * es, f, p.out_dtype, NB);
    }
}

// Group codes, 8 at a time (int8_weight_only.h's Codes); the tail one by one (no byte past the row is read).
struct Avx2Codes {
    static constexpr int64_t kLanes = 8;
    FDL_AVX2 static inline void convert(const uint8_t *src, float *dst) {
        int64_t b8;
        std::memcpy(&b8, src, 8);
        _mm256_storeu_ps(dst, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b8))));
    }
    static inline void convert_tail(const uint8_t *src, int64_t n, float *dst) {
        for (int64_t i = 0; i < n; ++i) {
            dst[i] = static_cast<float>(src[i]);
        }
    }
};

// The dot form's traits (int8_weight_only.h): tiles of 1 row x 8 w rows or 2 x 6.
struct Avx2Wo {
    static constexpr int64_t kXBytes = 4;
    static constexpr int kMB = 2;
    static constexpr int nb_for(int mb) { return mb == 1 ? 8 : 6; }
    template <int MB, int NB, bool G> static constexpr WoTileFn tile() { return &wo_tile<MB, NB, G>; }
    using Codes = Avx2Codes;
};

// ---------------------------------------------------------------------------------------------------------------
// Weight-only, many rows: a GEMM on dequantised blocks. A block of kPanelNc w rows x kPanelKc k is converted once (per
// row block of x) into fp32 in its own row-major order (d = w, or w * code: exact), so each weight is converted
// ceil(rows / kPanelMc) times instead of once per row tile. Tile: MB = 3 x rows by NB = 4 w rows, 8 k per step (12
// FMAs for 3 x and 4 w loads; 12 accumulators + 3 x + 1 w vector = 16 ymm), reduced at the end of the K slice into
// an fp32 block of partial sums. Loops: x row block (kPanelMc rows) > w column block (kPanelNc) > K slice > groups of
// kPanelJb w rows (16 KiB of fp32: L1) > x row tiles (their slice of x: L2) > w tiles. A stand-alone 6 x 16 FMA
// loop runs at 15.5 MAC/cycle here (Zen 4 at AVX2, one core; peak 16), ATen's fp32 GEMM (MKL) at ~9.5.
// Sizes: one core, K = N = 4096, M = 128 / 512, MAC/cycle within noise (+-5 % on this shared machine) for kPanelKc
// 256 / 512, kPanelNc 128 / 256, kPanelMc 120 / 240 / 510; kPanelKc 128 lost 20 %.
constexpr int64_t kPanelKc = 512;      // longest K slice; K is cut into near-equal slices (multiples of kWeightGroup)
constexpr int64_t kPanelNc = 128;      // w rows per converted block (128 x 256 fp32 = 128 KiB: L2)
constexpr int64_t kPanelL1 = 16 << 10; // bytes of converted w rows per L1 group
constexpr int64_t kPanelMc = 240;      // x rows per row block (their slice 240 KiB, partial sums 120 KiB: L2)
// The conversion prefetches the slice of the w row kPanelPfRows ahead: its kc bytes are too short a run for the
// hardware prefetcher. One core, K = N = 4096, ms, without -> with: M = 2 4.11 -> 3.69, M = 16 11.4 -> 9.5.
constexpr int64_t kPanelPfRows = 8;
constexpr int kPanelMB = 3, kPanelNB = 4;

// w rows [n0, n0 + nr) x k in [k0, k0 + kc) as fp32: row j at buf + j * ldb, zero from kc to the next multiple
// of 8 and in the rows nr .. round_up(nr, 4) - 1.
template <bool Grouped>
FDL_AVX2 void panel_convert(const WeightOnly &p, int64_t n0, int64_t nr, int64_t k0, int64_t kc, float *buf,
                            int64_t ldb) {
    const int64_t kc8 = (kc + 7) / 8 * 8;
    const int64_t nr4 = (nr + 3) / 4 * 4;
    for (int64_t j = 0; j < nr4; ++j) {
        float *dst = buf + j * ldb;
        if (j >= nr) {
            std::memset(dst, 0, static_cast<size_t>(4 * kc8));
            continue;
        }
        const int8_t *src = p.w + (n0 + j) * p.ldw + k0;
        const uint8_t *codes = Grouped ? p.w_group + (n0 + j) * p.ldg + k0 / kWeightGroup : nullptr;
        if (j + kPanelPfRows < nr) { // the rows' kc bytes are too short a run for the hardware prefetcher
            const int8_t *ahead = src + kPanelPfRows * p.ldw;
            for (int64_t kk = 0; kk < kc; kk += 64) {
                _mm_prefetch(reinterpret_cast<const char *>(ahead + kk), _MM_HINT_T0);
            }
        }
        for (int64_t kk = 0; kk < kc8; kk += 8) {
            __m128i w8;
            if (kk + 8 <= kc) {
                w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(src + kk));
            } else { // tail: no byte past the row is read
                alignas(16) int8_t t[16] = {};
                std::memcpy(t, src + kk, static_cast<size_t>(kc - kk));
                w8 = _mm_load_si128(reinterpret_cast<const __m128i *>(t));
            }
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
            if constexpr (Grouped) { // 8 k of one group: k0 and kk are multiples of 8, groups of 16
                v = _mm256_mul_ps(v, _mm256_set1_ps(static_cast<float>(codes[kk / kWeightGroup])));
            }
            _mm256_storeu_ps(dst + kk, v);
        }
    }
}

// acc[i][j] += x[i * ldx + k .. k + 7] * w[j * ldb + k .. k + 7] (Tail: x read under the lane mask m).
template <int MB, bool Tail>
FDL_AVX2 __attribute__((always_inline)) inline void panel_step(__m256 (&acc)[MB][kPanelNB], const float *x, int64_t ldx,
                                                               const float *w, int64_t ldb, int64_t k, __m256i m) {
    __m256 xv[MB];
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
        xv[i] = Tail ? _mm256_maskload_ps(x + i * ldx + k, m) : _mm256_loadu_ps(x + i * ldx + k);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kPanelNB; ++j) {
        const __m256 wv = _mm256_loadu_ps(w + j * ldb + k);
#pragma GCC unroll 3
        for (int i = 0; i < MB; ++i) {
            acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
}

// MB x rows (x + i * ldx: the kc values of the slice) times the 4 converted w rows at w (row stride ldb).
// part: the partial sums of these outputs, row stride kPanelNc. After the last slice: the outputs at columns n .. n + 3
// (those < p.cols) of rows m0 .. m0 + MB - 1.
template <int MB>
FDL_AVX2 void panel_tile(const WeightOnly &p, const float *x, const float *w, int64_t ldb, int64_t kc, float *part,
                         bool first, bool last, int64_t m0, int64_t n) {
    __m256 acc[MB][kPanelNB] = {}; // zeros
    const int64_t kfull = kc / 8 * 8;
    int64_t k = 0;
    for (; k < kfull; k += 8) {
        panel_step<MB, false>(acc, x, p.ldx, w, ldb, k, _mm256_setzero_si256());
    }
    if (k < kc) { // K tail: x read under a mask (nothing past the row), the converted w is zero there
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        panel_step<MB, true>(acc, x, p.ldx, w, ldb, k,
                             _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kc - k)), lane));
    }
    __m128 sum[MB];
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
        sum[i] = hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        if (!first) {
            sum[i] = _mm_add_ps(sum[i], _mm_loadu_ps(part + i * kPanelNc));
        }
    }
    if (!last) {
#pragma GCC unroll 3
        for (int i = 0; i < MB; ++i) {
            _mm_storeu_ps(part + i * kPanelNc, sum[i]);
        }
        return;
    }
    const int64_t nv = imin(kPanelNB, p.cols - n);
    alignas(16) float ws[4] = {}, bias[4] = {};
    std::memcpy(ws, p.w_scale + n, static_cast<size_t>(4 * nv));
    if (p.bias) {
        std::memcpy(bias, p.bias + n, static_cast<size_t>(4 * nv));
    }
    const int64_t es = p.out_dtype == DType::F32 ? 4 : 2;
#pragma GCC unroll 3
    for (int i = 0; i < MB; ++i) {
        __m128 f = _mm_mul_ps(sum[i], _mm_load_ps(ws));
        if (p.bias) {
            f = _mm_add_ps(f, _mm_load_ps(bias));
        }
        char *o = static_cast<char *>(p.out) + ((m0 + i) * p.ldo + n) * es;
        if (nv == 4 && p.out_dtype == DType::F32) { // the common case without store8's copy through a buffer
            _mm_storeu_ps(reinterpret_cast<float *>(o), f);
        } else if (nv == 4) {
            const __m256 f8 = _mm256_castps128_ps256(f);
            const __m128i h = p.out_dtype == DType::BF16 ? to_bf16(f8) : _mm256_cvtps_ph(f8, _MM_FROUND_TO_NEAREST_INT);
            _mm_storel_epi64(reinterpret_cast<__m128i *>(o), h);
        } else {
            store8(o, _mm256_castps128_ps256(f), p.out_dtype, nv);
        }
    }
}

template <bool Grouped> void weight_only_panels(const WeightOnly &p) {
    // K slices: one when K <= kPanelKc (no partial sums: K = 384 at M = 4096 took 0.86x the time of ATen's fp32
    // GEMM with slices of 256, ...), else near-equal slices, multiples of 16 so that groups do not straddle two.
    const int64_t nks = p.K > kPanelKc ? (p.K + kPanelKc - 1) / kPanelKc : 1;
    const int64_t kcs = nks == 1 ? p.K : ((p.K + nks - 1) / nks + kWeightGroup - 1) / kWeightGroup * kWeightGroup;
    const int64_t ldb = (kcs + 7) / 8 * 8 + 8; // converted row stride (+8: rows 4 KiB apart share L1 sets)
    const int64_t jb_rows = imax(kPanelNB, kPanelL1 / (ldb * 4) / kPanelNB * kPanelNB);
    float *wb = scratch_of<float>(kScratchA, kPanelNc * ldb);
    float *pt = scratch_of<float>(kScratchB, kPanelMc * kPanelNc);
    for (int64_t m0 = 0; m0 < p.rows; m0 += kPanelMc) {
        const int64_t mr = imin(kPanelMc, p.rows - m0);
        for (int64_t n0 = 0; n0 < p.cols; n0 += kPanelNc) {
            const int64_t nr = imin(kPanelNc, p.cols - n0);
            for (int64_t ks = 0; ks < nks; ++ks) {
                const int64_t k0 = ks * kcs, kc = imin(kcs, p.K - k0);
                panel_convert<Grouped>(p, n0, nr, k0, kc, wb, ldb);
                const bool first = ks == 0, last = ks == nks - 1;
                const float *xs = static_cast<const float *>(p.x) + m0 * p.ldx + k0;
                for (int64_t jb = 0; jb < nr; jb += jb_rows) {
                    const int64_t je = imin(nr, jb + jb_rows);
                    for (int64_t i0 = 0; i0 < mr; i0 += kPanelMB) {
                        const int mb = static_cast<int>(imin(kPanelMB, mr - i0));
                        const float *xi = xs + i0 * p.ldx;
                        for (int64_t j = jb; j < je; j += kPanelNB) {
                            const float *wj = wb + j * ldb;
                            float *pp = pt + i0 * kPanelNc + j;
                            if (mb == 3) {
                                panel_tile<3>(p, xi, wj, ldb, kc, pp, first, last, m0 + i0, n0 + j);
                            } else if (mb == 2) {
                                panel_tile<2>(p, xi, wj, ldb, kc, pp, first, last, m0 + i0, n0 + j);
                            } else {
                                panel_tile<1>(p, xi, wj, ldb, kc, pp, first, last, m0 + i0, n0 + j);
                            }
                        }
                    }
                }
            }
        }
    }
}

void weight_only_f32(const WeightOnly &p) {
    // The panel GEMM converts each weight once per call; the dot form converts it once per 2-row tile (and with group
    // codes multiplies it by its code there too), but reads int8 instead of fp32 in its inner loop. One core, ms, dot
    // form vs panels: per channel, K = N = 384: M = 8 0.046 vs 0.045, 16 0.079 vs 0.069, 32 0.143 vs 0.115; 384 ->
    // 1536 M = 4 0.082 vs 0.102, 16 0.280 vs 0.242; 2048 -> 5504 M = 8 3.35 vs 4.29, 16 5.99 vs 6.38; K = N = 4096
    // M = 16 8.0 vs 10.1, 32 15.6 vs 15.9, 64 31.3 vs 27.5. Grouped, K = N = 384: M = 4 0.050 vs 0.057, 8 0.058 vs
    // 0.052, 16 0.103 vs 0.075; 2048 -> 5504 M = 8 4.32 vs 4.25, 16 7.94 vs 6.25; K = N = 4096 M = 8 6.31 vs 6.26.
    // Hence panels from 8 rows with groups, else from 16 rows when the thread's weights fit in L2 and 32 otherwise.
    const int64_t from = p.w_group ? 8 : p.cols * p.K <= (int64_t(1) << 20) ? 16 : 32;
    if (p.rows >= from) {
        if (p.w_group) {
            weight_only_panels<true>(p);
        } else {
            weight_only_panels<false>(p);
        }
    } else {
        weight_only_dot<Avx2Wo>(p);
    }
}

} // namespace

// Weight-only threads from 128 Ki MACs: at M = 1 the kernel converts ~8 weights per cycle (vpmovsxbd, vcvtdq2ps,
// FMA), so 147 Ki MACs already take ~16 us on one core. AMD EPYC Zen 2, 2 threads, the op alone, us, one thread vs
// two: 1x128x512 11.4 vs 12.9 (kept serial) | 1x256x512 15.1 vs 15.3 | 1x384x512 19.0 vs 17.1 | 1x512x512 22.8 vs
// 18.9 | 1x384x1536 45.5 vs 31.9 | 1x1536x384 41.4 vs 27.9 (the shared default, 1 Mi MACs, kept all of these serial).
const Kernels *kernels_avx2() {
    static const Kernels k{.name = "avx2",
                           .a_min = -127,
                           .mr = kMR,
                           .quantize_rows = &quantize_rows,
                           .pack_a = &pack_a,
                           .gemm_block = &gemm_block,
                           .gemm_block_u7 = &gemm_block_u7,
                           .pack_b = &pack_b_portable,
                           .weight_only_f32 = &weight_only_f32,
                           .wo_serial_macs = int64_t(1) << 17};
    return &k;
}

} // namespace int8
} // namespace fastdl

#endif
