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

#include "../static_dispatch.h"
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
    Act act = Act::None;
    TORCH_CHECK_VALUE(activation_from_name(std::string_view(s.data(), s.size()), &act), fn,
                      ": activation must be one of ", kActivationList, ", got '", std::string(s.data(), s.size()), "'");
    return act;
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
        TORCH_CHECK_TYPE(false, "fused_linear: the CUDA kernel computes in float32, bfloat16 or float16, got dtype ",
                         c);
    }
}

// f(std::integral_constant<int, a>()) for the activation a (its enumerator's value: None 0 .. Silu 4).
template <typename F> void dispatch_act(Act a, F &&f) {
    with_count<static_cast<int>(Act::None), static_cast<int>(Act::Silu)>(static_cast<int>(a), f);
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
        TORCH_CHECK_TYPE(false, "fused_linear: cuBLASLt takes float32, bfloat16 or float16, got dtype ", t);
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
        TORCH_CHECK_VALUE(gx <= 2147483647LL, "fused_linear_backward: N = weight.shape[0] must be at most ",
                          2147483647LL * kBwdTX * V, " (the CUDA grid's x dimension), got ", N);
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

// The cuBLASLt objects of one GEMM: the matmul description and the layouts of A, B, C (C = D unless g.C is set), D.
struct LtProblem {
    LtDescGuard desc;
    LtLayoutGuard la, lb, lc, ld;
    const void *c_ptr = nullptr;
    cublasLtMatrixLayout_t c_layout = nullptr;
};

void lt_describe(const LtGemm &g, LtProblem &p) {
    FL_LT_CHECK(cublasLtMatmulDescCreate(&p.desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(g.transa));
    lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(g.transb));
    lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(g.epilogue));
    if (g.bias != nullptr) {
        lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
        if (g.bias_type >= 0)
            lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, g.bias_type);
    }
    if (g.aux != nullptr) {
        lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
        lt_desc_set(p.desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.aux_ld);
    }
    const bool ta = g.transa != CUBLAS_OP_N;
    const bool tb = g.transb != CUBLAS_OP_N;
    FL_LT_CHECK(cublasLtMatrixLayoutCreate(&p.la.l, g.ab_type, static_cast<uint64_t>(ta ? g.k : g.m),
                                           static_cast<uint64_t>(ta ? g.m : g.k), g.lda),
                "MatrixLayoutCreate(A)");
    FL_LT_CHECK(cublasLtMatrixLayoutCreate(&p.lb.l, g.ab_type, static_cast<uint64_t>(tb ? g.n : g.k),
                                           static_cast<uint64_t>(tb ? g.k : g.n), g.ldb),
                "MatrixLayoutCreate(B)");
    FL_LT_CHECK(
        cublasLtMatrixLayoutCreate(&p.ld.l, g.d_type, static_cast<uint64_t>(g.m), static_cast<uint64_t>(g.n), g.ldd),
        "MatrixLayoutCreate(D)");
    p.c_ptr = g.C != nullptr ? g.C : g.D;
    p.c_layout = p.ld.l;
    if (g.C != nullptr) {
        FL_LT_CHECK(cublasLtMatrixLayoutCreate(&p.lc.l, g.d_type, static_cast<uint64_t>(g.m),
                                               static_cast<uint64_t>(g.n), g.ldd),
                    "MatrixLayoutCreate(C)");
        p.c_layout = p.lc.l;
    }
}

