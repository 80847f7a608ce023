// CPU implementation of fastdl_cpp::fused_linear / fused_linear_backward (schemas are defined in Python).
// This file holds the argument checks, the choice of kernel family (kernels(): one table per family, from the level of
// cpu_isa.h) and of path, threading (at::parallel_for) and the ATen GEMM calls; the SIMD kernels live in
// fused_linear_avx512.cpp, fused_linear_avx2.cpp and fused_linear_scalar.cpp (no torch headers there).
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
//   AVX-512 families, fp32: M <= 64 small-M FMA kernel, M > 64 the oneDNN route for K >= 128 (fwd_f32_onednn: 1.0-2.2x
//     the fp32 pb kernel), else the fp32 pb kernel (MKL's sgemm is 2-3x slower on this AMD CPU at every M measured).
//   AVX2 family (bf16 and fp32) and the bf16 of the AVX-512 F family (no AVX512_BF16): fp32 FMA kernels that read the
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
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu_isa.h"
#include "fused_linear_api.h"
#include "fused_linear_kernels.h"
#include "fused_linear_onednn.h"
#include "parallel.h"

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

Act parse_activation(c10::string_view s, const char *fn) {
    Act act = Act::None;
    TORCH_CHECK_VALUE(find_activation(std::string_view(s.data(), s.size()), act), fn, ": activation must be one of ",
                      activation_names(), ", got '", std::string(s.data(), s.size()), "'");
    return act;
}

bool native_io(at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16;
}
DType dtype_of(at::ScalarType t) {
    return t == at::kFloat ? DType::F32 : DType::BF16;
}

// t viewed as a contiguous [rows, cols] matrix in a dtype the kernels read natively (others are converted to fp32).
at::Tensor as_matrix(const at::Tensor &t, int64_t rows, int64_t cols) {
    at::Tensor m = t.reshape({rows, cols});
    if (!native_io(m.scalar_type()))
        m = m.to(at::kFloat);
    return m.contiguous();
}

int64_t leading_rows(const at::Tensor &t) {
    int64_t m = 1;
    for (int64_t d = 0; d + 1 < t.dim(); ++d)
        m *= t.size(d);
    return m;
}

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

void check_optional(const at::Tensor &t, const char *name, at::IntArrayRef shape, const at::Tensor &x, const char *fn) {
    TORCH_CHECK(at::isFloatingType(t.scalar_type()), fn, ": ", name, " must be a floating-point tensor, got dtype ",
                t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), fn, ": ", name, " must be on device ", x.device(), " (the device of x), got ",
                t.device());
    TORCH_CHECK(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// Fresh multi-MB outputs are first touched by our kernels, one page fault per 4 KB page: for a 64 MB fp32
// grad_weight that is 16K faults, ~10 ms on the dev machine - more than computing it. Transparent huge pages cut that
// to 32 faults. The 2 MB-aligned interior of the buffer is advised MADV_HUGEPAGE and then populated in one
// madvise(MADV_POPULATE_WRITE) call from this thread, before the kernels' threads write it: left to fault in from the
// two threads' first writes, huge pages were fast in isolation but pathological right after an eager fp32 step (MKL)
// in the same process. Allocating + filling 64 MB on the 2-core Zen 4 (pure PyTorch, `torch.empty` + `fill_`, ms):
// 4 KB faults 17.0 (19.2 after an eager step), huge-page faults 5.6 (97.9 after an eager step: the fastdl training
// step at M = 1, 4096^2 took 87 ms instead of 15), advise + populate 8.8 (10.3 after an eager step). Populating 4 KB
// pages (30 ms) is slower than faulting them in from two threads, so nothing is done where THP is off ("never") or
// the kernel predates MADV_POPULATE_WRITE (Linux 5.14: EINVAL, then the pages fault in as before).
#if defined(__linux__) && defined(MADV_HUGEPAGE)
bool thp_available() {
    static const bool on = [] {
        FILE *f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
        if (f == nullptr)
            return false;
        char buf[128] = {};
        const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
        std::fclose(f);
        return n > 0 && std::strstr(buf, "[never]") == nullptr;
    }();
    return on;
}
#endif

at::Tensor empty_output(at::IntArrayRef shape, const at::TensorOptions &opts) {
    at::Tensor t = at::empty(shape, opts);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr uintptr_t kHuge = uintptr_t{2} << 20;
    if (t.nbytes() >= 4 * kHuge && thp_available()) {
        const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
        const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), e = (p + t.nbytes()) & ~(kHuge - 1);
        if (e > a && madvise(reinterpret_cast<void *>(a), e - a, MADV_HUGEPAGE) == 0) {
            constexpr int kPopulateWrite = 23; // MADV_POPULATE_WRITE (Linux 5.14); older headers lack the name
            madvise(reinterpret_cast<void *>(a), e - a, kPopulateWrite);
        }
    }
#endif
    return t;
}

