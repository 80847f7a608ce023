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

#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#define FASTDL_SP24_X86 1
#include <immintrin.h>
#endif

namespace fastdl {
namespace sparse24 {

namespace avx512 {

#ifdef FASTDL_SP24_X86
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

SP24_AVX512 inline float hsum512(__m512 v) {
    return _mm512_reduce_add_ps(v);
}

// The micro-kernels, stamped out for each family with its target attribute. Accumulators and weight registers
// are named variables (a<row><col>, w<col>; unused ones vanish under if constexpr): GCC spills a [4][6] array
// of accumulators to the stack on every iteration (measured: 2x slower), even split into rows. A tile reads
// its accumulators from `ain` (nullptr: zeros) and either stores them to `aout` (not the last K block) or writes
// their horizontal sums to out. Full chunks use unmasked loads (masked loads measured 25% slower on Zen 5);
// the K tail is one masked step. Generated code: clang-format is off for the macros.
// clang-format off
#define SP24_LOAD_WS(LOAD_W)                                                                                           \
    if constexpr (NR > 0)                                                                                              \
        w0 = LOAD_W(0);                                                                                                \
    if constexpr (NR > 1)                                                                                              \
        w1 = LOAD_W(1);                                                                                                \
    if constexpr (NR > 2)                                                                                              \
        w2 = LOAD_W(2);                                                                                                \
    if constexpr (NR > 3)                                                                                              \
        w3 = LOAD_W(3);                                                                                                \
    if constexpr (NR > 4)                                                                                              \
        w4 = LOAD_W(4);                                                                                                \
    if constexpr (NR > 5)                                                                                              \
        w5 = LOAD_W(5);                                                                                                \
    if constexpr (NR > 6)                                                                                              \
        w6 = LOAD_W(6);                                                                                                \
    if constexpr (NR > 7)                                                                                              \
        w7 = LOAD_W(7);
#define SP24_ROW(I, A)                                                                                                 \
    if constexpr (MR > I) {                                                                                            \
        const auto xv = load_x(xr[I] + CH * c, xm);                                                                    \
        if constexpr (NR > 0)                                                                                          \
            A##0 = fma(A##0, xv, w0);                                                                                  \
        if constexpr (NR > 1)                                                                                          \
            A##1 = fma(A##1, xv, w1);                                                                                  \
        if constexpr (NR > 2)                                                                                          \
            A##2 = fma(A##2, xv, w2);                                                                                  \
        if constexpr (NR > 3)                                                                                          \
            A##3 = fma(A##3, xv, w3);                                                                                  \
        if constexpr (NR > 4)                                                                                          \
            A##4 = fma(A##4, xv, w4);                                                                                  \
        if constexpr (NR > 5)                                                                                          \
            A##5 = fma(A##5, xv, w5);                                                                                  \
        if constexpr (NR > 6)                                                                                          \
            A##6 = fma(A##6, xv, w6);                                                                                  \
        if constexpr (NR > 7)                                                                                          \
            A##7 = fma(A##7, xv, w7);                                                                                  \
    }
#define SP24_TILE_STEP(LOAD_W)                                                                                         \
    decltype(LOAD_W(0)) w0, w1, w2, w3, w4, w5, w6, w7;                                                                \
    SP24_LOAD_WS(LOAD_W)                                                                                               \
    SP24_ROW(0, a0)                                                                                                    \
    SP24_ROW(1, a1)                                                                                                    \
    SP24_ROW(2, a2)                                                                                                    \
    SP24_ROW(3, a3)
#define SP24_TILE_LOOP(LOAD_W)                                                                                         \
    __m512 a00, a01, a02, a03, a04, a05, a06, a07;                                                                     \
    __m512 a10, a11, a12, a13, a14, a15, a16, a17;                                                                     \
    __m512 a20, a21, a22, a23, a24, a25, a26, a27;                                                                     \
    __m512 a30, a31, a32, a33, a34, a35, a36, a37;                                                                     \
    if constexpr (MR > 0 && NR > 0)                                                                                    \
        a00 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 0)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 1)                                                                                    \
        a01 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 1)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 2)                                                                                    \
        a02 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 2)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 3)                                                                                    \
        a03 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 3)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 4)                                                                                    \
        a04 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 4)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 5)                                                                                    \
        a05 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 5)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 6)                                                                                    \
        a06 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 6)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 0 && NR > 7)                                                                                    \
        a07 = ain ? _mm512_loadu_ps(ain + 16 * (0 * NR + 7)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 0)                                                                                    \
        a10 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 0)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 1)                                                                                    \
        a11 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 1)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 2)                                                                                    \
        a12 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 2)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 3)                                                                                    \
        a13 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 3)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 4)                                                                                    \
        a14 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 4)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 5)                                                                                    \
        a15 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 5)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 6)                                                                                    \
        a16 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 6)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 1 && NR > 7)                                                                                    \
        a17 = ain ? _mm512_loadu_ps(ain + 16 * (1 * NR + 7)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 0)                                                                                    \
        a20 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 0)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 1)                                                                                    \
        a21 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 1)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 2)                                                                                    \
        a22 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 2)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 3)                                                                                    \
        a23 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 3)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 4)                                                                                    \
        a24 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 4)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 5)                                                                                    \
        a25 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 5)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 6)                                                                                    \
        a26 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 6)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 2 && NR > 7)                                                                                    \
        a27 = ain ? _mm512_loadu_ps(ain + 16 * (2 * NR + 7)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 0)                                                                                    \
        a30 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 0)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 1)                                                                                    \
        a31 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 1)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 2)                                                                                    \
        a32 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 2)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 3)                                                                                    \
        a33 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 3)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 4)                                                                                    \
        a34 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 4)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 5)                                                                                    \
        a35 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 5)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 6)                                                                                    \
        a36 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 6)) : _mm512_setzero_ps();                                    \
    if constexpr (MR > 3 && NR > 7)                                                                                    \
        a37 = ain ? _mm512_loadu_ps(ain + 16 * (3 * NR + 7)) : _mm512_setzero_ps();                                    \
    const int64_t nc = K / CH, rem = K % CH;                                                                           \
    for (int64_t c = 0; c < nc; ++c) {                                                                                 \
        constexpr int64_t r = 0;                                                                                       \
        constexpr XMask xm = static_cast<XMask>(~XMask(0));                                                            \
        (void)r;                                                                                                       \
        SP24_TILE_STEP(LOAD_W)                                                                                         \
    }                                                                                                                  \
    if (rem) {                                                                                                         \
        const int64_t c = nc, r = rem;                                                                                 \
        const XMask xm = static_cast<XMask>((XMask(1) << rem) - 1);                                                    \
        (void)r;                                                                                                       \
        SP24_TILE_STEP(LOAD_W)                                                                                         \
    }                                                                                                                  \
    if (aout) {                                                                                                        \
        if constexpr (MR > 0 && NR > 0)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 0), a00);                                                           \
        if constexpr (MR > 0 && NR > 1)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 1), a01);                                                           \
        if constexpr (MR > 0 && NR > 2)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 2), a02);                                                           \
        if constexpr (MR > 0 && NR > 3)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 3), a03);                                                           \
        if constexpr (MR > 0 && NR > 4)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 4), a04);                                                           \
        if constexpr (MR > 0 && NR > 5)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 5), a05);                                                           \
        if constexpr (MR > 0 && NR > 6)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 6), a06);                                                           \
        if constexpr (MR > 0 && NR > 7)                                                                                \
            _mm512_storeu_ps(aout + 16 * (0 * NR + 7), a07);                                                           \
        if constexpr (MR > 1 && NR > 0)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 0), a10);                                                           \
        if constexpr (MR > 1 && NR > 1)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 1), a11);                                                           \
        if constexpr (MR > 1 && NR > 2)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 2), a12);                                                           \
        if constexpr (MR > 1 && NR > 3)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 3), a13);                                                           \
        if constexpr (MR > 1 && NR > 4)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 4), a14);                                                           \
        if constexpr (MR > 1 && NR > 5)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 5), a15);                                                           \
        if constexpr (MR > 1 && NR > 6)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 6), a16);                                                           \
        if constexpr (MR > 1 && NR > 7)                                                                                \
            _mm512_storeu_ps(aout + 16 * (1 * NR + 7), a17);                                                           \
        if constexpr (MR > 2 && NR > 0)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 0), a20);                                                           \
        if constexpr (MR > 2 && NR > 1)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 1), a21);                                                           \
        if constexpr (MR > 2 && NR > 2)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 2), a22);                                                           \
        if constexpr (MR > 2 && NR > 3)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 3), a23);                                                           \
        if constexpr (MR > 2 && NR > 4)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 4), a24);                                                           \
        if constexpr (MR > 2 && NR > 5)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 5), a25);                                                           \
        if constexpr (MR > 2 && NR > 6)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 6), a26);                                                           \
        if constexpr (MR > 2 && NR > 7)                                                                                \
            _mm512_storeu_ps(aout + 16 * (2 * NR + 7), a27);                                                           \
        if constexpr (MR > 3 && NR > 0)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 0), a30);                                                           \
        if constexpr (MR > 3 && NR > 1)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 1), a31);                                                           \
        if constexpr (MR > 3 && NR > 2)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 2), a32);                                                           \
        if constexpr (MR > 3 && NR > 3)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 3), a33);                                                           \
        if constexpr (MR > 3 && NR > 4)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 4), a34);                                                           \
        if constexpr (MR > 3 && NR > 5)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 5), a35);                                                           \
        if constexpr (MR > 3 && NR > 6)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 6), a36);                                                           \
        if constexpr (MR > 3 && NR > 7)                                                                                \
            _mm512_storeu_ps(aout + 16 * (3 * NR + 7), a37);                                                           \
    } else {                                                                                                           \
        if constexpr (MR > 0 && NR > 0)                                                                                \
            out[0 * NR + 0] = _mm512_reduce_add_ps(a00);                                                               \
        if constexpr (MR > 0 && NR > 1)                                                                                \
            out[0 * NR + 1] = _mm512_reduce_add_ps(a01);                                                               \
        if constexpr (MR > 0 && NR > 2)                                                                                \
            out[0 * NR + 2] = _mm512_reduce_add_ps(a02);                                                               \
        if constexpr (MR > 0 && NR > 3)                                                                                \
            out[0 * NR + 3] = _mm512_reduce_add_ps(a03);                                                               \
        if constexpr (MR > 0 && NR > 4)                                                                                \
            out[0 * NR + 4] = _mm512_reduce_add_ps(a04);                                                               \
        if constexpr (MR > 0 && NR > 5)                                                                                \
            out[0 * NR + 5] = _mm512_reduce_add_ps(a05);                                                               \
        if constexpr (MR > 0 && NR > 6)                                                                                \
            out[0 * NR + 6] = _mm512_reduce_add_ps(a06);                                                               \
        if constexpr (MR > 0 && NR > 7)                                                                                \
            out[0 * NR + 7] = _mm512_reduce_add_ps(a07);                                                               \
        if constexpr (MR > 1 && NR > 0)                                                                                \
            out[1 * NR + 0] = _mm512_reduce_add_ps(a10);                                                               \
        if constexpr (MR > 1 && NR > 1)                                                                                \
            out[1 * NR + 1] = _mm512_reduce_add_ps(a11);                                                               \
        if constexpr (MR > 1 && NR > 2)                                                                                \
            out[1 * NR + 2] = _mm512_reduce_add_ps(a12);                                                               \
        if constexpr (MR > 1 && NR > 3)                                                                                \
            out[1 * NR + 3] = _mm512_reduce_add_ps(a13);                                                               \
        if constexpr (MR > 1 && NR > 4)                                                                                \
            out[1 * NR + 4] = _mm512_reduce_add_ps(a14);                                                               \
        if constexpr (MR > 1 && NR > 5)                                                                                \
            out[1 * NR + 5] = _mm512_reduce_add_ps(a15);                                                               \
        if constexpr (MR > 1 && NR > 6)                                                                                \
            out[1 * NR + 6] = _mm512_reduce_add_ps(a16);                                                               \
        if constexpr (MR > 1 && NR > 7)                                                                                \
            out[1 * NR + 7] = _mm512_reduce_add_ps(a17);                                                               \
        if constexpr (MR > 2 && NR > 0)                                                                                \
            out[2 * NR + 0] = _mm512_reduce_add_ps(a20);                                                               \
        if constexpr (MR > 2 && NR > 1)                                                                                \
            out[2 * NR + 1] = _mm512_reduce_add_ps(a21);                                                               \
        if constexpr (MR > 2 && NR > 2)                                                                                \
            out[2 * NR + 2] = _mm512_reduce_add_ps(a22);                                                               \
        if constexpr (MR > 2 && NR > 3)                                                                                \
            out[2 * NR + 3] = _mm512_reduce_add_ps(a23);                                                               \
        if constexpr (MR > 2 && NR > 4)                                                                                \
            out[2 * NR + 4] = _mm512_reduce_add_ps(a24);                                                               \
        if constexpr (MR > 2 && NR > 5)                                                                                \
            out[2 * NR + 5] = _mm512_reduce_add_ps(a25);                                                               \
        if constexpr (MR > 2 && NR > 6)                                                                                \
            out[2 * NR + 6] = _mm512_reduce_add_ps(a26);                                                               \
        if constexpr (MR > 2 && NR > 7)                                                                                \
            out[2 * NR + 7] = _mm512_reduce_add_ps(a27);                                                               \
        if constexpr (MR > 3 && NR > 0)                                                                                \
            out[3 * NR + 0] = _mm512_reduce_add_ps(a30);                                                               \
        if constexpr (MR > 3 && NR > 1)                                                                                \
            out[3 * NR + 1] = _mm512_reduce_add_ps(a31);                                                               \
        if constexpr (MR > 3 && NR > 2)                                                                                \
            out[3 * NR + 2] = _mm512_reduce_add_ps(a32);                                                               \
        if constexpr (MR > 3 && NR > 3)                                                                                \
            out[3 * NR + 3] = _mm512_reduce_add_ps(a33);                                                               \
        if constexpr (MR > 3 && NR > 4)                                                                                \
            out[3 * NR + 4] = _mm512_reduce_add_ps(a34);                                                               \
        if constexpr (MR > 3 && NR > 5)                                                                                \
            out[3 * NR + 5] = _mm512_reduce_add_ps(a35);                                                               \
        if constexpr (MR > 3 && NR > 6)                                                                                \
            out[3 * NR + 6] = _mm512_reduce_add_ps(a36);                                                               \
        if constexpr (MR > 3 && NR > 7)                                                                                \
            out[3 * NR + 7] = _mm512_reduce_add_ps(a37);                                                               \
    }
