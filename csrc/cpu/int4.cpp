// CPU glue of the int4 weight-only capability: fastdl_cpp::int4_weight_only_linear and int4_a8_linear (schemas in
// fastdl/ops/int4.py, format in int4_kernels.h). Argument checks, then one route per op:
//   float x: up to the family's stream_max_rows rows, the streaming kernel (int4_stream.h: each packed byte read once
//     per call, the rows' FMAs share each dequantized vector); up to tiles_max_rows, the tile kernel (the weight rows
//     dequantized once per x chunk into a small buffer, register tiles of x rows x weight rows); above, fused_linear's
//     fgemm with the int4 weight dequantized strip by strip while it is packed (the AVX-512 families: its fp32 pb
//     kernel, chunk by chunk, from fused_linear::held_pb_min_rows rows on). No dense copy of the weight at any M.
//     The numbers behind each family's limits are beside its table (int4_avx512.cpp, int4_avx2.cpp).
//   W4A8: x quantized per row and group, then the integer kernel: the dot-product form for few rows, the family's
//     GEMM (AVX512-VNNI) from its a8_gemm_min_rows.
// Threads split N in both.
#include "int4_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <vector>

#include "cpu_isa.h"
#include "fused_linear_api.h"
#include "fused_linear_kernels.h"
#include "parallel.h"
#include "route_env.h"

const char *fastdl_int4_cpu_kernels() {
    return fastdl::int4::kernels().name;
}

namespace fastdl {
namespace int4 {

const Kernels &kernels() {
    static const Kernels &k = [] {
        const cpu::Level level = cpu::level();
        const Kernels *f = nullptr;
        if (level >= cpu::kAvx512 && cpu::features().avx512_vnni) // (its W4A8 kernel is vpdpbusd)
            f = kernels_avx512();
        if (!f && level >= cpu::kAvx2)
            f = kernels_avx2();
        return f ? std::cref(*f) : std::cref(*kernels_scalar());
    }();
    return k;
}

namespace {

constexpr int64_t kBf16DenseMinRows = 16;

void check_cpu(const char *op, const at::Tensor &t, const char *name) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
}

struct Checked {
    int64_t M = 0, K = 0, N = 0, group = 0, groups = 0;
    at::Tensor q, s, z, b, out;
    // What both kernels' arguments (Int4Args, A8Args) hold: the shapes, the weights, the bias and the fp32 output.
    template <class A> A args(float *fp32_out) const {
        A a;
        a.M = M;
        a.K = K;
        a.N = N;
        a.group = group;
        a.q = q.data_ptr<uint8_t>();
        a.scales = reinterpret_cast<const uint16_t *>(s.data_ptr<at::Half>());
        a.zeros = z.defined() ? z.data_ptr<uint8_t>() : nullptr;
        a.bias = b.defined() ? b.data_ptr<float>() : nullptr;
        a.out = fp32_out;
        a.ldo = N;
        return a;
    }
};

// The arguments of both int4 ops (same schema), checked; out allocated ([..., N] in x's dtype).
Checked check_args(const char *op, const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                   const c10::optional<at::Tensor> &zeros, const c10::optional<at::Tensor> &bias, int64_t group_size) {
    check_cpu(op, x, "x");
    check_cpu(op, qweight, "qweight");
    check_cpu(op, scales, "scales");
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                     op, ": x must be float32, bfloat16 or float16, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension [..., K], got a 0-D tensor");
    TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, op,
                      ": group_size must be 32, 64 or 128, got ", group_size);
    TORCH_CHECK_TYPE(qweight.scalar_type() == at::kByte, op, ": qweight must be uint8, got ", qweight.scalar_type());
    TORCH_CHECK_VALUE(qweight.dim() == 2, op, ": qweight must be 2-D [N, K / 2], got ", qweight.sizes());
    Checked c;
    c.group = group_size;
    c.K = x.size(-1);
    c.N = qweight.size(0);
    const int64_t K = c.K, N = c.N;
    TORCH_CHECK_VALUE(K % group_size == 0, op, ": K = x.shape[-1] = ", K,
                      " must be a multiple of group_size = ", group_size);
    TORCH_CHECK_VALUE(qweight.size(1) * 2 == K, op, ": qweight must have shape [N, K / 2] = [", N, ", ", K / 2,
                      "], got ", qweight.sizes());
    c.groups = K / group_size;
    TORCH_CHECK_TYPE(scales.scalar_type() == at::kHalf, op, ": scales must be float16, got ", scales.scalar_type());
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == c.groups, op,
                      ": scales must have shape [N, K / group_size] = [", N, ", ", c.groups, "], got ", scales.sizes());
    if (zeros.has_value() && zeros->defined()) {
        check_cpu(op, *zeros, "zeros");
        TORCH_CHECK_TYPE(zeros->scalar_type() == at::kByte, op, ": zeros must be uint8, got ", zeros->scalar_type());
        TORCH_CHECK_VALUE(zeros->dim() == 2 && zeros->size(0) == N && zeros->size(1) == c.groups, op,
                          ": zeros must have shape [N, K / group_size] = [", N, ", ", c.groups, "], got ",
                          zeros->sizes());
        c.z = zeros->contiguous();
    }
    if (bias.has_value() && bias->defined()) {
        check_cpu(op, *bias, "bias");
        TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, op, ": bias must have shape [N] = [", N, "], got ",
                          bias->sizes());
        TORCH_CHECK_TYPE(at::isFloatingType(bias->scalar_type()), op, ": bias must be a floating tensor, got ",
                         bias->scalar_type());
        c.b = bias->to(at::kFloat).contiguous();
    }
    std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
    out_shape.back() = N;
    c.out = at::empty(out_shape, x.options());
    c.M = K > 0 ? x.numel() / K : c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
    c.q = qweight.contiguous();
    c.s = scales.contiguous();
    return c;
}

