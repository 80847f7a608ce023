// Autograd kernel of fastdl_cpp::int8_linear_qat (every device): the straight-through estimator of
// fastdl/ops/int8.py's _qat_setup_context / _qat_backward in C++ (the quantizers treated as the identity: the
// gradients of the float linear, from fastdl_cpp::fused_linear_backward), for the eager calls that need a gradient and
// run the compiled kernels (fastdl/ops/_library.py, Op; the same scheme as fused_linear_autograd.cpp). Calls through
// the dispatcher (torch.compile, modes, the fastdl::int8_linear_qat op) keep the op's Python autograd registration.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "autograd_ops.h"

namespace fastdl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = at::Tensor(const at::Tensor &, const at::Tensor &, const std::optional<at::Tensor> &, bool);

const c10::TypedOperatorHandle<ForwardSig> &forward_op() {
    static const auto op = find_cpp_op<ForwardSig>("fastdl_cpp::int8_linear_qat");
    return op;
}

struct Int8LinearQatFunction : public torch::autograd::Function<Int8LinearQatFunction> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const std::optional<at::Tensor> &bias, bool weight_only) {
        at::AutoDispatchBelowADInplaceOrView below; // the device kernel, not this one again
        ctx->save_for_backward({x, weight});
        save_bias(ctx, bias);
        ctx->saved_data["weight_only"] = weight_only;
        return forward_op().call(x, weight, bias, weight_only);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list result(4); // x, weight, bias, weight_only (never)
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1];
        // edges: x 0, weight 1, bias 2 where given
        const LinearNeeds need = linear_needs(ctx, 2);
        if (!need.any())
            return result;
        if (at::GradMode::is_enabled()) { // create_graph=True: gradients with a graph (autograd_ops.h)
            const auto bias = kept_input(ctx, "bias", "int8_linear_qat");
            grads_with_graph("fastdl::int8_linear_qat", {x, weight, bias, ctx->saved_data["weight_only"].toBool()},
                             grads[0], {{0, need.x, x}, {1, need.w, weight}, {2, need.b, bias}}, result);
            return result;
        }
        const at::Tensor no_preact = at::empty({0}, x.options()); // activation "none" reads no pre-activation
        linear_grads(result, grads[0], x, weight, no_preact, "none", need.x, need.w, need.b,
                     ctx->saved_data["bias_dtype"].toScalarType());
        return result;
    }
};

at::Tensor int8_linear_qat_autograd(const at::Tensor &x, const at::Tensor &weight,
                                    const std::optional<at::Tensor> &bias, bool weight_only) {
    return device_or_node<Int8LinearQatFunction>(forward_op(), x, weight, bias, weight_only);
}

} // namespace
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, Autograd, m) {
    m.impl("int8_linear_qat", &fastdl::int8_linear_qat_autograd);
}
