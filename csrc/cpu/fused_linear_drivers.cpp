// The threaded drivers of the fused linear layer (declared in fused_linear_host.h): each cuts a GEMM or an elementwise
// pass into tasks for at::parallel_for and calls the SIMD kernels of the family (fused_linear_kernels.h); plus the
// allocation of multi-MB outputs (huge pages) and the per-thread scratch buffers they use. Which driver runs at which
// shape is decided by the routes in fused_linear.cpp (forward) and fused_linear_backward.cpp (backward).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "fused_linear_host.h"
#include "fused_linear_kernels.h"
#include "parallel.h"

namespace fastdl {
namespace fused_linear {

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
namespace {
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
} // namespace
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

// (Scratch, the slots: fused_linear_host.h)
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

// Packed-B GEMM (pb_* kernels). The work is laid out panel-major (panel of 48 columns, then groups of 8 rows), each
// group weighted by its panel's 16-column vectors (a last panel of 16 columns costs a third); each thread takes one
// contiguous share of equal cost, packs the B panels it touches into its own buffer and computes them, all in a single
// parallel region. No shared packed buffer: re-packing one that the other core read in the previous call costs a
// cache-line invalidation per line (2 threads ran slower than 1 at M = 16). Balanced to 8 rows: M = 359 on 2 threads
// gets 5.5 panels each, not the 256 + 103 rows of kFwdRowBlock blocks; 256 columns = 5 1/3 panels split 2 2/3 each
// (whole panels: 3 + 2 1/3, 13 % slower at M = 4096 grad_weight).
namespace {
constexpr int64_t kPbRowBlock = 256; // rows per pass over the thread's panels (x block stays in L2)
// With fp32 panels, a thread whose packed panels would take more than kPbChunkAbove packs and computes them in chunks
// of about kPbChunkBytes: packed all at once, a large weight's panels (33 MB per thread at 4096 x 4096, 90 MB at
// 11008 x 4096) went through memory between the packing and the GEMM, and those over 64 MB were allocated per call
// (thread_scratch). Intel Xeon (family 6 model 207, AVX-512 without BF16), 2 threads, gelu, ms, whole -> chunks, two
// alternating runs: bf16 forward (AVX-512 F family) 128x4096^2 25.5 -> 17.2-23.0 (eager fp32 F.linear + gelu 18.1-22.6)
// | 128x4096x11008 92-97 -> 44-48 (eager fp32 47-53) | 512x4096^2 74-86 -> 61-64 (eager fp32 61-62); fp32 training
// step (forward on oneDNN, the backward's pb) 128x4096^2 68-101 -> 61-63 (eager 64-95). The BF16 family keeps whole
// packing (its pb rule was measured so; 16.9 MB per thread at 512 x 4096^2, not re-measured in chunks).
constexpr int64_t kPbChunkAbove = int64_t{8} << 20, kPbChunkBytes = int64_t{1} << 20;
} // namespace

void run_pb(DType compute, const void *a, int64_t lda, PbA a_mode, int64_t M, int64_t N, int64_t K, PbPack pack,
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
            // the panels packed all at once, or (F32) in chunks of about 1 MB when all of them would take more than
            // kPbChunkAbove (each chunk then computed against every row while it is in L2)
            const int64_t panel_bytes = static_cast<int64_t>(sizeof(uint32_t)) * kpt * kGemmNR;
            const int64_t chunk = compute == DType::F32 && (hi - lo) * panel_bytes > kPbChunkAbove
                                      ? std::max<int64_t>(1, kPbChunkBytes / panel_bytes)
                                      : hi - lo;
            const Scratch ws = thread_scratch(kTaskSlot, panel_bytes * chunk);
            uint32_t *bp = static_cast<uint32_t *>(ws.ptr);
            for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
                const int64_t c1 = std::min(hi, c0 + chunk);
                pack(c0, c1, bp);
                for (int64_t b0 = 0; b0 < M; b0 += kPbRowBlock) {
                    for (int64_t p = c0; p < c1; ++p) {
                        int64_t g0, g1;
                        range(p, g0, g1);
                        const int64_t r0 = std::max(b0, g0 * kGemmMR);
                        const int64_t r1 = std::min({b0 + kPbRowBlock, M, g1 * kGemmMR});
                        if (r0 < r1)
                            pk.block(a, lda, a_mode, K, bp + (p - c0) * kpt * kGemmNR, N, r0, r1, p * kGemmNR, e);
                    }
                }
            }
        }
    });
}

