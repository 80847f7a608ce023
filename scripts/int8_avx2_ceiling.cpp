// The int8 multiply-add ceiling of one AVX2 core: inner loops of W8A8 tiles run on operands that stay in L1, so the
// loop, not memory, sets the rate. It answers "how fast can any AVX2 int8 GEMM be on this CPU?" for the int8 notes
// in csrc/cpu/int8.cpp (the AVX2 W8A8 kernel vs fbgemm).
//
//   g++ -O2 -std=c++17 scripts/int8_avx2_ceiling.cpp -o /tmp/int8_ceiling && /tmp/int8_ceiling
//
// Variants (GMAC/s of one thread, best of 20 runs):
//   sign_trick  fastdl's exact kernel: vpsignb + vpmaddubsw + vpmaddwd(ones) + vpaddd, 4 rows x 16 columns
//   plain       vpmaddubsw on an unsigned A without the sign trick (fbgemm's loop; exact only for 7-bit A)
//   madd16      int8 B widened to int16 (vpmovsxbw) and vpmaddwd on int16 A pairs, 2 rows x 32 columns
//   alu_widen   vpmaddubsw, its int16 pair sums widened with xor/shift/add instead of vpmaddwd (fewer multiplies)
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

#define KERNEL __attribute__((target("avx2,fma"), noinline))

namespace {
alignas(64) int8_t B[64 * 512];
alignas(64) int8_t A[8][4096];
alignas(64) int32_t sink[8][64];

__attribute__((target("avx2,fma"))) inline __m256i bcast4(int row, int q) {
    int32_t a4;
    std::memcpy(&a4, &A[row][(4 * q) & 4095], 4);
    return _mm256_set1_epi32(a4);
}

template <int MR> KERNEL void sign_trick(int nq) {
    __m256i acc[MR][2] = {};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int q = 0; q < nq; ++q) {
        const __m256i *bq = reinterpret_cast<const __m256i *>(B + (q & 511) * 64);
        const __m256i b0 = _mm256_load_si256(bq), b1 = _mm256_load_si256(bq + 1);
        const __m256i u0 = _mm256_abs_epi8(b0), u1 = _mm256_abs_epi8(b1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(i, q);
            acc[i][0] =
                _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, b0)), ones));
            acc[i][1] =
                _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, b1)), ones));
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2; ++j)
            _mm256_store_si256(reinterpret_cast<__m256i *>(sink[i] + 8 * j), acc[i][j]);
}

template <int MR> KERNEL void plain(int nq) {
    __m256i acc[MR][2] = {};
    const __m256i ones = _mm256_set1_epi16(1);
    for (int q = 0; q < nq; ++q) {
        const __m256i *bq = reinterpret_cast<const __m256i *>(B + (q & 511) * 64);
        const __m256i b0 = _mm256_load_si256(bq), b1 = _mm256_load_si256(bq + 1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(i, q);
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b0), ones));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b1), ones));
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2; ++j)
            _mm256_store_si256(reinterpret_cast<__m256i *>(sink[i] + 8 * j), acc[i][j]);
}

// nq counts k pairs: per pair, NC vectors of 8 columns x 2 k (16 int8 widened to int16).
template <int MR, int NC> KERNEL void madd16(int nq) {
    __m256i acc[MR][NC] = {};
    for (int q = 0; q < nq; ++q) {
        const __m128i *bq = reinterpret_cast<const __m128i *>(B + (q & 511) * 16 * NC);
        __m256i b[NC];
#pragma GCC unroll 8
        for (int j = 0; j < NC; ++j)
            b[j] = _mm256_cvtepi8_epi16(_mm_load_si128(bq + j));
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(i, q);
#pragma GCC unroll 8
            for (int j = 0; j < NC; ++j)
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(a, b[j]));
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NC; ++j)
            _mm256_store_si256(reinterpret_cast<__m256i *>(sink[i] + 8 * j), acc[i][j]);
}

// x' = pair sums ^ 0x80008000 (each int16 + 32768, as unsigned); raw += x', hi += x' >> 16: the column sums follow
// from raw - 65536 * hi and hi after the loop (not computed here: only the loop's rate matters).
template <int MR> KERNEL void alu_widen(int nq) {
    __m256i raw[MR][2] = {}, hi[MR][2] = {};
    const __m256i flip = _mm256_set1_epi32(static_cast<int>(0x80008000u));
    for (int q = 0; q < nq; ++q) {
        const __m256i *bq = reinterpret_cast<const __m256i *>(B + (q & 511) * 64);
        const __m256i b0 = _mm256_load_si256(bq), b1 = _mm256_load_si256(bq + 1);
        const __m256i u0 = _mm256_abs_epi8(b0), u1 = _mm256_abs_epi8(b1);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            const __m256i a = bcast4(i, q);
            const __m256i x0 = _mm256_xor_si256(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(a, b0)), flip);
            const __m256i x1 = _mm256_xor_si256(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(a, b1)), flip);
            raw[i][0] = _mm256_add_epi32(raw[i][0], x0);
            hi[i][0] = _mm256_add_epi32(hi[i][0], _mm256_srli_epi32(x0, 16));
            raw[i][1] = _mm256_add_epi32(raw[i][1], x1);
            hi[i][1] = _mm256_add_epi32(hi[i][1], _mm256_srli_epi32(x1, 16));
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 2; ++j) {
            _mm256_store_si256(reinterpret_cast<__m256i *>(sink[i] + 8 * j), raw[i][j]);
            _mm256_store_si256(reinterpret_cast<__m256i *>(sink[i] + 16 + 8 * j), hi[i][j]);
        }
}

template <class F> void report(const char *name, F f, double macs_per_step) {
    const int steps = 1 << 20;
    f(steps);
    double best = 1e30;
    for (int r = 0; r < 20; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        f(steps);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("%-12s %6.1f GMAC/s\n", name, macs_per_step * steps / best / 1e9);
}
} // namespace

int main() {
    for (size_t i = 0; i < sizeof(B); ++i)
        B[i] = static_cast<int8_t>(i * 7 + 3);
    for (int i = 0; i < 8; ++i)
        for (int k = 0; k < 4096; ++k)
            A[i][k] = static_cast<int8_t>((k * 3 + i) % 127);
    report("sign_trick", sign_trick<4>, 4 * 16 * 4);
    report("plain", plain<4>, 4 * 16 * 4);
    report("madd16", madd16<2, 4>, 2 * 32 * 2);
    report("alu_widen", alu_widen<2>, 2 * 16 * 4);
    return 0;
}
