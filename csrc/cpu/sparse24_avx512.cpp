// 2:4 sparsity, AVX-512 kernels: prune+compress, decompress and the sparse linear at two levels (AVX-512 F/BW/VL/DQ,
// and AVX-512 + BF16 + VBMI2), chosen at run time by sparse24.cpp (the AVX2 and scalar kernels are in
// sparse24_avx2.cpp / sparse24_scalar.cpp). No torch headers: the ISA is enabled per function with target attributes,
// so this file compiles with the project's generic flags and the same build runs on CPUs without AVX-512. Threading
// is done by the caller (sparse24.cpp) on row ranges.
//
// Sparse linear design (the weight is read compressed: values + meta = 56% of the dense bf16 bytes). Numbers are
// from the 2-core AMD EPYC (Zen 5) development machine, K = 4096, bf16, 2 threads, vs bf16 F.linear on the same
// masked weight: M = 1 ~3-4.5x, M = 16 ~1.5-1.8x, M = 128 ~1.1x, M = 512 1.0x.
//  * M <= 4 ("direct", memory-bound): the kept values of 32 positions (16 bf16 = one 256-bit load) are expanded
//    into a dense 32-wide register with vpexpandw under the 32-bit position mask read straight from meta, then
//    multiplied with vdpbf16ps against x (fp32 accumulation); fp32: 16 positions, vexpandps + FMA. The expansion
//    is cheaper than the product (~0.13 ns per vpexpandw vs ~0.19 ns per vdpbf16ps), so the kernel streams the
//    compressed weight at full speed. Tile: MR = M rows of x x NR = 8 (MR <= 2) or 6 weight rows.
//  * M > 4 ("pairs", compute-bound): the expanded form would do the dense GEMM's multiply-adds (half of them on
//    zeros). Instead two weight rows share one vector, [16 kept values of row a | 16 of row b], and x is gathered
//    to match with one vpermw per row of x and pair, using an index vector built once per panel (a table lookup
//    of the meta nibbles). One vdpbf16ps + one vpermw then do 32 useful multiply-adds where the expanded form
//    needs two vdpbf16ps: 1.2-1.3x faster than an expanded 4x6 panel kernel. Loop nest per thread: blocks of up
//    to 64 rows of x (L2) > panels of 4 pairs (8 weight rows) > K blocks of 512 positions (the 8 KiB pair panel
//    stays in L1; the next block's weights are prefetched while the tiles run) > 4-row tiles.
//  * Full chunks use unmasked loads (masked loads measured 25% slower); the K tail is one masked step.
//  * Output columns past the end / rows past M reuse the last valid pointer (results discarded): no tail kernels.
//  * Non-BF16 AVX-512 CPUs run bf16 through the fp32 kernels (converted on load).
#include "sparse24_kernels.h"

#include <utility>
#include <vector>

#ifdef FASTDL_SP24_X86
#include <immintrin.h>
#endif

