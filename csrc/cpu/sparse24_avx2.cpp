// 2:4 sparsity, AVX2 + FMA kernels (Haswell and later, AMD Zen 1-3, and any AVX-512 CPU capped with
// FASTDL_CPU_ISA=avx2). No torch headers; every function enables AVX2 + FMA with a target attribute and the dispatch
// (sparse24.cpp) calls in only when cpu_isa.h reports the level. Threading is done by the caller on row ranges.
//
// One meta byte covers 8 positions = 2 groups = 4 kept values, so every kernel steps 8 positions at a time and looks
// up a per-byte table (256 entries; a 2:4 meta only ever uses 36 of them):
//  * prune+compress: the 8 magnitude keys of 2 groups (one group per 128-bit lane) are compared with the keys of the
//    same group rotated by 1, 2, 3 (vpshufd); a position is kept when at most one other beats it. movmskps of the
//    result is the meta byte; vpermd (fp32) / pshufb (16-bit) by that byte packs the 4 kept values.
//  * decompress / expand: the 4 kept values are broadcast to both 128-bit lanes (vpbroadcastq / vbroadcasti128) and
//    one vpshufb by the meta byte's control places them at their positions, zeroes the pruned lanes and (bf16 values)
//    widens them to fp32 by putting the 2 bytes in the high half of each 32-bit lane. One load + one shuffle per
//    8 positions, no separate widening or masking.
//  * sparse linear, M <= 4 ("direct", memory-bound): MR rows of x x NR weight rows, each weight row expanded on the
//    fly, 16 positions per step (one 16-byte broadcast of 8 bf16 values and one 16-bit meta load feed two vpshufb),
//    multiplied (FMA, fp32 accumulation) with the x values of those positions. The weight is read once per 4 rows
//    of x, in its stored dtype: bf16 values stream 2.25 bytes per kept value (meta included), fp32 x reads bf16
//    values directly (widened in registers), so a user keeps fp32 activations and half-size weights.
//  * 5 <= M < 18 ("panel"): per 3 weight rows and K block of 512 positions, the expanded fp32 panel (6 KiB) is built
//    once in L1 and reused by every 4-row tile of x (4 x 3 dot-product tile, 12 accumulators).
//  * M >= 18 ("broadcast", compute-bound): the classic 6 x 16 GEMM tile on a k-major expanded panel (see
//    linear_bcast); ~84% of the FMA peak. Both expanded kernels do the dense GEMM's multiply-adds (half on zeros):
//    their gain over a dense fp32 GEMM is the weight bytes, not the FLOPs.
//  Alternatives measured (prototype, 1 thread, K = 4096, N = 504, AVX2 on the Zen 4 dev machine, useful GFLOP/s =
//  2 M N K / 2 / t): at M = 16 / 48 the panel tile reached 27-34 / 28-37, a pair tile (two weight rows' kept values
//  in one vector, x gathered to match with vpermps, the AVX-512 kernel's trick) 18-20 / 11-33, and a transposed-x
//  tile (every FMA useful: broadcast each kept value, load the 8-24 x rows of its position) 21-32 / 12-17: vpermps
//  and the extra loads cost more than the zero lanes save.
// These inner loops stay apart from sparse24_avx512.cpp's because they genuinely differ (AVX2 has no vexpandps /
// vpexpandw: a byte-table vpshufb expands 8 positions); the loop nest and tile helpers are shared (sparse24_kernels.h).
#include "sparse24_kernels.h"

#ifdef FASTDL_SP24_X86
#include <immintrin.h>
#endif

#include <vector>

