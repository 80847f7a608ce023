// Portable scalar kernels of the int8 capability: the fallback for CPUs without AVX2 (and non-x86 builds), and the
// plainest statement of what the SIMD kernels compute. Same interfaces and bit-exact results as int8_avx512.cpp for
// quantisation and W8A8 (the weight-only sums are fp32 in another order). Reads the same packed weight layout.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "int8_kernels.h"

namespace fastdl {
namespace int8 {
namespace {

uint32_t bits_of(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}

float float_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Stores and reloads v: the value is rounded to fp32 here, so the compiler cannot fuse a multiply with the add that
// follows into an FMA (GCC contracts across statements in C++ when the target has FMA; the contract wants two
// roundings). Only in the epilogue: one per output element.
float rounded(float v) {
    volatile float t = v;
    return t;
}

float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) { // zero or subnormal: mant * 2^-24, exact in fp32
        const float v = static_cast<float>(mant) * float_of(0x33800000u);
        return sign ? -v : v;
    }
    if (exp == 31) {
        return float_of(sign | 0x7f800000u | (mant << 13));
    }
    return float_of(sign | ((exp + 112) << 23) | (mant << 13));
}

// fp32 -> fp16 bits, round to nearest even (IEEE, subnormals kept), NaN -> 0x7e00 with the sign, like c10::Half.
uint16_t float_to_half(float f) {
    const uint32_t x = bits_of(f);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        return static_cast<uint16_t>(sign | 0x7e00u);
    }
    if (ax >= 0x477ff000u) { // >= 65520 rounds to infinity
        return static_cast<uint16_t>(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) {      // below 2^-14: a subnormal half (or zero)
        if (ax <= 0x33000000u) { // <= 2^-25 (the tie rounds to the even 0)
            return static_cast<uint16_t>(sign);
        }
        const uint32_t e = ax >> 23, mant = (ax & 0x7fffffu) | 0x800000u; // value = mant * 2^(e - 150)
        const uint32_t shift = 126 - e;                                   // in units of 2^-24: mant >> shift
        uint32_t q = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) {
            ++q;
        }
        return static_cast<uint16_t>(sign | q);
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
}

uint16_t float_to_bf16(float f) {
    const uint32_t x = bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0;
    }
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

float load(const void *p, DType dt, int64_t i) {
    if (dt == DType::F32) {
        return static_cast<const float *>(p)[i];
    }
    const uint16_t h = static_cast<const uint16_t *>(p)[i];
    return dt == DType::BF16 ? float_of(static_cast<uint32_t>(h) << 16) : half_to_float(h);
}

void store(void *p, DType dt, int64_t i, float v) {
    if (dt == DType::F32) {
        static_cast<float *>(p)[i] = v;
    } else if (dt == DType::BF16) {
        static_cast<uint16_t *>(p)[i] = float_to_bf16(v);
    } else {
        static_cast<uint16_t *>(p)[i] = float_to_half(v);
    }
}

int64_t elem_size(DType dt) {
    return dt == DType::F32 ? 4 : 2;
}

// ------------------------------------------------------------------------------------------- per-token quantisation
// amax as the bits of |x|: integer order is float order, NaN / Inf are >= 0x7f800000.
uint32_t amax_bits(const void *row, DType dt, int64_t K) {
    uint32_t m = 0;
    for (int64_t k = 0; k < K; ++k) {
        const uint32_t a = bits_of(load(row, dt, k)) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

float row_scale(uint32_t bits, float *inv) {
    if (bits >= 0x7f800000u) {
        *inv = 0.0f;
        return float_of(0x7fc00000u);
    }
    if (bits == 0) {
        *inv = 0.0f;
        return 0.0f;
    }
    const float amax = float_of(bits);
    *inv = 127.0f / amax;
    return amax / 127.0f;
}

int8_t quant(float x, float inv) {
    float p = x * inv;
    if (p != p) {
        return 0;
    }
    p = p < -127.0f ? -127.0f : (p > 127.0f ? 127.0f : p);
    return static_cast<int8_t>(std::nearbyint(p)); // the default rounding mode: to nearest even
}

void quantize_rows(const QuantRows &a) {
    const int64_t es = elem_size(a.dtype);
    for (int64_t r = 0; r < a.rows; ++r) {
        const void *row = static_cast<const char *>(a.src) + r * a.ld * es;
        float inv;
        a.scale[r] = row_scale(amax_bits(row, a.dtype, a.K), &inv);
        for (int64_t k = 0; k < a.K; ++k) {
            a.q[r * a.ldq + k] = quant(load(row, a.dtype, k), inv);
        }
    }
}

// The 7-bit mode (u7_params in int8_kernels.h): the row's range and a = q - z of one value (inv finite, x finite).
float u7_row_scale(const void *row, DType dt, int64_t K, float *inv, int32_t *z) {
    const bool nonfinite = amax_bits(row, dt, K) >= 0x7f800000u;
    float lo = 0.0f, hi = 0.0f;
    for (int64_t k = 0; k < K && !nonfinite; ++k) {
        const float x = load(row, dt, k);
        lo = x < lo ? x : lo;
        hi = x > hi ? x : hi;
    }
    return u7_params(nonfinite, lo, hi, inv, z);
}

int8_t quant_u7(float x, float inv, int32_t z) {
    if (inv == 0.0f) {
        return 0;
    }
    float q = std::nearbyint(x * inv) + static_cast<float>(z);
    q = q < 0.0f ? 0.0f : (q > 127.0f ? 127.0f : q);
    return static_cast<int8_t>(static_cast<int32_t>(q) - z);
}

// A block: the int8 value a itself (padding 0); in the 7-bit mode a = q - z.
void pack_a(const APack &p) {
    const bool is_float = p.dtype != DType::I8;
    const int64_t es = is_float ? elem_size(p.dtype) : 1;
    for (int64_t r = 0; r < p.rows; ++r) {
        const void *row = static_cast<const char *>(p.src) + r * p.ld * es;
        if (is_float && p.compute_scales) {
            p.scale[r] = p.u7 ? u7_row_scale(row, p.dtype, p.K, &p.inv[r], &p.zero[r])
                              : row_scale(amax_bits(row, p.dtype, p.K), &p.inv[r]);
        }
        int8_t *d = static_cast<int8_t *>(p.dst) + r * p.ldd;
        for (int64_t k = p.k0; k < p.k0 + p.kc; ++k) {
            int8_t v = 0;
            if (k < p.K && p.u7) {
                v = quant_u7(load(row, p.dtype, k), p.inv[r], p.zero[r]);
            } else if (k < p.K) {
                v = is_float ? quant(load(row, p.dtype, k), p.inv[r]) : static_cast<const int8_t *>(row)[k];
            }
            d[k - p.k0] = v;
        }
    }
}

// --------------------------------------------------------------------------------------------------- GEMM
void gemm_block(const GemmBlock &g) {
    const int8_t *a = static_cast<const int8_t *>(g.a);
    for (int64_t r = 0; r < g.rows; ++r) {
        for (int64_t c0 = 0; c0 < g.cols; c0 += 16) {
            uint32_t acc[16]; // int32 arithmetic modulo 2^32, as the SIMD accumulators
            for (int c = 0; c < 16; ++c) {
                acc[c] = g.first ? 0u : static_cast<uint32_t>(g.partial[r * g.ldp + c0 + c]);
            }
            const int8_t *b = g.b + (c0 / 16) * g.b_stride;
            for (int64_t q = 0; q < g.kc / 4; ++q) {
                const int8_t *ar = a + r * g.lda + 4 * q;
                const int8_t *bq = b + q * 64;
                for (int c = 0; c < 16; ++c) {
                    int32_t s = 0;
                    for (int t = 0; t < 4; ++t) {
                        s += int32_t(ar[t]) * int32_t(bq[c * 4 + t]);
                    }
                    acc[c] += static_cast<uint32_t>(s);
                }
            }
            for (int c = 0; c < 16; ++c) {
                const int64_t n = c0 + c;
                const int32_t v = static_cast<int32_t>(acc[c]);
                if (!g.last) {
                    g.partial[r * g.ldp + n] = v;
                    continue;
                }
                if (n >= g.n_valid) {
                    break;
                }
                if (g.out_dtype == DType::I32) {
                    static_cast<int32_t *>(g.out)[r * g.ldo + n] = v;
                    continue;
                }
                float f = rounded(static_cast<float>(v) * g.a_scale[r]);
                f = rounded(f * g.b_scale[n]);
                if (g.bias) {
                    f = f + g.bias[n];
                }
                store(g.out, g.out_dtype, r * g.ldo + n, f);
            }
        }
    }
}

// --------------------------------------------------------------------------------------------------- weight-only
void weight_only_f32(const WeightOnly &p) {
    const float *x = static_cast<const float *>(p.x);
    for (int64_t n = 0; n < p.cols; ++n) { // one w row (L1) against every x row
        const int8_t *w = p.w + n * p.ldw;
        const uint8_t *g = p.w_group ? p.w_group + n * p.ldg : nullptr;
        for (int64_t m = 0; m < p.rows; ++m) {
            const float *xr = x + m * p.ldx;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            int64_t k = 0;
            if (g) { // d = w * group scale, exact in fp32
                for (; k + 4 <= p.K; k += 4) {
                    const float c = static_cast<float>(g[k / kWeightGroup]); // 4 | 16: one group per 4 k
                    for (int t = 0; t < 4; ++t) {
                        s[t] += xr[k + t] * (static_cast<float>(w[k + t]) * c);
                    }
                }
                for (; k < p.K; ++k) {
                    s[0] += xr[k] * (static_cast<float>(w[k]) * static_cast<float>(g[k / kWeightGroup]));
                }
            }
            for (; k + 4 <= p.K; k += 4) {
                for (int t = 0; t < 4; ++t) {
                    s[t] += xr[k + t] * static_cast<float>(w[k + t]);
                }
            }
            for (; k < p.K; ++k) {
                s[0] += xr[k] * static_cast<float>(w[k]);
            }
            float v = ((s[0] + s[1]) + (s[2] + s[3])) * p.w_scale[n];
            if (p.bias) {
                v += p.bias[n];
            }
            store(p.out, p.out_dtype, m * p.ldo + n, v);
        }
    }
}

} // namespace

// Rows n < N copy 4 bytes per k-quad (k < K); the k-quad holding K is assembled byte by byte, padding stays 0.
void pack_b_portable(const PackB &p) {
    const int64_t full = p.K / 4;
    for (int64_t jb = p.jb0; jb < p.jb1; ++jb) {
        int8_t *blk = p.packed + jb * p.Kp * 16;
        std::memset(blk, 0, static_cast<size_t>(p.Kp * 16));
        for (int64_t i = 0; i < 16; ++i) {
            const int64_t n = jb * 16 + i;
            if (n >= p.N) {
                p.comp[n] = 0;
                continue;
            }
            const int8_t *row = p.w + n * p.ldw;
            uint32_t sum = 0;
            for (int64_t q = 0; q < full; ++q) {
                std::memcpy(blk + q * 64 + i * 4, row + 4 * q, 4);
            }
            for (int64_t k = 4 * full; k < p.K; ++k) {
                blk[full * 64 + i * 4 + (k - 4 * full)] = row[k];
            }
            for (int64_t k = 0; k < p.K; ++k) {
                sum += static_cast<uint32_t>(static_cast<int32_t>(row[k]));
            }
            p.comp[n] = static_cast<int32_t>(sum * 128u);
        }
    }
}

const Kernels *kernels_scalar() {
    static const Kernels k{.quantize_rows = &quantize_rows,
                           .pack_a = &pack_a,
                           .gemm_block = &gemm_block,
                           .pack_b = &pack_b_portable,
                           .weight_only_f32 = &weight_only_f32};
    return &k;
}

namespace {
struct FreeDeleter {
    void operator()(void *p) const { std::free(p); }
};
struct ThreadScratch {
    std::unique_ptr<void, FreeDeleter> mem[kScratchSlots];
    int64_t size[kScratchSlots] = {};
};
} // namespace

void *thread_scratch(int slot, int64_t bytes) {
    thread_local ThreadScratch s;
    if (bytes > s.size[slot]) {
        const int64_t want = (bytes + 4095) / 4096 * 4096;
        void *p = std::aligned_alloc(64, static_cast<size_t>(want));
        if (!p) {
            throw std::bad_alloc();
        }
        s.mem[slot].reset(p);
        s.size[slot] = want;
    }
    return s.mem[slot].get();
}

} // namespace int8
} // namespace fastdl