// The result of an empty product (K = 0): the bias, or zeros. True when it applies (or out is empty).
bool trivial(Checked &c) {
    if (c.out.numel() == 0)
        return true;
    if (c.K != 0)
        return false;
    if (c.b.defined())
        c.out.copy_(c.b.expand(c.out.sizes()));
    else
        c.out.zero_();
    return true;
}

// The kernels' fp32 [M, N] output: the op's output itself when it is fp32, else a scratch buffer that finish() copies
// into it (rounding once to x's dtype).
class F32Out {
public:
    F32Out(const at::Tensor &out, int64_t M, int64_t N)
        : out_(out), buf_(out.scalar_type() == at::kFloat ? out.view({M, N})
                                                          : at::empty({M, N}, out.options().dtype(at::kFloat))) {}
    float *ptr() const { return buf_.data_ptr<float>(); }
    const at::Tensor &finish() const {
        if (buf_.data_ptr() != out_.data_ptr())
            out_.view(buf_.sizes()).copy_(buf_);
        return out_;
    }

private:
    at::Tensor out_, buf_;
};

// Threads over contiguous slices of N (each streams its own weight rows); one thread below ~256K MACs.
template <class F> void over_columns(int64_t M, int64_t N, int64_t K, const F &fn) {
    const int64_t T = M * N * K < (int64_t{1} << 18) ? 1 : std::max<int64_t>(1, at::get_num_threads());
    const int64_t slice = std::max<int64_t>(kA8BlockRows, (N + T - 1) / T);
    if (T == 1) {
        fn(0, N);
        return;
    }
    parallel_for(0, (N + slice - 1) / slice, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
            fn(t * slice, std::min(N, (t + 1) * slice));
    });
}

// bf16 x on a CPU that multiplies bf16 pairs in hardware (AVX512_BF16), from bf16_dense_min_rows() rows: the weight is
// dequantized in blocks of rows, (u - z) * s exact in fp32 and then rounded to bf16 (RNE, as autocast rounds an fp32
// weight), into a bounded buffer (kBf16BlockBytes, freed with the call; never a kept copy), and each block is
// multiplied by fused_linear's bf16 CPU forward (vdpbf16ps on bf16 pairs, fp32 accumulation, one rounding). The tile
// kernel widens x to fp32 and multiplies at the fp32 rate, half of vdpbf16ps's: at compute-bound M it ran at 0.5x
// eager bf16 F.linear on the bf16 weight. Measured on AMD EPYC Zen 4, 2 threads, ms:
//  * `fastdl bench int4 --quick --x-dtype bfloat16` (weights cold), groups of 128, tiles -> this route (eager bf16
//    F.linear on the bf16 weight): M = 128 4096 x 4096 22.0 -> 11.5 (11.1), 4096 -> 11008 71.1 -> 30.8 (30.2); M = 16
//    3.48 -> 2.52 (2.98), 9.95 -> 6.27 (8.13). (Dequantizing through an fp32 row and integer rounding, before
//    vcvtne2ps2bf16: 13.6 and 37.6 at M = 128.)
//  * the threshold (medians of 7 calls, warm, two runs each, tiles / route): 4096 x 4096 M = 3 1.00-1.39 /
//    1.68-1.71, M = 8 1.69-1.94 / 1.62-1.94, M = 16 2.93-3.42 / 2.53-2.89, M = 32 5.38-5.75 / 3.70-5.17; 11008 ->
//    4096 M = 16 8.01-8.47 / 7.27-7.66, M = 32 16.3-16.9 / 11.9-12.4. From 16 rows.
//  * the block: fused_linear's bf16 forward over a 4096 x 4096 weight cut in blocks of 256 / 1024 rows, M = 128,
//    12.2 / 10.5 ms (whole: 10.7); fp32 blocks (rounded in the kernel) 15.4 / 12.8. Blocks of 8 MiB of bf16.
constexpr int64_t kBf16BlockBytes = int64_t{8} << 20;

