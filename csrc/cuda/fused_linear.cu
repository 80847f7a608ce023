// CUDA implementation of fastdl_cpp::fused_linear and fastdl_cpp::fused_linear_backward (schemas defined in Python).
//
// Forward, three tiers (first that applies wins):
//   1. cuBLASLt GEMM with the whole op in its epilogue, output written once in the compute dtype c:
//        none      : DEFAULT / BIAS, residual as the C matrix with beta = 1 (residual dtype c, or any for fp32)
//        relu      : RELU / RELU_BIAS (no residual); with save_preact: BIAS into preact, then out = relu(preact)
//                    with the epilogue kernel (exact: relu commutes with round-to-nearest)
//        gelu_tanh : GELU / GELU_BIAS / GELU_AUX(_BIAS) (aux = preact), bf16 only, no residual, aux needs N % 8 == 0
//      Bias in dtype c is passed as is; any other bias dtype is passed as fp32 (BIAS_DATA_TYPE = R_32F); if
//      cuBLASLt rejects that, the op falls through to tier 2.
//   2. cuBLASLt GEMM (+ fp32 bias epilogue) into an fp32 [M, N] buffer (for fp32 x: into out/preact), then ONE
//      vectorised epilogue kernel: activation (fp32, on the unrounded pre) + residual + preact store.
//   3. (cuBLASLt found no algorithm) at::mm in dtype c, then the epilogue kernel adds bias, activation, residual.
//   A fp32 weight with bf16/fp16 x is rounded to c first (as autocast does). Split-K reductions are restricted
//   to the fp32 compute type (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE): accumulation stays fp32 and deterministic.
// Backward: ONE kernel reads grad_out and preact, writes dpre_c = round_c(g * act'(p)) and reduces the fp32 dpre
//   column sums deterministically (per-block partial sums in fixed order + a second small pass). Then
//   grad_x = dpre_c @ w_c (at::mm) and grad_weight = dpre_c^T @ x_c (at::mm, or for a fp32 weight with 16-bit x a
//   cuBLASLt GEMM with bf16/fp16 A/B and fp32 D - no 16-bit round trip of grad_weight).
//   The cuBLASLt DGELU_BGRAD / DRELU_BGRAD epilogues are not used: they apply act' to a GEMM *output*, whereas here
//   grad_out is an input, and their bias gradient would be reduced from the rounded dpre, not the fp32 one.
//
// Debug knobs (read per call): FASTDL_FUSED_LINEAR_PATH=unfused (skip tier 1) | aten (skip tiers 1 and 2, and
// the cuBLASLt grad_weight); FASTDL_FUSED_LINEAR_VERBOSE=1 prints the chosen path / cuBLASLt rejections to stderr.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "fused_linear_epilogue.cuh"

namespace fastdl::fused_linear {
namespace {

constexpr int kThreads = 256;
constexpr int kBwdTX = 32; // threads along N (each owns V consecutive columns)
constexpr int kBwdTY = 8;  // threads along M

// ----------------------------------------------------------------------------------------------------------------
// Kernels
// ----------------------------------------------------------------------------------------------------------------

// out[i] = round(act(pre[i] + bias[i % N]) + res[i]); preact[i] = round(pre[i] + bias[i % N]).
// pre / out / preact may alias each other (each element is read before it is written by the same thread).
template <typename Tin, typename Tout, typename Tres, int ACT>
__global__ void __launch_bounds__(kThreads)
    fwd_epilogue_kernel(const Tin *pre, const float *__restrict__ bias, const Tres *__restrict__ res, Tout *out,
                        Tout *preact, int64_t total, int64_t N, bool vec) {
    constexpr int V = 16 / static_cast<int>(sizeof(Tout));
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    int64_t tail = 0;
    if (vec) {
        const int64_t nvec = total / V;
        for (int64_t v = tid; v < nvec; v += stride) {
            const int64_t i0 = v * V;
            float p[V];
            load_vec<Tin, V>(pre + i0, p);
            if (bias != nullptr) {
                int64_t n = i0 % N;
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    p[j] += __ldg(bias + n);
                    if (++n == N)
                        n = 0;
                }
            }
            if (preact != nullptr)
                store_vec<Tout, V>(preact + i0, p);
            float y[V];
#pragma unroll
            for (int j = 0; j < V; ++j)
                y[j] = act_fwd<ACT>(p[j]);
            if (res != nullptr) {
                float r[V];
                load_vec<Tres, V>(res + i0, r);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    y[j] += r[j];
            }
            store_vec<Tout, V>(out + i0, y);
        }
        tail = nvec * V;
    }
    for (int64_t i = tail + tid; i < total; i += stride) {
        float p = to_float(pre[i]);
        if (bias != nullptr)
            p += __ldg(bias + i % N);
        if (preact != nullptr)
            preact[i] = from_float<Tout>(p);
        float y = act_fwd<ACT>(p);
        if (res != nullptr)
            y += to_float(res[i]);
        out[i] = from_float<Tout>(y);
    }
}

// dpre = g * act'(p) in fp32; optionally stores round(dpre) and per-block column sums of the fp32 dpre:
// partial[blockIdx.y * N + n] = sum over the rows this block row visits (fixed order -> deterministic).
// Block (kBwdTX, kBwdTY); thread (tx, ty) owns columns [col0, col0 + V) and rows ty + kBwdTY * (blockIdx.y + k *
// gridDim.y). Requires N % V == 0 and aligned pointers when V > 1.
template <typename Tg, typename T, int ACT, int V>
__global__ void __launch_bounds__(kBwdTX *kBwdTY)
    bwd_dpre_kernel(const Tg *__restrict__ g, const T *__restrict__ p, T *__restrict__ dpre,
                    float *__restrict__ partial, int64_t M, int64_t N) {
    __shared__ float sh[kBwdTY][kBwdTX * V];
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    const int64_t col0 = (static_cast<int64_t>(blockIdx.x) * kBwdTX + tx) * V;
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j)
        acc[j] = 0.f;
    if (col0 < N) {
        const int64_t row_step = static_cast<int64_t>(gridDim.y) * kBwdTY;
        for (int64_t m = static_cast<int64_t>(blockIdx.y) * kBwdTY + ty; m < M; m += row_step) {
            const int64_t off = m * N + col0;
            float d[V];
            load_vec<Tg, V>(g + off, d);
            if constexpr (ACT != static_cast<int>(Act::None)) {
                float pv[V];
                load_vec<T, V>(p + off, pv);
#pragma unroll
                for (int j = 0; j < V; ++j)
                    d[j] *= act_grad<ACT>(pv[j]);
            }
            if (dpre != nullptr)
                store_vec<T, V>(dpre + off, d);
#pragma unroll
            for (int j = 0; j < V; ++j)
                acc[j] += d[j];
        }
    }
    if (partial != nullptr) { // uniform over the block
#pragma unroll
        for (int j = 0; j < V; ++j)
            sh[ty][tx * V + j] = acc[j];
        __syncthreads();
        const int64_t block_col0 = static_cast<int64_t>(blockIdx.x) * kBwdTX * V;
        for (int cidx = ty * kBwdTX + tx; cidx < kBwdTX * V; cidx += kBwdTX * kBwdTY) {
            const int64_t col = block_col0 + cidx;
            if (col < N) {
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < kBwdTY; ++r)
                    s += sh[r][cidx];
                partial[static_cast<int64_t>(blockIdx.y) * N + col] = s;
            }
        }
    }
}

