// The tile kernels of one AVX-512 family of the 2:4 sparse linear, written once over the family's vector primitives
// and compiled with its target attribute: sparse24_avx512.cpp includes this file once per family (fp32 FMA on
// AVX-512 F; vdpbf16ps + vpexpandw on AVX512_BF16 + VBMI2), each time inside a namespace of its own and after
// defining SP24_SIMD as that family's target attribute, as fused_linear_epilogue.h is included once per level. No
// #pragma once: it is meant to be read once per family.
//
// Tiles<F> takes the family F (F32Family<T> or Bf16Family) as its base. F provides:
//   Val (x and values element), Panel (expanded / pair panel element), Vec (x or weights in a register), XMask (the
//   lanes of a chunk), CH (positions per chunk), kPairs (pair panels supported);
//   load_x(p, mask); load_w(v, meta, c, rem): chunk c of a weight row expanded from values / meta (rem: positions of a
//   tail chunk, 0 for a full one); fma(acc, x, w); load_panel / store_panel; build_pair(...): one chunk of a pair
//   panel; perm(idx, x): x gathered to match a pair.
//
// Accumulators and weight registers are arrays indexed only by compile-time constants (unroll<N> calls its body with
// std::integral_constant indices; no loop is left for the compiler to unroll), so GCC keeps each in a register: a
// [4][6] array of accumulators indexed in loops was spilled to the stack on every step (measured: 2x slower), which
// is why these tiles were once a 213-line macro. A tile reads its accumulators from `ain` (nullptr: zeros) and either
// stores them to `aout` (not the last K block) or writes their horizontal sums to out. Full chunks use unmasked loads
// (masked loads measured 25% slower on Zen 5); the K tail is one masked step.
#ifndef SP24_SIMD
#error "sparse24_avx512_tiles.h: define SP24_SIMD (the family's target attribute) before including it"
#endif

// The lambdas of a tile call the family's intrinsics: they carry its target attribute, and are always inlined.
#define SP24_TILE_INLINE SP24_SIMD __attribute__((always_inline))

template <class Fn, int... I> SP24_TILE_INLINE inline void unroll_seq(const Fn &fn, std::integer_sequence<int, I...>) {
    (fn(std::integral_constant<int, I>{}), ...);
}
// fn(i) for i = 0 .. N - 1, each i a compile-time constant (std::integral_constant<int, i>).
template <int N, class Fn> SP24_TILE_INLINE inline void unroll(const Fn &fn) {
    unroll_seq(fn, std::make_integer_sequence<int, N>{});
}

