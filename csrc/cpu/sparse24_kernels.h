// Shared declarations between the ATen glue (sparse24.cpp) and the SIMD kernels (sparse24_avx512.cpp).
// No torch headers here: the SIMD translation unit must not see ATen (it is compiled with the generic project flags
// and enables AVX2 / AVX-512 per function with target attributes, chosen at run time from cpuid).
//
// 2:4 layout (see fastdl/ops/sparse24.py): groups of 4 consecutive elements along K keep 2 elements.
//   values [N][K/2]       the kept elements of each group in increasing index order
//   meta   [N][ceil(K/8)] 4 bits per group = bitmask of its kept positions; byte j = group 2j (low nibble) |
//                         group 2j+1 (high nibble). Bytes 4i..4i+3 read as a little-endian uint32 are the mask of
//                         positions 32i..32i+31, and every 16 positions hold exactly 8 kept values, so 16 (32)
//                         consecutive positions are expanded from 8 (16) consecutive values with one vexpandps
//                         (vpexpandw) under that mask.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fastdl {
namespace sparse24 {

enum class DType : int { F32 = 0, BF16 = 1, F16 = 2 };

// Instruction-set levels, lowest first. Avx512Bf16 also needs AVX512_VBMI2 (vpexpandw).
enum Level : int { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3 };

// The level of the 2:4 kernels in this process, from cpu_isa.h (cpuid, capped by FASTDL_CPU_ISA; decided once).
int active_level();
const char *level_name(int level);

// Prune+compress rows [r0, r1) of the dense weight w (row stride ld elements, K columns, K % 4 == 0). Each output
// may be nullptr (not written): values [rows][K/2] in w's dtype, meta [rows][ceil(K/8)], mask [rows][K] bool bytes.
void compress_rows(int level, DType dt, const void *w, int64_t ld, int64_t K, int64_t r0, int64_t r1, void *values,
                   uint8_t *meta, bool *mask);

// Dense rows [r0, r1) (K columns, zeros at pruned positions) from values / meta. Element size of dt; the bits are
// copied (no conversion), so any 16-bit type works as BF16.
void decompress_rows(int level, DType dt, const void *values, const uint8_t *meta, int64_t K, int64_t r0, int64_t r1,
                     void *out);

// out[m][n] = round(sum_k x[m][k] * W[n][k] + bias[n]) for all M rows and the output columns n in [n0, n1);
// W = decompress(values, meta); x, values and out share dt (F32 or BF16); fp32 accumulation.
struct LinearArgs {
    DType dt = DType::F32;
    const void *x = nullptr; // [M][ldx]
    int64_t ldx = 0;
    int64_t M = 0;
    int64_t K = 0;
    const void *values = nullptr;  // [N][K/2]
    const uint8_t *meta = nullptr; // [N][ceil(K/8)]
    int64_t N = 0;
    const float *bias = nullptr; // [N] or nullptr
    void *out = nullptr;         // [M][ldo]
    int64_t ldo = 0;
};
// Column count the glue should split N by between threads (a multiple of every kernel's block of rows).
int64_t linear_split(int level, const LinearArgs &a);
void linear_rows(int level, const LinearArgs &a, int64_t n0, int64_t n1);

} // namespace sparse24
} // namespace fastdl