#define SP24_DIRECT_W(J) load_w(vr[J], mr[J], c, r)
#define SP24_PANEL_W(J) load_panel(pn + (J) * Kp + CH * c)
// Pair tiles (M > 4): two weight rows share one vector: their kept values side by side (no zeros), and x is
// gathered to match with one vpermw/vpermps per row of x and pair (the index vector is built once per panel).
// Half the multiply-adds of the expanded form; the permute runs on another port (measured: 1.2-1.3x the
// expanded 4x6 panel tile at M = 8..128). Tile: MR rows of x times 4 pairs (8 output columns).
#define SP24_PAIR_ROW(I)                                                                                               \
    if constexpr (MR > I) {                                                                                            \
        const auto xv = load_x(xr[I] + CH * c, xm);                                                                    \
        p##I##0 = fma(p##I##0, perm(q0, xv), w0);                                                                      \
        p##I##1 = fma(p##I##1, perm(q1, xv), w1);                                                                      \
        p##I##2 = fma(p##I##2, perm(q2, xv), w2);                                                                      \
        p##I##3 = fma(p##I##3, perm(q3, xv), w3);                                                                      \
    }
#define SP24_PAIR_STEP                                                                                                 \
    const Panel *pc = pn + c * 2 * CH;                                                                                 \
    const auto w0 = load_panel(pc + 0 * ps);                                                                           \
    const __m512i q0 = load_idx(pc + 0 * ps + CH);                                                                     \
    const auto w1 = load_panel(pc + 1 * ps);                                                                           \
    const __m512i q1 = load_idx(pc + 1 * ps + CH);                                                                     \
    const auto w2 = load_panel(pc + 2 * ps);                                                                           \
    const __m512i q2 = load_idx(pc + 2 * ps + CH);                                                                     \
    const auto w3 = load_panel(pc + 3 * ps);                                                                           \
    const __m512i q3 = load_idx(pc + 3 * ps + CH);                                                                     \
    SP24_PAIR_ROW(0)                                                                                                   \
    SP24_PAIR_ROW(1)                                                                                                   \
    SP24_PAIR_ROW(2)                                                                                                   \
    SP24_PAIR_ROW(3)
