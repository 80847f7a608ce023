// Overflow-checked size and offset arithmetic for the ATen glue (csrc/cpu/*.cpp, csrc/cuda/*.cu): every product or sum
// of user-controlled sizes, offsets or counts that is not already the size of a tensor that exists (whose byte count
// fits in memory, so below 2^63) goes through these before it reaches a pointer. An overflow raises ValueError
// (TORCH_CHECK_VALUE) naming the op and the quantity, never wraps around into an out-of-bounds access.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

namespace fastdl {

// a * b; ValueError "<op>: <what> = a * b overflows int64" when it does not fit.
inline int64_t checked_mul(int64_t a, int64_t b, const char *op, const char *what) {
    int64_t r = 0;
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &r), op, ": ", what, " = ", a, " * ", b,
                      " overflows int64 (2^63 - 1)");
    return r;
}

// a + b; ValueError "<op>: <what> = a + b overflows int64" when it does not fit.
inline int64_t checked_add(int64_t a, int64_t b, const char *op, const char *what) {
    int64_t r = 0;
    TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &r), op, ": ", what, " = ", a, " + ", b,
                      " overflows int64 (2^63 - 1)");
    return r;
}

// Whether [off, off + len) lies inside [0, capacity), computed without overflow (off + len may exceed int64).
inline bool range_inside(int64_t off, int64_t len, int64_t capacity) {
    return off >= 0 && len >= 0 && off <= capacity && len <= capacity - off;
}

} // namespace fastdl