namespace fastdl {
namespace sparse24 {

#ifdef FASTDL_SP24_X86
namespace avx2 {
namespace {

using namespace detail;

#define SP24_AVX2 __attribute__((target("avx2,fma")))

// ----------------------------------------------------------------------------------------------- tables
// Rank of position p among the set bits of byte b below it (the index of its value in the byte's 4 kept values).
constexpr int rank_below(int b, int p) {
    int r = 0;
    for (int q = 0; q < p; ++q)
        r += (b >> q) & 1;
    return r;
}

struct Tables {
    alignas(32) uint8_t exp_bf16[256][32];    // vpshufb: 4 bf16 in bytes 0-7 of each lane -> 8 fp32 lanes
    alignas(32) uint8_t exp_bf16_hi[256][32]; // the same from bytes 8-15 (the second meta byte of a 16-position step)
    alignas(32) uint8_t exp_f32[256][32];     // vpshufb: 4 fp32 in bytes 0-15 of each lane -> 8 fp32 lanes
    alignas(16) uint8_t exp_16[256][16];      // pshufb: 4 16-bit values in bytes 0-7 -> 8 16-bit lanes
    alignas(16) uint8_t cmp_16[256][16];      // pshufb: 8 16-bit lanes -> the kept ones in bytes 0-7
    alignas(32) int32_t cmp_32[256][8];       // vpermd: 8 32-bit lanes -> the kept ones in lanes 0-3
    uint64_t mask_bytes[256];                 // the 8 bits of b as 8 bool bytes
    // Lanes of a byte with more than 4 bits (not a 2:4 meta) read the wrong value, never out of the 16-byte lane.
    constexpr Tables() : exp_bf16(), exp_bf16_hi(), exp_f32(), exp_16(), cmp_16(), cmp_32(), mask_bytes() {
        for (int b = 0; b < 256; ++b) {
            int r = 0;
            for (int p = 0; p < 8; ++p) {
                const bool on = (b >> p) & 1;
                const int rk = rank_below(b, p) & 3;
                for (int q = 0; q < 4; ++q) {
                    exp_bf16[b][4 * p + q] = on && q >= 2 ? static_cast<uint8_t>(2 * rk + q - 2) : 0x80;
                    exp_bf16_hi[b][4 * p + q] = on && q >= 2 ? static_cast<uint8_t>(8 + 2 * rk + q - 2) : 0x80;
                    exp_f32[b][4 * p + q] = on ? static_cast<uint8_t>(4 * rk + q) : 0x80;
                }
                for (int q = 0; q < 2; ++q)
                    exp_16[b][2 * p + q] = on ? static_cast<uint8_t>(2 * rk + q) : 0x80;
                if (on) {
                    if (r < 4) {
                        cmp_16[b][2 * r] = static_cast<uint8_t>(2 * p);
                        cmp_16[b][2 * r + 1] = static_cast<uint8_t>(2 * p + 1);
                        cmp_32[b][r] = p;
                    }
                    ++r;
                }
                mask_bytes[b] |= static_cast<uint64_t>(on) << (8 * p);
            }
            for (int q = 8; q < 16; ++q)
                cmp_16[b][q] = 0x80;
        }
    }
};
constexpr Tables kT{};

// ----------------------------------------------------------------------------------------------- loads
SP24_AVX2 inline __m256 load8(const float *p) {
    return _mm256_loadu_ps(p);
}
SP24_AVX2 inline __m256 load8(const uint16_t *p) { // 8 bf16 -> fp32 (exact)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// The 8 positions of meta byte `byte` as fp32 (zeros at pruned positions) from its 4 kept values at v.
SP24_AVX2 inline __m256 expand8(const uint16_t *v, unsigned byte) {
    long long q;
    std::memcpy(&q, v, 8);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(
        _mm256_set1_epi64x(q), _mm256_load_si256(reinterpret_cast<const __m256i *>(kT.exp_bf16[byte]))));
}
SP24_AVX2 inline __m256 expand8(const float *v, unsigned byte) {
    const __m256i s = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(v)));
    return _mm256_castsi256_ps(
        _mm256_shuffle_epi8(s, _mm256_load_si256(reinterpret_cast<const __m256i *>(kT.exp_f32[byte]))));
}

SP24_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// ----------------------------------------------------------------------------------------------- meta check
// detail::meta_bytes_ok, 32 bytes a step: vpshufb looks up both nibbles of each byte in a 16-entry table (0 where the
// nibble has exactly 2 bits set, else 0xFF); the rest (< 32 bytes) in scalar.
SP24_AVX2 bool meta_bytes_ok_avx2(const uint8_t *p, int64_t n) {
    const __m256i tab = _mm256_setr_epi8(-1, -1, -1, 0, -1, 0, 0, -1, -1, 0, 0, -1, 0, -1, -1, -1, //
                                         -1, -1, -1, 0, -1, 0, 0, -1, -1, 0, 0, -1, 0, -1, -1, -1);
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i));
        const __m256i lo = _mm256_and_si256(v, lo4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_shuffle_epi8(tab, lo), _mm256_shuffle_epi8(tab, hi)));
    }
    return _mm256_testz_si256(bad, bad) && meta_bytes_ok(p + i, n - i);
}

// Whether the meta of weight rows [n, min(n + rows, n1)) is valid (contiguous rows: one pass).
SP24_AVX2 inline bool block_meta_ok(const LinearArgs &a, int64_t n, int rows, int64_t n1) {
    const int64_t mb = (a.K + 7) / 8;
    return meta_rows_ok(a.meta + n * mb, a.K, std::min<int64_t>(rows, n1 - n), meta_bytes_ok_avx2);
}

// x . w over the trailing group (K % 8 == 4) of one row pair, scalar.
template <typename XT, typename VT> inline float tail_dot(const XT *xr, const VT *vr, const uint8_t *mr, int64_t K) {
    const int64_t g = K / 4 - 1;
    int p0, p1;
    kept_positions(meta_nibble(mr, g), p0, p1);
    return to_f32(xr[4 * g + p0]) * to_f32(vr[2 * g]) + to_f32(xr[4 * g + p1]) * to_f32(vr[2 * g + 1]);
}