#define SP24_PAIR_TILE                                                                                                 \
    __m512 p00, p01, p02, p03;                                                                                         \
    __m512 p10, p11, p12, p13;                                                                                         \
    __m512 p20, p21, p22, p23;                                                                                         \
    __m512 p30, p31, p32, p33;                                                                                         \
    if constexpr (MR > 0)                                                                                              \
        p00 = ain ? _mm512_loadu_ps(ain + 16 * (0 * 4 + 0)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 0)                                                                                              \
        p01 = ain ? _mm512_loadu_ps(ain + 16 * (0 * 4 + 1)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 0)                                                                                              \
        p02 = ain ? _mm512_loadu_ps(ain + 16 * (0 * 4 + 2)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 0)                                                                                              \
        p03 = ain ? _mm512_loadu_ps(ain + 16 * (0 * 4 + 3)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 1)                                                                                              \
        p10 = ain ? _mm512_loadu_ps(ain + 16 * (1 * 4 + 0)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 1)                                                                                              \
        p11 = ain ? _mm512_loadu_ps(ain + 16 * (1 * 4 + 1)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 1)                                                                                              \
        p12 = ain ? _mm512_loadu_ps(ain + 16 * (1 * 4 + 2)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 1)                                                                                              \
        p13 = ain ? _mm512_loadu_ps(ain + 16 * (1 * 4 + 3)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 2)                                                                                              \
        p20 = ain ? _mm512_loadu_ps(ain + 16 * (2 * 4 + 0)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 2)                                                                                              \
        p21 = ain ? _mm512_loadu_ps(ain + 16 * (2 * 4 + 1)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 2)                                                                                              \
        p22 = ain ? _mm512_loadu_ps(ain + 16 * (2 * 4 + 2)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 2)                                                                                              \
        p23 = ain ? _mm512_loadu_ps(ain + 16 * (2 * 4 + 3)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 3)                                                                                              \
        p30 = ain ? _mm512_loadu_ps(ain + 16 * (3 * 4 + 0)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 3)                                                                                              \
        p31 = ain ? _mm512_loadu_ps(ain + 16 * (3 * 4 + 1)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 3)                                                                                              \
        p32 = ain ? _mm512_loadu_ps(ain + 16 * (3 * 4 + 2)) : _mm512_setzero_ps();                                     \
    if constexpr (MR > 3)                                                                                              \
        p33 = ain ? _mm512_loadu_ps(ain + 16 * (3 * 4 + 3)) : _mm512_setzero_ps();                                     \
    const int64_t nc = K / CH, rem = K % CH;                                                                           \
    for (int64_t c = 0; c < nc; ++c) {                                                                                 \
        constexpr int64_t r = 0;                                                                                       \
        constexpr XMask xm = static_cast<XMask>(~XMask(0));                                                            \
        (void)r;                                                                                                       \
        SP24_PAIR_STEP                                                                                                 \
    }                                                                                                                  \
    if (rem) {                                                                                                         \
        const int64_t c = nc, r = rem;                                                                                 \
        const XMask xm = static_cast<XMask>((XMask(1) << rem) - 1);                                                    \
        (void)r;                                                                                                       \
        SP24_PAIR_STEP                                                                                                 \
    }                                                                                                                  \
    if (aout) {                                                                                                        \
        if constexpr (MR > 0)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (0 * 4 + 0), p00);                                                            \
        if constexpr (MR > 0)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (0 * 4 + 1), p01);                                                            \
        if constexpr (MR > 0)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (0 * 4 + 2), p02);                                                            \
        if constexpr (MR > 0)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (0 * 4 + 3), p03);                                                            \
        if constexpr (MR > 1)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (1 * 4 + 0), p10);                                                            \
        if constexpr (MR > 1)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (1 * 4 + 1), p11);                                                            \
        if constexpr (MR > 1)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (1 * 4 + 2), p12);                                                            \
        if constexpr (MR > 1)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (1 * 4 + 3), p13);                                                            \
        if constexpr (MR > 2)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (2 * 4 + 0), p20);                                                            \
        if constexpr (MR > 2)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (2 * 4 + 1), p21);                                                            \
        if constexpr (MR > 2)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (2 * 4 + 2), p22);                                                            \
        if constexpr (MR > 2)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (2 * 4 + 3), p23);                                                            \
        if constexpr (MR > 3)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (3 * 4 + 0), p30);                                                            \
        if constexpr (MR > 3)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (3 * 4 + 1), p31);                                                            \
        if constexpr (MR > 3)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (3 * 4 + 2), p32);                                                            \
        if constexpr (MR > 3)                                                                                          \
            _mm512_storeu_ps(aout + 16 * (3 * 4 + 3), p33);                                                            \
    } else {                                                                                                           \
        if constexpr (MR > 0)                                                                                          \
            reduce_pair(p00, out + 0 * 8 + 0);                                                                         \
        if constexpr (MR > 0)                                                                                          \
            reduce_pair(p01, out + 0 * 8 + 2);                                                                         \
        if constexpr (MR > 0)                                                                                          \
            reduce_pair(p02, out + 0 * 8 + 4);                                                                         \
        if constexpr (MR > 0)                                                                                          \
            reduce_pair(p03, out + 0 * 8 + 6);                                                                         \
        if constexpr (MR > 1)                                                                                          \
            reduce_pair(p10, out + 1 * 8 + 0);                                                                         \
        if constexpr (MR > 1)                                                                                          \
            reduce_pair(p11, out + 1 * 8 + 2);                                                                         \
        if constexpr (MR > 1)                                                                                          \
            reduce_pair(p12, out + 1 * 8 + 4);                                                                         \
        if constexpr (MR > 1)                                                                                          \
            reduce_pair(p13, out + 1 * 8 + 6);                                                                         \
        if constexpr (MR > 2)                                                                                          \
            reduce_pair(p20, out + 2 * 8 + 0);                                                                         \
        if constexpr (MR > 2)                                                                                          \
            reduce_pair(p21, out + 2 * 8 + 2);                                                                         \
        if constexpr (MR > 2)                                                                                          \
            reduce_pair(p22, out + 2 * 8 + 4);                                                                         \
        if constexpr (MR > 2)                                                                                          \
            reduce_pair(p23, out + 2 * 8 + 6);                                                                         \
        if constexpr (MR > 3)                                                                                          \
            reduce_pair(p30, out + 3 * 8 + 0);                                                                         \
        if constexpr (MR > 3)                                                                                          \
            reduce_pair(p31, out + 3 * 8 + 2);                                                                         \
        if constexpr (MR > 3)                                                                                          \
            reduce_pair(p32, out + 3 * 8 + 4);                                                                         \
        if constexpr (MR > 3)                                                                                          \
            reduce_pair(p33, out + 3 * 8 + 6);                                                                         \
    }