int64_t bf16_dense_min_rows() {
    static const int64_t rows = rows_or_env("FASTDL_INT4_BF16_DENSE_ROWS", kBf16DenseMinRows);
    return rows;
}

// The rows from which W4A8 runs the family's GEMM (Kernels::a8_gemm_min_rows).
int64_t a8_gemm_min_rows() {
    static const int64_t rows = rows_or_env("FASTDL_INT4_A8_GEMM_ROWS", kernels().a8_gemm_min_rows);
    return rows;
}

bool bf16_dense(const at::Tensor &x, const Checked &c) {
    return x.scalar_type() == at::kBFloat16 && c.M >= bf16_dense_min_rows() && kernels().dequant_rows_bf16 &&
           fastdl::fused_linear::has_bf16_dot();
}

at::Tensor bf16_dense_route(const at::Tensor &x, const Checked &c) {
    const Kernels &kr = kernels();
    const int64_t M = c.M, N = c.N, K = c.K;
    const at::Tensor x2 = x.reshape({M, K}).contiguous();
    const int64_t nb = std::clamp<int64_t>(kBf16BlockBytes / (2 * K), 1, N);
    at::Tensor wblock = at::empty({nb, K}, x.options());
    uint16_t *wp = reinterpret_cast<uint16_t *>(wblock.data_ptr<at::BFloat16>());
    const at::Tensor res = c.out.view({M, N});
    const Int4Args a = c.args<Int4Args>(nullptr);
    for (int64_t n0 = 0; n0 < N; n0 += nb) {
        const int64_t rows = std::min(nb, N - n0);
        parallel_for(0, rows, std::max<int64_t>(1, 16384 / K),
                     [&](int64_t r0, int64_t r1) { kr.dequant_rows_bf16(a, n0 + r0, n0 + r1, wp + r0 * K); });
        std::optional<at::Tensor> b;
        if (c.b.defined())
            b = c.b.narrow(0, n0, rows);
        res.narrow(1, n0, rows).copy_(fastdl::fused_linear::linear_forward(x2, wblock.narrow(0, 0, rows), b));
    }
    return c.out;
}

// The family's stream_max_rows (FASTDL_INT4_STREAM_ROWS overrides it).
int64_t stream_max_rows() {
    static const int64_t rows = rows_or_env("FASTDL_INT4_STREAM_ROWS", kernels().stream_max_rows);
    return rows;
}