template <class F> struct Tiles : F {
    using Val = typename F::Val;
    using Panel = typename F::Panel;
    using Vec = typename F::Vec;
    using XMask = typename F::XMask;
    static constexpr int CH = F::CH;

    // step(c, rem, mask) for the chunks of K positions: every full one (rem = 0, all lanes), then the tail.
    template <class Step> SP24_TILE_INLINE static void chunks(int64_t K, const Step &step) {
        const int64_t nc = K / CH, rem = K % CH;
        for (int64_t c = 0; c < nc; ++c)
            step(c, int64_t{0}, static_cast<XMask>(~XMask(0)));
        if (rem)
            step(nc, rem, static_cast<XMask>((XMask(1) << rem) - 1));
    }

    template <int N> SP24_TILE_INLINE static void load_acc(__m512 *acc, const float *ain) {
        unroll<N>([&](auto i) SP24_TILE_INLINE { acc[i] = ain ? _mm512_loadu_ps(ain + 16 * i) : _mm512_setzero_ps(); });
    }
    // Accumulators to aout (16 floats each) where given, else done(i, acc[i]) for each.
    template <int N, class Done> SP24_TILE_INLINE static void finish(const __m512 *acc, float *aout, const Done &done) {
        if (aout)
            unroll<N>([&](auto i) SP24_TILE_INLINE { _mm512_storeu_ps(aout + 16 * i, acc[i]); });
        else
            unroll<N>([&](auto i) SP24_TILE_INLINE { done(i, acc[i]); });
    }

    // MR rows of x times NR weight rows over K positions; load_w(j, c, rem) is chunk c of weight row j. out[MR * NR].
    template <int MR, int NR, class LoadW>
    SP24_TILE_INLINE static void tile(const Val *const *xr, int64_t K, const float *ain, float *aout, float *out,
                                      const LoadW &load_w) {
        __m512 acc[MR * NR];
        load_acc<MR * NR>(acc, ain);
        chunks(K, [&](int64_t c, int64_t rem, XMask xm) SP24_TILE_INLINE {
            Vec w[NR];
            unroll<NR>([&](auto j) SP24_TILE_INLINE { w[j] = load_w(j, c, rem); });
            unroll<MR>([&](auto i) SP24_TILE_INLINE {
                const Vec xv = F::load_x(xr[i] + CH * c, xm);
                unroll<NR>([&](auto j) SP24_TILE_INLINE { acc[i * NR + j] = F::fma(acc[i * NR + j], xv, w[j]); });
            });
        });
        finish<MR * NR>(acc, aout, [&](auto i, __m512 v) SP24_TILE_INLINE { out[i] = _mm512_reduce_add_ps(v); });
    }

    // direct<MR, NR>: MR (<= 4) rows of x times NR weight rows expanded from values / meta on the fly, all of K;
    // out[MR][NR] = the sums.
    template <int MR, int NR>
    SP24_SIMD static void direct(const Val *const *xr, const Val *const *vr, const uint8_t *const *mr, int64_t K,
                                 float *out) {
        tile<MR, NR>(xr, K, nullptr, nullptr, out,
                     [&](auto j, int64_t c, int64_t rem) SP24_TILE_INLINE { return F::load_w(vr[j], mr[j], c, rem); });
    }

    // Positions [k0, k0 + len) of one weight row (k0 % CH == 0) expanded into roundup(len, CH) panel values.
    SP24_SIMD static void expand_row(const Val *v, const uint8_t *mt, int64_t k0, int64_t len, Panel *dst) {
        const int64_t c0 = k0 / CH, nc = len / CH, rem = len % CH;
        for (int64_t c = 0; c < nc; ++c)
            F::store_panel(dst + CH * c, F::load_w(v, mt, c0 + c, 0));
        if (rem)
            F::store_panel(dst + CH * nc, F::load_w(v, mt, c0 + nc, rem));
    }

    // panel<MR, NR>: the tile over K positions of NR expanded panel rows (row stride Kp); xr point at the block.
    template <int MR, int NR>
    SP24_SIMD static void panel(const Val *const *xr, const Panel *pn, int64_t Kp, int64_t K, const float *ain,
                                float *aout, float *out) {
        tile<MR, NR>(xr, K, ain, aout, out,
                     [&](auto j, int64_t c, int64_t) SP24_TILE_INLINE { return F::load_panel(pn + j * Kp + CH * c); });
    }

    // Pair panels: 4 pairs of weight rows [ra[p], rb[p]], chunks [c0, c0 + nch) (the last one holds rem positions
    // when rem > 0), pair p at pn + p * ps; then the next weights to stream are prefetched (prefetch_rows).
    SP24_SIMD static void build_pairs(const Val *const *ra, const Val *const *rb, const uint8_t *const *ma,
                                      const uint8_t *const *mb, int64_t c0, int64_t nch, int64_t rem, Panel *pn,
                                      int64_t ps, const Val *const *pfv, const uint8_t *const *pfm, int64_t pf_bytes) {
        for (int p = 0; p < 4; ++p)
            for (int64_t c = 0; c < nch; ++c)
                F::build_pair(ra[p], ma[p], rb[p], mb[p], c0 + c, c == nch - 1 ? rem : 0, pn + p * ps + c * 2 * CH);
        prefetch_rows(pfv, pfm, pf_bytes);
    }

    // pair_tile<MR>: MR rows of x times 4 pairs of weight rows from a pair panel (pair stride ps); out[MR][8]. Two
    // weight rows share one vector: their kept values side by side (no zeros), and x is gathered to match with one
    // vpermw / vpermps per row of x and pair (the index vector, built once per panel, follows the values). Half the
    // multiply-adds of the expanded form; the permute runs on another port (measured: 1.2-1.3x the expanded 4x6
    // panel tile at M = 8..128).
    template <int MR>
    SP24_SIMD static void pair_tile(const Val *const *xr, const Panel *pn, int64_t ps, int64_t K, const float *ain,
                                    float *aout, float *out) {
        __m512 acc[MR * 4];
        load_acc<MR * 4>(acc, ain);
        chunks(K, [&](int64_t c, int64_t, XMask xm) SP24_TILE_INLINE {
            const Panel *pc = pn + c * 2 * CH;
            Vec w[4];
            __m512i q[4];
            unroll<4>([&](auto p) SP24_TILE_INLINE {
                w[p] = F::load_panel(pc + p * ps);
                q[p] = _mm512_loadu_si512(reinterpret_cast<const void *>(pc + p * ps + CH));
            });
            unroll<MR>([&](auto i) SP24_TILE_INLINE {
                const Vec xv = F::load_x(xr[i] + CH * c, xm);
                unroll<4>([&](auto p)
                              SP24_TILE_INLINE { acc[i * 4 + p] = F::fma(acc[i * 4 + p], F::perm(q[p], xv), w[p]); });
            });
        });
        // accumulator i = (row i / 4, pair i % 4): the two sums of its pair at out[8 * (i / 4) + 2 * (i % 4)]
        finish<MR * 4>(acc, aout, [&](auto i, __m512 v) SP24_TILE_INLINE { reduce_pair(v, out + 2 * i); });
    }
};

#undef SP24_TILE_INLINE
