// The int4 streaming kernel (see int4_kernels.h), written once over a vector-traits type V and included by each SIMD
// family's file after it defines V and the macro I4_SIMD (its target attribute). V provides:
//   F                      the fp32 vector, kLanes lanes (32 / kLanes vectors hold one block of 32 weights)
//   Z zp(int z)            the zero point of a group, in the form codes() takes
//   void codes(const uint8_t *p, Z z, F (&w)[32 / kLanes])
//                          16 packed bytes -> the 32 values u - z, as fp32, in k order
//   F zero(), F set1(float), F loadx(const float *), F fma(F a, F b, F c) (a * b + c), F add(F, F), F mul(F, F),
//   float hsum(F)
//   float half(uint16_t)   fp16 bits -> fp32; void half8(const uint16_t *p, float *dst): 8 of them
//   void times_u8(const float *a, const uint8_t *b, float *dst): dst[i] = a[i] * b[i], 8 of them
//
// Loop nest: per weight row, per group: the group's blocks accumulate x * u (x * (u - 8) without zero points) into
// one or two FMA chains per x row, then the group total is added into the row's sum times the group's scale; the
// zero points are subtracted once per weight row (i4_row_blocks). Each packed byte is
// loaded once per call; the MR rows of x (<= kStreamRows) share every dequantized vector. The weight rows of a
// thread's slice are contiguous, so the hardware prefetcher streams them.
// (Written as a header, not a template in one file: each family compiles it with its own target attribute.)

// A weight row's group scales as fp32 into sc[0, groups): 8 at a time (vcvtph2ps), the rest one by one; with zero
// points, also zs[g] = sc[g] * z[g] (exact: an fp16 value times an integer below 16).
template <class V>
I4_SIMD inline void i4_row_scales(const uint16_t *s, const uint8_t *zr, int64_t groups, float *sc, float *zs) {
    int64_t g8 = 0;
    for (; g8 + 8 <= groups; g8 += 8) {
        V::half8(s + g8, sc + g8);
        if (zr)
            V::times_u8(sc + g8, zr + g8, zs + g8);
    }
    for (; g8 < groups; ++g8) {
        sc[g8] = V::half(s[g8]);
        if (zr)
            zs[g8] = sc[g8] * static_cast<float>(zr[g8]);
    }
}

// One 32-k block (block b of a group) for MR rows of x (row m at xr + m * ldx, from the group's first k) and NR weight
// rows (row r's packed group at q + r * rowb): each x vector is loaded once for the NR weight rows (a 512-bit load
// per 16 products and row had bound the kernel: two rows of x took twice one row's time), the codes of each weight
// row dequantized once for the MR rows.
template <class V, int MR, int NR, int C>
I4_SIMD __attribute__((always_inline)) inline void i4_block(const uint8_t *q, int64_t rowb, typename V::Z table,
                                                            const float *xr, int64_t ldx, int64_t b,
                                                            typename V::F (&acc)[MR][NR][C]) {
    using F = typename V::F;
    constexpr int VB = 32 / V::kLanes;
    F xv[MR][VB] = {}; // with one weight row, x is read where it is used (the FMAs' memory operands: no registers)
    if constexpr (NR > 1)
        for (int m = 0; m < MR; ++m)
            for (int j = 0; j < VB; ++j)
                xv[m][j] = V::loadx(xr + m * ldx + b * 32 + j * V::kLanes);
    for (int r = 0; r < NR; ++r) {
        F w[VB];
        V::codes(q + r * rowb + b * 16, table, w);
        for (int m = 0; m < MR; ++m)
            for (int j = 0; j < VB; ++j) {
                const F x = NR > 1 ? xv[m][j] : V::loadx(xr + m * ldx + b * 32 + j * V::kLanes);
                F &c = acc[m][r][j % C];
                c = V::fma(x, w[j], c);
            }
    }
}