// Scratch buffers kept per (thread, slot) and reused across calls: a fresh multi-MB buffer costs one page fault per
// 4 KB page on every call (the 11 MB packed operand of a 512 x 11008 GEMM: ~2.8K faults, ~2-3 ms; a 64 MB one: ~10 ms).
// Slot kSharedSlot holds buffers the calling thread shares with the team (packed GEMM operand, grad_bias partial sums),
// kTaskSlot per-task workspaces (including each thread's packed weight panels of the pb kernels: about one copy of the
// weight over all threads), kDpreSlot the backward's dpre. Requests above 64 MB are not kept (allocated per call).
// Memory is released at thread exit.
constexpr int kSharedSlot = 0, kTaskSlot = 1, kDpreSlot = 2;

struct Scratch {
    void *ptr = nullptr;
    at::Tensor holder; // defined only for buffers that are not kept
};

Scratch thread_scratch(int slot, size_t bytes) {
    constexpr size_t kKeepLimit = size_t{64} << 20;
    Scratch s;
    if (bytes + 64 > kKeepLimit) {
        s.holder = at::empty({static_cast<int64_t>(bytes + 64)}, at::TensorOptions().dtype(at::kByte));
        s.ptr = s.holder.data_ptr();
    } else {
        struct Buffer {
            std::unique_ptr<char[]> data;
            size_t size = 0;
        };
        thread_local Buffer kept[3];
        Buffer &b = kept[slot];
        if (b.size < bytes + 64) {
            b.data.reset(); // free first: never hold two big buffers at once
            b.data.reset(new char[bytes + 64]);
            b.size = bytes + 64;
        }
        s.ptr = b.data.get();
    }
    char *p = static_cast<char *>(s.ptr);
    s.ptr = p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64;
    return s;
}

// Epilogue over a full [M, N] fp32 accumulator, parallel over rows.
void run_epilogue(const Epilogue &e, const float *acc, int64_t M, int64_t N) {
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1));
    parallel_for(0, M, grain,
                 [&](int64_t r0, int64_t r1) { kernels().epilogue(e, acc + r0 * N, N, r0, r1 - r0, 0, N); });
}

// C[M, N] = A[M, K] * B[K, N] with the bf16 GEMM, then the epilogue on C. A is packed once (shared by all
// threads); the threads then split the (M block, 48-column panel) tiles, each packing its own B panels.
void run_gemm_bf16(const GemmOperand &a, const GemmOperand &b, int64_t M, int64_t N, int64_t K, const Epilogue &e) {
    if (M == 0 || N == 0)
        return;
    const Bf16Gemm &g = kernels().gemm_bf16;
    const Scratch ap = thread_scratch(kSharedSlot, sizeof(uint16_t) * gemm_packed_a_elems(M, K));
    uint16_t *app = static_cast<uint16_t *>(ap.ptr);
    const int64_t panels = (M + kGemmMR - 1) / kGemmMR;
    const int64_t pairs = (panels + 1) / 2;
    parallel_for(0, pairs, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)),
                 [&](int64_t p0, int64_t p1) { g.pack_a(a, M, K, 2 * p0, std::min(panels, 2 * p1), app); });
    const int64_t n_tiles = (N + kGemmNR - 1) / kGemmNR;
    const int64_t m_blocks = (M + kGemmMC - 1) / kGemmMC;
    parallel_for(0, m_blocks * n_tiles, 1, [&](int64_t t0, int64_t t1) {
        const Scratch ws = thread_scratch(kTaskSlot, gemm_workspace_bytes());
        for (int64_t t = t0; t < t1; ++t)
            g.tile(app, b, M, N, K, (t / n_tiles) * kGemmMC, (t % n_tiles) * kGemmNR, e, ws.ptr);
    });
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

