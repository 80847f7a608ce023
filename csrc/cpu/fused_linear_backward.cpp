// The backward op of the fused linear layer on CPU (fastdl_cpp::fused_linear_backward; registered in
// fused_linear.cpp): step 1, one elementwise pass for dpre = grad_out * act'(preact) and grad_bias; steps 2 and 3,
// grad_x and grad_weight, each through a choose_*_path rule that carries the numbers behind it and a driver of
// fused_linear_drivers.cpp. The overview of the paths per family is at the top of fused_linear.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <tuple>

#include "fused_linear_host.h"
#include "fused_linear_kernels.h"
#include "parallel.h"

namespace fastdl {
namespace fused_linear {
namespace {

// Path rules of the backward ("pb": the packed-B kernels, run_pb; the forward's rule is fwd_bf16_pb in
// fused_linear.cpp). The numbers are us (ms where marked) on the dev machine (Zen 5, 2 threads), old path -> pb,
// measured interleaved in one process.
// bf16 grad_x (M, K, N): pb when M > 16 (the small-M kernel below) and N * K <= 4M or M >= 512, else the packed GEMM
// (run_gemm_bf16):
//   pb:   32,512,512 42 -> 35 | 359,64,512 111 -> 40 | 512,128,128 58 -> 28 | 359,512,512 298 -> 214 |
//         4096,256,1024 2680 -> 2360 | 128,2048,2048 1490 -> 1350 | 512,4096,4096 ms 20.4 -> 19.9
//   kept: 16,512,512 22 vs 26 | 64,4096,4096 ms 4.6 vs 5.0 | 256,4096,4096 ms 11.2 vs 11.5
bool gx_bf16_pb(int64_t M, int64_t N, int64_t K) {
    return M > kSmallGradXMax && (N * K <= (int64_t{1} << 22) || M >= 512);
}
// bf16 grad_weight: pb when M > 16 (the small-M kernel below): 24,512,512 44 = 44 | 359,64,512 113 -> 42 |
// 359,512,512 317 -> 255 | 64,4096,4096 ms 5.8 -> 5.5 | 256,4096,4096 ms 12.7 -> 12.0; kept 16,512,512 20 vs 43.
// fp32 (AVX-512): pb replaces MKL's sgemm (at::mm, ~190 GFLOP/s on these shapes on this AMD CPU) for the forward at
// M > 64 (the small-M kernel below): 65,512,512 201 -> 96 | 359,512,512 932 -> 402 | 4096,256,1024 ms 9.9 -> 4.8 |
// 65,4096,4096 ms 16.6 -> 7.3 | 512,4096,4096 ms 88 -> 38; for grad_x at M >= 2: 2,512,512 35 -> 29 | 16,512,512
// 101 -> 38 | 359,512,512 950 -> 407, kept 1,512,512 19 vs 44 | 1,4096,4096 ms 2.1 vs 3.4; for grad_weight at M >= 2
// or N * K >= 1M: 2,512,512 90 -> 38 | 359,512,512 986 -> 476 | 1,4096,4096 ms 13.2 -> 4.4, kept 1,512,512 27 vs 56.
bool gx_f32_pb(int64_t M) {
    return M >= 2;
}
// fp32 grad_x with a large weight and M <= 64 (AVX-512 families): fgemm (fused_linear_avx2.cpp, strips of the weight
// packed per K block) instead of pb, which packs the whole weight per call. Zen 4, 1 thread, ms: 16,4096,4096 54 ->
// 10 | 64,4096,4096 58 -> 28; kept pb at 128,4096,4096 (98 vs 56 on Zen 4, whose 512-bit FMAs are double-pumped; on
// a CPU with full-width AVX-512 pb runs twice the FMA rate) and for small weights: 16,512,512 107 vs 128 us |
// 8,384,1536 144 vs 227 | 32,1536,384 401 vs 469.
bool gx_f32_fgemm(int64_t M, int64_t N, int64_t K) {
    return M >= 2 && M <= 64 && N * K >= (int64_t{1} << 22);
}
bool gw_f32_pb(int64_t M, int64_t N, int64_t K) {
    return M >= 2 || N * K >= (int64_t{1} << 20);
}
// fp32 on Intel cores, where MKL's sgemm (at::mm) runs near the FMA peak (on the AMD dev machines it ran 2-3x slower
// than pb): grad_x always, grad_weight for weights of at most 1M elements. Intel Xeon (family 6 model 207, AVX-512),
// us, MKL vs fastdl (pb, or fgemm for grad_x of large weights at M <= 64), (M, K, N), 2 threads: grad_x 64,512,512
// 148 vs 174 | 16,512,512 37 vs 81 | 359,512,512 695 vs 730 | 128,1024,1024 1058 vs 1243 | 64,4096,4096 ms 10.4 vs
// 19.4 | 128,4096,4096 ms 17.2 vs 20.7 | 1,4096,4096 ms 2.29 vs 2.56 | 512,4096,4096 ms 58.5 vs 65.1; grad_weight
// 64,64,512 22 vs 55 | 64,512,512 147 vs 168 | 359,512,512 668 vs 713 | 128,1024,1024 975 vs 1073, kept (N * K = 16M)
// 64,4096,4096 ms 22.4 vs 16.8 | 128,4096,4096 ms 30.3 vs 24.3 | 512,4096,4096 ms 71.6 vs 66.8; 1 thread the same
// order (64,512,512 grad_x 214 vs 338, grad_weight 232 vs 296).
constexpr int64_t kGwF32IntelMklMax = int64_t{1} << 20;
// bf16 on the AVX-512 F family (no AVX512_BF16): from M = 33 (as the forward) both GEMMs on the fp32 pb kernels, dpre
// written in fp32 (holding the bf16-rounded values) and x widened once, the weight widened (fp32 master weights
// rounded to bf16) as it is packed, instead of fgemm's 8-lane tiles. Intel Xeon (family 6 model 207), 2 threads,
// bf16 autocast training step of a gelu layer (forward and backward), ms, two alternating runs, fgemm -> pb (eager
// fp32 step): 64x512x512 1.10-1.23 -> 0.80-0.85 (0.75-0.88) | 359x512x512 3.73-3.82 -> 2.66-2.72 (2.49-2.52) |
// 128x4096^2 93-100 -> 67-72 (64-66) | 512x4096^2 315-326 -> 206-211 (194-197).
constexpr int64_t kBf16PbMinM = 32;
// AVX2 family (no AVX-512), a forward K <= 192 from 256 rows: MKL's sgemm (at::mm) for grad_x, and for grad_weight
// while N <= 512, on dpre written in fp32 (bf16 training: fp32 holding the bf16-rounded values, so the products are
// the same as fgemm's). With so few output columns (K) fgemm's packing of the whole dpre (a round trip through memory)
// is not repaid. Zen 2, 2 threads, ms, fgemm vs at::mm (fp32 dpre, bf16 grad_x cast included), (M, K, N):
//   grad_x: 4096,64,512 2.22 vs 1.93 | 4096,32,1024 3.66 vs 2.46 | 4096,128,1024 8.93 vs 7.28 | 256,64,256 0.134 vs
//   0.083 | 4096,192,1024 12.0 vs 11.1 | kept 4096,256,1024 14.4 vs 14.5;
//   grad_weight: 4096,64,512 2.93 vs 2.27 | 4096,128,256 2.69 vs 1.93 | 256,192,256 0.263 vs 0.183 | kept N >= 1024:
//   4096,64,1024 6.0 vs 6.9 | 4096,128,2048 17.4 vs 20.1 | 256,32,1024 0.228 vs 0.290.
bool gx_aten_small_k(int64_t M, int64_t K) {
    return K <= 192 && M >= 256;
}
bool gw_aten_small_k(int64_t M, int64_t N, int64_t K) {
    return gx_aten_small_k(M, K) && N <= 512;
}

// ---- Backward, in named steps: backward_dpre (step 1), then grad_x and grad_weight, each through its choose_*_path
// rule (the numbers behind each rule are at gx_bf16_pb, gx_f32_pb, gx_f32_fgemm, gw_f32_pb above).

// What the family of this process offers the backward for compute dtype c and this weight.
struct BackwardFamily {
    bool fast_bf16 = false;   // AVX512_BF16: pb, packed bf16 GEMM and small-M kernels
    bool f32_pb = false;      // AVX-512 F with an fp32 weight: the fp32 pb kernels
    bool f32_pb_bf16 = false; // AVX-512 F without AVX512_BF16, bf16: the fp32 pb kernels on an fp32 dpre, M > 32
    bool fg = false;          // fgemm for both GEMMs: the AVX2 family (bf16, fp32), the AVX-512 F family's bf16
    bool fg_gx = false;       // fgemm for grad_x: as fg, plus AVX-512 fp32 grad_x of large weights at M <= 64
    bool avx2 = false;        // fg without AVX-512: MKL's sgemm at small K (gx_aten_small_k, gw_aten_small_k)
};

BackwardFamily backward_family(at::ScalarType c, at::ScalarType wt, int64_t M, int64_t N, int64_t K) {
    const Kernels &kr = kernels();
    BackwardFamily f;
    f.fast_bf16 = c == at::kBFloat16 && kr.pb_bf16.block && kr.gemm_bf16.tile && kr.small_bf16.grad_x;
    f.f32_pb = c == at::kFloat && kr.pb_f32.block && kr.pb_f32.pack_a && wt == at::kFloat;
    f.f32_pb_bf16 = c == at::kBFloat16 && kr.pb_f32.block && kr.pb_f32.pack_a && !kr.pb_bf16.block && M > kBf16PbMinM;
    f.fg = kr.fgemm.block && (c == at::kBFloat16 || (c == at::kFloat && !kr.pb_f32.block));
    f.fg_gx = f.fg || (kr.fgemm.block && f.f32_pb && gx_f32_fgemm(M, N, K));
    f.avx2 = f.fg && !kr.pb_f32.block;
    return f;
}

// Step 1: dpre = g * act'(p) (fp32) -> grad_bias (fp32 column sums, into gb when need_gb) and dpre_c = round_c(dpre)
// as [M, N] (returned when need_d; fp16: computed in fp32, rounded here), one pass over grad_out and preact. d_f32:
// dpre_c stored in fp32 (bf16: the rounded values), for MKL's sgemm.
at::Tensor backward_dpre(const at::Tensor &grad_out, const at::Tensor &preact, const at::Tensor &x, Act act, int64_t M,
                         int64_t N, bool need_d, bool d_f32, bool need_gb, at::Tensor &gb) {
    const Kernels &kr = kernels();
    const auto c = x.scalar_type();
    const at::Tensor g2 = as_matrix(grad_out, M, N);
    at::Tensor dpre;
    const bool dpre_is_g = need_d && !d_f32 && act == Act::None && g2.scalar_type() == c; // round_c(g) == g
    if (dpre_is_g)
        dpre = g2;
    else if (need_d) { // internal: a kept buffer (a fresh 8 MB one: page faults, grad_x-only backward M = 4096,
                       // K = 256, N = 1024 gelu 5.0 -> 4.1 ms)
        const auto dt = c == at::kHalf || d_f32 ? at::kFloat : c;
        const Scratch ds = thread_scratch(kDpreSlot, at::elementSize(dt) * M * N);
        dpre = at::from_blob(ds.ptr, {M, N}, x.options().dtype(dt));
    }
    if (need_gb || (need_d && !dpre_is_g)) {
        const at::Tensor p2 = act != Act::None ? as_matrix(preact, M, N) : at::Tensor();
        DpreArgs a;
        a.g = g2.data_ptr();
        a.ld_g = N;
        a.g_dtype = dtype_of(g2.scalar_type());
        if (act != Act::None) {
            a.p = p2.data_ptr();
            a.ld_p = N;
            a.p_dtype = dtype_of(p2.scalar_type());
        }
        a.act = act;
        if (need_d && !dpre_is_g) {
            a.dpre = dpre.data_ptr();
            a.ld_dpre = N;
            a.dpre_dtype = dtype_of(dpre.scalar_type());
            a.dpre_round_bf16 = c == at::kBFloat16 && a.dpre_dtype == DType::F32;
        }
        // Tasks: blocks of kDpreRows whole rows (contiguous streams: splitting the columns between the threads made
        // each read 1 KB of every 2 KB row, which the prefetchers did not follow: M = 4096, N = 1024 gelu, grad_bias
        // only, grad_out / preact in DRAM: 3.0 -> 1.3 ms; preact fresh from the forward: 3.5 -> 1.4 ms), columns split
        // too only when there are few blocks. grad_bias: per-block partial sums, added in block order afterwards (the
        // same result for any split and thread count).
        const int64_t blocks = (M + kDpreRows - 1) / kDpreRows;
        const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
        int64_t cw = N;
        if (blocks < 2 * nt)
            cw = std::max<int64_t>(256, ((N + 2 * nt - 1) / (2 * nt) + 15) / 16 * 16);
        const int64_t cchunks = (N + cw - 1) / cw, tasks = blocks * cchunks;
        const Scratch ps = thread_scratch(kSharedSlot, need_gb ? sizeof(float) * blocks * N : 0);
        float *partial = need_gb ? static_cast<float *>(ps.ptr) : nullptr;
        // ~32K elements per task at least
        const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, kDpreRows * std::min(cw, N)));
        parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; ++t) {
                const int64_t b = t / cchunks, c0 = (t % cchunks) * cw;
                kr.dpre_pass(a, b * kDpreRows, std::min(M, (b + 1) * kDpreRows), c0, std::min(N, c0 + cw), partial, N);
            }
        });
        if (need_gb) {
            float *gbp = gb.data_ptr<float>();
            parallel_for(0, N, std::max<int64_t>(64, 65536 / std::max<int64_t>(blocks, 1)),
                         [&](int64_t c0, int64_t c1) { dpre_sum_blocks(partial, N, blocks, c0, c1, gbp); });
        }
    }
    if (c == at::kHalf && need_d)
        dpre = dpre.to(c);
    return dpre;
}