// out[n] = sum_{r < R} partial[r * N + n] in fixed order.
__global__ void __launch_bounds__(kThreads)
    colsum_kernel(const float *__restrict__ partial, int64_t R, int64_t N, float *__restrict__ out) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += stride) {
        float s = 0.f;
        for (int64_t r = 0; r < R; ++r)
            s += partial[r * N + n];
        out[n] = s;
    }
}

// ----------------------------------------------------------------------------------------------------------------
// Host helpers
// ----------------------------------------------------------------------------------------------------------------

bool env_verbose() {
    const char *e = std::getenv("FASTDL_FUSED_LINEAR_VERBOSE");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
}

// 0: auto, 1: skip the fully fused cuBLASLt tier, 2: ATen GEMMs only.
int env_path_mode() {
    const char *e = std::getenv("FASTDL_FUSED_LINEAR_PATH");
    if (e == nullptr)
        return 0;
    if (std::strcmp(e, "unfused") == 0)
        return 1;
    if (std::strcmp(e, "aten") == 0)
        return 2;
    return 0;
}

void log_path(const char *fn, const char *what) {
    if (env_verbose())
        std::fprintf(stderr, "[fastdl fused_linear CUDA] %s: %s\n", fn, what);
}

Act parse_act(c10::string_view s, const char *fn) {
    const std::string a(s.data(), s.size());
    if (a == "none")
        return Act::None;
    if (a == "relu")
        return Act::Relu;
    if (a == "gelu")
        return Act::Gelu;
    if (a == "gelu_tanh")
        return Act::GeluTanh;
    if (a == "silu")
        return Act::Silu;
    TORCH_CHECK(false, fn, ": activation must be one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu', got '", a, "'");
    return Act::None;
}

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

bool is_aligned(const void *p, int bytes) {
    return (reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes)) == 0;
}

uint32_t ptr_alignment(const void *p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    uint32_t al = 1;
    while (al < 256 && (a % (2 * al)) == 0)
        al *= 2;
    return al;
}

int num_sms() {
    return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// Tensor of dtype float / bf16 / fp16 -> storage type tag.
template <typename F> void dispatch_c(at::ScalarType c, F &&f) {
    switch (c) {
    case at::kFloat:
        f(float{});
        break;
    case at::kBFloat16:
        f(bf16_t{});
        break;
    case at::kHalf:
        f(f16_t{});
        break;
    default:
        TORCH_CHECK(false, "fused_linear: unsupported compute dtype ", c);
    }
}

template <typename F> void dispatch_act(Act a, F &&f) {
    switch (a) {
    case Act::None:
        f(std::integral_constant<int, 0>{});
        break;
    case Act::Relu:
        f(std::integral_constant<int, 1>{});
        break;
    case Act::Gelu:
        f(std::integral_constant<int, 2>{});
        break;
    case Act::GeluTanh:
        f(std::integral_constant<int, 3>{});
        break;
    case Act::Silu:
        f(std::integral_constant<int, 4>{});
        break;
    }
}

cudaDataType_t cuda_dtype(at::ScalarType t) {
    switch (t) {
    case at::kFloat:
        return CUDA_R_32F;
    case at::kBFloat16:
        return CUDA_R_16BF;
    case at::kHalf:
        return CUDA_R_16F;
    default:
        TORCH_CHECK(false, "fused_linear: no cuBLASLt type for dtype ", t);
    }
    return CUDA_R_32F;
}

unsigned grid_1d(int64_t work) {
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, kThreads), int64_t{num_sms()} * 8));
    return static_cast<unsigned>(blocks);
}