// Packed-B GEMM (pb_* kernels). The work is laid out panel-major (panel of 48 columns, then groups of 8 rows), each
// group weighted by its panel's 16-column vectors (a last panel of 16 columns costs a third); each thread takes one
// contiguous share of equal cost, packs the B panels it touches into its own buffer and computes them, all in a single
// parallel region. No shared packed buffer: re-packing one that the other core read in the previous call costs a
// cache-line invalidation per line (2 threads ran slower than 1 at M = 16). Balanced to 8 rows: M = 359 on 2 threads
// gets 5.5 panels each, not the 256 + 103 rows of kFwdRowBlock blocks; 256 columns = 5 1/3 panels split 2 2/3 each
// (whole panels: 3 + 2 1/3, 13 % slower at M = 4096 grad_weight).
constexpr int64_t kPbRowBlock = 256; // rows per pass over the thread's panels (x block stays in L2)

template <class Pack>
void run_pb(DType compute, const void *a, int64_t lda, PbA a_mode, int64_t M, int64_t N, int64_t K, const Pack &pack,
            const Epilogue &e) {
    const PbKernels &pk = compute == DType::BF16 ? kernels().pb_bf16 : kernels().pb_f32;
    if (M == 0 || N == 0)
        return;
    const int64_t panels = (N + kGemmNR - 1) / kGemmNR, kpt = pb_kpt(K, compute);
    const int64_t groups = (M + kGemmMR - 1) / kGemmMR;
    auto nv = [&](int64_t p) { return (std::min<int64_t>(kGemmNR, N - p * kGemmNR) + 15) / 16; };
    const int64_t full = N / kGemmNR, total = groups * (full * 3 + (panels > full ? nv(full) : 0));
    // small problems (< ~256K multiply-adds per thread) use fewer threads
    const int64_t nt =
        std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), total, M * N * std::max<int64_t>(K, 1) >> 18}));
    parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t c0 = total * t / nt, c1 = total * (t + 1) / nt; // cost range, in (group x vector) units
            // row groups [g0, g1) of panel p (cost offset groups * 3 * p: only the last panel is narrower)
            auto range = [&](int64_t p, int64_t &g0, int64_t &g1) {
                const int64_t base = groups * 3 * p, w = nv(p);
                g0 = std::clamp<int64_t>((c0 - base + w - 1) / w, 0, groups);
                g1 = std::clamp<int64_t>((c1 - base + w - 1) / w, 0, groups);
                if (c0 < base)
                    g0 = 0;
                if (c1 < base)
                    g1 = 0;
            };
            const int64_t p0 = std::min(panels - 1, c0 / (groups * 3)), p1 = std::min(panels, c1 / (groups * 3) + 1);
            int64_t lo = p0, hi = p1; // drop panels without rows for this thread
            for (int64_t g0, g1; lo < hi && (range(lo, g0, g1), g0 >= g1);)
                ++lo;
            for (int64_t g0, g1; hi > lo && (range(hi - 1, g0, g1), g0 >= g1);)
                --hi;
            if (lo >= hi)
                continue;
            const Scratch ws = thread_scratch(kTaskSlot, sizeof(uint32_t) * (hi - lo) * kpt * kGemmNR);
            uint32_t *bp = static_cast<uint32_t *>(ws.ptr);
            pack(lo, hi, bp);
            for (int64_t b0 = 0; b0 < M; b0 += kPbRowBlock) {
                for (int64_t p = lo; p < hi; ++p) {
                    int64_t g0, g1;
                    range(p, g0, g1);
                    const int64_t r0 = std::max(b0, g0 * kGemmMR), r1 = std::min({b0 + kPbRowBlock, M, g1 * kGemmMR});
                    if (r0 < r1)
                        pk.block(a, lda, a_mode, K, bp + (p - lo) * kpt * kGemmNR, N, r0, r1, p * kGemmNR, e);
                }
            }
        }
    });
}