Epilogue store_only(const at::Tensor &out, int64_t ld, DType dt, bool stream) {
    Epilogue e;
    e.out = out.data_ptr();
    e.ld_out = ld;
    e.out_dtype = dt;
    e.stream = stream;
    return e;
}

// ---- Step 2: grad_x = dpre_c @ w_c -> [M, K] in c.
enum class GradXPath { Zeros, PbBf16, PbF32, SmallBf16, GemmBf16, Fgemm, AtenF32, AtenRounded };

// AVX512_BF16: pb (gx_bf16_pb: M > 16 and a small weight or M >= 512; 359,512,512 298 -> 214 us), else M <= 16 the
// small-M kernel streaming the weight rows once (16,512,512 22 vs 26 us for pb), else the packed bf16 GEMM
// (64,4096,4096 4.6 vs 5.0 ms for pb). AVX-512 fp32: pb from M = 2 (gx_f32_pb: 16,512,512 101 -> 38 us vs at::mm)
// unless fgemm takes it (gx_f32_fgemm: large weight, M <= 64: 16,4096,4096 54 -> 10 ms). AVX2 family / AVX-512 F's
// bf16: fgemm. Otherwise (scalar family, fp16, AVX-512 fp32 at M = 1: 1,4096,4096 2.1 vs 3.4 ms for pb) at::mm.
GradXPath choose_grad_x_path(const BackwardFamily &f, at::ScalarType c, int64_t M, int64_t N, int64_t K) {
    if (M == 0 || N == 0 || K == 0)
        return GradXPath::Zeros;
    if (f.fast_bf16 && gx_bf16_pb(M, N, K))
        return GradXPath::PbBf16;
    if (f.f32_pb && cpu::vendor_intel()) // MKL's sgemm on Intel cores (kGwF32IntelMklMax)
        return GradXPath::AtenF32;
    if ((f.f32_pb && gx_f32_pb(M) && !f.fg_gx) || f.f32_pb_bf16)
        return GradXPath::PbF32;
    if (f.fast_bf16)
        return M <= kSmallGradXMax ? GradXPath::SmallBf16 : GradXPath::GemmBf16;
    if (f.fg_gx && !(f.avx2 && gx_aten_small_k(M, K)))
        return GradXPath::Fgemm;
    return c == at::kFloat ? GradXPath::AtenF32 : GradXPath::AtenRounded;
}

