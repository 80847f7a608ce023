// AVX-512 family of the int4 capability: the streaming kernel of int4_stream.h over 512-bit vectors (one 16-byte
// load -> two vectors of 16 weights). No torch headers; int4.cpp checks cpuid (cpu_isa.h) before calling in.
#include "int4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
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
    // the streaming kernel's weight rows at once for MR rows of x (int4_stream.h, i4_rows: accumulators, totals and x
    // vectors within the 32 registers)
    static constexpr int stream_cols(int mr) { return mr == 1 ? 1 : mr == 2 ? 4 : mr == 3 ? 3 : 2; }
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

// ---------------------------------------------------------------------------------------------------------------
// bf16 x, few rows (int4.cpp: below the bf16 route's rows). The fp32 streaming kernel widened x to fp32 and did two
// FMAs per 32 weights and row; here one vdpbf16ps per 32 weights and row multiplies x (bf16, as given) by u - z (an
// integer in [-15, 15]: exact in bf16), two products per lane summed in fp32, and the group's sum is multiplied by s in
// fp32 as in the fp32 kernel (so the weight is not rounded to bf16; vdpbf16ps treats bf16 subnormals of x as 0).
// Blocks alternate two accumulators per row and groups two running sums, so no row waits on one dependency chain.
// Its window (the table below): bf16 x at 3 to 7 rows with groups of 64 or 128. 4096 x 4096, 2 threads, wall ms,
// medians of 30 calls rotating over 6 weight copies, two runs each, the fp32 kernels before (stream to 2 rows, tiles
// above) / this: groups of 128 M = 1 0.42-0.94 / 0.42-0.68, M = 2 0.79-1.28 / 0.65-0.99, M = 3 1.62-1.96 / 0.82-1.13, M
// = 4 1.37-1.61 / 0.94-1.16, M = 8 2.06-2.67 / 1.77-2.27; groups of 64 M = 3 1.84-2.06 / 1.21, M = 4 1.72-1.79 /
// 1.31-1.43, M = 8 2.49-2.51 / 2.58-2.89; groups of 32 M = 1 0.60 / 1.00-1.09, M = 4 1.43-1.57 / 1.60-1.79, M = 8
// 2.03-2.32 / 2.97-3.63 (one block per group: the group's own work dominates).
#define I4_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")))

// sum[m] = x row m0 + m times the u - z of group g (its blocks from k0), in fp32 (two chains: blocks in pairs).
template <int MR>
I4_BF16 inline void i4_group_bf16(const Int4Args &a, int64_t m0, const uint8_t *q, int64_t k0, int64_t blocks,
                                  __m512 table, __m512 (&sum)[MR]) {
    __m512 acc0[MR], acc1[MR];
    for (int m = 0; m < MR; ++m)
        acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b += 2) {
        const int64_t k = k0 + b * 32;
        __m512 w[2];
        Avx512Traits::codes(q + k / 2, table, w);
        const __m512bh wb = _mm512_cvtne2ps_pbh(w[1], w[0]); // k 0..31 in order, exact
        for (int m = 0; m < MR; ++m) {
            const __m512i xv = _mm512_loadu_si512(a.xh + (m0 + m) * a.ldx + k);
            acc0[m] = _mm512_dpbf16_ps(acc0[m], reinterpret_cast<const __m512bh &>(xv), wb);
        }
        if (b + 1 < blocks) {
            Avx512Traits::codes(q + (k + 32) / 2, table, w);
            const __m512bh wb1 = _mm512_cvtne2ps_pbh(w[1], w[0]);
            for (int m = 0; m < MR; ++m) {
                const __m512i xv = _mm512_loadu_si512(a.xh + (m0 + m) * a.ldx + k + 32);
                acc1[m] = _mm512_dpbf16_ps(acc1[m], reinterpret_cast<const __m512bh &>(xv), wb1);
            }
        }
    }
    for (int m = 0; m < MR; ++m)
        sum[m] = _mm512_add_ps(acc0[m], acc1[m]);
}