// fgemm (the AVX2 family; the AVX-512 F family's bf16 path): A packed once into fp32 panels (shared, in parallel),
// then each thread computes a contiguous range of 16-column units (it packs only the B blocks of its columns), or a
// range of rows when there are too few columns for the threads.
void run_fgemm(const FgemmArgs &g, const Epilogue &e) {
    const Fgemm &f = kernels().fgemm;
    const int64_t M = g.M, N = g.N, K = g.K;
    if (M == 0 || N == 0)
        return;
    const int64_t panels = (M + kFgMR - 1) / kFgMR;
    const Scratch ap = thread_scratch(kSharedSlot, sizeof(float) * fgemm_packed_a_floats(M, K));
    float *app = static_cast<float *>(ap.ptr);
    parallel_for(0, panels, std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1)),
                 [&](int64_t p0, int64_t p1) { f.pack_a(g, p0, p1, app); });
    // small problems (< ~256K multiply-adds per thread) use fewer threads
    const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (M * N * K) >> 18));
    const int64_t units = (N + kFgNR - 1) / kFgNR;
    const bool split_n = units >= 4 * nt || panels < 2 * nt;
    parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
            int64_t m0 = 0, m1 = M, n0 = 0, n1 = N;
            if (split_n) {
                n0 = units * t / nt * kFgNR;
                n1 = std::min(N, units * (t + 1) / nt * kFgNR);
            } else {
                m0 = panels * t / nt * kFgMR;
                m1 = std::min(M, panels * (t + 1) / nt * kFgMR);
            }
            if (m0 >= m1 || n0 >= n1)
                continue;
            const Scratch ws = thread_scratch(kTaskSlot, fgemm_workspace_bytes(g, m1 - m0, n1 - n0));
            f.block(g, app, m0, m1, n0, n1, e, ws.ptr);
        }
    });
}

void forward_pb(DType compute, const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, int64_t K,
                const Epilogue &e) {
    const void *wp = w.data_ptr();
    const DType wd = dtype_of(w.scalar_type());
    const PbKernels &pk = compute == DType::BF16 ? kernels().pb_bf16 : kernels().pb_f32;
    run_pb(
        compute, x2.data_ptr(), K, PbA::Rows, M, N, K,
        [&](int64_t p0, int64_t p1, uint32_t *bp) { pk.pack_wt(wp, wd, K, N, K, p0, p1, bp); }, e);
}

