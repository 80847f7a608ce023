// CPU implementation of fastdl_cpp::fused_linear / fused_linear_backward (schemas are defined in Python).
// This file holds the argument checks, the choice of kernel family (kernels(): one table per family, from the level of
// cpu_isa.h), the forward's route (forward_compute, the oneDNN route) and the registration of both ops; the threaded
// drivers (at::parallel_for, scratch buffers) are in fused_linear_drivers.cpp, the backward op in
// fused_linear_backward.cpp (both share fused_linear_host.h); the SIMD kernels live in fused_linear_avx512.cpp,
// fused_linear_avx2.cpp and fused_linear_scalar.cpp (no torch headers there).
//
// Paths (c = x.dtype, M = rows of x after flattening; the rules and their numbers are at fwd_bf16_pb & co. below):
//   AVX512_BF16 family, bf16: for M >= 48 with a weight not too large for M (narrow layers, large batches) the
//     packed-B kernel ("pb": each thread packs the weight panels it uses, x is broadcast from its rows in place, 8 x 48
//     tiles over the whole K, epilogue per 64 x 48 block); otherwise kernels reading the weight rows in place, never
//     packing or copying the weight (fp32 master weights are rounded to bf16 in registers or per 12-row tile, RNE like
//     autocast): inner products streaming the weight at small M (fwd_bf16_inner in fused_linear_avx512.cpp: M <= 12,
//     17-24, and more), else a broadcast kernel over x^T (packed once), within 1-2 % of the vdpbf16ps peak at full
//     lanes and faster than both the packed GEMM below and oneDNN.
//     Where the pb kernel would run with a weight of at most 4M elements (from M = 64), the oneDNN route instead
//     (fused_linear_onednn.h: PyTorch's oneDNN inner product with the activation as a post-op; rules at
//     fwd_bf16_onednn).
//   AVX-512 families, fp32: M <= 64 small-M FMA kernel (from M = 16 only for K >= 128: fwd_f32_small), M > 64 the
//     oneDNN route for K >= 128 (fwd_f32_onednn: 1.0-2.2x the fp32 pb kernel; also from M = 5 for K > 4096, and on
//     Intel from M = 25 for K > 2048), else the fp32 pb kernel (MKL's sgemm is 2-3x slower on the AMD dev machine at
//     every M measured).
//   AVX-512 F family (no AVX512_BF16), bf16, M > 32: the fp32 pb kernel on x widened once (exact) and the weight
//     widened (fp32 master weights: rounded to bf16, as autocast) while it is packed, in chunks of panels.
//   AVX2 family (bf16 and fp32) and the bf16 of the AVX-512 F family at M <= 32: fp32 FMA kernels that read the
//     operands in their stored dtype (bf16 widened in registers, fp32 master weights rounded to bf16 on the way, never
//     a converted copy of the weight): M <= 4 weight streaming (inner products), M <= 32 a broadcast kernel reading the
//     weight rows in place against x^T, larger M the packed-panel GEMM "fgemm" (6 x 16 register tiles, the epilogue
//     in registers on the last K block; fp32 outputs of 1 MB and more with non-temporal stores: kFgStreamOut).
//     Crossovers at kAvx2StreamMaxM.
//   scalar family and fp16: at::mm in fp32 on the operands rounded to c (products of bf16/fp16 values are exact in
//     fp32), then the epilogue (in place in an fp32 output).
// Backward: one pass computes dpre (rounded to c) and grad_bias; then grad_x / grad_weight with the pb kernels
// (grad_x: A = dpre in place, B = the weight; grad_weight: A = dpre^T, B = x), small-M kernels (bf16,
// M <= 16: weight rows streamed once, grad_weight written row by row) or, for grad_x with a large weight, the packed
// bf16 GEMM (vdpbf16ps, fp32 accumulation, epilogue per 512 x 48 block); the AVX2 family (and the AVX-512 F family's
// bf16, and fp32 grad_x of large weights at M <= 64) with fgemm (grad_x: A = dpre, B = the weight's rows; grad_weight:
// A = dpre^T, B = x), except with a forward K <= 192 from M = 256, where MKL's sgemm (at::mm) on an fp32 dpre takes
// grad_x and, up to N = 512, grad_weight (gx_aten_small_k). fp32 master weights are read directly and grad_weight is
// written directly in fp32: no bf16 weight copy, no bf16 gradient + cast. AVX-512 fp32 M = 1 / fp16 / scalar: at::mm.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_isa.h"
#include "fused_linear_api.h"
#include "fused_linear_host.h"
#include "fused_linear_kernels.h"
#include "fused_linear_onednn.h"
#include "route_env.h"