// ----------------------------------------------------------------------------------------------- compress
template <int KIND> // 0 = F32, 1 = BF16, 2 = F16
SP24_AVX2 void compress_row(const void *w, int64_t K, void *vals, uint8_t *meta, bool *mask) {
    const __m256i absm = _mm256_set1_epi32(static_cast<int>(kAbsMask[KIND]));
    const __m256i nank = _mm256_set1_epi32(static_cast<int>(kNanKey[KIND]));
    // element j beats element i on equal keys when j < i: lanes (of each group) where the rotated partner is lower
    const __m256i tie1 = _mm256_setr_epi32(0, 0, 0, -1, 0, 0, 0, -1);
    const __m256i tie2 = _mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1);
    const __m256i tie3 = _mm256_setr_epi32(0, -1, -1, -1, 0, -1, -1, -1);
    const int64_t nc = K / 8;
    for (int64_t c = 0; c < nc; ++c) {
        __m256i raw;
        __m128i raw16 = _mm_setzero_si128();
        if constexpr (KIND == 0) {
            raw = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(static_cast<const float *>(w) + 8 * c));
        } else {
            raw16 = _mm_loadu_si128(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(w) + 8 * c));
            raw = _mm256_cvtepu16_epi32(raw16);
        }
        const __m256i k = _mm256_min_epu32(_mm256_and_si256(raw, absm), nank);
        const __m256i k1 = _mm256_shuffle_epi32(k, 0x39), k2 = _mm256_shuffle_epi32(k, 0x4E),
                      k3 = _mm256_shuffle_epi32(k, 0x93);
        const __m256i b1 =
            _mm256_or_si256(_mm256_cmpgt_epi32(k1, k), _mm256_and_si256(_mm256_cmpeq_epi32(k1, k), tie1));
        const __m256i b2 =
            _mm256_or_si256(_mm256_cmpgt_epi32(k2, k), _mm256_and_si256(_mm256_cmpeq_epi32(k2, k), tie2));
        const __m256i b3 =
            _mm256_or_si256(_mm256_cmpgt_epi32(k3, k), _mm256_and_si256(_mm256_cmpeq_epi32(k3, k), tie3));
        const __m256i lost = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(b1, b2), _mm256_and_si256(b1, b3)),
                                             _mm256_and_si256(b2, b3));
        const unsigned keep = static_cast<unsigned>(~_mm256_movemask_ps(_mm256_castsi256_ps(lost))) & 0xFFu;
        if (vals) {
            if constexpr (KIND == 0) {
                const __m256i packed = _mm256_permutevar8x32_epi32(
                    raw, _mm256_load_si256(reinterpret_cast<const __m256i *>(kT.cmp_32[keep])));
                _mm_storeu_si128(reinterpret_cast<__m128i *>(static_cast<float *>(vals) + 4 * c),
                                 _mm256_castsi256_si128(packed));
            } else {
                const __m128i packed =
                    _mm_shuffle_epi8(raw16, _mm_load_si128(reinterpret_cast<const __m128i *>(kT.cmp_16[keep])));
                _mm_storel_epi64(reinterpret_cast<__m128i *>(static_cast<uint16_t *>(vals) + 4 * c), packed);
            }
        }
        if (meta)
            meta[c] = static_cast<uint8_t>(keep);
        if (mask)
            std::memcpy(mask + 8 * c, &kT.mask_bytes[keep], 8);
    }
    if (K % 8) { // one trailing group
        if constexpr (KIND == 0)
            compress_group(static_cast<const uint32_t *>(w) + 8 * nc, 2 * nc, KIND, static_cast<uint32_t *>(vals), meta,
                           mask);
        else
            compress_group(static_cast<const uint16_t *>(w) + 8 * nc, 2 * nc, KIND, static_cast<uint16_t *>(vals), meta,
                           mask);
    }
}

// ----------------------------------------------------------------------------------------------- decompress
template <int BYTES> SP24_AVX2 bool decompress_row(const void *vals, const uint8_t *meta, int64_t K, void *out) {
    if (!meta_rows_ok(meta, K, 1, meta_bytes_ok_avx2))
        return false;
    const int64_t nc = K / 8;
    for (int64_t c = 0; c < nc; ++c) {
        const unsigned byte = meta[c];
        if constexpr (BYTES == 4) {
            _mm256_storeu_ps(static_cast<float *>(out) + 8 * c,
                             expand8(static_cast<const float *>(vals) + 4 * c, byte));
        } else {
            const __m128i v =
                _mm_loadl_epi64(reinterpret_cast<const __m128i *>(static_cast<const uint16_t *>(vals) + 4 * c));
            _mm_storeu_si128(reinterpret_cast<__m128i *>(static_cast<uint16_t *>(out) + 8 * c),
                             _mm_shuffle_epi8(v, _mm_load_si128(reinterpret_cast<const __m128i *>(kT.exp_16[byte]))));
        }
    }
    if (K % 8) {
        if constexpr (BYTES == 4)
            decompress_group(static_cast<const uint32_t *>(vals), meta, 2 * nc, static_cast<uint32_t *>(out));
        else
            decompress_group(static_cast<const uint16_t *>(vals), meta, 2 * nc, static_cast<uint16_t *>(out));
    }
    return true;
}

// One row of bf16 values -> dense fp32 (the dense route's weight).
SP24_AVX2 void expand_row_f32(const uint16_t *v, const uint8_t *mt, int64_t K, float *out) {
    const int64_t nc = K / 8;
    for (int64_t c = 0; c < nc; ++c)
        _mm256_storeu_ps(out + 8 * c, expand8(v + 4 * c, mt[c]));
    if (K % 8) {
        const int nib = mt[nc] & 15;
        int j = 0;
        for (int i = 0; i < 4; ++i)
            out[8 * nc + i] = ((nib >> i) & 1) && j < 2 ? bf16_to_f32(v[4 * nc + j++]) : 0.f;
    }
}

