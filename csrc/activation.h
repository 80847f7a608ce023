// The activations of fused_linear, defined once for C++ and CUDA (Python: ACTIVATIONS in fastdl/ops/fused_linear.py,
// in the same order: the position is the code the Triton kernels take). Header-only, no torch includes, usable from
// host and device code.
#pragma once

#include <string_view>

namespace fastdl {

// X(enumerator, name as the ops take it)
#define FASTDL_ACTIVATIONS(X)                                                                                          \
    X(None, "none")                                                                                                    \
    X(Relu, "relu")                                                                                                    \
    X(Gelu, "gelu")                                                                                                    \
    X(GeluTanh, "gelu_tanh")                                                                                           \
    X(Silu, "silu")

#define FASTDL_ACT_ENUMERATOR(e, name) e,
enum class Act : int { FASTDL_ACTIVATIONS(FASTDL_ACT_ENUMERATOR) };
#undef FASTDL_ACT_ENUMERATOR

// The names as an error message lists them: 'none', 'relu', ... (the last ", " cut)
#define FASTDL_ACT_QUOTED(e, name) "'" name "', "
inline constexpr std::string_view kActivationList = std::string_view(FASTDL_ACTIVATIONS(FASTDL_ACT_QUOTED))
                                                        .substr(0, sizeof(FASTDL_ACTIVATIONS(FASTDL_ACT_QUOTED)) - 3);
#undef FASTDL_ACT_QUOTED

// The activation called `name`; false when there is none (the caller raises its argument error).
inline bool activation_from_name(std::string_view name, Act *act) {
#define FASTDL_ACT_MATCH(e, n)                                                                                         \
    if (name == n) {                                                                                                   \
        *act = Act::e;                                                                                                 \
        return true;                                                                                                   \
    }
    FASTDL_ACTIVATIONS(FASTDL_ACT_MATCH)
#undef FASTDL_ACT_MATCH
    return false;
}

} // namespace fastdl
