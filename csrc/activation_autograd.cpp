// Autograd kernel of fastdl_cpp::activation (every device): fastdl/ops/fused_linear.py's _act_setup_context /
// _act_backward in C++, for the eager calls that need a gradient and run the compiled kernels (fastdl/ops/_library.py,
// Op; the same scheme as fused_linear_autograd.cpp): the backward is fastdl_cpp::activation_backward on the saved
// input, with no Python in between. Calls through the dispatcher keep the op's Python autograd registration.
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>

#include "autograd_ops.h"

namespace fastdl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = at::Tensor(const at::Tensor &, c10::string_view);
using BackwardSig = at::Tensor(const at::Tensor &, const at::Tensor &, c10::string_view);

const c10::TypedOperatorHandle<ForwardSig> &forward_op() {
    static const auto op = find_cpp_op<ForwardSig>("fastdl_cpp::activation");
    return op;
}
const c10::TypedOperatorHandle<BackwardSig> &backward_op() {
    static const auto op = find_cpp_op<BackwardSig>("fastdl_cpp::activation_backward");
    return op;
}

struct ActivationFunction : public torch::autograd::Function<ActivationFunction> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, c10::string_view activation) {
        at::AutoDispatchBelowADInplaceOrView below; // the device kernel, not this one again
        ctx->save_for_backward({x});
        ctx->saved_data["activation"] = std::string(activation.data(), activation.size());
        return forward_op().call(x, activation);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list result(2); // x, activation (never)
        if (!grads[0].defined() || !ctx->needs_input_grad(0))
            return result;
        const at::Tensor x = ctx->get_saved_variables()[0];
        const std::string act = ctx->saved_data["activation"].toStringRef();
        if (at::GradMode::is_enabled()) { // create_graph=True: gradients with a graph (autograd_ops.h)
            grads_with_graph("fastdl::activation", {x, act}, grads[0], {{0, true, x}}, result);
            return result;
        }
        result[0] = backward_op().call(grads[0].contiguous(), x, act);
        return result;
    }
};

at::Tensor activation_autograd(const at::Tensor &x, c10::string_view activation) {
    return device_or_node<ActivationFunction>(forward_op(), x, activation);
}

} // namespace
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, Autograd, m) {
    m.impl("activation", &fastdl::activation_autograd);
}
