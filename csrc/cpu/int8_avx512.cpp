// AVX512-VNNI kernels of the int8 capability (W8A8 GEMM, per-token quantisation) and the weight-only kernels (FMA,
// and AVX512-BF16 `vdpbf16ps` for bf16 activations). No torch headers: this file is compiled with the generic project
// flags and every function enables its ISA with a target attribute; int8.cpp checks cpuid before calling in.
//
// Numbers behind the choices (AMD EPYC, family 26 = Zen 5, 2 cores, measured with stand-alone loops): `vpdpbusd zmm`
// issues 2 per cycle with a 4-cycle latency, so a register tile needs >= 8 independent accumulators; at ~4.1 GHz that
// is ~1 TOP/s per core. L1D 48 KiB, L2 1 MiB per core, L3 32 MiB shared.
#include "../static_dispatch.h"
#include "int8_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstring>
#include <memory>

#define FDL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define FDL_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")))

namespace fastdl {
namespace int8 {
namespace {

// Masks of the first n lanes (n <= 0: none).
inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u);
}
inline __mmask32 mask32(int64_t n) {
    return n >= 32 ? __mmask32(0xffffffffu) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1u);
}
inline __mmask64 mask64(int64_t n) {
    return n >= 64 ? ~__mmask64(0) : n <= 0 ? __mmask64(0) : (__mmask64(1) << n) - 1;
}
// Block j of 16 columns of a tile's output from column c0: its first column and its lanes below n_valid (none when
// the valid columns end before it: the tile's stores stop there).
struct ColBlock {
    int64_t col;
    __mmask16 m;
    ColBlock(int64_t c0, int j, int64_t n_valid) : col(c0 + 16 * j), m(mask16(n_valid - col)) {}
};

constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// ------------------------------------------------------------------------------------------------ element access
// 16 consecutive values (the first n of them, the rest 0) as fp32. bf16 -> fp32 is exact (a shift); fp16 -> fp32
// with vcvtph2ps is exact too, subnormals included.
template <DType DT> FDL_AVX512 inline __m512 load16(const void *p, __mmask16 m) {
    if constexpr (DT == DType::F32) {
        return _mm512_maskz_loadu_ps(m, p);
    } else if constexpr (DT == DType::BF16) {
        __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else {
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    }
}

// fp32 -> bf16 bits, round to nearest even, NaN -> 0x7fc0 (what c10::BFloat16 does; vcvtneps2bf16 would flush
// subnormals, so the rounding is done with integer ops).
FDL_AVX512 inline __m256i to_bf16(__m512 f) {
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

FDL_AVX512 inline void store16(void *p, __m512 f, DType dt, __mmask16 m) {
    if (dt == DType::F32) {
        _mm512_mask_storeu_ps(p, m, f);
    } else if (dt == DType::BF16) {
        _mm256_mask_storeu_epi16(p, m, to_bf16(f));
    } else { // F16: vcvtps2ph rounds to nearest even like c10::Half
        _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(f, kRne));
    }
}

// ------------------------------------------------------------------------------------------- per-token quantisation
// max |x| over a row as the bit pattern of the non-negative float: integer order of those bits is float order, and
// every NaN / Inf pattern (>= 0x7f800000) is above every finite value, so one integer max finds amax and detects
// non-finite rows at once. The same holds for the 16-bit patterns of bf16 and fp16, so those are compared 32 at a time
// without conversion, and only the maximum is converted (exactly) to fp32 bits.
// The unsigned max over lanes of 32-bit (fp32: T = uint32_t) or 16-bit (bf16 / fp16: uint16_t) patterns, for the loop
// of lane_max below.
template <class T> struct Lanes {
    static constexpr int64_t kLanes = 64 / sizeof(T);
    FDL_AVX512 static inline __m512i abs_mask() { return _mm512_set1_epi32(sizeof(T) == 4 ? 0x7fffffff : 0x7fff7fff); }
    FDL_AVX512 static inline __m512i max(__m512i a, __m512i b) {
        if constexpr (sizeof(T) == 4) {
            return _mm512_max_epu32(a, b);
        } else {
            return _mm512_max_epu16(a, b);
        }
    }
    FDL_AVX512 static inline __m512i load_tail(const T *p, int64_t n) {
        if constexpr (sizeof(T) == 4) {
            return _mm512_maskz_loadu_epi32(mask16(n), p);
        } else {
            return _mm512_maskz_loadu_epi16(mask32(n), p);
        }
    }
};

// Lane-wise max of |p[k]| (sign bit cleared) over the K patterns of a row, two vectors per step.
template <class T> FDL_AVX512 inline __m512i lane_max(const T *p, int64_t K) {
    using L = Lanes<T>;
    const __m512i abs_mask = L::abs_mask();
    __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 2 * L::kLanes <= K; k += 2 * L::kLanes) {
        m0 = L::max(m0, _mm512_and_si512(_mm512_loadu_si512(p + k), abs_mask));
        m1 = L::max(m1, _mm512_and_si512(_mm512_loadu_si512(p + k + L::kLanes), abs_mask));
    }
    for (; k < K; k += L::kLanes) {
        m0 = L::max(m0, _mm512_and_si512(L::load_tail(p + k, K - k), abs_mask));
    }
    return L::max(m0, m1);
}

