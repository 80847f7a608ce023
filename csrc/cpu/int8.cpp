// CPU kernels of the int8 capability, registered for the fastdl_cpp schemas that fastdl/ops/int8.py defines. This
// file checks arguments and routes each op; the W8A8 GEMM driver (weight packing, blocking, threads) is in
// int8_w8a8.cpp, the weight-only one below; the arithmetic lives in the kernels of int8_kernels.h (AVX512-VNNI,
// AVX2, scalar), chosen once per process from cpuid.
//
// Op-level routing: every int8 op runs fastdl's kernels at every ISA level; no PyTorch path is both exact and faster.
// - W8A8 (int8_mm, int8_linear): PyTorch's int8 GEMM, torch._int_mm (oneDNN), is exact only with VNNI; without it (an
//   AVX2-only CPU, or ONEDNN_MAX_CPU_ISA=AVX2) it saturates its int16 pair sums, and it is slower: Zen 4 capped at
//   AVX2, one core, 128 x 4096 x 4096, int32 out, 84.5 ms vs 40.4 ms for int8_mm (medians of thread CPU time). fbgemm's
//   dynamic-quant nn.Linear is not an alternative either: it quantises activations to 7 bits (reduce_range).
// - weight-only: the op has only the int8 weight, so PyTorch's alternative is a dequantised copy + F.linear, which
//   loses to eager fp32 itself and to this kernel at every M (Zen 4 capped at AVX2, one core, 4096 x 4096, ms,
//   kernel / copy + F.linear / eager fp32 F.linear: M = 64 34.9 / 55.5 / 43.0, 128 54.3 / 77.9 / 66.4, 256 119 / 124
//   / 111, 512 260 / 264 / 244). From M = 256 the kernel is 0.84-0.98x eager fp32 on a kept fp32 weight: there
//   Int8Linear's run-time choice (fastdl/runtime_choice.py) takes F.linear on its dequantised weight per M bucket.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "aten_dtype.h"
#include "cpu_isa.h"
#include "fused_linear_api.h"
#include "fused_linear_kernels.h"
#include "int8_kernels.h"
#include "int8_w8a8.h"
#include "parallel.h"

namespace fastdl {
namespace int8 {

// ------------------------------------------------------------------------------------------------ ISA choice
namespace {

// The level comes from the one CPU-capability module (cpu_isa.h: cpuid + XGETBV, capped by FASTDL_CPU_ISA). The
// AVX-512 int8 kernels also need VNNI (vpdpbusd); an AVX-512 CPU without it (Skylake-SP) runs the AVX2 kernels.
const Kernels &choose() {
    const cpu::Level level = cpu::level();
    const bool vnni = cpu::features().avx512_vnni;
    const Kernels *k = nullptr;
    if (level >= cpu::kAvx512Bf16 && vnni) {
        k = kernels_avx512_bf16();
    } else if (level >= cpu::kAvx512 && vnni) {
        k = kernels_avx512();
    }
    if (!k && level >= cpu::kAvx2) {
        k = kernels_avx2();
    }
    return k ? *k : *kernels_scalar();
}

} // namespace

const Kernels &kernels() {
    static const Kernels &k = choose();
    return k;
}

// ------------------------------------------------------------------------------------------------ helpers
namespace {

DType dtype_of(at::ScalarType t) {
    if (t == at::kInt)
        return DType::I32;
    return floating_dtype(t).value_or(DType::I8);
}

bool is_act_dtype(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// 2-D view [rows, K] of x [..., K] with unit stride along K (a copy only when the strides do not allow a view).
at::Tensor rows_view(const at::Tensor &x) {
    const int64_t K = x.size(-1);
    const int64_t M = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
    at::Tensor x2 = x.reshape({M, K});
    if (K > 1 && x2.stride(1) != 1) {
        x2 = x2.contiguous();
    }
    return x2;
}

void check_cpu(const at::Tensor &t, const char *op, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor (the fastdl_cpp CPU kernel), got ",
                t.device());
}

void check_weight(const char *op, const char *wname, const at::Tensor &w, int64_t K, const char *kname,
                  const char *sname, const at::Tensor &scale, const c10::optional<at::Tensor> &bias) {
    check_cpu(w, op, wname);
    TORCH_CHECK(w.scalar_type() == at::kChar, op, ": ", wname, " must be int8, got ", w.scalar_type());
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K, op, ": ", wname, " must have shape [N, K] with K = ", kname, " = ", K,
                ", got ", w.sizes(), " (mismatched K)");
    const int64_t N = w.size(0);
    check_cpu(scale, op, sname);
    TORCH_CHECK(scale.scalar_type() == at::kFloat, op, ": ", sname, " must be float32, got ", scale.scalar_type());
    TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, op, ": ", sname, " must have shape [N] = [", N, "], got ",
                scale.sizes());
    if (bias.has_value()) {
        check_cpu(*bias, op, "bias");
        TORCH_CHECK(at::isFloatingType(bias->scalar_type()), op, ": bias must be a floating tensor, got ",
                    bias->scalar_type());
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [N] = [", N, "], got ",
                    bias->sizes());
    }
}