// ----------------------------------------------------------------------------------------------- direct (small M)
// 16 positions (2 meta bytes, 8 kept values) of one weight row per step: one 16-byte broadcast of the 8 bf16 values
// feeds both vpshufb expansions (the second byte's control reads bytes 8-15), and the 2 meta bytes are one 16-bit
// load: 4 loads per 16 positions instead of 6.
SP24_AVX2 inline void expand16(const uint16_t *v, unsigned bytes, __m256 &lo, __m256 &hi) {
    const __m256i s = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(v)));
    lo = _mm256_castsi256_ps(
        _mm256_shuffle_epi8(s, _mm256_load_si256(reinterpret_cast<const __m256i *>(kT.exp_bf16[bytes & 0xFF]))));
    hi = _mm256_castsi256_ps(
        _mm256_shuffle_epi8(s, _mm256_load_si256(reinterpret_cast<const __m256i *>(kT.exp_bf16_hi[bytes >> 8]))));
}
SP24_AVX2 inline void expand16(const float *v, unsigned bytes, __m256 &lo, __m256 &hi) {
    lo = expand8(v, bytes & 0xFF);
    hi = expand8(v + 4, bytes >> 8);
}

// MR rows of x (fp32) times NR weight rows over all of K; out[MR * NR] = the sums (no bias). Each weight row is
// expanded and used right away (2 live weight registers: computing all NR first spilled them to the stack). One row of
// x stays in registers for the step and each output keeps two accumulators (positions 0-7 and 8-15) so that 8 FMA
// chains hide the latency; with more rows x comes from L1 as the FMAs' memory operand.
template <typename VT, int MR, int NR>
SP24_AVX2 void direct_tile(const float *const *xr, const VT *const *vr, const uint8_t *const *mr, int64_t K,
                           const char *pf, const uint8_t *pfm, float *out) {
    constexpr int kStepBytes = NR * 8 * static_cast<int>(sizeof(VT)); // values bytes of the tile per 16 positions
    constexpr int S = MR == 1 ? 2 : 1;
    __m256 acc[MR][NR][S];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
            for (int s = 0; s < S; ++s)
                acc[i][j][s] = _mm256_setzero_ps();
    const int64_t n16 = K / 16;
    for (int64_t c = 0; c < n16; ++c) {
        __m256 x0l = _mm256_setzero_ps(), x0h = x0l;
        if constexpr (MR == 1) {
            x0l = _mm256_loadu_ps(xr[0] + 16 * c);
            x0h = _mm256_loadu_ps(xr[0] + 16 * c + 8);
        }
#pragma GCC unroll 4
        for (int off = 0; off < kStepBytes; off += 64)
            _mm_prefetch(pf + c * kStepBytes + off, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char *>(pfm + c * NR * 2), _MM_HINT_T1); // its meta (2 bytes a row)
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            uint16_t bytes;
            std::memcpy(&bytes, mr[j] + 2 * c, 2);
            __m256 wl, wh;
            expand16(vr[j] + 8 * c, bytes, wl, wh);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i) {
                const __m256 xl = MR == 1 ? x0l : _mm256_loadu_ps(xr[i] + 16 * c);
                const __m256 xh = MR == 1 ? x0h : _mm256_loadu_ps(xr[i] + 16 * c + 8);
                acc[i][j][0] = _mm256_fmadd_ps(xl, wl, acc[i][j][0]);
                acc[i][j][S - 1] = _mm256_fmadd_ps(xh, wh, acc[i][j][S - 1]);
            }
        }
    }
    if (K % 16 >= 8) { // one more 8-position step
        const int64_t c = K / 8 - 1;
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const __m256 w = expand8(vr[j] + 4 * c, mr[j][c]);
#pragma GCC unroll 4
            for (int i = 0; i < MR; ++i)
                acc[i][j][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr[i] + 8 * c), w, acc[i][j][0]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const __m256 t = S == 2 ? _mm256_add_ps(acc[i][j][0], acc[i][j][S - 1]) : acc[i][j][0];
            out[i * NR + j] = hsum(t) + (K % 8 ? tail_dot(xr[i], vr[j], mr[j], K) : 0.f);
        }
}

// x: fp32 rows (bf16 x is widened once per call into xbuf by linear_direct).
template <typename XT, typename VT, int MR, int NR>
SP24_AVX2 bool run_direct(const LinearArgs &a, const float *x, int64_t ldx, int64_t m0, int64_t n0, int64_t n1) {
    const VT *v = static_cast<const VT *>(a.values);
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    const int rows = static_cast<int>(std::min<int64_t>(MR, a.M - m0));
    const float *xr[MR];
    tile_x_rows<MR>(x, ldx, m0, a.M, 0, xr);
    for (int64_t n = n0; n < n1; n += NR) {
        if (m0 == 0 && !block_meta_ok(a, n, NR, n1)) // the first pass over these rows checks their meta
            return false;
        const auto [vr, mr] = block_rows<NR>(a, v, n, n1); // past n1: the last row again (result discarded)
        float acc[MR * NR];
        // The next tile's values (NR contiguous rows) are prefetched into L2 over this tile's K loop: each row is
        // only K / 2 bf16 (4 KiB at K = 4096), too short for the hardware prefetchers to ramp up on 4 streams.
        // Measured (capped avx2, 1 thread, fp32 x, bf16 values, M = 1, medians ms of alternating calls, loaded
        // machine): N x K = 4096 x 4096 2.53 -> 2.21, 11008 x 4096 6.80 -> 5.50, 4096 x 11008 5.61 -> 3.56; a
        // prefetch into L1 (T0) or NTA gained nothing (2.51 / 6.97 / 5.51); NR = 2, 3, 6 instead of 4: within noise.
        // Prefetching its meta too: another 4-10% (1.41 -> 1.30, 5.60 -> 5.32, 5.72 -> 5.13).
        direct_tile<VT, MR, NR>(xr, vr, mr, a.K, reinterpret_cast<const char *>(v + (n + NR) * half),
                                a.meta + (n + NR) * mb, acc);
        store_tile<XT, NR>(a, acc, m0, rows, n, static_cast<int>(std::min<int64_t>(NR, n1 - n)));
    }
    return true;
}

