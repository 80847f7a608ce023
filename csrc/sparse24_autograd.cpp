// Autograd kernel of fastdl_cpp::sparse24_linear (every device): the formulas of fastdl/ops/sparse24.py's
// _linear_setup_context / _linear_backward in C++, for the eager calls that need a gradient and run the compiled
// kernels (fastdl/ops/_library.py, Op; the same scheme as fused_linear_autograd.cpp). Calls through the dispatcher
// (torch.compile, modes, the fastdl::sparse24_linear op) keep the op's Python autograd registration.
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

using ForwardSig = at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &,
                              const std::optional<at::Tensor> &);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor &, const at::Tensor &,
                                                                   const at::Tensor &, const at::Tensor &,
                                                                   std::array<bool, 3>);

const c10::TypedOperatorHandle<ForwardSig> &forward_op() {
    static const auto op = find_cpp_op<ForwardSig>("fastdl_cpp::sparse24_linear");
    return op;
}
const c10::TypedOperatorHandle<BackwardSig> &backward_op() {
    static const auto op = find_cpp_op<BackwardSig>("fastdl_cpp::sparse24_linear_backward");
    return op;
}

struct Sparse24LinearFunction : public torch::autograd::Function<Sparse24LinearFunction> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &values,
                              const at::Tensor &meta, const std::optional<at::Tensor> &bias) {
        at::AutoDispatchBelowADInplaceOrView below; // the device kernel, not this one again
        ctx->save_for_backward({x, values, meta});
        save_bias(ctx, bias);
        return forward_op().call(x, values, meta, bias);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list result(4); // x, values, meta (never), bias
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &values = saved[1], &meta = saved[2];
        // edges: x 0, values 1, meta 2, bias 3 where given
        const LinearNeeds need = linear_needs(ctx, 3);
        if (!need.any())
            return result;
        if (at::GradMode::is_enabled()) { // create_graph=True: gradients with a graph (autograd_ops.h)
            const auto bias = kept_input(ctx, "bias", "sparse24_linear");
            grads_with_graph("fastdl::sparse24_linear", {x, values, meta, bias}, grads[0],
                             {{0, need.x, x}, {1, need.w, values}, {3, need.b, bias}}, result);
            return result;
        }
        auto [gx, gv, gb] = backward_op().call(grads[0], x, values, meta, {need.x, need.w, need.b});
        if (need.x)
            result[0] = gx;
        if (need.w)
            result[1] = gv;
        if (need.b)
            result[3] = gb.to(ctx->saved_data["bias_dtype"].toScalarType());
        return result;
    }
};

at::Tensor sparse24_linear_autograd(const at::Tensor &x, const at::Tensor &values, const at::Tensor &meta,
                                    const std::optional<at::Tensor> &bias) {
    // (meta is an integer tensor: it never requires a gradient)
    return device_or_node<Sparse24LinearFunction>(forward_op(), x, values, meta, bias);
}

} // namespace
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, Autograd, m) {
    m.impl("sparse24_linear", &fastdl::sparse24_linear_autograd);
}