// fgemm (the AVX2 family; the AVX-512 F family's bf16 backward): A packed once into fp32 panels (shared, in parallel),
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
                const Epilogue &e, bool round_w) {
    const void *wp = w.data_ptr();
    const DType wd = dtype_of(w.scalar_type());
    const PbKernels &pk = compute == DType::BF16 ? kernels().pb_bf16 : kernels().pb_f32;
    run_pb(
        compute, x2.data_ptr(), K, PbA::Rows, M, N, K,
        [&](int64_t p0, int64_t p1, uint32_t *bp) { pk.pack_wt(wp, wd, round_w, K, N, K, p0, p1, bp); }, e);
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

namespace {
// x [M, K] (fp32 / bf16, row stride ldx) times a weight held quantized or compressed (one of w8, w4, s24) through the
// fp32 pb kernel, the weight dequantized / decompressed per chunk of panels while packed (pack_quant); + bias.
void pb_held_weight(const void *x, DType x_dtype, int64_t ldx, int64_t M, const Int8Weight &w8, const Int4Weight &w4,
                    const Sparse24Weight &s24, int64_t N, int64_t K, const float *bias, void *out, DType out_dtype) {
    const PbKernels &pk = kernels().pb_f32;
    at::Tensor xf;
    if (x_dtype == DType::BF16) { // widened once (exact): the pb kernel broadcasts fp32 x elements
        xf = at::from_blob(const_cast<void *>(x), {M, K}, {ldx, 1}, at::TensorOptions().dtype(at::kBFloat16))
                 .to(at::kFloat)
                 .contiguous();
        x = xf.data_ptr();
        ldx = K;
    }
    Epilogue e;
    e.bias = bias;
    e.out = out;
    e.ld_out = N;
    e.out_dtype = out_dtype;
    run_pb(
        DType::F32, x, ldx, PbA::Rows, M, N, K,
        [&](int64_t p0, int64_t p1, uint32_t *bp) { pk.pack_quant(w8, w4, s24, N, K, p0, p1, bp); }, e);
}
} // namespace

bool fgemm_quantized_weight(const void *x, DType x_dtype, int64_t ldx, int64_t M, const Int8Weight &w8,
                            const Int4Weight &w4, int64_t N, int64_t K, const float *bias, void *out, DType out_dtype) {
    if (kernels().pb_f32.pack_quant) { // the AVX-512 families
        pb_held_weight(x, x_dtype, ldx, M, w8, w4, Sparse24Weight{}, N, K, bias, out, out_dtype);
        return true;
    }
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

bool sparse24_pb_linear(const at::Tensor &x2, const at::Tensor &values, const at::Tensor &meta, const at::Tensor &bias,
                        const at::Tensor &out2) {
    const int64_t M = x2.size(0), K = x2.size(1), N = values.size(0);
    if (!kernels().pb_f32.pack_quant || K % 16 != 0)
        return false;
    const DType xd = dtype_of(x2.scalar_type());
    Sparse24Weight s;
    s.values = values.data_ptr();
    s.vdt = dtype_of(values.scalar_type());
    s.meta = meta.data_ptr<uint8_t>();
    s.round_bf16 = xd == DType::BF16 && s.vdt == DType::F32;
    pb_held_weight(x2.data_ptr(), xd, K, M, Int8Weight{}, Int4Weight{}, s, N, K,
                   bias.defined() ? bias.data_ptr<float>() : nullptr, out2.data_ptr(), xd);
    return true;
}

} // namespace fused_linear
} // namespace fastdl
