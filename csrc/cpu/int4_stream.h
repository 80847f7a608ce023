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

// ---------------------------------------------------------------------------------------------------------------
// W4A8 (int4_kernels.h, A8Args). V also provides, for these:
//   I                          the int32 vector of one 32-byte register (8 lanes)
//   I codes_u8(const uint8_t *p)   16 packed bytes -> the 32 codes u (unsigned bytes) in k order
//   I dot(I acc, I u, const int8_t *x)  acc + the sums of 4 adjacent u * x products per lane (exact)
//   I izero(), I sub_lane0(I acc, int32_t v) (acc with v subtracted from lane 0), F cvt8(I) (8 lanes as fp32, widened
//   to F's lanes with zeros), float hsum8(F)
//   F abs(F), F max(F, F), float hmax(F), F mul(F, F), void store_q(int8_t *dst, F rounded, int n), F roundc(F)
//   (clamp to [-127, 127] then round half to even), int32_t qsum(const int8_t *q, int64_t n)

template <class V, int MR> I4_SIMD inline void i4a8_tile(const A8Args &a, int64_t m0, int64_t n0, int64_t n1) {
    using I = typename V::I;
    const int64_t groups = a.K / a.group, blocks = a.group / 32, rowb = a.K / 2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *q = a.q + n * rowb;
        const uint16_t *s = a.scales + n * groups;
        const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
        typename V::F tot[MR];
        for (int m = 0; m < MR; ++m)
            tot[m] = V::zero();
        for (int64_t g = 0; g < groups; ++g) {
            I acc[MR];
            for (int m = 0; m < MR; ++m)
                acc[m] = V::izero();
            for (int64_t b = 0; b < blocks; ++b) {
                const int64_t k = (g * blocks + b) * 32;
                const I u = V::codes_u8(q + k / 2);
                for (int m = 0; m < MR; ++m)
                    acc[m] = V::dot(acc[m], u, a.qx + (m0 + m) * a.K + k);
            }
            const int32_t z = zr ? zr[g] : 8;
            const float sw = V::half(s[g]);
            for (int m = 0; m < MR; ++m) {
                const int64_t mg = (m0 + m) * groups + g;
                const I exact = V::sub_lane0(acc[m], z * a.sumx[mg]); // sum q_x (u - z), exact
                tot[m] = V::fma(V::cvt8(exact), V::set1(sw * a.sx[mg]), tot[m]);
            }
        }
        const float b = a.bias ? a.bias[n] : 0.f;
        for (int m = 0; m < MR; ++m)
            a.out[(m0 + m) * a.ldo + n] = V::hsum(tot[m]) + b;
    }
}

template <class V> I4_SIMD void i4a8(const A8Args &a, int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += kA8BlockRows) {
        const int64_t ne = nb + kA8BlockRows < n1 ? nb + kA8BlockRows : n1;
        for (int64_t m0 = 0; m0 < a.M; m0 += 4) {
            switch (a.M - m0 >= 4 ? 4 : a.M - m0) {
            case 1:
                i4a8_tile<V, 1>(a, m0, nb, ne);
                break;
            case 2:
                i4a8_tile<V, 2>(a, m0, nb, ne);
                break;
            case 3:
                i4a8_tile<V, 3>(a, m0, nb, ne);
                break;
            default:
                i4a8_tile<V, 4>(a, m0, nb, ne);
                break;
            }
        }
    }
}

// Per (row, group): amax, then q = round_half_even(clamp(x * (127 / amax))) (one IEEE division per group, one fp32
// multiply per element, as the reference); amax 0 gives q 0 and s 0; a NaN or infinity makes s NaN (the row's output
// is NaN, not a silently wrong number).
template <class V> I4_SIMD void i4a8_quantize(const QuantX &p, int64_t m0, int64_t m1) {
    const int64_t groups = p.K / p.group;
    for (int64_t m = m0; m < m1; ++m) {
        const float *x = p.x + m * p.ldx;
        for (int64_t g = 0; g < groups; ++g) {
            const float *xg = x + g * p.group;
            typename V::F mx = V::zero();
            bool finite = true;
            for (int64_t k = 0; k < p.group; k += V::kLanes)
                mx = V::max(mx, V::abs(V::loadx(xg + k)));
            float amax = V::hmax(mx);
            for (int64_t k = 0; k < p.group && finite; ++k)
                finite = xg[k] - xg[k] == 0.f; // false for NaN and +-inf (the max above may drop a NaN)
            int8_t *qg = p.qx + m * p.K + g * p.group;
            const int64_t mg = m * groups + g;
            if (!finite || !(amax > 0.f)) {
                for (int64_t k = 0; k < p.group; ++k)
                    qg[k] = 0;
                p.sx[mg] = finite ? 0.f : __builtin_nanf("");
                p.sumx[mg] = 0;
                continue;
            }
            const typename V::F inv = V::set1(127.f / amax);
            for (int64_t k = 0; k < p.group; k += V::kLanes)
                V::store_q(qg + k, V::roundc(V::mul(V::loadx(xg + k), inv)), V::kLanes);
            p.sx[mg] = amax / 127.f;
            p.sumx[mg] = V::qsum(qg, p.group);
        }
    }
}
