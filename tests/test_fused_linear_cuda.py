"""CUDA kernels of fused_linear (csrc/cuda/fused_linear.cu), called directly as torch.ops.fastdl_cpp.*.

Forward and backward against a float64 reference for every activation, fp32 / bf16 / fp16 and fp32 master weights,
odd shapes (1, 7, 33, 127, 1000+), with and without bias / residual, each internal path (cuBLASLt fused epilogue,
cuBLASLt GEMM + epilogue kernel, ATen GEMM + epilogue kernel; chosen with FASTDL_FUSED_LINEAR_PATH), empty inputs,
non-contiguous inputs, output_mask, bad arguments and run-to-run determinism.

Accuracy bar (the project contract): ||y - ref64|| / ||ref64|| <= 2 * (the same metric of PyTorch eager at that
dtype), with a small floor per dtype so that a near-exact eager result does not make the bar meaningless.
"""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err


def _why_skip():
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    try:
        import fastdl  # noqa: F401  (loads fastdl._C, which registers the fastdl_cpp kernels)
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"import fastdl failed: {e!r}"
    if not hasattr(torch.ops.fastdl_cpp, "fused_linear"):
        return "torch.ops.fastdl_cpp.fused_linear is not defined (fastdl._C not built or not loaded)"
    for op in ("fused_linear", "fused_linear_backward"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"fastdl_cpp::{op}", "CUDA"):
            return f"fastdl_cpp::{op} has no CUDA kernel (fastdl._C was built without csrc/cuda/*.cu)"
    return None


SKIP_REASON = _why_skip()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

DEV = "cuda"
ACTS = ("none", "relu", "gelu", "gelu_tanh", "silu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (compute dtype = x.dtype, weight dtype)
CONFIGS = [(F32, F32), (BF16, BF16), (BF16, F32), (F16, F16), (F16, F32)]
CONFIG_IDS = ["fp32", "bf16", "bf16-fp32w", "fp16", "fp16-fp32w"]
FLOOR = {F32: 2e-6, BF16: 4e-3, F16: 5e-4}
# (leading dims, M, K, N): x is [*lead, M, K]
SHAPES = [
    ((), 1, 1, 1),
    ((), 1, 7, 33),
    ((), 7, 33, 127),
    ((3,), 11, 127, 7),
    ((), 33, 1000, 1031),
    ((2,), 515, 1024, 1000),
    ((), 1029, 256, 64),
]
# (bias dtype, residual dtype); "c" = the compute dtype
VARIANTS = [(None, None), ("c", None), (F32, "c"), ("c", F32)]

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def ops():
    return torch.ops.fastdl_cpp


# ------------------------------------------------------------------------------------------------ references
def act64(p, act):
    if act == "none":
        return p
    if act == "relu":
        return torch.relu(p)
    if act == "gelu":
        return 0.5 * p * (1.0 + torch.erf(p / math.sqrt(2.0)))
    if act == "gelu_tanh":
        return 0.5 * p * (1.0 + torch.tanh(SQRT_2_OVER_PI * (p + 0.044715 * p**3)))
    if act == "silu":
        return p * torch.sigmoid(p)
    raise ValueError(act)


def dact64(p, act):
    if act == "none":
        return torch.ones_like(p)
    if act == "relu":
        return (p > 0).to(p.dtype)
    if act == "gelu":
        return 0.5 * (1.0 + torch.erf(p / math.sqrt(2.0))) + p * torch.exp(-0.5 * p * p) / math.sqrt(2.0 * math.pi)
    if act == "gelu_tanh":
        t = torch.tanh(SQRT_2_OVER_PI * (p + 0.044715 * p**3))
        return 0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * p * p)
    if act == "silu":
        s = torch.sigmoid(p)
        return s * (1.0 + p * (1.0 - s))
    raise ValueError(act)


def eager_act(y, act):
    """PyTorch's own activation at y's dtype."""
    if act == "none":
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if act == "silu":
        return F.silu(y)
    raise ValueError(act)


def tol(c, eager_err):
    return max(2.0 * eager_err, FLOOR[c])


def assert_close(name, got, ref64, eager, c):
    err = rel_err(got, ref64)
    e_err = rel_err(eager, ref64)
    assert err <= tol(c, e_err), f"{name}: rel err {err:.3e} > 2 x eager {e_err:.3e} (floor {FLOOR[c]:.0e})"