// Prefetch of the next weights to stream (pfv / pfm: 8 rows, pf_bytes of values each) into L2 while the tiles run.
#define SP24_PREFETCH_NEXT                                                                                             \
    if (pfv)                                                                                                           \
        for (int r = 0; r < 8; ++r) {                                                                                  \
            for (int64_t o = 0; o < pf_bytes; o += 64)                                                                 \
                _mm_prefetch(reinterpret_cast<const char *>(pfv[r]) + o, _MM_HINT_T1);                                 \
            _mm_prefetch(reinterpret_cast<const char *>(pfm[r]), _MM_HINT_T1);                                         \
        }
// The kernels of a family (F32Kernels / Bf16Kernels):
//   direct<MR, NR>  MR (<= 4) rows of x times NR weight rows expanded from values/meta on the fly, all of K;
//                   out[MR][NR] = the sums.
//   expand_row      expand positions [k0, k0 + len) of one weight row (k0 % CH == 0) into roundup(len, CH) values.
//   panel<MR, NR>   the same tile over K positions of NR expanded panel rows (row stride Kp); xr point at the block.
//   pair_tile<MR>   MR rows of x times 4 pairs of weight rows from a pair panel (pair stride ps); out[MR][8].
#define SP24_FAMILY_KERNELS(ATTR)                                                                                      \
    template <int MR, int NR>                                                                                          \
    ATTR static void direct(const Val *const *xr, const Val *const *vr, const uint8_t *const *mr, int64_t K,           \
                            float *out) {                                                                              \
        const float *ain = nullptr;                                                                                    \
        float *aout = nullptr;                                                                                         \
        SP24_TILE_LOOP(SP24_DIRECT_W)                                                                                  \
    }                                                                                                                  \
    ATTR static void expand_row(const Val *v, const uint8_t *mt, int64_t k0, int64_t len, Panel *dst) {                \
        const int64_t c0 = k0 / CH, nc = len / CH, rem = len % CH;                                                     \
        for (int64_t c = 0; c < nc; ++c)                                                                               \
            store_panel(dst + CH * c, load_w(v, mt, c0 + c, 0));                                                       \
        if (rem)                                                                                                       \
            store_panel(dst + CH * nc, load_w(v, mt, c0 + nc, rem));                                                   \
    }                                                                                                                  \
    template <int MR, int NR>                                                                                          \
    ATTR static void panel(const Val *const *xr, const Panel *pn, int64_t Kp, int64_t K, const float *ain,             \
                           float *aout, float *out) {                                                                  \
        SP24_TILE_LOOP(SP24_PANEL_W)                                                                                   \
    }                                                                                                                  \
    template <int MR>                                                                                                  \
    ATTR static void pair_tile(const Val *const *xr, const Panel *pn, int64_t ps, int64_t K, const float *ain,         \
                               float *aout, float *out) {                                                              \
        SP24_PAIR_TILE                                                                                                 \
    }