namespace fastdl {
namespace sparse24 {

#ifdef FASTDL_SP24_X86
namespace avx512 {
namespace {

using namespace detail;

#define SP24_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SP24_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx512vbmi2,avx512bf16")))

// Kept positions of full chunks without vpcompress (Zen 5: ~5.6 cycles per pair-chunk with 2 vpcompressw, and
// vpcompressb is 4x slower still): every group holds exactly 2 kept positions, the lower and the higher set bit of
// its nibble, so lane l of a pair index vector is 4 * group + table[nibble + 16 * (l & 1)] (vpsrlvd + vpermt2d).
alignas(64) constexpr int32_t kPosTable[32] = {0, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0,
                                               0, 0, 0, 1, 0, 2, 2, 1, 0, 3, 3, 1, 3, 2, 2, 1};
// fp32 table half of lane l: l & 1.
alignas(64) constexpr int32_t kSel16[16] = {0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16};
// bf16 pair index vectors in 16-bit lanes (lanes 0-15 row a, 16-31 row b; lane l covers group (l % 16) / 2):
// the source word of its nibble in (ka | kb << 32), the shift inside that word, the table half (l & 1) and the
// position base 4 * group. kPosTableW is kPosTable as 16-bit words (the upper 32 entries are never indexed).
alignas(64) constexpr int16_t kWordSrc[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
alignas(64) constexpr int16_t kShiftW[32] = {0, 0, 4, 4, 8, 8, 12, 12, 0, 0, 4, 4, 8, 8, 12, 12,
                                             0, 0, 4, 4, 8, 8, 12, 12, 0, 0, 4, 4, 8, 8, 12, 12};
alignas(64) constexpr int16_t kSelW[32] = {0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16,
                                           0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16};
alignas(64) constexpr int16_t kBaseW[32] = {0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28,
                                            0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28};
alignas(64) constexpr int16_t kPosTableW[64] = {0, 0, 1, 0, 2, 0, 1, 0, 3, 0, 1, 0, 2, 0, 1, 0, 0, 0, 0, 1, 0, 2,
                                                2, 1, 0, 3, 3, 1, 3, 2, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
// fp32 (16-position chunk, both rows of a pair in one call: lanes 0-7 row a, 8-15 row b; masks packed as
// ka | kb << 16): shift = 4 * ((l % 8) / 2) + 16 * (l / 8), position base = 4 * ((l % 8) / 2).
alignas(64) constexpr int32_t kShiftF[16] = {0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28};
alignas(64) constexpr int32_t kBaseF[16] = {0, 0, 4, 4, 8, 8, 12, 12, 0, 0, 4, 4, 8, 8, 12, 12};

// ============================================================================================== meta check
// detail::meta_bytes_ok, 64 bytes a step: vpshufb looks up both nibbles of each byte in a 16-entry table (0 where the
// nibble has exactly 2 bits set, else 0xFF); the last partial step loads valid nibbles (0x33) past the end.
SP24_AVX512 bool meta_bytes_ok_avx512(const uint8_t *p, int64_t n) {
    const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, -1, -1, 0, -1, 0, 0, -1, -1, 0, 0, -1, 0, -1, -1, -1));
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512i bad = _mm512_setzero_si512();
    int64_t i = 0;
    for (;; i += 64) {
        __m512i v;
        if (i + 64 <= n)
            v = _mm512_loadu_si512(p + i);
        else if (i < n)
            v = _mm512_mask_loadu_epi8(_mm512_set1_epi8(0x33), ~0ull >> (64 - (n - i)), p + i);
        else
            break;
        const __m512i lo = _mm512_and_si512(v, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        bad = _mm512_ternarylogic_epi32(bad, _mm512_shuffle_epi8(tab, lo), _mm512_shuffle_epi8(tab, hi), 0xFE);
    }
    return _mm512_test_epi8_mask(bad, bad) == 0;
}

// Whether the meta of weight rows [n, min(n + rows, n1)) is valid (contiguous rows: one pass).
SP24_AVX512 inline bool block_meta_ok(const LinearArgs &a, int64_t n, int rows, int64_t n1) {
    const int64_t mb = (a.K + 7) / 8;
    return meta_rows_ok(a.meta + n * mb, a.K, std::min<int64_t>(rows, n1 - n), meta_bytes_ok_avx512);
}

// ============================================================================================== AVX-512 (F/BW/VL/DQ)
// Prune+compress 16 positions (4 groups, one per 128-bit lane) per step: the keys are compared with the keys of the
// same group rotated by 1, 2, 3 (vpshufd), element j beats i if key_j > key_i or (equal and j < i), and a position
// is kept when at most one other beats it. The 16-bit keep mask is the 2 meta bytes of these 16 positions.
template <int KIND> // 0 = F32, 1 = BF16, 2 = F16
SP24_AVX512 void compress_row_avx512(const void *w, int64_t K, void *vals, uint8_t *meta, bool *mask) {
    const __m512i absm = _mm512_set1_epi32(static_cast<int>(kAbsMask[KIND]));
    const __m512i nank = _mm512_set1_epi32(static_cast<int>(kNanKey[KIND]));
    const int64_t nc = K / 16, rem = K % 16;
    for (int64_t c = 0; c < nc + (rem ? 1 : 0); ++c) {
        const bool full = c < nc;
        const __mmask16 lm = full ? 0xFFFF : static_cast<__mmask16>((1u << rem) - 1);
        __m512i raw;
        if constexpr (KIND == 0) {
            raw = full ? _mm512_loadu_si512(static_cast<const float *>(w) + 16 * c)
                       : _mm512_maskz_loadu_epi32(lm, static_cast<const float *>(w) + 16 * c);
        } else {
            const uint16_t *src = static_cast<const uint16_t *>(w) + 16 * c;
            raw = _mm512_cvtepu16_epi32(full ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src))
                                             : _mm256_maskz_loadu_epi16(lm, src));
        }
        const __m512i k = _mm512_min_epu32(_mm512_and_si512(raw, absm), nank);
        const __m512i k1 = _mm512_shuffle_epi32(k, static_cast<_MM_PERM_ENUM>(0x39));
        const __m512i k2 = _mm512_shuffle_epi32(k, static_cast<_MM_PERM_ENUM>(0x4E));
        const __m512i k3 = _mm512_shuffle_epi32(k, static_cast<_MM_PERM_ENUM>(0x93));
        const __mmask16 b1 = _mm512_cmpgt_epu32_mask(k1, k) | (_mm512_cmpeq_epi32_mask(k1, k) & 0x8888);
        const __mmask16 b2 = _mm512_cmpgt_epu32_mask(k2, k) | (_mm512_cmpeq_epi32_mask(k2, k) & 0xCCCC);
        const __mmask16 b3 = _mm512_cmpgt_epu32_mask(k3, k) | (_mm512_cmpeq_epi32_mask(k3, k) & 0xEEEE);
        const __mmask16 keep = static_cast<__mmask16>(~((b1 & b2) | (b1 & b3) | (b2 & b3)) & lm);
        if (vals) {
            const __m512i cv = _mm512_maskz_compress_epi32(keep, raw);
            const __mmask16 vm = full ? 0xFF : static_cast<__mmask16>((1u << (rem / 2)) - 1);
            if constexpr (KIND == 0) {
                _mm256_mask_storeu_epi32(static_cast<float *>(vals) + 8 * c, static_cast<__mmask8>(vm),
                                         _mm512_castsi512_si256(cv));
            } else {
                _mm_mask_storeu_epi16(static_cast<uint16_t *>(vals) + 8 * c, static_cast<__mmask8>(vm),
                                      _mm256_castsi256_si128(_mm512_cvtepi32_epi16(cv)));
            }
        }
        if (meta) {
            const uint16_t kk = keep;
            std::memcpy(meta + 2 * c, &kk, full ? 2 : static_cast<size_t>((rem + 7) / 8));
        }
        if (mask)
            _mm_mask_storeu_epi8(mask + 16 * c, lm, _mm_maskz_set1_epi8(keep, 1));
    }
}

// Decompress 16 positions per step from 8 values.
template <int BITS>
SP24_AVX512 bool decompress_row_avx512(const void *vals, const uint8_t *meta, int64_t K, void *out) {
    if (!meta_rows_ok(meta, K, 1, meta_bytes_ok_avx512))
        return false;
    const int64_t nc = K / 16, rem = K % 16;
    for (int64_t c = 0; c < nc + (rem ? 1 : 0); ++c) {
        const bool full = c < nc;
        uint16_t m16 = 0;
        std::memcpy(&m16, meta + 2 * c, full ? 2 : static_cast<size_t>((rem + 7) / 8));
        const __mmask16 lm = full ? 0xFFFF : static_cast<__mmask16>((1u << rem) - 1);
        const __mmask8 vm = full ? 0xFF : static_cast<__mmask8>((1u << (rem / 2)) - 1);
        if constexpr (BITS == 32) {
            const float *src = static_cast<const float *>(vals) + 8 * c;
            const __m256 v = full ? _mm256_loadu_ps(src) : _mm256_maskz_loadu_ps(vm, src);
            _mm512_mask_storeu_ps(static_cast<float *>(out) + 16 * c, lm,
                                  _mm512_maskz_expand_ps(m16, _mm512_castps256_ps512(v)));
        } else {
            const uint16_t *src = static_cast<const uint16_t *>(vals) + 8 * c;
            const __m128i v =
                full ? _mm_loadu_si128(reinterpret_cast<const __m128i *>(src)) : _mm_maskz_loadu_epi16(vm, src);
            const __m512i e = _mm512_maskz_expand_epi32(m16, _mm512_cvtepu16_epi32(_mm256_zextsi128_si256(v)));
            _mm256_mask_storeu_epi16(static_cast<uint16_t *>(out) + 16 * c, lm, _mm512_cvtepi32_epi16(e));
        }
    }
    return true;
}

// ============================================================================================== shared by the families
// The two sums of a pair accumulator (lanes 0-7 row a, 8-15 row b) to out[0], out[1].
SP24_AVX512 inline void reduce_pair(__m512 acc, float *out) {
    const __m256 lo = _mm512_castps512_ps256(acc), hi = _mm512_extractf32x8_ps(acc, 1);
    __m256 t = _mm256_hadd_ps(lo, hi); // l01 l23 h01 h23 | l45 l67 h45 h67
    t = _mm256_hadd_ps(t, t);          // l0-3 h0-3 . . | l4-7 h4-7 . .
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    out[0] = _mm_cvtss_f32(s);
    out[1] = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
}

// Prefetch of the next weights to stream (pfv / pfm: 8 rows, pf_bytes of values each; pfv == nullptr: none) into L2
// while the tiles run.
template <typename T> inline void prefetch_rows(const T *const *pfv, const uint8_t *const *pfm, int64_t pf_bytes) {
    if (!pfv)
        return;
    for (int r = 0; r < 8; ++r) {
        for (int64_t o = 0; o < pf_bytes; o += 64)
            _mm_prefetch(reinterpret_cast<const char *>(pfv[r]) + o, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(pfm[r]), _MM_HINT_T1);
    }
}

// ============================================================================================== the families
// The vector primitives of each family (what sparse24_avx512_tiles.h reads). They stay two structs because their
// instructions genuinely differ: 16 fp32 lanes with vexpandps + FMA, or 32 bf16 lanes with vpexpandw + vdpbf16ps.
//
// fp32-accumulating family: 16 positions per chunk, vexpandps + FMA. T = float, or uint16_t = bf16 (converted to
// fp32 on load; used when the CPU lacks AVX512_BF16/VBMI2).
template <typename T> struct F32Family {
    using Val = T;
    using Panel = float;
    using Vec = __m512; // x and weights in registers
    using XMask = __mmask16;
    static constexpr int CH = 16;

    SP24_AVX512 static inline __m512 load_x(const T *p, __mmask16 m) {
        if constexpr (sizeof(T) == 4) {
            return m == 0xFFFF ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
        } else {
            const __m256i h =
                m == 0xFFFF ? _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)) : _mm256_maskz_loadu_epi16(m, p);
            return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        }
    }
    SP24_AVX512 static inline __m512 load_w(const T *v, const uint8_t *mt, int64_t c, int64_t rem) {
        uint16_t m16 = 0;
        std::memcpy(&m16, mt + 2 * c, rem ? static_cast<size_t>((rem + 7) / 8) : 2);
        const __mmask8 vm = rem ? static_cast<__mmask8>((1u << (rem / 2)) - 1) : 0xFF;
        __m512 vv;
        if constexpr (sizeof(T) == 4) {
            vv = _mm512_castps256_ps512(rem ? _mm256_maskz_loadu_ps(vm, v + 8 * c) : _mm256_loadu_ps(v + 8 * c));
        } else {
            const __m128i h = rem ? _mm_maskz_loadu_epi16(vm, v + 8 * c)
                                  : _mm_loadu_si128(reinterpret_cast<const __m128i *>(v + 8 * c));
            vv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_zextsi128_si256(h)), 16));
        }
        return _mm512_maskz_expand_ps(m16, vv);
    }
    SP24_AVX512 static inline __m512 fma(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
    SP24_AVX512 static inline void store_panel(float *p, __m512 w) { _mm512_storeu_ps(p, w); }
    SP24_AVX512 static inline __m512 load_panel(const float *p) { return _mm512_loadu_ps(p); }

    // Pair panels (fp32 values only): [8 kept values of row a | 8 of row b] and the matching positions in x.
    static constexpr bool kPairs = sizeof(T) == 4;
    SP24_AVX512 static inline void build_pair(const T *va, const uint8_t *ma, const T *vb, const uint8_t *mb, int64_t c,
                                              int64_t rem, float *dst) {
        alignas(64) static const int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
        uint16_t ka = 0, kb = 0;
        const size_t nb = rem ? static_cast<size_t>((rem + 7) / 8) : 2;
        std::memcpy(&ka, ma + 2 * c, nb);
        std::memcpy(&kb, mb + 2 * c, nb);
        const __mmask8 vm = rem ? static_cast<__mmask8>((1u << (rem / 2)) - 1) : 0xFF;
        const float *pa = reinterpret_cast<const float *>(va) + 8 * c,
                    *pb = reinterpret_cast<const float *>(vb) + 8 * c;
        const __m256 a = rem ? _mm256_maskz_loadu_ps(vm, pa) : _mm256_loadu_ps(pa);
        const __m256 b = rem ? _mm256_maskz_loadu_ps(vm, pb) : _mm256_loadu_ps(pb);
        _mm512_storeu_ps(dst, _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1));
        if (rem) { // lanes past the kept count point at lane 15, which is past K and loaded as zero
            const __m512i io = _mm512_load_si512(reinterpret_cast<const void *>(iota)), fill = _mm512_set1_epi32(15);
            const __m512i ia = _mm512_mask_compress_epi32(fill, ka, io), ib = _mm512_mask_compress_epi32(fill, kb, io);
            _mm512_storeu_si512(reinterpret_cast<void *>(dst + 16),
                                _mm512_inserti64x4(ia, _mm512_castsi512_si256(ib), 1));
            return;
        }
        const __m512i tlo = _mm512_load_si512(kPosTable), thi = _mm512_load_si512(kPosTable + 16);
        const __m512i shift = _mm512_load_si512(kShiftF);
        const __m512i nib = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(ka | static_cast<uint32_t>(kb) << 16)), shift),
            _mm512_set1_epi32(15));
        const __m512i sel = _mm512_or_si512(nib, _mm512_load_si512(kSel16));
        const __m512i pos = _mm512_permutex2var_epi32(tlo, sel, thi);
        _mm512_storeu_si512(reinterpret_cast<void *>(dst + 16), _mm512_add_epi32(pos, _mm512_load_si512(kBaseF)));
    }
    SP24_AVX512 static inline __m512 perm(__m512i idx, __m512 x) { return _mm512_permutexvar_ps(idx, x); }
};

