// The row loops of the W8A8 kernels' A side, quantize_rows (per-token quantisation) and pack_a (a block of A rows for
// the GEMM), written once for the SIMD families and included by int8_avx2.cpp and int8_avx512.cpp inside their
// unnamed namespace (fastdl::int8::{}) after they define (imin and elem_size<DT>() come from int8_kernels.h):
//   I8_SIMD                    the family's target attribute
//   kAOffset                   how a packed activation is stored: the byte a xor kAOffset (AVX2: 0, int8 for
//                              vpmaddubsw's sign trick; AVX512-VNNI: 0x80, u8 = a + 128 for vpdpbusd)
//   amax_bits<DT>(row, K)      max |x| of a row as fp32 bits (NaN / Inf rows above every finite value)
//   quant_row<DT, Xor>(row, k0, k1, inv, uint8_t *dst)   k in [k0, k1) of a row as int8 (xor Xor) into dst
//   range_of<DT>(row, K, float *lo, float *hi)           min(0, min x) and max(0, max x) of a finite row
//   quant_row_u7<DT, Xor>(row, k0, k1, inv, z, zsub, dst)  the 7-bit codes q (u7_params) minus zsub (xor Xor)
//   pack_a_int8(const APack &) an int8 A block (AVX2: copied; AVX-512: copied + 128)
// What differs per family is vector code (the amax reduction, the rounding and its clamps, the tail stores): it stays
// in each family's file. No #pragma once: read once per family, each translation unit keeps its own copy.
#ifndef I8_SIMD
#error "int8_pack_a.h: define I8_SIMD (the family's target attribute) before including it"
#endif

// scale and 1/scale-equivalent multiplier of a row from its amax bits (contract formula, fp32 divisions). inv = 0 for
// rows of zeros and non-finite rows: their q are all 0.
inline float row_scale(uint32_t bits, float *inv) {
    if (bits >= 0x7f800000u) {
        *inv = 0.0f;
        const uint32_t qnan = 0x7fc00000u;
        float nan;
        std::memcpy(&nan, &qnan, 4);
        return nan;
    }
    if (bits == 0) {
        *inv = 0.0f;
        return 0.0f;
    }
    float amax;
    std::memcpy(&amax, &bits, 4);
    *inv = 127.0f / amax;
    return amax / 127.0f;
}

template <DType DT> I8_SIMD void quantize_rows_t(const QuantRows &a) {
    const char *src = static_cast<const char *>(a.src);
    for (int64_t r = 0; r < a.rows; ++r) {
        const void *row = src + r * a.ld * elem_size<DT>();
        float inv;
        a.scale[r] = row_scale(amax_bits<DT>(row, a.K), &inv);
        quant_row<DT, 0>(row, 0, a.K, inv, reinterpret_cast<uint8_t *>(a.q + r * a.ldq));
    }
}

void quantize_rows(const QuantRows &a) {
    if (a.dtype == DType::F32) {
        quantize_rows_t<DType::F32>(a);
    } else if (a.dtype == DType::BF16) {
        quantize_rows_t<DType::BF16>(a);
    } else {
        quantize_rows_t<DType::F16>(a);
    }
}

// Float rows, quantised per row on the first K slice (compute_scales) with the scales kept for the next slices. They
// are read twice (amax, then quantise), the second time from L1/L2: a 4096-wide fp32 row is 16 KiB.
template <DType DT> I8_SIMD void pack_a_float(const APack &p) {
    const char *src = static_cast<const char *>(p.src);
    const int64_t k1 = imin(p.K, p.k0 + p.kc);
    for (int64_t r = 0; r < p.rows; ++r) {
        const void *row = src + r * p.ld * elem_size<DT>();
        if (p.compute_scales && p.u7) {
            const bool nonfinite = amax_bits<DT>(row, p.K) >= 0x7f800000u;
            float lo = 0.0f, hi = 0.0f;
            if (!nonfinite) {
                range_of<DT>(row, p.K, &lo, &hi);
            }
            p.scale[r] = u7_params(nonfinite, lo, hi, &p.inv[r], &p.zero[r]);
        } else if (p.compute_scales) {
            p.scale[r] = row_scale(amax_bits<DT>(row, p.K), &p.inv[r]);
        }
        uint8_t *d = static_cast<uint8_t *>(p.dst) + r * p.ldd;
        if (k1 > p.k0 && p.u7) {
            quant_row_u7<DT, kAOffset>(row, p.k0, k1, p.inv[r], p.zero[r], p.u7_direct ? 0 : p.zero[r], d);
        } else if (k1 > p.k0) {
            quant_row<DT, kAOffset>(row, p.k0, k1, p.inv[r], d);
        }
        pad_a_row(d, p.k0, k1, p.kc, kAOffset);
    }
}

void pack_a(const APack &p) {
    switch (p.dtype) {
    case DType::F32:
        pack_a_float<DType::F32>(p);
        break;
    case DType::BF16:
        pack_a_float<DType::BF16>(p);
        break;
    case DType::F16:
        pack_a_float<DType::F16>(p);
        break;
    default:
        pack_a_int8(p);
    }
}