void forward_kernels(const FwdKernel &fk, const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, int64_t K,
                     const Epilogue &e) {
    // Tasks: (block of kFwdRowBlock x rows, slice of N) pairs, the N slices multiples of 48 weight rows; a thread's
    // tasks are contiguous (one row block and a weight slice at a time). Every task packs the x^T of its row block,
    // so N is only cut finer than ~512 rows when there are fewer row blocks than threads (M = 8192, N = 64: cutting
    // N in two cost 30 % in duplicated packing).
    // Row blocks of at most kFwdRowBlock rows, as many as a multiple of the thread count and of equal height (to 16
    // rows): M = 359 on 2 threads was cut 256 + 103, so one thread did 71 % of the work (K = N = 4096: 18.5 -> 14.2
    // ms).
    const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
    int64_t m_blocks = M > fk.row_block_above ? (M + kFwdRowBlock - 1) / kFwdRowBlock : 1;
    if (m_blocks >= nt) // (fewer blocks than threads: the threads split N instead)
        m_blocks = (m_blocks + nt - 1) / nt * nt;
    const int64_t rows_per_block = m_blocks == 1 ? M : ((M + m_blocks - 1) / m_blocks + 15) / 16 * 16;
    m_blocks = (M + rows_per_block - 1) / rows_per_block;
    int64_t n_slices = std::min(nt, (N + kGemmNR - 1) / kGemmNR);
    if (m_blocks >= nt)
        n_slices = std::min(n_slices, std::max<int64_t>(1, (N + 511) / 512));
    const int64_t slice = ((N + n_slices - 1) / n_slices + kGemmNR - 1) / kGemmNR * kGemmNR;
    n_slices = (N + slice - 1) / slice;
    // Small problems (< ~64K multiply-adds per task) stay on one thread (was 256K: fp32 M = 1, K = N = 512 on 2
    // threads 13.1 -> 10.7 us, bf16 M = 16 22.4 -> 21.7 us; 32K made M = 1, K = N = 256 slower, 5.4 -> 6.8 us).
    const int64_t grain = M * K * slice < (int64_t{1} << 16) ? m_blocks * n_slices : 1;
    parallel_for(0, m_blocks * n_slices, grain, [&](int64_t t0, int64_t t1) {
        const Scratch ws = thread_scratch(kTaskSlot, fk.workspace_bytes(M, K));
        for (int64_t t = t0; t < t1; ++t) {
            const int64_t mb = t / n_slices, sl = t % n_slices;
            const int64_t m0 = mb * rows_per_block, m1 = std::min(M, m0 + rows_per_block);
            const int64_t n0 = sl * slice, n1 = std::min(N, n0 + slice);
            fk.run(x2.data_ptr(), K, M, w.data_ptr(), dtype_of(w.scalar_type()), K, K, m0, m1, n0, n1, e, ws.ptr);
        }
    });
}