template <int MR> I4_BF16 void i4_rows_bf16(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1, float *sc) {
    const int64_t groups = a.K / a.group, blocks = a.group / 32, rowb = a.K / 2;
    const __m512 z8 = Avx512Traits::zp(8);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *q = a.q + n * rowb;
        const uint16_t *s = a.scales + n * groups;
        const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
        i4_row_scales<Avx512Traits>(s, nullptr, groups, sc, nullptr);
        __m512 tot0[MR], tot1[MR], sum[MR];
        for (int m = 0; m < MR; ++m)
            tot0[m] = tot1[m] = _mm512_setzero_ps();
        int64_t g = 0;
        for (; g + 2 <= groups; g += 2) {
            i4_group_bf16<MR>(a, m0, q, g * a.group, blocks, zr ? Avx512Traits::zp(zr[g]) : z8, sum);
            const __m512 s0 = _mm512_set1_ps(sc[g]);
            for (int m = 0; m < MR; ++m)
                tot0[m] = _mm512_fmadd_ps(sum[m], s0, tot0[m]);
            i4_group_bf16<MR>(a, m0, q, (g + 1) * a.group, blocks, zr ? Avx512Traits::zp(zr[g + 1]) : z8, sum);
            const __m512 s1 = _mm512_set1_ps(sc[g + 1]);
            for (int m = 0; m < MR; ++m)
                tot1[m] = _mm512_fmadd_ps(sum[m], s1, tot1[m]);
        }
        if (g < groups) {
            i4_group_bf16<MR>(a, m0, q, g * a.group, blocks, zr ? Avx512Traits::zp(zr[g]) : z8, sum);
            const __m512 s0 = _mm512_set1_ps(sc[g]);
            for (int m = 0; m < MR; ++m)
                tot0[m] = _mm512_fmadd_ps(sum[m], s0, tot0[m]);
        }
        const float bias = a.bias ? a.bias[n] : 0.f;
        for (int m = 0; m < MR; ++m)
            a.out[(m0 + m) * a.ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(tot0[m], tot1[m])) + bias;
    }
}

template <int MR> struct RowsBf16 {
    static I4_BF16 inline void run(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1, float *sc) {
        i4_rows_bf16<MR>(a, m0, n0, n1, sc);
    }
};

I4_BF16 void stream_bf16(const Int4Args &a, int64_t n0, int64_t n1) {
    std::unique_ptr<float[]> sc(new float[a.K / a.group + 8]);
    for (int64_t m0 = 0; m0 < a.M; m0 += kStreamRows)
        by_rows<RowsBf16, kStreamRows>(a.M - m0, a, m0, n0, n1, sc.get());
}

// ---------------------------------------------------------------------------------------------------------------
// W4A8 as a GEMM (many rows of x). The dot-product kernel of int4_stream.h (lanes over k, one weight row at a time)
// unpacks each weight row again for every 4 rows of x and reduces its lanes per group: at M = 128 it ran at 0.6-0.7x
// eager bf16 F.linear. Here the lanes are output columns, as in the int8 W8A8 kernel: a panel of kPanelCols weight
// rows is unpacked once per block of x rows into the VNNI layout [K / 4][kPanelCols][4] of its codes u (0..15, the
// unsigned operand of vpdpbusd) with its scales and zero points as [group][kPanelCols]; a register tile of kTileRows
// rows x 2 zmm (32 columns) then takes one broadcast quad of x's codes (signed) per k-quad, and per group the exact
// int32 sums (sum_k q_x u - z sum_k q_x) are converted and accumulated times s_w * s_x, as the dot kernel does.
constexpr int64_t kPanelCols = 32;
constexpr int64_t kRowBlock = 128; // x rows per block (512 KiB of codes at K = 4096: L2), each panel unpacked per block
constexpr int64_t kChunkK = 512; // k per chunk: its panel codes (16 KiB) stay in L1 while every row tile runs over them

// The unpacked panel of weight rows [n0, n0 + nc) (nc <= kPanelCols; missing rows are zero codes, never stored).
struct A8Panel {
    uint8_t *codes = nullptr; // [K / 4][kPanelCols][4]
    float *scale = nullptr;   // [groups][kPanelCols]
    int32_t *zero = nullptr;  // [groups][kPanelCols] (zero points given) or null (8)
};

// Index vectors of the 16 x 32 transpose below (vpermt2d over two sources: entries 0..15 the first, 16..31 the second).
struct PanelIdx {
    __m512i h[2], j[2], o[2];
};

