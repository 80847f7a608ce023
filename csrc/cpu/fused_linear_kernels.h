// Shared declarations between the ATen glue (fused_linear.cpp) and the SIMD kernels (fused_linear_avx512.cpp).
// No torch headers here: the SIMD translation unit must not see ATen (it is compiled with the generic project flags
// and enables AVX-512 per function with target attributes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastdl {
namespace fused_linear {

enum class Act : int { None = 0, Relu, Gelu, GeluTanh, Silu };

// Element types the kernels read or write natively. Anything else is converted by the glue code first.
enum class DType : int { F32 = 0, BF16 };

struct CpuCaps {
    bool avx512 = false;     // AVX512 F/BW/DQ/VL (+ OS support): vectorised epilogue / backward pass / fp32 kernels
    bool avx512bf16 = false; // AVX512_BF16 (vdpbf16ps): every bf16 matrix kernel
};
// From the level of cpu_isa.h (cpuid, capped by FASTDL_CPU_ISA), decided once.
const CpuCaps &cpu_caps();

// ---------------------------------------------------------------------------------------------------------------
// Forward epilogue. Applied to a tile of fp32 accumulators acc[rows][cols] (leading dimension ld_acc) whose element
// (i, j) is output element (row0 + i, col0 + j):
//   pre = acc + bias[col];  preact = round(pre);  out = round(act(pre) + residual[row][col])
// bias is fp32 indexed by the global column; residual / out / preact are indexed by global (row, col).
struct Epilogue {
    const float *bias = nullptr;
    const void *res = nullptr;
    int64_t ld_res = 0;
    DType res_dtype = DType::F32;
    void *out = nullptr;
    int64_t ld_out = 0;
    DType out_dtype = DType::F32;
    void *pre = nullptr; // same dtype as out; nullptr = not stored
    int64_t ld_pre = 0;
    Act act = Act::None;
    bool stream = false; // fp32 out: non-temporal stores for aligned full vectors (large outputs not read back soon)
    bool fence = true;   // stream: sfence when done (false: the caller fences once after many calls)
};
void apply_epilogue(const Epilogue &e, const float *acc, int64_t ld_acc, int64_t row0, int64_t rows, int64_t col0,
                    int64_t cols);

// ---------------------------------------------------------------------------------------------------------------
// Backward elementwise pass over the rows [row0, row1) (row0 % kDpreRows == 0) and columns [col0, col1):
//   dpre = g * act'(p) (fp32);  dpre_out = round(dpre) (a.dpre; nullptr = not written)
// and, if partial is set, the fp32 column sums of every kDpreRows-row block: partial[(r / kDpreRows) * ld_partial + c].
// dpre_sum_blocks adds the blocks in order into grad_bias: a two-level sum (error ~ (64 + M / 64) ulp instead of M
// ulp) whose result does not depend on how the pass was split between threads.
constexpr int64_t kDpreRows = 64;
struct DpreArgs {
    const void *g = nullptr;
    int64_t ld_g = 0;
    DType g_dtype = DType::F32;
    const void *p = nullptr; // ignored for Act::None
    int64_t ld_p = 0;
    DType p_dtype = DType::F32;
    Act act = Act::None;
    void *dpre = nullptr;
    int64_t ld_dpre = 0;
    DType dpre_dtype = DType::F32;
};
void dpre_pass(const DpreArgs &a, int64_t row0, int64_t row1, int64_t col0, int64_t col1, float *partial,
               int64_t ld_partial);
void dpre_sum_blocks(const float *partial, int64_t ld_partial, int64_t blocks, int64_t col0, int64_t col1,
                     float *grad_bias);

// ---------------------------------------------------------------------------------------------------------------
// bf16 GEMM with fp32 accumulation (AVX512_BF16 only, used by the backward): C[M, N] = A[M, K] * B[K, N], then the
// epilogue on C.
//   A is bf16:                a.trans ? A[i][k] = a[k * lda + i] : A[i][k] = a[i * lda + k]
//   B is bf16 or fp32 (fp32 is rounded to bf16 while packing, like autocast's weight cast), row-major:
//                             B[k][j] = b[k * ldb + j]   (b.trans is not supported)
// Usage: pack A once (gemm_pack_a, parallel over A panels), then call gemm_tile for every (M block, N panel) pair,
// each thread with its own workspace of gemm_workspace_bytes().
constexpr int kGemmMR = 8;   // rows of a micro tile (one A panel)
constexpr int kGemmNR = 48;  // columns of a micro tile (one B panel, 3 x 16 fp32 lanes)
constexpr int kGemmMC = 512; // rows per M block (C block of MC x NR fp32 = 96 KB, stays in L2)
constexpr int kGemmKC = 256; // K per packed B block (KC/2 x NR dwords = 24 KB, stays in L1)

struct GemmOperand {
    const void *ptr = nullptr;
    int64_t ld = 0;
    DType dtype = DType::BF16;
    bool trans = false;
};
int64_t gemm_packed_a_elems(int64_t M, int64_t K); // size of the packed A buffer, in bf16 elements
void gemm_pack_a(const GemmOperand &a, int64_t M, int64_t K, int64_t panel0, int64_t panel1, uint16_t *ap);
size_t gemm_workspace_bytes();
// Computes C rows [m0, min(m0 + kGemmMC, M)) x columns [j0, min(j0 + kGemmNR, N)); m0 % kGemmMR == 0.
void gemm_tile(const uint16_t *ap, const GemmOperand &b, int64_t M, int64_t N, int64_t K, int64_t m0, int64_t j0,
               const Epilogue &epi, void *workspace);

// ---------------------------------------------------------------------------------------------------------------
// Packed-B GEMM for a B operand small enough to pack per call (a narrow layer's weight, or x): C[M, N] = A[M, K] *
// B[K, N], accumulated over the whole K in registers (8 x 48 tiles; K is blocked only beyond 256 steps, k pairs in
// BF16), the epilogue per 64 rows x 48 columns. compute BF16 (AVX512_BF16, vdpbf16ps on k pairs, fp32 accumulation) or
// F32 (AVX-512 FMA, everything fp32). A (compute's dtype) is read in place, PbA::Rows: A[i][k] = a[i * lda + k]
// (elements / k pairs broadcast straight from A's rows, no packing) or PbA::Cols (BF16 only): A[i][k] = a[k * lda + i]
// (pairs interleaved on the fly), or pre-packed in panels of 8 rows, PbA::Packed (lda unused): BF16 by gemm_pack_a, F32
// by pb_pack_a_f32. B is packed in 48-column panels of pb_kpt(K, compute) x 48 dwords, panel p of [panel0, panel1) at
// bp + (p - panel0) * pb_kpt(K, compute) * 48: by pb_pack_wt (B[k][n] = w[n][k]; BF16: w bf16 or fp32 rounded to bf16,
// RNE; F32: w fp32) or pb_pack_rows (B[k][n] = b[k * ld + n], same dtypes). pb_block computes C rows [m0, m1) x the
// panel at `panel`, columns [j0, j0 + 48) (m0 % 8 == 0 when packed).
enum class PbA : int { Rows = 0, Packed, Cols };
inline int64_t pb_kpt(int64_t K, DType compute = DType::BF16) { // k (pairs) per panel, whole 16 x 16 transposes
    return ((compute == DType::BF16 ? (K + 1) / 2 : K) + 15) / 16 * 16;
}
void pb_pack_wt(DType compute, const void *w, DType w_dtype, int64_t ldw, int64_t N, int64_t K, int64_t panel0,
                int64_t panel1, uint32_t *bp);
void pb_pack_rows(DType compute, const GemmOperand &b, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                  uint32_t *bp);
// A[i][k] = src[k * ld + i] for i < rows (zero beyond), panels [panel0, panel1) of 8 rows: ap[(panel * K + k) * 8 + r].
void pb_pack_a_f32(const float *src, int64_t ld, int64_t rows, int64_t K, int64_t panel0, int64_t panel1, float *ap);
void pb_block(DType compute, const void *a, int64_t lda, PbA mode, int64_t K, const uint32_t *panel, int64_t N,
              int64_t m0, int64_t m1, int64_t j0, const Epilogue &epi);

// ---------------------------------------------------------------------------------------------------------------
// Forward: acc[m][n] = sum_k x[m][k] * w[n][k] for the x rows [m0, m1) and weight rows [n0, n1), reading the weight
// rows in place (no packing), then the epilogue. Kernels by M:
//   compute BF16 (x bf16, w bf16 or fp32 rounded to bf16 like autocast; needs avx512bf16): M <= 4 inner products
//     streaming the weight rows; M > 4 (any M) a broadcast kernel over x^T, packed per row block of kFwdRowBlock.
//   compute F32 (x fp32, w fp32, FMA; needs avx512): small M only, M <= kFwdF32MaxM.
// [m0, m1) is a block of at most kFwdRowBlock rows (bf16 with M <= 4 and fp32: the whole [0, M)); workspace:
// fwd_workspace_bytes.
constexpr int64_t kFwdRowBlock = 256;
size_t fwd_workspace_bytes(int64_t M, int64_t K);
void fwd_compute(DType compute, const void *x, int64_t ldx, int64_t M, const void *w, DType w_dtype, int64_t ldw,
                 int64_t K, int64_t m0, int64_t m1, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace);
constexpr int64_t kFwdF32MaxM = 64; // largest M of the fp32 forward kernel

// Small-M backward (AVX512_BF16): grad_x[m][k] = sum_n dpre[m][n] * w[n][k] for the columns [k0, k1), all M rows
// (M <= kSmallGradXMax); dpre bf16 [M, N], w bf16 or fp32 (rounded to bf16) [N, K], grad_x bf16. The weight rows are
// streamed sequentially; workspace: small_grad_x_workspace_bytes(M, k1 - k0).
constexpr int64_t kSmallGradXMax = 16;
size_t small_grad_x_workspace_bytes(int64_t M, int64_t k_cols);
void small_m_grad_x(const void *dpre, int64_t ldd, int64_t M, const void *w, DType w_dtype, int64_t ldw, int64_t N,
                    int64_t k0, int64_t k1, void *gx, int64_t ldgx, void *workspace);
// Small-M backward (AVX512_BF16): grad_w[n][k] = sum_m dpre[m][n] * x[m][k] (fp32 accumulation) for the rows
// [n0, n1), written row by row in out_dtype (fp32 or bf16); dpre bf16 [M, N], x bf16 [M, K], M <= kSmallGradXMax.
// workspace: small_grad_w_workspace_bytes(M, K) (x packed as interleaved row pairs, done by every call).
size_t small_grad_w_workspace_bytes(int64_t M, int64_t K);
void small_m_grad_w(const void *dpre, int64_t ldd, const void *x, int64_t ldx, int64_t M, int64_t K, int64_t n0,
                    int64_t n1, void *gw, DType out_dtype, int64_t ldgw, void *workspace);

} // namespace fused_linear
} // namespace fastdl
