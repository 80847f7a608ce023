// Shared declarations between the ATen glue (sparse24.cpp: checks, threads, dispatch) and the 2:4 kernels of each
// instruction-set level: sparse24_avx512.cpp (AVX-512 F/BW/VL/DQ, and AVX512-BF16 + VBMI2), sparse24_avx2.cpp
// (AVX2 + FMA) and sparse24_scalar.cpp (portable reference). No torch headers here: the SIMD translation units are
// compiled with the generic project flags and enable their ISA per function with target attributes (so inline helpers
// of this header compile to generic code everywhere), chosen at run time from cpu_isa.h.
//
// 2:4 layout (see fastdl/ops/sparse24.py): groups of 4 consecutive elements along K keep 2 elements.
//   values [N][K/2]       the kept elements of each group in increasing index order
//   meta   [N][ceil(K/8)] 4 bits per group = bitmask of its kept positions; byte j = group 2j (low nibble) |
//                         group 2j+1 (high nibble). Bytes 4i..4i+3 read as a little-endian uint32 are the mask of
//                         positions 32i..32i+31, and every 16 positions hold exactly 8 kept values, so 16 (32)
//                         consecutive positions are expanded from 8 (16) consecutive values with one vexpandps
//                         (vpexpandw) under that mask; on AVX2 one meta byte (8 positions, 4 values) selects a
//                         vpshufb control from a 256-entry table.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

// The x86 kernels (sparse24_avx2.cpp, sparse24_avx512.cpp) are compiled in.
#if defined(__x86_64__) || defined(__i386__)
#define FASTDL_SP24_X86 1
#endif