// The heuristic cache key of a problem: device, shape, types, epilogue, pointer alignments, workspace cap.
LtKey lt_key(const LtGemm &g, const void *c_ptr, uint64_t max_ws) {
    return {static_cast<int64_t>(at::cuda::current_device()),
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
}

// The algorithm for a problem, cached per key (the heuristic query costs tens of microseconds of CPU time per call
// otherwise; misses are cached too). False: cuBLASLt has none.
bool lt_algo(cublasLtHandle_t handle, const LtGemm &g, const LtProblem &p, const LtKey &key, uint64_t max_ws,
             const char *fn, cublasLtMatmulHeuristicResult_t *heur) {
    {
        std::lock_guard<std::mutex> lock(lt_cache_mutex());
        auto &cache = lt_cache();
        auto it = cache.find(key);
        if (it != cache.end()) {
            *heur = it->second.result;
            return it->second.found;
        }
    }
    LtPrefGuard pref;
    FL_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref.p), "MatmulPreferenceCreate");
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws);
    // Only non-split-K algorithms or split-K reduced in the fp32 compute type (fixed order, fp32 accumulation).
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ptr_alignment(g.A));
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ptr_alignment(g.B));
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ptr_alignment(p.c_ptr));
    lt_pref_set(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ptr_alignment(g.D));

    int n_results = 0;
    const cublasStatus_t hst = cublasLtMatmulAlgoGetHeuristic(handle, p.desc.d, p.la.l, p.lb.l, p.c_layout, p.ld.l,
                                                              pref.p, 1, heur, &n_results);
    const bool found = hst == CUBLAS_STATUS_SUCCESS && n_results > 0;
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
        cache[key] = LtCacheEntry{found, *heur};
    }
    return found;
}