// The packed weight must be the output of int8_pack_weight for this [N, K] weight (its contents are not checked).
void check_packed(const char *op, const char *pname, const char *cname, const c10::optional<at::Tensor> &packed,
                  const c10::optional<at::Tensor> &comp, int64_t N, int64_t K) {
    TORCH_CHECK(packed.has_value() == comp.has_value(), op, ": ", pname, " and ", cname,
                " must be given together (both from int8_pack_weight) or both be None");
    if (!packed.has_value()) {
        return;
    }
    const int64_t Np = round_up(N, 16), Kp = round_up(K, 4);
    check_cpu(*packed, op, pname);
    check_cpu(*comp, op, cname);
    TORCH_CHECK(packed->scalar_type() == at::kChar && packed->dim() == 2 && packed->size(0) == Np &&
                    packed->size(1) == Kp && packed->is_contiguous(),
                op, ": ", pname, " must be the contiguous int8 [", Np, ", ", Kp,
                "] tensor made by int8_pack_weight, got ", packed->scalar_type(), " ", packed->sizes());
    TORCH_CHECK(comp->scalar_type() == at::kInt && comp->dim() == 1 && comp->size(0) == Np && comp->is_contiguous(), op,
                ": ", cname, " must be the contiguous int32 [", Np, "] tensor made by int8_pack_weight, got ",
                comp->scalar_type(), " ", comp->sizes());
}

// Whether the int8 rows a [M, K] (row stride lda) hold the value -128.
bool holds_int8_min(const int8_t *a, int64_t M, int64_t K, int64_t lda) {
    for (int64_t m = 0; m < M; ++m) {
        const int8_t *row = a + m * lda;
        int8_t lo = 0;
        for (int64_t k = 0; k < K; ++k) {
            lo = row[k] < lo ? row[k] : lo;
        }
        if (lo == -128) {
            return true;
        }
    }
    return false;
}

const float *fp32_ptr(const c10::optional<at::Tensor> &t, at::Tensor &holder) {
    if (!t.has_value()) {
        return nullptr;
    }
    holder = t->to(at::kFloat).contiguous();
    return holder.data_ptr<float>();
}

// The checks of an activation x [..., K] (a CPU float32 / bfloat16 / float16 tensor) every op that takes one starts
// with; returns K.
int64_t checked_activation_k(const at::Tensor &x, const char *op) {
    check_cpu(x, op, "x");
    TORCH_CHECK(is_act_dtype(x.scalar_type()), op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
    TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K]");
    return x.size(-1);
}

// The weight side of a W8A8 call, shared by int8_mm and int8_linear: the packed weight (packed here, on every call,
// when the caller passed none - slower: pack once with int8_pack_weight), its scales and the bias as fp32. `keep` owns
// the tensors the pointers refer to; the caller fills in the activation side (a, lda, a_dtype, a_scale, M, out).
struct WeightSide {
    at::Tensor packed, comp, scale, bias_f;
};

W8A8 weight_args(WeightSide &keep, const at::Tensor &w_q, const at::Tensor &w_scale,
                 const c10::optional<at::Tensor> &bias, const c10::optional<at::Tensor> &w_packed,
                 const c10::optional<at::Tensor> &w_comp, int64_t K) {
    if (w_packed.has_value()) {
        keep.packed = *w_packed;
        keep.comp = *w_comp;
    } else {
        std::tie(keep.packed, keep.comp) = pack_weight(w_q);
    }
    keep.scale = w_scale.contiguous();
    W8A8 p;
    p.kr = &kernels();
    p.K = K;
    p.N = w_q.size(0);
    p.Kp = round_up(K, 4);
    p.b = keep.packed.data_ptr<int8_t>();
    p.comp = keep.comp.data_ptr<int32_t>();
    p.b_scale = keep.scale.data_ptr<float>();
    p.bias = fp32_ptr(bias, keep.bias_f);
    return p;
}