// Generic: fp32 GEMM of the operands rounded to c (the products of bf16/fp16 values are exact in fp32), then the
// epilogue: the scalar family and fp16.
void forward_aten(const at::Tensor &x2, const at::Tensor &w, int64_t M, int64_t N, const Epilogue &e,
                  const at::Tensor &out, const at::Tensor &pre, const at::Tensor &b32) {
    const auto c = x2.scalar_type();
    const at::Tensor a = c == at::kFloat ? x2 : x2.to(at::kFloat);
    const at::Tensor b = c == at::kFloat ? w : w.to(c).to(at::kFloat);
    if (out.scalar_type() != at::kFloat) { // bf16 without AVX512_BF16
        at::Tensor acc = at::mm(a, b.t());
        return run_epilogue(e, acc.data_ptr<float>(), M, N);
    }
    // fp32 output: the GEMM writes into it and the epilogue runs in place (element by element, read before write) -
    // no [M, N] accumulator to allocate and read back. Bias only: addmm, F.linear's own call. (FASTDL_CPU_ISA=scalar,
    // bias only, fp32 M = 4096, K = 256, N = 1024: 13.2 -> 10.2 ms; 359 x 512 x 512: 1.08 -> 0.95 ms.)
    if (e.act == Act::None && !e.res && !e.pre && b32.defined())
        return void(at::addmm_out(const_cast<at::Tensor &>(out), b32, a, b.t()));
    const at::Tensor &dst = e.pre ? pre : out;
    at::mm_out(const_cast<at::Tensor &>(dst), a, b.t());
    run_epilogue(e, dst.data_ptr<float>(), M, N);
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
        if (M <= std::min(kFwdF32SmallM, kr.fwd_f32.max_m))
            return forward_kernels(kr.fwd_f32, x2, w, M, N, K, e);
        if (w.scalar_type() == at::kFloat)
            return forward_pb(DType::F32, x2, w, M, N, K, e);
    }
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
bool fwd_f32_onednn(int64_t M, int64_t K) {
    return M > kFwdF32SmallM && K >= 128;
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

// The checks and the shapes both entry points start with: the activation, x's rank and dtype, the weight against x;
// K, N, M = the rows of x's leading dimensions, and the output's shape [..., N].
struct Geometry {
    Act act;
    int64_t K, N, M;
    std::vector<int64_t> out_shape;
};

Geometry checked_geometry(const at::Tensor &x, const at::Tensor &weight, c10::string_view activation, const char *fn) {
    const Act act = parse_activation(activation, fn);
    TORCH_CHECK(x.dim() >= 1, fn, ": x must have at least one dimension [..., K], got a 0-d tensor");
    check_compute_dtype(x, fn);
    check_weight(x, weight, fn);
    Geometry g{act, x.size(-1), weight.size(0), leading_rows(x),
               std::vector<int64_t>(x.sizes().begin(), x.sizes().end())};
    g.out_shape.back() = g.N;
    return g;
}

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

// ---- Backward, in named steps: backward_dpre (step 1), then grad_x and grad_weight, each through its choose_*_path
// rule (the numbers behind each rule are at gx_bf16_pb, gx_f32_pb, gx_f32_fgemm, gw_f32_pb above).

// What the family of this process offers the backward for compute dtype c and this weight.
struct BackwardFamily {
    bool fast_bf16 = false; // AVX512_BF16: pb, packed bf16 GEMM and small-M kernels
    bool f32_pb = false;    // AVX-512 F with an fp32 weight: the fp32 pb kernels
    bool fg = false;        // fgemm for both GEMMs: the AVX2 family (bf16, fp32), the AVX-512 F family's bf16
    bool fg_gx = false;     // fgemm for grad_x: as fg, plus AVX-512 fp32 grad_x of large weights at M <= 64
    bool avx2 = false;      // fg without AVX-512: MKL's sgemm at small K (gx_aten_small_k, gw_aten_small_k)
};

BackwardFamily backward_family(at::ScalarType c, at::ScalarType wt, int64_t M, int64_t N, int64_t K) {
    const Kernels &kr = kernels();
    BackwardFamily f;
    f.fast_bf16 = c == at::kBFloat16 && kr.pb_bf16.block && kr.gemm_bf16.tile && kr.small_bf16.grad_x;
    f.f32_pb = c == at::kFloat && kr.pb_f32.block && kr.pb_f32.pack_a && wt == at::kFloat;
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
    const bool dpre_is_g = need_d && act == Act::None && g2.scalar_type() == c; // round_c(g) == g: nothing to write
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
    if (f.f32_pb && gx_f32_pb(M) && !f.fg_gx)
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
    case GradXPath::PbF32: {
        const GemmOperand wb{w.data_ptr(), K, DType::F32, false};
        run_pb(
            DType::F32, dpre.data_ptr(), N, PbA::Rows, M, K, N,
            [&](int64_t p0, int64_t p1, uint32_t *bp) { kr.pb_f32.pack_rows(wb, K, N, p0, p1, bp); },
            store_only(gx, K, DType::F32, false));
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
    if (f.f32_pb && gw_f32_pb(M, N, K))
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
        const GemmOperand xb{x2.data_ptr(), K, DType::F32, false};
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
    const bool d_f32 = c == at::kBFloat16 && ((need_gx && gx_path == GradXPath::AtenRounded) ||
                                              (need_gw && gw_path == GradWPath::AtenRounded));
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

} // namespace

at::Tensor linear_forward(const at::Tensor &x2, const at::Tensor &w, const std::optional<at::Tensor> &bias) {
    return std::get<0>(fused_linear_cpu(x2, w, bias, "none", std::nullopt, false));
}

bool fgemm_quantized_weight(const void *x, DType x_dtype, int64_t ldx, int64_t M, const Int8Weight &w8,
                            const Int4Weight &w4, int64_t N, int64_t K, const float *bias, void *out, DType out_dtype) {
    if (!kernels().fgemm.block)
        return false;
    FgemmArgs g;
    g.a = GemmOperand{x, ldx, x_dtype, false};
    g.b = GemmOperand{nullptr, K, DType::F32, true}; // the weight's rows: strip mode
    g.bq = w8;
    g.b4 = w4;
    g.M = M;
    g.N = N;
    g.K = K;
    Epilogue e;
    e.bias = bias;
    e.out = out;
    e.ld_out = N;
    e.out_dtype = out_dtype;
    run_fgemm(g, e);
    return true;
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