// Epilogue launch. pre: [M, N] contiguous, dtype float or Tout. res: undefined or [M, N] contiguous float / Tout.
// bias32: undefined or [N] float. out / preact_out: [M, N] contiguous Tout (preact_out may be undefined).
template <typename Tout>
void launch_fwd_epilogue(const at::Tensor &pre, const at::Tensor &bias32, const at::Tensor &res, const at::Tensor &out,
                         const at::Tensor &preact_out, int64_t M, int64_t N, Act act) {
    const int64_t total = M * N;
    if (total == 0)
        return;
    TORCH_INTERNAL_ASSERT(pre.is_contiguous() && out.is_contiguous());
    TORCH_INTERNAL_ASSERT(!res.defined() || res.is_contiguous());
    TORCH_INTERNAL_ASSERT(!preact_out.defined() || preact_out.is_contiguous());
    constexpr int V = 16 / static_cast<int>(sizeof(Tout));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const float *bias_ptr = bias32.defined() ? bias32.data_ptr<float>() : nullptr;

    auto go = [&](auto tin_tag, auto tres_tag) {
        using Tin = decltype(tin_tag);
        using Tres = decltype(tres_tag);
        const Tin *pre_ptr = static_cast<const Tin *>(pre.data_ptr());
        const Tres *res_ptr = res.defined() ? static_cast<const Tres *>(res.data_ptr()) : nullptr;
        Tout *out_ptr = static_cast<Tout *>(out.data_ptr());
        Tout *preact_ptr = preact_out.defined() ? static_cast<Tout *>(preact_out.data_ptr()) : nullptr;
        const bool vec = is_aligned(pre_ptr, vec_align<Tin, V>()) && is_aligned(out_ptr, vec_align<Tout, V>()) &&
                         (res_ptr == nullptr || is_aligned(res_ptr, vec_align<Tres, V>())) &&
                         (preact_ptr == nullptr || is_aligned(preact_ptr, vec_align<Tout, V>()));
        const unsigned grid = grid_1d(vec ? ceil_div(total, V) : total);
        dispatch_act(act, [&](auto act_tag) {
            constexpr int A = decltype(act_tag)::value;
            fwd_epilogue_kernel<Tin, Tout, Tres, A>
                <<<grid, kThreads, 0, stream>>>(pre_ptr, bias_ptr, res_ptr, out_ptr, preact_ptr, total, N, vec);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
    };
    const bool pre_f = pre.scalar_type() == at::kFloat;
    const bool res_f = res.defined() && res.scalar_type() == at::kFloat;
    TORCH_INTERNAL_ASSERT(pre_f || pre.scalar_type() == out.scalar_type());
    TORCH_INTERNAL_ASSERT(!res.defined() || res_f || res.scalar_type() == out.scalar_type());
    if constexpr (std::is_same_v<Tout, float>) {
        go(float{}, float{});
    } else {
        if (pre_f) {
            if (res_f) {
                go(float{}, float{});
            } else {
                go(float{}, Tout{});
            }
        } else {
            if (res_f) {
                go(Tout{}, float{});
            } else {
                go(Tout{}, Tout{});
            }
        }
    }
}

void run_fwd_epilogue(const at::Tensor &pre, const at::Tensor &bias32, const at::Tensor &res, const at::Tensor &out,
                      const at::Tensor &preact_out, int64_t M, int64_t N, Act act) {
    dispatch_c(out.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        launch_fwd_epilogue<T>(pre, bias32, res, out, preact_out, M, N, act);
    });
}

// Backward dpre kernel launch. g: [M, N] contiguous T or float; p: [M, N] contiguous T (unused for none);
// dpre: undefined or [M, N] contiguous T; grad_bias: undefined or [N] float.
template <typename T>
void launch_bwd(const at::Tensor &g, const at::Tensor &p, const at::Tensor &dpre, const at::Tensor &grad_bias,
                int64_t M, int64_t N, Act act) {
    TORCH_INTERNAL_ASSERT(M > 0 && N > 0);
    constexpr int VV = 16 / static_cast<int>(sizeof(T));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const bool g_f = g.scalar_type() == at::kFloat;

    auto go = [&](auto tg_tag) {
        using Tg = decltype(tg_tag);
        const Tg *g_ptr = static_cast<const Tg *>(g.data_ptr());
        const T *p_ptr = p.defined() ? static_cast<const T *>(p.data_ptr()) : nullptr;
        T *d_ptr = dpre.defined() ? static_cast<T *>(dpre.data_ptr()) : nullptr;
        const bool vec = (N % VV == 0) && is_aligned(g_ptr, vec_align<Tg, VV>()) &&
                         (p_ptr == nullptr || is_aligned(p_ptr, vec_align<T, VV>())) &&
                         (d_ptr == nullptr || is_aligned(d_ptr, vec_align<T, VV>()));
        const int V = vec ? VV : 1;
        const int64_t gx = ceil_div(N, int64_t{kBwdTX} * V);
        TORCH_CHECK(gx <= 2147483647LL, "fused_linear_backward: N = ", N, " is too large");
        const int64_t target_blocks = int64_t{num_sms()} * 4;
        int64_t gy = std::max<int64_t>(1, ceil_div(target_blocks, gx));
        gy = std::min<int64_t>(gy, std::max<int64_t>(1, ceil_div(M, int64_t{kBwdTY} * 4))); // >= 4 rows / thread
        gy = std::min<int64_t>(gy, grad_bias.defined() ? 1024 : 65535);
        at::Tensor partial;
        float *partial_ptr = nullptr;
        if (grad_bias.defined()) {
            if (gy == 1) {
                partial_ptr = grad_bias.data_ptr<float>();
            } else {
                partial = at::empty({gy, N}, g.options().dtype(at::kFloat));
                partial_ptr = partial.data_ptr<float>();
            }
        }
        const dim3 block(kBwdTX, kBwdTY);
        const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
        dispatch_act(act, [&](auto act_tag) {
            constexpr int A = decltype(act_tag)::value;
            if (vec) {
                bwd_dpre_kernel<Tg, T, A, VV><<<grid, block, 0, stream>>>(g_ptr, p_ptr, d_ptr, partial_ptr, M, N);
            } else {
                bwd_dpre_kernel<Tg, T, A, 1><<<grid, block, 0, stream>>>(g_ptr, p_ptr, d_ptr, partial_ptr, M, N);
            }
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
        if (partial.defined()) {
            colsum_kernel<<<grid_1d(N), kThreads, 0, stream>>>(partial.data_ptr<float>(), gy, N,
                                                               grad_bias.data_ptr<float>());
            C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
    };
    if constexpr (std::is_same_v<T, float>) {
        go(float{});
    } else {
        if (g_f) {
            go(float{});
        } else {
            go(T{});
        }
    }
}

// ----------------------------------------------------------------------------------------------------------------
// cuBLASLt
// ----------------------------------------------------------------------------------------------------------------

#define FL_LT_CHECK(expr, what)                                                                                        \
    do {                                                                                                               \
        const cublasStatus_t st_ = (expr);                                                                             \
        TORCH_CHECK(st_ == CUBLAS_STATUS_SUCCESS, "fused_linear: cuBLASLt ", what,                                     \
                    " failed: ", cublasLtGetStatusString(st_), " (", static_cast<int>(st_), ")");                      \
    } while (0)

struct LtDescGuard {
    cublasLtMatmulDesc_t d = nullptr;
    ~LtDescGuard() {
        if (d != nullptr)
            cublasLtMatmulDescDestroy(d);
    }
};
struct LtLayoutGuard {
    cublasLtMatrixLayout_t l = nullptr;
    ~LtLayoutGuard() {
        if (l != nullptr)
            cublasLtMatrixLayoutDestroy(l);
    }
};
struct LtPrefGuard {
    cublasLtMatmulPreference_t p = nullptr;
    ~LtPrefGuard() {
        if (p != nullptr)
            cublasLtMatmulPreferenceDestroy(p);
    }
};

template <typename V> void lt_desc_set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const V &v) {
    FL_LT_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v)), "MatmulDescSetAttribute");
}
template <typename V>
void lt_pref_set(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, const V &v) {
    FL_LT_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v)), "MatmulPreferenceSetAttribute");
}

