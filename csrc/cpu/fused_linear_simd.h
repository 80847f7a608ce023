// What the AVX2 (fused_linear_avx2.cpp) and AVX-512 (fused_linear_avx512.cpp) kernels of the fused linear layer share,
// written once over a vector-traits struct V: the activations and their derivatives, exp's polynomial, the in-register
// transpose, register tiles of inner products and the dispatch of a run-time count to a template argument. Vectors
// use the compiler's operators for + - * (GCC and Clang define __m256 / __m512 as vector types, and their intrinsics
// for these are the same operators). V provides, beyond what fused_linear_epilogue.h lists:
//   set1(f), setzero(), fmadd(a, b, c) (a b + c), fnmadd(a, b, c) (c - a b), max(a, b) (NaN: the second operand),
//   round(v) (to the nearest integer), rcp_approx(d) (the approximate reciprocal instruction), hsum(v) (the sum of
//   the lanes)
//   neg_abs(v) (-|v|), blend_neg(z, a, b) (b where z < 0, else a), pos_mask(p, v) (v where p > 0, else 0)
//   exp_neg(x) (e^x for x <= 0: the level's range handling around exp_poly below), gelu(x), gelu_grad(x) (the level's
//   own approximations: a rational function on AVX2, where exp is dear; erfc on AVX-512, see each file)
//   unpacklo32 / unpackhi32 / unpacklo64 / unpackhi64 (a, b): the interleaves of a transpose's first two stages, and
//   transpose_lanes(r): its last stages, which move 128-bit lanes and so differ by the vector width
// What stays in each file is what differs by more than the vector width: the register tiles and inner loops of the
// GEMM and weight-reading kernels (vdpbf16ps k pairs and mask registers on AVX-512, bf16 widened by shifts into FMAs
// in 16 ymm registers on AVX2: other tile shapes, other instructions).
// Include it, like fused_linear_epilogue.h, inside the level's unnamed namespace after defining FL_SIMD as the level's
// target attribute (each translation unit keeps its own copy, compiled for its ISA). No #pragma once.
#ifndef FL_SIMD
#error "fused_linear_simd.h: define FL_SIMD (the level's target attribute) before including it"
#endif
#define FL_SIMD_INLINE inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------------------------
// Activations. exp(x) by Cody-Waite reduction to r in [-ln2/2, ln2/2] and a degree-5 minimax polynomial (2.2e-7 in
// fp32); returns the polynomial at r and n (e^x = p 2^n), which each level scales in its own way.
template <class V> FL_SIMD FL_SIMD_INLINE typename V::Vec exp_poly(typename V::Vec x, typename V::Vec &n) {
    n = V::round(x * V::set1(1.44269504088896341f));
    typename V::Vec r = V::fnmadd(n, V::set1(0.693359375f), x);
    r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
    typename V::Vec p = V::set1(0.008297819644212723f);
    p = V::fmadd(p, r, V::set1(0.04191580414772034f));
    p = V::fmadd(p, r, V::set1(0.16667574644088745f));
    p = V::fmadd(p, r, V::set1(0.4999889135360718f));
    p = V::fmadd(p, r, V::set1(0.9999997019767761f));
    return V::fmadd(p, r, V::set1(1.0000001192092896f));
}

// 1 / d for d >= 1: the approximate reciprocal and one Newton step (~1e-7 relative after vrcpps' 12 bits, ~1e-8 after
// vrcp14ps' 14), instead of a division.
template <class V> FL_SIMD FL_SIMD_INLINE typename V::Vec rcp(typename V::Vec d) {
    const typename V::Vec r = V::rcp_approx(d);
    return r * V::fnmadd(d, r, V::set1(2.f));
}

// sigmoid(z) and, in oms, 1 - sigmoid(z), without cancellation or overflow: with e = exp(-|z|) in (0, 1], the pair is
// (1, e) / (1 + e) for z >= 0 and (e, 1) / (1 + e) for z < 0 (NaN propagates through e).
template <class V> FL_SIMD FL_SIMD_INLINE typename V::Vec sigmoid(typename V::Vec z, typename V::Vec &oms) {
    const typename V::Vec e = V::exp_neg(V::neg_abs(z));
    const typename V::Vec r = rcp<V>(V::set1(1.f) + e);
    const typename V::Vec er = e * r;
    oms = V::blend_neg(z, er, r);
    return V::blend_neg(z, r, er);
}

// 2 u = 2 sqrt(2/pi) (x + c x^3): gelu_tanh(x) = 0.5 x (1 + tanh u) = x sigmoid(2 u).
template <class V> FL_SIMD FL_SIMD_INLINE typename V::Vec gelu_tanh_2u(typename V::Vec x) {
    return (x * V::set1(2.f * kSqrt2OverPi)) * V::fmadd(x * x, V::set1(kGeluTanhC), V::set1(1.f));
}

template <class V, Act A> FL_SIMD FL_SIMD_INLINE typename V::Vec act(typename V::Vec x) {
    typename V::Vec tmp;
    if constexpr (A == Act::Relu) {
        return V::max(V::setzero(), x); // NaN propagates (second operand)
    } else if constexpr (A == Act::Gelu) {
        return V::gelu(x);
    } else if constexpr (A == Act::GeluTanh) {
        return x * sigmoid<V>(gelu_tanh_2u<V>(x), tmp);
    } else if constexpr (A == Act::Silu) {
        return x * sigmoid<V>(x, tmp);
    } else {
        return x;
    }
}

