// Autograd kernel of fastdl_cpp::fused_linear (every device): the formulas of fastdl/ops/fused_linear.py's
// _setup_context / _backward, in C++. fastdl's eager calls that need a gradient and run the compiled kernels call the
// fastdl_cpp op directly (fastdl/ops/_library.py, Op): forward and backward then run with no Python in between, as
// F.linear does. The Python torch.autograd.Function these calls used before cost a training step ~50-60 us on the
// 2-core Zen 2 (fused_linear, bf16 under autocast, M = 64, K = N = 384: 807 vs 795 us for the eager fp32 step, whose
// kernels take 100 us longer). Calls through the dispatcher (torch.compile, modes, the fastdl::fused_linear op) keep
// the op's Python autograd registration, which reaches this kernel with grad mode off (no graph is recorded here).
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd_ops.h"

namespace fastdl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor &, const at::Tensor &,
                                                      const std::optional<at::Tensor> &, c10::string_view,
                                                      const std::optional<at::Tensor> &, bool);

const c10::TypedOperatorHandle<ForwardSig> &forward_op() {
    static const auto op = find_cpp_op<ForwardSig>("fastdl_cpp::fused_linear");
    return op;
}

struct FusedLinearFunction : public torch::autograd::Function<FusedLinearFunction> {
    static variable_list forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                                 const std::optional<at::Tensor> &bias, c10::string_view activation,
                                 const std::optional<at::Tensor> &residual, bool save_preact) {
        at::AutoDispatchBelowADInplaceOrView below; // the device kernel, not this one again
        auto [out, preact] = forward_op().call(x, weight, bias, activation, residual, save_preact);
        const std::string act(activation.data(), activation.size());
        ctx->saved_data["activation"] = act;
        ctx->saved_data["has_preact"] = save_preact && act != "none";
        // edges: x 0, weight 1, then bias and residual where given
        ctx->saved_data["bias_edge"] = is_given(bias) ? int64_t{2} : int64_t{-1};
        ctx->saved_data["bias_dtype"] = is_given(bias) ? bias->scalar_type() : at::kFloat;
        ctx->saved_data["residual_edge"] = is_given(residual) ? int64_t{is_given(bias) ? 3 : 2} : int64_t{-1};
        ctx->saved_data["residual_dtype"] = is_given(residual) ? residual->scalar_type() : at::kFloat;
        ctx->save_for_backward({x, weight, preact});
        keep_input(ctx, "bias", bias); // for a create_graph backward (grads_with_graph)
        keep_input(ctx, "residual", residual);
        // preact is an internal output nobody differentiates: no zero gradient is filled for it on every backward
        ctx->mark_non_differentiable({preact});
        ctx->set_materialize_grads(false);
        return {out, preact};
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        variable_list result(6); // one per argument of forward (undefined: no gradient)
        const at::Tensor &grad_out = grads[0];
        if (!grad_out.defined()) // the output itself took no part in the loss
            return result;
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &x = saved[0], &weight = saved[1], &preact = saved[2];
        const std::string act = ctx->saved_data["activation"].toStringRef();
        const int64_t bias_edge = ctx->saved_data["bias_edge"].toInt();
        const int64_t res_edge = ctx->saved_data["residual_edge"].toInt();
        const bool need_x = ctx->needs_input_grad(0), need_w = ctx->needs_input_grad(1);
        const bool need_b = bias_edge >= 0 && ctx->needs_input_grad(static_cast<size_t>(bias_edge));
        const bool need_r = res_edge >= 0 && ctx->needs_input_grad(static_cast<size_t>(res_edge));
        if (at::GradMode::is_enabled()) { // create_graph=True: gradients with a graph (autograd_ops.h)
            const auto bias = kept_input(ctx, "bias", "fused_linear");
            const auto residual = kept_input(ctx, "residual", "fused_linear");
            grads_with_graph("fastdl::fused_linear", {x, weight, bias, act, residual, true}, grad_out,
                             {{0, need_x, x}, {1, need_w, weight}, {2, need_b, bias}, {4, need_r, residual}}, result);
            return result;
        }
        if (need_x || need_w || need_b) {
            TORCH_CHECK(act == "none" || ctx->saved_data["has_preact"].toBool(),
                        "fused_linear: gradients were requested but the op ran with save_preact=False; "
                        "call fastdl.ops.fused_linear (which sets it) or pass save_preact=True");
            linear_grads(result, grad_out, x, weight, preact, act, need_x, need_w, need_b,
                         ctx->saved_data["bias_dtype"].toScalarType());
        }
        if (need_r)
            result[4] = grad_out.to(ctx->saved_data["residual_dtype"].toScalarType());
        return result;
    }
};

std::tuple<at::Tensor, at::Tensor> fused_linear_autograd(const at::Tensor &x, const at::Tensor &weight,
                                                         const std::optional<at::Tensor> &bias,
                                                         c10::string_view activation,
                                                         const std::optional<at::Tensor> &residual, bool save_preact) {
    if (!records_graph(x, weight, bias, residual)) {
        at::AutoDispatchBelowADInplaceOrView below;
        return forward_op().call(x, weight, bias, activation, residual, save_preact);
    }
    const variable_list r = FusedLinearFunction::apply(x, weight, bias, activation, residual, save_preact);
    return {r[0], r[1]};
}

} // namespace
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, Autograd, m) {
    m.impl("fused_linear", &fastdl::fused_linear_autograd);
}