// Column-major D[m, n] = epilogue(op(A)[m, k] @ op(B)[k, n] + beta * C) with fp32 compute and fp32 alpha/beta.
struct LtGemm {
    cublasOperation_t transa = CUBLAS_OP_N;
    cublasOperation_t transb = CUBLAS_OP_N;
    int64_t m = 0, n = 0, k = 0;
    const void *A = nullptr;
    int64_t lda = 0;
    const void *B = nullptr;
    int64_t ldb = 0;
    cudaDataType_t ab_type = CUDA_R_32F;
    const void *C = nullptr; // nullptr: C = D with beta = 0
    float beta = 0.f;
    void *D = nullptr;
    int64_t ldd = 0;
    cudaDataType_t d_type = CUDA_R_32F;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void *bias = nullptr;
    int32_t bias_type = -1; // -1: cuBLASLt default (D's type)
    void *aux = nullptr;
    int64_t aux_ld = 0;
};

using LtKey = std::array<int64_t, 22>;
struct LtCacheEntry {
    bool found = false;
    cublasLtMatmulHeuristicResult_t result;
};
std::mutex &lt_cache_mutex() {
    static std::mutex m;
    return m;
}
std::map<LtKey, LtCacheEntry> &lt_cache() {
    static std::map<LtKey, LtCacheEntry> cache;
    return cache;
}