// sum_k x[k] u[k] over one group (gs[m][r]), with the table u -> u: the zero points come in once per weight row
// (i4_row_blocks). C FMA chains per (x row, weight row): 2 where one pair of rows alone would wait on one chain.
template <class V, int MR, int NR, int C>
I4_SIMD __attribute__((always_inline)) inline void i4_group(const uint8_t *q, int64_t rowb, typename V::Z table,
                                                            const float *xr, int64_t ldx, int64_t blocks,
                                                            typename V::F (&gs)[MR][NR]) {
    typename V::F acc[MR][NR][C];
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < C; ++c)
                acc[m][r][c] = V::zero();
    for (int64_t b = 0; b < blocks; ++b)
        i4_block<V, MR, NR, C>(q, rowb, table, xr, ldx, b, acc);
    for (int m = 0; m < MR; ++m)
        for (int r = 0; r < NR; ++r)
            gs[m][r] = C == 2 ? V::add(acc[m][r][0], acc[m][r][1]) : acc[m][r][0];
}

// Group g of NR weight rows into the totals tot: the group's sums times its scales (sg[r * ld]).
template <class V, int MR, int NR, int C>
I4_SIMD __attribute__((always_inline)) inline void
i4_group_total(const Int4Args &a, const uint8_t *q, int64_t rowb, typename V::Z table, const float *x0, int64_t blocks,
               const float *sg, int64_t ld, int64_t g, typename V::F (&tot)[MR][NR]) {
    typename V::F gs[MR][NR];
    i4_group<V, MR, NR, C>(q + g * a.group / 2, rowb, table, x0 + g * a.group, a.ldx, blocks, gs);
    for (int r = 0; r < NR; ++r) {
        const typename V::F sv = V::set1(sg[r * ld]);
        for (int m = 0; m < MR; ++m)
            tot[m][r] = V::fma(gs[m][r], sv, tot[m][r]);
    }
}

// What a call of the streaming kernel prepares once for its MR rows of x: with zero points, x's sums per row and
// group (xs); and space for NR weight rows' scales (sc) and s * z per group (zs), each row at a stride of ld.
struct I4RowBufs {
    int64_t ld;
    std::unique_ptr<float[]> buf;
    float *sc, *zs, *xs;
};

// Weight rows [n0, n1) of MR rows of x, NR at a time; returns where it stopped (n1 - (n1 - n0) mod NR). With zero
// points the kernel sums x * u per group (a fixed table: no per-group set-up) and subtracts sum_g s_g z_g sum_{k in g}
// x_k once per weight row, from xs and zs; with groups of 32 the per-group set-up (the zero point's table) had been as
// many instructions as the block's products. With one row of each the group sums go into two totals per row, even
// and odd groups, so no group waits on the one before.
template <class V, int MR, int NR, int C>
I4_SIMD int64_t i4_row_blocks(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1, const I4RowBufs &bufs) {
    using F = typename V::F;
    constexpr int P = NR == 1 && MR == 1 ? 2 : 1; // more rows: as many independent totals already
    const int64_t groups = a.K / a.group, blocks = a.group / 32, rowb = a.K / 2, ld = bufs.ld;
    const bool zp = a.zeros != nullptr;
    const auto table = V::zp(zp ? 0 : 8);
    const float *x0 = a.x + m0 * a.ldx;
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        const uint8_t *q = a.q + n * rowb;
        for (int r = 0; r < NR; ++r)
            i4_row_scales<V>(a.scales + (n + r) * groups, zp ? a.zeros + (n + r) * groups : nullptr, groups,
                             bufs.sc + r * ld, bufs.zs + r * ld);
        F tot[MR][NR], tot1[MR][NR]; // tot1: the odd groups' when P == 2
        for (int m = 0; m < MR; ++m)
            for (int r = 0; r < NR; ++r)
                tot[m][r] = tot1[m][r] = V::zero();
        int64_t g = 0;
        for (; g + P <= groups; g += P) { // (two named totals: an index into one array had kept it in memory)
            i4_group_total<V, MR, NR, C>(a, q, rowb, table, x0, blocks, bufs.sc + g, ld, g, tot);
            if constexpr (P == 2)
                i4_group_total<V, MR, NR, C>(a, q, rowb, table, x0, blocks, bufs.sc + g + 1, ld, g + 1, tot1);
        }
        if (g < groups)
            i4_group_total<V, MR, NR, C>(a, q, rowb, table, x0, blocks, bufs.sc + g, ld, g, tot);
        for (int r = 0; r < NR; ++r) {
            const float b = a.bias ? a.bias[n + r] : 0.f;
            for (int m = 0; m < MR; ++m) {
                const F t = P == 2 ? V::add(tot[m][r], tot1[m][r]) : tot[m][r];
                float corr = 0.f; // sum_g s_g z_g xs[m][g]
                if (zp) {
                    const float *zr = bufs.zs + r * ld, *xm = bufs.xs + m * groups;
                    F c = V::zero();
                    int64_t h = 0;
                    for (; h + V::kLanes <= groups; h += V::kLanes)
                        c = V::fma(V::loadx(zr + h), V::loadx(xm + h), c);
                    corr = V::hsum(c);
                    for (; h < groups; ++h)
                        corr += zr[h] * xm[h];
                }
                a.out[(m0 + m) * a.ldo + n + r] = V::hsum(t) - corr + b;
            }
        }
    }
    return n;
}

