// The kernel-side code of a floating ATen dtype, for the ATen glue files (int8.cpp, sparse24.cpp): each capability's
// kernel header has its own DType enum (no torch includes there), each with F32, BF16 and F16.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace fastdl {

// D::F32 / D::BF16 / D::F16 for float32 / bfloat16 / float16; nullopt for any other dtype (the caller decides).
template <typename D> std::optional<D> floating_dtype(at::ScalarType t) {
    switch (t) {
    case at::kFloat:
        return D::F32;
    case at::kBFloat16:
        return D::BF16;
    case at::kHalf:
        return D::F16;
    default:
        return std::nullopt;
    }
}

} // namespace fastdl
