// 2:4 sparsity, CPU: ATen glue for fastdl_cpp::{mask_2_4, compress_2_4, decompress_2_4, sparse24_linear,
// sparse24_linear_backward}.
// Checks arguments, makes inputs contiguous, allocates outputs and splits the work between threads with
// at::parallel_for; the kernels of this process's instruction-set family (kernels(): sparse24_avx512.cpp,
// sparse24_avx2.cpp, sparse24_scalar.cpp; no torch headers) run on row ranges. The schemas are defined in Python
// (fastdl/ops/sparse24.py), which documents the semantics and the meta layout.
#include "sparse24_kernels.h"

#include "aten_dtype.h"
#include "checked_math.h"
#include "cpu_isa.h"
#include "fused_linear_api.h"
#include "parallel.h"
#include "route_env.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fastdl {
namespace sparse24 {

// ================================================================================================== dispatch
// The family of this process, from the one CPU-capability module (cpu_isa.h: cpuid + XGETBV, capped by
// FASTDL_CPU_ISA). The AVX512-BF16 kernels also need AVX512_VBMI2 (vpexpandw); a non-x86 build has only the portable
// family.
const Kernels &kernels() {
    static const Kernels &k = []() -> const Kernels & {
#ifdef FASTDL_SP24_X86
        const cpu::Level level = cpu::level();
        if (level >= cpu::kAvx512Bf16 && cpu::features().avx512_vbmi2)
            return *kernels_avx512_bf16();
        if (level >= cpu::kAvx512)
            return *kernels_avx512();
        if (level >= cpu::kAvx2)
            return *kernels_avx2();
#endif
        return *kernels_scalar();
    }();
    return k;
}

} // namespace sparse24
} // namespace fastdl

// The family of this process, for `fastdl info` (csrc/module.cpp).
const char *fastdl_sparse24_cpu_kernels() {
    return fastdl::sparse24::kernels().name;
}