// Two FMA chains per pair of rows only for one weight row, one or two x rows and groups of several blocks (more x
// rows: as many chains already, and the AVX2 family's 16 registers ran 10-15 % slower at 3-4 rows with two).
template <class V, int MR>
I4_SIMD int64_t i4_single_rows(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1, const I4RowBufs &bufs) {
    if (MR <= 2 && a.group > 32)
        return i4_row_blocks<V, MR, 1, 2>(a, m0, n0, n1, bufs);
    return i4_row_blocks<V, MR, 1, 1>(a, m0, n0, n1, bufs);
}

// MR rows of x against weight rows [n0, n1): V::stream_cols(MR) weight rows at a time, the rest one at a time.
template <class V, int MR> I4_SIMD inline void i4_rows(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1) {
    using F = typename V::F;
    constexpr int NR = V::stream_cols(MR);
    const int64_t groups = a.K / a.group, ld = groups + 8; // + 8: half8's tail
    I4RowBufs bufs{ld, std::unique_ptr<float[]>(new float[2 * NR * ld + MR * groups + 8]), nullptr, nullptr, nullptr};
    bufs.sc = bufs.buf.get();
    bufs.zs = bufs.sc + NR * ld;
    bufs.xs = bufs.zs + NR * ld;
    if (a.zeros)
        for (int m = 0; m < MR; ++m)
            for (int64_t g = 0; g < groups; ++g) {
                const float *xr = a.x + (m0 + m) * a.ldx + g * a.group;
                F s = V::loadx(xr);
                for (int64_t k = V::kLanes; k < a.group; k += V::kLanes)
                    s = V::add(s, V::loadx(xr + k));
                bufs.xs[m * groups + g] = V::hsum(s);
            }
    int64_t n = n0;
    if constexpr (NR > 1)
        n = i4_row_blocks<V, MR, NR, 1>(a, m0, n0, n1, bufs);
    i4_single_rows<V, MR>(a, m0, n, n1, bufs);
}

// Kern<R>::run(args...) with R = rows, for 1 <= rows <= MaxR: a register tile's row count as a template argument.
template <template <int> class Kern, int MaxR, class... A> I4_SIMD inline void by_rows(int64_t rows, const A &...args) {
    if constexpr (MaxR > 1) {
        if (rows < MaxR) {
            by_rows<Kern, MaxR - 1>(rows, args...);
            return;
        }
    }
    Kern<MaxR>::run(args...);
}

template <class V> struct StreamRows {
    template <int MR> struct K {
        static I4_SIMD inline void run(const Int4Args &a, int64_t m0, int64_t n0, int64_t n1) {
            i4_rows<V, MR>(a, m0, n0, n1);
        }
    };
};

template <class V> I4_SIMD void i4_stream(const Int4Args &a, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kStreamRows)
        by_rows<StreamRows<V>::template K, kStreamRows>(a.M - m0, a, m0, n0, n1);
}

