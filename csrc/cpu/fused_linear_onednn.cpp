// The oneDNN route of the CPU fused linear (see fused_linear_onednn.h): calls PyTorch's mkldnn::_linear_pointwise
// through the dispatcher (looked up once; absent in a PyTorch built without oneDNN). Boxed calls: the op's C++
// signature has changed type aliases between PyTorch releases (string_view), the boxed form has not; the ~2 us this
// costs is nothing at the shapes the route serves (calls of 50 us and more).
#include "fused_linear_onednn.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace fastdl {
namespace fused_linear {
namespace {

struct OnednnOps {
    std::optional<c10::OperatorHandle> pointwise, binary;
    bool f32 = false, bf16 = false;
};

std::optional<c10::OperatorHandle> find_op(const char *name, const char *overload) {
    return c10::Dispatcher::singleton().findSchema({name, overload});
}

const OnednnOps &ops() {
    static const OnednnOps o = [] {
        OnednnOps r;
        r.pointwise = find_op("mkldnn::_linear_pointwise", "");
        r.binary = find_op("mkldnn::_linear_pointwise", "binary");
        if (!r.pointwise || !r.binary)
            return r;
        r.f32 = true;
        if (const auto probe = find_op("mkldnn::_is_mkldnn_bf16_supported", "")) {
            torch::jit::Stack st;
            probe->callBoxed(&st);
            r.bf16 = !st.empty() && st.back().isBool() && st.back().toBool();
        }
        return r;
    }();
    return o;
}

// oneDNN's post-op for each activation: (attr, algorithm) as _linear_pointwise names them.
void post_op(Act act, const char **attr, const char **algorithm) {
    *algorithm = nullptr;
    switch (act) {
    case Act::Relu:
        *attr = "relu";
        break;
    case Act::Gelu:
        *attr = "gelu";
        *algorithm = "none"; // the erf form
        break;
    case Act::GeluTanh:
        *attr = "gelu";
        *algorithm = "tanh";
        break;
    case Act::Silu:
        *attr = "swish";
        break;
    default:
        *attr = "none";
    }
}

} // namespace

bool onednn_available(at::ScalarType c) {
    const OnednnOps &o = ops();
    const bool dtype_ok = (c == at::kFloat && o.f32) || (c == at::kBFloat16 && o.bf16);
    if (!dtype_ok)
        return false;
    const char *env = std::getenv("FASTDL_CPU_ONEDNN");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

at::Tensor onednn_linear(const at::Tensor &x2, const at::Tensor &w, const std::optional<at::Tensor> &bias, Act act,
                         const at::Tensor &residual) {
    const OnednnOps &o = ops();
    TORCH_INTERNAL_ASSERT(o.pointwise && o.binary, "fused_linear: the oneDNN route is not available");
    TORCH_INTERNAL_ASSERT(!residual.defined() || act == Act::None, "fused_linear: oneDNN route: residual with act");
    const c10::IValue b = bias.has_value() && bias->defined() ? c10::IValue(*bias) : c10::IValue();
    torch::jit::Stack st;
    if (residual.defined()) {
        st = {x2, residual, w, b, std::string("add")};
        o.binary->callBoxed(&st);
    } else {
        const char *attr = nullptr, *algorithm = nullptr;
        post_op(act, &attr, &algorithm);
        c10::List<std::optional<c10::Scalar>> scalars;
        scalars.push_back(std::nullopt);
        st = {x2, w, b, std::string(attr), scalars, algorithm ? c10::IValue(std::string(algorithm)) : c10::IValue()};
        o.pointwise->callBoxed(&st);
    }
    return st.back().toTensor();
}

} // namespace fused_linear
} // namespace fastdl
