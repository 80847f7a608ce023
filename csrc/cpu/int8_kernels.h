// Shared declarations between the ATen glue (int8.cpp: argument checks, blocking, threads) and the kernels of the int8
// capability: int8_avx512.cpp (AVX512-VNNI W8A8, AVX512-BF16 weight-only), int8_avx2.cpp (CPUs without VNNI) and
// int8_scalar.cpp (portable fallback). No torch headers here: the SIMD translation units are compiled with the
// generic project flags and enable their ISA per function with target attributes, so they must not see ATen.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

// Which int8 CPU kernels run in this process: "avx512_vnni+bf16", "avx512_vnni", "avx2" or "scalar". Decided once,
// from the level of cpu_isa.h (cpuid, capped by FASTDL_CPU_ISA). For `fastdl info`.
const char *fastdl_int8_isa();

namespace fastdl {
namespace int8 {

using cpu::DType; // F32 / BF16 / F16 / I32 / I8 (cpu_isa.h)

// ---------------------------------------------------------------------------------------------------------------
// Per-token quantisation (contract formula): per row, amax = max |x| in fp32; non-finite amax -> scale NaN, q = 0;
// amax == 0 -> scale 0, q = 0; else inv = 127 / amax, q = clamp(rne(x * inv), -127, 127), scale = amax / 127.
// (x * inv can only be NaN for x == 0 when amax < 127 / FLT_MAX makes inv infinite: that q is 0.)
struct QuantRows {
    const void *src = nullptr; // element (r, k) at src + r * ld + k, dtype F32 / BF16 / F16
    int64_t ld = 0;
    DType dtype = DType::F32;
    int64_t rows = 0, K = 0;
    int8_t *q = nullptr; // element (r, k) at q + r * ldq + k
    int64_t ldq = 0;
    float *scale = nullptr; // [rows]
};

// ---------------------------------------------------------------------------------------------------------------
// W8A8 GEMM: C[m, n] = sum_k A[m, k] * B[n, k] in int32 on a block of A rows packed into a small buffer, and B in the
// VNNI layout of int8_pack_weight ([Np/16][Kp/4][16 columns][4 k] bytes, so the 16-column block j starts at byte
// j * Kp * 16 and its k-quad q at byte q * 64 within it).

// Pack rows [0, rows) x k in [k0, k0 + kc) of A into dst (row stride ldd elements), in the element type of the ISA
// (Kernels::a_bytes): the int8 value a (scalar, AVX2), or a + 128 as uint8 (AVX512-VNNI takes u8 x s8; the
// compensation 128 * sum_k B[n, k] is removed in the epilogue). k >= K is padded with a = 0. A is int8 (copied)
// or float (quantised per token; the row scales are computed first when compute_scales, else read from scale).
struct APack {
    const void *src = nullptr; // element (r, k) at src + r * ld + k
    int64_t ld = 0;
    DType dtype = DType::I8; // I8, or F32 / BF16 / F16 to quantise
    int64_t rows = 0, K = 0, k0 = 0, kc = 0;
    float *scale = nullptr;      // [rows], float A only: amax / 127
    float *inv = nullptr;        // [rows], float A only: 127 / amax (0 for rows of zeros and non-finite rows)
    bool compute_scales = false; // fill scale and inv (first K slice), else read them
    void *dst = nullptr;
    int64_t ldd = 0;
    // Float A only, the 7-bit activation mode (int8_linear with act_bits = 7): per row an unsigned code q in [0, 127]
    // with a zero point z (u7_params below; scale = range / 127, inv = 127 / range), the row's value (q - z) * scale.
    // Stored as q for a kernel that takes it directly (u7_direct: the AVX2 gemm_block_u7, which subtracts
    // z * sum_k B[n, k] in its epilogue), else as the int8 a = q - z in [-127, 127] for the exact kernels.
    bool u7 = false, u7_direct = false;
    int32_t *zero = nullptr; // [rows], u7: z (filled with the scales)
};

// The 7-bit mode's parameters of a row (the contract formula of fastdl/ops/int8.py): lo = min(0, min x) and hi =
// max(0, max x) in fp32, range = hi - lo (fp32). A row holding NaN / Inf, or whose range overflows fp32: scale NaN,
// every a 0. range 0, or inv = 127 / range not finite (range below ~3.7e-37): scale 0, every a 0. Else inv = 127 /
// range, scale = range / 127 (IEEE fp32 divisions) and z = clamp(rint(-lo * inv), 0, 127); then per value q =
// clamp(rint(x * inv) + z, 0, 127). inv = 0 marks the rows whose a are all 0 (and z = 0).
namespace {
inline float u7_params(bool nonfinite, float lo, float hi, float *inv, int32_t *z) {
    const float range = hi - lo;
    *inv = 0.0f;
    *z = 0;
    if (nonfinite || !(range <= 3.4028234e38f)) {
        return std::nanf("");
    }
    const float iv = 127.0f / range;
    if (range == 0.0f || !(iv <= 3.4028234e38f)) {
        return 0.0f;
    }
    *inv = iv;
    const float zf = std::nearbyint(-lo * iv); // the default rounding mode: to nearest even
    *z = zf < 0.0f ? 0 : (zf > 127.0f ? 127 : static_cast<int32_t>(zf));
    return range / 127.0f;
}
} // namespace

// The padding of a packed A row d (slice [k0, k0 + kc), valid part ending at k1): a = 0 for k >= K, stored as `zero`.
inline void pad_a_row(uint8_t *d, int64_t k0, int64_t k1, int64_t kc, uint8_t zero) {
    const int64_t from = k1 > k0 ? k1 - k0 : 0;
    if (kc > from) {
        std::memset(d + from, zero, static_cast<size_t>(kc - from));
    }
}

// One row block of A (packed, kc k values) times the 16-column blocks [0, cols / 16) of a slice of packed B.
// K slices: the first slice starts from zero, the others add the int32 partial sums kept in `partial` (rows x cols,
// row stride ldp); every slice but the last stores its sums there, the last one applies the epilogue:
//   out_dtype I32:  out = acc
//   else:           out = cast(((float(acc) * a_scale[r]) * b_scale[n]) + bias[n])   (fp32, this order, no FMA)
// Only the columns n < n_valid are stored.
struct GemmBlock {
    const void *a = nullptr; // packed A block
    int64_t lda = 0;         // elements
    int64_t rows = 0;
    const int8_t *b = nullptr; // packed B at (first 16-column block of the range, first k-quad of the slice)
    int64_t b_stride = 0;      // bytes between consecutive 16-column blocks (Kp * 16)
    int64_t kc = 0;            // k values in the slice (multiple of 4)
    int64_t cols = 0;          // multiple of 16
    int64_t n_valid = 0;
    bool first = true, last = true;
    int32_t *partial = nullptr;
    int64_t ldp = 0;
    // epilogue (all indexed from the first row / column of the block)
    const int32_t *comp = nullptr;   // 128 * sum_k B[n, k]: read by the VNNI kernels and by gemm_block_u7
    const int32_t *a_zero = nullptr; // gemm_block_u7: z per row; acc = sum_k q B - z * (comp[n] >> 7) before the rest
    const float *a_scale = nullptr, *b_scale = nullptr, *bias = nullptr;
    void *out = nullptr;
    int64_t ldo = 0; // elements
    DType out_dtype = DType::F32;
};

// ---------------------------------------------------------------------------------------------------------------
// Weight-only: out[m, n] = cast(w_scale[n] * sum_k x[m, k] * d[n, k] + bias[n]) with x fp32 (or bf16 for the
// AVX512-BF16 kernel) and w int8 [N, K] row-major, dequantised in registers. Rows [0, rows) x columns [0, cols).
// d[n, k] = w[n, k] without group scales; with them (w_group != nullptr) d[n, k] = w[n, k] * w_group[n * ldg + k / 16]
// (kWeightGroup = 16 k per group, uint8 scales): an integer |d| <= 127 * 255, exact in fp32. The fp32-x kernels
// multiply by the exact d; the bf16-x kernels round d to bf16 before vdpbf16ps (like a bf16 GEMM on the dequantised
// weight).
struct WeightOnly {
    const void *x = nullptr; // element (m, k) at x + m * ldx + k
    int64_t ldx = 0;
    int64_t rows = 0, K = 0;
    const int8_t *w = nullptr; // element (n, k) at w + n * ldw + k
    int64_t ldw = 0;
    int64_t cols = 0;
    const float *w_scale = nullptr, *bias = nullptr;
    const uint8_t *w_group = nullptr; // optional group scales: element (n, g) at w_group + n * ldg + g
    int64_t ldg = 0;
    void *out = nullptr;
    int64_t ldo = 0;
    DType out_dtype = DType::F32;
};
constexpr int64_t kWeightGroup = 16;

// Group codes as the SIMD weight-only kernels read them: converted to fp32 (exact) once per column group of kWoCols
// w rows, in chunks of kCodeChunk groups; chunk c holds the kWoCols rows' codes of groups [64 c, 64 c + 64), 64
// floats per row, so that in a tile the code of w row j is at the constant offset j * kCodeChunk from one pointer (a
// variable row stride takes a general register per row, and the NB = 8 tile then ran out of them: 1.6x -> 1.35x the
// time of the per-channel kernel).
constexpr int64_t kWoCols = 24;
constexpr int64_t kCodeChunk = 64;
constexpr int64_t kCodeChunkStride = kWoCols * kCodeChunk; // floats per chunk

// Offset of the code of group g of a column group's first w row.
inline int64_t code_offset(int64_t g) {
    return (g / kCodeChunk) * kCodeChunkStride + g % kCodeChunk;
}
inline const float *code_at(const float *codes, int64_t g) {
    return codes + code_offset(g);
}
// Floats of the code buffer of one column group for K input features.
inline int64_t code_buffer_floats(int64_t K) {
    const int64_t chunks = (K + kWeightGroup * kCodeChunk - 1) / (kWeightGroup * kCodeChunk);
    return (chunks > 0 ? chunks : 1) * kCodeChunkStride;
}

// ---------------------------------------------------------------------------------------------------------------
// Scratch memory of the calling thread, 64-byte aligned, at least `bytes`: one buffer per slot, kept and grown across
// calls (a fresh multi-100-KiB buffer per call came from mmap and paid a page fault per 4 KiB, every call: 17 % of a
// W8A8 call at M = 512, K = N = 1024). Contents are undefined. The slots of one call must differ.
enum ScratchSlot : int { kScratchA = 0, kScratchB, kScratchC, kScratchD, kScratchSlots };
void *thread_scratch(int slot, int64_t bytes); // int8_scalar.cpp
template <class T> T *scratch_of(int slot, int64_t count) {
    return static_cast<T *>(thread_scratch(slot, count * static_cast<int64_t>(sizeof(T))));
}

// ---------------------------------------------------------------------------------------------------------------
// int8_pack_weight for the 16-row blocks [jb0, jb1) of w [N, K] (row stride ldw): packed is the whole [Np, Kp] output
// (VNNI layout above, zero padding), comp[n] = 128 * sum_k w[n, k] in int32 arithmetic (0 for padded rows).
struct PackB {
    const int8_t *w = nullptr;
    int64_t ldw = 0, N = 0, K = 0, Kp = 0;
    int64_t jb0 = 0, jb1 = 0;
    int8_t *packed = nullptr;
    int32_t *comp = nullptr;
};
void pack_b_portable(const PackB &p); // int8_scalar.cpp, also used by the AVX2 kernels

namespace {
// Helpers of the SIMD families. No std:: templates in target code: an inline function instantiated in a SIMD
// translation unit could be the copy the linker keeps for the generic ones; these have internal linkage, one copy per
// unit.
inline int64_t imin(int64_t a, int64_t b) {
    return a < b ? a : b;
}
inline int64_t imax(int64_t a, int64_t b) {
    return a > b ? a : b;
}
// The 4 bytes of k-quad q of a packed A row as one int32, for the GEMM tiles' broadcast.
inline int32_t a_quad(const void *row, int64_t q) {
    int32_t v;
    std::memcpy(&v, static_cast<const char *>(row) + 4 * q, 4);
    return v;
}
// Bytes of one element of a float dtype (F32, BF16, F16).
template <DType DT> constexpr int64_t elem_size() {
    return DT == DType::F32 ? 4 : 2;
}
} // namespace

// Walks the cache lines of `rows` w rows (K bytes each, row stride ldw) one prefetch (into L2, prefetcht1) per step:
// the weight-only kernels of int8_avx2.cpp and int8_avx512.cpp fetch the next tile's weights while a tile computes;
// the runs of K bytes per row are too short for the hardware prefetcher (K = 1024: 16 lines). Generic code (no target
// attribute, the same instruction on every level), in an unnamed namespace: each translation unit keeps its own copy.
// Measured, M = 1, one core, weights from DRAM, ms without -> with:
//   AVX2 (caches flushed before each call), per channel: 1024 -> 2816 0.56 -> 0.43, 2048 -> 5504 1.36 -> 1.10,
//   K = N = 4096 1.62 -> 1.50, 11008 -> 4096 3.18 -> 2.74; grouped 1024 -> 2816 0.69 -> 0.45, 2048 -> 5504 1.66
//   -> 1.37. Into L1 (T0) it lost up to 40 % from K = 4096 (a tile's worth ahead evicts the tile's own lines). AVX-512
//   (Zen 4, ranges of two runs, loaded machine, thread CPU time), per channel fp32 x / group scales bf16 x: 4096 ->
//   11008 4.05-4.19 -> 2.94-3.44 / 4.69-4.79 -> 3.56-4.16, 11008 -> 4096 3.29-3.67 -> 2.42-2.81 / 3.97-4.55
//   -> 3.68-3.74; M = 16 within noise or faster (4096 -> 11008 per channel 16.0-17.6 -> 14.8-15.1).
namespace {
struct LinePrefetch {
    const int8_t *base = nullptr;
    int64_t ldw = 0, K = 0, r = 0, c = 0, rows = 0;
    inline __attribute__((always_inline)) void step() {
        if (r < rows) {
            __builtin_prefetch(base + r * ldw + c, 0, 2); // _mm_prefetch(..., _MM_HINT_T1)
            c += 64;
            if (c >= K) {
                c = 0;
                ++r;
            }
        }
    }
};
} // namespace

// Below ~1 M MACs (< 10 us) threads cost more than they save: W8A8 runs on one thread, and so does the weight-only
// kernel of every family that does not set its own limit (Kernels::wo_serial_macs).
constexpr int64_t kSerialMacs = int64_t(1) << 20;

// One ISA's kernels. A null pointer means "not available".
struct Kernels {
    const char *name = "scalar";
    int a_bytes = 1; // bytes per packed A element
    // The least int8 A value the GEMM is exact for: -128, or -127 for the AVX2 sign trick (quantised activations
    // never hold -128; int8_mm splits a user A that does into two products, see int8.cpp).
    int a_min = -128;
    int mr = 1; // rows of the W8A8 register tile (threads get row ranges in multiples of it)
    void (*quantize_rows)(const QuantRows &) = nullptr;
    void (*pack_a)(const APack &) = nullptr;
    void (*gemm_block)(const GemmBlock &) = nullptr;
    // The GEMM on A stored as u7 codes q (APack::u7_direct), if this family has one (AVX2: vpmaddubsw takes q as its
    // unsigned operand directly, no sign trick); the others run gemm_block on a = q - z.
    void (*gemm_block_u7)(const GemmBlock &) = nullptr;
    void (*pack_b)(const PackB &) = nullptr;
    void (*weight_only_f32)(const WeightOnly &) = nullptr;  // x fp32
    void (*weight_only_bf16)(const WeightOnly &) = nullptr; // x bf16
    // The weight-only kernel runs on one thread below this many MACs (M x N x K): under it, waking the other
    // threads costs more than splitting the columns saves. It depends on the kernel's MAC rate (int8_avx2.cpp).
    int64_t wo_serial_macs = kSerialMacs;
};

// The tables of the families; the caller checks cpuid. The SIMD families are x86 code: their files compile to nothing
// elsewhere, where these return nullptr.
#if defined(__x86_64__) || defined(_M_X64)
const Kernels *kernels_avx512();      // AVX512 F/BW/VL/DQ + VNNI
const Kernels *kernels_avx512_bf16(); // the same plus the AVX512-BF16 weight-only kernel
const Kernels *kernels_avx2();        // AVX2 + FMA + F16C
#else
inline const Kernels *kernels_avx512() {
    return nullptr;
}
inline const Kernels *kernels_avx512_bf16() {
    return nullptr;
}
inline const Kernels *kernels_avx2() {
    return nullptr;
}
#endif
const Kernels *kernels_scalar(); // portable C++

// The kernels chosen for this process (see fastdl_int8_isa).
const Kernels &kernels();

} // namespace int8
} // namespace fastdl