// ------------------------------------------------------------------------------------------------ ops
std::tuple<at::Tensor, at::Tensor> quantize_per_token(const at::Tensor &x) {
    constexpr const char *op = "quantize_per_token";
    const int64_t K = checked_activation_k(x, op);
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
    at::Tensor scale = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
    if (x.numel() == 0) {
        scale.zero_(); // K == 0: scale 0
        return {q, scale};
    }
    const at::Tensor x2 = rows_view(x);
    const int64_t M = x2.size(0), ld = x2.stride(0);
    const Kernels &kr = kernels();
    const int64_t esz = x2.element_size();
    const char *src = static_cast<const char *>(x2.data_ptr());
    int8_t *qp = q.data_ptr<int8_t>();
    float *sp = scale.data_ptr<float>();
    parallel_for(0, M, std::max<int64_t>(1, 32768 / std::max<int64_t>(K, 1)), [&](int64_t b, int64_t e) {
        QuantRows a;
        a.src = src + b * ld * esz;
        a.ld = ld;
        a.dtype = dtype_of(x2.scalar_type());
        a.rows = e - b;
        a.K = K;
        a.q = qp + b * K;
        a.ldq = K;
        a.scale = sp + b;
        kr.quantize_rows(a);
    });
    return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> int8_pack_weight(const at::Tensor &w_q) {
    constexpr const char *op = "int8_pack_weight";
    check_cpu(w_q, op, "w_q");
    TORCH_CHECK(w_q.scalar_type() == at::kChar, op, ": w_q must be int8, got ", w_q.scalar_type());
    TORCH_CHECK(w_q.dim() == 2, op, ": w_q must be 2-D [N, K], got shape ", w_q.sizes());
    return pack_weight(w_q);
}

at::Tensor int8_mm(const at::Tensor &a_q, const at::Tensor &b_q, const at::Tensor &a_scale, const at::Tensor &b_scale,
                   const c10::optional<at::Tensor> &bias, at::ScalarType out_dtype,
                   const c10::optional<at::Tensor> &b_packed, const c10::optional<at::Tensor> &b_comp) {
    constexpr const char *op = "int8_mm";
    check_cpu(a_q, op, "a_q");
    TORCH_CHECK(a_q.scalar_type() == at::kChar, op, ": a_q must be int8, got ", a_q.scalar_type());
    TORCH_CHECK(a_q.dim() == 2, op, ": a_q must be 2-D [M, K], got shape ", a_q.sizes());
    const int64_t M = a_q.size(0), K = a_q.size(1);
    check_weight(op, "b_q", b_q, K, "a_q.size(1)", "b_scale", b_scale, bias);
    const int64_t N = b_q.size(0);
    check_cpu(a_scale, op, "a_scale");
    TORCH_CHECK(a_scale.scalar_type() == at::kFloat, op, ": a_scale must be float32, got ", a_scale.scalar_type());
    TORCH_CHECK(a_scale.dim() == 1 && a_scale.size(0) == M, op, ": a_scale must have shape [M] = [", M, "], got ",
                a_scale.sizes());
    TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf ||
                    out_dtype == at::kInt,
                op, ": out_dtype must be float32, bfloat16, float16 or int32, got ", out_dtype);
    check_packed(op, "b_packed", "b_comp", b_packed, b_comp, N, K);
    at::Tensor out = at::empty({M, N}, a_q.options().dtype(out_dtype));
    if (M == 0 || N == 0) {
        return out;
    }
    WeightSide ws;
    W8A8 p = weight_args(ws, b_q, b_scale, bias, b_packed, b_comp, K);
    const at::Tensor a = a_q.stride(1) == 1 || K <= 1 ? a_q : a_q.contiguous();
    const at::Tensor as = a_scale.contiguous();
    const at::Tensor &bs = ws.scale;
    p.a = a.data_ptr();
    p.lda = a.stride(0);
    p.a_dtype = DType::I8;
    p.a_scale = as.data_ptr<float>();
    p.M = M;
    p.out = out.data_ptr();
    p.out_dtype = dtype_of(out_dtype);
    if (p.kr->a_min > -128 && holds_int8_min(a.data_ptr<int8_t>(), M, K, p.lda)) {
        // The AVX2 sign trick is exact for A in [-127, 127] only: A = A' + E with A' = max(A, -127) and E = -[A ==
        // -128] (both in range), acc = A' B + E B in int32, then the contract's dequantisation as separate fp32 ops
        // (the same roundings as the epilogue). Only a user's int8_mm can get here (quantised activations never hold
        // -128); it costs a second GEMM.
        at::Tensor acc = at::empty({M, N}, a_q.options().dtype(at::kInt));
        at::Tensor acc_e = at::empty({M, N}, a_q.options().dtype(at::kInt));
        const at::Tensor a1 = a.clamp_min(-127), e = a.eq(-128).to(at::kChar).neg_();
        for (auto [src, dst] : {std::pair{&a1, &acc}, std::pair{&e, &acc_e}}) {
            W8A8 q = p;
            q.a = src->data_ptr();
            q.lda = src->stride(0);
            q.out = dst->data_ptr();
            q.out_dtype = DType::I32;
            run_w8a8(q);
        }
        acc = acc.to(at::kLong).add_(acc_e).to(at::kInt); // wraps like the int32 accumulator
        if (out_dtype == at::kInt) {
            return acc;
        }
        at::Tensor f = acc.to(at::kFloat).mul_(as.unsqueeze(1)).mul_(bs.unsqueeze(0));
        if (bias.has_value()) {
            f.add_(bias->to(at::kFloat).unsqueeze(0));
        }
        return f.to(out_dtype);
    }
    run_w8a8(p);
    return out;
}