template <typename XT, typename VT> SP24_AVX2 bool linear_direct(const LinearArgs &a, int64_t n0, int64_t n1) {
    const float *x = static_cast<const float *>(a.x);
    int64_t ldx = a.ldx;
    std::vector<float> xbuf;
    if constexpr (sizeof(XT) == 2) { // bf16 x: widened once (M <= 4 rows) instead of in every tile
        xbuf.resize(static_cast<size_t>(a.M * a.K));
        const uint16_t *xb = static_cast<const uint16_t *>(a.x);
        for (int64_t m = 0; m < a.M; ++m) {
            int64_t k = 0;
            for (; k + 8 <= a.K; k += 8)
                _mm256_storeu_ps(xbuf.data() + m * a.K + k, load8(xb + m * a.ldx + k));
            for (; k < a.K; ++k)
                xbuf[m * a.K + k] = bf16_to_f32(xb[m * a.ldx + k]);
        }
        x = xbuf.data();
        ldx = a.K;
    }
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4)
        if (!run_direct<XT, VT, 4, 3>(a, x, ldx, m, n0, n1))
            return false;
    switch (a.M - m) {
    case 1:
        // 1 thread, L2-resident bf16 weight, GB/s of weight: NR = 2 17-21, 3 26-27, 4 21-27, 6 19-24
        return run_direct<XT, VT, 1, 4>(a, x, ldx, m, n0, n1);
    case 2:
        return run_direct<XT, VT, 2, 6>(a, x, ldx, m, n0, n1);
    case 3:
        return run_direct<XT, VT, 3, 4>(a, x, ldx, m, n0, n1);
    default:
        return true;
    }
}

// ----------------------------------------------------------------------------------------------- panel (larger M)
constexpr int kPMR = 4, kPNR = 3;
constexpr int64_t kPKC = 512; // K block: the expanded panel is 3 x 512 fp32 = 6 KiB (L1)
constexpr int64_t kPMC = 192; // M block: x block 192 x 512 fp32 = 384 KiB (L2), re-read per 3 weight rows

// 4 rows of x (fp32) times the 3 expanded panel rows (stride kPKC) over `len` positions (multiple of 8). Partial sums
// come from ain (nullptr: zeros) and go to aout (not the last K block), else their horizontal sums to out[4 * 3].
SP24_AVX2 void panel_tile(const float *const *xr, const float *pn, int64_t len, const float *ain, float *aout,
                          float *out) {
    __m256 acc[kPMR][kPNR];
#pragma GCC unroll 4
    for (int i = 0; i < kPMR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < kPNR; ++j)
            acc[i][j] = ain ? _mm256_loadu_ps(ain + 8 * (i * kPNR + j)) : _mm256_setzero_ps();
    for (int64_t c = 0; c < len / 8; ++c) {
        const __m256 w0 = _mm256_loadu_ps(pn + 8 * c), w1 = _mm256_loadu_ps(pn + kPKC + 8 * c),
                     w2 = _mm256_loadu_ps(pn + 2 * kPKC + 8 * c);
#pragma GCC unroll 4
        for (int i = 0; i < kPMR; ++i) {
            const __m256 xv = _mm256_loadu_ps(xr[i] + 8 * c);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(xv, w2, acc[i][2]);
        }
    }
    if (aout) {
#pragma GCC unroll 4
        for (int i = 0; i < kPMR; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < kPNR; ++j)
                _mm256_storeu_ps(aout + 8 * (i * kPNR + j), acc[i][j]);
        return;
    }
#pragma GCC unroll 4
    for (int i = 0; i < kPMR; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < kPNR; ++j)
            out[i * kPNR + j] = hsum(acc[i][j]);
}

