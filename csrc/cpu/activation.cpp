// CPU implementation of fastdl_cpp::activation / activation_backward (schemas in fastdl/ops/fused_linear.py): an
// activation of fused_linear's list applied on its own, out = round(act(x)), and its backward, grad_x =
// round(grad_out * act'(x)), both computed in fp32 and rounded once to x's dtype. The layers whose GEMM has no
// activation epilogue (Sparse24Linear's kernels) apply theirs with it. The work is fused_linear's: its epilogue and its
// backward's dpre pass, over x as an [M, N] matrix (N its last dimension), so both have the family's SIMD code.
// Why not ATen's: for every contiguous fp32 CPU tensor (and bf16 where oneDNN has it) at::gelu builds a oneDNN eltwise
// primitive, which dominates small calls: GELU on 64 floats 10-14 us forward, ~45 us forward + backward with
// autograd, against ~3 and ~20 us with oneDNN disabled (AMD EPYC Zen 4, 2 threads; fastdl bench overhead is the row).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>

#include "fused_linear_host.h"
#include "fused_linear_kernels.h"
#include "parallel.h"

namespace fastdl {
namespace fused_linear {

namespace {

void check_input(const at::Tensor &t, const char *name, const char *fn) {
    TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor here, got ", t.device());
    const auto st = t.scalar_type();
    TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, fn, ": ", name,
                     " must be float32, bfloat16 or float16 (float64 runs the reference), got ", st);
}

int64_t last_dim(const at::Tensor &t) {
    return t.dim() == 0 ? 1 : t.size(-1);
}

} // namespace

at::Tensor activation_cpu(const at::Tensor &x, c10::string_view activation) {
    constexpr const char *fn = "activation";
    const Act act = parse_activation(activation, fn);
    check_input(x, "x", fn);
    const auto c = x.scalar_type();
    const int64_t N = last_dim(x), M = N ? x.numel() / N : 0;
    if (x.numel() == 0 || act == Act::None)
        return x.clone(at::MemoryFormat::Contiguous);
    // the epilogue reads fp32 "accumulators" and writes fp32 or bf16 (fp16: written in fp32, rounded once after)
    const at::Tensor acc = x.to(at::kFloat).contiguous();
    at::Tensor out = at::empty(x.sizes(), x.options().dtype(c == at::kHalf ? at::kFloat : c));
    Epilogue e;
    e.out = out.data_ptr();
    e.ld_out = N;
    e.out_dtype = dtype_of(out.scalar_type());
    e.act = act;
    run_epilogue(e, acc.data_ptr<float>(), M, N);
    return c == at::kHalf ? out.to(c) : out;
}

at::Tensor activation_backward_cpu(const at::Tensor &grad_out, const at::Tensor &x, c10::string_view activation) {
    constexpr const char *fn = "activation_backward";
    const Act act = parse_activation(activation, fn);
    check_input(x, "x", fn);
    check_input(grad_out, "grad_out", fn);
    TORCH_CHECK_VALUE(grad_out.sizes() == x.sizes(), fn, ": grad_out must have x's shape ", x.sizes(), ", got ",
                      grad_out.sizes());
    const auto c = x.scalar_type();
    const int64_t N = last_dim(x), M = N ? x.numel() / N : 0;
    if (x.numel() == 0)
        return at::empty(x.sizes(), x.options());
    const at::Tensor g = as_matrix(grad_out, M, N), p = as_matrix(x, M, N);
    at::Tensor d = at::empty({M, N}, x.options().dtype(c == at::kHalf ? at::kFloat : c));
    DpreArgs a;
    a.g = g.data_ptr();
    a.ld_g = N;
    a.g_dtype = dtype_of(g.scalar_type());
    a.p = p.data_ptr();
    a.ld_p = N;
    a.p_dtype = dtype_of(p.scalar_type());
    a.act = act;
    a.dpre = d.data_ptr();
    a.ld_dpre = N;
    a.dpre_dtype = dtype_of(d.scalar_type());
    const Kernels &kr = kernels();
    const int64_t blocks = (M + kDpreRows - 1) / kDpreRows;
    // whole row blocks per task (the pass starts at multiples of kDpreRows), ~32K elements per task at least
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, kDpreRows * N));
    parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b)
            kr.dpre_pass(a, b * kDpreRows, std::min(M, (b + 1) * kDpreRows), 0, N, nullptr, 0);
    });
    return (c == at::kHalf ? d.to(c) : d).view(x.sizes());
}

} // namespace fused_linear
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("activation", TORCH_FN(fastdl::fused_linear::activation_cpu));
    m.impl("activation_backward", TORCH_FN(fastdl::fused_linear::activation_backward_cpu));
}
