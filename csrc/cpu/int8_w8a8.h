// The W8A8 driver of the int8 capability, shared by the ops of int8.cpp: the packing of a weight into the VNNI
// layout (int8_pack_weight) and the blocked, threaded GEMM over the kernels of int8_kernels.h (int8_w8a8.cpp), with
// the small integer helpers the glue uses too. Torch headers allowed (glue only).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>

#include "int8_kernels.h"

namespace fastdl {
namespace int8 {

inline constexpr int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}
inline constexpr int64_t round_up(int64_t a, int64_t b) {
    return ceil_div(a, b) * b;
}

// [begin, end) of part i of n parts of `total` units, boundaries on multiples of `unit` where possible.
inline std::pair<int64_t, int64_t> split(int64_t total, int64_t parts, int64_t i, int64_t unit) {
    auto edge = [&](int64_t j) {
        if (j >= parts) {
            return total;
        }
        return std::min(total, round_up(total * j / parts, unit));
    };
    return {edge(i), edge(i + 1)};
}

// Weight in the VNNI layout [Np/16][Kp/4][16][4] and comp[n] = 128 * sum_k w[n, k] (the output of int8_pack_weight).
std::tuple<at::Tensor, at::Tensor> pack_weight(const at::Tensor &w_q);

// One W8A8 GEMM: out[M, N] = dequant(A [M, K] (int8 with a_scale, or float rows quantised per row on the fly) x the
// packed weight) (+ bias), in out_dtype. run_w8a8 fills in the blocking and runs it on at::parallel_for.
struct W8A8 {
    const Kernels *kr = nullptr;
    const void *a = nullptr; // int8 or float rows
    int64_t lda = 0;
    DType a_dtype = DType::I8;
    const float *a_scale = nullptr; // int8 A
    int64_t M = 0, K = 0, N = 0, Kp = 0;
    const int8_t *b = nullptr;
    const int32_t *comp = nullptr;
    const float *b_scale = nullptr, *bias = nullptr;
    void *out = nullptr;
    DType out_dtype = DType::F32;
    bool u7 = false; // float A: the 7-bit activation mode (APack::u7)
    // blocking
    int64_t nkb = 1, Kc = 0, mc_max = 1;
};

void run_w8a8(W8A8 &p);

} // namespace int8
} // namespace fastdl