at::Tensor backward_grad_x(GradXPath path, const at::Tensor &dpre, const at::Tensor &w, const at::Tensor &x, int64_t M,
                           int64_t N, int64_t K) {
    const Kernels &kr = kernels();
    const auto c = x.scalar_type();
    const DType wd = dtype_of(w.scalar_type());
    if (path == GradXPath::Zeros)
        return at::zeros({M, K}, x.options());
    if (path == GradXPath::AtenF32)
        return at::mm(dpre, w);
    if (path == GradXPath::AtenRounded)
        return at::mm(dpre.to(at::kFloat), w.to(c).to(at::kFloat)).to(c);
    at::Tensor gx = empty_output({M, K}, x.options());
    switch (path) {
    case GradXPath::PbBf16: {
        const GemmOperand wb{w.data_ptr(), K, wd, false};
        run_pb(
            DType::BF16, dpre.data_ptr(), N, PbA::Rows, M, K, N,
            [&](int64_t p0, int64_t p1, uint32_t *bp) { kr.pb_bf16.pack_rows(wb, K, N, p0, p1, bp); },
            store_only(gx, K, DType::BF16, false));
        break;
    }
    case GradXPath::PbF32: { // (bf16 x: dpre in fp32, the weight bf16 or fp32 rounded to bf16)
        const GemmOperand wb{w.data_ptr(), K, wd, false, c == at::kBFloat16 && wd == DType::F32};
        run_pb(
            DType::F32, dpre.data_ptr(), N, PbA::Rows, M, K, N,
            [&](int64_t p0, int64_t p1, uint32_t *bp) { kr.pb_f32.pack_rows(wb, K, N, p0, p1, bp); },
            store_only(gx, K, dtype_of(c), false));
        break;
    }
    case GradXPath::SmallBf16: { // stream the weight rows once (threads split the columns of grad_x)
        const int64_t grain = std::max<int64_t>(64, (int64_t{1} << 18) / std::max<int64_t>(1, M * N));
        parallel_for(0, K, grain, [&](int64_t k0, int64_t k1) {
            const Scratch ws = thread_scratch(kTaskSlot, small_grad_x_workspace_bytes(M, k1 - k0));
            kr.small_bf16.grad_x(dpre.data_ptr(), N, M, w.data_ptr(), wd, K, N, k0, k1, gx.data_ptr(), K, ws.ptr);
        });
        break;
    }
    case GradXPath::GemmBf16:
        run_gemm_bf16({dpre.data_ptr(), N, DType::BF16, false}, {w.data_ptr(), K, wd, false}, M, K, N,
                      store_only(gx, K, DType::BF16, false));
        break;
    case GradXPath::Fgemm: { // A = dpre, B = the weight's rows
        FgemmArgs g;
        g.a = GemmOperand{dpre.data_ptr(), N, dtype_of(dpre.scalar_type()), false};
        g.b = GemmOperand{w.data_ptr(), K, wd, false};
        g.round_b = c == at::kBFloat16 && w.scalar_type() == at::kFloat;
        g.M = M;
        g.N = K;
        g.K = N;
        run_fgemm(g, store_only(gx, K, dtype_of(c), false));
        break;
    }
    default:
        break;
    }
    return gx;
}