// clang-format on

// fp32-accumulating family: 16 positions per chunk, vexpandps + FMA. T = float, or uint16_t = bf16 (converted to
// fp32 on load; used when the CPU lacks AVX512_BF16/VBMI2).
template <typename T> struct F32Family {
    using Val = T;
    using Panel = float;
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
        // Lanes past the kept count (tails only) point at lane 15, which is past K and loaded as zero.
        if (!rem) {
            const __m512i tlo = _mm512_load_si512(kPosTable), thi = _mm512_load_si512(kPosTable + 16);
            const __m512i shift = _mm512_load_si512(kShiftF);
            const __m512i nib = _mm512_and_si512(
                _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(ka | static_cast<uint32_t>(kb) << 16)), shift),
                _mm512_set1_epi32(15));
            const __m512i sel = _mm512_or_si512(nib, _mm512_load_si512(kSel16));
            const __m512i pos = _mm512_permutex2var_epi32(tlo, sel, thi);
            _mm512_storeu_si512(reinterpret_cast<void *>(dst + 16), _mm512_add_epi32(pos, _mm512_load_si512(kBaseF)));
            return;
        }
        const __m512i io = _mm512_load_si512(reinterpret_cast<const void *>(iota)), fill = _mm512_set1_epi32(15);
        const __m512i ia = _mm512_mask_compress_epi32(fill, ka, io), ib = _mm512_mask_compress_epi32(fill, kb, io);
        _mm512_storeu_si512(reinterpret_cast<void *>(dst + 16), _mm512_inserti64x4(ia, _mm512_castsi512_si256(ib), 1));
    }
    SP24_AVX512 static void build_pairs(const T *const *ra, const T *const *rb, const uint8_t *const *ma,
                                        const uint8_t *const *mb, int64_t c0, int64_t nch, int64_t rem, float *pn,
                                        int64_t ps, const T *const *pfv, const uint8_t *const *pfm, int64_t pf_bytes) {
        for (int p = 0; p < 4; ++p)
            for (int64_t c = 0; c < nch; ++c)
                build_pair(ra[p], ma[p], rb[p], mb[p], c0 + c, c == nch - 1 ? rem : 0, pn + p * ps + c * 2 * CH);
        SP24_PREFETCH_NEXT
    }
    SP24_AVX512 static inline __m512i load_idx(const float *p) {
        return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    }
    SP24_AVX512 static inline __m512 perm(__m512i idx, __m512 x) { return _mm512_permutexvar_ps(idx, x); }
    SP24_AVX512 static inline void reduce_pair(__m512 acc, float *out) {
        const __m256 lo = _mm512_castps512_ps256(acc), hi = _mm512_extractf32x8_ps(acc, 1);
        __m256 t = _mm256_hadd_ps(lo, hi); // l01 l23 h01 h23 | l45 l67 h45 h67
        t = _mm256_hadd_ps(t, t);          // l0-3 h0-3 . . | l4-7 h4-7 . .
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        out[0] = _mm_cvtss_f32(s);
        out[1] = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
    }
};