// Returns false (nothing launched) when cuBLASLt has no algorithm for the problem or rejects the configuration;
// throws on other errors.
bool lt_matmul(const LtGemm &g, const at::Tensor &like, const char *fn) {
    TORCH_INTERNAL_ASSERT(g.m > 0 && g.n > 0 && g.k > 0);
    cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();

    LtDescGuard desc;
    FL_LT_CHECK(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.transa));
    lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.transb));
    lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
    if (g.bias != nullptr) {
        lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
        if (g.bias_type >= 0)
            lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, g.bias_type);
    }
    if (g.aux != nullptr) {
        lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
        lt_desc_set(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
    }

    LtLayoutGuard la, lb, lc, ld;
    const bool ta = g.transa != CUBLAS_OP_N;
    const bool tb = g.transb != CUBLAS_OP_N;
    FL_LT_CHECK(cublasLtMatrixLayoutCreate(&la.l, g.ab_type, static_cast<uint64_t>(ta ? g.k : g.m),
                                           static_cast<uint64_t>(ta ? g.m : g.k), g.lda),
                "MatrixLayoutCreate(A)");
    FL_LT_CHECK(cublasLtMatrixLayoutCreate(&lb.l, g.ab_type, static_cast<uint64_t>(tb ? g.n : g.k),
                                           static_cast<uint64_t>(tb ? g.k : g.n), g.ldb),
                "MatrixLayoutCreate(B)");
    FL_LT_CHECK(
        cublasLtMatrixLayoutCreate(&ld.l, g.d_type, static_cast<uint64_t>(g.m), static_cast<uint64_t>(g.n), g.ldd),
        "MatrixLayoutCreate(D)");
    const void *c_ptr = g.C != nullptr ? g.C : g.D;
    cublasLtMatrixLayout_t c_layout = ld.l;
    if (g.C != nullptr) {
        FL_LT_CHECK(
            cublasLtMatrixLayoutCreate(&lc.l, g.d_type, static_cast<uint64_t>(g.m), static_cast<uint64_t>(g.n), g.ldd),
            "MatrixLayoutCreate(C)");
        c_layout = lc.l;
    }

    const int major = at::cuda::getCurrentDeviceProperties()->major;
    const uint64_t max_ws = major >= 9 ? (uint64_t{32} << 20) : (uint64_t{4} << 20);
    // Heuristic results are cached per problem (shape, types, epilogue, pointer alignments, device): the query
    // costs tens of microseconds of CPU time per call otherwise. Misses (no algorithm) are cached too.
    const LtKey key = {static_cast<int64_t>(at::cuda::current_device()),
                       static_cast<int64_t>(g.transa),
                       static_cast<int64_t>(g.transb),
                       g.m,
                       g.n,
                       g.k,
                       g.lda,
                       g.ldb,
                       g.ldd,
                       static_cast<int64_t>(g.ab_type),
                       static_cast<int64_t>(g.d_type),
                       g.C != nullptr ? 1 : 0,
                       static_cast<int64_t>(g.epilogue),
                       g.bias != nullptr ? static_cast<int64_t>(ptr_alignment(g.bias)) : 0,
                       static_cast<int64_t>(g.bias_type),
                       g.aux != nullptr ? static_cast<int64_t>(ptr_alignment(g.aux)) : 0,
                       g.aux_ld,
                       static_cast<int64_t>(ptr_alignment(g.A)),
                       static_cast<int64_t>(ptr_alignment(g.B)),
                       static_cast<int64_t>(ptr_alignment(c_ptr)),
                       static_cast<int64_t>(ptr_alignment(g.D)),
                       static_cast<int64_t>(max_ws)};
    cublasLtMatmulHeuristicResult_t heur;
    std::memset(&heur, 0, sizeof(heur));
    bool found = false;
    bool cached = false;
    {
        std::lock_guard<std::mutex> lock(lt_cache_mutex());
        auto &cache = lt_cache();
        auto it = cache.find(key);
        if (it != cache.end()) {
            cached = true;
            found = it->second.found;
            heur = it->second.result;
        }
    }
    if (!cached) {
        LtPrefGuard pref;
        FL_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref.p), "MatmulPreferenceCreate");
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws);
        // Only non-split-K algorithms or split-K reduced in the fp32 compute type (fixed order, fp32 accumulation).
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ptr_alignment(g.A));
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ptr_alignment(g.B));
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ptr_alignment(c_ptr));
        lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ptr_alignment(g.D));

        int n_results = 0;
        const cublasStatus_t hst =
            cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, c_layout, ld.l, pref.p, 1, &heur, &n_results);
        found = hst == CUBLAS_STATUS_SUCCESS && n_results > 0;
        if (!found && env_verbose()) {
            std::fprintf(stderr,
                         "[fastdl fused_linear CUDA] %s: cuBLASLt heuristic found no algorithm (%s; m=%lld n=%lld "
                         "k=%lld epilogue=%u)\n",
                         fn, cublasLtGetStatusString(hst), static_cast<long long>(g.m), static_cast<long long>(g.n),
                         static_cast<long long>(g.k), static_cast<unsigned>(g.epilogue));
        }
        if (hst == CUBLAS_STATUS_SUCCESS || hst == CUBLAS_STATUS_NOT_SUPPORTED) { // definite answers only
            std::lock_guard<std::mutex> lock(lt_cache_mutex());
            auto &cache = lt_cache();
            if (cache.size() >= 4096)
                cache.clear();
            cache[key] = LtCacheEntry{found, heur};
        }
    }
    if (!found)
        return false;

    // Workspace from the caching allocator (stream-ordered, CUDA-graph safe), only as large as the algorithm needs.
    at::Tensor workspace;
    void *ws_ptr = nullptr;
    if (heur.workspaceSize > 0) {
        workspace = at::empty({static_cast<int64_t>(heur.workspaceSize)}, like.options().dtype(at::kByte));
        ws_ptr = workspace.data_ptr();
    }
    const float alpha = 1.f;
    const float beta = g.C != nullptr ? g.beta : 0.f;
    const cublasStatus_t st = cublasLtMatmul(handle, desc.d, &alpha, g.A, la.l, g.B, lb.l, &beta, c_ptr, c_layout, g.D,
                                             ld.l, &heur.algo, ws_ptr, heur.workspaceSize, stream);
    if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
        { // remember the rejection: later calls with this problem go straight to the fallback
            std::lock_guard<std::mutex> lock(lt_cache_mutex());
            lt_cache()[key] = LtCacheEntry{false, heur};
        }
        if (env_verbose()) {
            std::fprintf(stderr, "[fastdl fused_linear CUDA] %s: cublasLtMatmul rejected the configuration (%s)\n", fn,
                         cublasLtGetStatusString(st));
        }
        return false;
    }
    FL_LT_CHECK(st, "Matmul");
    return true;
}