template <typename XT, typename VT> SP24_AVX2 bool linear_panel(const LinearArgs &a, int64_t n0, int64_t n1) {
    const float *x = a.xf ? a.xf : static_cast<const float *>(a.x); // fp32 x (the glue widened bf16 x once)
    const int64_t ldx = a.xf ? a.ldxf : a.ldx;
    const XT *xo = static_cast<const XT *>(a.x);
    const VT *v = static_cast<const VT *>(a.values);
    const int64_t K8 = a.K / 8 * 8;
    const int64_t nkb = std::max<int64_t>(1, (K8 + kPKC - 1) / kPKC);
    const int64_t mc = std::min(a.M, kPMC);
    std::vector<float> panel(static_cast<size_t>(kPNR * kPKC));
    std::vector<float> accs(static_cast<size_t>((mc + kPMR - 1) / kPMR * kPMR * kPNR * 8));
    return for_panels<kPNR>(
        a, n0, n1, kPMC, meta_bytes_ok_avx2, [&](int64_t m0, int64_t m1, int64_t n, int cols) SP24_AVX2 {
            const auto [vr, mr] = block_rows<kPNR>(a, v, n, n1); // past n1: the last row again (result discarded)
            for (int64_t kb = 0; kb < nkb; ++kb) {
                const int64_t k0 = kb * kPKC, len = std::min(kPKC, K8 - k0);
                for (int j = 0; j < kPNR; ++j)
                    for (int64_t c = 0; c < len / 8; ++c)
                        _mm256_storeu_ps(panel.data() + j * kPKC + 8 * c,
                                         expand8(vr[j] + k0 / 2 + 4 * c, mr[j][k0 / 8 + c]));
                const bool last = kb == nkb - 1;
                for (int64_t m = m0; m < m1; m += kPMR) {
                    const int rows = static_cast<int>(std::min<int64_t>(kPMR, m1 - m));
                    const float *xr[kPMR];
                    tile_x_rows<kPMR>(x, ldx, m, m1, k0, xr);
                    float *acc_io = accs.data() + (m - m0) / kPMR * kPMR * kPNR * 8;
                    float sums[kPMR * kPNR];
                    panel_tile(xr, panel.data(), len, kb ? acc_io : nullptr, last ? nullptr : acc_io, sums);
                    if (!last)
                        continue;
                    if (a.K % 8)
                        for (int i = 0; i < rows; ++i)
                            for (int j = 0; j < kPNR; ++j)
                                sums[i * kPNR + j] += tail_dot(xo + (m + i) * a.ldx, vr[j], mr[j], a.K);
                    store_tile<XT, kPNR>(a, sums, m, rows, n, cols);
                }
            }
        });
}

// ----------------------------------------------------------------------------------------------- broadcast (large M)
// The classic GEMM micro-kernel on the expanded weight: 6 rows of x (each element broadcast) times 16 weight rows
// stored k-major (two 8-wide vectors per position), 12 accumulators, output tile in registers, no horizontal sums.
// x is read 4 bytes per 2 FMAs (the dot-product panel streams 32 bytes of x per 3 FMAs from L2), which is what keeps
// it at the FMA rate once M is large enough to amortise building the k-major panel (one 8 x 8 transpose per 8 rows x
// 8 positions). Loop nest per thread (Goto): K blocks of 256 > M blocks of 240 rows (x block 240 KiB, L2) >
// panels of 16 weight rows (16 KiB, L1) > 6-row tiles; fp32 partial sums in C (out itself for fp32 x).
constexpr int kBMR = 6, kBNR = 16;
constexpr int64_t kBKC = 256, kBMC = 240;

