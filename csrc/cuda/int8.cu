// CUDA kernels of the int8 capability, registered under fastdl_cpp (schemas are defined in Python,
// fastdl/ops/int8.py).
//
// quantize_per_token: bit-exact with the contract in fastdl/ops/int8.py. Here the IEEE divisions are __fdiv_rn, the
// multiply x * inv is __fmul_rn (never contracted into an fma) and the rounding (half to even) __float2int_rn.
//
// One pass over x when the row fits in registers is not worth the register pressure here: the kernel reads each row
// twice (amax, then quantize) and the second read hits L1/L2 (a row is at most a few tens of KiB). Loads are 16 bytes
// wide (8 x bf16/fp16 or 4 x fp32) when the rows are 16-byte aligned, and the int8 stores are 8 / 4 bytes wide.
// Rows of up to kWarpRowMax elements are handled by one warp each (kThreads / kWarp rows per block, warp-shuffle
// reduction); longer rows by a whole block (shuffle + shared-memory reduction).
//
// int8_mm / int8_linear / int8_weight_only_linear have no CUDA C++ kernel: the Triton kernels (kernels/int8.py) serve
// them on CUDA with the dequant fused in the GEMM epilogue. The alternatives available here - torch._int_mm or
// cuBLASLt IMMA - write the int32 accumulator to memory (cuBLASLt's int8 GEMM has no float-output epilogue with
// per-row x per-column scales), which the op contract rules out; the PyTorch reference already is that path.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../static_dispatch.h"

namespace fastdl::int8 {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int64_t kWarpRowMax = 2048; // rows up to this length: one warp per row

template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) {
    return v;
}
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
    return __bfloat162float(v);
}
template <> __device__ __forceinline__ float to_float<__half>(__half v) {
    return __half2float(v);
}

// |v| with NaN mapped to +inf, so that fmaxf (which drops NaN operands) still marks the row as not finite.
__device__ __forceinline__ float abs_or_inf(float v) {
    const float a = fabsf(v);
    return a != a ? __int_as_float(0x7f800000) : a;
}

__device__ __forceinline__ int8_t quantize_one(float v, float inv) {
    float t = __fmul_rn(v, inv);
    if (t != t) { // 0 * inf when 127 / amax overflowed
        t = 0.f;
    }
    t = fminf(fmaxf(t, -127.f), 127.f);
    return static_cast<int8_t>(__float2int_rn(t));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    }
    return v;
}

// V elements of T in 16 bytes; the matching int8 store is V bytes wide.
template <typename T> struct Vec {
    static constexpr int V = 16 / static_cast<int>(sizeof(T));
};

template <int V> struct QStore;
template <> struct QStore<4> {
    using type = uint32_t;
};
template <> struct QStore<8> {
    using type = uint2;
};

template <typename T, bool VEC>
__device__ __forceinline__ float row_amax_partial(const T *__restrict__ row, int64_t K, int lane, int tpr) {
    float m = 0.f;
    if constexpr (VEC) {
        constexpr int V = Vec<T>::V;
        const int64_t nvec = K / V;
        const uint4 *src = reinterpret_cast<const uint4 *>(row);
        for (int64_t i = lane; i < nvec; i += tpr) {
            uint4 raw = __ldg(src + i);
            const T *vals = reinterpret_cast<const T *>(&raw);
#pragma unroll
            for (int j = 0; j < V; ++j) {
                m = fmaxf(m, abs_or_inf(to_float(vals[j])));
            }
        }
    } else {
        for (int64_t i = lane; i < K; i += tpr) {
            m = fmaxf(m, abs_or_inf(to_float(row[i])));
        }
    }
    return m;
}

template <typename T, bool VEC>
__device__ __forceinline__ void row_quantize(const T *__restrict__ row, int8_t *__restrict__ qrow, int64_t K, float inv,
                                             bool ok, int lane, int tpr) {
    if constexpr (VEC) {
        constexpr int V = Vec<T>::V;
        using S = typename QStore<V>::type;
        const int64_t nvec = K / V;
        const uint4 *src = reinterpret_cast<const uint4 *>(row);
        S *dst = reinterpret_cast<S *>(qrow);
        for (int64_t i = lane; i < nvec; i += tpr) {
            union {
                S s;
                int8_t b[V];
            } out;
            if (ok) {
                uint4 raw = __ldg(src + i);
                const T *vals = reinterpret_cast<const T *>(&raw);
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    out.b[j] = quantize_one(to_float(vals[j]), inv);
                }
            } else {
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    out.b[j] = 0;
                }
            }
            dst[i] = out.s;
        }
    } else {
        for (int64_t i = lane; i < K; i += tpr) {
            qrow[i] = ok ? quantize_one(to_float(row[i]), inv) : int8_t{0};
        }
    }
}

__device__ __forceinline__ void row_params(float amax, float &inv, float &scale, bool &ok) {
    const bool finite = amax <= 3.402823466e38f; // false for +inf (NaN was mapped to +inf)
    ok = finite && amax > 0.f;
    inv = ok ? __fdiv_rn(127.f, amax) : 0.f;
    scale = ok ? __fdiv_rn(amax, 127.f) : (finite ? 0.f : __int_as_float(0x7fc00000));
}