I4_SIMD PanelIdx panel_idx() {
    alignas(64) int32_t h[2][16], j[2][16], o[2][16];
    for (int t = 0; t < 2; ++t) {
        for (int ql = 0; ql < 4; ++ql)
            for (int cl = 0; cl < 4; ++cl)
                h[t][ql * 4 + cl] = 16 * (cl / 2) + t * 8 + (cl % 2) * 4 + ql;
        for (int qq = 0; qq < 2; ++qq)
            for (int p = 0; p < 2; ++p)
                for (int cl = 0; cl < 4; ++cl)
                    j[t][qq * 8 + p * 4 + cl] = 16 * p + (2 * t + qq) * 4 + cl;
        for (int c = 0; c < 16; ++c)
            o[t][c] = c < 8 ? t * 8 + c : 16 + t * 8 + (c - 8);
    }
    PanelIdx r;
    for (int t = 0; t < 2; ++t) {
        r.h[t] = _mm512_load_si512(h[t]);
        r.j[t] = _mm512_load_si512(j[t]);
        r.o[t] = _mm512_load_si512(o[t]);
    }
    return r;
}

// One 32-k block of 16 weight rows (rows[r]: its 16 packed bytes, low nibbles k 0..15, high k 16..31) into the 8
// k-quads of the panel's VNNI layout at dst (quad q at dst + q * kPanelCols * 4). Two rows per zmm: 128-bit lanes
// [lo(r), lo(r + 1), hi(r), hi(r + 1)], so dword (row parity e, quad q) sits at (q / 4) * 8 + e * 4 + q % 4; three
// rounds of vpermt2d (24 in all, 8 per round) gather each quad's 16 rows into one vector.
I4_SIMD inline void panel_block(const uint8_t *const (&rows)[16], const PanelIdx &ix, uint8_t *dst) {
    const __m256i m = _mm256_set1_epi8(0x0F);
    __m512i z[8];
    for (int t = 0; t < 8; ++t) {
        const __m256i v = _mm256_loadu2_m128i(reinterpret_cast<const __m128i *>(rows[2 * t + 1]),
                                              reinterpret_cast<const __m128i *>(rows[2 * t]));
        z[t] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                                  _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
    }
    __m512i h[4][2]; // rows 4p..4p+3, quads 4t..4t+3: dword ql * 4 + cl
    for (int p = 0; p < 4; ++p)
        for (int t = 0; t < 2; ++t)
            h[p][t] = _mm512_permutex2var_epi32(z[2 * p], ix.h[t], z[2 * p + 1]);
    for (int t = 0; t < 2; ++t)                                                      // quads 4t ..
        for (int s = 0; s < 2; ++s) {                                                // .. + 2s + qq
            const __m512i ja = _mm512_permutex2var_epi32(h[0][t], ix.j[s], h[1][t]); // rows 0..7
            const __m512i jb = _mm512_permutex2var_epi32(h[2][t], ix.j[s], h[3][t]); // rows 8..15
            for (int qq = 0; qq < 2; ++qq)
                _mm512_storeu_si512(dst + (4 * t + 2 * s + qq) * kPanelCols * 4,
                                    _mm512_permutex2var_epi32(ja, ix.o[qq], jb));
        }
}

I4_SIMD void pack_panel(const A8Args &a, int64_t n0, int64_t nc, const PanelIdx &ix, const A8Panel &pn) {
    const int64_t groups = a.K / a.group, rowb = a.K / 2;
    alignas(16) static const uint8_t kZeroRow[16] = {};
    for (int h = 0; h < 2; ++h) { // the two 16-row halves of the panel
        const uint8_t *rows[16];
        for (int r = 0; r < 16; ++r)
            rows[r] = h * 16 + r < nc ? a.q + (n0 + h * 16 + r) * rowb : kZeroRow;
        for (int64_t b = 0; b < a.K / 32; ++b) {
            const uint8_t *blk[16];
            for (int r = 0; r < 16; ++r)
                blk[r] = rows[r] == kZeroRow ? kZeroRow : rows[r] + b * 16;
            panel_block(blk, ix, pn.codes + (b * 8 * kPanelCols + h * 16) * 4);
        }
    }
    for (int64_t c = 0; c < kPanelCols; ++c) {
        const bool valid = c < nc;
        const uint16_t *s = a.scales + (n0 + c) * groups;
        const uint8_t *zr = a.zeros && valid ? a.zeros + (n0 + c) * groups : nullptr;
        for (int64_t g = 0; g < groups; ++g) {
            pn.scale[g * kPanelCols + c] = valid ? _cvtsh_ss(s[g]) : 0.f;
            if (pn.zero)
                pn.zero[g * kPanelCols + c] = zr ? zr[g] : 8;
        }
    }
}

