// AVX2 + FMA + F16C kernels of the fused linear layer (stub).
#include "fused_linear_kernels.h"

namespace fastdl {
namespace fused_linear {

int64_t fgemm_packed_a_floats(int64_t M, int64_t K) {
    return (M + kFgMR - 1) / kFgMR * kFgMR * ((K + kFgKC - 1) / kFgKC * kFgKC);
}

size_t fgemm_workspace_bytes() {
    return 64 + sizeof(float) * (kFgKC * kFgNC + kFgMS * kFgNC);
}

const Kernels *kernels_avx2() {
    return nullptr;
}

} // namespace fused_linear
} // namespace fastdl