// Row-major out[M, N] = x[M, K] @ w[N, K]^T  <=>  column-major out^T[N, M] = w^T (op T on stored K x N) @ x^T.
LtGemm forward_gemm(const at::Tensor &x2d, const at::Tensor &w_c, void *D, cudaDataType_t d_type, int64_t M, int64_t N,
                    int64_t K) {
    LtGemm g;
    g.transa = CUBLAS_OP_T;
    g.transb = CUBLAS_OP_N;
    g.m = N;
    g.n = M;
    g.k = K;
    g.A = w_c.data_ptr();
    g.lda = K;
    g.B = x2d.data_ptr();
    g.ldb = K;
    g.ab_type = cuda_dtype(x2d.scalar_type());
    g.D = D;
    g.ldd = N;
    g.d_type = d_type;
    return g;
}

at::Tensor aligned16(at::Tensor t) {
    if (!is_aligned(t.data_ptr(), 16))
        t = t.clone();
    return t;
}

std::vector<int64_t> out_shape(const at::Tensor &x, int64_t N) {
    std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
    s.back() = N;
    return s;
}

int64_t leading_rows(const at::Tensor &x) {
    int64_t M = 1;
    for (int64_t d = 0; d + 1 < x.dim(); ++d)
        M *= x.size(d);
    return M;
}

void check_x_weight(const char *fn, const at::Tensor &x, const at::Tensor &weight) {
    TORCH_CHECK(x.defined(), fn, ": x must be a defined tensor");
    TORCH_CHECK(x.is_cuda(), fn, ": x must be a CUDA tensor, got device ", x.device());
    const auto c = x.scalar_type();
    TORCH_CHECK(c == at::kFloat || c == at::kBFloat16 || c == at::kHalf, fn,
                ": x.dtype must be float32, bfloat16 or float16, got ", c);
    TORCH_CHECK(x.dim() >= 1, fn, ": x must have shape [..., K] (at least 1 dimension), got a 0-d tensor");
    TORCH_CHECK(weight.defined(), fn, ": weight must be a defined tensor");
    TORCH_CHECK(weight.device() == x.device(), fn, ": weight must be on x's device ", x.device(), ", got ",
                weight.device());
    TORCH_CHECK(weight.dim() == 2, fn, ": weight must have shape [N, K] (2-D), got ", weight.dim(), "-D");
    TORCH_CHECK(weight.scalar_type() == c || weight.scalar_type() == at::kFloat, fn, ": weight.dtype must be ", c,
                " (x.dtype) or float32, got ", weight.scalar_type());
    TORCH_CHECK(weight.size(1) == x.size(-1), fn, ": weight.shape[1] must equal x.shape[-1] = ", x.size(-1),
                " (K), got ", weight.size(1));
}

