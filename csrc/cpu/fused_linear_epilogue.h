// The fused epilogue (bias, activation, residual, stores) and the backward elementwise pass (dpre = grad_out times the
// activation's derivative, grad_bias partial sums) of the SIMD kernels, written once over a vector-traits struct V that
// fused_linear_avx2.cpp (Avx2Vec: 8 fp32 lanes, masks as lane counts) and fused_linear_avx512.cpp (Avx512Vec: 16 lanes,
// mask registers) define:
//   Vec, Mask, kLanes, kStreamAlign (the alignment a non-temporal store needs)
//   mask(n): the first n lanes (n >= kLanes: all); full(m): all lanes
//   loadf(p, m) / storef(p, v, m): fp32; load(p, dt, i, m) / store(p, dt, i, v, m): element i of fp32 or bf16 data
//   stream(p, v) (non-temporal store), fence(), zero(p, n) (n fp32 zeros), round_bf16(v) (RNE, kept in fp32)
// and what fused_linear_simd.h's activations need (act<V, A>, act_grad<V, A>); + and * are the vectors' operators.
// Include it inside the level's unnamed namespace (fastdl::fused_linear::{}), after fused_linear_simd.h and V, with
// FL_SIMD defined as the level's target attribute: the templates then compile with that ISA and have internal linkage,
// so each translation unit keeps its own copy and the linker can never give the AVX2 table an AVX-512 body (or the
// reverse). No #pragma once: it is meant to be read once per level.
#ifndef FL_SIMD
#error "fused_linear_epilogue.h: define FL_SIMD (the level's target attribute) before including it"
#endif
#define FL_SIMD_INLINE inline __attribute__((always_inline))

