// The int4 weight-only capability's kernel interface, shared by the ATen glue (int4.cpp) and the kernel families:
//   int4_avx512.cpp  AVX-512 F/BW/VL (+ F16C): the streaming kernel of int4_stream.h over 512-bit vectors;
//   int4_avx2.cpp    AVX2 + FMA + F16C: the same body over 256-bit vectors;
//   int4_scalar.cpp  portable C++.
// One table per family (struct Kernels), chosen once per process from cpu_isa.h's level (FASTDL_CPU_ISA caps it).
// The body is written once (int4_stream.h) over a vector-traits type; each SIMD file defines its traits (how 16
// packed bytes become 32 dequantized fp32 weights, FMA, horizontal sum) and includes it - the only per-ISA code.
// No torch headers here.
//
// Format (fastdl/ops/int4.py; docs in the module): W [N, K] with codes u in 0..15 in blocks of 32 input features, byte
// i (0..15) of a block holding u[32 b + i] in its low nibble and u[32 b + 16 + i] in its high nibble (one 16-byte load
// is 32 consecutive codes); per group of G in {32, 64, 128} features an fp16 scale s and a zero point z (uint8, or 8
// when there is no zeros tensor): W[n][k] = (u - z) * s, exact in fp32.
#pragma once

#include <cstdint>

// The kernel family int4_weight_only_linear runs in this process, for `fastdl info`.
const char *fastdl_int4_cpu_kernels();

namespace fastdl {
namespace int4 {

struct Int4Args {
    const float *x = nullptr; // [M, K] fp32, row stride ldx
    int64_t ldx = 0;
    int64_t M = 0, K = 0, N = 0, group = 0;
    const uint8_t *q = nullptr;       // [N, K / 2]
    const uint16_t *scales = nullptr; // [N, K / group] fp16 bits
    const uint8_t *zeros = nullptr;   // [N, K / group] or null (8)
    const float *bias = nullptr;      // [N] or null
    float *out = nullptr;             // [M, N] fp32, row stride ldo
    int64_t ldo = 0;
    const uint16_t *xh = nullptr; // stream_bf16 only: x as bf16 bits [M, K], row stride ldx (x is then unused)
};

// The streaming kernel reads each packed weight byte once per call for up to kStreamRows rows of x (the rows' FMAs
// share every dequantized weight vector); it computes out rows [0, M) x columns [n0, n1) (any M: more rows are done
// kStreamRows at a time, re-reading the weights, which only the scalar family does).
constexpr int64_t kStreamRows = 4;

// W4A8 (int4_a8_linear): x quantized per row and per weight group (the same G input features) to int8 with its own
// scale, s_x = amax / 127, q = round_half_even(x * (127 / amax)) (fastdl/ops/int4.py's contract, bit for bit), then
// integer products: per group sum_k q_x (u - z) exactly in int32 (u unsigned 0..15 against s8 q_x: vpdpbusd with
// VNNI, vpmaddubsw + vpmaddwd on AVX2 - pair sums <= 2 * 15 * 127, no int16 saturation), times s_x * s_w in fp32.
struct A8Args {
    // x's codes [M, K] (row stride K); its scales and the sums of its codes (for the zero points) per row and group,
    // [M, ldg] with ldg = K / group rounded up to a multiple of 8 (the padding is 0: the kernels read 8 groups at once)
    const int8_t *qx = nullptr;
    const float *sx = nullptr;
    const int32_t *sumx = nullptr;
    int64_t M = 0, K = 0, N = 0, group = 0;
    const uint8_t *q = nullptr;
    const uint16_t *scales = nullptr;
    const uint8_t *zeros = nullptr;
    const float *bias = nullptr;
    float *out = nullptr; // [M, N] fp32, row stride ldo
    int64_t ldo = 0;
};

// Rows [m0, m1) of x [., K] (fp32, row stride ldx) quantized per group as above.
struct QuantX {
    const float *x = nullptr;
    int64_t ldx = 0, K = 0, group = 0;
    int8_t *qx = nullptr;
    float *sx = nullptr;     // [M, ldg] (A8Args), the padding left as the caller set it
    int32_t *sumx = nullptr; // [M, ldg]
    bool natural = false;    // codes in k order always (a8_gemm); else the paired order where K % 64 == 0
};

// W4A8 weight rows per block: each block's packed bytes (kA8BlockRows x K / 2: 32 KB at K = 4096) stay in L1/L2 while
// every 4-row tile of x runs over them, so the weights stream from memory once at any M.
constexpr int64_t kA8BlockRows = 16;

struct Kernels {
    const char *name = "scalar";
    void (*stream)(const Int4Args &a, int64_t n0, int64_t n1) = nullptr;
    void (*quantize_x)(const QuantX &q, int64_t m0, int64_t m1) = nullptr;
    void (*a8)(const A8Args &a, int64_t n0, int64_t n1) = nullptr; // all M rows, weight rows [n0, n1)
    // the float kernel for more rows (int4_stream.h's i4_tiles): all M rows, weight rows [n0, n1); null: stream
    void (*tiles)(const Int4Args &a, int64_t n0, int64_t n1) = nullptr;
    // The float route of this family (int4.cpp): stream up to stream_max_rows rows of x, tiles up to tiles_max_rows,
    // fused_linear's fgemm above (measured per family: the numbers are in each family's file)
    int64_t stream_max_rows = INT64_MAX, tiles_max_rows = 0;
    // weight rows [n0, n1) dequantized, (u - z) * s (exact in fp32), then rounded to bf16 (RNE) into dst
    // [n1 - n0, K]: the blocks of int4.cpp's bf16 route (AVX-512 only: only CPUs with AVX512_BF16 take that route)
    void (*dequant_rows_bf16)(const Int4Args &a, int64_t n0, int64_t n1, uint16_t *dst) = nullptr;
    // W4A8 as a GEMM from a8_gemm_min_rows rows (x's codes in k order: QuantX::natural): all M rows, weight rows
    // [n0, n1); null: a8 at every M (int4_avx512.cpp has the numbers)
    void (*a8_gemm)(const A8Args &a, int64_t n0, int64_t n1) = nullptr;
    int64_t a8_gemm_min_rows = INT64_MAX;
    // The streaming kernel for bf16 x (Int4Args::xh; AVX512_BF16, taken only where fused_linear's family has it):
    // vdpbf16ps on x and the exact u - z (in bf16), the group's sum times s in fp32; all M rows, weight rows [n0, n1).
    // The route takes it for stream_bf16_rows[0] <= M <= stream_bf16_rows[1] and groups of stream_bf16_min_group or
    // more (measured: int4_avx512.cpp).
    void (*stream_bf16)(const Int4Args &a, int64_t n0, int64_t n1) = nullptr;
    int64_t stream_bf16_rows[2] = {0, 0};
    int64_t stream_bf16_min_group = 0;
};

#if defined(__x86_64__) || defined(_M_X64)
const Kernels *kernels_avx512();
const Kernels *kernels_avx2();
#else // the SIMD families are x86 code: their files compile to nothing elsewhere
inline const Kernels *kernels_avx512() {
    return nullptr;
}
inline const Kernels *kernels_avx2() {
    return nullptr;
}
#endif
const Kernels *kernels_scalar();
const Kernels &kernels(); // this process's family (cpu_isa.h level, decided once)

// fp16 bits -> fp32, exact (portable; the SIMD families use F16C).
inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13); // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign; // +-0
    } else {         // subnormal: normalise
        exp = 113;
        while ((man & 0x400u) == 0) {
            man <<= 1;
            --exp;
        }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

} // namespace int4
} // namespace fastdl