// ============================================================================================== AVX-512 BF16
// bf16 family: 32 positions per chunk, vpexpandw (VBMI2) under the 32-bit meta mask + vdpbf16ps.
struct Bf16Family {
    using Val = uint16_t;
    using Panel = uint16_t;
    using Vec = __m512i; // x and weights in registers: 32 bf16
    using XMask = __mmask32;
    static constexpr int CH = 32;

    SP24_AVX512BF16 static inline __m512i load_x(const uint16_t *p, __mmask32 m) {
        return m == 0xFFFFFFFFu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(m, p);
    }
    SP24_AVX512BF16 static inline __m512i load_w(const uint16_t *v, const uint8_t *mt, int64_t c, int64_t rem) {
        uint32_t m32 = 0;
        std::memcpy(&m32, mt + 4 * c, rem ? static_cast<size_t>((rem + 7) / 8) : 4);
        const __mmask16 vm = rem ? static_cast<__mmask16>((1u << (rem / 2)) - 1) : 0xFFFF;
        const __m256i h = rem ? _mm256_maskz_loadu_epi16(vm, v + 16 * c)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(v + 16 * c));
        return _mm512_maskz_expand_epi16(m32, _mm512_castsi256_si512(h));
    }
    SP24_AVX512BF16 static inline __m512 fma(__m512 acc, __m512i x, __m512i w) {
        return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
    }
    SP24_AVX512BF16 static inline void store_panel(uint16_t *p, __m512i w) {
        _mm512_storeu_si512(reinterpret_cast<void *>(p), w);
    }
    SP24_AVX512BF16 static inline __m512i load_panel(const uint16_t *p) {
        return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    }

    // Pair panels: [16 kept values of row a | 16 of row b] and the matching positions in x.
    static constexpr bool kPairs = true;
    SP24_AVX512BF16 static inline void build_pair(const uint16_t *va, const uint8_t *ma, const uint16_t *vb,
                                                  const uint8_t *mb, int64_t c, int64_t rem, uint16_t *dst) {
        alignas(64) static const uint16_t iota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                                      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
        uint32_t ka = 0, kb = 0;
        const size_t nb = rem ? static_cast<size_t>((rem + 7) / 8) : 4;
        std::memcpy(&ka, ma + 4 * c, nb);
        std::memcpy(&kb, mb + 4 * c, nb);
        const __mmask16 vm = rem ? static_cast<__mmask16>((1u << (rem / 2)) - 1) : 0xFFFF;
        const __m256i a = rem ? _mm256_maskz_loadu_epi16(vm, va + 16 * c)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(va + 16 * c));
        const __m256i b = rem ? _mm256_maskz_loadu_epi16(vm, vb + 16 * c)
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(vb + 16 * c));
        _mm512_storeu_si512(reinterpret_cast<void *>(dst), _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
        // Lanes past the kept count (tails only) point at lane 31, which is past K and loaded as zero.
        if (!rem) { // both rows at once in 16-bit lanes: lanes 0-15 row a, 16-31 row b
            const __m512i words = _mm512_permutexvar_epi16(
                _mm512_load_si512(kWordSrc), _mm512_castsi128_si512(_mm_cvtsi64_si128(
                                                 static_cast<long long>(ka | static_cast<uint64_t>(kb) << 32))));
            const __m512i shift = _mm512_load_si512(kShiftW);
            const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(words, shift), _mm512_set1_epi16(15));
            const __m512i pos =
                _mm512_permutex2var_epi16(_mm512_load_si512(kPosTableW), _mm512_or_si512(nib, _mm512_load_si512(kSelW)),
                                          _mm512_load_si512(kPosTableW + 32));
            _mm512_storeu_si512(reinterpret_cast<void *>(dst + 32), _mm512_add_epi16(pos, _mm512_load_si512(kBaseW)));
            return;
        }
        const __m512i io = _mm512_load_si512(reinterpret_cast<const void *>(iota)), fill = _mm512_set1_epi16(31);
        const __m512i ia = _mm512_mask_compress_epi16(fill, ka, io), ib = _mm512_mask_compress_epi16(fill, kb, io);
        _mm512_storeu_si512(reinterpret_cast<void *>(dst + 32), _mm512_inserti64x4(ia, _mm512_castsi512_si256(ib), 1));
    }
    SP24_AVX512BF16 static inline __m512i perm(__m512i idx, __m512i x) { return _mm512_permutexvar_epi16(idx, x); }
};

