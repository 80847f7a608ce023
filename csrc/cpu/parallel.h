// Threads for every CPU kernel of the extension: at::parallel_for, nothing else.
//
// The one answer to the OpenMP question: with torch's OpenMP backend (torch's x86 Linux wheels) at::parallel_for is
// header code around `#pragma omp parallel`, so it is parallel only in a translation unit compiled with -fopenmp and
// silently serial without it (measured: the W8A8 GEMM at M = 512 took the same 17 ms with 1 and 2 threads). fastdl's
// build passes -fopenmp to every C++ file and to the link (fastdl/_build.py, shared by setup.py and the JIT), and the
// kernels then run on torch's own OpenMP thread team (same runtime, torch.set_num_threads() applies). A build without
// it would be a silently slow build, so it does not compile.
#pragma once

#include <ATen/Parallel.h>

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error                                                                                                                 \
    "fastdl's CPU kernels must be compiled with -fopenmp: torch uses the OpenMP backend, and at::parallel_for would run every kernel on one thread (fastdl/_build.py passes the flag)"
#endif

namespace fastdl {

// at::parallel_for(begin, end, grain, f): f(b, e) over chunks of [begin, end), one chunk per thread.
template <class F> inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F &f) {
    at::parallel_for(begin, end, grain, f);
}

} // namespace fastdl