// One warp per row, kThreads / 32 rows per block.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    quantize_warp_rows_kernel(const T *__restrict__ x, int8_t *__restrict__ q, float *__restrict__ scale, int64_t M,
                              int64_t K, int64_t row_stride) {
    const int lane = threadIdx.x % kWarp;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * (kThreads / kWarp) + threadIdx.x / kWarp;
    if (r >= M) {
        return; // whole warps exit together: no block-level barrier below
    }
    const T *row = x + r * row_stride;
    int8_t *qrow = q + r * K;
    const float amax = warp_max(row_amax_partial<T, VEC>(row, K, lane, kWarp));
    float inv, s;
    bool ok;
    row_params(amax, inv, s, ok);
    if (lane == 0) {
        scale[r] = s;
    }
    row_quantize<T, VEC>(row, qrow, K, inv, ok, lane, kWarp);
}

// One block per row (long rows).
template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads)
    quantize_block_rows_kernel(const T *__restrict__ x, int8_t *__restrict__ q, float *__restrict__ scale, int64_t M,
                               int64_t K, int64_t row_stride) {
    __shared__ float partial[kThreads / kWarp];
    const int64_t r = blockIdx.x;
    const T *row = x + r * row_stride;
    int8_t *qrow = q + r * K;
    float m = warp_max(row_amax_partial<T, VEC>(row, K, threadIdx.x, kThreads));
    if (threadIdx.x % kWarp == 0) {
        partial[threadIdx.x / kWarp] = m;
    }
    __syncthreads();
    if (threadIdx.x < kWarp) {
        m = threadIdx.x < kThreads / kWarp ? partial[threadIdx.x] : 0.f;
        m = warp_max(m);
        if (threadIdx.x == 0) {
            partial[0] = m;
        }
    }
    __syncthreads();
    const float amax = partial[0];
    float inv, s;
    bool ok;
    row_params(amax, inv, s, ok);
    if (threadIdx.x == 0) {
        scale[r] = s;
    }
    row_quantize<T, VEC>(row, qrow, K, inv, ok, threadIdx.x, kThreads);
}

template <typename T> void launch_quantize(const at::Tensor &x2, at::Tensor &q2, at::Tensor &s1, cudaStream_t stream) {
    const int64_t M = x2.size(0);
    const int64_t K = x2.size(1);
    const int64_t row_stride = x2.stride(0);
    const T *xp = reinterpret_cast<const T *>(x2.data_ptr());
    int8_t *qp = q2.data_ptr<int8_t>();
    float *sp = s1.data_ptr<float>();
    constexpr int V = Vec<T>::V;
    // 16-byte loads need every row start 16-byte aligned and whole vectors per row; the V-byte q stores then are
    // aligned too (q rows start at r * K bytes, K % V == 0; the allocation itself is 256-byte aligned).
    const bool vec = K % V == 0 && (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(xp) % 16 == 0 && reinterpret_cast<uintptr_t>(qp) % V == 0;
    if (K <= kWarpRowMax) {
        constexpr int rows = kThreads / kWarp;
        const int64_t blocks = (M + rows - 1) / rows;
        TORCH_CHECK_VALUE(blocks <= INT32_MAX, "quantize_per_token: x must have at most ", int64_t{INT32_MAX} * rows,
                          " rows (the product of its leading dimensions) for K = ", K, " (one CUDA block per ", rows,
                          " rows), got ", M);
        with_flag(vec, [&](auto V) {
            quantize_warp_rows_kernel<T, decltype(V)::value>
                <<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(xp, qp, sp, M, K, row_stride);
        });
    } else {
        TORCH_CHECK_VALUE(M <= INT32_MAX, "quantize_per_token: x must have at most ", INT32_MAX,
                          " rows (the product of its leading dimensions) for K = ", K,
                          " (one CUDA block per row), got ", M);
        with_flag(vec, [&](auto V) {
            quantize_block_rows_kernel<T, decltype(V)::value>
                <<<static_cast<unsigned>(M), kThreads, 0, stream>>>(xp, qp, sp, M, K, row_stride);
        });
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> quantize_per_token_cuda(const at::Tensor &x) {
    TORCH_CHECK(x.is_cuda(), "quantize_per_token: x must be a CUDA tensor, got ", x.device());
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
                     "quantize_per_token: x must be float32, bfloat16 or float16, got dtype ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() >= 1,
                      "quantize_per_token: x must have at least 1 dimension [..., K], got a 0-dim tensor");
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t K = x.size(-1);
    std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 1);
    at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
    at::Tensor s = at::empty(lead, x.options().dtype(at::kFloat));
    const int64_t M = s.numel();
    if (M == 0) {
        return {q, s};
    }
    if (K == 0) {
        s.zero_();
        return {q, s};
    }
    at::Tensor x2 = x.reshape({M, K}); // a view whenever the leading dims collapse
    if (x2.stride(1) != 1) {
        x2 = x2.contiguous();
    }
    at::Tensor q2 = q.view({M, K});
    at::Tensor s1 = s.view({M});
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    switch (x.scalar_type()) {
    case at::kFloat:
        launch_quantize<float>(x2, q2, s1, stream);
        break;
    case at::kBFloat16:
        launch_quantize<__nv_bfloat16>(x2, q2, s1, stream);
        break;
    default:
        launch_quantize<__half>(x2, q2, s1, stream);
        break;
    }
    return {q, s};
}

} // namespace
} // namespace fastdl::int8

TORCH_LIBRARY_IMPL(fastdl_cpp, CUDA, m) {
    m.impl("quantize_per_token", &fastdl::int8::quantize_per_token_cuda);
}