// Rows [m0, m0 + MR) of x against groups [g0, g1) of the panel. The running fp32 sums of the rows are in part
// (kPanelCols floats per row, from row m0), read unless g0 == 0; after the last group (g1 == groups) the columns
// n0 .. n0 + nc - 1 are stored with the bias, else the sums go back to part.
template <int MR>
I4_SIMD void a8_gemm_tile(const A8Args &a, int64_t m0, int64_t n0, int64_t nc, int64_t ldg, const A8Panel &pn,
                          int64_t g0, int64_t g1, float *part) {
    const int64_t groups = a.K / a.group, quads = a.group / 4;
    __m512 tot[MR][2];
    for (int m = 0; m < MR; ++m) {
        tot[m][0] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * kPanelCols);
        tot[m][1] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + m * kPanelCols + 16);
    }
    const int8_t *xr[MR];
    for (int m = 0; m < MR; ++m)
        xr[m] = a.qx + (m0 + m) * a.K;
    for (int64_t g = g0; g < g1; ++g) {
        __m512i acc[MR][2];
        for (int m = 0; m < MR; ++m)
            acc[m][0] = acc[m][1] = _mm512_setzero_si512();
        const uint8_t *b = pn.codes + g * quads * kPanelCols * 4;
        const int64_t k0 = g * a.group;
        for (int64_t q = 0; q < quads; ++q) {
            const __m512i b0 = _mm512_loadu_si512(b + q * kPanelCols * 4);
            const __m512i b1 = _mm512_loadu_si512(b + q * kPanelCols * 4 + 64);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
                int32_t quad;
                std::memcpy(&quad, xr[m] + k0 + 4 * q, 4);
                const __m512i av = _mm512_set1_epi32(quad);
                acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], b0, av);
                acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], b1, av);
            }
        }
        const __m512 sw0 = _mm512_loadu_ps(pn.scale + g * kPanelCols);
        const __m512 sw1 = _mm512_loadu_ps(pn.scale + g * kPanelCols + 16);
        for (int m = 0; m < MR; ++m) {
            const int64_t mg = (m0 + m) * ldg + g;
            const __m512i sumx = _mm512_set1_epi32(a.sumx[mg]);
            __m512i e0, e1;
            if (pn.zero) {
                e0 =
                    _mm512_sub_epi32(acc[m][0], _mm512_mullo_epi32(_mm512_loadu_si512(pn.zero + g * kPanelCols), sumx));
                e1 = _mm512_sub_epi32(acc[m][1],
                                      _mm512_mullo_epi32(_mm512_loadu_si512(pn.zero + g * kPanelCols + 16), sumx));
            } else {
                const __m512i z8 = _mm512_slli_epi32(sumx, 3);
                e0 = _mm512_sub_epi32(acc[m][0], z8);
                e1 = _mm512_sub_epi32(acc[m][1], z8);
            }
            const __m512 sx = _mm512_set1_ps(a.sx[mg]);
            tot[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e0), _mm512_mul_ps(sw0, sx), tot[m][0]);
            tot[m][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e1), _mm512_mul_ps(sw1, sx), tot[m][1]);
        }
    }
    if (g1 < groups) {
        for (int m = 0; m < MR; ++m) {
            _mm512_storeu_ps(part + m * kPanelCols, tot[m][0]);
            _mm512_storeu_ps(part + m * kPanelCols + 16, tot[m][1]);
        }
        return;
    }
    for (int h = 0; h < 2; ++h) {
        const int64_t c0 = h * 16;
        if (c0 >= nc)
            break;
        const __mmask16 mk = nc - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (nc - c0)) - 1u);
        const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mk, a.bias + n0 + c0) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m)
            _mm512_mask_storeu_ps(a.out + (m0 + m) * a.ldo + n0 + c0, mk, _mm512_add_ps(tot[m][h], bias));
    }
}

