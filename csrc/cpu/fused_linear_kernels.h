// Shared declarations between the ATen glue (fused_linear.cpp) and the kernel families of the fused linear layer:
//   fused_linear_avx512.cpp  AVX-512 F (fp32 FMA kernels, vectorised epilogue / backward pass) and AVX512_BF16
//                            (vdpbf16ps kernels for bf16);
//   fused_linear_avx2.cpp    AVX2 + FMA + F16C: fp32-FMA GEMM and weight-streaming kernels that read bf16 / fp32
//                            operands in their stored dtype (bf16 widened in registers), vectorised elementwise passes;
//   fused_linear_scalar.cpp  portable C++ elementwise passes (the GEMMs then go through ATen).
// One table of function pointers per family (struct Kernels below), chosen once per process from the level of
// cpu_isa.h (cpuid, capped by FASTDL_CPU_ISA); a null entry means "not in this family" and the glue takes another path.
// No torch headers here: the SIMD translation units must not see ATen (they are compiled with the generic project
// flags and enable their ISA per function with target attributes).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"
#include "fused_linear_activation.h"

// The kernel family fused_linear runs in this process, for `fastdl info` (csrc/module.cpp).
const char *fastdl_fused_linear_cpu_kernels();

namespace fastdl {
namespace fused_linear {

using cpu::DType; // F32 / BF16 / F16 / I32 / I8 (cpu_isa.h)

inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// Round to nearest even, NaN -> 0x7FC0: bit-identical to c10::BFloat16 (and so to torch's .to(torch.bfloat16)).
inline uint16_t f32_to_bf16(float f) {
    if (std::isnan(f))
        return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

constexpr float kSqrt1_2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f; // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhC = 0.044715f;

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
using EpilogueFn = void (*)(const Epilogue &e, const float *acc, int64_t ld_acc, int64_t row0, int64_t rows,
                            int64_t col0, int64_t cols);

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
    bool dpre_round_bf16 = false; // fp32 dpre holding values rounded to bf16 (RNE): bf16 training's dpre for MKL
};
using DprePassFn = void (*)(const DpreArgs &a, int64_t row0, int64_t row1, int64_t col0, int64_t col1, float *partial,
                            int64_t ld_partial);
// Portable (fused_linear_scalar.cpp), the same in every family.
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
    bool round_bf16 = false; // pb_f32's pack_rows: an fp32 operand rounded to bf16 (RNE) as it is packed
};
// Size of the packed A buffer, in bf16 elements, and of a gemm_tile workspace (portable).
int64_t gemm_packed_a_elems(int64_t M, int64_t K);
size_t gemm_workspace_bytes();
struct Bf16Gemm {
    void (*pack_a)(const GemmOperand &a, int64_t M, int64_t K, int64_t panel0, int64_t panel1, uint16_t *ap) = nullptr;
    // Computes C rows [m0, min(m0 + kGemmMC, M)) x columns [j0, min(j0 + kGemmNR, N)); m0 % kGemmMR == 0.
    void (*tile)(const uint16_t *ap, const GemmOperand &b, int64_t M, int64_t N, int64_t K, int64_t m0, int64_t j0,
                 const Epilogue &epi, void *workspace) = nullptr;
};

// ---------------------------------------------------------------------------------------------------------------
// Packed-B GEMM for a B operand small enough to pack per call (a narrow layer's weight, or x): C[M, N] = A[M, K] *
// B[K, N], accumulated over the whole K in registers (8 x 48 tiles; K is blocked only beyond 256 steps, k pairs in
// BF16), the epilogue per 64 rows x 48 columns. compute BF16 (AVX512_BF16, vdpbf16ps on k pairs, fp32 accumulation) or
// F32 (AVX-512 FMA, everything fp32). A (compute's dtype) is read in place, PbA::Rows: A[i][k] = a[i * lda + k]
// (elements / k pairs broadcast straight from A's rows, no packing) or PbA::Cols (BF16 only): A[i][k] = a[k * lda + i]
// (pairs interleaved on the fly), or pre-packed in panels of 8 rows, PbA::Packed (lda unused): BF16 by gemm_pack_a, F32
// by pack_a_f32. B is packed in 48-column panels of pb_kpt(K, compute) x 48 dwords, panel p of [panel0, panel1) at
// bp + (p - panel0) * pb_kpt(K, compute) * 48: by pack_wt (B[k][n] = w[n][k]; BF16: w bf16 or fp32 rounded to bf16,
// RNE; F32: w fp32, or w bf16 widened, or with round_bf16 w fp32 rounded to bf16 (the AVX-512 F family's bf16
// forward, whose x is widened to fp32 first)) or pack_rows (B[k][n] = b[k * ld + n], same dtypes). block computes C
// rows [m0, m1) x the panel at `panel`, columns [j0, j0 + 48) (m0 % 8 == 0 when packed).
enum class PbA : int { Rows = 0, Packed, Cols };
inline int64_t pb_kpt(int64_t K, DType compute = DType::BF16) { // k (pairs) per panel, whole 16 x 16 transposes
    return ((compute == DType::BF16 ? (K + 1) / 2 : K) + 15) / 16 * 16;
}
struct Int8Weight; // (below, with fgemm)
struct Int4Weight;
struct Sparse24Weight;
struct PbKernels {
    void (*pack_wt)(const void *w, DType w_dtype, bool round_bf16, int64_t ldw, int64_t N, int64_t K, int64_t panel0,
                    int64_t panel1, uint32_t *bp) = nullptr;
    void (*pack_rows)(const GemmOperand &b, int64_t N, int64_t K, int64_t panel0, int64_t panel1,
                      uint32_t *bp) = nullptr;
    void (*block)(const void *a, int64_t lda, PbA mode, int64_t K, const uint32_t *panel, int64_t N, int64_t m0,
                  int64_t m1, int64_t j0, const Epilogue &epi) = nullptr;
    // F32 only: A[i][k] = src[k * ld + i] for i < rows (zero beyond), panels [panel0, panel1) of 8 rows:
    // ap[(panel * K + k) * 8 + r] (PbA::Packed).
    void (*pack_a)(const float *src, int64_t ld, int64_t rows, int64_t K, int64_t panel0, int64_t panel1,
                   float *ap) = nullptr;
    // F32 only: as pack_wt for a weight held quantized or compressed (one of Int8Weight, Int4Weight, Sparse24Weight
    // below set, the others empty), dequantized (as fgemm dequantizes it) or decompressed while packed.
    void (*pack_quant)(const Int8Weight &w8, const Int4Weight &w4, const Sparse24Weight &s24, int64_t N, int64_t K,
                       int64_t panel0, int64_t panel1, uint32_t *bp) = nullptr;
};

// ---------------------------------------------------------------------------------------------------------------
// Forward kernels reading the weight rows in place (no packing): acc[m][n] = sum_k x[m][k] * w[n][k] for the x rows
// [m0, m1) and weight rows [n0, n1), then the epilogue. x is in the compute dtype (bf16: w bf16 or fp32 rounded to bf16
// like autocast; fp32: w fp32). Kernels by family:
//   AVX512_BF16, x bf16: inner products streaming the weight rows at small M (fwd_bf16_inner); other M (any M) a
//     broadcast kernel over x^T,
//     packed per row block of kFwdRowBlock ([m0, m1) is such a block when M > row_block_above).
//   AVX-512 F, x fp32: inner products, M <= 64.
//   AVX2, x bf16 or fp32: inner products streaming the weight rows, widened / rounded in registers, small M.
// [m0, m1) is the whole [0, M) unless M > row_block_above; workspace: workspace_bytes(M, K).
constexpr int64_t kFwdRowBlock = 256;
struct FwdKernel {
    void (*run)(const void *x, int64_t ldx, int64_t M, const void *w, DType w_dtype, int64_t ldw, int64_t K, int64_t m0,
                int64_t m1, int64_t n0, int64_t n1, const Epilogue &epi, void *workspace) = nullptr;
    size_t (*workspace_bytes)(int64_t M, int64_t K) = nullptr;
    int64_t max_m = 0;                   // largest M it takes
    int64_t row_block_above = INT64_MAX; // M above this: tasks are row blocks of kFwdRowBlock
};

// ---------------------------------------------------------------------------------------------------------------
// Small-M backward (AVX512_BF16), M <= kSmallGradXMax.
// grad_x[m][k] = sum_n dpre[m][n] * w[n][k] for the columns [k0, k1), all M rows; dpre bf16 [M, N], w bf16 or fp32
// (rounded to bf16) [N, K], grad_x bf16. The weight rows are streamed sequentially; workspace:
// small_grad_x_workspace_bytes(M, k1 - k0).
// grad_w[n][k] = sum_m dpre[m][n] * x[m][k] (fp32 accumulation) for the rows [n0, n1), written row by row in out_dtype
// (fp32 or bf16); dpre bf16 [M, N], x bf16 [M, K]. workspace: small_grad_w_workspace_bytes(M, K) (x packed as
// interleaved row pairs, done by every call).
constexpr int64_t kSmallGradXMax = 16;
size_t small_grad_x_workspace_bytes(int64_t M, int64_t k_cols);
size_t small_grad_w_workspace_bytes(int64_t M, int64_t K);
struct SmallBackward {
    void (*grad_x)(const void *dpre, int64_t ldd, int64_t M, const void *w, DType w_dtype, int64_t ldw, int64_t N,
                   int64_t k0, int64_t k1, void *gx, int64_t ldgx, void *workspace) = nullptr;
    void (*grad_w)(const void *dpre, int64_t ldd, const void *x, int64_t ldx, int64_t M, int64_t K, int64_t n0,
                   int64_t n1, void *gw, DType out_dtype, int64_t ldgw, void *workspace) = nullptr;
};

// ---------------------------------------------------------------------------------------------------------------
// fp32-FMA GEMM reading its operands in their stored dtype (the AVX2 family; the AVX-512 F family runs it for bf16):
// C[M, N] = A[M, K] * B[K, N] accumulated in fp32, then the epilogue.
//   A: a.trans ? A[i][k] = a[k * lda + i] : A[i][k] = a[i * lda + k]; fp32 or bf16 (widened, exact).
//   B: b.trans ? B[k][j] = b[j * ldb + k] (the forward's weight [N, K]) : B[k][j] = b[k * ldb + j]; fp32 or bf16;
//      round_b: an fp32 B is rounded to bf16 (RNE) first, as autocast casts an fp32 master weight.
// A is packed once per call into fp32 panels of kFgMR rows (pack_a over the panels [panel0, panel1), in parallel;
// fgemm_packed_a_floats(M, K) floats), and block computes C rows [m0, m1) x columns [n0, n1) (m0 % kFgMR == 0) with
// kFgMR x kFgNR register tiles over K blocks of kFgKC, packing the B it needs (widened, rounded) into its workspace
// (fgemm_workspace_bytes): B trans per strip of kFgNC columns over the whole K, B rows per K block over all columns
// (whole row segments: TLB-friendly). The fp32 sums stay in the workspace until the epilogue runs on them.
//   bq (instead of b, b.trans only): an int8 weight dequantized while it is packed, B[k][j] = (q[j * ldq + k] *
//      group[j * ldg + k / 16]) * scale[j] (the codes optional): int8_weight_only_linear's format, no fp32 copy.
struct Int8Weight {
    const int8_t *q = nullptr;
    int64_t ldq = 0;
    const float *scale = nullptr;
    const uint8_t *group = nullptr; // [N, ceil(K / 16)] or null
    int64_t ldg = 0;
};
//   b4 (instead of b, b.trans only): an int4 weight (csrc/cpu/int4_kernels.h's format) dequantized while it is packed,
//      B[k][j] = (u[j][k] - z[j][k / group]) * s[j][k / group] (exact in fp32), K a multiple of 32.
struct Int4Weight {
    const uint8_t *q = nullptr;       // [N, K / 2], 32-k blocks of low / high nibbles
    const uint16_t *scales = nullptr; // [N, K / group] fp16 bits
    const uint8_t *zeros = nullptr;   // [N, K / group] or null (8)
    int64_t group = 0;
};
//   s24 (pb_f32's pack_quant only): a 2:4 weight (sparse24_kernels.h's layout: values [N, K / 2] fp32 or bf16, meta
//      [N, K / 8] bitmasks of the kept positions, valid, K a multiple of 16) decompressed while packed; round_bf16:
//      fp32 values rounded to bf16 (RNE) first, as the contract rounds W to a bf16 x's dtype.
struct Sparse24Weight {
    const void *values = nullptr;
    DType vdt = DType::F32;
    const uint8_t *meta = nullptr;
    bool round_bf16 = false;
};
struct FgemmArgs {
    GemmOperand a, b;
    Int8Weight bq; // bq.q set: B is this int8 weight (b unused)
    Int4Weight b4; // b4.q set: B is this int4 weight (b unused)
    bool round_b = false;
    int64_t M = 0, N = 0, K = 0;
};
constexpr int64_t kFgMR = 6, kFgNR = 16, kFgKC = 256, kFgNC = 64, kFgMS = 480;
constexpr int64_t kFgStripPanels = kFgNC / kFgNR;
int64_t fgemm_packed_a_floats(int64_t M, int64_t K);
size_t fgemm_workspace_bytes(const FgemmArgs &g, int64_t rows, int64_t cols); // of block() on rows x cols
struct Fgemm {
    void (*pack_a)(const FgemmArgs &g, int64_t panel0, int64_t panel1, float *ap) = nullptr;
    void (*block)(const FgemmArgs &g, const float *ap, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                  const Epilogue &epi, void *workspace) = nullptr;
};

// x [M, K] (fp32 or bf16, row stride ldx) times a quantized weight (FgemmArgs::bq or ::b4, the other one empty)
// through fgemm (the AVX2 family) or the fp32 pb kernel (the AVX-512 families: 16-lane FMAs, 8 x 48 tiles, the
// weight packed in chunks of panels of about 1 MB per thread; a bf16 x widened to fp32 first), + bias (fp32 or null),
// into out [M, N] (row stride N, fp32 or bf16): fused_linear.cpp runs it on its threads; false (nothing written) when
// this process's family has neither. For the weight-only layers where they are compute-bound (int8.cpp, int4.cpp):
// the weight is dequantized strip by strip (chunk by chunk) as it is packed, never as a whole.
bool fgemm_quantized_weight(const void *x, DType x_dtype, int64_t ldx, int64_t M, const Int8Weight &w8,
                            const Int4Weight &w4, int64_t N, int64_t K, const float *bias, void *out, DType out_dtype);

// ---------------------------------------------------------------------------------------------------------------
// One family's kernels. Absent kernels are null; the glue then takes the next path (see fused_linear.cpp).
struct Kernels {
    const char *name = "scalar";
    EpilogueFn epilogue = nullptr; // every family
    DprePassFn dpre_pass = nullptr;
    FwdKernel fwd_bf16, fwd_f32;
    PbKernels pb_bf16, pb_f32;
    Bf16Gemm gemm_bf16;
    SmallBackward small_bf16;
    Fgemm fgemm;
};
// A family's table, built by Make the first time it is asked for (each family's file hands it out through this).
template <Kernels (*Make)()> const Kernels *cached_table() {
    static const Kernels k = Make();
    return &k;
}
const Kernels *kernels_avx512_bf16(); // fused_linear_avx512.cpp (nullptr on non-x86 builds)
const Kernels *kernels_avx512();      // fused_linear_avx512.cpp: AVX-512 F, bf16 through the AVX2 kernels
const Kernels *kernels_avx2();        // fused_linear_avx2.cpp
const Kernels *kernels_scalar();      // fused_linear_scalar.cpp
// The family of this process (cpu_isa.h level, decided once).
const Kernels &kernels();

} // namespace fused_linear
} // namespace fastdl