// ---- Step 3: grad_weight = dpre_c^T @ x_c, fp32 accumulation, in weight.dtype.
enum class GradWPath { Zeros, PbBf16, PbF32, SmallBf16, Fgemm, AtenF32, AtenRounded };

// AVX512_BF16: pb for M > 16 (359,512,512 317 -> 255 us), else the small-M rank-M update (16,512,512 20 vs 43 us for
// pb). AVX-512 fp32: pb (gw_f32_pb: M >= 2 or N * K >= 1M; 359,512,512 986 -> 476 us vs at::mm), at M = 1 with a
// small weight at::mm (1,512,512 27 vs 56 us). AVX2 family / AVX-512 F's bf16: fgemm. Otherwise at::mm.
GradWPath choose_grad_weight_path(const BackwardFamily &f, at::ScalarType c, int64_t M, int64_t N, int64_t K) {
    if (M == 0 || N == 0 || K == 0)
        return GradWPath::Zeros;
    if (f.fast_bf16)
        return M > kSmallGradXMax ? GradWPath::PbBf16 : GradWPath::SmallBf16;
    if (f.f32_pb && cpu::vendor_intel() && N * K <= kGwF32IntelMklMax) // MKL's sgemm on Intel cores (kGwF32IntelMklMax)
        return GradWPath::AtenF32;
    if ((f.f32_pb && gw_f32_pb(M, N, K)) || f.f32_pb_bf16)
        return GradWPath::PbF32;
    if (f.fg && !(f.avx2 && gw_aten_small_k(M, N, K)))
        return GradWPath::Fgemm;
    return c == at::kFloat ? GradWPath::AtenF32 : GradWPath::AtenRounded;
}

