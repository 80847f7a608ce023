// CPU capability detection shared by every fastdl CPU kernel (see cpu_isa.h).
#include "cpu_isa.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FASTDL_CPU_X86 1
#include <cpuid.h>
#else
#define FASTDL_CPU_X86 0
#endif

namespace fastdl {
namespace cpu {
namespace {

struct Detected {
    Features features;
    Level level = kScalar;
    char model[96] = "unknown";
    bool intel = false;
};

#if FASTDL_CPU_X86
bool cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    return __get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]) != 0;
}

uint64_t xgetbv0() {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<uint64_t>(hi) << 32) | lo;
}

void read_model(char *out, size_t size) {
    unsigned r[4];
    if (!cpuid(0x80000000u, 0, r) || r[0] < 0x80000004u)
        return;
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
        cpuid(0x80000002u + i, 0, r);
        std::memcpy(brand + 16 * i, r, 16);
    }
    std::string s(brand);
    const auto first = s.find_first_not_of(' ');
    const auto last = s.find_last_not_of(' ');
    if (first == std::string::npos)
        return;
    s = s.substr(first, last - first + 1);
    std::snprintf(out, size, "%s", s.c_str());
}
#endif

Detected detect() {
    Detected d;
#if FASTDL_CPU_X86
    unsigned r1[4] = {}, r7[4] = {}, r71[4] = {};
    if (!cpuid(1, 0, r1))
        return d;
    const bool osxsave = (r1[2] >> 27) & 1u, avx = (r1[2] >> 28) & 1u;
    const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    const bool os_ymm = avx && (xcr0 & 0x6) == 0x6;      // XMM and YMM state
    const bool os_zmm = os_ymm && (xcr0 & 0xE6) == 0xE6; // plus opmask, ZMM_Hi256, Hi16_ZMM
    unsigned max_leaf[4] = {};
    cpuid(0, 0, max_leaf);
    if (max_leaf[0] >= 7)
        cpuid(7, 0, r7);
    if (max_leaf[0] >= 7 && r7[0] >= 1)
        cpuid(7, 1, r71);
    Features &f = d.features;
    f.fma = os_ymm && ((r1[2] >> 12) & 1u);
    f.f16c = os_ymm && ((r1[2] >> 29) & 1u);
    f.avx2 = os_ymm && ((r7[1] >> 5) & 1u);
    f.avx512f = os_zmm && ((r7[1] >> 16) & 1u);
    f.avx512dq = os_zmm && ((r7[1] >> 17) & 1u);
    f.avx512bw = os_zmm && ((r7[1] >> 30) & 1u);
    f.avx512vl = os_zmm && ((r7[1] >> 31) & 1u);
    f.avx512_vbmi2 = os_zmm && ((r7[2] >> 6) & 1u);
    f.avx512_vnni = os_zmm && ((r7[2] >> 11) & 1u);
    f.avx512_bf16 = os_zmm && ((r71[0] >> 5) & 1u);
    if (f.avx2 && f.fma && f.f16c) {
        d.level = kAvx2;
        if (f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl) {
            d.level = kAvx512;
            if (f.avx512_bf16)
                d.level = kAvx512Bf16;
        }
    }
    read_model(d.model, sizeof(d.model));
    d.intel = max_leaf[1] == 0x756E6547u && max_leaf[3] == 0x49656E69u && max_leaf[2] == 0x6C65746Eu; // "GenuineIntel"
    // Virtual machines often report a bare brand ("AMD EPYC"): the cpuid family / model tell the generation apart
    // (AMD family 23 = Zen 1/2, 25 = Zen 3/4, 26 = Zen 5).
    const unsigned base_family = (r1[0] >> 8) & 0xF, base_model = (r1[0] >> 4) & 0xF;
    const unsigned family = base_family == 0xF ? base_family + ((r1[0] >> 20) & 0xFF) : base_family;
    const unsigned model =
        (base_family == 0xF || base_family == 0x6) ? base_model | (((r1[0] >> 16) & 0xF) << 4) : base_model;
    const size_t used = std::strlen(d.model);
    std::snprintf(d.model + used, sizeof(d.model) - used, " (cpuid family %u, model %u)", family, model);
#endif
    return d;
}

const Detected &detected() {
    static const Detected d = detect();
    return d;
}

// FASTDL_CPU_ISA as a level; unset, empty and "native" do not cap.
Level env_cap() {
    const char *env = std::getenv("FASTDL_CPU_ISA");
    std::string want = env ? env : "";
    std::transform(want.begin(), want.end(), want.begin(), [](unsigned char c) { return std::tolower(c); });
    if (want.empty() || want == "native")
        return kAvx512Bf16;
    if (want == "scalar" || want == "none")
        return kScalar;
    if (want == "avx2")
        return kAvx2;
    if (want == "avx512" || want == "avx512_vnni")
        return kAvx512;
    if (want == "avx512_bf16" || want == "avx512bf16")
        return kAvx512Bf16;
    std::fprintf(stderr, "fastdl: FASTDL_CPU_ISA=%s is not one of scalar, avx2, avx512, avx512_bf16, native; ignored\n",
                 env);
    return kAvx512Bf16;
}

struct Active {
    Level level = kScalar;
    Features features;
    bool capped = false;
};

Active make_active() {
    const Detected &d = detected();
    Active a;
    a.level = std::min(d.level, env_cap());
    a.capped = a.level < d.level;
    a.features = d.features;
    Features &f = a.features;
    if (a.level < kAvx512Bf16)
        f.avx512_bf16 = false;
    if (a.level < kAvx512)
        f.avx512f = f.avx512bw = f.avx512dq = f.avx512vl = f.avx512_vnni = f.avx512_vbmi2 = false;
    if (a.level < kAvx2)
        f.avx2 = f.fma = f.f16c = false;
    return a;
}

const Active &active() {
    static const Active a = make_active();
    return a;
}

} // namespace

Level level() {
    return active().level;
}
const Features &features() {
    return active().features;
}
Level detected_level() {
    return detected().level;
}
const Features &detected_features() {
    return detected().features;
}
bool capped() {
    return active().capped;
}
const char *model_name() {
    return detected().model;
}

bool vendor_intel() {
    return detected().intel;
}

const char *level_name(Level level) {
    switch (level) {
    case kAvx512Bf16:
        return "avx512_bf16";
    case kAvx512:
        return "avx512";
    case kAvx2:
        return "avx2";
    default:
        return "scalar";
    }
}

} // namespace cpu
} // namespace fastdl