template <DType DT> FDL_AVX512 uint32_t amax_bits(const void *row, int64_t K) {
    if constexpr (DT == DType::F32) {
        return _mm512_reduce_max_epu32(lane_max(static_cast<const uint32_t *>(row), K));
    } else {
        const __m512i m0 = lane_max(static_cast<const uint16_t *>(row), K);
        // 32 x u16 -> 16 x u32 (max of the two halves of each dword), then a dword reduction
        const __m512i hi = _mm512_srli_epi32(m0, 16), lo = _mm512_and_si512(m0, _mm512_set1_epi32(0xffff));
        const uint32_t h = _mm512_reduce_max_epu32(_mm512_max_epu32(hi, lo));
        const __m512 f = load16<DT>(&h, 1); // the 16-bit pattern (lane 0) as fp32, exactly; NaN / Inf stay so
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        return bits & 0x7fffffffu;
    }
}

// q = clamp(rne(x * inv), -127, 127) as int32 lanes; one rounded multiply (no FMA), NaN products -> 0. The clamp is
// done in float (where +-inf clamp correctly; the integer conversion would turn both into INT_MIN). Only needed when
// inv is infinite (amax < 127 / FLT_MAX), see quant_row.
FDL_AVX512 inline __m512i quant16_careful(__m512 x, __m512 inv) {
    __m512 p = _mm512_mul_round_ps(x, inv, kRne);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    p = _mm512_min_ps(_mm512_max_ps(p, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_maskz_mov_epi32(static_cast<__mmask16>(~nan), _mm512_cvt_roundps_epi32(p, kRne));
}

// With a finite inv = fl(127 / amax) and |x| <= amax: |fl(x * inv)| <= 127 (1 + 2^-24)^2 < 127.5, so the rounded value
// is within [-127, 127] without a clamp, and x is finite, so no NaN.
FDL_AVX512 inline __m512i quant16(__m512 x, __m512 inv) {
    return _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(x, inv, kRne), kRne);
}

// Quantise k in [k0, k1) of one row into dst[0 .. k1 - k0) as int8 (Xor = 0) or as u8 a + 128 (Xor = 0x80).
template <DType DT, int Xor>
FDL_AVX512 inline void quant_row(const void *row, int64_t k0, int64_t k1, float inv_s, uint8_t *dst) {
    const char *p = static_cast<const char *>(row);
    const __m512 inv = _mm512_set1_ps(inv_s);
    const __m128i flip = _mm_set1_epi8(static_cast<char>(Xor));
    if (inv_s == 0.0f) { // row of zeros or non-finite row
        std::memset(dst, Xor, static_cast<size_t>(k1 - k0));
        return;
    }
    int64_t k = k0;
    if (inv_s <= 3.4028234e38f) {
        for (; k + 16 <= k1; k += 16) {
            const __m512i q = quant16(load16<DT>(p + k * elem_size<DT>(), 0xffff), inv);
            _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + (k - k0)), _mm_xor_si128(_mm512_cvtepi32_epi8(q), flip));
        }
    }
    for (; k < k1; k += 16) { // tail, or every k when inv is infinite
        const __mmask16 m = mask16(k1 - k);
        const __m512i q = quant16_careful(load16<DT>(p + k * elem_size<DT>(), m), inv);
        _mm_mask_storeu_epi8(dst + (k - k0), m, _mm_xor_si128(_mm512_cvtepi32_epi8(q), flip));
    }
}

// The 7-bit mode (u7_params in int8_kernels.h). lo = min(0, min x), hi = max(0, max x) of a finite row (masked
// lanes load 0, which changes neither).
template <DType DT> FDL_AVX512 void range_of(const void *row, int64_t K, float *lo, float *hi) {
    const char *p = static_cast<const char *>(row);
    __m512 mn = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m512 x = load16<DT>(p + k * elem_size<DT>(), mask16(K - k));
        mn = _mm512_min_ps(mn, x);
        mx = _mm512_max_ps(mx, x);
    }
    *lo = _mm512_reduce_min_ps(mn);
    *hi = _mm512_reduce_max_ps(mx);
}

