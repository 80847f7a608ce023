// The register tile of the AVX-512 weight-only dot form, written once for fp32 x and bf16 x. int8_avx512.cpp includes
// it twice, each time in its own namespace with I8_WO_SIMD set: FDL_AVX512 for the fp32-x tile, FDL_AVX512BF16 for
// the bf16-x one. One body cannot serve both target sets (GCC compiles a function for one target, and will not inline
// the bf16 step into a body compiled without AVX512-BF16), and the fp32-x tile must not be compiled with AVX512-BF16:
// it runs on CPUs that have VNNI but not BF16 (Ice Lake, Cascade Lake). X (F32X, Bf16X) gives:
//   T, kStep              the x element and the k per step (fp32 16, bf16 32; a step is kStep / 16 whole groups)
//   kAll, mask(n)         the lane mask of a full step and of the K tail
//   step<MB, NB, Masked, Grouped>(x, ldx, w, ldw, k, m, c, hi_valid, acc)   one step (hi_valid: bf16, see its step)
// No #pragma once: read once per target.
#ifndef I8_WO_SIMD
#error "int8_wo_tile_avx512.h: define I8_WO_SIMD (the tile's target attribute) before including it"
#endif

// codes: see kCodeChunk (unused without groups); pf: the next tile's weights, kStep / 8 lines per step.
template <class X, int MB, int NB, bool Grouped>
I8_WO_SIMD void wo_dot_tile(const WeightOnly &p, int64_t m0, int64_t n0, const float *codes, LinePrefetch pf) {
    constexpr int64_t S = X::kStep;
    __m512 acc[MB][NB] = {}; // zeros
    const typename X::T *x = static_cast<const typename X::T *>(p.x) + m0 * p.ldx;
    const int8_t *w = p.w + n0 * p.ldw;
    int64_t k = 0;
    // Two loops rather than one over runs (run = kfull without groups): with one, GCC spilled more of the prefetch
    // walk's registers to the stack (seen in the fp32 1 x 8 tile's loop).
    if constexpr (Grouped) {
        const int64_t kfull = p.K / S * S;
        for (const float *c = codes; k < kfull; c += kCodeChunkStride) { // a chunk of codes at a time
            const int64_t ke = imin(kfull, k + 16 * kCodeChunk);
            for (const float *cc = c; k < ke; k += S, cc += S / 16) { // a step: S / 16 groups
#pragma GCC unroll 4
                for (int s = 0; s < S / 8; ++s) {
                    pf.step();
                }
                X::template step<MB, NB, false, true>(x, p.ldx, w, p.ldw, k, X::kAll, cc, true, acc);
            }
        }
        if (k < p.K) { // masked: nothing past the rows is read
            X::template step<MB, NB, true, true>(x, p.ldx, w, p.ldw, k, X::mask(p.K - k), code_at(codes, k / 16),
                                                 k + 16 < p.K, acc);
        }
    } else {
        for (; k + S <= p.K; k += S) {
#pragma GCC unroll 4
            for (int s = 0; s < S / 8; ++s) {
                pf.step();
            }
            X::template step<MB, NB, false, false>(x, p.ldx, w, p.ldw, k, X::kAll, nullptr, false, acc);
        }
        if (k < p.K) {
            X::template step<MB, NB, true, false>(x, p.ldx, w, p.ldw, k, X::mask(p.K - k), nullptr, false, acc);
        }
    }
    wo_store<MB, NB>(p, m0, n0, acc);
}