at::Tensor int8_linear(const at::Tensor &x, const at::Tensor &w_q, const at::Tensor &w_scale,
                       const c10::optional<at::Tensor> &bias, const c10::optional<at::Tensor> &w_packed,
                       const c10::optional<at::Tensor> &w_comp, int64_t act_bits) {
    constexpr const char *op = "int8_linear";
    const int64_t K = checked_activation_k(x, op);
    TORCH_CHECK_VALUE(act_bits == 8 || act_bits == 7, op, ": act_bits must be 8 or 7, got ", act_bits);
    check_weight(op, "w_q", w_q, K, "x.shape[-1]", "w_scale", w_scale, bias);
    const int64_t N = w_q.size(0);
    check_packed(op, "w_packed", "w_comp", w_packed, w_comp, N, K);
    std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
    out_shape.back() = N;
    at::Tensor out = at::empty(out_shape, x.options());
    if (out.numel() == 0) {
        return out;
    }
    WeightSide ws;
    W8A8 p = weight_args(ws, w_q, w_scale, bias, w_packed, w_comp, K);
    const at::Tensor x2 = rows_view(x);
    p.a = x2.data_ptr();
    p.lda = x2.stride(0);
    p.a_dtype = dtype_of(x.scalar_type());
    p.M = x2.size(0);
    p.out = out.data_ptr();
    p.out_dtype = dtype_of(x.scalar_type());
    p.u7 = act_bits == 7;
    run_w8a8(p);
    return out;
}

// The W8A8 forward of quantization-aware training in one call: quantize the float master weight per output channel,
// then int8_linear (one trip through the dispatcher instead of two Python-routed ops: the QAT training step at M = 1,
// K = N = 64 is dominated by call overhead). The weight-only forward (group scales) is the PyTorch composite's.
// On any failed check the Python layer reruns its own checks, so bad input is reported in fastdl.ops' words.
at::Tensor int8_linear_qat(const at::Tensor &x, const at::Tensor &weight, const c10::optional<at::Tensor> &bias,
                           bool weight_only) {
    constexpr const char *op = "int8_linear_qat";
    TORCH_CHECK(!weight_only, op, ": the weight-only forward is served by the PyTorch composite, not this kernel");
    check_cpu(x, op, "x");
    check_cpu(weight, op, "weight");
    TORCH_CHECK(is_act_dtype(x.scalar_type()), op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
    TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K]");
    TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [N, K], got ", weight.sizes());
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, op,
                ": weight must have x's dtype or float32, got ", weight.scalar_type());
    TORCH_CHECK(weight.size(1) == x.size(-1), op, ": weight must have shape [N, K] with K = x.shape[-1]");
    const auto [w_q, w_scale] = quantize_per_token(weight);
    return int8_linear(x, w_q, w_scale, bias, c10::nullopt, c10::nullopt, 8);
}

