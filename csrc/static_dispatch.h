// Run-time values as template arguments, for the kernel files (C++ and CUDA host code; no torch headers). Their
// kernels are templates over a tile's rows / vectors (register arrays need compile-time sizes), an activation or a
// flag, while the drivers know the value only at run time: with_count and with_flag replace the switch (or ?: chain,
// or if / else) that picked the instantiation at each such place.
#pragma once

#include <type_traits>

namespace fastdl {

// f(std::integral_constant<int, c>()) with c = n clamped to [Lo, Hi], and what it returns. One compare per candidate:
// for the per-tile, per-panel or per-launch choices it is used for (not per element), as cheap as a switch.
template <int Lo, int Hi, class F> inline decltype(auto) with_count(int n, F &&f) {
    static_assert(Lo <= Hi, "with_count: empty range");
    if constexpr (Lo == Hi) {
        return f(std::integral_constant<int, Lo>());
    } else {
        if (n <= Lo)
            return f(std::integral_constant<int, Lo>());
        return with_count<Lo + 1, Hi>(n, static_cast<F &&>(f));
    }
}

// f(std::true_type()) or f(std::false_type()), and what it returns.
template <class F> inline decltype(auto) with_flag(bool b, F &&f) {
    if (b)
        return f(std::true_type());
    return f(std::false_type());
}

} // namespace fastdl