template <typename T> struct F32Kernels : F32Family<T> {
    using Base = F32Family<T>;
    using typename Base::Panel;
    using typename Base::Val;
    using XMask = __mmask16;
    using Base::build_pair;
    using Base::build_pairs;
    using Base::CH;
    using Base::fma;
    using Base::kPairs;
    using Base::load_idx;
    using Base::load_panel;
    using Base::load_w;
    using Base::load_x;
    using Base::perm;
    using Base::reduce_pair;
    using Base::store_panel;
    SP24_FAMILY_KERNELS(SP24_AVX512)
};

// ============================================================================================== AVX-512 BF16
// bf16 family: 32 positions per chunk, vpexpandw (VBMI2) under the 32-bit meta mask + vdpbf16ps.
struct Bf16Kernels {
    using Val = uint16_t;
    using Panel = uint16_t;
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
    SP24_AVX512BF16 static void build_pairs(const uint16_t *const *ra, const uint16_t *const *rb,
                                            const uint8_t *const *ma, const uint8_t *const *mb, int64_t c0, int64_t nch,
                                            int64_t rem, uint16_t *pn, int64_t ps, const uint16_t *const *pfv,
                                            const uint8_t *const *pfm, int64_t pf_bytes) {
        for (int p = 0; p < 4; ++p)
            for (int64_t c = 0; c < nch; ++c)
                build_pair(ra[p], ma[p], rb[p], mb[p], c0 + c, c == nch - 1 ? rem : 0, pn + p * ps + c * 2 * CH);
        SP24_PREFETCH_NEXT
    }
    SP24_AVX512BF16 static inline __m512i load_idx(const uint16_t *p) {
        return _mm512_loadu_si512(reinterpret_cast<const void *>(p));
    }
    SP24_AVX512BF16 static inline __m512i perm(__m512i idx, __m512i x) { return _mm512_permutexvar_epi16(idx, x); }
    SP24_AVX512BF16 static inline void reduce_pair(__m512 acc, float *out) {
        const __m256 lo = _mm512_castps512_ps256(acc), hi = _mm512_extractf32x8_ps(acc, 1);
        __m256 t = _mm256_hadd_ps(lo, hi);
        t = _mm256_hadd_ps(t, t);
        const __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        out[0] = _mm_cvtss_f32(s);
        out[1] = _mm_cvtss_f32(_mm_shuffle_ps(s, s, 1));
    }
    SP24_FAMILY_KERNELS(SP24_AVX512BF16)
};

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
// KC positions (the expanded panel, NR x KC, stays in L1) > tiles of MR rows. Partial accumulators of a tile live in
// `accs` between K blocks (16 floats per output: the dot-product form reduces horizontally only once, at the end).
template <class F, typename T> bool run_panel(const LinearArgs &a, int64_t n0, int64_t n1) {
    constexpr int MR = 4, NR = 6;
    constexpr int64_t KC = 16 * F::CH; // the expanded panel is 6 KiB (bf16) or 12 KiB (fp32): L1
    using P = typename F::Panel;
    const T *x = static_cast<const T *>(a.x);
    const T *v = static_cast<const T *>(a.values);
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    const int64_t mblk = std::max<int64_t>(
        MR, std::min<int64_t>(64, 512 * 1024 / std::max<int64_t>(1, a.K * static_cast<int64_t>(sizeof(T)))) / MR * MR);
    const int64_t nkb = (a.K + KC - 1) / KC;
    std::vector<P> panel(static_cast<size_t>(NR * KC));
    std::vector<float> accs(static_cast<size_t>((mblk / MR) * MR * NR * 16));
    for (int64_t m0 = 0; m0 < a.M; m0 += mblk) {
        const int64_t m1 = std::min(a.M, m0 + mblk);
        for (int64_t n = n0; n < n1; n += NR) {
            const int cols = static_cast<int>(std::min<int64_t>(NR, n1 - n));
            if (m0 == 0 && !block_meta_ok(a, n, NR, n1)) // the first pass over these rows checks their meta
                return false;
            for (int64_t kb = 0; kb < nkb; ++kb) {
                const int64_t k0 = kb * KC, len = std::min(KC, a.K - k0);
                const int64_t kp = (len + F::CH - 1) / F::CH * F::CH;
                for (int j = 0; j < NR; ++j) {
                    const int64_t r = std::min(n + j, n1 - 1);
                    F::expand_row(v + r * half, a.meta + r * mb, k0, len, panel.data() + j * kp);
                }
                const bool last = kb == nkb - 1;
                for (int64_t m = m0; m < m1; m += MR) {
                    const T *xr[MR];
                    for (int i = 0; i < MR; ++i)
                        xr[i] = x + std::min(m + i, m1 - 1) * a.ldx + k0;
                    float *acc_io = accs.data() + ((m - m0) / MR) * MR * NR * 16;
                    float sums[MR * NR];
                    F::template panel<MR, NR>(xr, panel.data(), kp, len, kb ? acc_io : nullptr, last ? nullptr : acc_io,
                                              sums);
                    if (last)
                        store_tile<T, NR>(a, sums, m, static_cast<int>(std::min<int64_t>(MR, m1 - m)), n, cols);
                }
            }
        }
    }
    return true;
}