namespace fastdl {
namespace fused_linear {

// The family of this process, from the level of cpu_isa.h (cpuid + XGETBV, capped by FASTDL_CPU_ISA): AVX512_BF16,
// AVX-512 F (bf16 through the AVX2 kernels), AVX2 + FMA + F16C, or scalar. The AVX-512 families also need FMA (every
// AVX-512 CPU has it; a hypervisor could hide it).
const Kernels &kernels() {
    static const Kernels &k = [&]() -> const Kernels & {
        const cpu::Level level = cpu::level();
        const cpu::Features &f = cpu::features();
        const Kernels *t = nullptr;
        if (level >= cpu::kAvx512Bf16 && f.fma)
            t = kernels_avx512_bf16();
        if (!t && level >= cpu::kAvx512 && f.fma)
            t = kernels_avx512();
        if (!t && level >= cpu::kAvx2)
            t = kernels_avx2();
        return t ? *t : *kernels_scalar();
    }();
    return k;
}

namespace {

// fp32 small-M threshold (rows of x after flattening) of the AVX-512 family: the FMA kernel beats MKL's sgemm (at::mm)
// on the dev machine (Zen 5, 2 threads, K = N = 4096) at every M <= 64: M = 1: 0.52 vs 2.1 ms, 16: 2.4 vs 7.8, 64:
// 8.0 vs 13. (The kernel takes at most kernels().fwd_f32.max_m rows.)
constexpr int64_t kFwdF32SmallM = 64;
// AVX-512 families, fp32, below the oneDNN route (fwd_f32_onednn): the small-M kernel (inner products of x rows with
// weight rows) up to M = 64, except at K < 128 from M = 16, where its horizontal sums outweigh the few FMAs of each
// product and the pb kernel (broadcast, no sums) wins. Intel Xeon (family 6 model 207), 2 threads, gelu + bias, us,
// small-M vs pb: 16x64x512 29.1 vs 23.6 | 32x64x512 43.1 vs 28.7 | 64x64x512 73.4 vs 44.4 (eager F.linear + gelu 63);
// kept at K >= 128: 8x512x512 47 vs 66, 16x1024^2 228 vs 373, 16x4096^2 4.35 vs 12.3 ms.
bool fwd_f32_small(int64_t M, int64_t K) {
    return M <= kFwdF32SmallM && (K >= 128 || M < 16);
}
// AVX2 family: the kernels reading the weight in place (streaming up to M = 4, then broadcast) up to this M, the
// fgemm above it. Zen 4 capped to AVX2, 1 thread, K = N = 4096, GFLOP/s bf16 / fp32 (broadcast vs fgemm): M = 8:
// 41 / 36 vs 25 / 24 | 16: 72 / 61 vs 45 / 41 | 24: 64 / 67 vs 59 / 56 | 32: 60 / 59 vs 64 / 52 (the fgemm's
// 6-row tiles and weight transposes do not pay off below ~32 rows).
constexpr int64_t kAvx2StreamMaxM = 32;
// fgemm's fp32 outputs of at least this many elements (1 MB) are written with non-temporal stores: the op does not
// read them back, and a 6 x 16 tile writes 6 lines 1 row apart, each of which a normal store first reads from memory.
// Zen 2, 2 threads, gelu + bias, ms, per-path loops (normal -> streaming stores; MKL's sgemm + fastdl's in-place
// epilogue; F.linear + F.gelu): 4096x64x512 4.46 -> 2.60 (3.03; 3.08) | 4096x32x512 3.63 -> 1.92 (2.37; 2.42) |
// 1024x64x512 0.869 -> 0.691 (0.697; 0.760) | 1024x384x384 2.25 -> 1.98 (eager 2.21) | 4096x256x1024 16.4 -> 13.7
// (eager 21.2); 256x64x512 (512 KB) 0.207 -> 0.198, kept normal stores for outputs a next layer may still find in
// cache. With streaming stores fgemm beats the MKL route at every K <= 64 measured, which the AVX2 family's fp32
// took before (fwd_f32_aten, M >= 256).
constexpr int64_t kFgStreamOut = int64_t{1} << 18;

void check_compute_dtype(const at::Tensor &x, const char *fn) {
    const auto c = x.scalar_type();
    TORCH_CHECK(c == at::kFloat || c == at::kBFloat16 || c == at::kHalf, fn,
                ": x.dtype must be float32, bfloat16 or float16, got ", c);
}

void check_weight(const at::Tensor &x, const at::Tensor &weight, const char *fn) {
    TORCH_CHECK(weight.dim() == 2, fn, ": weight must be 2-D [N, K], got shape ", weight.sizes());
    TORCH_CHECK(weight.size(1) == x.size(-1), fn, ": weight must have shape [N, K] with K = x.size(-1) = ", x.size(-1),
                ", got weight.shape = ", weight.sizes());
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, fn,
                ": weight.dtype must be x.dtype (", x.scalar_type(), ") or float32, got ", weight.scalar_type());
    TORCH_CHECK(weight.device() == x.device(), fn, ": weight must be on device ", x.device(),
                " (the device of x), got ", weight.device());
}

// Path rules. "pb": the packed-B kernels (run_pb); the numbers are us (ms where marked) on the dev machine (Zen 5,
// 2 threads), old path -> pb, measured interleaved in one process.
// bf16 forward: pb when M >= 48 and N * K < 64 M^2, else the kernels reading the weight in place (forward_kernels).
// (At the boundary, 512,4096,4096, Zen 4 1 thread: broadcast kernel 79.4 ms vs pb 85.8; Zen 5 below: 19.0 vs 18.7.)
// pb packs the weight per call (per thread, its panels), which pays off with M, and loses once the weight is large
// next to M (panels beyond L2):
//   pb:   48,512,512 40 -> 39 | 64,512,512 52 -> 48 | 96,512,512 77 -> 66 | 359,64,512 90 -> 41 | 512,128,128
//         38 -> 28 | 359,512,512 248 -> 210 | 4096,256,1024 3020 -> 2380 | 300,1024,4096 3220 -> 2830 |
//         600,2048,2048 6070 -> 5410 | 512,4096,4096 ms 19.0 -> 18.7
//   kept: 32,512,512 26 vs 29 | 64,1024,1024 158 vs 176 | 128,2048,2048 1170 vs 1220 | 192,4096,4096 ms 7.0 vs 7.6
//         | 256,4096,4096 ms 9.3 vs 9.9 | 359,4096,4096 ms 14.2 vs 14.3
bool fwd_bf16_pb(int64_t M, int64_t N, int64_t K) {
    return M >= 48 && N * K < 64 * M * M;
}

// out / pre: the op's outputs as [M, N] (pre undefined when not stored); b32: the bias in fp32 or undefined.
void forward_compute(const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, int64_t K, const Epilogue &e,
                     const at::Tensor &out, const at::Tensor &pre, const at::Tensor &b32) {
    const Kernels &kr = kernels();
    const auto c = x2.scalar_type();
    if (K == 0) { // empty reduction: acc = 0
        at::Tensor acc = at::zeros({M, N}, x2.options().dtype(at::kFloat));
        return run_epilogue(e, acc.data_ptr<float>(), M, N);
    }
    if (c == at::kBFloat16 && kr.pb_bf16.block) { // AVX512_BF16
        if (fwd_bf16_pb(M, N, K))
            return forward_pb(DType::BF16, x2, w, M, N, K, e);
        return forward_kernels(kr.fwd_bf16, x2, w, M, N, K, e);
    }
    if (c == at::kFloat && kr.pb_f32.block) { // AVX-512 F
        if (fwd_f32_small(M, K) && M <= kr.fwd_f32.max_m)
            return forward_kernels(kr.fwd_f32, x2, w, M, N, K, e);
        if (w.scalar_type() == at::kFloat)
            return forward_pb(DType::F32, x2, w, M, N, K, e);
    }
    if (c == at::kBFloat16 && kr.pb_f32.block && M > kAvx2StreamMaxM) // AVX-512 F without AVX512_BF16
        return forward_pb(DType::F32, x2.to(at::kFloat), w, M, N, K, e, w.scalar_type() == at::kFloat);
    if (kr.fgemm.block && (c == at::kBFloat16 || c == at::kFloat)) { // AVX2 (and AVX-512 F for bf16)
        const FwdKernel &fk = c == at::kBFloat16 ? kr.fwd_bf16 : kr.fwd_f32;
        if (fk.run && M <= std::min(kAvx2StreamMaxM, fk.max_m))
            return forward_kernels(fk, x2, w, M, N, K, e);
        FgemmArgs g;
        g.a = GemmOperand{x2.data_ptr(), K, dtype_of(c), false};
        g.b = GemmOperand{w.data_ptr(), K, dtype_of(w.scalar_type()), true};
        g.round_b = c == at::kBFloat16 && w.scalar_type() == at::kFloat;
        g.M = M;
        g.N = N;
        g.K = K;
        Epilogue es = e;
        es.stream = e.out_dtype == DType::F32 && M * N >= kFgStreamOut;
        return run_fgemm(g, es);
    }
    forward_aten(x2, w, M, N, e, out, pre, b32);
}

// ---- The oneDNN route (fused_linear_onednn.h): PyTorch's oneDNN inner product with the activation as a post-op, one
// rounding like fastdl's kernels, at the shapes where it beats them. In-process A/B, fastdl kernel vs oneDNN, gelu +
// bias, Zen 4 (AVX512-BF16), 2 threads, ms (oneDNN's speed-up):
//   fp32 (AVX-512 families), M > 64: fastdl's pb kernel holds the weight panel of 48 columns over the whole K, which
//   leaves L2 at large K: 96x11008x4096 102.6 vs 46.0 (2.23x) | 128x4096x11008 111 vs 59.6 (1.86x) | 128x4096^2
//   29.8 vs 22.1 (1.35x) | 512x4096^2 94.0 vs 83.9 (1.12x) | 128x1536^2 4.40 vs 3.40 (1.29x) | 512x384x1536 3.39 vs
//   3.35 | 2048x4096^2 347 vs 345; kept: M <= 64 (the small-M kernel: 48x4096^2 9.76 vs 10.7, 64x1536x384 0.39 vs
//   0.42) and K < 128 (96x64x512 0.096 vs 0.106, 2048x64x512 1.02 vs 1.13).
//   bf16 (AVX512_BF16), where fastdl would run its pb kernel (fwd_bf16_pb), M >= 64 and a weight of at most 4M
//   elements: 2048x64x512 0.861 vs 0.676 (1.27x) | 256x1536^2 3.63 vs 3.23 (1.12x) | 512x384x1536 1.90 vs 1.76
//   (1.08x) | 256x1024^2 1.61 vs 1.46 (1.10x) | 64x384x384 0.092 vs 0.089; kept: the in-place kernels below the pb
//   region (16x1536^2 0.265 vs 0.325, 64x11008x4096 14.2 vs 18.1, 128x4096^2 10.8 vs 11.6) and pb with larger weights
//   (2048x4096^2 174 vs 198).
//   AVX2 family: oneDNN's fp32 lost to fgemm at every shape measured (capped Zen 4: 512x4096^2 87.8 vs 108) and it
//   has no bf16 there.
// The route needs the weight in the compute dtype (fp32 master weights with bf16 x keep fastdl's kernels, which round
// it in registers), computes the stored pre-activation only in fp32 (bf16 training keeps the kernels: out must come
// from the fp32 accumulator), and takes a bf16 residual only without an activation (a binary post-op).
// Below M = 65 (Intel Xeon, cpuid family 6 model 207: AVX-512 without BF16, 2 threads, gelu + bias, us, small-M
// kernel vs oneDNN, in-process): a long K leaves the small-M kernel's rows of x (4 rows of K floats per pass over
// the weight) out of L1: 8x11008x4096 10.9 vs 9.7 ms, 16x11008x4096 17.5 vs 11.7 ms, 32x11008x4096 30 vs 16 ms,
// 32x8192x2048 8.4 vs 6.1 ms; so K > 4096 goes to oneDNN from M = 5. On Intel cores oneDNN also wins from M = 25 at K
// > 2048 (48x4096^2 8.75-9.05 vs 7.7-7.9 ms; 24x4096^2 4.85-5.05 vs 5.0; K <= 2048 kept: 48x2048^2 1.91-1.96 vs
// 1.91, 48x1024^2 0.47-0.58 vs 0.50-0.59), where on the AMD dev machine (Zen 4) the kernel won (48x4096^2 9.76 vs
// 10.7 ms).
bool fwd_f32_onednn(int64_t M, int64_t K) {
    if (K < 128)
        return false;
    return M > kFwdF32SmallM || (M > 4 && K > 4096) || (M > 24 && K > 2048 && cpu::vendor_intel());
}
bool fwd_bf16_onednn(int64_t M, int64_t N, int64_t K) {
    return M >= 64 && fwd_bf16_pb(M, N, K) && N * K <= (int64_t{1} << 22);
}

bool choose_onednn(at::ScalarType c, at::ScalarType wt, Act act, at::ScalarType rt, bool has_res, bool store_pre,
                   int64_t M, int64_t N, int64_t K) {
    const Kernels &kr = kernels();
    if (wt != c)
        return false;
    bool rule = false;
    if (c == at::kFloat && kr.pb_f32.block)
        rule = fwd_f32_onednn(M, K);
    else if (c == at::kBFloat16 && kr.pb_bf16.block)
        rule = !store_pre && (!has_res || (act == Act::None && rt == c)) && fwd_bf16_onednn(M, N, K);
    return rule && onednn_available(c); // (last: it reads the environment)
}

// Returns (out, pre) as [M, N] (pre undefined unless stored; fp32 only, see above).
std::tuple<at::Tensor, at::Tensor> forward_onednn(const at::Tensor &x2, const at::Tensor &w,
                                                  const std::optional<at::Tensor> &bias, Act act, const at::Tensor &res,
                                                  bool store_pre) {
    if (!store_pre && (!res.defined() || act == Act::None)) // the whole op in one primitive
        return {onednn_linear(x2, w, bias, act, res.defined() ? res.to(x2.scalar_type()) : res), at::Tensor()};
    // fp32: the product + bias from oneDNN, then the activation and residual in one elementwise pass (in place, or
    // into out when the pre-activation is kept)
    at::Tensor lin = onednn_linear(x2, w, bias, Act::None, at::Tensor());
    const int64_t M = lin.size(0), N = lin.size(1);
    at::Tensor out = store_pre ? empty_output({M, N}, lin.options()) : lin;
    Epilogue e;
    if (res.defined()) {
        e.res = res.data_ptr();
        e.ld_res = N;
        e.res_dtype = dtype_of(res.scalar_type());
    }
    e.out = out.data_ptr();
    e.ld_out = N;
    e.out_dtype = DType::F32;
    e.act = act;
    run_epilogue(e, lin.data_ptr<float>(), M, N);
    return {out, store_pre ? lin : at::Tensor()};
}

} // namespace

Act parse_activation(c10::string_view s, const char *fn) {
    Act act = Act::None;
    TORCH_CHECK_VALUE(find_activation(std::string_view(s.data(), s.size()), act), fn, ": activation must be one of ",
                      activation_names(), ", got '", std::string(s.data(), s.size()), "'");
    return act;
}

// (Geometry: fused_linear_host.h)
Geometry checked_geometry(const at::Tensor &x, const at::Tensor &weight, c10::string_view activation, const char *fn) {
    const Act act = parse_activation(activation, fn);
    TORCH_CHECK(x.dim() >= 1, fn, ": x must have at least one dimension [..., K], got a 0-d tensor");
    check_compute_dtype(x, fn);
    check_weight(x, weight, fn);
    Geometry g{act, x.size(-1), weight.size(0), c10::multiply_integers(x.sizes().slice(0, x.dim() - 1)),
               std::vector<int64_t>(x.sizes().begin(), x.sizes().end())};
    g.out_shape.back() = g.N;
    return g;
}

void check_optional(const at::Tensor &t, const char *name, at::IntArrayRef shape, const at::Tensor &x, const char *fn) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), fn, ": ", name, " must be a floating-point tensor, got dtype ",
                t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), fn, ": ", name, " must be on device ", x.device(), " (the device of x), got ",
                t.device());
    TORCH_CHECK(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

namespace {

std::tuple<at::Tensor, at::Tensor> fused_linear_cpu(const at::Tensor &x, const at::Tensor &weight,
                                                    const std::optional<at::Tensor> &bias, c10::string_view activation,
                                                    const std::optional<at::Tensor> &residual, bool save_preact) {
    constexpr const char *fn = "fused_linear";
    const auto [act, K, N, M, out_shape] = checked_geometry(x, weight, activation, fn);
    const auto c = x.scalar_type();
    const bool has_bias = bias.has_value() && bias->defined();
    const bool has_res = residual.has_value() && residual->defined();
    if (has_bias)
        check_optional(*bias, "bias", {N}, x, fn);
    if (has_res)
        check_optional(*residual, "residual", out_shape, x, fn);

    const bool store_pre = save_preact && act != Act::None;
    const auto io = c == at::kHalf ? at::kFloat : c; // fp16 (CUDA's dtype) is computed through fp32 on CPU
    at::Tensor out, pre;
    const bool routed =
        M > 0 && N > 0 && K > 0 &&
        choose_onednn(c, weight.scalar_type(), act, has_res ? residual->scalar_type() : c, has_res, store_pre, M, N, K);
    if (routed) {
        // oneDNN reads the bias as a dense fp32 or bf16 vector: a strided or expanded one is made dense, another dtype
        // fp32 (the contract adds the bias in fp32)
        std::optional<at::Tensor> b;
        if (has_bias) {
            const auto bt = bias->scalar_type();
            b = (bt == at::kFloat || bt == at::kBFloat16 ? *bias : bias->to(at::kFloat)).contiguous();
        }
        std::tie(out, pre) = forward_onednn(x.reshape({M, K}).contiguous(), weight.contiguous(), b, act,
                                            has_res ? as_matrix(*residual, M, N) : at::Tensor(), store_pre);
    } else {
        out = empty_output({M, N}, x.options().dtype(io));
        pre = store_pre ? empty_output({M, N}, x.options().dtype(io)) : at::Tensor();
    }
    if (M > 0 && N > 0 && !routed) {
        const at::Tensor b32 = has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
        const at::Tensor res = has_res ? as_matrix(*residual, M, N) : at::Tensor();
        Epilogue e;
        e.bias = has_bias ? b32.data_ptr<float>() : nullptr;
        if (has_res) {
            e.res = res.data_ptr();
            e.ld_res = N;
            e.res_dtype = dtype_of(res.scalar_type());
        }
        e.out = out.data_ptr();
        e.ld_out = N;
        e.out_dtype = dtype_of(io);
        e.pre = store_pre ? pre.data_ptr() : nullptr;
        e.ld_pre = N;
        e.act = act;
        forward_compute(x.reshape({M, K}).contiguous(), weight.contiguous(), M, N, K, e, out, pre, b32);
    }
    if (c == at::kHalf) {
        out = out.to(c);
        if (store_pre)
            pre = pre.to(c);
    }
    if (x.dim() == 2) // no view of an [M, N] tensor as [M, N]: a view output costs the Python wrapper ~2 us per
                      // training call (it hands out a non-view tensor, see fastdl/ops/fused_linear.py)
        return {out, store_pre ? pre : at::empty({0}, x.options())};
    return {out.view(out_shape), store_pre ? pre.view(out_shape) : at::empty({0}, x.options())};
}

} // namespace

at::Tensor linear_forward(const at::Tensor &x2, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    return std::get<0>(fused_linear_cpu(x2, w, bias, "none", std::nullopt, false));
}

bool has_bf16_dot() {
    return kernels().pb_bf16.block != nullptr;
}

// Intel Xeon (cpuid family 6 model 207: AVX-512 with VNNI, without BF16), 2 threads, ms, two alternating runs, the
// format's own kernel -> pb (eager fp32 F.linear on the dense weight). K = N = 4096, fp32 x:
//   int8 per channel M = 32 6.7-7.6 -> 5.5-6.4 | 64 11.6-12.4 -> 12.6-12.8 (11.4-13.1) | 128 22.7-36.5 -> 17.0-18.1
//   (17.7-25.6) | 512 102-165 -> 65-96 (61-114); groups of 16 (before: from 128 rows the AVX2 family's fgemm) M = 32
//   7.3-7.5 -> 5.9-6.8 | 64 13.5-14.8 -> 12.8 | 128 16.8-26.0 -> 16.8-18.6; kept at 16 rows (3.6-3.7 vs 3.6-4.5);
//   int4 (the tile kernel) M = 64 13.8-16.7 -> 11.6-14.9 | 128 26.7-35.0 -> 18.8-20.4 | 512 104-160 -> 67-98; kept at
//   32 rows (7.3-7.4 vs 7.8-9.3);
//   2:4 (the sparse kernel), fp32 x / bf16 x with bf16 values: M = 64 11.6-14.5 -> 10.6-10.9 / 12.9-15.5 -> 10.1-10.5
//   (10.6-11.7) | 128 20.7-20.8 -> 18.0-18.4 / 19.2-19.5 -> 17.2-17.8 (17.2-18.1) | 512 64.8-65.2 -> 63.5-65.1 /
//   68-72 -> 62-63 (59-62); bf16 x M = 32 6.9-7.0 -> 6.1; kept: fp32 x M = 32 (5.9-6.7 vs 6.6), M = 16 (3.6 vs 4.8).
//   512 x 512: M = 359 1.03-1.05 -> 0.72 / 1.34-1.37 -> 0.75-0.76 (0.72-0.75) | 128 0.38-0.49 -> 0.28-0.30 / 0.49-0.65
//   -> 0.30-0.31 (0.27-0.35) | 64 0.25-0.27 -> 0.18-0.19 / 0.32-0.36 -> 0.18-0.19 (0.18-0.26).
// On other vendors (AMD Zen 4, whose rules were measured against the AVX2 family's fgemm and the 2:4 dense route, not
// against this kernel): grouped int8 from 128 rows as before (through this kernel now, not re-measured there), the rest
// unchanged. A bf16 x on the AVX512_BF16 family keeps its bf16 kernels (2:4).
int64_t held_pb_min_rows(Held kind) {
    if (!kernels().pb_f32.pack_quant)
        return INT64_MAX;
    static const int64_t forced = rows_or_env("FASTDL_CPU_PB_ROWS", 0);
    if (forced)
        return forced;
    if (!cpu::vendor_intel())
        return kind == Held::Int8Grouped ? 128 : INT64_MAX;
    switch (kind) {
    case Held::Int8:
    case Held::Int8Grouped:
        return 32;
    case Held::Int4:
    case Held::Sparse24:
        return 64;
    default: // Sparse24Bf16x
        return has_bf16_dot() ? INT64_MAX : 32;
    }
}

} // namespace fused_linear
} // namespace fastdl

const char *fastdl_fused_linear_cpu_kernels() {
    return fastdl::fused_linear::kernels().name;
}

// The dtypes the fused linear forward routes to oneDNN at large shapes in this process ("fp32, bf16", "fp32" or "").
std::string fastdl_fused_linear_onednn() {
    using namespace fastdl::fused_linear;
    const Kernels &kr = kernels();
    std::string s;
    if (kr.pb_f32.block && onednn_available(at::kFloat))
        s = "fp32";
    if (kr.pb_bf16.block && onednn_available(at::kBFloat16))
        s += s.empty() ? "bf16" : ", bf16";
    return s;
}

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("fused_linear", TORCH_FN(fastdl::fused_linear::fused_linear_cpu));
    m.impl("fused_linear_backward", TORCH_FN(fastdl::fused_linear::fused_linear_backward_cpu));
}
