"""Tests of the Triton fused linear kernels (kernels/fused_linear.py, installed as fastdl.kernels.fused_linear).

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1 is set below, before
triton is imported); shapes stay small because the interpreter is slow. bf16 is tested on the GPU only: the
interpreter handles bf16 as raw integers (and rounds fp32 -> bf16 toward zero). The GPU tests (bf16 included,
larger shapes) run when CUDA is available and the interpreter is off.
"""

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere below

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _load_kernels():
    """fastdl.kernels.fused_linear: the module fastdl's op router calls (fastdl/ops/_library.py), not a copy."""
    from fastdl.kernels import fused_linear as mod

    assert getattr(mod, "_INTERPRET", None) == _INTERPRET, (
        "fastdl.kernels.fused_linear was imported before TRITON_INTERPRET was set (tests/conftest.py sets it first)"
    )
    return mod


fl = _load_kernels()
fused_linear_fwd = fl.fused_linear_fwd
fused_linear_bwd = fl.fused_linear_bwd

DEV = "cpu" if _INTERPRET else "cuda"
ACTS = ["none", "relu", "gelu", "gelu_tanh", "silu"]
F = torch.nn.functional
_ACT_FN = {
    "none": lambda t: t,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}
# ||out - ref64|| / ||ref64|| floors (about one unit in the last place of the output dtype); the main bound is
# twice PyTorch's own error at the same precision.
FLOOR = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}
# backward bounds vs the unrounded float64 reference (contract: ~1e-5 fp32, 2e-3 fp16, 1e-2 bf16)
BWD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out, ref):
    ref = ref.double()
    den = ref.norm().item()
    num = (out.double() - ref).norm().item()
    return num / den if den > 0 else num


def make(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEV)


def ref_fwd64(x, w, b, act, r):
    c = x.dtype
    pre = x.double() @ w.to(c).double().T
    if b is not None:
        pre = pre + b.double()
    out = _ACT_FN[act](pre)
    if r is not None:
        out = out + r.double()
    return out, pre


def ref_fwd_eager(x, w, b, act, r):
    """The contract's pure-PyTorch reference at the compute dtype."""
    c = x.dtype
    pre = x.float() @ w.to(c).float().T
    if b is not None:
        pre = pre + b.float()
    out = _ACT_FN[act](pre)
    if r is not None:
        out = out + r.float()
    return out.to(c), pre.to(c)


def check_fwd(x, w, b, act, r, save=True):
    out, pre = fused_linear_fwd(x, w, b, act, r, save)
    n = w.shape[0]
    assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype and out.is_contiguous()
    ref, pre64 = ref_fwd64(x, w, b, act, r)
    eager, eager_pre = ref_fwd_eager(x, w, b, act, r)
    assert torch.isfinite(out).all()
    err, err_eager = rel_err(out, ref), rel_err(eager, ref)
    assert err <= max(2 * err_eager, FLOOR[x.dtype]), (err, err_eager)
    if save and act != "none":
        assert pre.shape == out.shape and pre.dtype == x.dtype
        perr, perr_eager = rel_err(pre, pre64), rel_err(eager_pre, pre64)
        assert perr <= max(2 * perr_eager, FLOOR[x.dtype]), (perr, perr_eager)
    else:
        assert pre.numel() == 0 and pre.dtype == x.dtype
    return out, pre


