// The driver of the weight-only dot form (the kernel for few rows of x), written once for the SIMD families and
// included by int8_avx2.cpp and int8_avx512.cpp inside their unnamed namespace (fastdl::int8::{}) after they define:
//   I8_SIMD    the family's target attribute
//   a Codes struct, the family's conversion of group codes (uint8) to fp32 into the buffer of code_at:
//     kLanes                       codes per vector (a divisor of kCodeChunk: a vector never straddles two chunks)
//     convert(src, dst)            kLanes codes;  convert_tail(src, n, dst)  the last n < kLanes
//   per x type, a traits struct W:
//     kXBytes      bytes of one x element (fp32 4, bf16 2)
//     kMB          rows of x per register tile; nb_for(mb): w rows per tile of mb rows (leftover w rows: 1)
//     tile<MB, NB, Grouped>()      the register-tile kernel (WoTileFn), MB <= kMB
//     Codes        the Codes struct above
// What stays in each family's file is the tile (its inner loop is intrinsic-level and differs: AVX-512 steps 16 / 32 k
// with masked tails, AVX2 steps 8 k, sums a whole group before its code at M = 1 and ends with a scalar tail).
// No #pragma once: read once per family, each translation unit keeps its own copy.
#ifndef I8_SIMD
#error "int8_weight_only.h: define I8_SIMD (the family's target attribute) before including it"
#endif

// out rows [m0, m0 + MB) x w rows [n0, n0 + NB); codes: the codes of w row n0 (see kCodeChunk; null without groups);
// pf: the weights to prefetch while the tile computes.
using WoTileFn = void (*)(const WeightOnly &, int64_t m0, int64_t n0, const float *codes, LinePrefetch pf);

// The tile of mb (1 .. W::kMB) rows: NB = W::nb_for(mb) w rows, or 1 (the w rows left over).
template <class W, bool Grouped> WoTileFn wo_tile_fn(int mb, bool full) {
    return with_count<1, W::kMB>(mb, [&](auto MB) {
        constexpr int m = decltype(MB)::value;
        return full ? W::template tile<m, W::nb_for(m), Grouped>() : W::template tile<m, 1, Grouped>();
    });
}

// The codes of w rows [n0, n0 + rows) (rows <= kWoCols) as fp32 in the chunked layout of kCodeChunk; entries past
// the last group are left as they are (never read).
template <class C> I8_SIMD void wo_codes(const WeightOnly &p, int64_t n0, int64_t rows, float *buf) {
    const int64_t G = (p.K + kWeightGroup - 1) / kWeightGroup;
    for (int64_t r = 0; r < rows; ++r) {
        const uint8_t *src = p.w_group + (n0 + r) * p.ldg;
        float *dst = buf + r * kCodeChunk;
        int64_t g = 0;
        for (; g + C::kLanes <= G; g += C::kLanes) {
            C::convert(src + g, dst + code_offset(g));
        }
        if (g < G) {
            C::convert_tail(src + g, G - g, dst + code_offset(g));
        }
    }
}

// Rows in blocks whose x slice stays in L2 (<= 256 KiB), w rows in groups of kWoCols (a multiple of every NB; 24 x K
// bytes, L2) inside, row tiles of kMB innermost: each w row comes from L3 once per row block. Grouped: the codes of
// the kWoCols w rows are converted to fp32 once per row block (kWoCols x ceil(K / 16) floats, 1/4 of their weight
// bytes).
template <class W, bool Grouped> void weight_only_dot_t(const WeightOnly &p) {
    constexpr int64_t kXBlockBytes = 256 << 10;
    const int64_t row_bytes = (p.K > 0 ? p.K : 1) * W::kXBytes;
    int64_t mc = kXBlockBytes / row_bytes;
    mc = mc < W::kMB ? W::kMB : mc / W::kMB * W::kMB;
    float *codes = Grouped ? scratch_of<float>(kScratchA, code_buffer_floats(p.K)) : nullptr;
    for (int64_t mb0 = 0; mb0 < p.rows; mb0 += mc) {
        const int64_t mb1 = imin(p.rows, mb0 + mc);
        for (int64_t g0 = 0; g0 < p.cols; g0 += kWoCols) {
            const int64_t g1 = imin(p.cols, g0 + kWoCols);
            if (Grouped) {
                wo_codes<typename W::Codes>(p, g0, g1 - g0, codes);
            }
            for (int64_t m0 = mb0; m0 < mb1; m0 += W::kMB) {
                const int mb = static_cast<int>(imin(W::kMB, mb1 - m0));
                const int nb = W::nb_for(mb);
                int64_t n = g0;
                for (; n + nb <= g1; n += nb) {
                    LinePrefetch pf; // the first row tile of a row block fetches the next tile's weights
                    if (m0 == mb0) {
                        pf.base = p.w + (n + nb) * p.ldw;
                        pf.ldw = p.ldw;
                        pf.K = p.K;
                        pf.rows = imin(nb, p.cols - (n + nb));
                    }
                    wo_tile_fn<W, Grouped>(mb, true)(p, m0, n, Grouped ? codes + (n - g0) * kCodeChunk : nullptr, pf);
                }
                for (; n < g1; ++n) {
                    wo_tile_fn<W, Grouped>(mb, false)(p, m0, n, Grouped ? codes + (n - g0) * kCodeChunk : nullptr,
                                                      LinePrefetch());
                }
            }
        }
    }
}

template <class W> void weight_only_dot(const WeightOnly &p) {
    with_flag(p.w_group != nullptr, [&](auto grouped) { weight_only_dot_t<W, decltype(grouped)::value>(p); });
}