// ----------------------------------------------------------------------------------------------------------------
// Forward
// ----------------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> fused_linear_cuda(const at::Tensor &x, const at::Tensor &weight,
                                                     const std::optional<at::Tensor> &bias, c10::string_view activation,
                                                     const std::optional<at::Tensor> &residual, bool save_preact) {
    constexpr const char *fn = "fused_linear";
    const Act act = parse_act(activation, fn);
    check_x_weight(fn, x, weight);
    const at::ScalarType c = x.scalar_type();
    const int64_t K = x.size(-1);
    const int64_t N = weight.size(0);
    const int64_t M = leading_rows(x);
    const std::vector<int64_t> oshape = out_shape(x, N);

    const bool has_bias = bias.has_value() && bias->defined();
    if (has_bias) {
        TORCH_CHECK(bias->device() == x.device(), fn, ": bias must be on x's device ", x.device(), ", got ",
                    bias->device());
        TORCH_CHECK(at::isFloatingType(bias->scalar_type()), fn, ": bias.dtype must be a floating point type, got ",
                    bias->scalar_type());
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, fn, ": bias must have shape [", N,
                    "] (N = weight.shape[0]), got ", bias->sizes());
    }
    const bool has_res = residual.has_value() && residual->defined();
    if (has_res) {
        TORCH_CHECK(residual->device() == x.device(), fn, ": residual must be on x's device ", x.device(), ", got ",
                    residual->device());
        TORCH_CHECK(at::isFloatingType(residual->scalar_type()), fn,
                    ": residual.dtype must be a floating point type, got ", residual->scalar_type());
        TORCH_CHECK(residual->sizes() == at::IntArrayRef(oshape), fn, ": residual must have the output shape ",
                    at::IntArrayRef(oshape), ", got ", residual->sizes());
    }

    c10::cuda::CUDAGuard device_guard(x.device());
    const auto opts = x.options().dtype(c);
    const bool want_pre = save_preact && act != Act::None;
    at::Tensor out = at::empty(oshape, opts);
    at::Tensor preact = want_pre ? at::empty(oshape, opts) : at::empty({0}, opts);
    if (M == 0 || N == 0)
        return {out, preact};

    at::Tensor out2d = out.view({M, N});
    at::Tensor pre2d = want_pre ? preact.view({M, N}) : at::Tensor();
    at::Tensor bias32;
    if (has_bias)
        bias32 = aligned16(bias->to(at::kFloat).contiguous());
    at::Tensor res2d;
    if (has_res) {
        at::Tensor r = residual->reshape({M, N});
        if (r.scalar_type() != c && r.scalar_type() != at::kFloat)
            r = r.to(at::kFloat);
        res2d = r.contiguous();
    }

    if (K == 0) { // acc = 0
        log_path(fn, "K == 0: epilogue on zeros");
        at::Tensor zeros = at::zeros({M, N}, opts.dtype(at::kFloat));
        run_fwd_epilogue(zeros, bias32, res2d, out2d, pre2d, M, N, act);
        return {out, preact};
    }

    const at::Tensor x2d = x.reshape({M, K}).contiguous();
    const at::Tensor w_c = weight.to(c).contiguous();
    const int mode = env_path_mode();
    const cudaDataType_t c_type = cuda_dtype(c);

    // ---- tier 1: everything in the cuBLASLt epilogue ----
    if (mode == 0) {
        bool applicable = true;
        bool relu_after = false;
        LtGemm g = forward_gemm(x2d, w_c, out2d.data_ptr(), c_type, M, N, K);
        switch (act) {
        case Act::None:
            if (has_res) {
                if (res2d.scalar_type() == c) {
                    g.C = res2d.data_ptr();
                    g.beta = 1.f;
                } else {
                    applicable = false;
                }
            }
            g.epilogue = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
            break;
        case Act::Relu:
            if (has_res) {
                applicable = false;
            } else if (want_pre) {
                g.D = pre2d.data_ptr();
                g.epilogue = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
                relu_after = true;
            } else {
                g.epilogue = has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
            }
            break;
        case Act::GeluTanh:
            // cuBLASLt's GELU may use a fast tanh; only trusted within bf16 rounding.
            if (c != at::kBFloat16 || has_res || (want_pre && N % 8 != 0)) {
                applicable = false;
            } else if (want_pre) {
                g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
                g.aux = pre2d.data_ptr();
                g.aux_ld = N;
            } else {
                g.epilogue = has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
            }
            break;
        default:
            applicable = false;
            break;
        }
        at::Tensor bias_lt;
        if (applicable && has_bias) {
            if (bias->scalar_type() == c) {
                bias_lt = aligned16(bias->contiguous());
            } else {
                bias_lt = bias32;
                if (c != at::kFloat)
                    g.bias_type = static_cast<int32_t>(CUDA_R_32F);
            }
            g.bias = bias_lt.data_ptr();
        }
        if (applicable && lt_matmul(g, x, fn)) {
            if (relu_after) {
                log_path(fn, "tier 1: cuBLASLt bias epilogue into preact + relu kernel");
                run_fwd_epilogue(pre2d, at::Tensor(), at::Tensor(), out2d, at::Tensor(), M, N, Act::Relu);
            } else {
                log_path(fn, "tier 1: cuBLASLt fused epilogue");
            }
            return {out, preact};
        }
    }

    // ---- tier 2: cuBLASLt GEMM (+ fp32 bias) into fp32, then the epilogue kernel ----
    if (mode <= 1) {
        at::Tensor acc32;
        at::Tensor preact_store = pre2d;
        if (c == at::kFloat) {
            acc32 = want_pre ? pre2d : out2d; // epilogue runs in place
            if (want_pre)
                preact_store = at::Tensor();
        } else {
            acc32 = at::empty({M, N}, opts.dtype(at::kFloat));
        }
        LtGemm g = forward_gemm(x2d, w_c, acc32.data_ptr(), CUDA_R_32F, M, N, K);
        if (has_bias) {
            g.epilogue = CUBLASLT_EPILOGUE_BIAS;
            g.bias = bias32.data_ptr();
        }
        if (lt_matmul(g, x, fn)) {
            log_path(fn, "tier 2: cuBLASLt fp32 GEMM + epilogue kernel");
            const bool noop = c == at::kFloat && act == Act::None && !has_res; // acc32 is out already
            if (!noop)
                run_fwd_epilogue(acc32, at::Tensor(), res2d, out2d, preact_store, M, N, act);
            return {out, preact};
        }
    }

    // ---- tier 3: ATen GEMM in dtype c, then the epilogue kernel (bias added there) ----
    log_path(fn, "tier 3: at::mm + epilogue kernel");
    at::Tensor target = want_pre ? pre2d : out2d;
    at::mm_out(target, x2d, w_c.t());
    run_fwd_epilogue(target, bias32, res2d, out2d, pre2d, M, N, act);
    return {out, preact};
}

