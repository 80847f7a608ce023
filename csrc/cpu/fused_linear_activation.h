// The activations of the fused linear layer, defined once for the C++ CPU code: the enum the kernels switch on and the
// names the op accepts (the same strings as fastdl/ops/fused_linear.py). No torch headers: the SIMD translation units
// include this through fused_linear_kernels.h.
#pragma once

#include <array>
#include <string>
#include <string_view>

namespace fastdl {
namespace fused_linear {

enum class Act : int { None = 0, Relu, Gelu, GeluTanh, Silu };

struct ActName {
    std::string_view name;
    Act act;
};

inline constexpr std::array<ActName, 5> kActivations{{
    {"none", Act::None},
    {"relu", Act::Relu},
    {"gelu", Act::Gelu},
    {"gelu_tanh", Act::GeluTanh},
    {"silu", Act::Silu},
}};

// The activation called `name`; false if there is none.
inline bool find_activation(std::string_view name, Act &out) {
    for (const ActName &a : kActivations)
        if (a.name == name) {
            out = a.act;
            return true;
        }
    return false;
}

// "'none', 'relu', 'gelu', 'gelu_tanh', 'silu'" for error messages.
inline std::string activation_names() {
    std::string s;
    for (const ActName &a : kActivations) {
        if (!s.empty())
            s += ", ";
        s += "'";
        s += a.name;
        s += "'";
    }
    return s;
}

} // namespace fused_linear
} // namespace fastdl