// The AVX2 family from 64 rows: fused_linear's fp32 GEMM (fgemm: 6 x 16 register tiles over strips packed from the
// int8 weight, dequantized while packed; fgemm_quantized_weight) instead of the weight-only kernel's 3 x 4 dot tiles.
// Zen 4 capped to AVX2, 2 threads, per-channel scales, ms, kernel vs fgemm (eager fp32 F.linear on the dequantized
// weight): 512x4096^2 101.4 vs 81.3 (94.8) | 128x4096^2 23.4 vs 21.7 | 64x4096^2 12.5 vs 11.8 | 160x384x1536 1.41 vs
// 1.03 | 4096x64x512 2.33 vs 1.50 (1.46) | 64x1024^2 1.05 vs 0.80 | 64x384x384 0.15 vs 0.13; kept below 64 rows:
// 32x1024^2 0.42 vs 0.48 (the dot form reads int8 in its inner loop, and M is too small to amortise the packing).
// The AVX-512 families: fused_linear's fp32 pb kernel from the rows fused_linear::held_pb_min_rows gives (its
// numbers there; Intel: 32 rows). Before it, on Zen 4, the AVX2 fgemm from 128 rows, grouped weights only: the dot form
// multiplies each group's code in its inner loop. Zen 4 (AVX-512), 1 thread (thread CPU time, shared machine), fp32 x,
// groups of 16, ms, dot vs fgemm (Int8Linear's former kept-fp32-copy path, oneDNN): M = 128 2048x5632 35.5 vs 32.4
// (29.1) | 5632x2048 36.4 vs 33.4 (28.9) | 4096x4096 51.8 vs 45.7 (42.7); M = 256 70.2 vs 57.9 (54.8) | 70.1 vs 67.5
// (54.9) | 100.1 vs 81.6 (92.5); kept the dot form at M = 64 (17.5 vs 19.0) and for per-channel scales (M = 256 55.8
// vs 58.4).
bool weight_only_fgemm(const Kernels &kr, int64_t M, bool grouped) {
    if (&kr == kernels_avx2())
        return M >= 64;
    return (&kr == kernels_avx512() || &kr == kernels_avx512_bf16()) &&
           M >= fastdl::fused_linear::held_pb_min_rows(grouped ? fastdl::fused_linear::Held::Int8Grouped
                                                               : fastdl::fused_linear::Held::Int8);
}