// M > 4 with pair panels: same loop nest as run_panel, panels of 4 pairs = 8 weight rows.
template <class F, typename T> bool run_pairs(const LinearArgs &a, int64_t n0, int64_t n1) {
    constexpr int MR = 4, NP = 4, NR = 2 * NP;
    constexpr int64_t KC = 16 * F::CH; // pair panel of a K block: 4 pairs x 16 chunks x 128 B = 8 KiB (L1)
    using P = typename F::Panel;
    const T *x = static_cast<const T *>(a.x);
    const T *v = static_cast<const T *>(a.values);
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    const int64_t mblk = std::max<int64_t>(
        MR, std::min<int64_t>(64, 512 * 1024 / std::max<int64_t>(1, a.K * static_cast<int64_t>(sizeof(T)))) / MR * MR);
    const int64_t nkb = (a.K + KC - 1) / KC;
    std::vector<P> panel(static_cast<size_t>(NP * 2 * KC));
    std::vector<float> accs(static_cast<size_t>((mblk / MR) * MR * NP * 16));
    for (int64_t m0 = 0; m0 < a.M; m0 += mblk) {
        const int64_t m1 = std::min(a.M, m0 + mblk);
        for (int64_t n = n0; n < n1; n += NR) {
            const int cols = static_cast<int>(std::min<int64_t>(NR, n1 - n));
            if (m0 == 0 && !block_meta_ok(a, n, NR, n1)) // the first pass over these rows checks their meta
                return false;
            for (int64_t kb = 0; kb < nkb; ++kb) {
                const int64_t k0 = kb * KC, len = std::min(KC, a.K - k0);
                const int64_t nch = (len + F::CH - 1) / F::CH, rem = len % F::CH;
                const int64_t ps = nch * 2 * F::CH; // panel elements per pair
                const T *ra[NP], *rb[NP], *pfv[NR];
                const uint8_t *ma[NP], *mbp[NP], *pfm[NR];
                for (int p = 0; p < NP; ++p) {
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
                F::build_pairs(ra, rb, ma, mbp, k0 / F::CH, nch, rem, panel.data(), ps, pf ? pfv : nullptr, pfm,
                               pf_len);
                const bool last = kb == nkb - 1;
                for (int64_t m = m0; m < m1; m += MR) {
                    const T *xr[MR];
                    for (int i = 0; i < MR; ++i)
                        xr[i] = x + std::min(m + i, m1 - 1) * a.ldx + k0;
                    float *acc_io = accs.data() + ((m - m0) / MR) * MR * NP * 16;
                    float sums[MR * NR];
                    F::template pair_tile<MR>(xr, panel.data(), ps, len, kb ? acc_io : nullptr, last ? nullptr : acc_io,
                                              sums);
                    if (last)
                        store_tile<T, NR>(a, sums, m, static_cast<int>(std::min<int64_t>(MR, m1 - m)), n, cols);
                }
            }
        }
    }
    return true;
}

template <class F, typename T> bool linear_family(const LinearArgs &a, int64_t n0, int64_t n1) {
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
        if constexpr (F::kPairs)
            return run_pairs<F, T>(a, n0, n1);
        else
            return run_panel<F, T>(a, n0, n1);
    }
}

} // namespace

const RowKernels kRows = {{compress_row_avx512<0>, compress_row_avx512<1>, compress_row_avx512<2>},
                          {decompress_row_avx512<16>, decompress_row_avx512<32>}};
#else
const RowKernels kRows = {};
#endif // FASTDL_SP24_X86

bool linear_rows(bool bf16_dot, const LinearArgs &a, int64_t n0, int64_t n1) {
    if (n0 >= n1 || a.M <= 0)
        return true;
#ifdef FASTDL_SP24_X86
    if (a.vdt == a.dt) {
        if (a.dt == DType::F32)
            return linear_family<F32Kernels<float>, float>(a, n0, n1);
        if (bf16_dot)
            return linear_family<Bf16Kernels, uint16_t>(a, n0, n1);
        return linear_family<F32Kernels<uint16_t>, uint16_t>(a, n0, n1);
    }
#else
    (void)bf16_dot;
#endif
    return scalar::linear_rows(a, n0, n1); // mixed dtypes: the glue converts the values first
}

} // namespace avx512
} // namespace sparse24
} // namespace fastdl