// The tile kernels of each family (sparse24_avx512_tiles.h), compiled with the family's target attribute.
namespace f32_tiles {
#define SP24_SIMD SP24_AVX512
#include "sparse24_avx512_tiles.h"
#undef SP24_SIMD
} // namespace f32_tiles
namespace bf16_tiles {
#define SP24_SIMD SP24_AVX512BF16
#include "sparse24_avx512_tiles.h"
#undef SP24_SIMD
} // namespace bf16_tiles

template <class F, typename T, int MR, int NR> bool run_direct(const LinearArgs &a, int64_t n0, int64_t n1) {
    const T *x = static_cast<const T *>(a.x);
    const T *v = static_cast<const T *>(a.values);
    const T *xr[MR];
    for (int i = 0; i < MR; ++i)
        xr[i] = x + i * a.ldx;
    for (int64_t n = n0; n < n1; n += NR) {
        if (!block_meta_ok(a, n, NR, n1)) // from memory into L1, where the tile reads it
            return false;
        const auto [vr, mr] = block_rows<NR>(a, v, n, n1); // past n1: the last row again (result discarded)
        float acc[MR * NR];
        F::template direct<MR, NR>(xr, vr, mr, a.K, acc);
        store_tile<T, NR>(a, acc, 0, MR, n, static_cast<int>(std::min<int64_t>(NR, n1 - n)));
    }
    return true;
}