// ----------------------------------------------------------------------------------------------------------------
// Backward
// ----------------------------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor>
fused_linear_backward_cuda(const at::Tensor &grad_out, const at::Tensor &x, const at::Tensor &weight,
                           const at::Tensor &preact, c10::string_view activation, std::array<bool, 3> output_mask) {
    constexpr const char *fn = "fused_linear_backward";
    const Act act = parse_act(activation, fn);
    check_x_weight(fn, x, weight);
    const at::ScalarType c = x.scalar_type();
    const int64_t K = x.size(-1);
    const int64_t N = weight.size(0);
    const int64_t M = leading_rows(x);
    const std::vector<int64_t> oshape = out_shape(x, N);
    const bool need_gx = output_mask[0];
    const bool need_gw = output_mask[1];
    const bool need_gb = output_mask[2];

    TORCH_CHECK(grad_out.defined(), fn, ": grad_out must be a defined tensor");
    TORCH_CHECK(grad_out.device() == x.device(), fn, ": grad_out must be on x's device ", x.device(), ", got ",
                grad_out.device());
    TORCH_CHECK(at::isFloatingType(grad_out.scalar_type()), fn, ": grad_out.dtype must be a floating point type, got ",
                grad_out.scalar_type());
    TORCH_CHECK(grad_out.sizes() == at::IntArrayRef(oshape), fn, ": grad_out must have the output shape ",
                at::IntArrayRef(oshape), ", got ", grad_out.sizes());
    const bool any = need_gx || need_gw || need_gb;
    if (act != Act::None && any) {
        TORCH_CHECK(preact.defined(), fn, ": preact must be a defined tensor for activation '",
                    std::string(activation.data(), activation.size()), "'");
        TORCH_CHECK(preact.device() == x.device(), fn, ": preact must be on x's device ", x.device(), ", got ",
                    preact.device());
        TORCH_CHECK(at::isFloatingType(preact.scalar_type()), fn, ": preact.dtype must be a floating point type, got ",
                    preact.scalar_type());
        TORCH_CHECK(preact.sizes() == at::IntArrayRef(oshape), fn, ": preact must have the output shape ",
                    at::IntArrayRef(oshape), " (save_preact=True in the forward), got ", preact.sizes());
    }

    c10::cuda::CUDAGuard device_guard(x.device());
    const auto opts_c = x.options().dtype(c);
    at::Tensor grad_x = at::empty({0}, opts_c);
    at::Tensor grad_w = at::empty({0}, opts_c.dtype(weight.scalar_type()));
    at::Tensor grad_b = at::empty({0}, opts_c.dtype(at::kFloat));
    if (!any)
        return {grad_x, grad_w, grad_b};

    const bool need_dpre = need_gx || need_gw;
    at::Tensor dpre_c;
    if (need_gb)
        grad_b = at::empty({N}, opts_c.dtype(at::kFloat));
    if (M > 0 && N > 0) {
        at::Tensor g2d = grad_out.reshape({M, N});
        if (g2d.scalar_type() != c && g2d.scalar_type() != at::kFloat)
            g2d = g2d.to(at::kFloat);
        g2d = g2d.contiguous();
        at::Tensor p2d;
        if (act != Act::None)
            p2d = preact.reshape({M, N}).to(c).contiguous();
        const bool dpre_is_g = act == Act::None && g2d.scalar_type() == c;
        at::Tensor dpre_out;
        if (need_dpre) {
            if (dpre_is_g) {
                dpre_c = g2d;
            } else {
                dpre_out = at::empty({M, N}, opts_c);
                dpre_c = dpre_out;
            }
        }
        if (dpre_out.defined() || need_gb) {
            const at::Tensor gb = need_gb ? grad_b : at::Tensor();
            dispatch_c(c, [&](auto tag) {
                using T = decltype(tag);
                launch_bwd<T>(g2d, p2d, dpre_out, gb, M, N, act);
            });
        }
    } else {
        if (need_gb)
            grad_b.zero_();
        if (need_dpre)
            dpre_c = at::zeros({M, N}, opts_c);
    }

    if (need_gx) {
        const at::Tensor w_c = weight.to(c).contiguous();
        grad_x = at::mm(dpre_c, w_c).view(x.sizes());
    }
    if (need_gw) {
        const at::Tensor x2d = x.reshape({M, K}).contiguous();
        if (weight.scalar_type() == c) {
            grad_w = at::mm(dpre_c.t(), x2d);
        } else {
            // fp32 master weight, 16-bit activations: fp32 output straight from the GEMM.
            grad_w = at::empty({N, K}, opts_c.dtype(at::kFloat));
            if (N > 0 && K > 0) {
                bool done = false;
                if (M == 0) {
                    grad_w.zero_();
                    done = true;
                } else if (env_path_mode() < 2) {
                    // Row-major gw[N, K] = dpre^T @ x  <=>  column-major gw^T[K, N] = x^T[K, M] @ dpre[M, N]
                    // (dpre stored column-major as N x M -> op T).
                    LtGemm g;
                    g.transa = CUBLAS_OP_N;
                    g.transb = CUBLAS_OP_T;
                    g.m = K;
                    g.n = N;
                    g.k = M;
                    g.A = x2d.data_ptr();
                    g.lda = K;
                    g.B = dpre_c.data_ptr();
                    g.ldb = N;
                    g.ab_type = cuda_dtype(c);
                    g.D = grad_w.data_ptr();
                    g.ldd = K;
                    g.d_type = CUDA_R_32F;
                    done = lt_matmul(g, x, fn);
                    if (done)
                        log_path(fn, "grad_weight: cuBLASLt 16-bit x 16-bit -> fp32");
                }
                if (!done) {
                    // Exact fallback: 16-bit values are exact in fp32 (and in TF32), products accumulate in fp32.
                    log_path(fn, "grad_weight: at::mm in fp32");
                    at::mm_out(grad_w, dpre_c.t().to(at::kFloat), x2d.to(at::kFloat));
                }
            }
        }
    }
    return {grad_x, grad_w, grad_b};
}

} // namespace
} // namespace fastdl::fused_linear

TORCH_LIBRARY_IMPL(fastdl_cpp, CUDA, m) {
    m.impl("fused_linear", &fastdl::fused_linear::fused_linear_cuda);
    m.impl("fused_linear_backward", &fastdl::fused_linear::fused_linear_backward_cuda);
}