// 8 rows x 8 positions (r[row] = the row's 8 expanded positions) -> out[p * 16 + row] for p < 8.
SP24_AVX2 inline void transpose_store8(const __m256 *r, float *out) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(out + 0 * kBNR, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(out + 1 * kBNR, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(out + 2 * kBNR, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(out + 3 * kBNR, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(out + 4 * kBNR, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(out + 5 * kBNR, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(out + 6 * kBNR, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(out + 7 * kBNR, _mm256_permute2f128_ps(s3, s7, 0x31));
}

// Positions [k0, k0 + len) of the 16 weight rows vr/mr as pk[p][16] fp32 (k0 % 8 == 0); positions past K8 = K / 8 * 8
// (the trailing group of K % 8 == 4, then zeros) are filled up to a multiple of 8.
template <typename VT>
SP24_AVX2 void build_bpanel(const VT *const *vr, const uint8_t *const *mr, int64_t k0, int64_t len, int64_t K,
                            float *pk) {
    const int64_t K8 = K / 8 * 8, full = std::min(len, K8 - k0) / 8;
    for (int64_t c = 0; c < full; ++c) {
        const int64_t cc = k0 / 8 + c;
        for (int h = 0; h < 2; ++h) {
            __m256 r[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; ++j)
                r[j] = expand8(vr[8 * h + j] + 4 * cc, mr[8 * h + j][cc]);
            transpose_store8(r, pk + 8 * c * kBNR + 8 * h);
        }
    }
    if (full * 8 < len) { // the trailing group (K % 8 == 4): scalar, zeros after it
        std::memset(pk + 8 * full * kBNR, 0, 8 * kBNR * sizeof(float));
        const int64_t g = K / 4 - 1;
        for (int j = 0; j < kBNR; ++j) {
            int p0, p1;
            kept_positions(meta_nibble(mr[j], g), p0, p1);
            pk[(8 * full + p0) * kBNR + j] = to_f32(vr[j][2 * g]);
            pk[(8 * full + p1) * kBNR + j] = to_f32(vr[j][2 * g + 1]);
        }
    }
}

// fp32 -> bf16 bits (round to nearest even, NaN -> 0x7FC0, like c10::BFloat16), 8 lanes.
SP24_AVX2 inline __m128i to_bf16(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

// Where a tile's sums go. Not the last K block: fp32 partial sums to c (row stride ldc). The last one: + bias (16
// values or nullptr), then fp32 to c (out itself for fp32 x) or bf16 to ob (row stride ldo).
struct TileOut {
    float *c = nullptr;
    int64_t ldc = 0;
    bool last = false;
    const float *bias = nullptr;
    uint16_t *ob = nullptr;
    int64_t ldo = 0;
};

// 6 rows of x (fp32, at the block's first position) times pk over len positions, added to c (first: from zero).
SP24_AVX2 void bcast_tile(const float *const *xr, const float *pk, int64_t len, bool first, const TileOut &o) {
    __m256 acc[kBMR][2];
#pragma GCC unroll 6
    for (int i = 0; i < kBMR; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
            acc[i][h] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o.c + i * o.ldc + 8 * h);
    for (int64_t k = 0; k < len; ++k) {
        const __m256 w0 = _mm256_loadu_ps(pk + kBNR * k), w1 = _mm256_loadu_ps(pk + kBNR * k + 8);
#pragma GCC unroll 6
        for (int i = 0; i < kBMR; ++i) {
            const __m256 b = _mm256_broadcast_ss(xr[i] + k);
            acc[i][0] = _mm256_fmadd_ps(b, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(b, w1, acc[i][1]);
        }
    }
    if (o.last && o.bias) {
        const __m256 b0 = _mm256_loadu_ps(o.bias), b1 = _mm256_loadu_ps(o.bias + 8);
#pragma GCC unroll 6
        for (int i = 0; i < kBMR; ++i) {
            acc[i][0] = _mm256_add_ps(acc[i][0], b0);
            acc[i][1] = _mm256_add_ps(acc[i][1], b1);
        }
    }
    if (o.last && o.ob) {
#pragma GCC unroll 6
        for (int i = 0; i < kBMR; ++i)
#pragma GCC unroll 2
            for (int h = 0; h < 2; ++h)
                _mm_storeu_si128(reinterpret_cast<__m128i *>(o.ob + i * o.ldo + 8 * h), to_bf16(acc[i][h]));
        return;
    }
#pragma GCC unroll 6
    for (int i = 0; i < kBMR; ++i)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
            _mm256_storeu_ps(o.c + i * o.ldc + 8 * h, acc[i][h]);
}

template <typename XT, typename VT> SP24_AVX2 bool linear_bcast(const LinearArgs &a, int64_t n0, int64_t n1) {
    const float *x = a.xf ? a.xf : static_cast<const float *>(a.x);
    const int64_t ldx = a.xf ? a.ldxf : a.ldx;
    const VT *v = static_cast<const VT *>(a.values);
    const int64_t nt = n1 - n0;
    const bool f32_out = sizeof(XT) == 4; // accumulate in out itself
    const int64_t Kp = (a.K + 7) / 8 * 8; // positions incl. the trailing group, padded
    const bool one_block = Kp <= kBKC;    // no partial sums to keep
    std::vector<float> cbuf(f32_out || one_block ? 0 : static_cast<size_t>(a.M * nt));
    float *C = f32_out ? static_cast<float *>(a.out) + n0 : cbuf.data();
    const int64_t ldc = f32_out ? a.ldo : nt;
    std::vector<float> panel(static_cast<size_t>(kBKC * kBNR + 8)), edge(static_cast<size_t>(kBMR * kBNR));
    for (int64_t k0 = 0; k0 < Kp; k0 += kBKC) {
        const int64_t len = std::min(kBKC, a.K - k0); // positions of x to read (the panel is zero-padded to 8)
        const bool first = k0 == 0, last = k0 + kBKC >= Kp;
        for (int64_t m0 = 0; m0 < a.M; m0 += kBMC) {
            const int64_t m1 = std::min(a.M, m0 + kBMC);
            for (int64_t n = n0; n < n1; n += kBNR) {
                const int cols = static_cast<int>(std::min<int64_t>(kBNR, n1 - n));
                if (k0 == 0 && m0 == 0 && !block_meta_ok(a, n, kBNR, n1)) // the first pass over these rows
                    return false;
                const auto [vr, mr] = block_rows<kBNR>(a, v, n, n1); // past n1: the last row again (result discarded)
                build_bpanel<VT>(vr, mr, k0, len, a.K, panel.data());
                for (int64_t m = m0; m < m1; m += kBMR) {
                    const int rows = static_cast<int>(std::min<int64_t>(kBMR, m1 - m));
                    const float *xr[kBMR];
                    tile_x_rows<kBMR>(x, ldx, m, m1, k0, xr);
                    float *ct = C + m * ldc + (n - n0);
                    if (rows == kBMR && cols == kBNR) { // full tile: straight to / from C and out
                        TileOut o;
                        o.c = ct;
                        o.ldc = ldc;
                        o.last = last;
                        o.bias = a.bias ? a.bias + n : nullptr;
                        o.ob = f32_out ? nullptr : static_cast<uint16_t *>(a.out) + m * a.ldo + n;
                        o.ldo = a.ldo;
                        bcast_tile(xr, panel.data(), len, first, o);
                        continue;
                    }
                    // an edge tile works on a copy of its valid part; the last K block stores it element by element
                    for (int i = 0; i < rows && !first; ++i)
                        std::memcpy(edge.data() + i * kBNR, ct + i * ldc, cols * sizeof(float));
                    TileOut o;
                    o.c = edge.data();
                    o.ldc = kBNR;
                    bcast_tile(xr, panel.data(), len, first, o);
                    if (!last) {
                        for (int i = 0; i < rows; ++i)
                            std::memcpy(ct + i * ldc, edge.data() + i * kBNR, cols * sizeof(float));
                        continue;
                    }
                    XT *out = static_cast<XT *>(a.out);
                    for (int i = 0; i < rows; ++i)
                        for (int j = 0; j < cols; ++j)
                            store_out(out + (m + i) * a.ldo + n + j,
                                      edge[i * kBNR + j] + (a.bias ? a.bias[n + j] : 0.f));
                }
            }
        }
    }
    return true;
}

// Rows of x up to which the direct kernel (weight re-read per 4 rows) runs; the panel kernel from 5 on.
// Measured (1 thread, K = 4096, N = 11008 bf16 (50 MB, from DRAM), ms direct / panel): M = 4 7.6 / -, 5 15.4 / 18-22,
// 6 17-25 / 21-28, 8 24-26 / 16-23, 12 25-38 / 19, 16 31-39 / 25-31 (the shared machine's noise is +-30%): the
// direct kernel's second pass over the weight costs about what the panel's zero lanes do at M = 5-8.
constexpr int64_t kDirectMaxM = 4;
// The broadcast kernel from 18 rows on, unless its 6-row tiles waste more than 10% over the panel's 4-row ones.
// Measured (1 thread, K = 4096, N = 240, bf16, ms panel / broadcast): M = 8 0.24 / 0.45, 12 0.33 / 0.45,
// 16 0.51 / 0.55, 18 0.69 / 0.55-0.64, 24 0.65-0.89 / 0.65, 32 0.75 / 0.84, 36 0.95 / 0.85, 40 0.94 / 0.96,
// 48 1.19 / 1.08, 64 1.57 / 1.37, 128 3.39 / 2.53, 512 14.5 / 10.2 (49.5 useful GFLOP/s = 84% of the FMA peak).
inline bool use_bcast(int64_t M) {
    return M >= 18 && 10 * ((M + 5) / 6 * 6) <= 11 * ((M + 3) / 4 * 4);
}

template <typename XT, typename VT> SP24_AVX2 bool linear_typed(const LinearArgs &a, int64_t n0, int64_t n1) {
    if (a.M <= kDirectMaxM || a.K < 8)
        return linear_direct<XT, VT>(a, n0, n1);
    if (use_bcast(a.M))
        return linear_bcast<XT, VT>(a, n0, n1);
    return linear_panel<XT, VT>(a, n0, n1);
}

// Entry points of the table: one per (x, values) dtype pair read directly.
template <typename XT, typename VT> bool linear_rows(const LinearArgs &a, int64_t n0, int64_t n1) {
    if (n0 >= n1 || a.M <= 0)
        return true;
    return linear_typed<XT, VT>(a, n0, n1);
}

// bf16 x is widened to fp32 once per call for the panel and broadcast kernels (the direct kernel widens its <= 4 rows
// itself).
bool wants_f32_x(const LinearArgs &a) {
    return a.dt == DType::BF16 && a.M > kDirectMaxM && a.K >= 8;
}

constexpr RowKernels kRows = {{compress_row<0>, compress_row<1>, compress_row<2>},
                              {decompress_row<2>, decompress_row<4>}};

bool decompress_rows_f32(DType vdt, const void *values, const uint8_t *meta, int64_t K, int64_t r0, int64_t r1,
                         float *out) {
    if (vdt == DType::F32)
        return sparse24::decompress_rows(kRows, vdt, values, meta, K, r0, r1, out);
    const int64_t half = K / 2, mb = (K + 7) / 8;
    for (int64_t r = r0; r < r1; ++r) {
        if (!meta_rows_ok(meta + r * mb, K, 1, meta_bytes_ok_avx2))
            return false;
        expand_row_f32(static_cast<const uint16_t *>(values) + r * half, meta + r * mb, K, out + r * K);
    }
    return true;
}

} // namespace
} // namespace avx2

// Every pair but bf16 x with fp32 values (the glue rounds those values to bf16 first); bf16 values widen exactly for
// fp32 x. Columns are split by 48, a multiple of every NR (8, 6, 4, 3, 16). Never the dense route (sparse24.cpp,
// dense_route_min_rows).
const Kernels *kernels_avx2() {
    static const Kernels k = [] {
        using namespace avx2;
        Kernels t;
        t.name = cpu::level_name(cpu::kAvx2);
        t.rows = kRows;
        t.decompress_rows_f32 = decompress_rows_f32;
        t.linear[0][0] = LinearKernel{linear_rows<float, float>, nullptr, 48};
        t.linear[0][1] = LinearKernel{linear_rows<float, uint16_t>, nullptr, 48};
        t.linear[1][1] = LinearKernel{linear_rows<uint16_t, uint16_t>, wants_f32_x, 48};
        return t;
    }();
    return &k;
}
#endif // FASTDL_SP24_X86

} // namespace sparse24
} // namespace fastdl
