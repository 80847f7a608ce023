// Python module fastdl._C. Kernels register themselves with the dispatcher (TORCH_LIBRARY_IMPL(fastdl_cpp, ...))
// from static initialisers when this library is loaded; the module itself only reports build facts.
#include <torch/extension.h>

const char *fastdl_int8_isa(); // csrc/cpu/int8.cpp: the int8 CPU kernels chosen in this process

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

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "fastdl compiled kernels (C++ CPU, CUDA)";
#ifdef FASTDL_WITH_CUDA
    m.attr("with_cuda") = true;
#else
    m.attr("with_cuda") = false;
#endif
    m.def("cpu_features", &cpu_features, "CPU ISA extensions detected at run time");
    m.def(
        "int8_cpu_kernels", [] { return std::string(fastdl_int8_isa()); },
        "the int8 CPU kernels this process runs (cpuid, capped by FASTDL_CPU_ISA)");
}