// k in [k0, k1) of a row as the bytes (q - zsub) xor Xor, q = clamp(rint(x * inv) + z, 0, 127) (x and inv finite);
// a row with inv = 0 stores a = 0.
template <DType DT, int Xor>
FDL_AVX512 void quant_row_u7(const void *row, int64_t k0, int64_t k1, float inv_s, int32_t z, int32_t zsub,
                             uint8_t *dst) {
    if (inv_s == 0.0f) {
        std::memset(dst, Xor, static_cast<size_t>(k1 - k0));
        return;
    }
    const char *p = static_cast<const char *>(row);
    const __m512 inv = _mm512_set1_ps(inv_s), zf = _mm512_set1_ps(static_cast<float>(z));
    const __m512i zs = _mm512_set1_epi32(zsub);
    const __m128i flip = _mm_set1_epi8(static_cast<char>(Xor));
    for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 m = mask16(k1 - k);
        const __m512 r =
            _mm512_roundscale_ps(_mm512_mul_round_ps(load16<DT>(p + k * elem_size<DT>(), m), inv, kRne), kRne);
        const __m512 q =
            _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, zf), _mm512_setzero_ps()), _mm512_set1_ps(127.0f));
        const __m512i a = _mm512_sub_epi32(_mm512_cvttps_epi32(q), zs);
        _mm_mask_storeu_epi8(dst + (k - k0), m, _mm_xor_si128(_mm512_cvtepi32_epi8(a), flip));
    }
}

// ---------------------------------------------------------------------------------------------------- pack A
// A block for vpdpbusd: u8 = a + 128, rows of kc bytes; padding (k >= K) a = 0, i.e. u8 128.
constexpr int kAOffset = 0x80;

FDL_AVX512 void pack_a_int8(const APack &p) {
    const int8_t *src = static_cast<const int8_t *>(p.src);
    const int64_t k1 = imin(p.K, p.k0 + p.kc);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(kAOffset));
    for (int64_t r = 0; r < p.rows; ++r) {
        const int8_t *row = src + r * p.ld;
        uint8_t *d = static_cast<uint8_t *>(p.dst) + r * p.ldd;
        for (int64_t k = p.k0; k < k1; k += 64) {
            const __mmask64 m = mask64(k1 - k);
            _mm512_mask_storeu_epi8(d + (k - p.k0), m, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, row + k), flip));
        }
        pad_a_row(d, p.k0, k1, p.kc, kAOffset);
    }
}

// quantize_rows and pack_a (float rows quantised on the fly, int8 rows by pack_a_int8); the weight-only dot form's
// driver (over the traits WoF32 / WoBf16 below)
#define I8_SIMD FDL_AVX512
#include "int8_pack_a.h"
#include "int8_weight_only.h"
#undef I8_SIMD

// ---------------------------------------------------------------------------------------------------- pack B
// 16 x 16 dword transpose: r[i] holds row i (16 dwords); afterwards r[q] holds dword q of every row.
FDL_AVX512 inline void transpose16x16(__m512i (&r)[16]) {
    __m512i t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + c], lane L: rows 4g .. 4g + 3 of column 4L + c
    __m512i u[16];
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    // 4 x 4 transpose of 128-bit lanes for each c: column 4L + c = lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
        const __m512i w0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), w1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i w2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i w3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        r[c] = _mm512_shuffle_i32x4(w0, w2, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(w0, w2, 0xdd);
        r[8 + c] = _mm512_shuffle_i32x4(w1, w3, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(w1, w3, 0xdd);
    }
}

// int8_pack_weight: 16 rows x 64 k (16 dwords each) transposed are 16 k-quads x 16 rows, i.e. 16 consecutive 64-byte
// vectors of the VNNI layout. comp accumulates sum_k w[n, k] per row with one vpdpbusd by all-ones per vector.
// 4096 x 4096 on one core: 16.8 ms byte by byte, 0.63 ms here.
FDL_AVX512 void pack_b(const PackB &p) {
    const int64_t nq = p.Kp / 4;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t jb = p.jb0; jb < p.jb1; ++jb) {
        int8_t *blk = p.packed + jb * p.Kp * 16;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t k = 0; k < p.Kp; k += 64) {
            const __mmask64 m = mask64(p.K - k);
            __m512i r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
                const int64_t n = jb * 16 + i;
                r[i] = n < p.N ? _mm512_maskz_loadu_epi8(m, p.w + n * p.ldw + k) : _mm512_setzero_si512();
            }
            transpose16x16(r);
            const int64_t nvec = imin(16, nq - k / 4);
            for (int64_t q = 0; q < nvec; ++q) {
                _mm512_storeu_si512(blk + (k / 4 + q) * 64, r[q]);
                sum = _mm512_dpbusd_epi32(sum, ones, r[q]);
            }
        }
        _mm512_storeu_si512(p.comp + jb * 16, _mm512_slli_epi32(sum, 7));
    }
}

// ------------------------------------------------------------------------------------------------- VNNI GEMM
// Register tile: MR rows x NV zmm (16 columns each). 6 x 4 = 24 accumulators (>= 8 needed to hide the 4-cycle
// latency at 2 per cycle) + 4 B registers + 1 broadcast = 29 of 32 zmm. Per k-quad: 4 B loads (256 bytes) and 6
// 4-byte broadcasts for 24 vpdpbusd (12 cycles), i.e. ~23 bytes per cycle from L1/L2.
constexpr int kMR = 6;
constexpr int kNV = 4;

