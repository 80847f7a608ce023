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

// The fewest rows of x from which a weight-only layer's GEMM (int4, or int8 with per-channel or grouped scales) runs
// through fgemm_quantized_weight's pb kernel on this family (the AVX-512 families: 16-lane FMAs, the weight
// dequantized per chunk of panels while packed) instead of the format's own kernels; INT64_MAX: never (the AVX2 and
// scalar families: the formats' own rules). The crossovers and their numbers are at the definition.
int64_t quantized_pb_min_rows(bool int4, bool grouped);

} // namespace fused_linear
} // namespace fastdl