// Float x: the bf16 route above, else the streaming kernel (for bf16 x in the family's stream_bf16 window its bf16
// one), the tile kernel or fgemm by M (the family's limits; on the AVX-512 families fgemm_quantized_weight runs the pb
// kernel, from the rows fused_linear::held_pb_min_rows gives).
at::Tensor weight_only_route(const at::Tensor &x, const Checked &c) {
    const Kernels &kr = kernels();
    const int64_t M = c.M, N = c.N, K = c.K;
    if (bf16_dense(x, c))
        return bf16_dense_route(x, c);
    const bool bf16_stream = x.scalar_type() == at::kBFloat16 && kr.stream_bf16 && M >= kr.stream_bf16_rows[0] &&
                             M <= kr.stream_bf16_rows[1] && c.group >= kr.stream_bf16_min_group &&
                             fastdl::fused_linear::has_bf16_dot();
    const int64_t stream_rows = stream_max_rows();
    const bool pb = M >= fastdl::fused_linear::held_pb_min_rows(fastdl::fused_linear::Held::Int4);
    const bool tiles = !bf16_stream && M > stream_rows && M <= kr.tiles_max_rows && kr.tiles && !pb;
    const bool fgemm = !bf16_stream && M > stream_rows && !tiles && x.scalar_type() != at::kHalf;
    if (fgemm) { // x fp32 / bf16 as it is
        namespace fl = fastdl::fused_linear;
        const at::Tensor x2 = x.reshape({M, K}).contiguous();
        fl::Int4Weight w4;
        w4.q = c.q.data_ptr<uint8_t>();
        w4.scales = reinterpret_cast<const uint16_t *>(c.s.data_ptr<at::Half>());
        w4.zeros = c.z.defined() ? c.z.data_ptr<uint8_t>() : nullptr;
        w4.group = c.group;
        const fl::DType xd = x2.scalar_type() == at::kFloat ? fl::DType::F32 : fl::DType::BF16;
        if (fl::fgemm_quantized_weight(x2.data_ptr(), xd, K, M, fl::Int8Weight{}, w4, N, K,
                                       c.b.defined() ? c.b.data_ptr<float>() : nullptr, c.out.data_ptr(), xd))
            return c.out;
    }
    // x as the kernel reads it: bf16 as given for stream_bf16, else fp32
    const at::Tensor xk = x.reshape({M, K}).to(bf16_stream ? at::kBFloat16 : at::kFloat).contiguous();
    F32Out of(c.out, M, N);
    Int4Args a = c.args<Int4Args>(of.ptr());
    if (bf16_stream)
        a.xh = reinterpret_cast<const uint16_t *>(xk.data_ptr<at::BFloat16>());
    else
        a.x = xk.data_ptr<float>();
    a.ldx = K;
    const auto fn = bf16_stream ? kr.stream_bf16 : tiles ? kr.tiles : kr.stream;
    over_columns(M, N, K, [&](int64_t n0, int64_t n1) { fn(a, n0, n1); });
    return of.finish();
}

// W4A8: x quantized per row and group (threads over rows), then the integer kernel over slices of N (every M: the
// weight rows of a block stay in cache while all row tiles run over them).
at::Tensor a8_route(const at::Tensor &x, const Checked &c) {
    const int64_t M = c.M, N = c.N, K = c.K, G = c.groups;
    const Kernels &kr = kernels();
    const at::Tensor xf = x.reshape({M, K}).to(at::kFloat).contiguous();
    at::Tensor qx = at::empty({M, K}, x.options().dtype(at::kChar));
    const int64_t ldg = (G + 7) / 8 * 8; // padded with zeros: the kernels read 8 groups at once
    at::Tensor sx = at::zeros({M, ldg}, x.options().dtype(at::kFloat));
    at::Tensor sumx = at::zeros({M, ldg}, x.options().dtype(at::kInt));
    QuantX qp;
    qp.x = xf.data_ptr<float>();
    qp.ldx = K;
    qp.K = K;
    qp.group = c.group;
    qp.qx = qx.data_ptr<int8_t>();
    qp.sx = sx.data_ptr<float>();
    qp.sumx = sumx.data_ptr<int32_t>();
    const bool gemm = kr.a8_gemm != nullptr && M >= a8_gemm_min_rows();
    qp.natural = gemm;
    parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) { kr.quantize_x(qp, m0, m1); });
    F32Out of(c.out, M, N);
    A8Args a = c.args<A8Args>(of.ptr());
    a.qx = qp.qx;
    a.sx = qp.sx;
    a.sumx = qp.sumx;
    over_columns(M, N, K, [&](int64_t n0, int64_t n1) { (gemm ? kr.a8_gemm : kr.a8)(a, n0, n1); });
    return of.finish();
}

// int4_weight_only_linear (A8 false) and int4_a8_linear (A8 true): one schema, the same checks, then the op's route.
template <bool A8>
at::Tensor int4_linear(const at::Tensor &x, const at::Tensor &qweight, const at::Tensor &scales,
                       const c10::optional<at::Tensor> &zeros, const c10::optional<at::Tensor> &bias,
                       int64_t group_size) {
    Checked c =
        check_args(A8 ? "int4_a8_linear" : "int4_weight_only_linear", x, qweight, scales, zeros, bias, group_size);
    if (trivial(c))
        return c.out;
    return A8 ? a8_route(x, c) : weight_only_route(x, c);
}

} // namespace
} // namespace int4
} // namespace fastdl

TORCH_LIBRARY_IMPL(fastdl_cpp, CPU, m) {
    m.impl("int4_weight_only_linear", TORCH_FN(fastdl::int4::int4_linear<false>));
    m.impl("int4_a8_linear", TORCH_FN(fastdl::int4::int4_linear<true>));
}
