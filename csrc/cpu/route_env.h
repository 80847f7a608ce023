// The row-count thresholds of the CPU routes, overridden from the environment: one parse for every capability
// (FASTDL_INT4_*_ROWS, FASTDL_SPARSE24_DENSE_ROWS, FASTDL_CPU_PB_ROWS). Benchmarks measure the crossovers with them
// and the tests run each route; every caller reads its variable once per process (a function-local static).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace fastdl {

// `rows` unless the environment variable `name` is set and not empty, then its value (at least 1).
inline int64_t rows_or_env(const char *name, int64_t rows) {
    const char *env = std::getenv(name);
    return env && *env ? std::max<int64_t>(1, std::atoll(env)) : rows;
}

} // namespace fastdl