// ---------------------------------------------------------------------------------------------------------------
// The float kernel for more rows (int4_kernels.h, Kernels::tiles). V also provides kTileM, kTileN (the register tile:
// kTileM x kTileN accumulators, plus kTileN weight vectors and one x vector, fit the family's registers), F mul(F, F)
// and void store(float *, F).
// Per tile of kTileN weight rows: the rows dequantized once, (u - z) * s (exact in fp32), into a buffer of kTileN x K
// floats (96 KB at K = 4096 with 6 rows: in L2), then every kTileM-row tile of x runs over the whole buffer, one FMA
// per kLanes products, and each output is one horizontal sum at the end. Each packed byte is read and dequantized once
// per x chunk (below), so the work per weight is the products alone: fused_linear's fgemm, the route before,
// dequantizes and transposes 8 x 8 blocks into its panels, 16.5 ms against 7.3 at M = 16, 4096 x 4096, one Zen 4 core
// (the limits per family are beside its Kernels table).

template <class V> I4_SIMD inline void i4_dequant_row(const Int4Args &a, int64_t n, float *dst) {
    using F = typename V::F;
    constexpr int VB = 32 / V::kLanes;
    const int64_t groups = a.K / a.group, blocks = a.group / 32;
    const uint8_t *q = a.q + n * (a.K / 2);
    const uint16_t *s = a.scales + n * groups;
    const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
    for (int64_t g = 0; g < groups; ++g) {
        const auto z = V::zp(zr ? zr[g] : 8);
        const F sv = V::set1(V::half(s[g]));
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t k = (g * blocks + b) * 32;
            F w[VB];
            V::codes(q + k / 2, z, w);
            for (int j = 0; j < VB; ++j)
                V::store(dst + k + j * V::kLanes, V::mul(w[j], sv));
        }
    }
}

// Rows [m0, m0 + MR) of x against the NR dequantized weight rows in wb (row stride K); the first nv are stored.
template <class V, int MR, int NR>
I4_SIMD inline void i4_tile(const Int4Args &a, int64_t m0, const float *wb, int64_t n0, int nv) {
    using F = typename V::F;
    F acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NR; ++j)
            acc[m][j] = V::zero();
    const float *xr = a.x + m0 * a.ldx;
    for (int64_t k = 0; k < a.K; k += V::kLanes) {
        F w[NR];
        for (int j = 0; j < NR; ++j)
            w[j] = V::loadx(wb + j * a.K + k);
        for (int m = 0; m < MR; ++m) {
            const F xv = V::loadx(xr + m * a.ldx + k);
            for (int j = 0; j < NR; ++j)
                acc[m][j] = V::fma(xv, w[j], acc[m][j]);
        }
    }
    for (int m = 0; m < MR; ++m)
        for (int j = 0; j < nv; ++j)
            a.out[(m0 + m) * a.ldo + n0 + j] = V::hsum(acc[m][j]) + (a.bias ? a.bias[n0 + j] : 0.f);
}

template <class V, int NR> struct TileRows {
    template <int MR> struct K {
        static I4_SIMD inline void run(const Int4Args &a, int64_t m0, const float *wb, int64_t n0, int nv) {
            i4_tile<V, MR, NR>(a, m0, wb, n0, nv);
        }
    };
};

