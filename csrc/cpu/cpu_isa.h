// The one answer to "which CPU is this" for every fastdl CPU kernel (fused_linear, int8, sparse24).
//
// Detected once per process from cpuid and the OS's XSAVE state (XGETBV: the OS must save the ymm / zmm / opmask
// registers, or the instructions fault even where cpuid lists them), then capped by the environment variable
// FASTDL_CPU_ISA = scalar | avx2 | avx512 | avx512_bf16 | native (read once; tests and benchmarks run each level in
// its own process). A cap above what the CPU has changes nothing. Every capability picks its kernel family from
// level() and, where a family needs one more extension (VNNI for the int8 AVX-512 kernels, VBMI2 for the 2:4 bf16
// kernel), from features(), whose bits above the cap are cleared.
//
// No torch headers: the SIMD translation units include this file.
#pragma once

namespace fastdl {
namespace cpu {

// Kernel families, lowest first. Each level implies the ones below it.
enum Level : int {
    kScalar = 0,     // portable C++
    kAvx2 = 1,       // AVX2 + FMA + F16C (Haswell, AMD Zen 1-3 and later)
    kAvx512 = 2,     // AVX-512 F/BW/DQ/VL (Skylake-SP, Ice Lake, Zen 4 and later)
    kAvx512Bf16 = 3, // the above plus AVX512_BF16 (vdpbf16ps: Cooper Lake, Sapphire Rapids, Zen 4 and later)
};

// Element types the CPU kernels read or write, one enum for every capability (a kernel family says which it accepts;
// the ATen glue converts anything else first).
enum class DType : int { F32 = 0, BF16 = 1, F16 = 2, I32 = 3, I8 = 4 };

struct Features {
    bool avx2 = false, fma = false, f16c = false;                               // with the OS saving ymm
    bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false; // with the OS saving zmm / opmask
    bool avx512_vnni = false, avx512_bf16 = false, avx512_vbmi2 = false;
};

// What this process uses: the detected level capped by FASTDL_CPU_ISA.
Level level();
// The features of level(): a bit above the cap reads false.
const Features &features();
// What the CPU itself has (uncapped), and whether FASTDL_CPU_ISA lowered it.
Level detected_level();
const Features &detected_features();
bool capped();
// "scalar", "avx2", "avx512", "avx512_bf16".
const char *level_name(Level level);
// The cpuid brand string, trimmed, with the cpuid family and model ("AMD EPYC (cpuid family 25, model 17)");
// "unknown" where cpuid has none.
const char *model_name();
// Whether the cpuid vendor is "GenuineIntel". Some path rules depend on it: PyTorch's oneDNN and MKL reach a larger
// share of the FMA peak on Intel cores than on AMD ones, so where fastdl's kernel and oneDNN are close the crossover
// differs by vendor (fused_linear.cpp, fwd_f32_onednn).
bool vendor_intel();

} // namespace cpu
} // namespace fastdl
