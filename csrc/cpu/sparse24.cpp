// 2:4 sparsity, CPU: ATen glue for fastdl_cpp::{mask_2_4, compress_2_4, decompress_2_4, sparse24_linear}.
// Checks arguments, makes inputs contiguous, allocates outputs and splits the work between threads with
// at::parallel_for; the SIMD kernels (sparse24_avx512.cpp, no torch headers) run on row ranges. The schemas are
// defined in Python (fastdl/ops/sparse24.py), which documents the semantics and the meta layout.
#include "sparse24_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace fastdl {
namespace sparse24 {
namespace {

DType weight_dtype(const at::Tensor &t, const char *op, const char *name) {
    switch (t.scalar_type()) {
    case at::kFloat:
        return DType::F32;
    case at::kBFloat16:
        return DType::BF16;
    case at::kHalf:
        return DType::F16;
    default:
        TORCH_CHECK_VALUE(false, op, ": ", name,
                          " must be a floating tensor: float32, bfloat16 or float16 on the CPU, got ", t.scalar_type());
    }
}

void check_weight(const at::Tensor &w, const char *op) {
    TORCH_CHECK(w.device().is_cpu(), op, ": w must be a CPU tensor, got ", w.device());
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": w must be 2-D [N, K], got shape ", w.sizes());
    TORCH_CHECK_VALUE(w.size(1) % 4 == 0, op, ": K = w.shape[1] = ", w.size(1),
                      " is not a multiple of 4 (2:4 sparsity groups 4 consecutive elements along K)");
}

void check_compressed(const at::Tensor &values, const at::Tensor &meta, const char *op) {
    TORCH_CHECK(values.device().is_cpu() && meta.device().is_cpu(), op, ": values and meta must be CPU tensors");
    TORCH_CHECK_VALUE(values.dim() == 2, op, ": values must be 2-D [N, K/2], got shape ", values.sizes());
    TORCH_CHECK_VALUE(values.size(1) % 2 == 0, op, ": values.shape[1] = ", values.size(1),
                      " must be K/2 with K a multiple of 4 (so it must be even)");
    TORCH_CHECK_VALUE(meta.scalar_type() == at::kByte, op, ": meta must be torch.uint8, got ", meta.scalar_type());
    const int64_t N = values.size(0), K = 2 * values.size(1);
    TORCH_CHECK_VALUE(meta.dim() == 2 && meta.size(0) == N && meta.size(1) == (K + 7) / 8, op,
                      ": meta must have shape [N, ceil(K/8)] = [", N, ", ", (K + 7) / 8, "] for K = ", K, ", got ",
                      meta.sizes());
}

// Threads over [0, n). With ATen's OpenMP backend at::parallel_for is inline code around `#pragma omp parallel`, so
// it runs serially in a translation unit compiled without -fopenmp: build with -fopenmp (compile and link). Without
// it, fall back to std::thread (one per torch thread). Measured: correct, but only ~1x-2x of one thread, since
// torch's OpenMP workers keep spinning on the cores for a while after each ATen op (with -fopenmp this kernel runs
// on those same workers: 2x faster at M = 1 and M = 16).
template <class F> void parallel_range(int64_t n, int64_t grain, const F &f) {
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
    const int64_t tasks = (n + grain - 1) / std::max<int64_t>(grain, 1);
    const int64_t nt = std::min<int64_t>(at::get_num_threads(), tasks);
    if (nt <= 1 || at::in_parallel_region()) {
        if (n > 0)
            f(0, n);
        return;
    }
    const int64_t chunk = (n + nt - 1) / nt;
    std::exception_ptr err;
    std::mutex mu;
    auto run = [&](int64_t t) {
        const int64_t b = t * chunk, e = std::min(n, b + chunk);
        if (b >= e)
            return;
        try {
            f(b, e);
        } catch (...) {
            std::lock_guard<std::mutex> lock(mu);
            if (!err)
                err = std::current_exception();
        }
    };
    std::vector<std::thread> threads;
    for (int64_t t = 1; t < nt; ++t)
        threads.emplace_back(run, t);
    run(0);
    for (auto &th : threads)
        th.join();
    if (err)
        std::rethrow_exception(err);
#else
    at::parallel_for(0, n, grain, f);
#endif
}

// Rows per parallel task so that each task touches ~64K elements.
int64_t row_grain(int64_t K) {
    return std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
}

at::Tensor mask_2_4(const at::Tensor &w_in) {
    check_weight(w_in, "mask_2_4");
    const DType dt = weight_dtype(w_in, "mask_2_4", "w");
    const at::Tensor w = w_in.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    at::Tensor mask = at::empty({N, K}, w.options().dtype(at::kBool));
    if (N == 0 || K == 0)
        return mask;
    const int level = active_level();
    bool *mp = mask.data_ptr<bool>();
    const void *wp = w.data_ptr();
    parallel_range(N, row_grain(K),
                   [&](int64_t r0, int64_t r1) { compress_rows(level, dt, wp, K, K, r0, r1, nullptr, nullptr, mp); });
    return mask;
}

std::tuple<at::Tensor, at::Tensor> compress_2_4(const at::Tensor &w_in) {
    check_weight(w_in, "compress_2_4");
    const DType dt = weight_dtype(w_in, "compress_2_4", "w");
    const at::Tensor w = w_in.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    at::Tensor values = at::empty({N, K / 2}, w.options());
    at::Tensor meta = at::empty({N, (K + 7) / 8}, w.options().dtype(at::kByte));
    if (N == 0 || K == 0)
        return {values, meta};
    const int level = active_level();
    void *vp = values.data_ptr();
    uint8_t *mp = meta.data_ptr<uint8_t>();
    const void *wp = w.data_ptr();
    parallel_range(N, row_grain(K),
                   [&](int64_t r0, int64_t r1) { compress_rows(level, dt, wp, K, K, r0, r1, vp, mp, nullptr); });
    return {values, meta};
}

at::Tensor decompress_2_4(const at::Tensor &values_in, const at::Tensor &meta_in) {
    check_compressed(values_in, meta_in, "decompress_2_4");
    const DType dt = weight_dtype(values_in, "decompress_2_4", "values");
    const at::Tensor values = values_in.contiguous(), meta = meta_in.contiguous();
    const int64_t N = values.size(0), K = 2 * values.size(1);
    at::Tensor out = at::empty({N, K}, values.options());
    if (N == 0 || K == 0)
        return out;
    const int level = active_level();
    const void *vp = values.data_ptr();
    const uint8_t *mp = meta.data_ptr<uint8_t>();
    void *op = out.data_ptr();
    parallel_range(N, row_grain(K), [&](int64_t r0, int64_t r1) { decompress_rows(level, dt, vp, mp, K, r0, r1, op); });
    return out;
}

at::Tensor sparse24_linear(const at::Tensor &x_in, const at::Tensor &values_in, const at::Tensor &meta_in,
                           const std::optional<at::Tensor> &bias_in) {
    check_compressed(values_in, meta_in, "sparse24_linear");
    TORCH_CHECK(x_in.device().is_cpu(), "sparse24_linear: x must be a CPU tensor, got ", x_in.device());
    TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
                "sparse24_linear: the CPU kernel takes x of dtype float32 or bfloat16, got ", x_in.scalar_type());
    TORCH_CHECK(values_in.scalar_type() == at::kFloat || values_in.scalar_type() == at::kBFloat16,
                "sparse24_linear: the CPU kernel takes values of dtype float32 or bfloat16, got ",
                values_in.scalar_type());
    TORCH_CHECK(x_in.dim() >= 1, "sparse24_linear: x must have at least 1 dimension [..., K]");
    const int64_t N = values_in.size(0), K = 2 * values_in.size(1);
    TORCH_CHECK_VALUE(x_in.size(-1) == K, "sparse24_linear: x.shape[-1] = ", x_in.size(-1),
                      " must equal K = 2 * values.shape[1] = ", K, " (mismatched K)");
    std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
    out_shape.back() = N;
    at::Tensor bias;
    if (bias_in.has_value() && bias_in->defined()) {
        TORCH_CHECK(bias_in->device().is_cpu(), "sparse24_linear: bias must be on x's device cpu, got ",
                    bias_in->device());
        TORCH_CHECK_VALUE(bias_in->dim() == 1 && bias_in->size(0) == N, "sparse24_linear: bias must have shape [N] = [",
                          N, "], got ", bias_in->sizes());
        TORCH_CHECK(at::isFloatingType(bias_in->scalar_type()), "sparse24_linear: bias must be a floating tensor, got ",
                    bias_in->scalar_type());
        bias = bias_in->to(at::kFloat).contiguous();
    }
    at::Tensor out = at::empty(out_shape, x_in.options());
    const int64_t M = x_in.numel() / std::max<int64_t>(K, 1);
    if (out.numel() == 0)
        return out;
    if (K == 0) { // nothing to accumulate: only the bias remains
        if (bias.defined())
            out.copy_(bias.expand(out_shape));
        else
            out.zero_();
        return out;
    }
    const at::Tensor x = x_in.reshape({M, K}).contiguous();
    // The kernel reads x and the values in one dtype: round fp32 values to bf16 x (as the contract says), or widen
    // bf16 values for fp32 x (exact). Storing the values in x's dtype avoids this pass.
    const at::Tensor values = values_in.to(x.scalar_type()).contiguous();
    const at::Tensor meta = meta_in.contiguous();

    LinearArgs a;
    a.dt = x.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
    a.x = x.data_ptr();
    a.ldx = K;
    a.M = M;
    a.K = K;
    a.values = values.data_ptr();
    a.meta = meta.data_ptr<uint8_t>();
    a.N = N;
    a.bias = bias.defined() ? bias.data_ptr<float>() : nullptr;
    a.out = out.data_ptr();
    a.ldo = N;
    const int level = active_level();
    const int64_t split = linear_split(level, a);
    const int64_t blocks = (N + split - 1) / split;
    parallel_range(blocks, 1,
                   [&](int64_t b0, int64_t b1) { linear_rows(level, a, b0 * split, std::min(N, b1 * split)); });
    return out;
}

} // namespace
} // namespace sparse24
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("mask_2_4", &fastdl::sparse24::mask_2_4);
    m.impl("compress_2_4", &fastdl::sparse24::compress_2_4);
    m.impl("decompress_2_4", &fastdl::sparse24::decompress_2_4);
    m.impl("sparse24_linear", &fastdl::sparse24::sparse24_linear);
}