template <class V> I4_SIMD void i4_tiles(const Int4Args &a, int64_t n0, int64_t n1) {
    constexpr int MR = V::kTileM, NR = V::kTileN;
    // x in chunks of rows (1 MB: 64 rows at K = 4096) that stay in L2 while every weight tile runs over them; each
    // chunk dequantizes the weights again (a few instructions per 32 weights against 64 FMAs per weight at 64 rows).
    // Without chunks, M = 1024 at 4096 x 4096 took 966 ms against 362 (one Zen 4 core); chunks of 2 / 4 MB 361 / 376.
    constexpr int64_t kChunkBytes = int64_t{1} << 20;
    const int64_t chunk = std::max<int64_t>(MR, kChunkBytes / (a.K * 4) / MR * MR);
    std::unique_ptr<float[]> buf(new float[NR * a.K]);
    float *wb = buf.get();
    for (int64_t c0 = 0; c0 < a.M; c0 += chunk) {
        const int64_t c1 = std::min(a.M, c0 + chunk);
        for (int64_t n = n0; n < n1; n += NR) {
            const int nv = static_cast<int>(n1 - n < NR ? n1 - n : NR);
            for (int j = 0; j < NR; ++j) {
                if (j < nv)
                    i4_dequant_row<V>(a, n + j, wb + j * a.K);
                else
                    std::fill(wb + j * a.K, wb + (j + 1) * a.K, 0.f);
            }
            for (int64_t m0 = c0; m0 < c1; m0 += MR)
                by_rows<TileRows<V, NR>::template K, MR>(c1 - m0, a, m0, static_cast<const float *>(wb), n, nv);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// W4A8 (int4_kernels.h, A8Args). V also provides, for these:
//   I (= __m256i)              the int32 vector of one 32-byte register (8 lanes)
//   I codes_u8(const uint8_t *p)   16 packed bytes -> the 32 codes u (unsigned bytes) in k order
//   I dot(I acc, I u, const int8_t *x)  acc + the sums of 4 adjacent u * x products per lane (exact)
//   I izero()
//   F abs(F), F max(F, F), float hmax(F), F mul(F, F), void store_q(int8_t *dst, F rounded, int n), F roundc(F)
//   (clamp to [-127, 127] then round half to even)
// The rest is 256-bit AVX2 code, which every family that includes this has.

// The 8 lanes of v summed, for 8 vectors at once: lane j of the result is the sum of v[j] (6 vphaddd, 2 permutes).
I4_SIMD inline __m256i i4_hsum8(const __m256i (&v)[8]) {
    const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31));
}

// The group epilogue of 8 groups [gc, gc + ng) of weight row (s, zr) for MR rows of x: sum[m] lane j is row m's
// sum q_x u over group gc + j; tot[m] += (sum - z sum_x) * s_w * s_x, vectorised over the 8 groups.
template <int MR>
I4_SIMD inline void i4a8_epilogue(const A8Args &a, int64_t m0, int64_t ldg, int64_t gc, int64_t ng, const uint16_t *s,
                                  const uint8_t *zr, const __m256i (&sum)[MR], __m256 (&tot)[MR]) {
    __m128i sh;
    __m256i z;
    if (ng == 8) {
        sh = _mm_loadu_si128(reinterpret_cast<const __m128i *>(s + gc));
        z = zr ? _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(zr + gc)))
               : _mm256_set1_epi32(8);
    } else {
        alignas(16) uint16_t hs[8] = {};
        alignas(32) int32_t zz[8] = {8, 8, 8, 8, 8, 8, 8, 8};
        for (int64_t j = 0; j < ng; ++j) {
            hs[j] = s[gc + j];
            if (zr)
                zz[j] = zr[gc + j];
        }
        sh = _mm_load_si128(reinterpret_cast<const __m128i *>(hs));
        z = _mm256_load_si256(reinterpret_cast<const __m256i *>(zz));
    }
    const __m256 sw = _mm256_cvtph_ps(sh);
    for (int m = 0; m < MR; ++m) {
        const int64_t row = (m0 + m) * ldg + gc;
        const __m256i sumx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(a.sumx + row));
        const __m256i exact = _mm256_sub_epi32(sum[m], _mm256_mullo_epi32(z, sumx));
        const __m256 scale = _mm256_mul_ps(sw, _mm256_loadu_ps(a.sx + row));
        tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), scale, tot[m]);
    }
}

template <int MR> I4_SIMD inline void i4a8_store(const A8Args &a, int64_t m0, int64_t n, const __m256 (&tot)[MR]) {
    const float b = a.bias ? a.bias[n] : 0.f;
    for (int m = 0; m < MR; ++m) {
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(tot[m]), _mm256_extractf128_ps(tot[m], 1));
        t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        a.out[(m0 + m) * a.ldo + n] = _mm_cvtss_f32(t) + b;
    }
}

