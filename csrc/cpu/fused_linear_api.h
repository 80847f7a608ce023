// What other capabilities' ATen glue may call of the fused linear layer (torch headers allowed: glue only).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fastdl {
namespace fused_linear {

// out = x2 @ w^T (+ bias) for x2 [M, K] and w [N, K] of the same float dtype (fp32 / bf16), fp32 accumulation, one
// rounding: the CPU forward of fastdl::fused_linear with its routes (oneDNN where it wins, fastdl's kernels
// elsewhere). For the dense-by-blocks routes of weights held compressed (sparse24.cpp): a block of rows decompressed
// into a bounded buffer, multiplied, dropped.
at::Tensor linear_forward(const at::Tensor &x2, const at::Tensor &w, const std::optional<at::Tensor> &bias);

// Whether this process's family multiplies bf16 pairs in hardware (AVX512_BF16's vdpbf16ps, fp32 accumulation): a
// bf16 linear_forward then runs at twice the fp32 rate, which the quantized formats' bf16 routes use.
bool has_bf16_dot();

// A weight held quantized or compressed, for held_pb_min_rows: int8 weight-only with per-channel or grouped scales,
// int4 weight-only (float x), 2:4 with an fp32 or a bf16 x.
enum class Held { Int8, Int8Grouped, Int4, Sparse24, Sparse24Bf16x };
// The fewest rows of x from which such a layer's GEMM runs through this family's fp32 pb kernel with the weight
// dequantized / decompressed per chunk of panels while packed (fgemm_quantized_weight, sparse24_pb_linear: the
// AVX-512 families; 16-lane FMAs, a bounded workspace) instead of the format's own kernels; INT64_MAX: never (the
// AVX2 and scalar families: the formats' own rules). FASTDL_CPU_PB_ROWS=<rows> overrides it on the AVX-512 families
// (read once per process; the tests run both routes). The crossovers and their numbers are at the definition.
int64_t held_pb_min_rows(Held kind);

// out2 [M, N] (x2's dtype, contiguous) = x2 [M, K] (fp32 / bf16, contiguous) @ W^T + bias (fp32 or undefined), W the
// 2:4 weight of values [N, K / 2] (fp32 / bf16, contiguous; rounded to bf16 for a bf16 x) and meta [N, K / 8]
// (contiguous, valid: the caller checks it) decompressed per chunk of panels while packed into the fp32 pb kernel
// (the AVX-512 families; a bounded workspace, no dense copy). false (nothing written) where this family has no such
// kernel or K % 16 != 0.
bool sparse24_pb_linear(const at::Tensor &x2, const at::Tensor &values, const at::Tensor &meta, const at::Tensor &bias,
                        const at::Tensor &out2);

} // namespace fused_linear
} // namespace fastdl