def make_inputs(lead, M, K, N, c, w_dtype, bias_dtype, res_dtype, g_dtype=None):
    bias_dtype = c if bias_dtype == "c" else bias_dtype
    res_dtype = c if res_dtype == "c" else res_dtype
    x = torch.randn(*lead, M, K, device=DEV, dtype=c)
    w = (torch.randn(N, K, device=DEV) / max(K, 1) ** 0.5).to(w_dtype)
    b = None if bias_dtype is None else torch.randn(N, device=DEV).to(bias_dtype)
    r = None if res_dtype is None else torch.randn(*lead, M, N, device=DEV).to(res_dtype)
    g = torch.randn(*lead, M, N, device=DEV).to(g_dtype or c)
    return x, w, b, r, g


def check_forward(x, w, b, r, act, save_preact=True):
    c = x.dtype
    N = w.shape[0]
    out, pre = ops().fused_linear(x, w, b, act, r, save_preact)
    oshape = (*x.shape[:-1], N)
    assert out.shape == oshape and out.dtype == c and out.is_contiguous() and out.device == x.device
    pre64 = x.double() @ w.to(c).double().t()
    if b is not None:
        pre64 = pre64 + b.float().double()
    ref = act64(pre64, act)
    if r is not None:
        ref = ref + r.float().double()
    # PyTorch eager at dtype c
    pre_e = F.linear(x, w.to(c), None if b is None else b.to(c))
    y_e = eager_act(pre_e, act)
    if r is not None:
        y_e = y_e + r.to(c)
    assert_close(f"out[{act}, {c}]", out, ref, y_e, c)
    if save_preact and act != "none":
        assert pre.shape == oshape and pre.dtype == c
        assert_close(f"preact[{act}, {c}]", pre, pre64, pre_e, c)
    else:
        assert pre.numel() == 0 and pre.dtype == c and pre.device == x.device
    return out, pre


def check_backward(g, x, w, pre, act):
    c = x.dtype
    N, K = w.shape
    M = math.prod(x.shape[:-1])
    p = pre if act != "none" else torch.empty(0, device=DEV, dtype=c)
    gx, gw, gb = ops().fused_linear_backward(g, x, w, p, act, [True, True, True])
    assert gx.shape == x.shape and gx.dtype == c
    assert gw.shape == w.shape and gw.dtype == w.dtype
    assert gb.shape == (N,) and gb.dtype == F32
    g64 = g.float().double().reshape(M, N)
    dpre64 = g64 if act == "none" else g64 * dact64(pre.float().double().reshape(M, N), act)
    x64 = x.double().reshape(M, K)
    gx_ref = (dpre64 @ w.to(c).double()).reshape(x.shape)
    gw_ref = dpre64.t() @ x64
    gb_ref = dpre64.sum(0)
    # PyTorch eager at dtype c: activation backward from the same preact, GEMMs in c, bias grad summed in c
    if act == "none":
        de = g.to(c).reshape(M, N)
    else:
        pc = pre.detach().clone().requires_grad_(True)
        eager_act(pc, act).backward(g.to(c))
        de = pc.grad.reshape(M, N)
    x2 = x.reshape(M, K)
    assert_close(f"grad_x[{act}, {c}]", gx, gx_ref, (de @ w.to(c)).reshape(x.shape), c)
    assert_close(f"grad_weight[{act}, {c}]", gw, gw_ref, (de.t() @ x2).to(w.dtype), c)
    assert_close(f"grad_bias[{act}, {c}]", gb, gb_ref, de.sum(0), c)
    return gx, gw, gb


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_forward_backward_vs_fp64(act, cfg):
    c, w_dtype = cfg
    for lead, M, K, N in SHAPES:
        for bias_dtype, res_dtype in VARIANTS:
            x, w, b, r, g = make_inputs(lead, M, K, N, c, w_dtype, bias_dtype, res_dtype)
            _, pre = check_forward(x, w, b, r, act)
            check_backward(g, x, w, pre, act)