namespace fastdl {
namespace sparse24 {

namespace {

DType weight_dtype(const at::Tensor &t, const char *op, const char *name) {
    const std::optional<DType> d = floating_dtype(t.scalar_type());
    TORCH_CHECK_VALUE(d.has_value(), op, ": ", name,
                      " must be a floating tensor: float32, bfloat16 or float16 on the CPU, got ", t.scalar_type());
    return *d;
}

void check_weight(const at::Tensor &w, const char *op) {
    TORCH_CHECK(w.device().is_cpu(), op, ": w must be a CPU tensor, got ", w.device());
    TORCH_CHECK_VALUE(w.dim() == 2, op, ": w must be 2-D [N, K], got shape ", w.sizes());
    TORCH_CHECK_VALUE(w.size(1) % 4 == 0, op, ": K = w.shape[1] = ", w.size(1),
                      " is not a multiple of 4 (2:4 sparsity groups 4 consecutive elements along K)");
}

// ceil(K / 8) without overflow (K of an expanded values tensor can be near 2^63).
int64_t meta_cols(int64_t K) {
    return K / 8 + (K % 8 != 0);
}

// Returns K. values may be an expanded view whose values.shape[1] is near 2^62: K = 2 * values.shape[1] is checked.
int64_t check_compressed(const at::Tensor &values, const at::Tensor &meta, const char *op) {
    TORCH_CHECK(values.device().is_cpu() && meta.device().is_cpu(), op, ": values and meta must be CPU tensors");
    TORCH_CHECK_VALUE(values.dim() == 2, op, ": values must be 2-D [N, K/2], got shape ", values.sizes());
    TORCH_CHECK_VALUE(values.size(1) % 2 == 0, op, ": values.shape[1] = ", values.size(1),
                      " must be K/2 with K a multiple of 4 (so it must be even)");
    TORCH_CHECK_TYPE(meta.scalar_type() == at::kByte, op, ": meta must be torch.uint8, got ", meta.scalar_type());
    const int64_t N = values.size(0), K = checked_mul(2, values.size(1), op, "K = 2 * values.shape[1]");
    TORCH_CHECK_VALUE(meta.dim() == 2 && meta.size(0) == N && meta.size(1) == meta_cols(K), op,
                      ": meta must have shape [N, ceil(K/8)] = [", N, ", ", meta_cols(K), "] for K = ", K, ", got ",
                      meta.sizes());
    return K;
}

// Threads over [0, n) (parallel.h).
template <class F> void parallel_range(int64_t n, int64_t grain, const F &f) {
    parallel_for(0, n, grain, f);
}

// Rows per parallel task so that each task touches ~64K elements.
int64_t row_grain(int64_t K) {
    return std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1));
}

// -------------------------------------------------------------------------------------------- meta validation
// Every op that reads meta rejects invalid 2:4 meta (detail::meta_rows_ok: exactly 2 bits in every 4-bit group, 0 in
// the unused high nibble of a row's last byte when K % 8 == 4; the reference, fastdl/ops/sparse24.py, applies the
// same rule). The kernels check it as they first read each block of weight rows (sparse24_kernels.h) and return
// false; the ops then raise with raise_bad_meta, which finds the first bad byte by a slow scan (error path only).
// Where no kernel reads meta (sparse24_linear on an empty x, the backward asked only for grad_bias), check_meta
// passes over all of it.

// Whether meta rows [r0, r1) (contiguous, ceil(K/8) bytes a row) are valid 2:4 meta (portable SWAR).
bool meta_rows_valid(const uint8_t *meta, int64_t K, int64_t r0, int64_t r1) {
    return detail::meta_rows_ok(meta + r0 * meta_cols(K), K, r1 - r0, detail::meta_bytes_ok);
}

// ValueError naming the first invalid group of meta (contiguous [N, ceil(K/8)]); a kernel reported one.
[[noreturn]] void raise_bad_meta(const at::Tensor &meta, int64_t N, int64_t K, const char *op) {
    const uint8_t *mp = meta.data_ptr<uint8_t>();
    const int64_t mb = meta_cols(K), G = K / 4;
    for (int64_t r = 0; r < N; ++r)
        for (int64_t j = 0; j < mb; ++j) {
            const int byte = mp[r * mb + j];
            for (int h = 0; h < 2; ++h) {
                const int64_t g = 2 * j + h;
                const int nib = (byte >> (4 * h)) & 15;
                const bool valid = g < G ? __builtin_popcount(nib) == 2 : nib == 0;
                TORCH_CHECK_VALUE(valid, op,
                                  ": meta must have exactly 2 bits set in every 4-bit group (the kept positions of "
                                  "4 weights; nibble 0x3, 0x5, 0x6, 0x9, 0xA or 0xC) and 0 in the unused high "
                                  "nibble of a row's last byte when K % 8 == 4 (use meta from compress_2_4); got "
                                  "meta[",
                                  r, ", ", j, "] = ", byte, " (",
                                  g < G ? "group " + std::to_string(g) : std::string("unused nibble"), " of row ", r,
                                  ": ", nib, ")");
            }
        }
    TORCH_CHECK(false, op, ": internal error: a kernel reported invalid meta, but every byte is valid");
}

// ValueError naming the first invalid group of meta (contiguous [N, ceil(K/8)]), or nothing when it is valid: one
// pass over all of meta, for the calls where no kernel reads it.
void check_meta(const at::Tensor &meta, int64_t N, int64_t K, const char *op) {
    if (N == 0 || K == 0)
        return;
    const uint8_t *mp = meta.data_ptr<uint8_t>();
    std::atomic<bool> ok{true};
    // threads from 256 KiB of meta each (a 4096 x 4096 layer's 2 MB: 8 tasks)
    parallel_range(N, std::max<int64_t>(1, (int64_t{256} << 10) / meta_cols(K)), [&](int64_t r0, int64_t r1) {
        if (!meta_rows_valid(mp, K, r0, r1))
            ok = false;
    });
    if (!ok.load())
        raise_bad_meta(meta, N, K, op);
}

at::Tensor mask_2_4(const at::Tensor &w_in) {
    check_weight(w_in, "mask_2_4");
    const DType dt = weight_dtype(w_in, "mask_2_4", "w");
    const at::Tensor w = w_in.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    at::Tensor mask = at::empty({N, K}, w.options().dtype(at::kBool));
    if (N == 0 || K == 0)
        return mask;
    const RowKernels &rk = kernels().rows;
    bool *mp = mask.data_ptr<bool>();
    const void *wp = w.data_ptr();
    parallel_range(N, row_grain(K),
                   [&](int64_t r0, int64_t r1) { compress_rows(rk, dt, wp, K, K, r0, r1, nullptr, nullptr, mp); });
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
    const RowKernels &rk = kernels().rows;
    void *vp = values.data_ptr();
    uint8_t *mp = meta.data_ptr<uint8_t>();
    const void *wp = w.data_ptr();
    parallel_range(N, row_grain(K),
                   [&](int64_t r0, int64_t r1) { compress_rows(rk, dt, wp, K, K, r0, r1, vp, mp, nullptr); });
    return {values, meta};
}

// decompress_2_4, its errors naming op (the backward's grad_x calls it too). The row kernels check meta.
at::Tensor decompress_impl(const at::Tensor &values_in, const at::Tensor &meta_in, const char *op) {
    const int64_t K = check_compressed(values_in, meta_in, op), N = values_in.size(0);
    const DType dt = weight_dtype(values_in, op, "values");
    at::Tensor out = at::empty({N, K}, values_in.options());
    if (N == 0 || K == 0)
        return out;
    const at::Tensor values = values_in.contiguous(), meta = meta_in.contiguous();
    const RowKernels &rk = kernels().rows;
    const void *vp = values.data_ptr();
    const uint8_t *mp = meta.data_ptr<uint8_t>();
    void *outp = out.data_ptr();
    std::atomic<bool> bad{false};
    parallel_range(N, row_grain(K), [&](int64_t r0, int64_t r1) {
        if (!decompress_rows(rk, dt, vp, mp, K, r0, r1, outp))
            bad.store(true, std::memory_order_relaxed);
    });
    if (bad.load())
        raise_bad_meta(meta, N, K, op);
    return out;
}

at::Tensor decompress_2_4(const at::Tensor &values_in, const at::Tensor &meta_in) {
    return decompress_impl(values_in, meta_in, "decompress_2_4");
}

// ------------------------------------------------------------------------------------------- dense route
// (Before it, on the AVX-512 families: fused_linear's fp32 pb kernel with the weight decompressed per chunk of panels
// while packed, from fused_linear::held_pb_min_rows rows on, K % 16 == 0; its numbers are there. It is taken first
// where both apply.)
// From dense_route_min_rows(...) rows of x on, sparse24_linear decompresses the weight in blocks of rows (4 MiB of it
// in fp32, 8 MiB in bf16, or one row if a row is larger: a bounded workspace, freed with the call; never a kept copy)
// and multiplies each block with fused_linear's CPU forward (fused_linear_api.h: oneDNN where it wins, fastdl's
// kernels elsewhere). The decompression is paid on every call (the op keeps no state), so the route only pays where the
// sparse kernel is much slower than a tuned dense GEMM. Measured (AMD EPYC Zen 4, 2 threads, medians of alternating
// calls, ms: sparse kernel / dense GEMM on a kept dense copy (Sparse24Linear's former cached path) / this route):
//  * avx512 / avx512_bf16 from 128 rows, weights of 8M elements and more (the pair kernels do half the dense
//    multiply-adds but run well below the FMA peak): TinyLlama 5632 -> 2048 M = 256 fp32 46.8 / 29.8 / 36.8, bf16
//    23.1 / 15.1 / 18.1; 2048 -> 5632 M = 256 fp32 35.7 / 29.7 / 32.7, bf16 19.7 / 15.1 / 17.5 (the per-call
//    decompression costs 10-20 % of the GEMM; kept: 2048 x 2048, 12.8 / 11.3 / 14.7). At M = 16 the sparse kernel is
//    0.9-1.46x the kept copy and stays.
//  * scalar (portable kernels; also what a non-x86 CPU runs): from 1 row (the per-call decompression is a fraction
//    of the scalar kernel's time).
//  * avx2 (capped, fp32 x with bf16 values / bf16 x): M = 512: 716-813 (sparse) / 716 (F.linear fp32): never (the
//    broadcast kernel runs the dense GEMM's multiply-adds at ~84% of the FMA peak and reads half the weight).
//  * the block: fp32 4 MiB (16 and 32 MiB were no faster); bf16 8 MiB (1024 rows at K = 4096): fused_linear's bf16
//    kernels pack x^T once per call, and 4 MiB blocks cost 4096 x 4096 M = 128 12.2-12.9 ms against 11.3-11.6 (dense
//    bf16 F.linear 10.9-11.6); the TinyLlama shapes and M = 256 did not move (two alternating runs each).
// Each family's Kernels::dense_min_rows / dense_min_weight hold these numbers. FASTDL_SPARSE24_DENSE_ROWS=<rows>
// overrides them (read once per process: the tests run both routes at every level, and benchmarks measure the
// crossover with it).
int64_t dense_route_min_rows(const Kernels &kr, int64_t N, int64_t K) {
    static const int64_t forced = rows_or_env("FASTDL_SPARSE24_DENSE_ROWS", 0);
    if (forced)
        return forced;
    return N * K >= kr.dense_min_weight ? kr.dense_min_rows : INT64_MAX;
}

// out = x @ decompress(values, meta).T + bias, the weight decompressed in blocks of rows (4 MiB fp32 / 8 MiB bf16, or
// one row) and each block multiplied by fused_linear's forward (fp32 accumulation, bias in its epilogue, one rounding).
at::Tensor dense_route(const Kernels &kr, const at::Tensor &x, const at::Tensor &values_in, const at::Tensor &meta_in,
                       const at::Tensor &bias, at::Tensor &out) {
    // W is rounded to x's dtype (the contract): fp32 values for bf16 x become bf16 first
    const bool bf16 = x.scalar_type() == at::kBFloat16;
    const at::Tensor values = (bf16 ? values_in.to(at::kBFloat16) : values_in).contiguous();
    const at::Tensor meta = meta_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = values.size(0);
    const DType vdt = values.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
    const int64_t es = bf16 ? 2 : 4;
    const int64_t nb = std::max<int64_t>(1, std::min<int64_t>(N, (int64_t(bf16 ? 8 : 4) << 20) / (es * K)));
    at::Tensor wblock = at::empty({std::min(nb, N), K}, x.options());
    const at::Tensor res = out.view({M, N});
    const void *vp = values.data_ptr();
    const uint8_t *mp = meta.data_ptr<uint8_t>();
    const int64_t vstride = (K / 2) * static_cast<int64_t>(values.element_size());
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
        const int64_t rows = std::min(nb, N - n0);
        const void *vb = static_cast<const char *>(vp) + n0 * vstride;
        const uint8_t *mb = mp + n0 * ((K + 7) / 8);
        void *wp = wblock.data_ptr();
        std::atomic<bool> bad{false};
        parallel_range(rows, row_grain(K), [&](int64_t r0, int64_t r1) {
            const bool ok = bf16 ? decompress_rows(kr.rows, vdt, vb, mb, K, r0, r1, wp)
                                 : kr.decompress_rows_f32(vdt, vb, mb, K, r0, r1, static_cast<float *>(wp));
            if (!ok)
                bad.store(true, std::memory_order_relaxed);
        });
        if (bad.load())
            raise_bad_meta(meta, N, K, "sparse24_linear");
        std::optional<at::Tensor> b;
        if (bias.defined())
            b = bias.narrow(0, n0, rows);
        res.narrow(1, n0, rows).copy_(fused_linear::linear_forward(x, wblock.narrow(0, 0, rows), b));
    }
    return out;
}

