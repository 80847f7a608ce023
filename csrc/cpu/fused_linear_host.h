// The ATen side of the fused linear layer, shared by its three glue files:
//   fused_linear.cpp           the ops' checks, the forward's route (which kernel family and path at which shape, with
//                              the numbers behind each rule), the oneDNN route and TORCH_LIBRARY_IMPL;
//   fused_linear_backward.cpp  the backward op: dpre / grad_bias pass, grad_x and grad_weight with their path rules;
//   fused_linear_drivers.cpp   the threaded drivers that cut a GEMM into tasks for at::parallel_for and call the SIMD
//                              kernels of the family (fused_linear_kernels.h), output allocation and scratch buffers.
// Torch headers allowed (glue only); the SIMD translation units do not include this file.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fused_linear_kernels.h"

namespace fastdl {
namespace fused_linear {

// ---- dtypes and operands

inline bool native_io(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16;
}
inline DType dtype_of(at::ScalarType t) {
    return t == at::kFloat ? DType::F32 : DType::BF16;
}

// t viewed as a contiguous [rows, cols] matrix in a dtype the kernels read natively (others are converted to fp32).
inline at::Tensor as_matrix(const at::Tensor &t, int64_t rows, int64_t cols) {
    at::Tensor m = t.reshape({rows, cols});
    if (!native_io(m.scalar_type()))
        m = m.to(at::kFloat);
    return m.contiguous();
}

// ---- checks (fused_linear.cpp)

// The checks and the shapes both entry points start with: the activation, x's rank and dtype, the weight against x;
// K, N, M = the rows of x's leading dimensions, and the output's shape [..., N].
struct Geometry {
    Act act;
    int64_t K, N, M;
    std::vector<int64_t> out_shape;
};
Geometry checked_geometry(const at::Tensor &x, const at::Tensor &weight, c10::string_view activation, const char *fn);
// The activation named s (ValueError naming fn and the list otherwise).
Act parse_activation(c10::string_view s, const char *fn);
// An optional operand (bias, residual, grad_out, preact): floating point, on x's device, of this shape.
void check_optional(const at::Tensor &t, const char *name, at::IntArrayRef shape, const at::Tensor &x, const char *fn);

// ---- memory (fused_linear_drivers.cpp)

// at::empty, with transparent huge pages advised and populated for multi-MB outputs (the reason at its definition).
at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions &opts);

// Scratch buffers kept per (thread, slot) and reused across calls: a fresh multi-MB buffer costs one page fault per
// 4 KB page on every call (the 11 MB packed operand of a 512 x 11008 GEMM: ~2.8K faults, ~2-3 ms; a 64 MB one: ~10 ms).
// Slot kSharedSlot holds buffers the calling thread shares with the team (packed GEMM operand, grad_bias partial sums),
// kTaskSlot per-task workspaces (including each thread's packed weight panels of the pb kernels: about one copy of the
// weight over all threads), kDpreSlot the backward's dpre. Requests above 64 MB are not kept (allocated per call).
// Memory is released at thread exit.
constexpr int kSharedSlot = 0, kTaskSlot = 1, kDpreSlot = 2;

struct Scratch {
    void *ptr = nullptr; // 64-byte aligned
    at::Tensor holder;   // defined only for buffers that are not kept
};
Scratch thread_scratch(int slot, size_t bytes);

// ---- threaded drivers (fused_linear_drivers.cpp)

// Epilogue over a full [M, N] fp32 accumulator, parallel over rows.
void run_epilogue(const Epilogue &e, const float *acc, int64_t M, int64_t N);
// C[M, N] = A[M, K] * B[K, N] with the bf16 GEMM, then the epilogue on C.
void run_gemm_bf16(const GemmOperand &a, const GemmOperand &b, int64_t M, int64_t N, int64_t K, const Epilogue &e);
// Packed-B GEMM (pb_* kernels) of A (a, lda, a_mode) [M, K] and B [K, N]: pack(p0, p1, bp) packs B's 48-column panels
// [p0, p1) into bp (called once per thread, for the panels that thread computes).
using PbPack = c10::function_ref<void(int64_t, int64_t, uint32_t *)>;
void run_pb(DType compute, const void *a, int64_t lda, PbA a_mode, int64_t M, int64_t N, int64_t K, PbPack pack,
            const Epilogue &e);
// fgemm (the AVX2 family; the AVX-512 F family's bf16 backward).
void run_fgemm(const FgemmArgs &g, const Epilogue &e);
// The forward of x2 [M, K] and w [N, K] with the pb kernels / the kernels reading the weight in place (fk) / ATen.
// round_w: an fp32 w rounded to bf16 while packed (F32 compute of a bf16 x, see PbKernels).
void forward_pb(DType compute, const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, int64_t K,
                const Epilogue &e, bool round_w = false);
void forward_kernels(const FwdKernel &fk, const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, int64_t K,
                     const Epilogue &e);
void forward_aten(const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, const Epilogue &e,
                  const at::Tensor &out, const at::Tensor &pre, const at::Tensor &b32);

// ---- the backward op (fused_linear_backward.cpp)

std::tuple<at::Tensor, at::Tensor, at::Tensor>
fused_linear_backward_cpu(const at::Tensor &grad_out, const at::Tensor &x, const at::Tensor &weight,
                          const at::Tensor &preact, c10::string_view activation, std::array<bool, 3> output_mask);

} // namespace fused_linear
} // namespace fastdl