// With npf = 1, also prefetch one line per k-quad of the 16-column block pf of the next panel (see gemm_block).
template <int MR, int NV>
FDL_AVX512 void vnni_tile(const GemmBlock &g, int64_t r0, int64_t c0, const int8_t *pf, int npf) {
    __m512i acc[MR][NV];
    if (g.first) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
                acc[i][j] = _mm512_setzero_si512();
            }
        }
    } else {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
                acc[i][j] = _mm512_loadu_si512(g.partial + (r0 + i) * g.ldp + c0 + 16 * j);
            }
        }
    }
    const uint8_t *a = static_cast<const uint8_t *>(g.a) + r0 * g.lda;
    const int8_t *b = g.b + (c0 / 16) * g.b_stride;
    const int64_t nq = g.kc / 4;
    for (int64_t q = 0; q < nq; ++q) {
        __m512i bv[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
            bv[j] = _mm512_loadu_si512(b + j * g.b_stride + q * 64);
        }
        if (npf) {
            _mm_prefetch(reinterpret_cast<const char *>(pf + q * 64), _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m512i av = _mm512_set1_epi32(a_quad(a + i * g.lda, q));
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
                acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], av, bv[j]);
            }
        }
    }
    if (!g.last) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
                _mm512_storeu_si512(g.partial + (r0 + i) * g.ldp + c0 + 16 * j, acc[i][j]);
            }
        }
        return;
    }
    // Epilogue: remove the +128 compensation, dequantise ((acc * a_scale) * b_scale) + bias with separate roundings
    // (the _round_ forms cannot be contracted into an FMA), cast, masked store of the valid columns.
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        const ColBlock cb(c0, j, g.n_valid);
        if (!cb.m) {
            break;
        }
        const __m512i comp = _mm512_loadu_si512(g.comp + cb.col);
        if (g.out_dtype == DType::I32) {
#pragma GCC unroll 8
            for (int i = 0; i < MR; ++i) {
                _mm512_mask_storeu_epi32(static_cast<int32_t *>(g.out) + (r0 + i) * g.ldo + cb.col, cb.m,
                                         _mm512_sub_epi32(acc[i][j], comp));
            }
            continue;
        }
        const __m512 bs = _mm512_maskz_loadu_ps(cb.m, g.b_scale + cb.col);
        const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(cb.m, g.bias + cb.col) : _mm512_setzero_ps();
        const int64_t esz = g.out_dtype == DType::F32 ? 4 : 2;
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            __m512 f = _mm512_cvt_roundepi32_ps(_mm512_sub_epi32(acc[i][j], comp), kRne);
            f = _mm512_mul_round_ps(f, _mm512_set1_ps(g.a_scale[r0 + i]), kRne);
            f = _mm512_mul_round_ps(f, bs, kRne);
            if (g.bias) { // no bias: no "+ 0", which would turn -0 into +0
                f = _mm512_add_round_ps(f, bias, kRne);
            }
            store16(static_cast<char *>(g.out) + ((r0 + i) * g.ldo + cb.col) * esz, f, g.out_dtype, cb.m);
        }
    }
}

using TileFn = void (*)(const GemmBlock &, int64_t, int64_t, const int8_t *, int);

TileFn tile_fn(int mr, int nv) {
    return with_count<1, kMR>(mr, [&](auto MR) {
        return with_count<1, kNV>(
            nv, [](auto NV) -> TileFn { return &vnni_tile<decltype(MR)::value, decltype(NV)::value>; });
    });
}

// Loop order: 64-column panel outer, row tiles inner, so the panel's B slice (64 x kc bytes, 256 KiB at kc = 4096)
// is read from L3 / DRAM once and from L2 by the following row tiles; the A block (rows x kc bytes) stays in L2.
// Row tiles have balanced heights (32 rows: 2 x 6 + 4 x 5, not 5 x 6 + 2): a short tile reads the same 256 bytes of
// B per k-quad for fewer vpdpbusd; measured 119.5 -> 123.3 MAC/cycle at 32 rows (one core, B from L3).
// With >= 4 row tiles, tile t < 4 also prefetches block t of the next panel, one line per k-quad, so the first tile
// of the next panel does not wait for DRAM. One core, K = 4096, B of 11008 columns (45 MB, from DRAM), MAC/cycle:
// 24 rows 107.8 -> 120.5, 64 rows 115.0 -> 120.2, 128 rows 118.7 -> 120.3; with B in L3 (2048 columns) it costs
// 1-2 % (24 rows 124.3 -> 121.5, 128 rows 123.8 -> 122.4), and with 1-3 tiles it lost up to 40 % (1 row), so it is
// off there. Weights of a real model are never L3-resident, hence the choice.
void gemm_block(const GemmBlock &g) {
    const int64_t ntiles = (g.rows + kMR - 1) / kMR;
    const int64_t base = ntiles ? g.rows / ntiles : 0, taller = ntiles ? g.rows % ntiles : 0;
    for (int64_t c0 = 0; c0 < g.cols; c0 += 16 * kNV) {
        const int nv = static_cast<int>(imin(kNV, (g.cols - c0) / 16));
        const int64_t next_blocks = ntiles >= 4 ? imin(kNV, (g.cols - c0) / 16 - kNV) : 0;
        const int8_t *next = g.b + (c0 / 16 + kNV) * g.b_stride;
        int64_t r0 = 0;
        for (int64_t t = 0; t < ntiles; ++t) {
            const int h = static_cast<int>(base + (t < taller ? 1 : 0));
            tile_fn(h, nv)(g, r0, c0, next + t * g.b_stride, t < next_blocks ? 1 : 0);
            r0 += h;
        }
    }
}