// Returns false (nothing launched) when cuBLASLt has no algorithm for the problem or rejects the configuration;
// throws on other errors.
bool lt_matmul(const LtGemm &g, const at::Tensor &like, const char *fn) {
    TORCH_INTERNAL_ASSERT(g.m > 0 && g.n > 0 && g.k > 0);
    cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    LtProblem p;
    lt_describe(g, p);
    const int major = at::cuda::getCurrentDeviceProperties()->major;
    const uint64_t max_ws = major >= 9 ? (uint64_t{32} << 20) : (uint64_t{4} << 20);
    const LtKey key = lt_key(g, p.c_ptr, max_ws);
    cublasLtMatmulHeuristicResult_t heur;
    std::memset(&heur, 0, sizeof(heur));
    if (!lt_algo(handle, g, p, key, max_ws, fn, &heur))
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
    const cublasStatus_t st = cublasLtMatmul(handle, p.desc.d, &alpha, g.A, p.la.l, g.B, p.lb.l, &beta, p.c_ptr,
                                             p.c_layout, g.D, p.ld.l, &heur.algo, ws_ptr, heur.workspaceSize, stream);
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

// Column-major D[m, n] (ldd) = op(A)[m, k] (lda) @ op(B)[k, n] (ldb), no epilogue yet.
LtGemm lt_gemm(cublasOperation_t transa, cublasOperation_t transb, int64_t m, int64_t n, int64_t k, const void *A,
               int64_t lda, const void *B, int64_t ldb, cudaDataType_t ab_type, void *D, int64_t ldd,
               cudaDataType_t d_type) {
    return LtGemm{.transa = transa,
                  .transb = transb,
                  .m = m,
                  .n = n,
                  .k = k,
                  .A = A,
                  .lda = lda,
                  .B = B,
                  .ldb = ldb,
                  .ab_type = ab_type,
                  .D = D,
                  .ldd = ldd,
                  .d_type = d_type};
}

// Row-major out[M, N] = x[M, K] @ w[N, K]^T  <=>  column-major out^T[N, M] = w^T (op T on stored K x N) @ x^T.
LtGemm forward_gemm(const at::Tensor &x2d, const at::Tensor &w_c, void *D, cudaDataType_t d_type, int64_t M, int64_t N,
                    int64_t K) {
    return lt_gemm(CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, w_c.data_ptr(), K, x2d.data_ptr(), K,
                   cuda_dtype(x2d.scalar_type()), D, N, d_type);
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

// ----------------------------------------------------------------------------------------------------------------
// Argument checks: one exception type per kind of mistake, the messages of the Python checks
// (fastdl/ops/fused_linear.py; the op router re-runs those when a kernel raises): TORCH_CHECK_TYPE for a dtype,
// TORCH_CHECK_VALUE for a shape or value, TORCH_CHECK for a device.
// ----------------------------------------------------------------------------------------------------------------

void check_x_weight(const char *fn, const at::Tensor &x, const at::Tensor &weight) {
    TORCH_CHECK_VALUE(x.defined() && weight.defined(), fn, ": x and weight must be defined tensors");
    TORCH_CHECK(x.is_cuda(), fn, ": x must be a CUDA tensor, got device ", x.device());
    TORCH_CHECK_VALUE(x.dim() >= 1, fn, ": x must have at least one dimension [..., K], got a 0-d tensor");
    const auto c = x.scalar_type();
    TORCH_CHECK_TYPE(c == at::kFloat || c == at::kBFloat16 || c == at::kHalf, fn,
                     ": x must be a floating tensor (float32, bfloat16, float16), got dtype ", c);
    TORCH_CHECK_VALUE(weight.dim() == 2, fn, ": weight must be 2-D [N, K], got shape ", weight.sizes());
    TORCH_CHECK_VALUE(weight.size(1) == x.size(-1), fn,
                      ": weight must have shape [N, K] with K = x.shape[-1] = ", x.size(-1), ", got weight of shape ",
                      weight.sizes(), " (mismatched K)");
    TORCH_CHECK_TYPE(weight.scalar_type() == c || weight.scalar_type() == at::kFloat, fn, ": weight.dtype must be ",
                     "x.dtype (", c, ") or float32, got ", weight.scalar_type());
    TORCH_CHECK(weight.device() == x.device(), fn, ": weight must be on device ", x.device(),
                " (the device of x), got ", weight.device());
}

// bias / residual / grad_out / preact: a floating tensor of the given shape on x's device.
void check_optional(const char *fn, const char *name, const at::Tensor &t, at::IntArrayRef shape, const at::Tensor &x) {
    TORCH_CHECK_TYPE(at::isFloatingType(t.scalar_type()), fn, ": ", name, " must be a floating tensor, got dtype ",
                     t.scalar_type());
    TORCH_CHECK(t.device() == x.device(), fn, ": ", name, " must be on device ", x.device(), " (the device of x), got ",
                t.device());
    TORCH_CHECK_VALUE(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

// ----------------------------------------------------------------------------------------------------------------
// Forward: the tiers of the header comment, each a step of its own; the first that applies wins. The choice is by
// what cuBLASLt can fuse (choose_lt_epilogue) and by what it accepts at run time (lt_matmul returns false), not by
// a measured crossover: every tier computes the same rounding of the same fp32 accumulator.
// ----------------------------------------------------------------------------------------------------------------

// One forward call, flattened to 2-D: what every tier reads and writes.
struct FwdCall {
    const char *fn;
    Act act;
    at::ScalarType c;
    int64_t M, N, K;
    const std::optional<at::Tensor> *bias; // as given (tier 1 passes a bias in dtype c as is)
    bool has_bias, has_res, want_pre;
    at::Tensor x2d, w_c; // [M, K], [N, K] in dtype c, contiguous
    at::Tensor bias32;   // [N] fp32, 16-byte aligned (or undefined)
    at::Tensor res2d;    // [M, N] contiguous, dtype c or fp32 (or undefined)
    at::Tensor out2d;    // [M, N] dtype c
    at::Tensor pre2d;    // [M, N] dtype c when want_pre (or undefined)
};

// Tier 1 rule: the cuBLASLt epilogue computing the whole op for this call, set on g; false when there is none
// (silu and erf gelu have none; the GELU epilogue may use a fast tanh, trusted only within bf16 rounding; a residual
// can only ride as the C matrix when nothing follows the bias). *relu_after: the epilogue stops at the bias (into
// preact) and the epilogue kernel applies relu.
bool choose_lt_epilogue(const FwdCall &f, LtGemm &g, bool *relu_after) {
    *relu_after = false;
    switch (f.act) {
    case Act::None:
        if (f.has_res) {
            if (f.res2d.scalar_type() != f.c)
                return false;
            g.C = f.res2d.data_ptr();
            g.beta = 1.f;
        }
        g.epilogue = f.has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
        return true;
    case Act::Relu:
        if (f.has_res)
            return false;
        if (f.want_pre) {
            g.D = f.pre2d.data_ptr();
            g.epilogue = f.has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
            *relu_after = true;
        } else {
            g.epilogue = f.has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
        }
        return true;
    case Act::GeluTanh:
        if (f.c != at::kBFloat16 || f.has_res || (f.want_pre && f.N % 8 != 0))
            return false;
        if (f.want_pre) {
            g.epilogue = f.has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
            g.aux = f.pre2d.data_ptr();
            g.aux_ld = f.N;
        } else {
            g.epilogue = f.has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
        }
        return true;
    default:
        return false;
    }
}

// Tier 1: everything in the cuBLASLt epilogue. False: nothing ran.
bool fwd_lt_fused(const FwdCall &f) {
    LtGemm g = forward_gemm(f.x2d, f.w_c, f.out2d.data_ptr(), cuda_dtype(f.c), f.M, f.N, f.K);
    bool relu_after = false;
    if (!choose_lt_epilogue(f, g, &relu_after))
        return false;
    at::Tensor bias_lt;
    if (f.has_bias) {
        const at::Tensor &b = **f.bias;
        if (b.scalar_type() == f.c) {
            bias_lt = aligned16(b.contiguous());
        } else {
            bias_lt = f.bias32;
            if (f.c != at::kFloat)
                g.bias_type = static_cast<int32_t>(CUDA_R_32F);
        }
        g.bias = bias_lt.data_ptr();
    }
    if (!lt_matmul(g, f.x2d, f.fn))
        return false;
    if (relu_after) {
        log_path(f.fn, "tier 1: cuBLASLt bias epilogue into preact + relu kernel");
        run_fwd_epilogue(f.pre2d, at::Tensor(), at::Tensor(), f.out2d, at::Tensor(), f.M, f.N, Act::Relu);
    } else {
        log_path(f.fn, "tier 1: cuBLASLt fused epilogue");
    }
    return true;
}

// Tier 2: cuBLASLt GEMM (+ fp32 bias) into fp32, then the epilogue kernel. False: nothing ran.
bool fwd_lt_then_epilogue(const FwdCall &f) {
    at::Tensor acc32;
    at::Tensor preact_store = f.pre2d;
    if (f.c == at::kFloat) {
        acc32 = f.want_pre ? f.pre2d : f.out2d; // epilogue runs in place
        if (f.want_pre)
            preact_store = at::Tensor();
    } else {
        acc32 = at::empty({f.M, f.N}, f.out2d.options().dtype(at::kFloat));
    }
    LtGemm g = forward_gemm(f.x2d, f.w_c, acc32.data_ptr(), CUDA_R_32F, f.M, f.N, f.K);
    if (f.has_bias) {
        g.epilogue = CUBLASLT_EPILOGUE_BIAS;
        g.bias = f.bias32.data_ptr();
    }
    if (!lt_matmul(g, f.x2d, f.fn))
        return false;
    log_path(f.fn, "tier 2: cuBLASLt fp32 GEMM + epilogue kernel");
    const bool noop = f.c == at::kFloat && f.act == Act::None && !f.has_res; // acc32 is out already
    if (!noop)
        run_fwd_epilogue(acc32, at::Tensor(), f.res2d, f.out2d, preact_store, f.M, f.N, f.act);
    return true;
}

// Tier 3: ATen GEMM in dtype c, then the epilogue kernel (bias added there).
void fwd_aten_then_epilogue(const FwdCall &f) {
    log_path(f.fn, "tier 3: at::mm + epilogue kernel");
    at::Tensor target = f.want_pre ? f.pre2d : f.out2d;
    at::mm_out(target, f.x2d, f.w_c.t());
    run_fwd_epilogue(target, f.bias32, f.res2d, f.out2d, f.pre2d, f.M, f.N, f.act);
}

std::tuple<at::Tensor, at::Tensor> fused_linear_cuda(const at::Tensor &x, const at::Tensor &weight,
                                                     const std::optional<at::Tensor> &bias, c10::string_view activation,
                                                     const std::optional<at::Tensor> &residual, bool save_preact) {
    FwdCall f;
    f.fn = "fused_linear";
    f.act = parse_act(activation, f.fn);
    check_x_weight(f.fn, x, weight);
    f.c = x.scalar_type();
    f.K = x.size(-1);
    f.N = weight.size(0);
    f.M = leading_rows(x);
    const std::vector<int64_t> oshape = out_shape(x, f.N);
    f.bias = &bias;
    f.has_bias = bias.has_value() && bias->defined();
    if (f.has_bias)
        check_optional(f.fn, "bias", *bias, {f.N}, x);
    f.has_res = residual.has_value() && residual->defined();
    if (f.has_res)
        check_optional(f.fn, "residual", *residual, oshape, x);

    c10::cuda::CUDAGuard device_guard(x.device());
    const auto opts = x.options().dtype(f.c);
    f.want_pre = save_preact && f.act != Act::None;
    at::Tensor out = at::empty(oshape, opts);
    at::Tensor preact = f.want_pre ? at::empty(oshape, opts) : at::empty({0}, opts);
    if (f.M == 0 || f.N == 0)
        return {out, preact};

    f.out2d = out.view({f.M, f.N});
    if (f.want_pre)
        f.pre2d = preact.view({f.M, f.N});
    if (f.has_bias)
        f.bias32 = aligned16(bias->to(at::kFloat).contiguous());
    if (f.has_res) {
        at::Tensor r = residual->reshape({f.M, f.N});
        if (r.scalar_type() != f.c && r.scalar_type() != at::kFloat)
            r = r.to(at::kFloat);
        f.res2d = r.contiguous();
    }
    if (f.K == 0) { // acc = 0
        log_path(f.fn, "K == 0: epilogue on zeros");
        at::Tensor zeros = at::zeros({f.M, f.N}, opts.dtype(at::kFloat));
        run_fwd_epilogue(zeros, f.bias32, f.res2d, f.out2d, f.pre2d, f.M, f.N, f.act);
        return {out, preact};
    }
    f.x2d = x.reshape({f.M, f.K}).contiguous();
    f.w_c = weight.to(f.c).contiguous();
    const int mode = env_path_mode(); // FASTDL_FUSED_LINEAR_PATH: 0 all tiers, 1 from tier 2, 2 tier 3 only
    if (mode == 0 && fwd_lt_fused(f))
        return {out, preact};
    if (mode <= 1 && fwd_lt_then_epilogue(f))
        return {out, preact};
    fwd_aten_then_epilogue(f);
    return {out, preact};
}

// ----------------------------------------------------------------------------------------------------------------
// Backward: dpre (one kernel: act' and the fp32 bias gradient), then grad_x and grad_weight as GEMMs.
// ----------------------------------------------------------------------------------------------------------------

// dpre_c = round_c(g * act'(p)) [M, N] (grad_out itself when act is none and grad_out has dtype c), and grad_b (fp32
// column sums of the unrounded dpre) when grad_b is defined. need_dpre: grad_x or grad_weight needs it.
at::Tensor backward_dpre(const at::Tensor &grad_out, const at::Tensor &preact, at::ScalarType c, Act act, int64_t M,
                         int64_t N, bool need_dpre, const at::Tensor &grad_b) {
    const auto opts_c = grad_out.options().dtype(c);
    if (M == 0 || N == 0) {
        if (grad_b.defined())
            grad_b.zero_();
        return need_dpre ? at::zeros({M, N}, opts_c) : at::Tensor();
    }
    at::Tensor g2d = grad_out.reshape({M, N});
    if (g2d.scalar_type() != c && g2d.scalar_type() != at::kFloat)
        g2d = g2d.to(at::kFloat);
    g2d = g2d.contiguous();
    at::Tensor p2d;
    if (act != Act::None)
        p2d = preact.reshape({M, N}).to(c).contiguous();
    const bool dpre_is_g = act == Act::None && g2d.scalar_type() == c;
    at::Tensor dpre_out;
    if (need_dpre && !dpre_is_g)
        dpre_out = at::empty({M, N}, opts_c);
    if (dpre_out.defined() || grad_b.defined()) {
        dispatch_c(c, [&](auto tag) {
            using T = decltype(tag);
            launch_bwd<T>(g2d, p2d, dpre_out, grad_b, M, N, act);
        });
    }
    if (!need_dpre)
        return at::Tensor();
    return dpre_is_g ? g2d : dpre_out;
}

// grad_weight of an fp32 master weight with 16-bit x, in fp32 straight from the GEMM (no 16-bit round trip).
// Rule: cuBLASLt 16-bit x 16-bit -> fp32 when allowed (FASTDL_FUSED_LINEAR_PATH) and it has an algorithm; else the
// exact fallback (16-bit values are exact in fp32 and in TF32, products accumulate in fp32).
at::Tensor grad_weight_fp32(const at::Tensor &dpre_c, const at::Tensor &x2d, int64_t M, int64_t N, int64_t K,
                            const char *fn) {
    at::Tensor grad_w = at::empty({N, K}, x2d.options().dtype(at::kFloat));
    if (N == 0 || K == 0)
        return grad_w;
    if (M == 0)
        return grad_w.zero_();
    if (env_path_mode() < 2) {
        // Row-major gw[N, K] = dpre^T @ x  <=>  column-major gw^T[K, N] = x^T[K, M] @ dpre[M, N]
        // (dpre stored column-major as N x M -> op T).
        const LtGemm g = lt_gemm(CUBLAS_OP_N, CUBLAS_OP_T, K, N, M, x2d.data_ptr(), K, dpre_c.data_ptr(), N,
                                 cuda_dtype(x2d.scalar_type()), grad_w.data_ptr(), K, CUDA_R_32F);
        if (lt_matmul(g, x2d, fn)) {
            log_path(fn, "grad_weight: cuBLASLt 16-bit x 16-bit -> fp32");
            return grad_w;
        }
    }
    log_path(fn, "grad_weight: at::mm in fp32");
    at::mm_out(grad_w, dpre_c.t().to(at::kFloat), x2d.to(at::kFloat));
    return grad_w;
}

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
    const auto [need_gx, need_gw, need_gb] = output_mask;
    TORCH_CHECK_VALUE(grad_out.defined(), fn, ": grad_out must be a defined tensor");
    check_optional(fn, "grad_out", grad_out, oshape, x);
    const bool any = need_gx || need_gw || need_gb;
    if (act != Act::None && any) {
        TORCH_CHECK_VALUE(preact.defined() && preact.sizes() == at::IntArrayRef(oshape), fn,
                          ": preact must have shape ", at::IntArrayRef(oshape), ", got ",
                          preact.defined() ? preact.sizes() : at::IntArrayRef{}, " (activation '",
                          std::string(activation.data(), activation.size()),
                          "' needs it: call fused_linear with save_preact=True when gradients are needed)");
        check_optional(fn, "preact", preact, oshape, x);
    }

    c10::cuda::CUDAGuard device_guard(x.device());
    const auto opts_c = x.options().dtype(c);
    at::Tensor grad_x = at::empty({0}, opts_c);
    at::Tensor grad_w = at::empty({0}, opts_c.dtype(weight.scalar_type()));
    at::Tensor grad_b = at::empty({0}, opts_c.dtype(at::kFloat));
    if (!any)
        return {grad_x, grad_w, grad_b};
    if (need_gb)
        grad_b = at::empty({N}, opts_c.dtype(at::kFloat));
    const at::Tensor dpre_c =
        backward_dpre(grad_out, preact, c, act, M, N, need_gx || need_gw, need_gb ? grad_b : at::Tensor());
    if (need_gx)
        grad_x = at::mm(dpre_c, weight.to(c).contiguous()).view(x.sizes());
    if (need_gw) {
        const at::Tensor x2d = x.reshape({M, K}).contiguous();
        grad_w = weight.scalar_type() == c ? at::mm(dpre_c.t(), x2d) : grad_weight_fp32(dpre_c, x2d, M, N, K, fn);
    }
    return {grad_x, grad_w, grad_b};
}

} // namespace
} // namespace fastdl::fused_linear

TORCH_LIBRARY_IMPL(fastdl_cpp, CUDA, m) {
    m.impl("fused_linear", &fastdl::fused_linear::fused_linear_cuda);
    m.impl("fused_linear_backward", &fastdl::fused_linear::fused_linear_backward_cuda);
}
