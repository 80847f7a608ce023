// The CPU kernels' view of the activation list, which is defined once for C++ and CUDA in csrc/activation.h: the enum
// the kernels switch on, the lookup by name and the names for error messages. No torch headers: the SIMD translation
// units include this through fused_linear_kernels.h.
#pragma once

#include <string>
#include <string_view>

#include "activation.h"

namespace fastdl {
namespace fused_linear {

using Act = ::fastdl::Act;

// The activation called `name`; false if there is none.
inline bool find_activation(std::string_view name, Act &out) {
    return activation_from_name(name, &out);
}

// "'none', 'relu', 'gelu', 'gelu_tanh', 'silu'" for error messages.
inline std::string activation_names() {
    return std::string(kActivationList);
}

} // namespace fused_linear
} // namespace fastdl