// ------------------------------------------------------------------------------------------------- weight-only
// Dot-product form (no transposition of w): tile of MB x rows by NB w rows, 16 (fp32) or 32 (bf16) k per step, each
// w vector converted once (int8 -> int32 -> fp32 [-> bf16]) and used by the MB rows; horizontal sums at the end.
// At M = 1 the kernel streams 1 byte per weight with 3 vector uops per 16 weights (vpmovsxbd, vcvtdq2ps, vfmadd) and
// is bound by those uops: one core reads 70 GB/s of weights from L3 (41 GB/s from DRAM); NB = 8 gives the 8
// independent FMA chains the 4-cycle latency needs. Tried and slower at M = 1: NB = 12 / 16, 64-byte steps per row,
// software prefetch, int8 -> fp32 by a magic-number add + vsubps instead of vcvtdq2ps (-22 %).

// Finish MB x NB dot products: out[m0 + i][n0 + j] = cast(sum * w_scale + bias).
template <int MB, int NB>
FDL_AVX512 inline void wo_store(const WeightOnly &p, int64_t m0, int64_t n0, const __m512 (&acc)[MB][NB]) {
    const __mmask16 m = mask16(NB);
    const __m512 ws = _mm512_maskz_loadu_ps(m, p.w_scale + n0);
    const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(m, p.bias + n0) : _mm512_setzero_ps();
    const int64_t esz = p.out_dtype == DType::F32 ? 4 : 2;
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
        alignas(64) float s[16] = {};
#pragma GCC unroll 8
        for (int j = 0; j < NB; ++j) {
            s[j] = _mm512_reduce_add_ps(acc[i][j]);
        }
        __m512 f = _mm512_mul_ps(_mm512_load_ps(s), ws);
        if (p.bias) {
            f = _mm512_add_ps(f, bias);
        }
        store16(static_cast<char *>(p.out) + ((m0 + i) * p.ldo + n0) * esz, f, p.out_dtype, m);
    }
}

// Group codes for the dot form: the layout of int8_kernels.h (code_at), one column group of kWoCols w rows.

// One 16-k step of the fp32 tile (Masked: the K tail, with masked loads that read nothing past the end). Grouped: the
// step is one group (k is a multiple of 16), c[j * kCodeChunk] is its code for w row j, and the converted weights are
// multiplied by it (exact: |d| <= 127 * 255) before the FMA: one vmulps with a broadcast memory operand.
template <int MB, int NB, bool Masked, bool Grouped>
FDL_AVX512 inline void wo_f32_step(const float *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t k, __mmask16 m,
                                   const float *c, __m512 (&acc)[MB][NB]) {
    __m512 xv[MB];
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
        xv[i] = Masked ? _mm512_maskz_loadu_ps(m, x + i * ldx + k) : _mm512_loadu_ps(x + i * ldx + k);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
        const __m128i w8 = Masked ? _mm_maskz_loadu_epi8(m, w + j * ldw + k)
                                  : _mm_loadu_si128(reinterpret_cast<const __m128i *>(w + j * ldw + k));
        __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(w8));
        if constexpr (Grouped) {
            wv = _mm512_mul_ps(wv, _mm512_set1_ps(c[j * kCodeChunk]));
        }
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
            acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
}

// bf16 x: int8 weights are exact in bf16 (8 significant bits), and vdpbf16ps multiplies exactly and accumulates in
// fp32, so this is the fp32 computation with another summation order. 32 k per step: 5 uops convert 32 weights
// (2 x vpmovsxbd, 2 x vcvtdq2ps, vcvtne2ps2bf16), then one vdpbf16ps per row. Grouped: a step is the groups k / 16
// (lo) and k / 16 + 1 (hi) with codes c[j * kCodeChunk] and c[j * kCodeChunk + 1] (an even group and the next one:
// the same chunk): two more vmulps, then d is rounded to bf16 (the contract for bf16 x). In the masked tail the hi
// group may not exist (hi_valid false, as all its weights are masked): its code is not read.
template <int MB, int NB, bool Masked, bool Grouped>
FDL_AVX512BF16 inline void wo_bf16_step(const uint16_t *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t k,
                                        __mmask32 m, const float *c, bool hi_valid, __m512 (&acc)[MB][NB]) {
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
        xv[i] = (__m512bh)(Masked ? _mm512_maskz_loadu_epi16(m, x + i * ldx + k) : _mm512_loadu_si512(x + i * ldx + k));
    }
#pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
        const __m256i w8 = Masked ? _mm256_maskz_loadu_epi8(m, w + j * ldw + k)
                                  : _mm256_loadu_si256(reinterpret_cast<const __m256i *>(w + j * ldw + k));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
        if constexpr (Grouped) {
            lo = _mm512_mul_ps(lo, _mm512_set1_ps(c[j * kCodeChunk]));
            if (!Masked || hi_valid) {
                hi = _mm512_mul_ps(hi, _mm512_set1_ps(c[j * kCodeChunk + 1]));
            }
        }
        const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
#pragma GCC unroll 4
        for (int i = 0; i < MB; ++i) {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
        }
    }
}

// The x types of the dot form, for its tile (int8_wo_tile_avx512.h, one body per target) and its driver
// (int8_weight_only.h): MB rows x NB w rows: MB <= 2 -> NB = 8 (8-16 accumulators), MB 3-4 -> NB = 6 (18-24
// accumulators + MB x + 1 w <= 29 zmm). Leftover w rows use NB = 1.
struct F32X {
    using T = float;
    static constexpr int64_t kStep = 16;
    static constexpr __mmask16 kAll = 0xffff;
    static inline __mmask16 mask(int64_t n) { return mask16(n); }
    template <int MB, int NB, bool Masked, bool Grouped>
    FDL_AVX512 static inline void step(const float *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t k,
                                       __mmask16 m, const float *c, bool, __m512 (&acc)[MB][NB]) {
        wo_f32_step<MB, NB, Masked, Grouped>(x, ldx, w, ldw, k, m, c, acc);
    }
};
struct Bf16X {
    using T = uint16_t;
    static constexpr int64_t kStep = 32;
    static constexpr __mmask32 kAll = 0xffffffffu;
    static inline __mmask32 mask(int64_t n) { return mask32(n); }
    template <int MB, int NB, bool Masked, bool Grouped>
    FDL_AVX512BF16 static inline void step(const uint16_t *x, int64_t ldx, const int8_t *w, int64_t ldw, int64_t k,
                                           __mmask32 m, const float *c, bool hi_valid, __m512 (&acc)[MB][NB]) {
        wo_bf16_step<MB, NB, Masked, Grouped>(x, ldx, w, ldw, k, m, c, hi_valid, acc);
    }
};

namespace f32x {
#define I8_WO_SIMD FDL_AVX512
#include "int8_wo_tile_avx512.h"
#undef I8_WO_SIMD
} // namespace f32x
namespace bf16x {
#define I8_WO_SIMD FDL_AVX512BF16
#include "int8_wo_tile_avx512.h"
#undef I8_WO_SIMD
} // namespace bf16x

// Group codes, 16 at a time (int8_weight_only.h's Codes)
struct Codes512 {
    static constexpr int64_t kLanes = 16;
    FDL_AVX512 static inline void convert(const uint8_t *src, float *dst) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src));
        _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
    }
    FDL_AVX512 static inline void convert_tail(const uint8_t *src, int64_t n, float *dst) {
        _mm512_storeu_ps(dst, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask16(n), src))));
    }
};

struct Wo512 {
    static constexpr int kMB = 4;
    static constexpr int nb_for(int mb) { return mb <= 2 ? 8 : 6; }
    using Codes = Codes512;
};
struct WoF32 : Wo512 {
    static constexpr int64_t kXBytes = 4;
    template <int MB, int NB, bool G> static constexpr WoTileFn tile() { return &f32x::wo_dot_tile<F32X, MB, NB, G>; }
};
struct WoBf16 : Wo512 {
    static constexpr int64_t kXBytes = 2;
    template <int MB, int NB, bool G> static constexpr WoTileFn tile() { return &bf16x::wo_dot_tile<Bf16X, MB, NB, G>; }
};

// ---------------------------------------------------------------------------------------------------------------
// Weight-only, bf16 x, many rows: the dot-product form above converts every weight once per 4-row tile and peaks at
// ~32 MAC/cycle (vcvtne2ps2bf16 issues ~1.25 per cycle). Here a 64-column panel x 2048-k slice of the weights is
// converted once into the layout vdpbf16ps wants, [k-pair][16 columns][2] bf16 (256 KiB, L2), and used by every row
// tile: a 6-row x 64-column register tile then does 24 vdpbf16ps per k-pair for 4 panel loads and 6 broadcasts of an
// x pair, like the VNNI tile. Partial sums of a panel across K slices are kept in fp32 (rows x 64).
// Measured on one core, 2048 columns x K = 4096 (MAC/cycle, peak 64): rows 16: 32.0 (dot form 31.8), 32: 42.4,
// 128: 55.4, 512: 60.2 (dot form 31.8). The conversion (a 16 x 16 dword transpose, then int8 -> fp32 -> bf16) costs
// ~0.25 cycle per weight, bound by shuffles, so below 16 rows the dot form is faster. Slices of 256 / 1024 / 4096 k
// measured within 3 % of 2048.
constexpr int64_t kWoKc = 2048;
constexpr int64_t kWoPanelRows = 16;

