// Shared by the C++ Autograd kernels (csrc/<op>_autograd.cpp): typed handles of the fastdl_cpp ops they call, looked
// up on first use (the schemas are defined from Python when fastdl is imported, after this library is loaded).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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
inline bool requires_grad_arg(bool) { // a flag argument
    return false;
}
inline bool requires_grad_arg(c10::string_view) { // a name (an activation)
    return false;
}

// Whether a call records a graph: grad mode is on and an argument requires a gradient. When it does not (inference,
// frozen weights), the Autograd kernels call the device kernel directly, as PyTorch's generated kernels do, instead of
// building a Function node, its context and saved data that nothing reads: ~2.5 us a call at M = 1 (fused_linear,
// K = N = 64, AMD EPYC Zen 2).
template <class... Args> bool records_graph(const Args &...args) {
    return at::GradMode::is_enabled() && (requires_grad_arg(args) || ...);
}

// The Autograd kernel of a fastdl_cpp op whose node is Node (a torch::autograd::Function over the op's arguments):
// the device kernel `op` directly when the call records no graph (records_graph), else the node.
template <class Node, class Sig, class... Args>
auto device_or_node(const c10::TypedOperatorHandle<Sig> &op, const Args &...args) {
    if (!records_graph(args...)) {
        at::AutoDispatchBelowADInplaceOrView below;
        return op.call(args...);
    }
    return Node::apply(args...);
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

// ------------------------------------------------------------------------------------ gradients with a graph
// The C++ nodes' backward formulas call the fastdl_cpp backward kernels, whose results carry no graph. Under
// create_graph=True (grad mode is on inside backward) a double backward through them would silently miss every
// second-order term (issue 34: FusedLinear's weight.grad None or off by 0.93). So there the nodes instead re-run the
// forward through the PUBLIC op fastdl::<op> (same schema; its Python autograd registration, differentiable to any
// order) on the saved inputs, and differentiate that with torch::autograd::grad(create_graph=True): the gradients then
// have a graph. No loop: the public op's autograd runs its forward with grad mode off, so the fastdl_cpp Autograd
// kernels below it call the device kernel directly (records_graph is false) and record no C++ node. The forward is
// computed once more, only in this (rare) case.

// An input the nodes keep for a create_graph backward only: bias, residual (x and the weight are saved for the
// first-order formulas anyway). Kept by reference in saved_data with its version, not with save_for_backward: a
// first-order backward, which never reads it, must not fail because the caller changed it in place afterwards.
inline void keep_input(torch::autograd::AutogradContext *ctx, const char *key, const std::optional<at::Tensor> &t) {
    if (!is_given(t))
        return;
    ctx->saved_data[key] = *t;
    ctx->saved_data[std::string(key) + "_version"] = static_cast<int64_t>(t->_version());
}

// The bias of a linear node's forward: whether it was given and its dtype (its gradient is returned in it), and the
// tensor itself for a create_graph backward (keep_input).
inline void save_bias(torch::autograd::AutogradContext *ctx, const std::optional<at::Tensor> &bias) {
    const bool has_bias = is_given(bias);
    ctx->saved_data["bias_dtype"] = has_bias ? bias->scalar_type() : at::kFloat;
    ctx->saved_data["has_bias"] = has_bias;
    keep_input(ctx, "bias", bias);
}
// The gradients a linear node's backward must compute: x (input edge 0), the weight (edge 1) and the bias saved by
// save_bias (at bias_edge).
struct LinearNeeds {
    bool x, w, b;
    bool any() const { return x || w || b; }
};
inline LinearNeeds linear_needs(torch::autograd::AutogradContext *ctx, size_t bias_edge) {
    return {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
            ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(bias_edge)};
}

// The input kept by keep_input (nullopt when it was not given); RuntimeError, as a saved tensor's, when it was changed
// in place since the forward.
inline std::optional<at::Tensor> kept_input(torch::autograd::AutogradContext *ctx, const char *key, const char *op) {
    const auto it = ctx->saved_data.find(key);
    if (it == ctx->saved_data.end())
        return std::nullopt;
    at::Tensor t = it->second.toTensor();
    const int64_t saved = ctx->saved_data[std::string(key) + "_version"].toInt();
    TORCH_CHECK(static_cast<int64_t>(t._version()) == saved, op, ": the ", key,
                " needed for a create_graph=True backward has been modified by an inplace operation since the "
                "forward (its version is ",
                t._version(), ", expected ", saved, ")");
    return t;
}

// One input a create_graph backward may differentiate: its slot in the node's result, whether its gradient is wanted
// (ctx->needs_input_grad), the tensor. An optional input (bias, residual) is wanted only when it was given.
struct GradInput {
    size_t slot;
    bool need;
    at::Tensor t;
    GradInput(size_t slot_, bool need_, const at::Tensor &t_) : slot(slot_), need(need_), t(t_) {}
    GradInput(size_t slot_, bool need_, const std::optional<at::Tensor> &t_)
        : slot(slot_), need(need_ && is_given(t_)), t(need ? *t_ : at::Tensor()) {}
};

// result[slot] = the gradient, with a graph, of output 0 of fastdl::<public_op>(args) with respect to each wanted
// input, contracted with grad_out. Unused inputs get an undefined gradient.
inline void grads_with_graph(const char *public_op, torch::jit::Stack args, const at::Tensor &grad_out,
                             std::initializer_list<GradInput> wanted, torch::autograd::variable_list &result) {
    std::vector<const GradInput *> wrt;
    for (const GradInput &w : wanted)
        if (w.need)
            wrt.push_back(&w);
    if (wrt.empty())
        return;
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(public_op, "");
    op.callBoxed(args); // the stack now holds the outputs
    const at::Tensor out = args[0].toTensor();
    std::vector<at::Tensor> inputs;
    inputs.reserve(wrt.size());
    for (const GradInput *w : wrt)
        inputs.push_back(w->t);
    const torch::autograd::variable_list g = torch::autograd::grad({out}, inputs, {grad_out}, /*retain_graph=*/true,
                                                                   /*create_graph=*/true, /*allow_unused=*/true);
    for (size_t i = 0; i < wrt.size(); ++i)
        result[wrt[i]->slot] = g[i];
}

} // namespace fastdl