SHAPES = [(1, 1, 1), (7, 33, 127), (33, 127, 7), (127, 7, 33), (64, 96, 200), (150, 70, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act", ACTS)
def test_forward_shapes(act, dtype):
    gen = torch.Generator().manual_seed(1)
    for i, (m, n, k) in enumerate(SHAPES):
        x = make((m, k), dtype, gen)
        w = make((n, k), dtype, gen, k**-0.5)
        b = make((n,), torch.float32, gen) if i % 2 == 0 else None
        r = make((m, n), dtype, gen) if i % 3 != 1 else None
        check_fwd(x, w, b, act, r, save=i % 4 != 3)


ODD = [1, 7, 33, 127]


def test_forward_odd_shape_grid():
    # every (M, N, K) in {1, 7, 33, 127}^3: partial tiles on every edge, single rows/columns, K < BLOCK_K
    gen = torch.Generator().manual_seed(6)
    for m in ODD:
        for n in ODD:
            for k in ODD:
                x = make((m, k), torch.float16, gen)
                w = make((n, k), torch.float16, gen, k**-0.5)
                check_fwd(x, w, make((n,), torch.float32, gen), "silu", make((m, n), torch.float16, gen))


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("has_res", [False, True])
def test_forward_bias_residual_combos(has_bias, has_res):
    gen = torch.Generator().manual_seed(2)
    m, n, k = 45, 38, 70
    x = make((m, k), torch.float16, gen)
    w = make((n, k), torch.float16, gen, k**-0.5)
    # bias / residual in other float dtypes are read as fp32
    b = make((n,), torch.float16, gen) if has_bias else None
    r = make((m, n), torch.float32, gen) if has_res else None
    check_fwd(x, w, b, "gelu", r)


def test_forward_noncontiguous_and_leading_dims():
    gen = torch.Generator().manual_seed(3)
    k, n = 40, 24
    # leading dims that do not collapse (transposed batch): reshape copies
    x = make((5, 3, k), torch.float32, gen).transpose(0, 1)
    w = make((n, k), torch.float32, gen, k**-0.5)
    r = make((3, 5, n), torch.float32, gen)
    out, _ = check_fwd(x, w, None, "silu", r)
    assert out.shape == (3, 5, n)
    # strided K (stride_xk == 2), transposed weight, strided bias, non-contiguous residual: passed as strides
    x = make((2, 9, 2 * k), torch.float16, gen)[..., ::2]
    w = make((k, n), torch.float16, gen, k**-0.5).t()
    b = make((2 * n,), torch.float32, gen)[::2]
    r = make((n, 9, 2), torch.float16, gen).permute(2, 1, 0)
    assert not x.is_contiguous() and not w.is_contiguous() and not r.is_contiguous()
    check_fwd(x, w, b, "gelu_tanh", r)
    # 1-D x: a single row
    x = make((k,), torch.float32, gen)
    out, _ = check_fwd(x, make((n, k), torch.float32, gen), None, "relu", None)
    assert out.shape == (n,)


@pytest.mark.parametrize("act", ["none", "gelu"])
def test_forward_mixed_fp32_weight(act):
    gen = torch.Generator().manual_seed(4)
    m, n, k = 33, 50, 96
    x = make((m, k), torch.float16, gen)
    w = make((n, k), torch.float32, gen, k**-0.5)  # fp32 master weight, rounded to fp16 before the product
    b = make((n,), torch.float32, gen)
    check_fwd(x, w, b, act, make((m, n), torch.float16, gen))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy exp in the interpreter
def test_forward_saturating_activations():
    # exp/erf/tanh at large |pre| must not produce inf/nan
    vals = torch.tensor([-200.0, -60.0, -30.0, -8.0, -1.0, 0.0, 1e-4, 1.0, 8.0, 30.0, 60.0, 200.0])
    x = vals[:, None].to(DEV)
    w = torch.ones(3, 1, device=DEV)
    for act in ACTS:
        out, pre = fused_linear_fwd(x, w, None, act, None, True)
        ref, _ = ref_fwd64(x, w, None, act, None)
        assert torch.isfinite(out).all(), act
        assert rel_err(out, ref) <= 1e-6, act
        if act != "none":
            g = torch.ones_like(out)
            gx, gw, gb = fused_linear_bwd(g, x, w, pre, act, [True, True, True])
            p64 = pre.double().requires_grad_()
            _ACT_FN[act](p64).backward(g.double())
            assert torch.isfinite(gb).all() and torch.isfinite(gx).all(), act
            assert rel_err(gb, p64.grad.sum(0)) <= 1e-6, act


def test_forward_empty_inputs():
    gen = torch.Generator().manual_seed(5)
    w = make((6, 4), torch.float32, gen)
    b = make((6,), torch.float32, gen)
    for shape in [(0, 4), (2, 0, 4)]:
        x = make(shape, torch.float32, gen)
        out, pre = fused_linear_fwd(x, w, b, "gelu", None, True)
        assert out.shape == (*shape[:-1], 6) and pre.shape == out.shape
        out, pre = fused_linear_fwd(x, w, b, "none", None, True)
        assert out.shape == (*shape[:-1], 6) and pre.numel() == 0
    # K == 0: acc = 0, out = act(bias) + residual
    x = make((3, 0), torch.float16, gen)
    w0 = make((6, 0), torch.float16, gen)
    r = make((3, 6), torch.float16, gen)
    out, pre = fused_linear_fwd(x, w0, b, "silu", r, True)
    ref = F.silu(b.double()) + r.double()
    assert rel_err(out, ref) <= FLOOR[torch.float16]
    assert rel_err(pre, b.double().expand(3, 6)) <= FLOOR[torch.float16]


def test_forward_errors():
    """The launcher's own checks: one type per kind of mistake, the message naming the argument and its value."""
    x = torch.randn(4, 8, device=DEV)
    w = torch.randn(5, 8, device=DEV)
    with pytest.raises(ValueError, match=r"weight.shape\[1\] must equal x.shape\[-1\] \(K=8\), got weight shape "
                                         r"\(5, 7\)"):
        fused_linear_fwd(x, torch.randn(5, 7, device=DEV), None, "none", None, False)
    with pytest.raises(ValueError, match=r"activation must be one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu', "
                                         r"got 'tanh'"):
        fused_linear_fwd(x, w, None, "tanh", None, False)
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16 \(the compute dtype\), got "
                                        r"torch.int32"):
        fused_linear_fwd(x.to(torch.int32), w, None, "none", None, False)
    with pytest.raises(TypeError, match="weight must have a floating dtype, got torch.int64"):
        fused_linear_fwd(x, w.to(torch.int64), None, "none", None, False)
    with pytest.raises(TypeError, match=r"weight.dtype must be x.dtype \(torch.float32\) or torch.float32, got "
                                        r"torch.float16"):
        fused_linear_fwd(x, w.half(), None, "none", None, False)
    with pytest.raises(ValueError, match=r"bias must have shape \[N\] = \[5\], got \(4,\)"):
        fused_linear_fwd(x, w, torch.randn(4, device=DEV), "none", None, False)
    with pytest.raises(ValueError, match=r"residual must have the output shape \[4, 5\], got \[4, 4\]"):
        fused_linear_fwd(x, w, None, "none", torch.randn(4, 4, device=DEV), False)
    with pytest.raises(RuntimeError, match="weight must be on the same device"):
        fused_linear_fwd(x, torch.randn(5, 8, device="meta"), None, "none", None, False)
    with pytest.raises(RuntimeError, match="bias must be on the same device"):
        fused_linear_fwd(x, w, torch.randn(5, device="meta"), "none", None, False)


# ------------------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------------------
def ref_bwd64(g, x, w, pre, act):
    """float64 autograd through the activation at the saved pre-activation, then the two products."""
    m = g.numel() // g.shape[-1] if g.shape[-1] else 0
    g64 = g.double().reshape(m, -1)
    if act == "none":
        d = g64
    else:
        p = pre.double().reshape(m, -1).requires_grad_()
        _ACT_FN[act](p).backward(g64)
        d = p.grad
    c = x.dtype
    gx = (d @ w.to(c).double()).reshape(x.shape)
    gw = d.T @ x.double().reshape(m, -1)
    return gx, gw, d.sum(0)


def check_bwd(g, x, w, pre, act, mask, tol=None, fn=None):
    fn = fn or fused_linear_bwd
    gx, gw, gb = fn(g, x, w, pre if act != "none" else torch.empty(0, dtype=x.dtype, device=x.device), act, mask)
    rx, rw, rb = ref_bwd64(g, x, w, pre, act)
    tol = tol or BWD_TOL[x.dtype]
    if mask[0]:
        assert gx.shape == x.shape and gx.dtype == x.dtype and gx.is_contiguous()
        assert rel_err(gx, rx) <= tol, ("grad_x", rel_err(gx, rx))
    else:
        assert gx.numel() == 0 and gx.dtype == x.dtype
    if mask[1]:
        assert gw.shape == w.shape and gw.dtype == w.dtype
        assert rel_err(gw, rw) <= tol, ("grad_weight", rel_err(gw, rw))
    else:
        assert gw.numel() == 0 and gw.dtype == w.dtype
    if mask[2]:
        assert gb.shape == (w.shape[0],) and gb.dtype == torch.float32
        # grad_bias is reduced from the fp32 dpre: close to fp32 accuracy whatever the compute dtype
        assert rel_err(gb, rb) <= 1e-5, ("grad_bias", rel_err(gb, rb))
    else:
        assert gb.numel() == 0 and gb.dtype == torch.float32
    return gx, gw, gb


MASKS = [[True, True, True], [True, False, False], [False, True, False], [False, False, True], [True, False, True]]


def test_backward_odd_shape_grid():
    gen = torch.Generator().manual_seed(16)
    for i, (m, n, k) in enumerate((m, n, k) for m in ODD for n in ODD for k in ODD):
        x = make((m, k), torch.float32, gen)
        w = make((n, k), torch.float32, gen, k**-0.5)
        pre = make((m, n), torch.float32, gen)
        g = make((m, n), torch.float32, gen)
        # alternate the fused-write-through path (grad_weight requested) and the grad_x-only path
        check_bwd(g, x, w, pre, "gelu", MASKS[0] if i % 2 == 0 else MASKS[4])


BWD_SHAPES = [(1, 7, 33), (33, 127, 7), (127, 33, 1), (96, 64, 150)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act", ACTS)
def test_backward(act, dtype):
    gen = torch.Generator().manual_seed(10)
    for i, (m, n, k) in enumerate(BWD_SHAPES):
        x = make((m, k), dtype, gen)
        w = make((n, k), dtype, gen, k**-0.5)
        pre = make((m, n), dtype, gen)
        g = make((m, n), dtype, gen)
        check_bwd(g, x, w, pre, act, MASKS[0])
        check_bwd(g, x, w, pre, act, MASKS[1 + i % (len(MASKS) - 1)])


@pytest.mark.parametrize("mask", MASKS + [[False, True, True]])
def test_backward_masks_mixed_weight(mask):
    # fp32 master weight with fp16 activations: grad_weight in fp32, grad_x through the in-kernel weight cast
    gen = torch.Generator().manual_seed(11)
    m, n, k = 70, 45, 60
    x = make((2, m // 2, k), torch.float16, gen)
    w = make((n, k), torch.float32, gen, k**-0.5)
    pre = make((2, m // 2, n), torch.float16, gen)
    g = make((2, m // 2, n), torch.float16, gen)
    check_bwd(g, x, w, pre, "gelu", mask)
    check_bwd(g, x, w, pre, "none", mask)


def test_backward_noncontiguous_and_fp32_grad_out():
    gen = torch.Generator().manual_seed(12)
    m, n, k = 40, 30, 50
    x = make((k, m), torch.float16, gen).t()  # transposed x
    w = make((n, 2 * k), torch.float16, gen, k**-0.5)[:, ::2]
    pre = make((n, m), torch.float16, gen).t()
    g = make((m, 2 * n), torch.float16, gen)[:, 1::2]
    for act in ["relu", "silu"]:
        check_bwd(g, x, w, pre, act, [True, True, True])
        check_bwd(g, x, w, pre, act, [True, False, True])
    # grad_out in fp32 with fp16 compute and no activation: dpre_c = round(grad_out) is materialised
    g32 = make((m, n), torch.float32, gen)
    check_bwd(g32, x, w, pre, "none", [True, True, True])


def test_backward_split_reduction():
    # the weight-gradient GEMM split over M (used on GPUs when the N x K tile grid is small)
    gen = torch.Generator().manual_seed(13)
    m, n, k = 600, 20, 40
    x = make((m, k), torch.float32, gen)
    w = make((n, k), torch.float32, gen, k**-0.5)
    pre = make((m, n), torch.float32, gen)
    g = make((m, n), torch.float32, gen)

    def split_bwd(*args):
        return fl._fused_linear_bwd(*args, split=3)

    for act in ["gelu", "none"]:
        check_bwd(g, x, w, pre, act, [True, True, True], fn=split_bwd)
        check_bwd(g, x, w.half().float(), pre, act, [False, True, True], fn=split_bwd)


def test_backward_empty_inputs():
    gen = torch.Generator().manual_seed(14)
    w = make((6, 4), torch.float32, gen)
    x = make((0, 4), torch.float32, gen)
    g = make((0, 6), torch.float32, gen)
    gx, gw, gb = fused_linear_bwd(g, x, w, g, "gelu", [True, True, True])
    assert gx.shape == (0, 4) and torch.equal(gw, torch.zeros_like(w)) and torch.equal(gb, torch.zeros(6, device=DEV))
    # K == 0: no grad_x / grad_weight elements, grad_bias still sums dpre
    x = make((5, 0), torch.float32, gen)
    w0 = make((6, 0), torch.float32, gen)
    g = make((5, 6), torch.float32, gen)
    pre = make((5, 6), torch.float32, gen)
    gx, gw, gb = fused_linear_bwd(g, x, w0, pre, "silu", [True, True, True])
    _, _, rb = ref_bwd64(g, x, w0, pre, "silu")
    assert gx.shape == (5, 0) and gw.shape == (6, 0) and rel_err(gb, rb) <= 1e-6


def test_backward_errors():
    x = torch.randn(4, 8, device=DEV)
    w = torch.randn(5, 8, device=DEV)
    g = torch.randn(4, 5, device=DEV)
    with pytest.raises(ValueError, match=r"grad_out must have shape \[4, 5\] \(x.shape\[:-1\] \+ \[N\]\), "
                                         r"got \[4, 6\]"):
        fused_linear_bwd(torch.randn(4, 6, device=DEV), x, w, g, "relu", [True, True, True])
    with pytest.raises(ValueError, match=r"preact must have the shape of grad_out \[4, 5\] for activation 'relu', "
                                         r"got \[0\]"):
        fused_linear_bwd(g, x, w, torch.empty(0, device=DEV), "relu", [True, True, True])
    with pytest.raises(ValueError, match=r"output_mask must be 3 booleans .*, got \[True, True\]"):
        fused_linear_bwd(g, x, w, g, "relu", [True, True])
    with pytest.raises(ValueError, match=r"activation must be one of .*, got 'gelu_erf'"):
        fused_linear_bwd(g, x, w, g, "gelu_erf", [True, True, True])
    with pytest.raises(ValueError, match=r"weight.shape\[1\] must equal x.shape\[-1\] \(K=8\)"):
        fused_linear_bwd(g, x, torch.randn(5, 9, device=DEV), g, "relu", [True, True, True])
    with pytest.raises(TypeError, match="grad_out must have a floating dtype, got torch.int32"):
        fused_linear_bwd(g.int(), x, w, g, "relu", [True, True, True])
    # activation "none" ignores preact (may be empty)
    gx, _, _ = fused_linear_bwd(g, x, w, torch.empty(0, device=DEV), "none", [True, False, False])
    assert gx.shape == x.shape


def test_forward_backward_chain_vs_autograd():
    """Forward + backward against float64 autograd of the whole op (x, weight, bias, residual)."""
    gen = torch.Generator().manual_seed(15)
    m, n, k = 50, 40, 70
    x = make((2, m // 2, k), torch.float32, gen)
    w = make((n, k), torch.float32, gen, k**-0.5)
    b = make((n,), torch.float32, gen)
    r = make((2, m // 2, n), torch.float32, gen)
    g = make((2, m // 2, n), torch.float32, gen)
    out, pre = fused_linear_fwd(x, w, b, "gelu_tanh", r, True)
    gx, gw, gb = fused_linear_bwd(g, x, w, pre, "gelu_tanh", [True, True, True])
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    out64 = F.gelu(x64 @ w64.T + b64, approximate="tanh") + r.double()
    out64.backward(g.double())
    assert rel_err(out, out64.detach()) <= 1e-6
    for got, want in [(gx, x64.grad), (gw, w64.grad), (gb, b64.grad)]:
        assert rel_err(got, want) <= 1e-5


# ------------------------------------------------------------------------------------------------------------
# GPU (compiled kernels, autotuning, bf16, larger shapes)
# ------------------------------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(
    not _HAS_CUDA or _INTERPRET,
    reason="needs a CUDA GPU with the Triton interpreter off (these tests run the compiled, autotuned kernels)",
)


GPU_CASES = [(torch.bfloat16, act) for act in ACTS] + [
    (dtype, act) for dtype in (torch.float16, torch.float32) for act in ("none", "gelu")
]


@gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype,act", GPU_CASES, ids=[f"{str(d)[6:]}-{a}" for d, a in GPU_CASES])
def test_gpu_forward_backward(dtype, act):
    # each new (shape, dtype, activation) autotunes: keep the matrix small
    gen = torch.Generator().manual_seed(20)
    for lead, n, k in [((4, 256), 768, 512), ((3, 333), 1000, 1000), ((3, 7), 129, 65)]:
        x = make((*lead, k), dtype, gen)
        w = make((n, k), dtype, gen, k**-0.5)
        b = make((n,), torch.float32, gen)
        r = make((*lead, n), dtype, gen)
        _, pre = check_fwd(x, w, b, act, r)
        g = make((*lead, n), dtype, gen)
        if act == "none":
            pre = ref_fwd_eager(x, w, b, act, r)[1]
        for mask in MASKS:
            check_bwd(g, x, w, pre, act, mask)


@gpu
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_mixed_weight_and_noncontiguous(dtype):
    gen = torch.Generator().manual_seed(21)
    m, n, k = 2048, 1024, 768
    x = make((k, m), dtype, gen).t()
    w = make((n, k), torch.float32, gen, k**-0.5)
    b = make((n,), torch.float32, gen)
    _, pre = check_fwd(x, w, b, "gelu", None)
    g = make((m, n), dtype, gen)
    for mask in MASKS:
        check_bwd(g, x, w, pre, "gelu", mask)


@gpu
@pytest.mark.cuda
def test_gpu_small_weight_many_rows_split():
    # N x K tile grid smaller than the GPU: the weight gradient is split over M automatically
    gen = torch.Generator().manual_seed(22)
    m, n, k = 65536, 64, 96
    x = make((m, k), torch.bfloat16, gen)
    w = make((n, k), torch.float32, gen, k**-0.5)
    pre = make((m, n), torch.bfloat16, gen)
    g = make((m, n), torch.bfloat16, gen)
    check_bwd(g, x, w, pre, "silu", [True, True, True])
    check_bwd(g, x, w, pre, "silu", [False, True, True])