// G vectors of one row, the last ones masked by rem: the activations of a group are independent chains the core
// overlaps (one vector at a time, gelu ran ~30 cycles per vector, latency-bound; groups of 3-4 on AVX-512: bf16
// M = 4096, K = 256, N = 1024 gelu forward 3.24 -> 3.03 ms, of which gelu 0.81 -> 0.63 ms).
template <class V, Act A, int G>
FL_SIMD FL_SIMD_INLINE void epilogue_group(const Epilogue &e, const float *a, int64_t r, int64_t c, int64_t rem) {
    typename V::Vec v[G];
    typename V::Mask m[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
        m[g] = V::mask(rem - V::kLanes * g);
        v[g] = V::loadf(a + V::kLanes * g, m[g]);
        if (e.bias)
            v[g] = v[g] + V::loadf(e.bias + c + V::kLanes * g, m[g]);
        if (e.pre)
            V::store(e.pre, e.out_dtype, r * e.ld_pre + c + V::kLanes * g, v[g], m[g]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
        v[g] = act<V, A>(v[g]);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
        const int64_t cg = c + V::kLanes * g;
        if (e.res)
            v[g] = v[g] + V::load(e.res, e.res_dtype, r * e.ld_res + cg, m[g]);
        float *dst = static_cast<float *>(e.out) + r * e.ld_out + cg;
        if (e.stream && e.out_dtype == DType::F32 && V::full(m[g]) &&
            reinterpret_cast<uintptr_t>(dst) % V::kStreamAlign == 0)
            V::stream(dst, v[g]);
        else
            V::store(e.out, e.out_dtype, r * e.ld_out + cg, v[g], m[g]);
    }
}

// The same for the backward pass (M = 4096, N = 1024 gelu, grad_bias only, AVX-512: 0.96 -> 0.82 ms): d = grad_out
// times act'(preact), added into the grad_bias partial sums `part` and stored as dpre, each where asked for.
template <class V, Act A, int G>
FL_SIMD FL_SIMD_INLINE void dpre_group(const DpreArgs &a, int64_t r, int64_t c, int64_t rem, float *part) {
    typename V::Vec d[G];
    typename V::Mask m[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
        m[g] = V::mask(rem - V::kLanes * g);
        d[g] = V::load(a.g, a.g_dtype, r * a.ld_g + c + V::kLanes * g, m[g]);
    }
    if constexpr (A != Act::None) {
        typename V::Vec p[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g)
            p[g] = V::load(a.p, a.p_dtype, r * a.ld_p + c + V::kLanes * g, m[g]);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g)
            d[g] = d[g] * act_grad<V, A>(p[g]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
        const int64_t cg = c + V::kLanes * g;
        if (part)
            V::storef(part + cg, V::loadf(part + cg, m[g]) + d[g], m[g]);
        if (a.dpre)
            V::store(a.dpre, a.dpre_dtype, r * a.ld_dpre + cg, a.dpre_round_bf16 ? V::round_bf16(d[g]) : d[g], m[g]);
    }
}

// One row of the epilogue / of the backward pass, as the group walk below calls it: columns [j, j + rem) of the row.
template <class V, Act A> struct EpilogueRow {
    const Epilogue &e;
    const float *a;
    int64_t r, c0;
    template <int G> FL_SIMD FL_SIMD_INLINE void run(int64_t j, int64_t rem) const {
        epilogue_group<V, A, G>(e, a + j, r, c0 + j, rem);
    }
};

template <class V, Act A> struct DpreRow {
    const DpreArgs &a;
    int64_t r, c0;
    float *part;
    template <int G> FL_SIMD FL_SIMD_INLINE void run(int64_t j, int64_t rem) const {
        dpre_group<V, A, G>(a, r, c0 + j, rem, part);
    }
};

// The w columns of a row in groups of 4 vectors, then one group of the 1-3 vectors left.
template <class V, class Row> FL_SIMD FL_SIMD_INLINE void for_groups(const Row &row, int64_t w) {
    int64_t j = 0;
    for (; w - j > 3 * V::kLanes; j += 4 * V::kLanes)
        row.template run<4>(j, w - j);
    switch ((w - j + V::kLanes - 1) / V::kLanes) {
    case 3:
        row.template run<3>(j, w - j);
        break;
    case 2:
        row.template run<2>(j, w - j);
        break;
    case 1:
        row.template run<1>(j, w - j);
        break;
    default:
        break;
    }
}

template <class V, Act A>
FL_SIMD void epilogue_rows(const Epilogue &epi, const float *acc, int64_t ld_acc, int64_t row0, int64_t rows,
                           int64_t col0, int64_t cols) {
    const Epilogue e = epi; // a local copy: the output stores cannot alias it, so its fields stay in registers
    for (int64_t i = 0; i < rows; ++i)
        for_groups<V>(EpilogueRow<V, A>{e, acc + i * ld_acc, row0 + i, col0}, cols);
    if (e.stream && e.fence)
        V::fence();
}

template <class V, Act A>
FL_SIMD void dpre_rows(const DpreArgs &a, int64_t row0, int64_t row1, int64_t col0, int64_t col1, float *partial,
                       int64_t ld_partial) {
    for (int64_t r0 = row0; r0 < row1; r0 += kDpreRows) {
        float *part = partial ? partial + (r0 / kDpreRows) * ld_partial : nullptr;
        const int64_t w = col1 - col0;
        if (part)
            V::zero(part + col0, w);
        for (int64_t r = r0; r < std::min(row1, r0 + kDpreRows); ++r)
            for_groups<V>(DpreRow<V, A>{a, r, col0, part}, w);
    }
}

// The kernel-table entries (Kernels::epilogue, Kernels::dpre_pass): the activation chosen once per call.
#define FL_EPILOGUE_CASE(act, name)                                                                                    \
    case Act::act:                                                                                                     \
        return epilogue_rows<V, Act::act>(e, acc, ld_acc, row0, rows, col0, cols);
template <class V>
FL_SIMD void simd_epilogue(const Epilogue &e, const float *acc, int64_t ld_acc, int64_t row0, int64_t rows,
                           int64_t col0, int64_t cols) {
    switch (e.act) { FASTDL_ACTIVATIONS(FL_EPILOGUE_CASE) }
}
#undef FL_EPILOGUE_CASE

#define FL_DPRE_CASE(act, name)                                                                                        \
    case Act::act:                                                                                                     \
        return dpre_rows<V, Act::act>(a, row0, row1, col0, col1, partial, ld_partial);
template <class V>
FL_SIMD void simd_dpre_pass(const DpreArgs &a, int64_t row0, int64_t row1, int64_t col0, int64_t col1, float *partial,
                            int64_t ld_partial) {
    switch (a.act) { FASTDL_ACTIVATIONS(FL_DPRE_CASE) }
}
#undef FL_DPRE_CASE

#undef FL_SIMD_INLINE