@pytest.mark.parametrize("path", ["auto", "unfused", "aten"])
@pytest.mark.parametrize("act", ["none", "relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[3]], ids=CONFIG_IDS[:4])
def test_each_internal_path(path, act, cfg, monkeypatch):
    """Tier 1 (cuBLASLt epilogue), tier 2 (cuBLASLt fp32 GEMM + kernel), tier 3 (at::mm + kernel)."""
    monkeypatch.setenv("FASTDL_FUSED_LINEAR_PATH", path)
    c, w_dtype = cfg
    for lead, M, K, N in [((), 64, 128, 256), ((2,), 33, 127, 1000)]:
        for bias_dtype, res_dtype, save in [
            ("c", None, True),
            (F32, None, False),
            ("c", "c", True),
            (None, None, True),
        ]:
            x, w, b, r, g = make_inputs(lead, M, K, N, c, w_dtype, bias_dtype, res_dtype)
            _, pre = check_forward(x, w, b, r, act, save_preact=save)
            if save or act == "none":
                check_backward(g, x, w, pre, act)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_fp32_grad_out_and_1d_x(cfg):
    c, w_dtype = cfg
    x, w, b, r, g = make_inputs((), 5, 40, 24, c, w_dtype, F32, None, g_dtype=F32)
    _, pre = check_forward(x, w, b, r, "silu")
    check_backward(g, x, w, pre, "silu")
    check_backward(g, x, w, pre, "none")  # fp32 grad_out with act none: dpre_c = round_c(g)
    x1 = torch.randn(40, device=DEV, dtype=c)  # x of shape [K]
    out, pre = check_forward(x1, w, b, None, "gelu")
    assert out.shape == (24,)
    check_backward(torch.randn(24, device=DEV, dtype=c), x1, w, pre, "gelu")


@pytest.mark.parametrize("c", [F32, BF16, F16])
def test_non_contiguous_inputs(c):
    M, K, N = 37, 72, 48
    x = torch.randn(K, M, device=DEV, dtype=c).t()  # [M, K], strides (1, M)
    w = torch.randn(K, N, device=DEV, dtype=c).t() / K**0.5  # [N, K], not contiguous
    b = torch.randn(2 * N, device=DEV, dtype=c)[::2]
    r = torch.randn(N, M, device=DEV, dtype=c).t()
    g = torch.randn(N, M, device=DEV, dtype=c).t()
    for act in ACTS:
        _, pre = check_forward(x, w, b, r, act)
        check_backward(g, x, w, pre, act)
    # misaligned (offset by one element) views force the scalar kernel paths
    xo = torch.randn(M * K + 1, device=DEV, dtype=c)[1:].view(M, K)
    ro = torch.randn(M * N + 1, device=DEV, dtype=c)[1:].view(M, N)
    go = torch.randn(M * N + 1, device=DEV, dtype=c)[1:].view(M, N)
    bo = torch.randn(N + 1, device=DEV, dtype=c)[1:]
    for act in ACTS:
        _, pre = check_forward(xo, w, bo, ro, act)
        check_backward(go, xo, w, pre, act)


@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_empty_inputs(cfg):
    c, w_dtype = cfg
    for act in ("none", "gelu", "relu"):
        # M == 0
        x, w, b, r, g = make_inputs((2,), 0, 16, 8, c, w_dtype, "c", "c")
        out, pre = ops().fused_linear(x, w, b, act, r, True)
        assert out.shape == (2, 0, 8) and out.dtype == c
        gx, gw, gb = ops().fused_linear_backward(g, x, w, pre, act, [True, True, True])
        assert gx.shape == x.shape and gw.shape == w.shape and gb.shape == (8,)
        assert gw.dtype == w_dtype and torch.all(gw == 0) and torch.all(gb == 0)
        # K == 0: acc = 0, out = act(bias) + residual
        x, w, b, r, g = make_inputs((), 5, 0, 8, c, w_dtype, "c", "c")
        _, pre = check_forward(x, w, b, r, act)
        gx, gw, gb = check_backward(g, x, w, pre, act)
        assert gx.shape == (5, 0) and gw.shape == (8, 0)
        # N == 0
        x, w, b, r, g = make_inputs((), 5, 16, 0, c, w_dtype, "c", None)
        out, pre = ops().fused_linear(x, w, b, act, None, True)
        assert out.shape == (5, 0)
        gx, gw, gb = ops().fused_linear_backward(g, x, w, pre, act, [True, True, True])
        assert gx.shape == (5, 16) and torch.all(gx == 0) and gw.shape == (0, 16) and gb.shape == (0,)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2]], ids=[CONFIG_IDS[0], CONFIG_IDS[2]])
def test_output_mask(cfg):
    c, w_dtype = cfg
    x, w, b, r, g = make_inputs((), 33, 64, 40, c, w_dtype, "c", None)
    _, pre = ops().fused_linear(x, w, b, "silu", None, True)
    full = ops().fused_linear_backward(g, x, w, pre, "silu", [True, True, True])
    for mask in ([False, False, False], [True, False, False], [False, True, False], [False, False, True]):
        got = ops().fused_linear_backward(g, x, w, pre, "silu", mask)
        for i, (want, t, f) in enumerate(zip(mask, got, full, strict=True)):
            if want:
                assert torch.equal(t, f), f"output {i} differs with mask {mask}"
            else:
                assert t.numel() == 0 and t.dtype == f.dtype and t.device == f.device


