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
        const bool has_bias = is_given(bias);
        ctx->saved_data["bias_dtype"] = has_bias ? bias->scalar_type() : at::kFloat;
        ctx->saved_data["has_bias"] = has_bias;
        ctx->save_for_backward({x, values, meta});
        keep_input(ctx, "bias", bias); // for a create_graph backward (grads_with_graph)
        return forward_op().call(x, values, meta, bias);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list result(4); // x, values, meta (never), bias
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &values = saved[1], &meta = saved[2];
        // edges: x 0, values 1, meta 2, bias 3 where given
        const bool need_x = ctx->needs_input_grad(0), need_v = ctx->needs_input_grad(1);
        const bool need_b = ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(3);
        if (!(need_x || need_v || need_b))
            return result;
        if (at::GradMode::is_enabled()) { // create_graph=True: gradients with a graph (autograd_ops.h)
            const auto bias = kept_input(ctx, "bias", "sparse24_linear");
            std::vector<std::pair<size_t, at::Tensor>> wrt;
            if (need_x)
                wrt.emplace_back(0, x);
            if (need_v)
                wrt.emplace_back(1, values);
            if (need_b)
                wrt.emplace_back(3, *bias);
            grads_with_graph("fastdl::sparse24_linear", {x, values, meta, bias}, grads[0], wrt, result);
            return result;
        }
        auto [gx, gv, gb] = backward_op().call(grads[0], x, values, meta, {need_x, need_v, need_b});
        if (need_x)
            result[0] = gx;
        if (need_v)
            result[1] = gv;
        if (need_b)
            result[3] = gb.to(ctx->saved_data["bias_dtype"].toScalarType());
        return result;
    }
};

at::Tensor sparse24_linear_autograd(const at::Tensor &x, const at::Tensor &values, const at::Tensor &meta,
                                    const std::optional<at::Tensor> &bias) {
    if (!records_graph(x, values, bias)) { // meta is integer: never differentiable
        at::AutoDispatchBelowADInplaceOrView below;
        return forward_op().call(x, values, meta, bias);
    }
    return Sparse24LinearFunction::apply(x, values, meta, bias);
}

} // namespace
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, Autograd, m) {
    m.impl("sparse24_linear", &fastdl::sparse24_linear_autograd);
}
