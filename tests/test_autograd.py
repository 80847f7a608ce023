"""Autograd beyond first order (issue 34, items 4 and 5): double backward, forward-mode AD and torch.func transforms
on every differentiable op and module, against float64 / fp32 PyTorch references.

* gradcheck + gradgradcheck in float64 on the torch backend (the C++ and Triton kernels take no float64); the
  int8 ops take no float64 at all: their x is fp32, and what gradcheck can check is checked there (the
  straight-through estimator is not the numerical derivative of a quantized forward: its Jacobian is compared
  with the one of the linear function it is defined by, exactly).
* every CPU backend (cpp, triton where the interpreter runs, torch) in fp32: first- and second-order gradients
  against the float64 result, and the gradient-penalty loss of the issue against an nn.Linear model.
* torch.func grad / jvp / vmap / jacrev and torch.autograd.forward_ad, through fastdl.ops and torch.ops.fastdl.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_backends, rel_err
from torch.autograd import forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, jacrev, jvp, vmap

import fastdl
from fastdl import ops
from fastdl.ops.fused_linear import ACTIVATIONS

M, K, N = 3, 8, 5  # small odd shapes (K a multiple of 4 for 2:4)
F64 = torch.float64


@pytest.fixture(autouse=True)
def _quiet():
    # PyTorch's own deprecation notes (torch.jit.script inside its jvp decompositions) and vmap's fallback notice
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        yield


def _rand(*shape, dtype=F64, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def _first_and_second(fn, inputs, seed=0):
    """g1 = d<fn, u>/d inputs (create_graph), g2 = d<g1, v>/d inputs for fixed random u, v: the first and second
    order gradients a gradient-penalty loss needs (None where an input gets none)."""
    gen = torch.Generator().manual_seed(seed)
    out = fn(*inputs)
    u = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    g1 = torch.autograd.grad(out, inputs, u, create_graph=True, allow_unused=True)
    pen = sum((g * torch.randn(g.shape, generator=gen, dtype=F64).to(g.dtype)).sum() for g in g1 if g is not None)
    g2 = torch.autograd.grad(pen, inputs, allow_unused=True) if pen.requires_grad else (None,) * len(inputs)
    return [None if g is None else g.detach() for g in g1], [None if g is None else g.detach() for g in g2]


def _assert_close_grads(got, want, tol, what):
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None or not w.abs().sum():
            assert g is None or not g.abs().sum(), f"{what}: input {i} has a gradient, the reference none"
            continue
        assert g is not None, f"{what}: input {i} has no gradient (the reference has one)"
        assert rel_err(g, w) < tol, f"{what}: input {i}: relative error {rel_err(g, w):.2e}"


def _backend_ok(backend, op):
    if backend not in cpu_backends(op):
        pytest.skip(f"backend {backend} cannot serve {op} on the CPU here")


# --------------------------------------------------------------------------------------------- fused_linear
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_linear_gradcheck_gradgradcheck(activation, bias, residual):
    x, w = _rand(M, K, grad=True), _rand(N, K, grad=True)
    b = _rand(N, grad=True) if bias else None
    r = _rand(M, N, grad=True) if residual else None
    inputs = tuple(t for t in (x, w, b, r) if t is not None)

    def fn(*ts):
        it = iter(ts)
        xx, ww = next(it), next(it)
        bb = next(it) if bias else None
        rr = next(it) if residual else None
        return ops.fused_linear(xx, ww, bb, activation, rr)

    with fastdl.use_backend("torch"):
        assert gradcheck(fn, inputs)
        assert gradgradcheck(fn, inputs)


@pytest.mark.parametrize("backend", ["cpp", "triton", "torch"])
@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_fused_linear_fp32_first_and_second_order(backend, activation):
    _backend_ok(backend, "fused_linear")
    x, w, b, r = _rand(M, K), _rand(N, K), _rand(N), _rand(M, N)

    def fn(*ts):
        return ops.fused_linear(ts[0], ts[1], ts[2], activation, ts[3])

    with fastdl.use_backend("torch"):
        want1, want2 = _first_and_second(fn, [t.clone().requires_grad_() for t in (x, w, b, r)])
    with fastdl.use_backend(backend):
        got1, got2 = _first_and_second(fn, [t.float().requires_grad_() for t in (x, w, b, r)])
    _assert_close_grads(got1, want1, 1e-5, f"fused_linear {backend} first order")
    _assert_close_grads(got2, want2, 1e-5, f"fused_linear {backend} second order")


# ---------------------------------------------------------------------------------------------- int8 ops
def _int8_weights(k=K, grouped=False):
    w = torch.randn(N, k)
    if grouped:
        return ops.quantize_per_group(w)
    return ops.quantize_per_channel(w)


def _dequant(w_q, w_scale, w_group=None):
    d = w_q.double()
    if w_group is not None:
        d = d * w_group.double().repeat_interleave(16, dim=1)[:, : w_q.shape[1]]
    return d * w_scale.double()[:, None]


@pytest.mark.parametrize("backend", ["cpp", "triton", "torch"])
@pytest.mark.parametrize("kind", ["int8_linear", "weight_only", "weight_only_grouped"])
def test_int8_frozen_ops_straight_through_first_and_second_order(backend, kind):
    """Differentiable in x and bias: grad_x = g @ dequant(W) exactly (the straight-through estimator through the
    activation quantization), grad_b = sum g; the backward is linear in g and does not depend on x, so the second
    derivative is 0 in x and the gradient of <grad_x, v> in g is v @ dequant(W).T; gradgradcheck in fp32."""
    op_name = "int8_linear" if kind == "int8_linear" else "int8_weight_only_linear"
    _backend_ok(backend, op_name)
    k = 40  # groups of 16 with a partial one
    grouped = kind == "weight_only_grouped"
    w_q, w_scale, *rest = _int8_weights(k, grouped)
    w_group = rest[0] if grouped else None

    def fn(x, b):
        if kind == "int8_linear":
            return ops.int8_linear(x, w_q, w_scale, b)
        return ops.int8_weight_only_linear(x, w_q, w_scale, b, w_group)

    x, b = _rand(M, k, dtype=torch.float32, grad=True), _rand(N, dtype=torch.float32, grad=True)
    with fastdl.use_backend(backend):
        g1, g2 = _first_and_second(fn, [x, b])
        d = _dequant(w_q, w_scale, w_group)
        gen = torch.Generator().manual_seed(0)
        u = torch.randn(M, N, generator=gen, dtype=F64)
        v = torch.randn(M, k, generator=gen, dtype=F64)
        _assert_close_grads(g1, [u @ d, u.sum(0)], 1e-5, f"{kind} {backend} first order")
        assert g2[0] is None or not g2[0].abs().sum()  # no second derivative in x
        assert g2[1] is None or not g2[1].abs().sum()
        # the double backward: d<grad_x, v>/d grad_out = v @ d.T
        out = fn(x, b)
        gu = torch.zeros_like(out, requires_grad=True)
        (gx,) = torch.autograd.grad(out, x, gu, create_graph=True)
        (ggu,) = torch.autograd.grad((gx * v.float()).sum(), gu)
        assert rel_err(ggu, v @ d.t()) < 1e-5
        assert gradgradcheck(fn, (x, b), eps=1e-2, atol=1e-2, rtol=1e-2, fast_mode=True)
        if kind != "int8_linear":  # a float forward (x is not quantized): the numerical derivative is the gradient
            assert gradcheck(fn, (x, b), eps=1e-2, atol=1e-2, rtol=1e-2, fast_mode=True)


def _qat_straight_through(x, weight, bias, weight_only):
    """The straight-through model of int8_linear_qat in plain PyTorch: the op's value, nn.Linear's derivative."""
    value = ops.int8_linear_qat(x.detach(), weight.detach(), bias.detach(), weight_only)  # (no_grad keeps tangents)
    lin = F.linear(x, weight, bias)
    return value + (lin - lin.detach())


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("weight_only", [False, True])
def test_int8_linear_qat_first_and_second_order(backend, weight_only):
    """The straight-through estimator: the gradients of x @ W.T + b (float W) at the quantized forward's output;
    second order: those of the bilinear x @ W.T (d grad_x / dW = g, d grad_W / dx = g.T). gradgradcheck in fp32."""
    _backend_ok(backend, "int8_linear_qat")
    if backend == "cpp" and weight_only:
        pytest.skip("the cpp backend does not serve the weight-only QAT forward (a composite of the routed ops)")
    k = 32
    x, w, b = (_rand(*s, dtype=torch.float32, grad=True) for s in ((M, k), (N, k), (N,)))
    with fastdl.use_backend(backend):
        got1, got2 = _first_and_second(lambda *t: ops.int8_linear_qat(*t, weight_only), [x, w, b])
        want1, want2 = _first_and_second(lambda *t: _qat_straight_through(*t, weight_only), [x, w, b])
        _assert_close_grads(got1, want1, 1e-5, f"int8_linear_qat {backend} first order")
        _assert_close_grads(got2, want2, 1e-5, f"int8_linear_qat {backend} second order")
        assert gradgradcheck(
            lambda *t: ops.int8_linear_qat(*t, weight_only), (x, w, b), eps=1e-2, atol=2e-2, rtol=1e-2, fast_mode=True
        )


# -------------------------------------------------------------------------------------------------- 2:4 ops
def _compressed(dtype=F64, k=K):
    return ops.compress_2_4(torch.randn(N, k, dtype=dtype))


def test_decompress_2_4_gradcheck_gradgradcheck():
    values, meta = _compressed()
    values.requires_grad_()
    with fastdl.use_backend("torch"):
        assert gradcheck(lambda v: ops.decompress_2_4(v, meta), (values,))
        assert gradgradcheck(lambda v: ops.decompress_2_4(v, meta), (values,))


@pytest.mark.parametrize("bias", [False, True])
def test_sparse24_linear_gradcheck_gradgradcheck(bias):
    values, meta = _compressed()
    x, b = _rand(M, K, grad=True), (_rand(N, grad=True) if bias else None)
    values.requires_grad_()
    inputs = (x, values, b) if bias else (x, values)
    with fastdl.use_backend("torch"):
        assert gradcheck(lambda x, v, *b: ops.sparse24_linear(x, v, meta, *b), inputs)
        assert gradgradcheck(lambda x, v, *b: ops.sparse24_linear(x, v, meta, *b), inputs)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_sparse24_fp32_first_and_second_order(backend):
    _backend_ok(backend, "sparse24_linear")
    values, meta = _compressed()
    x, b = _rand(M, K), _rand(N)

    def fn(x, v, b):
        return ops.sparse24_linear(x, v, meta, b)

    def fn_decompress(v):
        return ops.decompress_2_4(v, meta).pow(2)

    with fastdl.use_backend("torch"):
        want1, want2 = _first_and_second(fn, [t.clone().requires_grad_() for t in (x, values, b)])
        wantd = _first_and_second(fn_decompress, [values.clone().requires_grad_()])
    with fastdl.use_backend(backend):
        got1, got2 = _first_and_second(fn, [t.float().requires_grad_() for t in (x, values, b)])
        gotd = _first_and_second(fn_decompress, [values.float().requires_grad_()])
    _assert_close_grads(got1, want1, 1e-5, f"sparse24_linear {backend} first order")
    _assert_close_grads(got2, want2, 1e-5, f"sparse24_linear {backend} second order")
    for got, want in zip(gotd, wantd):
        _assert_close_grads(got, want, 1e-5, f"decompress_2_4 {backend}")


# ---------------------------------------------------------------------------------------------------- modules
def _module(kind, dtype):
    torch.manual_seed(0)
    if kind == "FusedLinear":
        return fastdl.nn.FusedLinear(K, N, activation="gelu", dtype=dtype)
    if kind == "Sparse24Linear":
        return fastdl.nn.Sparse24Linear.from_linear(torch.nn.Linear(K, N, dtype=dtype), trainable=True)
    lin = torch.nn.Linear(32, N)
    return fastdl.nn.Int8Linear.from_linear(lin, trainable=True)


def _equivalent(kind, m):
    """The same model in plain PyTorch (nn.Linear's ops), with its parameters as leaves: (fn(x), parameters, map from
    the module's parameters to gradients comparable with them)."""
    if kind == "FusedLinear":
        w, b = m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()
        return (lambda x: F.gelu(F.linear(x, w, b))), (w, b), lambda: {"weight": w.grad, "bias": b.grad}
    if kind == "Sparse24Linear":
        dense = ops.decompress_2_4(m.values.detach(), m.meta).clone().requires_grad_()
        b = m.bias.detach().clone().requires_grad_()
        keep = ops.unpack_meta(m.meta, K)
        return (
            (lambda x: F.linear(x, dense, b)),
            (dense, b),
            lambda: {"values": dense.grad[keep].reshape(N, K // 2), "bias": b.grad},
        )
    w, b = m.weight.detach().clone().requires_grad_(), m.bias.detach().clone().requires_grad_()
    return (lambda x: _qat_straight_through(x, w, b, False)), (w, b), lambda: {"weight": w.grad, "bias": b.grad}


def _penalty_grads(fn, x):
    """The gradient-penalty loss of the issue: grad_x of sum(fn(x)^2) (create_graph), then backward of its square
    plus the loss; returns x's gradient."""
    loss = fn(x).pow(2).sum()
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + g.pow(2).sum()).backward()
    return x.grad


@pytest.mark.parametrize("backend", ["cpp", "triton", "torch"])
@pytest.mark.parametrize("kind", ["FusedLinear", "Sparse24Linear", "Int8Linear"])
def test_module_gradient_penalty_matches_nn_linear(kind, backend):
    """Issue 34 item 4: the parameter gradients of a gradient-penalty loss (FusedLinear's weight.grad was None;
    0.93 / 0.50 / 0.53 relative errors) equal those of the same model written with nn.Linear's ops."""
    op = {"FusedLinear": "fused_linear", "Sparse24Linear": "sparse24_linear", "Int8Linear": "int8_linear_qat"}[kind]
    _backend_ok(backend, op)
    m = _module(kind, torch.float32)
    k = m.in_features
    x = torch.randn(M, k)
    ref_fn, _, ref_grads = _equivalent(kind, m)
    with fastdl.use_backend(backend):
        gx = _penalty_grads(m, x.clone().requires_grad_())
    gx_ref = _penalty_grads(ref_fn, x.clone().requires_grad_())
    assert rel_err(gx, gx_ref) < 1e-5
    for name, want in ref_grads().items():
        got = getattr(m, name).grad
        assert got is not None, f"{kind}.{name}.grad is None ({backend})"
        assert rel_err(got, want) < 1e-5, f"{kind}.{name} ({backend}): {rel_err(got, want):.2e}"


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("kind", ["FusedLinear", "Sparse24Linear", "Int8Linear"])
def test_gradient_penalty_through_the_dispatcher(kind, backend):
    """The same loss with fastdl's calls sent through the dispatcher (a TorchFunctionMode): the ops' registered
    autograd (``torch.ops.fastdl.<op>``'s Autograd kernel, which the C++ autograd nodes call when a graph of the
    backward is recorded) with the backend's kernels in the forward."""
    from conftest import Passthrough

    op = {"FusedLinear": "fused_linear", "Sparse24Linear": "sparse24_linear", "Int8Linear": "int8_linear_qat"}[kind]
    _backend_ok(backend, op)
    m = _module(kind, torch.float32)
    x = torch.randn(M, m.in_features)
    ref_fn, _, ref_grads = _equivalent(kind, m)
    with fastdl.use_backend(backend), Passthrough():
        gx = _penalty_grads(m, x.clone().requires_grad_())
    assert rel_err(gx, _penalty_grads(ref_fn, x.clone().requires_grad_())) < 1e-5
    for name, want in ref_grads().items():
        got = getattr(m, name).grad
        assert got is not None and rel_err(got, want) < 1e-5, f"{kind}.{name} ({backend})"


@pytest.mark.parametrize("kind", ["FusedLinear", "Sparse24Linear"])
def test_module_gradcheck_gradgradcheck_float64(kind):
    """gradcheck / gradgradcheck of the module in x and every parameter (torch.func.functional_call)."""
    m = _module(kind, F64)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    params = tuple(p.detach().clone().requires_grad_() for n, p in m.named_parameters() if p.requires_grad)
    x = _rand(M, K, grad=True)

    def fn(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    with fastdl.use_backend("torch"):
        assert gradcheck(fn, (x, *params))
        assert gradgradcheck(fn, (x, *params))


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_int8linear_trainable_gradgradcheck(backend):
    """Int8Linear(trainable=True) in fp32 (the int8 ops take no float64): gradgradcheck of the module in x, weight
    and bias (its first-order gradients: test_module_gradient_penalty_matches_nn_linear)."""
    _backend_ok(backend, "int8_linear_qat")
    m = _module("Int8Linear", torch.float32)
    names = ["weight", "bias"]
    params = tuple(getattr(m, n).detach().clone().requires_grad_() for n in names)
    x = _rand(M, 32, dtype=torch.float32, grad=True)

    def fn(x, *ps):
        return torch.func.functional_call(m, dict(zip(names, ps)), (x,))

    with fastdl.use_backend(backend):
        assert gradgradcheck(fn, (x, *params), eps=1e-2, atol=2e-2, rtol=1e-2, fast_mode=True)


# ----------------------------------------------------------------------------- torch.func and forward-mode AD
def _op_cases():
    """name -> (fn(x, p): the op on input x and differentiable parameter p, the same in plain PyTorch, x, p)."""
    torch.manual_seed(1)
    x32, x = torch.randn(M, 32), torch.randn(M, K)
    w, b = torch.randn(N, K), torch.randn(N)
    w32 = torch.randn(N, 32)
    w_q, w_scale = ops.quantize_per_channel(w32)
    g_q, g_scale, g_group = ops.quantize_per_group(w32)
    values, meta = ops.compress_2_4(torch.randn(N, K))
    keep = ops.unpack_meta(meta, K)

    def scatter(v):
        return torch.zeros(N, K, dtype=v.dtype).masked_scatter(keep, v)

    def ste(op_fn, lin_fn, *args):
        """The op's value (on detached arguments: no_grad would keep forward-AD tangents), lin_fn's derivative."""
        lin = lin_fn(*args)
        return op_fn(*(a.detach() for a in args)) + (lin - lin.detach())

    def weight_only(x, b):
        return ops.int8_weight_only_linear(x, g_q, g_scale, b, g_group)

    dq = _dequant(w_q, w_scale).float()
    dg = _dequant(g_q, g_scale, g_group).float()
    return {
        "fused_linear": (lambda x, w: ops.fused_linear(x, w, b, "gelu"), lambda x, w: F.gelu(F.linear(x, w, b)), x, w),
        "fused_linear_residual": (
            lambda x, r: ops.fused_linear(x, w, b, "silu", r),
            lambda x, r: F.silu(F.linear(x, w, b)) + r,
            x,
            torch.randn(M, N),
        ),
        "int8_linear": (
            lambda x, b: ops.int8_linear(x, w_q, w_scale, b),
            lambda x, b: ste(lambda x, b: ops.int8_linear(x, w_q, w_scale, b), lambda x, b: F.linear(x, dq, b), x, b),
            x32,
            b,
        ),
        "int8_weight_only_linear": (
            lambda x, b: ops.int8_weight_only_linear(x, g_q, g_scale, b, g_group),
            lambda x, b: ste(weight_only, lambda x, b: F.linear(x, dg, b), x, b),
            x32,
            b,
        ),
        "int8_linear_qat": (
            lambda x, w: ops.int8_linear_qat(x, w, b),
            lambda x, w: ste(lambda x, w: ops.int8_linear_qat(x, w, b), lambda x, w: F.linear(x, w, b), x, w),
            x32,
            w32,
        ),
        "int8_linear_qat_weight_only": (
            lambda x, w: ops.int8_linear_qat(x, w, b, True),
            lambda x, w: ste(lambda x, w: ops.int8_linear_qat(x, w, b, True), lambda x, w: F.linear(x, w, b), x, w),
            x32,
            w32,
        ),
        "sparse24_linear": (
            lambda x, v: ops.sparse24_linear(x, v, meta, b),
            lambda x, v: F.linear(x, scatter(v), b),
            x,
            values,
        ),
        "decompress_2_4": (
            lambda x, v: x @ ops.decompress_2_4(v, meta).t(),
            lambda x, v: x @ scatter(v).t(),
            x,
            values,
        ),
    }


CASES = list(_op_cases())
TOL = 1e-5


@pytest.mark.parametrize("case", CASES)
def test_torch_func_transforms_match_plain_pytorch(case):
    """Issue 34 item 5: jvp gave zeros, grad / jacrev failed ("must override the setup_context staticmethod")."""
    fn, ref, x, p = _op_cases()[case]
    tx, tp = torch.randn_like(x), torch.randn_like(p)
    # jvp
    out, tangent = jvp(fn, (x, p), (tx, tp))
    out_r, tangent_r = jvp(ref, (x, p), (tx, tp))
    assert torch.equal(out, out_r)  # the op's value
    assert tangent.abs().sum() > 0 and rel_err(tangent, tangent_r) < TOL
    # grad (of a non-linear scalar, so that the value matters)
    for argnum in (0, 1):
        g = grad(lambda x, p: fn(x, p).pow(2).sum(), argnums=argnum)(x, p)
        g_r = grad(lambda x, p: ref(x, p).pow(2).sum(), argnums=argnum)(x, p)
        assert rel_err(g, g_r) < TOL, (argnum, rel_err(g, g_r))
    # jacrev
    j = jacrev(fn, argnums=(0, 1))(x, p)
    j_r = jacrev(ref, argnums=(0, 1))(x, p)
    for a, b in zip(j, j_r):
        assert rel_err(a, b) < TOL
    # vmap over a batch of inputs: the value of the op on each
    xs = torch.stack([x, 2 * x, -x])
    batched = vmap(fn, in_dims=(0, None))(xs, p)
    with torch.no_grad():
        looped = torch.stack([fn(xi, p) for xi in xs])
    torch.testing.assert_close(batched, looped, rtol=1e-6, atol=1e-6)
    # grad of grad (a Hessian-vector product through torch.func)
    hv = grad(lambda x: (grad(lambda x: fn(x, p).pow(2).sum())(x) * tx).sum())(x)
    hv_r = grad(lambda x: (grad(lambda x: ref(x, p).pow(2).sum())(x) * tx).sum())(x)
    assert rel_err(hv, hv_r) < TOL


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("direct", [False, True], ids=["fastdl.ops", "torch.ops.fastdl"])
def test_forward_ad_dual_tensors(case, direct):
    """torch.autograd.forward_ad: the tangent was None; calls straight to torch.ops.fastdl gave none either.
    (``direct`` runs the op under a TorchFunctionMode, which sends fastdl's calls through the dispatcher.)"""
    fn, ref, x, p = _op_cases()[case]
    tx, tp = torch.randn_like(x), torch.randn_like(p)
    with fwAD.dual_level():
        if direct:
            from conftest import Passthrough

            with Passthrough():
                out = fn(fwAD.make_dual(x, tx), fwAD.make_dual(p, tp))
        else:
            out = fn(fwAD.make_dual(x, tx), fwAD.make_dual(p, tp))
        primal, tangent = fwAD.unpack_dual(out)
    _, tangent_r = jvp(ref, (x, p), (tx, tp))
    assert tangent is not None, f"{case}: no tangent"
    assert rel_err(tangent, tangent_r) < TOL
    with torch.no_grad():  # the reference ran (not the kernel): the same value up to the order of the sums
        torch.testing.assert_close(primal, fn(x, p), rtol=1e-5, atol=1e-5)


def test_raw_ops_under_jvp_and_forward_ad():
    """torch.ops.fastdl.<op> itself (its Autograd kernel): jvp and dual tensors give the true tangent, not zeros."""
    x, w, t = torch.randn(M, K), torch.randn(N, K), torch.randn(M, K)
    want = t @ w.t()
    _, tangent = jvp(lambda x: torch.ops.fastdl.fused_linear(x, w, None, "none", None, False)[0], (x,), (t,))
    assert rel_err(tangent, want) < 1e-6
    with fwAD.dual_level():
        out, _ = torch.ops.fastdl.fused_linear(fwAD.make_dual(x, t), w, None, "none", None, False)
        assert rel_err(fwAD.unpack_dual(out).tangent, want) < 1e-6
    values, meta = _compressed(torch.float32)
    tv = torch.randn_like(values)
    _, tangent = jvp(lambda v: torch.ops.fastdl.decompress_2_4(v, meta), (values,), (tv,))
    assert torch.equal(tangent, ops.decompress_2_4(tv, meta))


@pytest.mark.parametrize("kind", ["FusedLinear", "Sparse24Linear", "Int8Linear"])
def test_modules_under_torch_func(kind):
    """functional_call + jvp, and grad, on the modules: the same as the plain-PyTorch model."""
    m = _module(kind, torch.float32)
    ref_fn, _, _ = _equivalent(kind, m)
    x = torch.randn(M, m.in_features)
    t = torch.randn_like(x)
    _, tangent = jvp(lambda x: torch.func.functional_call(m, dict(m.named_parameters()), (x,)), (x,), (t,))
    _, tangent_r = jvp(ref_fn, (x,), (t,))
    assert rel_err(tangent, tangent_r) < TOL
    g = grad(lambda x: m(x).pow(2).sum())(x)
    g_r = grad(lambda x: ref_fn(x).pow(2).sum())(x)
    assert rel_err(g, g_r) < TOL


def test_plain_calls_under_a_dual_level_without_tangents_run_the_kernels():
    """A dual level open but no tangent on the arguments: the op's own path (not the reference)."""
    x, w = torch.randn(M, K), torch.randn(N, K)
    with fwAD.dual_level():
        out = ops.fused_linear(x, w, None, "relu")
        assert fwAD.unpack_dual(out).tangent is None
    torch.testing.assert_close(out, F.relu(x @ w.t()))


def test_hessian_of_fused_linear_matches_nn_linear():
    """torch.autograd.functional.hessian (double backward, create_graph) in float64."""
    x, w, b = _rand(M, K), _rand(N, K), _rand(N)
    with fastdl.use_backend("torch"):
        h = torch.autograd.functional.hessian(lambda w: ops.fused_linear(x, w, b, "gelu_tanh").pow(3).sum(), w)
    h_r = torch.autograd.functional.hessian(
        lambda w: F.gelu(F.linear(x, w, b), approximate="tanh").pow(3).sum(), w
    )
    assert rel_err(h, h_r) < 1e-12
    assert math.isfinite(h.sum().item())