// One weight row n against MR rows of x. Groups are taken 8 at a time: each group's int32 products stay in a vector
// (vpdpbusd / vpmaddubsw lanes) until 8 groups are done, then the 8 are reduced together (lane j = group j) and the
// group epilogue runs once for the 8, vectorised: (sum - z * sum_x) exactly in int32, to fp32, times s_w * s_x. (A
// per-group horizontal sum and scalar epilogue cost ~12 instructions per group, as much as the products of a
// 32-weight group: groups of 32 ran at 0.6x the speed of groups of 128.) The sums of x's codes and its scales are
// padded to a multiple of 8 groups per row by the caller (zeros), so their 8-wide loads stay in bounds.
template <class V, int MR> I4_SIMD inline void i4a8_row(const A8Args &a, int64_t m0, int64_t n, int64_t ldg) {
    using I = typename V::I;
    const int64_t groups = a.K / a.group, blocks = a.group / 32;
    const uint8_t *q = a.q + n * (a.K / 2);
    const uint16_t *s = a.scales + n * groups;
    const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
    __m256 tot[MR];
    for (int m = 0; m < MR; ++m)
        tot[m] = _mm256_setzero_ps();
    for (int64_t gc = 0; gc < groups; gc += 8) {
        const int64_t ng = groups - gc < 8 ? groups - gc : 8;
        I acc[MR][8];
        for (int j = 0; j < 8; ++j)
            for (int m = 0; m < MR; ++m)
                acc[m][j] = V::izero();
        // blocks outer, groups inner: 8 x MR independent accumulation chains (a group's blocks in a row would wait
        // on vpdpbusd's latency: 0.36 ms at 4096 x 4096, M = 1, groups of 128, was ~6 weights per cycle)
        for (int64_t b = 0; b < blocks; ++b) {
            if (ng == 8) {
#pragma GCC unroll 8
                for (int j = 0; j < 8; ++j) {
                    const int64_t k = ((gc + j) * blocks + b) * 32;
                    const I u = V::codes_u8(q + k / 2);
                    for (int m = 0; m < MR; ++m)
                        acc[m][j] = V::dot(acc[m][j], u, a.qx + (m0 + m) * a.K + k);
                }
            } else {
                for (int j = 0; j < ng; ++j) {
                    const int64_t k = ((gc + j) * blocks + b) * 32;
                    const I u = V::codes_u8(q + k / 2);
                    for (int m = 0; m < MR; ++m)
                        acc[m][j] = V::dot(acc[m][j], u, a.qx + (m0 + m) * a.K + k);
                }
            }
        }
        __m256i sum[MR];
        for (int m = 0; m < MR; ++m)
            sum[m] = i4_hsum8(acc[m]);
        i4a8_epilogue<MR>(a, m0, ldg, gc, ng, s, zr, sum, tot);
    }
    i4a8_store<MR>(a, m0, n, tot);
}

// 32 packed bytes (two 32-k blocks, 64 codes) against x in the paired order (see i4a8_quantize): the low nibbles are
// the blocks' k 0..15 and the high nibbles their k 16..31, so two dots and no shuffle.
template <class V> I4_SIMD inline typename V::I i4a8_pair(typename V::I acc, const uint8_t *qb, const int8_t *x) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(qb));
    const __m256i m = _mm256_set1_epi8(0x0F);
    acc = V::dot(acc, _mm256_and_si256(v, m), x);
    return V::dot(acc, _mm256_and_si256(_mm256_srli_epi16(v, 4), m), x + 32);
}