namespace fastdl {
namespace sparse24 {

using cpu::DType; // F32 / BF16 / F16 / I32 / I8 (cpu_isa.h)

// out[m][n] = round(sum_k x[m][k] * W[n][k] + bias[n]) for all M rows and the output columns n in [n0, n1);
// W = decompress(values, meta); out has x's dtype; fp32 accumulation.
struct LinearArgs {
    DType dt = DType::F32;   // x and out: F32 or BF16
    DType vdt = DType::F32;  // values: F32 or BF16 (Kernels::linear tells which (dt, vdt) a family reads directly)
    const void *x = nullptr; // [M][ldx]
    int64_t ldx = 0;
    int64_t M = 0;
    int64_t K = 0;
    const float *xf = nullptr; // x as fp32 [M][ldxf], where LinearKernel::wants_f32_x asked for it (else nullptr)
    int64_t ldxf = 0;
    const void *values = nullptr;  // [N][K/2]
    const uint8_t *meta = nullptr; // [N][ceil(K/8)]
    int64_t N = 0;
    const float *bias = nullptr; // [N] or nullptr
    void *out = nullptr;         // [M][ldo]
    int64_t ldo = 0;
};

// ------------------------------------------------------------------------------------- one family's kernels
// Row kernels: compress[kind] (kind 0 = F32, 1 = BF16, 2 = F16) prunes+compresses one row of K elements, an output
// passed as nullptr is not written; decompress[bytes == 4] expands one row of K elements from its values and meta
// (the bits are copied: any 16-bit type works as BF16), or returns false (nothing written) where the row's meta is
// invalid (detail::meta_rows_ok).
struct RowKernels {
    void (*compress[3])(const void *w, int64_t K, void *vals, uint8_t *meta, bool *mask);
    bool (*decompress[2])(const void *vals, const uint8_t *meta, int64_t K, void *out);
};

// The linear kernel of one (x dtype, values dtype) pair. rows computes the output columns [n0, n1) for all M rows;
// it returns false where the meta of a weight row in [n0, n1) is not valid 2:4 meta: each kernel checks the meta of a
// block of weight rows (detail::meta_rows_ok, from L1 right before it reads them) the first time it reads them, and
// stops at the first invalid one (out is then partly unwritten: the glue raises).
struct LinearKernel {
    bool (*rows)(const LinearArgs &a, int64_t n0, int64_t n1) = nullptr; // nullptr: the glue converts the values first
    bool (*wants_f32_x)(const LinearArgs &a) = nullptr; // x as fp32 in a.xf (converted once, shared by the threads)
    int64_t split = 24; // columns the glue splits N by between threads: a multiple of every NR of the kernel
};

// One instruction-set family's kernels, chosen once per process (sparse24.cpp: kernels()) from the level of
// cpu_isa.h, as fused_linear and int8 choose theirs.
struct Kernels {
    const char *name = "scalar"; // cpu::level_name of the family's level (for `fastdl info`)
    RowKernels rows;
    // Dense fp32 rows [r0, r1) (K columns, zeros at pruned positions) from values of dtype vdt (F32, or BF16 widened
    // exactly): the weight of the dense route (decompress + GEMM), without a 16-bit copy in between. Returns false
    // where a row's meta is invalid.
    bool (*decompress_rows_f32)(DType vdt, const void *values, const uint8_t *meta, int64_t K, int64_t r0, int64_t r1,
                                float *out) = nullptr;
    LinearKernel linear[2][2]; // [x is BF16][values are BF16]
    // sparse24_linear decompresses the weight and runs a dense GEMM from dense_min_rows rows of x on, for weights of
    // at least dense_min_weight elements (the measurements are in sparse24.cpp, dense_route_min_rows).
    int64_t dense_min_rows = INT64_MAX;
    int64_t dense_min_weight = 0;
};

// The tables of the families, as fused_linear and int8 have theirs (the caller, kernels(), checks the CPU). The x86
// ones exist where FASTDL_SP24_X86 is set.
const Kernels *kernels_scalar(); // sparse24_scalar.cpp: portable C++
#ifdef FASTDL_SP24_X86
const Kernels *kernels_avx2();        // sparse24_avx2.cpp: AVX2 + FMA
const Kernels *kernels_avx512();      // sparse24_avx512.cpp: AVX-512 F/BW/VL/DQ (bf16 through the fp32 kernels)
const Kernels *kernels_avx512_bf16(); // sparse24_avx512.cpp: the above + AVX512_BF16 + AVX512_VBMI2
#endif
// The family of this process, chosen once (sparse24.cpp).
const Kernels &kernels();

// Prune+compress rows [r0, r1) of the dense weight w (row stride ld elements, K columns, K % 4 == 0) with the row
// kernels rk. Each output may be nullptr (not written): values [rows][K/2] in w's dtype, meta [rows][ceil(K/8)], mask
// [rows][K] bool bytes.
inline void compress_rows(const RowKernels &rk, DType dt, const void *w, int64_t ld, int64_t K, int64_t r0, int64_t r1,
                          void *values, uint8_t *meta, bool *mask) {
    const auto row = rk.compress[dt == DType::F32 ? 0 : dt == DType::BF16 ? 1 : 2];
    const size_t es = dt == DType::F32 ? 4 : 2;
    const int64_t half = K / 2, mb = (K + 7) / 8;
    for (int64_t r = r0; r < r1; ++r) {
        const char *wr = static_cast<const char *>(w) + r * ld * es;
        row(wr, K, values ? static_cast<char *>(values) + r * half * es : nullptr, meta ? meta + r * mb : nullptr,
            mask ? mask + r * K : nullptr);
    }
}

// Dense rows [r0, r1) (K columns, zeros at pruned positions) from values / meta, element size of dt (bits copied).
// Returns false (rows from the first bad one on unwritten) where meta is not valid 2:4 meta.
inline bool decompress_rows(const RowKernels &rk, DType dt, const void *values, const uint8_t *meta, int64_t K,
                            int64_t r0, int64_t r1, void *out) {
    const size_t es = dt == DType::F32 ? 4 : 2;
    const auto row = rk.decompress[es == 4 ? 1 : 0];
    const int64_t half = K / 2, mb = (K + 7) / 8;
    for (int64_t r = r0; r < r1; ++r)
        if (!row(static_cast<const char *>(values) + r * half * es, meta + r * mb, K,
                 static_cast<char *>(out) + r * K * es))
            return false;
    return true;
}

// ------------------------------------------------------------------------------------- scalar helpers (all levels)
namespace detail {

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) { // round to nearest even, like c10::BFloat16
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float to_f32(float v) {
    return v;
}
inline float to_f32(uint16_t v) {
    return bf16_to_f32(v);
}
inline void store_out(float *p, float v) {
    *p = v;
}
inline void store_out(uint16_t *p, float v) {
    *p = f32_to_bf16(v);
}

// Magnitude key: |w| read as an unsigned integer (orders like |w|), every NaN mapped to the smallest NaN pattern,
// so NaN > inf > any number and all NaNs tie. Indexed by DType (F32, BF16, F16). Every key is below 2^31, so
// signed 32-bit compares order them too.
inline constexpr uint32_t kNanKey[3] = {0x7F800001u, 0x7F81u, 0x7C01u};
inline constexpr uint32_t kAbsMask[3] = {0x7FFFFFFFu, 0x7FFFu, 0x7FFFu};

inline uint32_t key_of(uint32_t bits, int kind) {
    return std::min(bits & kAbsMask[kind], kNanKey[kind]);
}

// The 6 pairwise comparisons of a group (bit set = the lower index wins: k_i >= k_j) -> nibble of kept positions.
struct CodeLut {
    uint8_t nib[64];
    constexpr CodeLut() : nib() {
        for (int code = 0; code < 64; ++code) {
            const int c01 = code & 1, c02 = (code >> 1) & 1, c03 = (code >> 2) & 1;
            const int c12 = (code >> 3) & 1, c13 = (code >> 4) & 1, c23 = (code >> 5) & 1;
            const int rank[4] = {(1 - c01) + (1 - c02) + (1 - c03), c01 + (1 - c12) + (1 - c13), c02 + c12 + (1 - c23),
                                 c03 + c13 + c23};
            int n = 0;
            for (int i = 0; i < 4; ++i)
                n |= (rank[i] < 2) << i;
            nib[code] = static_cast<uint8_t>(n);
        }
    }
};
inline constexpr CodeLut kCodeLut{};

inline int group_nibble(uint32_t k0, uint32_t k1, uint32_t k2, uint32_t k3) {
    const int code =
        (k0 >= k1) | (k0 >= k2) << 1 | (k0 >= k3) << 2 | (k1 >= k2) << 3 | (k1 >= k3) << 4 | (k2 >= k3) << 5;
    return kCodeLut.nib[code];
}

inline uint8_t meta_nibble(const uint8_t *meta, int64_t g) {
    return (meta[g >> 1] >> ((g & 1) * 4)) & 15;
}

// ------------------------------------------------------------------------------------- meta validation
// Valid 2:4 meta (the layout compress_2_4 writes): every 4-bit group has exactly 2 bits set (0x3, 0x5, 0x6, 0x9, 0xA,
// 0xC), and the unused high nibble of a row's last byte (K % 8 == 4) is 0. The kernels expand values under meta
// masks and tables: a group with 3 or 4 bits set takes values of the next groups, one with fewer leaves them
// misaligned, and every level returned different garbage (issue 34). So each kernel checks the meta of a block of
// weight rows right before it first reads it (one vector pass over bytes that then sit in L1 for the kernel: no
// second trip to memory, as a separate pass over all of meta before the kernels took) and stops with `false` at an
// invalid one, before using it; the glue (sparse24.cpp) then raises a ValueError naming the first bad byte.
inline constexpr uint32_t kValidNibbles = 0x1668; // bit n set where nibble n has exactly 2 bits set

// Nonzero where a nibble of the 16 in w does not have exactly 2 bits set (SWAR popcount per nibble, compared to 2).
inline uint64_t bad_nibbles(uint64_t w) {
    const uint64_t a = w - ((w >> 1) & 0x5555555555555555ull);
    const uint64_t c = (a & 0x3333333333333333ull) + ((a >> 2) & 0x3333333333333333ull);
    return c ^ 0x2222222222222222ull;
}

// Whether every nibble of bytes p[0, n) has exactly 2 bits set (portable: 8 bytes a step).
inline bool meta_bytes_ok(const uint8_t *p, int64_t n) {
    uint64_t bad = 0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        bad |= bad_nibbles(w);
    }
    if (i < n) {
        uint64_t w = 0x3333333333333333ull; // valid nibbles where fewer than 8 bytes remain
        std::memcpy(&w, p + i, static_cast<size_t>(n - i));
        bad |= bad_nibbles(w);
    }
    return bad == 0;
}

// Whether `rows` consecutive meta rows at m (ceil(K/8) bytes a row) are valid; bytes_ok checks whole bytes (the
// level's vector form of meta_bytes_ok).
inline bool meta_rows_ok(const uint8_t *m, int64_t K, int64_t rows, bool (*bytes_ok)(const uint8_t *, int64_t)) {
    const int64_t mb = (K + 7) / 8;
    if (K % 8 == 0)
        return bytes_ok(m, rows * mb);
    for (int64_t r = 0; r < rows; ++r) { // the last byte of a row holds one group (low nibble) and 4 zero bits
        const uint8_t last = m[r * mb + mb - 1];
        if (!bytes_ok(m + r * mb, mb - 1) || last >= 16 || !((kValidNibbles >> last) & 1))
            return false;
    }
    return true;
}

// The two kept positions of a group (0..3) from its nibble; a nibble with fewer than 2 bits (not from compress_2_4)
// reads positions 0 / 1 instead of faulting.
inline void kept_positions(int nib, int &p0, int &p1) {
    p0 = nib ? __builtin_ctz(nib) : 0;
    const int rest = nib & (nib - 1);
    p1 = rest ? __builtin_ctz(rest) : 1;
}

// One group of 4 positions, scalar: used by every level for the K % 8 == 4 tail.
template <typename U> // U: uint32_t (F32 bits) or uint16_t (BF16/F16 bits)
inline void compress_group(const U *p, int64_t g, int kind, U *vals, uint8_t *meta, bool *mask) {
    const int nib = group_nibble(key_of(p[0], kind), key_of(p[1], kind), key_of(p[2], kind), key_of(p[3], kind));
    if (vals) {
        const int p0 = __builtin_ctz(nib), p1 = __builtin_ctz(nib & (nib - 1));
        vals[2 * g] = p[p0];
        vals[2 * g + 1] = p[p1];
    }
    if (meta) {
        if (g & 1)
            meta[g >> 1] |= static_cast<uint8_t>(nib << 4);
        else
            meta[g >> 1] = static_cast<uint8_t>(nib);
    }
    if (mask)
        for (int i = 0; i < 4; ++i)
            mask[4 * g + i] = (nib >> i) & 1;
}

template <typename U> inline void decompress_group(const U *vals, const uint8_t *meta, int64_t g, U *out) {
    const int nib = meta_nibble(meta, g);
    U *o = out + 4 * g;
    o[0] = o[1] = o[2] = o[3] = 0;
    int j = 0;
    for (int i = 0; i < 4 && j < 2; ++i)
        if ((nib >> i) & 1)
            o[i] = vals[2 * g + j++];
}

// Store an MR x NR tile of fp32 sums (acc[i * NR + j]) plus bias into out (rows x cols valid), in out's dtype.
// Every caller's tile kernel writes all MR x NR sums before this reads rows x cols of them; GCC 12 at -O3 -Wall still
// reports "'acc' may be used uninitialized" here once the AVX2 kernel is inlined (issue 33), even with the array
// zero-initialised (a false positive: the zeroing is a dead store it removes first), so the warning is silenced for
// this function only instead of zeroing the tile in the hot loop.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
template <typename T, int NR>
inline void store_tile(const LinearArgs &a, const float *acc, int64_t m0, int rows, int64_t n0, int cols) {
    T *out = static_cast<T *>(a.out);
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j)
            store_out(out + (m0 + i) * a.ldo + n0 + j, acc[i * NR + j] + (a.bias ? a.bias[n0 + j] : 0.f));
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The values and meta of the NR weight rows n, n + 1, ... of a block of a kernel: rows at or past n1 repeat row n1 - 1
// (their results are discarded). Generic code in an unnamed namespace: inlined into each level's kernels, and each
// translation unit keeps its own copy.
namespace {
template <int NR, typename VT> struct BlockRows {
    const VT *v[NR];
    const uint8_t *m[NR];
};

template <int NR, typename VT>
inline BlockRows<NR, VT> block_rows(const LinearArgs &a, const VT *v, int64_t n, int64_t n1) {
    const int64_t half = a.K / 2, mb = (a.K + 7) / 8;
    BlockRows<NR, VT> b;
    for (int j = 0; j < NR; ++j) {
        const int64_t r = std::min<int64_t>(n + j, n1 - 1);
        b.v[j] = v + r * half;
        b.m[j] = a.meta + r * mb;
    }
    return b;
}

// The MR rows of x of a tile at row m, from column k0: rows at or past m1 repeat row m1 - 1 (results discarded).
template <int MR, typename T>
inline void tile_x_rows(const T *x, int64_t ldx, int64_t m, int64_t m1, int64_t k0, const T **xr) {
    for (int i = 0; i < MR; ++i)
        xr[i] = x + std::min<int64_t>(m + i, m1 - 1) * ldx + k0;
}

// The outer loops of a blocked linear kernel: blocks of up to mblk rows of x [m0, m1) > panels of NR weight rows from
// n (cols of them valid, n < n1); body(m0, m1, n, cols) runs one panel on one block. The meta of a panel is checked
// (bytes_ok: the level's form of meta_bytes_ok) on its first pass, right before the body reads it; returns false at
// the first invalid one.
template <int NR, class Body>
inline bool for_panels(const LinearArgs &a, int64_t n0, int64_t n1, int64_t mblk,
                       bool (*bytes_ok)(const uint8_t *, int64_t), const Body &body) {
    const int64_t mb = (a.K + 7) / 8;
    for (int64_t m0 = 0; m0 < a.M; m0 += mblk) {
        const int64_t m1 = std::min(a.M, m0 + mblk);
        for (int64_t n = n0; n < n1; n += NR) {
            const int cols = static_cast<int>(std::min<int64_t>(NR, n1 - n));
            if (m0 == 0 && !meta_rows_ok(a.meta + n * mb, a.K, cols, bytes_ok))
                return false;
            body(m0, m1, n, cols);
        }
    }
    return true;
}
} // namespace

} // namespace detail
} // namespace sparse24
} // namespace fastdl