template <int MR> struct GemmRows {
    static I4_SIMD inline void run(const A8Args &a, int64_t m0, int64_t n0, int64_t nc, int64_t ldg, const A8Panel &pn,
                                   int64_t g0, int64_t g1, float *part) {
        a8_gemm_tile<MR>(a, m0, n0, nc, ldg, pn, g0, g1, part);
    }
};

I4_SIMD void a8_gemm(const A8Args &a, int64_t n0, int64_t n1) {
    constexpr int kTileRows = 6;
    const int64_t groups = a.K / a.group, ldg = (groups + 7) / 8 * 8;
    const size_t code_bytes = static_cast<size_t>(a.K / 4 * kPanelCols * 4);
    const size_t f_bytes = static_cast<size_t>(groups * kPanelCols * 4);
    const size_t bytes = code_bytes + f_bytes * (a.zeros ? 2 : 1);
    std::unique_ptr<uint8_t, decltype(&std::free)> buf(
        static_cast<uint8_t *>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)), &std::free);
    A8Panel pn;
    pn.codes = buf.get();
    pn.scale = reinterpret_cast<float *>(buf.get() + code_bytes);
    pn.zero = a.zeros ? reinterpret_cast<int32_t *>(buf.get() + code_bytes + f_bytes) : nullptr;
    std::unique_ptr<float[]> part(new float[kRowBlock * kPanelCols]);
    const PanelIdx ix = panel_idx();
    const int64_t chunk = kChunkK / a.group > 1 ? kChunkK / a.group : 1; // groups per K chunk
    for (int64_t r0 = 0; r0 < a.M; r0 += kRowBlock) {
        const int64_t r1 = r0 + kRowBlock < a.M ? r0 + kRowBlock : a.M;
        for (int64_t nb = n0; nb < n1; nb += kPanelCols) {
            const int64_t nc = n1 - nb < kPanelCols ? n1 - nb : kPanelCols;
            pack_panel(a, nb, nc, ix, pn);
            for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
                const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
                for (int64_t m0 = r0; m0 < r1; m0 += kTileRows)
                    by_rows<GemmRows, kTileRows>(r1 - m0, a, m0, nb, nc, ldg, pn, g0, g1,
                                                 part.get() + (m0 - r0) * kPanelCols);
            }
        }
    }
}

} // namespace

// W4A8 GEMM from 16 rows (4096 x 4096, 2 threads, wall ms, medians of 30 calls rotating over 6 weight copies, two
// runs; dot kernel / GEMM): groups of 32 M = 8 1.04 / 1.13-1.32, M = 16 1.94-1.95 / 1.50-1.94, M = 32 3.76-3.85 /
// 2.36-2.53, M = 64 7.33-7.47 / 3.95-4.12; groups of 128 M = 8 1.18 / 1.07-1.12, M = 16 2.24-2.35 / 1.33-1.54, M = 64
// 8.73-8.89 / 3.51-3.73.
// Route (thread CPU time, one Zen 4 core, 4096 x 4096, groups of 128, fp32 x, ms): stream / tiles at M = 1 1.40 /
// 2.13, 2 1.94 / 2.31, 3 3.07 / 2.77, 4 3.68 / 2.76; tiles / fgemm at M = 8 4.39 / 13.6, 16 7.31 / 16.5, 128 42.1 /
// 51.0, 512 179 / 246, 1024 362 / 417. Since the streaming kernel shares each x vector between weight rows
// (stream_cols), stream / tiles at M = 3 1.26-1.38 / 2.0, M = 4 1.66 / 2.55 (one core, weights hot, groups of 128;
// groups of 32 M = 3 1.71 / 2.48, M = 4 2.50 / 2.63): stream up to 4 rows, tiles from 5, at every M.
const Kernels *kernels_avx512() {
    static const Kernels k{"avx512_vnni",
                           &i4_stream<Avx512Traits>,
                           &i4a8_quantize<Avx512Traits>,
                           &i4a8<Avx512Traits>,
                           &i4_tiles<Avx512Traits>,
                           4,
                           INT64_MAX,
                           &dequant_rows_bf16,
                           &a8_gemm,
                           16,
                           &stream_bf16,
                           {3, 7},
                           64};
    return &k;
}

} // namespace int4
} // namespace fastdl

#endif