// M > 4. Loop nest per thread: blocks of up to 64 rows of x (kept in L2) > panels of NR weight rows > K blocks of
// KC positions (the panel of a K block stays in L1) > tiles of MR rows. Partial accumulators of a tile live in `accs`
// between K blocks (16 floats per accumulator: the dot-product form reduces horizontally only once, at the end).
// The panel is the pair panel of 4 pairs (8 weight rows) where the family has one (F::kPairs), else 6 expanded rows.
template <class F, typename T> bool run_blocked(const LinearArgs &a, int64_t n0, int64_t n1) {
    constexpr bool kPairs = F::kPairs;
    constexpr int MR = 4, NR = kPairs ? 8 : 6;
    constexpr int NACC = kPairs ? NR / 2 : NR; // accumulators per row of x: one per pair, or per weight row
    // K block: an expanded panel of 6 KiB (bf16) or 12 KiB (fp32), a pair panel of 4 pairs x 16 chunks x 128 B = 8 KiB
    constexpr int64_t KC = 16 * F::CH;
    using P = typename F::Panel;
    const T *x = static_cast<const T *>(a.x);
    const T *v = static_cast<const T *>(a.values);
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    const int64_t mblk = std::max<int64_t>(
        MR, std::min<int64_t>(64, 512 * 1024 / std::max<int64_t>(1, a.K * static_cast<int64_t>(sizeof(T)))) / MR * MR);
    const int64_t nkb = (a.K + KC - 1) / KC;
    std::vector<P> panel(static_cast<size_t>(NR * KC));
    std::vector<float> accs(static_cast<size_t>((mblk / MR) * MR * NACC * 16));
    return for_panels<NR>(a, n0, n1, mblk, meta_bytes_ok_avx512, [&](int64_t m0, int64_t m1, int64_t n, int cols) {
        for (int64_t kb = 0; kb < nkb; ++kb) {
            const int64_t k0 = kb * KC, len = std::min(KC, a.K - k0);
            int64_t ld; // panel elements per pair (pair panel) or per row (expanded panel)
            if constexpr (kPairs) {
                const int64_t nch = (len + F::CH - 1) / F::CH, rem = len % F::CH;
                ld = nch * 2 * F::CH;
                const T *ra[NR / 2], *rb[NR / 2], *pfv[NR];
                const uint8_t *ma[NR / 2], *mbp[NR / 2], *pfm[NR];
                for (int p = 0; p < NR / 2; ++p) {
                    const int64_t ia = std::min(n + 2 * p, n1 - 1), ib = std::min(n + 2 * p + 1, n1 - 1);
                    ra[p] = v + ia * half;
                    rb[p] = v + ib * half;
                    ma[p] = a.meta + ia * mb;
                    mbp[p] = a.meta + ib * mb;
                }
                // Next weights to stream: this panel's rows at the next K block, else the next panel's rows.
                const bool more_k = kb + 1 < nkb;
                const int64_t pf_k = more_k ? k0 + KC : 0, pf_n = more_k ? n : n + NR;
                const bool pf = more_k || pf_n < n1;
                for (int r = 0; r < NR && pf; ++r) {
                    const int64_t ir = std::min(pf_n + r, n1 - 1);
                    pfv[r] = v + ir * half + pf_k / 2;
                    pfm[r] = a.meta + ir * mb + pf_k / 8;
                }
                const int64_t pf_len = std::min(KC, a.K - pf_k) / 2 * static_cast<int64_t>(sizeof(T));
                F::build_pairs(ra, rb, ma, mbp, k0 / F::CH, nch, rem, panel.data(), ld, pf ? pfv : nullptr, pfm,
                               pf_len);
            } else {
                ld = (len + F::CH - 1) / F::CH * F::CH;
                for (int j = 0; j < NR; ++j) {
                    const int64_t r = std::min(n + j, n1 - 1);
                    F::expand_row(v + r * half, a.meta + r * mb, k0, len, panel.data() + j * ld);
                }
            }
            const bool last = kb == nkb - 1;
            for (int64_t m = m0; m < m1; m += MR) {
                const T *xr[MR];
                tile_x_rows<MR>(x, a.ldx, m, m1, k0, xr);
                float *acc_io = accs.data() + ((m - m0) / MR) * MR * NACC * 16;
                const float *ain = kb ? acc_io : nullptr;
                float *aout = last ? nullptr : acc_io;
                float sums[MR * NR];
                if constexpr (kPairs)
                    F::template pair_tile<MR>(xr, panel.data(), ld, len, ain, aout, sums);
                else
                    F::template panel<MR, NR>(xr, panel.data(), ld, len, ain, aout, sums);
                if (last)
                    store_tile<T, NR>(a, sums, m, static_cast<int>(std::min<int64_t>(MR, m1 - m)), n, cols);
            }
        }
    });
}