at::Tensor int8_weight_only_linear(const at::Tensor &x, const at::Tensor &w_q, const at::Tensor &w_scale,
                                   const c10::optional<at::Tensor> &bias,
                                   const c10::optional<at::Tensor> &w_group_scale) {
    constexpr const char *op = "int8_weight_only_linear";
    const int64_t K = checked_activation_k(x, op);
    check_weight(op, "w_q", w_q, K, "x.shape[-1]", "w_scale", w_scale, bias);
    const int64_t N = w_q.size(0);
    at::Tensor wg;
    if (w_group_scale.has_value()) {
        const int64_t G = ceil_div(K, kWeightGroup);
        check_cpu(*w_group_scale, op, "w_group_scale");
        TORCH_CHECK(w_group_scale->scalar_type() == at::kByte, op, ": w_group_scale must be uint8, got ",
                    w_group_scale->scalar_type());
        TORCH_CHECK(w_group_scale->dim() == 2 && w_group_scale->size(0) == N && w_group_scale->size(1) == G, op,
                    ": w_group_scale must have shape [N, ceil(K / 16)] = [", N, ", ", G, "], got ",
                    w_group_scale->sizes());
        wg = w_group_scale->contiguous();
    }
    std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
    out_shape.back() = N;
    at::Tensor out = at::empty(out_shape, x.options());
    if (out.numel() == 0) {
        return out;
    }
    if (K == 0) { // an empty product: the epilogue on a zero accumulator, as the reference (no kernel reads K = 0)
        at::Tensor y = at::zeros({out.numel() / N, N}, x.options().dtype(at::kFloat)) * w_scale.unsqueeze(0);
        if (bias.has_value() && bias->defined())
            y = y + bias->to(at::kFloat).unsqueeze(0);
        return out.copy_(y.view(out_shape));
    }
    const Kernels &kr = kernels();
    // bf16 x goes to the vdpbf16ps kernel as it is, from 4 rows up; otherwise the kernel reads fp32 (a bf16 / fp16 x
    // is converted once: M x K values, small next to the N x K weights). At 1-2 rows the fp32 kernel is faster (1 row
    // x 2048 x 4096, one core: 0.120 ms fp32 vs 0.175 ms bf16): vcvtne2ps2bf16 (~1.25 per cycle) is then not
    // amortised over rows; from 4 rows the bf16 kernel wins (0.257 vs 0.272 ms at 4 rows).
    const int64_t rows_total = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
    const bool bf16 = x.scalar_type() == at::kBFloat16 && kr.weight_only_bf16 != nullptr && rows_total >= 4;
    // fgemm reads a bf16 x as it is (widened exactly while packed); it has no fp16 (x and out fp16: the kernel).
    const bool fgemm = weight_only_fgemm(kr, rows_total, wg.defined()) && x.scalar_type() != at::kHalf &&
                       !bf16; // (bf16 x on AVX512_BF16: the vdpbf16ps panel kernel, 2x the fp32 FMA rate)
    at::Tensor x2 = rows_view(bf16 || (fgemm && x.scalar_type() == at::kBFloat16) ? x : x.to(at::kFloat));
    const at::Tensor w = w_q.stride(1) == 1 || K <= 1 ? w_q : w_q.contiguous();
    const at::Tensor ws = w_scale.contiguous();
    at::Tensor bias_f;
    WeightOnly base;
    base.x = x2.data_ptr();
    base.ldx = x2.stride(0);
    base.rows = x2.size(0);
    base.K = K;
    base.w = w.data_ptr<int8_t>();
    base.ldw = w.stride(0);
    base.cols = N;
    base.w_scale = ws.data_ptr<float>();
    base.bias = fp32_ptr(bias, bias_f);
    base.w_group = wg.defined() ? wg.data_ptr<uint8_t>() : nullptr;
    base.ldg = wg.defined() ? wg.stride(0) : 0;
    base.out = out.data_ptr();
    base.ldo = N;
    base.out_dtype = dtype_of(x.scalar_type());
    const int64_t M = base.rows;
    if (fgemm) {
        namespace fl = fastdl::fused_linear;
        const fl::Int8Weight iw{base.w, base.ldw, base.w_scale, base.w_group, base.ldg};
        const fl::DType xd = x2.scalar_type() == at::kFloat ? fl::DType::F32 : fl::DType::BF16;
        const fl::DType od = out.scalar_type() == at::kFloat ? fl::DType::F32 : fl::DType::BF16;
        if (fl::fgemm_quantized_weight(base.x, xd, base.ldx, M, iw, fl::Int4Weight{}, N, K, base.bias, base.out, od))
            return out;
        TORCH_CHECK(x2.scalar_type() == at::kFloat, op, ": internal error: bf16 x without fgemm");
    }
    auto fn = bf16 ? kr.weight_only_bf16 : kr.weight_only_f32;
    const int64_t xe = bf16 ? 2 : 4, oe = out.element_size();
    // Threads split N (each streams its share of the weights), then M when N is too narrow.
    const int64_t T = (M * N * std::max<int64_t>(K, 1) < kr.wo_serial_macs) ? 1 : at::get_num_threads();
    const int64_t tn = std::max<int64_t>(1, std::min(T, ceil_div(N, 64)));
    const int64_t tm = std::max<int64_t>(1, std::min(T / tn, ceil_div(M, 4)));
    auto body = [&](int64_t b, int64_t e) {
        for (int64_t it = b; it < e; ++it) {
            const auto rows = split(M, tm, it / tn, 4);
            const auto cols = split(N, tn, it % tn, 8);
            if (rows.first >= rows.second || cols.first >= cols.second) {
                continue;
            }
            WeightOnly p = base;
            p.x = static_cast<const char *>(base.x) + rows.first * base.ldx * xe;
            p.rows = rows.second - rows.first;
            p.w = base.w + cols.first * base.ldw;
            p.cols = cols.second - cols.first;
            p.w_scale = base.w_scale + cols.first;
            p.w_group = base.w_group ? base.w_group + cols.first * base.ldg : nullptr;
            p.bias = base.bias ? base.bias + cols.first : nullptr;
            p.out = static_cast<char *>(base.out) + (rows.first * N + cols.first) * oe;
            fn(p);
        }
    };
    if (tm * tn == 1) {
        body(0, 1);
    } else {
        parallel_for(0, tm * tn, 1, body);
    }
    return out;
}

} // namespace
} // namespace int8
} // namespace fastdl

const char *fastdl_int8_isa() {
    return fastdl::int8::kernels().name;
}

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("quantize_per_token", &fastdl::int8::quantize_per_token);
    m.impl("int8_pack_weight", &fastdl::int8::int8_pack_weight);
    m.impl("int8_mm", &fastdl::int8::int8_mm);
    m.impl("int8_linear", &fastdl::int8::int8_linear);
    m.impl("int8_weight_only_linear", &fastdl::int8::int8_weight_only_linear);
    m.impl("int8_linear_qat", &fastdl::int8::int8_linear_qat);
}
