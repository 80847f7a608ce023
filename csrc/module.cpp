// Python module fastdl._C. Kernels register themselves with the dispatcher (TORCH_LIBRARY_IMPL(fastdl_cpp, ...))
// from static initialisers when this library is loaded; the module itself only reports build facts.
#include <torch/extension.h>

#include "cpu/cpu_isa.h"

// The kernel family each CPU capability runs in this process (chosen once from cpu_isa.h's level).
const char *fastdl_int8_isa();                 // csrc/cpu/int8.cpp
const char *fastdl_fused_linear_cpu_kernels(); // csrc/cpu/fused_linear.cpp
const char *fastdl_int4_cpu_kernels();         // csrc/cpu/int4.cpp
std::string fastdl_fused_linear_onednn();      // csrc/cpu/fused_linear.cpp
const char *fastdl_sparse24_cpu_kernels();     // csrc/cpu/sparse24.cpp

namespace {

// What the CPU can run, checked at run time (the same build runs on CPUs without AVX-512).
pybind11::dict cpu_features() {
    pybind11::dict d;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    d["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
    d["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
    d["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
    d["avx512bw"] = static_cast<bool>(__builtin_cpu_supports("avx512bw"));
    d["avx512vl"] = static_cast<bool>(__builtin_cpu_supports("avx512vl"));
    d["avx512_vnni"] = static_cast<bool>(__builtin_cpu_supports("avx512vnni"));
    d["avx512_bf16"] = static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
#endif
    return d;
}

// The CPU as fastdl sees it (cpu_isa.h): model, detected and active level, and the kernels of each capability.
pybind11::dict cpu_info() {
    namespace cpu = fastdl::cpu;
    pybind11::dict d;
    d["model"] = std::string(cpu::model_name());
    d["detected_level"] = std::string(cpu::level_name(cpu::detected_level()));
    d["level"] = std::string(cpu::level_name(cpu::level()));
    d["capped"] = cpu::capped();
    const cpu::Features &f = cpu::features();
    pybind11::dict feats;
    feats["avx2"] = f.avx2;
    feats["fma"] = f.fma;
    feats["f16c"] = f.f16c;
    feats["avx512f"] = f.avx512f;
    feats["avx512bw"] = f.avx512bw;
    feats["avx512dq"] = f.avx512dq;
    feats["avx512vl"] = f.avx512vl;
    feats["avx512_vnni"] = f.avx512_vnni;
    feats["avx512_bf16"] = f.avx512_bf16;
    feats["avx512_vbmi2"] = f.avx512_vbmi2;
    d["features"] = feats;
    pybind11::dict kernels;
    kernels["fused_linear"] = std::string(fastdl_fused_linear_cpu_kernels());
    kernels["int8"] = std::string(fastdl_int8_isa());
    kernels["sparse24"] = std::string(fastdl_sparse24_cpu_kernels());
    kernels["int4"] = std::string(fastdl_int4_cpu_kernels());
    d["kernels"] = kernels;
    d["fused_linear_onednn"] = fastdl_fused_linear_onednn();
    return d;
}

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "fastdl compiled kernels (C++ CPU, CUDA)";
#ifdef FASTDL_WITH_CUDA
    m.attr("with_cuda") = true;
#else
    m.attr("with_cuda") = false;
#endif
    m.def("cpu_features", &cpu_features, "CPU ISA extensions detected at run time");
    m.def("cpu_info", &cpu_info,
          "the CPU model, its ISA level (capped by FASTDL_CPU_ISA) and each capability's kernels");
    m.def(
        "int8_cpu_kernels", [] { return std::string(fastdl_int8_isa()); },
        "the int8 CPU kernels this process runs (cpuid, capped by FASTDL_CPU_ISA)");
}