// One (x, values) dtype pair of a family: the direct kernels for M <= 4, the blocked ones above.
template <class F, typename T> bool linear_rows(const LinearArgs &a, int64_t n0, int64_t n1) {
    if (n0 >= n1 || a.M <= 0)
        return true;
    switch (a.M) {
    case 1:
        return run_direct<F, T, 1, 8>(a, n0, n1);
    case 2:
        return run_direct<F, T, 2, 8>(a, n0, n1);
    case 3:
        return run_direct<F, T, 3, 6>(a, n0, n1);
    case 4:
        return run_direct<F, T, 4, 6>(a, n0, n1);
    default:
        return run_blocked<F, T>(a, n0, n1);
    }
}

} // namespace
} // namespace avx512

// AVX-512 F: the AVX2 family's table (its kernels run on every AVX-512 CPU) with the AVX-512 row kernels and the
// linear kernels of x and values of one dtype (bf16 through the fp32 kernels, converted on load), split by 24 (a
// multiple of every NR: 4, 6, 8). fp32 x with bf16 values keeps the AVX2 kernels: they widen the bf16 values in
// registers, where these kernels need the values converted to fp32 first (a 2x larger copy of the weight written and
// read on every call). Measured (Zen 4, 1 thread, K = N = 4096, ms AVX-512 with the conversion / AVX2 kernels,
// separate processes): M = 1 44.4 / 3.2, M = 16 55.5 / 15.1, M = 128 157 / 86. The dense route from 128 rows of x,
// for weights of 8M elements and more (sparse24.cpp, dense_route_min_rows).
const Kernels *kernels_avx512() {
    static const Kernels k = [] {
        using namespace avx512;
        Kernels t = *kernels_avx2();
        t.name = cpu::level_name(cpu::kAvx512);
        t.rows = {{compress_row_avx512<0>, compress_row_avx512<1>, compress_row_avx512<2>},
                  {decompress_row_avx512<16>, decompress_row_avx512<32>}};
        t.linear[0][0] = LinearKernel{linear_rows<f32_tiles::Tiles<F32Family<float>>, float>, nullptr, 24};
        t.linear[1][1] = LinearKernel{linear_rows<f32_tiles::Tiles<F32Family<uint16_t>>, uint16_t>, nullptr, 24};
        t.dense_min_rows = 128;
        t.dense_min_weight = int64_t{8} << 20;
        return t;
    }();
    return &k;
}

// AVX512_BF16 + VBMI2: the above with bf16 x and values through the vdpbf16ps kernels.
const Kernels *kernels_avx512_bf16() {
    static const Kernels k = [] {
        Kernels t = *kernels_avx512();
        t.name = cpu::level_name(cpu::kAvx512Bf16);
        t.linear[1][1] =
            LinearKernel{avx512::linear_rows<avx512::bf16_tiles::Tiles<avx512::Bf16Family>, uint16_t>, nullptr, 24};
        return t;
    }();
    return &k;
}
#endif // FASTDL_SP24_X86

} // namespace sparse24
} // namespace fastdl