at::Tensor backward_grad_weight(GradWPath path, const at::Tensor &dpre, const at::Tensor &x2, const at::Tensor &weight,
                                int64_t M, int64_t N, int64_t K) {
    const Kernels &kr = kernels();
    if (path == GradWPath::Zeros)
        return at::zeros({N, K}, weight.options());
    if (path == GradWPath::AtenF32)
        return at::mm(dpre.t(), x2);
    if (path == GradWPath::AtenRounded)
        return at::mm(dpre.to(at::kFloat).t(), x2.to(at::kFloat)).to(weight.scalar_type());
    at::Tensor gw = empty_output({N, K}, weight.options());
    const DType wd = dtype_of(weight.scalar_type());
    // grad_weight is not read back by this op: streaming stores skip the read-for-ownership traffic (also for a
    // grad_weight that fits the L3: 64,384,1536 fp32 797 vs 937 us with normal stores)
    const Epilogue e = store_only(gw, K, wd, true);
    switch (path) {
    case GradWPath::PbBf16: {
        // B = x packed per thread. A = dpre^T: read in place with its pairs interleaved on the fly when grad_weight
        // has at most 3 panels (K <= 128), packed once (shared) otherwise - the on-the-fly interleave is redone
        // per panel: 359,64,512 69 -> 51 us, 512,128,128 48 -> 31 us, but 359,512,512 252 vs 266 us and
        // 4096,256,1024 3.4 vs 4.1 ms.
        const GemmOperand xb{x2.data_ptr(), K, DType::BF16, false};
        auto pack_x = [&](int64_t p0, int64_t p1, uint32_t *bp) { kr.pb_bf16.pack_rows(xb, K, M, p0, p1, bp); };
        if (K <= 128) {
            run_pb(DType::BF16, dpre.data_ptr(), N, PbA::Cols, N, K, M, pack_x, e);
            break;
        }
        const Scratch ap = thread_scratch(kSharedSlot, sizeof(uint16_t) * gemm_packed_a_elems(N, M));
        uint16_t *app = static_cast<uint16_t *>(ap.ptr);
        const GemmOperand at_{dpre.data_ptr(), N, DType::BF16, true};
        const int64_t apanels = (N + kGemmMR - 1) / kGemmMR, pairs = (apanels + 1) / 2;
        parallel_for(0, pairs, std::max<int64_t>(1, 4096 / std::max<int64_t>(M, 1)), [&](int64_t p0, int64_t p1) {
            kr.gemm_bf16.pack_a(at_, N, M, 2 * p0, std::min(apanels, 2 * p1), app);
        });
        run_pb(DType::BF16, app, 0, PbA::Packed, N, K, M, pack_x, e);
        break;
    }
    case GradWPath::PbF32: {
        // A = dpre^T in panels of 8 rows (shared, plain 8-float copies), B = x rows packed per thread
        const int64_t apanels = (N + kGemmMR - 1) / kGemmMR;
        const Scratch ap = thread_scratch(kSharedSlot, sizeof(float) * apanels * kGemmMR * M);
        float *app = static_cast<float *>(ap.ptr);
        const float *dp = dpre.data_ptr<float>();
        parallel_for(0, apanels, std::max<int64_t>(1, 8192 / std::max<int64_t>(M, 1)),
                     [&](int64_t p0, int64_t p1) { kr.pb_f32.pack_a(dp, N, N, M, p0, p1, app); });
        const GemmOperand xb{x2.data_ptr(), K, dtype_of(x2.scalar_type()), false}; // (bf16 x: widened as packed)
        run_pb(
            DType::F32, app, 0, PbA::Packed, N, K, M,
            [&](int64_t p0, int64_t p1, uint32_t *bp) { kr.pb_f32.pack_rows(xb, K, M, p0, p1, bp); }, e);
        break;
    }
    case GradWPath::SmallBf16: { // rank-M update written row by row (threads split the rows of grad_weight)
        const int64_t grain = std::max<int64_t>(8, (int64_t{1} << 18) / std::max<int64_t>(1, M * K));
        parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
            const Scratch ws = thread_scratch(kTaskSlot, small_grad_w_workspace_bytes(M, K));
            kr.small_bf16.grad_w(dpre.data_ptr(), N, x2.data_ptr(), K, M, K, n0, n1, gw.data_ptr(), wd, K, ws.ptr);
        });
        break;
    }
    case GradWPath::Fgemm: { // A = dpre^T, B = x
        FgemmArgs g;
        g.a = GemmOperand{dpre.data_ptr(), N, dtype_of(dpre.scalar_type()), true};
        g.b = GemmOperand{x2.data_ptr(), K, dtype_of(x2.scalar_type()), false};
        g.M = N;
        g.N = K;
        g.K = M;
        run_fgemm(g, e);
        break;
    }
    default:
        break;
    }
    return gw;
}

} // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor>
fused_linear_backward_cpu(const at::Tensor &grad_out, const at::Tensor &x, const at::Tensor &weight,
                          const at::Tensor &preact, c10::string_view activation, std::array<bool, 3> output_mask) {
    constexpr const char *fn = "fused_linear_backward";
    const auto [act, K, N, M, out_shape] = checked_geometry(x, weight, activation, fn);
    const auto c = x.scalar_type();
    check_optional(grad_out, "grad_out", out_shape, x, fn);
    if (act != Act::None)
        check_optional(preact, "preact", out_shape, x, fn);
    const bool need_gx = output_mask[0], need_gw = output_mask[1], need_gb = output_mask[2];
    const BackwardFamily fam = backward_family(c, weight.scalar_type(), M, N, K);

    at::Tensor gb =
        need_gb ? at::empty({N}, x.options().dtype(at::kFloat)) : at::empty({0}, x.options().dtype(at::kFloat));
    const GradXPath gx_path = choose_grad_x_path(fam, c, M, N, K);
    const GradWPath gw_path = choose_grad_weight_path(fam, c, M, N, K);
    // a bf16 dpre for MKL's sgemm would be widened to fp32 by at::mm's caller: write it in fp32 at once
    // (and for the fp32 pb kernels, which read dpre as fp32)
    const bool d_f32 =
        c == at::kBFloat16 && ((need_gx && (gx_path == GradXPath::AtenRounded || gx_path == GradXPath::PbF32)) ||
                               (need_gw && (gw_path == GradWPath::AtenRounded || gw_path == GradWPath::PbF32)));
    const at::Tensor dpre = backward_dpre(grad_out, preact, x, act, M, N, need_gx || need_gw, d_f32, need_gb, gb);
    at::Tensor gx = at::empty({0}, x.options());
    if (need_gx)
        gx = backward_grad_x(gx_path, dpre, weight.contiguous(), x, M, N, K).view(x.sizes());
    at::Tensor gw = at::empty({0}, weight.options());
    if (need_gw)
        gw = backward_grad_weight(gw_path, dpre, x.reshape({M, K}).contiguous(), weight, M, N, K);
    if (need_gb && M == 0)
        gb.zero_();
    return {gx, gw, gb};
}

} // namespace fused_linear
} // namespace fastdl
