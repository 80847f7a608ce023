// Shared by the C++ Autograd kernels (csrc/<op>_autograd.cpp): typed handles of the fastdl_cpp ops they call, looked
// up on first use (the schemas are defined from Python when fastdl is imported, after this library is loaded).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <array>
#include <optional>
#include <tuple>

namespace fastdl {

// An optional tensor argument that was passed (an undefined tensor counts as absent, as in the schemas' `Tensor?`).
inline bool is_given(const std::optional<at::Tensor> &t) {
    return t.has_value() && t->defined();
}

inline bool requires_grad_arg(const at::Tensor &t) {
    return t.defined() && t.requires_grad();
}
inline bool requires_grad_arg(const std::optional<at::Tensor> &t) {
    return is_given(t) && t->requires_grad();
}

// Whether a call records a graph: grad mode is on and an argument requires a gradient. When it does not (inference,
// frozen weights), the Autograd kernels call the device kernel directly, as PyTorch's generated kernels do, instead of
// building a Function node, its context and saved data that nothing reads: ~2.5 us a call at M = 1 (fused_linear,
// K = N = 64, AMD EPYC Zen 2).
template <class... Args> bool records_graph(const Args &...args) {
    return at::GradMode::is_enabled() && (requires_grad_arg(args) || ...);
}

template <class Sig> c10::TypedOperatorHandle<Sig> find_cpp_op(const char *qualified_name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Sig>();
}

// fastdl_cpp::fused_linear_backward (the backward of fused_linear and of int8_linear_qat's straight-through estimator)
using FusedLinearBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor &, const at::Tensor &,
                                                                              const at::Tensor &, const at::Tensor &,
                                                                              c10::string_view, std::array<bool, 3>);
inline const c10::TypedOperatorHandle<FusedLinearBackwardSig> &fused_linear_backward_op() {
    static const auto op = find_cpp_op<FusedLinearBackwardSig>("fastdl_cpp::fused_linear_backward");
    return op;
}

// The gradients of a linear layer's x, weight and bias from fastdl_cpp::fused_linear_backward into result[0], [1] and
// [2] (the bias's in bias_dtype), each only where needed.
inline void linear_grads(torch::autograd::variable_list &result, const at::Tensor &grad_out, const at::Tensor &x,
                         const at::Tensor &weight, const at::Tensor &preact, c10::string_view activation, bool need_x,
                         bool need_w, bool need_b, at::ScalarType bias_dtype) {
    auto [gx, gw, gb] =
        fused_linear_backward_op().call(grad_out.contiguous(), x, weight, preact, activation, {need_x, need_w, need_b});
    if (need_x)
        result[0] = gx;
    if (need_w)
        result[1] = gw;
    if (need_b)
        result[2] = gb.to(bias_dtype);
}

} // namespace fastdl