at::Tensor sparse24_linear(const at::Tensor &x_in, const at::Tensor &values_in, const at::Tensor &meta_in,
                           const std::optional<at::Tensor> &bias_in) {
    const int64_t K = check_compressed(values_in, meta_in, "sparse24_linear"), N = values_in.size(0);
    TORCH_CHECK(x_in.device().is_cpu(), "sparse24_linear: x must be a CPU tensor, got ", x_in.device());
    TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
                "sparse24_linear: the CPU kernel takes x of dtype float32 or bfloat16, got ", x_in.scalar_type());
    TORCH_CHECK(values_in.scalar_type() == at::kFloat || values_in.scalar_type() == at::kBFloat16,
                "sparse24_linear: the CPU kernel takes values of dtype float32 or bfloat16, got ",
                values_in.scalar_type());
    TORCH_CHECK_VALUE(x_in.dim() >= 1, "sparse24_linear: x must have at least 1 dimension [..., K], got a 0-D tensor");
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
    const at::Tensor meta = meta_in.contiguous();
    at::Tensor out = at::empty(out_shape, x_in.options());
    const int64_t M = x_in.numel() / std::max<int64_t>(K, 1);
    if (out.numel() == 0) { // no kernel reads meta: checked anyway, as the reference (one answer on every backend)
        check_meta(meta, N, K, "sparse24_linear");
        return out;
    }
    if (K == 0) { // nothing to accumulate: only the bias remains
        if (bias.defined())
            out.copy_(bias.expand(out_shape));
        else
            out.zero_();
        return out;
    }
    const at::Tensor x = x_in.reshape({M, K}).contiguous();
    const Kernels &kr = kernels();
    // the AVX-512 families from held_pb_min_rows rows (the numbers there): fused_linear's fp32 pb kernel with the
    // weight decompressed per chunk of panels while packed (meta checked first, as the kernels do)
    const auto held =
        x.scalar_type() == at::kBFloat16 ? fused_linear::Held::Sparse24Bf16x : fused_linear::Held::Sparse24;
    if (K % 16 == 0 && M >= fused_linear::held_pb_min_rows(held)) {
        if (!meta_rows_valid(meta.data_ptr<uint8_t>(), K, 0, N))
            raise_bad_meta(meta, N, K, "sparse24_linear");
        if (fused_linear::sparse24_pb_linear(x, values_in.contiguous(), meta, bias, out.view({M, N})))
            return out;
    }
    if (M >= dense_route_min_rows(kr, N, K))
        return dense_route(kr, x, values_in, meta, bias, out);
    LinearArgs a;
    a.dt = x.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
    a.vdt = values_in.scalar_type() == at::kFloat ? DType::F32 : DType::BF16;
    // A family that does not read this (x, values) dtype pair directly gets the values in x's dtype: fp32 values for
    // bf16 x are rounded to bf16 (the contract; a copy per call: store the values in x's dtype to avoid it). bf16
    // values for fp32 x are read directly by every family (widened in registers).
    const LinearKernel *lk = &kr.linear[a.dt == DType::BF16][a.vdt == DType::BF16];
    if (!lk->rows) {
        a.vdt = a.dt;
        lk = &kr.linear[a.dt == DType::BF16][a.dt == DType::BF16];
    }
    const at::Tensor values = (a.vdt == a.dt ? values_in.to(x.scalar_type()) : values_in).contiguous();
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
    at::Tensor xf; // x widened to fp32 once, for kernels that read it many times (shared by the threads)
    if (lk->wants_f32_x && lk->wants_f32_x(a)) {
        xf = x.to(at::kFloat);
        a.xf = xf.data_ptr<float>();
        a.ldxf = K;
    }
    const int64_t split = lk->split;
    const int64_t blocks = (N + split - 1) / split;
    std::atomic<bool> bad{false}; // a kernel met invalid meta (it checks each block of weight rows as it reads them)
    parallel_range(blocks, 1, [&](int64_t b0, int64_t b1) {
        if (!lk->rows(a, b0 * split, std::min(N, b1 * split)))
            bad.store(true, std::memory_order_relaxed);
    });
    if (bad.load())
        raise_bad_meta(meta, N, K, "sparse24_linear");
    return out;
}

