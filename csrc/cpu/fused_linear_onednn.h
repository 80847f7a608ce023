// The oneDNN route of the CPU fused linear: PyTorch's own oneDNN inner product with the activation fused as a post-op
// (mkldnn::_linear_pointwise, the op torch.compile's CPU backend emits for linear + pointwise), used by
// fused_linear.cpp at the shapes where it is faster than fastdl's kernels (the rules and their numbers are there).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "../activation.h"

namespace fastdl {
namespace fused_linear {

// Whether the route can serve compute dtype c in this process: PyTorch was built with oneDNN and registers the op,
// oneDNN runs that dtype on this CPU (bf16: mkldnn::_is_mkldnn_bf16_supported, False when ONEDNN_MAX_CPU_ISA caps it
// below AVX512-BF16) and FASTDL_CPU_ONEDNN is not "0" (read on every call: a developer switch that keeps fastdl's own
// kernels on every shape, for tests and A/B benchmarks).
bool onednn_available(at::ScalarType c);

// act(x2 @ w^T + bias) + residual in one oneDNN primitive, rounded to c once: x2 is [M, K] contiguous in c, w [N, K]
// in c, bias (optional) any floating dtype, residual (undefined for none) [M, N] in c and only with act == None (a
// binary post-op; _linear_pointwise has no activation-then-add form). Returns a new [M, N] tensor in c.
at::Tensor onednn_linear(const at::Tensor &x2, const at::Tensor &w, const std::optional<at::Tensor> &bias, Act act,
                         const at::Tensor &residual);

} // namespace fused_linear
} // namespace fastdl