// i4a8_row for K % 64 == 0 (x's codes in the paired order): 64 weights per step, 6 instructions with VNNI instead of
// 2 x 6. G (the group size) is a template argument so that every offset in the unrolled loops is a constant (with a
// run-time G the compiler kept recomputing addresses and reloading pointers: 2.3x slower at M = 1). Groups of 32: a
// pair is two groups (low / high 128-bit lanes), reduced 4 pairs at a time.
template <class V, int MR, int G>
I4_SIMD inline void i4a8_row_paired(const A8Args &a, int64_t m0, int64_t n, int64_t ldg, const uint8_t *ahead) {
    using I = typename V::I;
    constexpr int kPairs = G / 64, kHalf = G / 2;
    const int64_t groups = a.K / G;
    const uint8_t *q = a.q + n * (a.K / 2);
    const uint16_t *s = a.scales + n * groups;
    const uint8_t *zr = a.zeros ? a.zeros + n * groups : nullptr;
    const int8_t *xr[MR];
    __m256 tot[MR];
    for (int m = 0; m < MR; ++m) {
        xr[m] = a.qx + (m0 + m) * a.K;
        tot[m] = _mm256_setzero_ps();
    }
    for (int64_t gc = 0; gc < groups; gc += 8) {
        const int64_t ng = groups - gc < 8 ? groups - gc : 8;
        const uint8_t *qg = q + gc * kHalf;
        if (ahead) // the same 8 groups of a row further on, into L2 (the hardware prefetcher alone reached ~70 % of
                   // the DRAM bandwidth the int8 kernel reaches with its software prefetch)
            for (int l = 0; l < 4 * G; l += 64)
                __builtin_prefetch(ahead + gc * kHalf + l, 0, 2);
        __m256i sum[MR];
        if constexpr (G == 32) { // groups gc + 2p (low lanes) and gc + 2p + 1 (high lanes) in acc[p]
            I acc[MR][4];
            for (int p = 0; p < 4; ++p)
                for (int m = 0; m < MR; ++m)
                    acc[m][p] = V::izero();
            if (ng == 8) {
#pragma GCC unroll 4
                for (int p = 0; p < 4; ++p)
                    for (int m = 0; m < MR; ++m)
                        acc[m][p] = i4a8_pair<V>(acc[m][p], qg + p * 32, xr[m] + gc * 32 + p * 64);
            } else {
                for (int p = 0; p < (ng + 1) / 2; ++p)
                    for (int m = 0; m < MR; ++m)
                        acc[m][p] = i4a8_pair<V>(acc[m][p], qg + p * 32, xr[m] + gc * 32 + p * 64);
            }
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); // [g0 g2 g4 g6 g1 g3 g5 g7] -> g0..g7
            for (int m = 0; m < MR; ++m)
                sum[m] = _mm256_permutevar8x32_epi32(
                    _mm256_hadd_epi32(_mm256_hadd_epi32(acc[m][0], acc[m][1]), _mm256_hadd_epi32(acc[m][2], acc[m][3])),
                    order);
        } else {
            I acc[MR][8];
            for (int j = 0; j < 8; ++j)
                for (int m = 0; m < MR; ++m)
                    acc[m][j] = V::izero();
            if (ng == 8) {
                for (int c = 0; c < kPairs; ++c) // pairs outer: 8 x MR independent chains
#pragma GCC unroll 8
                    for (int j = 0; j < 8; ++j)
                        for (int m = 0; m < MR; ++m)
                            acc[m][j] =
                                i4a8_pair<V>(acc[m][j], qg + j * kHalf + c * 32, xr[m] + gc * G + j * G + c * 64);
            } else {
                for (int c = 0; c < kPairs; ++c)
                    for (int j = 0; j < ng; ++j)
                        for (int m = 0; m < MR; ++m)
                            acc[m][j] =
                                i4a8_pair<V>(acc[m][j], qg + j * kHalf + c * 32, xr[m] + gc * G + j * G + c * 64);
            }
            for (int m = 0; m < MR; ++m)
                sum[m] = i4_hsum8(acc[m]);
        }
        i4a8_epilogue<MR>(a, m0, ldg, gc, ng, s, zr, sum, tot);
    }
    i4a8_store<MR>(a, m0, n, tot);
}