// ------------------------------------------------------------------------------------------- backward
// The gradient of the values is the dense weight gradient (g^T x, fp32) at the kept positions: rows [r0, r1) of
// dense [N, K] gathered into out [N, K/2] in the order of the values (detail::kept_positions, as decompress_rows
// reads them). Returns false at a row whose meta is invalid.
bool gather_kept_rows(const float *dense, const uint8_t *meta, int64_t K, int64_t r0, int64_t r1, float *out) {
    const int64_t mb = (K + 7) / 8, half = K / 2;
    for (int64_t r = r0; r < r1; ++r) {
        const float *d = dense + r * K;
        const uint8_t *m = meta + r * mb;
        float *o = out + r * half;
        if (!meta_rows_valid(meta, K, r, r + 1))
            return false;
        for (int64_t g = 0; g < K / 4; ++g) {
            const int nib = detail::meta_nibble(m, g);
            int p0, p1;
            detail::kept_positions(nib, p0, p1);
            o[2 * g] = d[4 * g + p0];
            o[2 * g + 1] = d[4 * g + p1];
        }
    }
    return true;
}

// sparse24_linear's backward in one call, with the formulas of the reference (fastdl/ops/sparse24.py,
// _backward_reference): grad_x = g @ W (W = decompress(values, meta) in x's dtype), grad_values = (g^T x in fp32) at
// the kept positions, grad_bias = the fp32 sum of g over rows. From Python these were ~10 ATen calls and two op calls
// per backward: a trainable Sparse24Linear step at M = 1, K = N = 64 (+ gelu) took 2.0x the time of nn.Linear + gelu
// on an AMD EPYC Zen 2 (AVX2), above the 1.5x bar of `fastdl bench overhead`; see that benchmark for the figure now.
std::tuple<at::Tensor, at::Tensor, at::Tensor>
sparse24_linear_backward(const at::Tensor &grad_out, const at::Tensor &x_in, const at::Tensor &values_in,
                         const at::Tensor &meta_in, std::array<bool, 3> output_mask) {
    constexpr const char *op = "sparse24_linear_backward";
    const int64_t K = check_compressed(values_in, meta_in, op), N = values_in.size(0);
    TORCH_CHECK(x_in.device().is_cpu() && grad_out.device().is_cpu(), op, ": x and grad_out must be CPU tensors");
    TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, op,
                ": the CPU kernel takes x of dtype float32 or bfloat16, got ", x_in.scalar_type());
    TORCH_CHECK(values_in.scalar_type() == at::kFloat || values_in.scalar_type() == at::kBFloat16, op,
                ": the CPU kernel takes values of dtype float32 or bfloat16, got ", values_in.scalar_type());
    TORCH_CHECK(at::isFloatingType(grad_out.scalar_type()), op, ": grad_out must be a floating tensor, got ",
                grad_out.scalar_type());
    TORCH_CHECK_VALUE(x_in.dim() >= 1 && x_in.size(-1) == K, op, ": x.shape[-1] must equal K = ", K, ", got shape ",
                      x_in.sizes());
    std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
    out_shape.back() = N;
    TORCH_CHECK_VALUE(grad_out.sizes() == at::IntArrayRef(out_shape), op, ": grad_out must have shape ",
                      at::IntArrayRef(out_shape), ", got ", grad_out.sizes());
    int64_t M = 1; // the rows of x: a product of sizes of x, which exists (an expanded x's too: numel fits int64)
    for (int64_t d = 0; d + 1 < x_in.dim(); ++d)
        M *= x_in.size(d);
    if (!output_mask[0] && !output_mask[1]) // no kernel reads meta: checked anyway, as the reference
        check_meta(meta_in.contiguous(), N, K, op);
    const at::Tensor g = grad_out.reshape({M, N});
    at::Tensor gx = at::empty({0}, x_in.options()), gv = at::empty({0}, values_in.options());
    at::Tensor gb = at::empty({0}, x_in.options().dtype(at::kFloat));
    if (output_mask[0]) {
        const at::Tensor w = decompress_impl(values_in, meta_in, op).to(x_in.scalar_type());
        gx = at::mm(g.to(x_in.scalar_type()), w).reshape(x_in.sizes());
    }
    if (output_mask[1]) {
        const at::Tensor dense = at::mm(g.t().to(at::kFloat), x_in.reshape({M, K}).to(at::kFloat)).contiguous();
        const at::Tensor meta = meta_in.contiguous();
        at::Tensor gvf = at::empty({N, K / 2}, dense.options());
        const float *dp = dense.data_ptr<float>();
        const uint8_t *mp = meta.data_ptr<uint8_t>();
        float *op_ = gvf.data_ptr<float>();
        std::atomic<bool> ok{true};
        parallel_range(N, row_grain(K), [&](int64_t r0, int64_t r1) {
            if (!gather_kept_rows(dp, mp, K, r0, r1, op_))
                ok = false;
        });
        if (!ok.load())
            raise_bad_meta(meta, N, K, op);
        gv = gvf.to(values_in.scalar_type());
    }
    if (output_mask[2])
        gb = g.to(at::kFloat).sum(0);
    return {gx, gv, gb};
}

} // namespace
} // namespace sparse24
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("mask_2_4", &fastdl::sparse24::mask_2_4);
    m.impl("compress_2_4", &fastdl::sparse24::compress_2_4);
    m.impl("decompress_2_4", &fastdl::sparse24::decompress_2_4);
    m.impl("sparse24_linear", &fastdl::sparse24::sparse24_linear);
    m.impl("sparse24_linear_backward", TORCH_FN(fastdl::sparse24::sparse24_linear_backward));
}