def test_deterministic():
    x, w, b, r, g = make_inputs((), 4099, 512, 1000, BF16, F32, F32, None)
    a = ops().fused_linear(x, w, b, "gelu", None, True)
    a2 = ops().fused_linear(x, w, b, "gelu", None, True)
    assert torch.equal(a[0], a2[0]) and torch.equal(a[1], a2[1])
    gb1 = ops().fused_linear_backward(g, x, w, a[1], "gelu", [True, True, True])
    gb2 = ops().fused_linear_backward(g, x, w, a[1], "gelu", [True, True, True])
    for t1, t2 in zip(gb1, gb2, strict=True):
        assert torch.equal(t1, t2)


def test_bad_arguments():
    """The CUDA kernel's own checks (called directly, without the op router): one exception type per kind of mistake
    (TypeError: dtype, ValueError: shape or value, RuntimeError: device), the message naming the argument and the
    expected value, as the Python checks word it."""
    x = torch.randn(4, 8, device=DEV)
    w = torch.randn(6, 8, device=DEV)
    fl = ops().fused_linear
    with pytest.raises(ValueError, match=r"weight must have shape \[N, K\] with K = x.shape\[-1\] = 8, got weight of "
                                         r"shape \[6, 7\]"):
        fl(x, torch.randn(6, 7, device=DEV), None, "none", None, False)
    with pytest.raises(TypeError, match=r"x must be a floating tensor \(float32, bfloat16, float16\), got dtype Int"):
        fl(torch.ones(4, 8, device=DEV, dtype=torch.int32), w, None, "none", None, False)
    with pytest.raises(ValueError, match=r"activation must be one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu', "
                                         r"got 'tanh'"):
        fl(x, w, None, "tanh", None, False)
    with pytest.raises(ValueError, match=r"bias must have shape \[6\], got \[5\]"):
        fl(x, w, torch.randn(5, device=DEV), "none", None, False)
    with pytest.raises(ValueError, match=r"residual must have shape \[4, 6\], got \[4, 5\]"):
        fl(x, w, None, "none", torch.randn(4, 5, device=DEV), False)
    with pytest.raises(RuntimeError, match=r"weight must be on device cuda:0 \(the device of x\), got cpu"):
        fl(x, w.cpu(), None, "none", None, False)
    with pytest.raises(TypeError, match=r"weight.dtype must be x.dtype \(Half\) or float32, got BFloat16"):
        fl(x.half(), w.bfloat16(), None, "none", None, False)  # weight dtype neither x's nor fp32
    bw = ops().fused_linear_backward
    with pytest.raises(ValueError, match=r"grad_out must have shape \[4, 6\], got \[4, 5\]"):
        bw(torch.randn(4, 5, device=DEV), x, w, torch.empty(0, device=DEV), "none", [True, True, True])
    with pytest.raises(ValueError, match=r"preact must have shape \[4, 6\], got \[0\] \(activation 'gelu' needs it"):
        bw(torch.randn(4, 6, device=DEV), x, w, torch.empty(0, device=DEV), "gelu", [True, True, True])
    # through the op router: the same types (the Python checks re-run when a kernel raises)
    with pytest.raises(TypeError, match=r"weight.dtype must be x.dtype \(torch.float16\) or float32"):
        torch.ops.fastdl.fused_linear(x.half(), w.bfloat16(), None, "none", None, False)


@pytest.mark.skipif(
    os.environ.get("FASTDL_TEST_LARGE") != "1", reason="set FASTDL_TEST_LARGE=1 to run (needs ~40 GB of GPU memory)"
)
def test_more_than_2_pow_31_elements():
    """M * N > 2^31: int64 indexing in the epilogue and backward kernels (checked on the last rows)."""
    M, K, N = (1 << 21) + 3, 16, 1024
    x = torch.randn(M, K, device=DEV, dtype=BF16)
    w = torch.randn(N, K, device=DEV, dtype=BF16) / 4
    b = torch.randn(N, device=DEV)
    out, pre = ops().fused_linear(x, w, b, "silu", None, True)
    tail = slice(M - 5, M)
    pre64 = x[tail].double() @ w.double().t() + b.double()
    assert rel_err(out[tail], act64(pre64, "silu")) < 1e-2
    g = torch.ones(M, N, device=DEV, dtype=BF16)
    gx, _, gb = ops().fused_linear_backward(g, x, w, pre, "silu", [True, False, True])
    ref_gb = sum(dact64(pre[i : i + (1 << 18)].double(), "silu").sum(0) for i in range(0, M, 1 << 18))
    assert rel_err(gb, ref_gb) < 1e-4
    assert rel_err(gx[tail], dact64(pre[tail].double(), "silu") @ w.double()) < 1e-2