// 32 int8 (pairs of k for 16 columns) -> 32 bf16 in the same order (exact). Grouped: the fp32 values are first
// multiplied by cl (lanes of columns 0-7, each twice) and ch (columns 8-15), see wo_convert_panel, and d is rounded
// to bf16.
template <bool Grouped> FDL_AVX512BF16 inline __m512bh i8x32_to_bf16(__m256i v, __m512 cl, __m512 ch) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
    if constexpr (Grouped) {
        lo = _mm512_mul_ps(lo, cl);
        hi = _mm512_mul_ps(hi, ch);
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}

// Panel slice: w rows [n0, n0 + 64) (rows >= cols are 0) x k in [k0, k0 + kc) (k >= K are 0) -> buf, where the 64
// bytes of (pair pp, 16-column block j) hold columns 16 j .. 16 j + 15, each (w[n][k0 + 2 pp], w[n][k0 + 2 pp + 1]).
// Grouped: each value is d = w * code of its (column, group), in fp32, rounded to bf16. A 64-k chunk is 4 groups
// (k0 and kk are multiples of 64) and a k-quad q lies in group q / 4 of it. The codes of 64 groups x 16 columns are
// loaded and transposed like the weights (rows >= cols and groups >= ceil(K / 16) read as 0), so that codes[c][i]
// holds the 4 codes of chunk c for column i, one byte per group.
template <bool Grouped>
FDL_AVX512BF16 void wo_convert_panel(const WeightOnly &p, int64_t n0, int64_t k0, int64_t kc, uint16_t *buf) {
    const int64_t G = (p.K + kWeightGroup - 1) / kWeightGroup;
    // lane L of the lo (hi) fp32 vector of i8x32_to_bf16 holds column L / 2 (8 + L / 2): a k pair per column
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
    alignas(64) __m512i codes[16];
    for (int j = 0; j < 4; ++j) {
        for (int64_t kk = 0; kk < kc; kk += 64) {
            if constexpr (Grouped) {
                if (kk % 1024 == 0) {
                    const int64_t g0 = (k0 + kk) / kWeightGroup;
                    const __mmask64 gm = mask64(G - g0);
#pragma GCC unroll 16
                    for (int i = 0; i < 16; ++i) {
                        const int64_t n = n0 + 16 * j + i;
                        codes[i] = n < p.cols ? _mm512_maskz_loadu_epi8(gm, p.w_group + n * p.ldg + g0)
                                              : _mm512_setzero_si512();
                    }
                    transpose16x16(codes);
                }
            }
            const __mmask64 m = mask64(p.K - (k0 + kk));
            __m512i r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) {
                const int64_t n = n0 + 16 * j + i;
                r[i] = n < p.cols ? _mm512_maskz_loadu_epi8(m, p.w + n * p.ldw + k0 + kk) : _mm512_setzero_si512();
                // 4 lines ahead in each of the 16 rows: the runs of 2048 bytes per row are too short for the hardware
                // prefetcher; from DRAM (16 rows x 4096 x K = 11008, one core) 23.3 -> 34.2 MAC/cycle, in L3 +-3 %
                _mm_prefetch(reinterpret_cast<const char *>(p.w + imin(n, p.cols - 1) * p.ldw + k0 + kk + 256),
                             _MM_HINT_T0);
            }
            transpose16x16(r); // r[q]: k-quad q of this 64-k chunk, 16 columns x 4 bytes
            __m512i cw = Grouped ? codes[(kk % 1024) / 64] : _mm512_setzero_si512();
            __m512 cl = _mm512_setzero_ps(), ch = _mm512_setzero_ps();
#pragma GCC unroll 16
            for (int q = 0; q < 16; ++q) {
                if (Grouped && q % 4 == 0) { // codes of group q / 4 of the chunk: byte q / 4 of each column's dword
                    const __m512 cf = _mm512_cvtepi32_ps(_mm512_and_si512(cw, _mm512_set1_epi32(0xff)));
                    cw = _mm512_srli_epi32(cw, 8);
                    cl = _mm512_permutexvar_ps(dup_lo, cf);
                    ch = _mm512_permutexvar_ps(dup_hi, cf);
                }
                const int64_t pp = (kk + 4 * q) / 2; // pair index of k0 + kk + 4q within the slice
                const __m256i lo = _mm512_cvtepi32_epi16(r[q]);
                const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[q], 16));
                _mm512_storeu_si512(buf + ((pp * 4) + j) * 32, (__m512i)i8x32_to_bf16<Grouped>(lo, cl, ch));
                _mm512_storeu_si512(buf + (((pp + 1) * 4) + j) * 32, (__m512i)i8x32_to_bf16<Grouped>(hi, cl, ch));
            }
        }
    }
}