template <class V, Act A> FL_SIMD FL_SIMD_INLINE typename V::Vec act_grad(typename V::Vec p) {
    if constexpr (A == Act::Relu) {
        return V::pos_mask(p, V::set1(1.f));
    } else if constexpr (A == Act::Gelu) {
        return V::gelu_grad(p);
    } else if constexpr (A == Act::GeluTanh) {
        typename V::Vec oms;
        const typename V::Vec s = sigmoid<V>(gelu_tanh_2u<V>(p), oms);
        // d = s + 2 p s (1 - s) sqrt(2/pi) (1 + 3 c p^2)
        const typename V::Vec inner = V::fmadd(p * p, V::set1(3.f * kGeluTanhC), V::set1(1.f));
        return V::fmadd(s * oms * p * V::set1(2.f * kSqrt2OverPi), inner, s);
    } else if constexpr (A == Act::Silu) {
        typename V::Vec oms;
        const typename V::Vec s = sigmoid<V>(p, oms);
        return s * V::fmadd(p, oms, V::set1(1.f));
    } else {
        return V::set1(1.f);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// In-register transpose of N x N 32-bit elements (N = the lanes of T): on return r[q] holds column q. Row pairs are
// interleaved by 32 bits, then by 64 bits; V::transpose_lanes moves the 128-bit lanes.
template <class V, class T, int N> FL_SIMD FL_SIMD_INLINE void transpose(T (&r)[N]) {
    T t[N];
#pragma GCC unroll 8
    for (int i = 0; i < N / 2; ++i) {
        t[2 * i] = V::unpacklo32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = V::unpackhi32(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < N / 4; ++i) {
        r[4 * i + 0] = V::unpacklo64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 1] = V::unpackhi64(t[4 * i + 0], t[4 * i + 2]);
        r[4 * i + 2] = V::unpacklo64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = V::unpackhi64(t[4 * i + 1], t[4 * i + 3]);
    }
    V::transpose_lanes(r, t);
}

// ---------------------------------------------------------------------------------------------------------------
// Register tiles.
template <class V, int A, int B> FL_SIMD FL_SIMD_INLINE void zero_tile(typename V::Vec (&acc)[A][B]) {
#pragma GCC unroll 24
    for (int i = 0; i < A; ++i)
#pragma GCC unroll 8
        for (int j = 0; j < B; ++j)
            acc[i][j] = V::setzero();
}

// The operands of an inner-product tile: MT rows of x (row stride ldx elements) against R weight rows (row stride ldw,
// in elements of W).
template <class X, class W> struct DotRows {
    const X *x;
    int64_t ldx;
    const W *w;
    int64_t ldw;
};

// An MT x R tile of inner products over K: step.run<TAIL>(acc, k, rem) adds S elements from k on (TAIL: only the
// rem < S valid ones), then c[m * ldc + r] = the lanes of acc[m][r] summed. The full steps and the one tail step are
// separate calls so that the accumulators stay in registers (a tail test inside the loop made GCC keep them on the
// stack: 4x slower at M = 4).
template <class V, int MT, int R, int S, class Step>
FL_SIMD FL_SIMD_INLINE void dot_tile(const Step &step, int64_t K, float *c, int64_t ldc) {
    typename V::Vec acc[MT][R];
    zero_tile<V>(acc);
    const int64_t kmain = K & ~int64_t{S - 1};
    for (int64_t k = 0; k < kmain; k += S)
        step.template run<false>(acc, k, S);
    if (kmain < K)
        step.template run<true>(acc, kmain, K - kmain);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
            c[m * ldc + r] = V::hsum(acc[m][r]);
}

// f(std::integral_constant<int, n>) for 1 <= n < Max, f(std::integral_constant<int, Max>) otherwise: a run-time count
// (rows of a tile, vectors of a panel) as a template argument, as a switch would. (A class: its qualified recursion
// cannot meet the other level's copy through argument-dependent lookup.)
template <int Max, int N = 1> struct ByCount {
    template <class F> static FL_SIMD_INLINE void run(int64_t n, F &f) {
        if constexpr (N < Max) {
            if (n == N)
                return f(std::integral_constant<int, N>{});
            return ByCount<Max, N + 1>::run(n, f);
        } else {
            return f(std::integral_constant<int, Max>{});
        }
    }
};
template <int Max, class F> FL_SIMD_INLINE void by_count(int64_t n, F &&f) {
    ByCount<Max>::run(n, f);
}

// nrows weight rows as tiles of R rows, the rest one row at a time: tile(r, std::integral_constant<int, rows>).
template <int R, class Tile> FL_SIMD_INLINE void by_row_tiles(int64_t nrows, Tile &&tile) {
    int64_t r = 0;
    for (; r + R <= nrows; r += R)
        tile(r, std::integral_constant<int, R>{});
    for (; r < nrows; ++r)
        tile(r, std::integral_constant<int, 1>{});
}

#undef FL_SIMD_INLINE
