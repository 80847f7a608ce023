// The kernel-side code (cpu::DType, cpu_isa.h) of a floating ATen dtype, for the ATen glue files (int8.cpp,
// sparse24.cpp); the kernel headers include no torch.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "cpu_isa.h"

namespace fastdl {

// F32 / BF16 / F16 for float32 / bfloat16 / float16; nullopt for any other dtype (the caller decides).
inline std::optional<cpu::DType> floating_dtype(at::ScalarType t) {
    using D = cpu::DType;
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