template <class V, int MR, int G>
I4_SIMD inline void i4a8_rows_paired(const A8Args &a, int64_t m0, int64_t n0, int64_t n1, int64_t ldg) {
    constexpr int64_t kAhead = 3; // rows (6 KB at K = 4096)
    for (int64_t n = n0; n < n1; ++n)
        i4a8_row_paired<V, MR, G>(a, m0, n, ldg, n + kAhead < n1 ? a.q + (n + kAhead) * (a.K / 2) : nullptr);
}

template <class V, int MR> I4_SIMD inline void i4a8_tile(const A8Args &a, int64_t m0, int64_t n0, int64_t n1) {
    const int64_t ldg = (a.K / a.group + 7) / 8 * 8;
    if (a.K % 64 == 0 && a.group == 32) {
        i4a8_rows_paired<V, MR, 32>(a, m0, n0, n1, ldg);
    } else if (a.K % 64 == 0 && a.group == 64) {
        i4a8_rows_paired<V, MR, 64>(a, m0, n0, n1, ldg);
    } else if (a.K % 64 == 0 && a.group == 128) {
        i4a8_rows_paired<V, MR, 128>(a, m0, n0, n1, ldg);
    } else {
        for (int64_t n = n0; n < n1; ++n)
            i4a8_row<V, MR>(a, m0, n, ldg);
    }
}

template <class V> struct A8Rows {
    template <int MR> struct K {
        static I4_SIMD inline void run(const A8Args &a, int64_t m0, int64_t n0, int64_t n1) {
            i4a8_tile<V, MR>(a, m0, n0, n1);
        }
    };
};

template <class V> I4_SIMD void i4a8(const A8Args &a, int64_t n0, int64_t n1) {
    for (int64_t nb = n0; nb < n1; nb += kA8BlockRows) {
        const int64_t ne = nb + kA8BlockRows < n1 ? nb + kA8BlockRows : n1;
        for (int64_t m0 = 0; m0 < a.M; m0 += 4)
            by_rows<A8Rows<V>::template K, 4>(a.M - m0, a, m0, nb, ne);
    }
}

// The paired order of x's codes (K % 64 == 0): in every 64-k chunk, k 16..31 and k 32..47 trade places, so that the
// low nibbles of two packed blocks (their k 0..15) meet x's codes [0, 32) and the high nibbles (k 16..31) x's [32, 64).
inline int64_t i4a8_paired_pos(int64_t k) {
    const int64_t c = k % 64;
    return c >= 16 && c < 32 ? k + 16 : c >= 32 && c < 48 ? k - 16 : k;
}

// Per (row, group): amax, then q = round_half_even(clamp(x * (127 / amax))) (one IEEE division per group, one fp32
// multiply per element, as the reference); amax 0 gives q 0 and s 0; a NaN or infinity makes s NaN (the row's output
// is NaN, not a silently wrong number).
template <class V> I4_SIMD void i4a8_quantize(const QuantX &p, int64_t m0, int64_t m1) {
    const int64_t groups = p.K / p.group, ldg = (groups + 7) / 8 * 8; // (sx / sumx rows padded with zeros)
    const bool paired = !p.natural && p.K % 64 == 0; // the paired order (i4a8_row_paired reads x's codes so)
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
            const int64_t mg = m * ldg + g;
            if (!finite || !(amax > 0.f)) {
                for (int64_t k = 0; k < p.group; ++k)
                    qg[k] = 0;
                p.sx[mg] = finite ? 0.f : __builtin_nanf("");
                p.sumx[mg] = 0;
                continue;
            }
            const typename V::F inv = V::set1(127.f / amax);
            typename V::F qs = V::zero();
            for (int64_t k = 0; k < p.group; k += V::kLanes) {
                const typename V::F r = V::roundc(V::mul(V::loadx(xg + k), inv));
                qs = V::add(qs, r); // integers below 2^24: exact
                V::store_q(qg + (paired ? i4a8_paired_pos(g * p.group + k) - g * p.group : k), r, V::kLanes);
            }
            p.sx[mg] = amax / 127.f;
            p.sumx[mg] = static_cast<int32_t>(V::hsum(qs));
        }
    }
}
