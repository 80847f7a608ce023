// The int4 streaming kernel (see int4_kernels.h), written once over a vector-traits type V and included by each SIMD
// family's file after it defines V and the macro I4_SIMD (its target attribute). V provides:
//   F                      the fp32 vector, kLanes lanes (32 / kLanes vectors hold one block of 32 weights)
//   Z zp(int z)            the zero point of a group, in the form codes() takes
//   void codes(const uint8_t *p, Z z, F (&w)[32 / kLanes])
//                          16 packed bytes -> the 32 values u - z, as fp32, in k order
//   F zero(), F set1(float), F loadx(const float *), F fma(F a, F b, F c) (a * b + c), F add(F, F), float hsum(F)
//   float half(uint16_t)   fp16 bits -> fp32
//
// Loop nest: per weight row, per group: the group's blocks accumulate x * (u - z) into two accumulators per x row
// (two FMA chains), then the group total is added into the row's sum times the group's scale. Each packed byte is
// loaded once per call; the MR rows of x (<= kStreamRows) share every dequantized vector. The weight rows of a
// thread's slice are contiguous, so the hardware prefetcher streams them.
// (Written as a header, not a template in one file: each family compiles it with its own target attribute.)

template <class V, int MR> I4_SIMD inline void i4_rows(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1) {
    using F = typename V::F;
    constexpr int VB = 32 / V::kLanes;
    const int64_t groups = a.K / a.group, blocks = a.group / 32, rowb = a.K / 2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *q = a.q + n * rowb;
        const uint16_t *s = a.scales + n * groups;
        const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
        F tot[MR];
        for (int m = 0; m < MR; ++m)
            tot[m] = V::zero();
        for (int64_t g = 0; g < groups; ++g) {
            F acc[MR][2];
            for (int m = 0; m < MR; ++m)
                acc[m][0] = acc[m][1] = V::zero();
            const auto z = V::zp(zr ? zr[g] : 8);
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t k = (g * blocks + b) * 32;
                F w[VB];
                V::codes(q + k / 2, z, w);
                for (int m = 0; m < MR; ++m) {
                    const float *xr = a.x + (m0 + m) * a.ldx + k;
                    for (int j = 0; j < VB; ++j)
                        acc[m][j & 1] = V::fma(V::loadx(xr + j * V::kLanes), w[j], acc[m][j & 1]);
                }
            }
            const F sv = V::set1(V::half(s[g]));
            for (int m = 0; m < MR; ++m)
                tot[m] = V::fma(V::add(acc[m][0], acc[m][1]), sv, tot[m]);
        }
        const float b = a.bias ? a.bias[n] : 0.f;
        for (int m = 0; m < MR; ++m)
            a.out[(m0 + m) * a.ldo + n] = V::hsum(tot[m]) + b;
    }
}

template <class V> I4_SIMD void i4_stream(const Int4Args &a, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kStreamRows) {
        switch (a.M - m0 >= kStreamRows ? kStreamRows : a.M - m0) {
        case 1:
            i4_rows<V, 1>(a, m0, n0, n1);
            break;
        case 2:
            i4_rows<V, 2>(a, m0, n0, n1);
            break;
        case 3:
            i4_rows<V, 3>(a, m0, n0, n1);
            break;
        default:
            i4_rows<V, 4>(a, m0, n0, n1);
            break;
        }
    }
}
