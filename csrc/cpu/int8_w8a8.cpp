// The W8A8 driver of the int8 capability (declared in int8_w8a8.h): weight packing into the VNNI layout and the
// blocked GEMM, which cuts the work into per-thread rectangles of rows x 16-column blocks, packs (and quantises) the A
// rows of each block and calls the ISA's gemm_block (int8_kernels.h). The ops that use it are in int8.cpp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "int8_kernels.h"
#include "int8_w8a8.h"
#include "parallel.h"

namespace fastdl {
namespace int8 {

// ------------------------------------------------------------------------------------------------ weight packing
// VNNI layout [Np/16][Kp/4][16][4]; comp[n] = 128 * sum_k w[n, k] (int32, wrapping like the int32 accumulator).
std::tuple<at::Tensor, at::Tensor> pack_weight(const at::Tensor &w_q) {
    const at::Tensor w = w_q.stride(-1) == 1 ? w_q : w_q.contiguous();
    const int64_t N = w.size(0), K = w.size(1);
    const int64_t Np = round_up(N, 16), Kp = round_up(K, 4);
    at::Tensor packed = at::empty({Np, Kp}, w.options().dtype(at::kChar));
    at::Tensor comp = at::empty({Np}, w.options().dtype(at::kInt));
    PackB p;
    p.w = w.data_ptr<int8_t>();
    p.ldw = w.stride(0);
    p.N = N;
    p.K = K;
    p.Kp = Kp;
    p.packed = packed.data_ptr<int8_t>();
    p.comp = comp.data_ptr<int32_t>();
    const Kernels &kr = kernels();
    // grain: 16 blocks of 16 rows (>= 1 MiB at K = 4096) per thread at least
    parallel_for(0, Np / 16, 16, [&](int64_t b, int64_t e) {
        PackB q = p;
        q.jb0 = b;
        q.jb1 = e;
        kr.pack_b(q);
    });
    return {packed, comp};
}

// ------------------------------------------------------------------------------------------------ W8A8 driver
// Blocking (per thread, on the rectangle of rows x columns it owns):
//   K slices of <= 4096 values: the A block (rows x kc bytes) and one 64-column panel of B (64 x kc bytes, 256 KiB)
//   both stay in the 1 MiB L2; longer K (11008 in LLaMA-7B) is cut into near-equal slices with int32 partial sums.
//   Row blocks of <= 512 KiB of packed A (128 rows at K = 4096: 768 KiB of L2 with the B panel), cut into equal
//   multiples of the register tile: each weight byte is read from L3 (or DRAM) once per row block. Measured
//   stand-alone, the VNNI tile loop then runs at 125 of the 128 MAC/cycle peak even when B streams from L3.
//   512 rather than 256 KiB lets M = 128 split the columns over 2 threads (B read once, not once per thread).
//   `fastdl bench int8`, 2 threads, ms, 256 -> 512 KiB: 4096 x 4096 at M = 128 2.23-2.27 -> 2.17-2.18; LLaMA
//   4096 -> 11008 at M = 128 6.08-6.14 -> 5.93-5.94, 11008 -> 4096 5.98-6.02 -> 5.89-5.97; M = 16, 512 unchanged.
//   Threads: rows are split only in parts of at least one full row block (a thread's weights then stream the same
//   number of times as with a column split, and each thread quantises only its own rows); below that the columns
//   are split and each thread quantises the (few) rows itself rather than waiting for another thread.
namespace {
constexpr int64_t kMaxKc = 4096;
constexpr int64_t kABlockBytes = 512 << 10;

void w8a8_rect(const W8A8 &p, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
    const Kernels &kr = *p.kr;
    const int64_t nkb = p.nkb, Kc = p.Kc;
    const int64_t nrb = ceil_div(m1 - m0, p.mc_max);
    const int64_t mc = std::min(m1 - m0, round_up(ceil_div(m1 - m0, nrb), kr.mr));
    const int64_t cols = (j1 - j0) * 16;
    const int64_t a_bytes = round_up(mc * Kc * kr.a_bytes, 64);
    const int64_t f_bytes = round_up(3 * mc * 4, 64);
    const int64_t p_bytes = nkb > 1 ? mc * cols * 4 : 0;
    uint8_t *base = scratch_of<uint8_t>(kScratchA, a_bytes + f_bytes + p_bytes);
    void *abuf = base;
    float *scale = reinterpret_cast<float *>(base + a_bytes);
    float *inv = scale + mc;
    int32_t *zero = reinterpret_cast<int32_t *>(inv + mc);
    // The 7-bit mode on a family with a kernel for the codes themselves (gemm_block_u7), while its compensation
    // z * comp[n] / 128 is exact (|comp| <= 128 * 128 * K < 2^31); else the exact kernel on a = q - z.
    const bool u7_direct = p.u7 && kr.gemm_block_u7 != nullptr && p.K < (int64_t(1) << 17);
    void (*gemm)(const GemmBlock &) = u7_direct ? kr.gemm_block_u7 : kr.gemm_block;
    int32_t *partial = nkb > 1 ? reinterpret_cast<int32_t *>(base + a_bytes + f_bytes) : nullptr;
    const bool float_a = p.a_dtype != DType::I8;
    const int64_t a_elem = p.a_dtype == DType::F32 ? 4 : p.a_dtype == DType::I8 ? 1 : 2;
    const int64_t o_elem = (p.out_dtype == DType::F32 || p.out_dtype == DType::I32) ? 4 : 2;
    for (int64_t r0 = m0; r0 < m1; r0 += mc) {
        const int64_t rows = std::min(mc, m1 - r0);
        for (int64_t kb = 0; kb < nkb; ++kb) {
            const int64_t k0 = kb * Kc;
            const int64_t kc = std::min(Kc, p.Kp - k0);
            APack ap;
            ap.src = static_cast<const char *>(p.a) + r0 * p.lda * a_elem;
            ap.ld = p.lda;
            ap.dtype = p.a_dtype;
            ap.rows = rows;
            ap.K = p.K;
            ap.k0 = k0;
            ap.kc = kc;
            ap.scale = scale;
            ap.inv = inv;
            ap.compute_scales = float_a && kb == 0;
            ap.dst = abuf;
            ap.ldd = Kc;
            ap.u7 = p.u7;
            ap.u7_direct = u7_direct;
            ap.zero = zero;
            kr.pack_a(ap);
            GemmBlock g;
            g.a = abuf;
            g.lda = Kc;
            g.rows = rows;
            g.b = p.b + j0 * 16 * p.Kp + k0 * 16;
            g.b_stride = p.Kp * 16;
            g.kc = kc;
            g.cols = cols;
            g.n_valid = std::min(cols, p.N - j0 * 16);
            g.first = kb == 0;
            g.last = kb == nkb - 1;
            g.partial = partial;
            g.ldp = cols;
            g.comp = p.comp + j0 * 16;
            g.a_scale = float_a ? scale : p.a_scale + r0;
            g.b_scale = p.b_scale + j0 * 16;
            g.bias = p.bias ? p.bias + j0 * 16 : nullptr;
            g.out = static_cast<char *>(p.out) + (r0 * p.N + j0 * 16) * o_elem;
            g.ldo = p.N;
            g.out_dtype = p.out_dtype;
            g.a_zero = u7_direct ? zero : nullptr;
            gemm(g);
        }
    }
}

} // namespace

void run_w8a8(W8A8 &p) {
    const int64_t mr = p.kr->mr;
    p.nkb = std::max<int64_t>(1, ceil_div(p.Kp, kMaxKc));
    p.Kc = round_up(ceil_div(p.Kp, p.nkb), 4);
    p.mc_max = std::max<int64_t>(mr, kABlockBytes / (std::max<int64_t>(p.Kc, 4) * p.kr->a_bytes));
    const int64_t nblk = round_up(p.N, 16) / 16;
    const int64_t T = (p.M * nblk * 16 * std::max<int64_t>(p.Kp, 4) < kSerialMacs) ? 1 : at::get_num_threads();
    int64_t tm = std::min(T, std::max<int64_t>(1, p.M / p.mc_max));
    const int64_t tn = std::max<int64_t>(1, std::min(T / tm, ceil_div(nblk, 4)));
    tm = std::max(tm, std::min(T / tn, ceil_div(p.M, mr)));
    auto body = [&](int64_t b, int64_t e) {
        for (int64_t it = b; it < e; ++it) {
            const auto rows = split(p.M, tm, it / tn, mr);
            const auto blks = split(nblk, tn, it % tn, 4);
            if (rows.first < rows.second && blks.first < blks.second) {
                w8a8_rect(p, rows.first, rows.second, blks.first, blks.second);
            }
        }
    };
    if (tm * tn == 1) {
        body(0, 1);
    } else {
        parallel_for(0, tm * tn, 1, body);
    }
}

} // namespace int8
} // namespace fastdl