// One k-pair of the panel tile (Odd: the last, unpaired k of the row; its partner weight is 0 and x is not read).
template <int MR, int NV, bool Odd>
FDL_AVX512BF16 inline void wo_panel_step(const uint16_t *x, int64_t ldx, int64_t pp, const uint16_t *buf,
                                         __m512 (&acc)[MR][NV]) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        bv[j] = (__m512bh)_mm512_loadu_si512(buf + (pp * 4 + j) * 32);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
        int32_t x2;
        if constexpr (Odd) {
            x2 = x[i * ldx + 2 * pp];
        } else {
            std::memcpy(&x2, x + i * ldx + 2 * pp, 4);
        }
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2);
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
            acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, bv[j]);
        }
    }
}

template <int MR, int NV>
FDL_AVX512BF16 void wo_panel_tile(const WeightOnly &p, const uint16_t *buf, int64_t k0, int64_t kc, int64_t r0,
                                  int64_t n0, float *part, bool first, bool last) {
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
            acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (r0 + i) * 64 + 16 * j);
        }
    }
    const uint16_t *x = static_cast<const uint16_t *>(p.x) + r0 * p.ldx + k0;
    const int64_t kv = imin(kc, p.K - k0); // valid k of the slice; an odd last one is read alone (no x[K] read)
    int64_t pp = 0;
    for (; pp < kv / 2; ++pp) {
        wo_panel_step<MR, NV, false>(x, p.ldx, pp, buf, acc);
    }
    if (kv & 1) {
        wo_panel_step<MR, NV, true>(x, p.ldx, pp, buf, acc);
    }
    if (!last) {
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
            for (int j = 0; j < NV; ++j) {
                _mm512_storeu_ps(part + (r0 + i) * 64 + 16 * j, acc[i][j]);
            }
        }
        return;
    }
    const int64_t esz = p.out_dtype == DType::F32 ? 4 : 2;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        const ColBlock cb(n0, j, p.cols);
        if (!cb.m) {
            break;
        }
        const __m512 ws = _mm512_maskz_loadu_ps(cb.m, p.w_scale + cb.col);
        const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(cb.m, p.bias + cb.col) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            __m512 f = _mm512_mul_ps(acc[i][j], ws);
            if (p.bias) {
                f = _mm512_add_ps(f, bias);
            }
            store16(static_cast<char *>(p.out) + ((r0 + i) * p.ldo + cb.col) * esz, f, p.out_dtype, cb.m);
        }
    }
}

using WoPanelFn = void (*)(const WeightOnly &, const uint16_t *, int64_t, int64_t, int64_t, int64_t, float *, bool,
                           bool);

WoPanelFn wo_panel_fn(int mr, int nv) {
    return with_count<1, kMR>(mr, [&](auto MR) {
        return with_count<1, 4>(
            nv, [](auto NV) -> WoPanelFn { return &wo_panel_tile<decltype(MR)::value, decltype(NV)::value>; });
    });
}

void weight_only_bf16_panels(const WeightOnly &p) {
    uint16_t *buf = scratch_of<uint16_t>(kScratchA, kWoKc * 64 + 32);
    float *part = scratch_of<float>(kScratchB, p.rows * 64 + 16);
    const int64_t ntiles = (p.rows + kMR - 1) / kMR;
    const int64_t base = p.rows / ntiles, taller = p.rows % ntiles;
    for (int64_t n0 = 0; n0 < p.cols; n0 += 64) {
        const int nv = static_cast<int>(imin(4, (p.cols - n0 + 15) / 16));
        for (int64_t k0 = 0; k0 < p.K || k0 == 0; k0 += kWoKc) {
            const int64_t kc = imin(kWoKc, p.K - k0 > 0 ? p.K - k0 : 0);
            const int64_t kc4 = (kc + 63) / 64 * 64; // converted k (zero beyond K)
            if (p.w_group) {
                wo_convert_panel<true>(p, n0, k0, kc4, buf);
            } else {
                wo_convert_panel<false>(p, n0, k0, kc4, buf);
            }
            const bool first = k0 == 0, last = k0 + kWoKc >= p.K;
            int64_t r0 = 0;
            for (int64_t t = 0; t < ntiles; ++t) {
                const int h = static_cast<int>(base + (t < taller ? 1 : 0));
                wo_panel_fn(h, nv)(p, buf, k0, kc, r0, n0, part, first, last);
                r0 += h;
            }
        }
    }
}

void weight_only_bf16(const WeightOnly &p) {
    if (p.rows >= kWoPanelRows) {
        weight_only_bf16_panels(p);
    } else {
        weight_only_dot<WoBf16>(p);
    }
}

} // namespace

const Kernels *kernels_avx512() {
    static const Kernels k{.name = "avx512_vnni",
                           .mr = kMR,
                           .quantize_rows = &quantize_rows,
                           .pack_a = &pack_a,
                           .gemm_block = &gemm_block,
                           .pack_b = &pack_b,
                           .weight_only_f32 = &weight_only_dot<WoF32>};
    return &k;
}

const Kernels *kernels_avx512_bf16() {
    static const Kernels k = [] {
        Kernels t = *kernels_avx512();
        t.name = "avx512_vnni+bf16";
        t.weight_only_bf16 = &weight_only_bf16;
        return t;
    }();
    return &k;
}

} // namespace int8
} // namespace fastdl

#endif
