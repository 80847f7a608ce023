"""Fused mixed-precision linear: every CPU backend against a float64 reference, gradients, opcheck, compile,
bad inputs, the FusedLinear module (state_dict, autocast, DDP)."""

import contextlib
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    Passthrough,
    cpu_backends,
    native_cpu_kernels,
    rel_err,
    requires_cuda,
    run_at_isa,
    skip_unsupported,
)
from torch import nn

import fastdl
from fastdl import backends
from fastdl._distributed import finish_worker
from fastdl.nn import FusedLinear
from fastdl.ops import ACTIVATIONS, fused_linear
from fastdl.ops.fused_linear import activation_fn, fused_linear_backward_op

BACKENDS = cpu_backends("fused_linear")
HAS_CPP = "cpp" in BACKENDS


def ref64(x, w, b, act, res):
    """float64 reference of the op's contract (weight rounded to x's dtype first)."""
    pre = x.double() @ w.to(x.dtype).double().t()
    if b is not None:
        pre = pre + b.double()
    out = activation_fn(pre, act)
    if res is not None:
        out = out + res.double()
    return out


def eager_err(x, w, b, act, res, ref):
    """PyTorch's own error at x's dtype (F.linear + activation + add), the bar a low-precision kernel is held to."""
    c = x.dtype
    y = activation_fn(F.linear(x, w.to(c), None if b is None else b.to(c)), act)
    if res is not None:
        y = y + res.to(c)
    return rel_err(y, ref)


def make(M, K, N, dtype, bias=True, res=False, w_dtype=None, lead=()):
    x = torch.randn(*lead, M, K, dtype=dtype)
    w = (torch.randn(N, K) / max(K, 1) ** 0.5).to(w_dtype or dtype)
    b = torch.randn(N).to(dtype) if bias else None
    r = torch.randn(*lead, M, N).to(dtype) if res else None
    return x, w, b, r


def check_close(out, x, w, b, act, res):
    ref = ref64(x, w, b, act, res)
    assert out.shape == ref.shape and out.dtype == x.dtype
    err = rel_err(out, ref)
    if x.dtype == torch.float32:
        assert err <= 2e-5, err
    else:
        assert err <= 2 * eager_err(x, w, b, act, res, ref) + 1e-4, (err, eager_err(x, w, b, act, res, ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("M,K,N", [(1, 7, 33), (7, 33, 1), (33, 127, 7), (127, 64, 65), (5, 256, 300)])
def test_forward_matches_reference(backend, dtype, act, M, K, N):
    x, w, b, r = make(M, K, N, dtype, bias=(M % 2 == 1), res=(N % 2 == 1))
    skip_unsupported(backend, x)
    with fastdl.use_backend(backend):
        out = fused_linear(x, w, b, act, r)
    check_close(out, x, w, b, act, r)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("M", [1, 3, 16, 40, 300])
def test_small_and_large_m_paths(backend, M):
    """The C++ kernel switches between its own small-M kernel and a GEMM + fused epilogue by M."""
    for dtype in (torch.float32, torch.bfloat16):
        if backend == "triton" and dtype == torch.bfloat16:
            continue  # bf16 is not supported by the Triton interpreter
        x, w, b, r = make(M, 512, 96, dtype, res=True)
        with fastdl.use_backend(backend):
            out = fused_linear(x, w, b, "gelu", r)
        check_close(out, x, w, b, "gelu", r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_precision_fp32_weight(backend):
    x, _, b, r = make(9, 130, 70, torch.bfloat16, res=True)
    if backend == "triton":
        x, b, r = x.half(), b.half(), r.half()  # the interpreter has no bf16: check the mixed path with fp16
    w = torch.randn(70, 130) / 130**0.5  # fp32 master weight
    with fastdl.use_backend(backend):
        out = fused_linear(x, w, b.float(), "silu", r)
    check_close(out, x, w, b.float(), "silu", r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_noncontiguous(backend):
    x = torch.randn(4, 3, 40, 2)[..., 0].transpose(0, 1)  # [3, 4, 40], not contiguous
    assert not x.is_contiguous()
    w = torch.randn(50, 80)[:, ::2]  # [50, 40] strided
    b = torch.randn(100)[::2]
    res = torch.randn(3, 50, 4).transpose(1, 2)
    with fastdl.use_backend(backend):
        out = fused_linear(x, w, b, "relu", res)
    assert out.shape == (3, 4, 50)
    check_close(out, x, w, b, "relu", res)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_empty_k(backend):
    with fastdl.use_backend(backend):
        out = fused_linear(torch.randn(0, 16), torch.randn(8, 16), torch.randn(8), "gelu")
        assert out.shape == (0, 8)
        out = fused_linear(torch.randn(2, 0, 16), torch.randn(8, 16), None, "relu")
        assert out.shape == (2, 0, 8)
        b = torch.randn(8)
        out = fused_linear(torch.randn(3, 0), torch.randn(8, 0), b, "none")  # K == 0: only the bias remains
        torch.testing.assert_close(out, b.expand(3, 8))


# --------------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_backward_matches_reference(backend, dtype, act):
    M, K, N = 33, 70, 45
    x, w, b, r = make(M, K, N, dtype, res=True, lead=(2,))
    skip_unsupported(backend, x)
    g = torch.randn(2, M, N).to(dtype)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, r)]
    with fastdl.use_backend(backend):
        out = fused_linear(*leaves[:3], act, leaves[3])
    out.backward(g)
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, w.to(dtype), b, r)]
    ref64(ref_leaves[0], ref_leaves[1], ref_leaves[2], act, ref_leaves[3]).backward(g.double())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for name, got, want in zip("xwbr", leaves, ref_leaves):
        assert got.grad is not None and got.grad.dtype == got.dtype, name
        assert rel_err(got.grad, want.grad) <= tol, (name, rel_err(got.grad, want.grad))


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("onednn", ["1", "0"])
@pytest.mark.parametrize(
    "M,K,N", [(359, 512, 72), (359, 64, 130), (100, 128, 10), (513, 40, 50), (65, 300, 77), (17, 96, 50), (2, 33, 9)]
)
def test_cpp_dispatch_regions_forward_backward(dtype, threads, onednn, M, K, N, monkeypatch):
    """The C++ kernels pick a path per shape (weight streaming, packed weight panels, packed x^T, small-M kernels,
    at::mm for some fp32 gradients, the oneDNN route) and split rows or columns over threads by cost: shapes on every
    side of those rules, with gelu, bias, residual and (bf16) an fp32 master weight, forward and backward against
    float64; with the oneDNN route allowed and switched off (FASTDL_CPU_ONEDNN=0: fastdl's kernels at every shape)."""
    monkeypatch.setenv("FASTDL_CPU_ONEDNN", onednn)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b, r = make(M, K, N, dtype, res=True, w_dtype=torch.float32)
        g = torch.randn(M, N).to(dtype)
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, r)]
        with fastdl.use_backend("cpp"):
            out = fused_linear(*leaves[:3], "gelu", leaves[3])
        check_close(out.detach(), x, w, b, "gelu", r)
        out.backward(g)
        ref_leaves = [t.detach().double().requires_grad_() for t in (x, w.to(dtype), b, r)]
        ref64(ref_leaves[0], ref_leaves[1], ref_leaves[2], "gelu", ref_leaves[3]).backward(g.double())
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        for name, got, want in zip("xwbr", leaves, ref_leaves):
            assert rel_err(got.grad, want.grad) <= tol, (name, rel_err(got.grad, want.grad))
        with fastdl.use_backend("cpp"):
            plain = fused_linear(x, w.to(dtype), None, "none")
        check_close(plain, x, w.to(dtype), None, "none", None)
    finally:
        torch.set_num_threads(old_threads)


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension")
@pytest.mark.parametrize("M,K,N", [(300, 64, 200), (300, 64, 600), (257, 192, 40), (300, 256, 200)])
def test_cpp_bf16_backward_rounds_dpre_like_autocast_on_every_route(M, K, N):
    """bf16 training's dpre is rounded to bf16 before the gradient GEMMs (autocast's gelu_backward output), also where
    the AVX2 family hands the GEMMs to MKL's sgemm on an fp32 dpre (K <= 192: grad_x, and grad_weight up to N = 512):
    grad_weight (fp32) matches the reference backend's to ~1e-5; the same GEMMs on an unrounded dpre differ by ~2e-3."""
    torch.manual_seed(M + K + N)
    x, w, b = torch.randn(M, K).bfloat16(), torch.randn(N, K) / K**0.5, torch.randn(N)
    g = torch.randn(M, N).bfloat16()
    grads = {}
    for be in ("cpp", "torch"):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        with fastdl.use_backend(be):
            fused_linear(*leaves, "gelu").backward(g)
        grads[be] = [t.grad for t in leaves]
    (gx, gw, gb), (rx, rw, rb) = grads["cpp"], grads["torch"]
    assert gx.dtype == torch.bfloat16 and gw.dtype == gb.dtype == torch.float32
    assert rel_err(gw, rw) <= 2e-4, rel_err(gw, rw)
    assert rel_err(gx, rx) <= 1e-3 and rel_err(gb, rb) <= 1e-5, (rel_err(gx, rx), rel_err(gb, rb))


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,K,N,act", [(1030, 64, 300, "gelu"), (600, 100, 513, "none"), (700, 24, 400, "silu")])
def test_cpp_large_fp32_outputs_written_with_streaming_stores_match_reference(threads, M, K, N, act):
    """fp32 outputs of 1 MB and more leave the AVX2 GEMM through non-temporal stores (aligned full vectors; rows of an
    odd width alternate between aligned and not, partial tiles go through the buffered epilogue): forward with bias and
    residual, and a training step (the pre-activation kept, normal stores) against float64."""
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(M)
        x, w, b, r = make(M, K, N, torch.float32, res=True)
        with fastdl.use_backend("cpp"):
            check_close(fused_linear(x, w, b, act, r), x, w, b, act, r)
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            out = fused_linear(*leaves, act)
            check_close(out.detach(), x, w, b, act, None)
            g = torch.randn(M, N)
            out.backward(g)
        refs = [t.double().requires_grad_() for t in (x, w, b)]
        ref64(*refs, act, None).backward(g.double())
        for name, got, want in zip("xwb", leaves, refs):
            assert rel_err(got.grad, want.grad) <= 2e-5, (name, rel_err(got.grad, want.grad))
    finally:
        torch.set_num_threads(old_threads)


def onednn_dtypes() -> str:
    return fastdl.info(print_result=False)["cpu"].get("fused_linear_onednn", "") if HAS_CPP else ""


# Shapes the C++ forward routes to oneDNN (fused_linear.cpp: fwd_f32_onednn on AVX-512, fwd_bf16_onednn on
# AVX512-BF16), with K, N and M not multiples of 8 or 16.
@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension")
@pytest.mark.parametrize("dtype,M,K,N", [(torch.float32, 200, 300, 70), (torch.float32, 65, 129, 33),
                                         (torch.bfloat16, 128, 64, 200), (torch.bfloat16, 300, 37, 515)])
def test_cpp_onednn_route_is_taken_where_the_rules_say_and_matches_reference(dtype, M, K, N, monkeypatch):
    """At a routed shape the op returns exactly oneDNN's own result (one primitive with the activation as post-op),
    every activation with and without a residual matches float64, fp32 training (pre-activation kept) gives the
    reference gradients; FASTDL_CPU_ONEDNN=0 runs fastdl's own kernels there (within the same bound, other bits)."""
    name = "fp32" if dtype == torch.float32 else "bf16"
    if name not in onednn_dtypes():
        pytest.skip(f"this process does not route {name} to oneDNN (CPU level or PyTorch's oneDNN: fastdl info)")
    torch.manual_seed(0)
    x, w, b, r = make(M, K, N, dtype, res=True)
    with fastdl.use_backend("cpp"):
        for act in ACTIVATIONS:
            for res in (None, r):
                check_close(fused_linear(x, w, b, act, res), x, w, b, act, res)
        routed = fused_linear(x, w, b, "gelu")
        assert torch.equal(routed, torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [None], "none"))
        if dtype == torch.float32:  # training: the pre-activation from oneDNN, the activation in fastdl's pass
            leaves = [t.clone().requires_grad_() for t in (x, w, b, r)]
            out = fused_linear(*leaves[:3], "silu", leaves[3])
            g = torch.randn_like(out)
            out.backward(g)
            refs = [t.double().requires_grad_() for t in (x, w, b, r)]
            ref64(*refs[:3], "silu", refs[3]).backward(g.double())
            for n, got, want in zip("xwbr", leaves, refs):
                assert rel_err(got.grad, want.grad) <= 2e-5, n
        monkeypatch.setenv("FASTDL_CPU_ONEDNN", "0")
        own = fused_linear(x, w, b, "gelu")
    check_close(own, x, w, b, "gelu", None)
    assert not torch.equal(own, routed), "FASTDL_CPU_ONEDNN=0 still ran oneDNN"


# Shapes (M, K, N) on every side of the C++ kernels' rules at every ISA level: weight streaming (small M), broadcast
# kernels (M <= 32: 1-4 vectors of x rows, partial row tiles, odd K), packed-panel GEMMs (several K blocks, strips,
# super blocks, threads split by columns or by rows), K not a multiple of 8 / 16 / 32, N not a multiple of 16 / 48.
LEVEL_SHAPES = [(1, 7, 33), (2, 300, 17), (4, 33, 50), (5, 1, 9), (7, 33, 7), (16, 127, 53), (24, 257, 48),
                (32, 64, 65), (33, 520, 70), (127, 40, 130), (500, 19, 33), (61, 4095, 20), (9, 65, 100),
                (14, 1030, 37), (9, 4104, 20), (40, 2056, 24)]  # the last two: fp32 routes by K (fwd_f32_onednn)


def check_cpp_levels_match() -> str:
    """Run in a process capped by FASTDL_CPU_ISA (test below): the C++ kernels of that level against float64, forward
    and backward, every activation, residual, fp32 and bf16, fp32 master weights with bf16 x, non-contiguous inputs,
    NaN propagation. Returns the fused_linear kernel family the process ran."""
    torch.manual_seed(0)
    configs = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)]
    with fastdl.use_backend("cpp"):
        for i, (M, K, N) in enumerate(LEVEL_SHAPES):
            act = ACTIVATIONS[i % len(ACTIVATIONS)]
            for dtype, w_dtype in configs:
                x, w, b, r = make(M, K, N, dtype, bias=i % 3 != 1, res=i % 2 == 0, w_dtype=w_dtype)
                g = torch.randn(M, N).to(dtype)
                leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b, r)]
                out = fused_linear(*leaves[:3], act, leaves[3])
                check_close(out.detach(), x, w, b, act, r)
                out.backward(g)
                refs = [t.detach().double().requires_grad_() if t is not None else None
                        for t in (x, w.to(dtype), b, r)]
                ref64(refs[0], refs[1], refs[2], act, refs[3]).backward(g.double())
                tol = 2e-5 if dtype == torch.float32 else 2e-2
                for name, got, want in zip("xwbr", leaves, refs):
                    if got is not None:
                        assert got.grad.dtype == got.dtype, (name, M, K, N, dtype)
                        err = rel_err(got.grad, want.grad)
                        assert err <= tol, (name, err, M, K, N, dtype, w_dtype, act)
        # fp32 master weights are rounded to bf16 like autocast: the same outputs as with the rounded weight (up to
        # the fp32 summation order; a kernel that skipped the rounding would change ~1/4 of the bf16 outputs)
        for M, K, N in [(1, 512, 64), (16, 512, 64), (64, 512, 64)]:
            x = torch.randn(M, K, dtype=torch.bfloat16)
            w = torch.randn(N, K) / K**0.5
            a, b_ = fused_linear(x, w), fused_linear(x, w.bfloat16())
            assert (a != b_).float().mean().item() < 0.02, (M, K, N)
        # non-contiguous x / weight / bias / residual
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(4, 3, 40, 2)[..., 0].transpose(0, 1).to(dtype)
            w = torch.randn(50, 80)[:, ::2].to(dtype)
            b = torch.randn(100)[::2].to(dtype)
            res = torch.randn(3, 50, 4).transpose(1, 2).to(dtype)
            check_close(fused_linear(x, w, b, "gelu_tanh", res), x, w, b, "gelu_tanh", res)
        # NaN in one row of x reaches exactly that row of the output
        for dtype in (torch.float32, torch.bfloat16):
            for M in (1, 8, 40):
                x = torch.randn(M, 64).to(dtype)
                x[M // 2, 3] = float("nan")
                out = fused_linear(x, torch.randn(24, 64).to(dtype), None, "gelu")
                assert out[M // 2].isnan().all() and not out[torch.arange(M) != M // 2].isnan().any(), (dtype, M)
        check_activations_against_float64()
    return fastdl.info(print_result=False)["cpu"]["kernels"]["fused_linear"]


def check_activations_against_float64():
    """Every activation and its derivative as the kernels compute them (the vectorised exp / erf / sigmoid forms of
    the level), on a fine grid of [-12, 12]: within 1e-6 of float64 (absolute, relative above 1); gelu saturates
    cleanly for huge |x| (0 and x, derivative 0 and 1: a cancellation there once gave -3e22 at x = -1e30)."""
    grid = torch.linspace(-12, 12, 24001)
    for act in ACTIVATIONS:
        xx = grid[:, None].clone().requires_grad_()
        y = fused_linear(xx, torch.ones(1, 1), None, act)
        y.backward(torch.ones_like(y))
        x64 = grid.double().requires_grad_()
        r = activation_fn(x64, act)
        r.backward(torch.ones_like(r))
        for what, got, want in (("forward", y.detach()[:, 0], r.detach()), ("derivative", xx.grad[:, 0], x64.grad)):
            err = ((got.double() - want).abs() / want.abs().clamp(min=1)).max().item()
            assert err <= 1e-6, (act, what, err)
    big = torch.tensor([[-1e30], [-100.0], [100.0], [1e30], [float("nan")]], requires_grad=True)
    y = fused_linear(big, torch.ones(1, 1), None, "gelu")
    y.sum().backward()
    want_y = torch.tensor([0.0, 0.0, 100.0, 1e30, float("nan")])
    want_d = torch.tensor([0.0, 0.0, 1.0, 1.0, float("nan")])
    torch.testing.assert_close(y.detach()[:, 0], want_y, atol=1e-6, rtol=1e-6, equal_nan=True)
    torch.testing.assert_close(big.grad[:, 0], want_d, atol=1e-6, rtol=1e-6, equal_nan=True)


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_bf16"])
def test_cpp_isa_levels_match(isa):
    """FASTDL_CPU_ISA caps the kernels' instruction set (once per process): every level gives the contract's results,
    and the process runs the kernel family of the level it was capped at (the CPU's own level where that is lower)."""
    out = run_at_isa(isa, "import test_fused_linear as t; print('kernels', t.check_cpp_levels_match())")
    family = out.split()[-1]
    native = native_cpu_kernels()["fused_linear"]
    levels = ["scalar", "avx2", "avx512", "avx512_bf16"]
    assert family == levels[min(levels.index(isa), levels.index(native))], (isa, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_mixed_fp32_master_weight(backend):
    low = torch.float16 if backend == "triton" else torch.bfloat16  # the interpreter has no bf16
    x = torch.randn(20, 64, dtype=low, requires_grad=True)
    w = (torch.randn(48, 64) / 8).requires_grad_()
    b = torch.randn(48, requires_grad=True)
    with fastdl.use_backend(backend):
        fused_linear(x, w, b, "gelu").float().square().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and x.grad.dtype == low
    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w.to(low), b))
    ref64(xr, wr, br, "gelu", None).square().sum().backward()
    for got, want in ((x, xr), (w, wr), (b, br)):
        assert rel_err(got.grad, want.grad) <= 3e-2


def test_gradcheck_float64():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    for act in ("none", "gelu", "gelu_tanh", "silu"):
        assert torch.autograd.gradcheck(lambda x, w, b, r, a=act: fused_linear(x, w, b, a, r), (x, w, b, r))


def test_backward_needs_preact():
    x = torch.randn(3, 4, requires_grad=True)
    out, _ = torch.ops.fastdl.fused_linear(x, torch.randn(5, 4), None, "gelu", None, False)
    with pytest.raises(RuntimeError, match="save_preact"):
        out.sum().backward()


# --------------------------------------------------------------------------------------- opcheck and compile
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = torch.randn(7, 33, requires_grad=True)
    w = torch.randn(9, 33, requires_grad=True)
    b = torch.randn(9, requires_grad=True)
    r = torch.randn(7, 9)
    with fastdl.use_backend(backend):
        torch.library.opcheck(torch.ops.fastdl.fused_linear.default, (x, w, b, "gelu", r, True))
        low = torch.float16 if backend == "triton" else torch.bfloat16
        torch.library.opcheck(torch.ops.fastdl.fused_linear.default, (x.detach().to(low), w.detach(), None,
                                                                      "relu", None, False))
        g = torch.randn(7, 9)
        pre = torch.randn(7, 9)
        torch.library.opcheck(torch.ops.fastdl.fused_linear_backward.default,
                              (g, x.detach(), w.detach(), pre, "silu", [True, True, True]))


def test_compile_fullgraph():
    model = nn.Sequential(FusedLinear(32, 64, activation="gelu"), FusedLinear(64, 16, activation="none"))
    x = torch.randn(8, 32, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None


@pytest.mark.slow
def test_compile_inductor_fullgraph():
    model = FusedLinear(16, 24, activation="silu")
    x = torch.randn(4, 16)
    out = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(out, model(x))


# ---------------------------------------------------------------------------------------------- bad inputs
# Each bad argument: (call, exception type, message). The message names the argument and the expected value; the
# type is the kind of mistake (TypeError: dtype, ValueError: shape or value, RuntimeError: device), on every backend.
_X, _W = torch.randn(4, 8), torch.randn(5, 8)
_G = torch.randn(4, 5)
BAD_FORWARD = {
    "mismatched K": (lambda: fused_linear(_X, torch.randn(5, 7)), ValueError,
                     r"weight must have shape \[N, K\] with K = x.shape\[-1\] = 8, got weight of shape \[5, 7\]"),
    "int x": (lambda: fused_linear(_X.to(torch.int32), _W), TypeError,
              r"x must be a floating tensor \(float32, bfloat16, float16\), got dtype torch.int32"),
    "0-d x": (lambda: fused_linear(torch.tensor(1.0), _W), ValueError, r"x must have at least one dimension"),
    "activation": (lambda: fused_linear(_X, _W, None, "tanh"), ValueError,
                   r"activation must be one of 'none', 'relu', 'gelu', 'gelu_tanh', 'silu', got 'tanh'"),
    "residual shape": (lambda: fused_linear(_X, _W, None, "relu", torch.randn(4, 6)), ValueError,
                       r"residual must have shape \[4, 5\], got \[4, 6\]"),
    "bias shape": (lambda: fused_linear(_X, _W, torch.randn(6)), ValueError,
                   r"bias must have shape \[5\], got \[6\]"),
    "int bias": (lambda: fused_linear(_X, _W, torch.ones(5, dtype=torch.int32)), TypeError,
                 r"bias must be a floating tensor, got dtype torch.int32"),
    "weight dtype": (lambda: fused_linear(_X, torch.randn(5, 8, dtype=torch.float64)), TypeError,
                     r"weight.dtype must be x.dtype \(torch.float32\) or float32, got torch.float64"),
    "3-D weight": (lambda: fused_linear(_X, torch.randn(5, 8, 1)), ValueError,
                   r"weight must be 2-D \[N, K\], got shape \[5, 8, 1\]"),
}
BAD_BACKWARD = {
    "grad_out shape": (lambda: fused_linear_backward_op(torch.randn(4, 6), _X, _W, _G, "relu", [True] * 3),
                       ValueError, r"grad_out must have shape \[4, 5\], got \[4, 6\]"),
    "preact missing": (lambda: fused_linear_backward_op(_G, _X, _W, torch.empty(0), "gelu", [True] * 3),
                       ValueError, r"preact must have shape \[4, 5\], got \[0\] \(activation 'gelu' needs it"),
    "activation": (lambda: fused_linear_backward_op(_G, _X, _W, _G, "gelu_erf", [True] * 3), ValueError,
                   r"fused_linear_backward: activation must be one of 'none', .*, got 'gelu_erf'"),
    "mismatched K": (lambda: fused_linear_backward_op(_G, _X, torch.randn(5, 9), _G, "relu", [True] * 3),
                     ValueError, r"weight must have shape \[N, K\] with K = x.shape\[-1\] = 8"),
    "int grad_out": (lambda: fused_linear_backward_op(_G.int(), _X, _W, _G, "relu", [True] * 3), TypeError,
                     r"grad_out must be a floating tensor, got dtype torch.int32"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [*BAD_FORWARD, *(f"backward {k}" for k in BAD_BACKWARD)])
def test_bad_inputs_raise_one_type_naming_argument_and_expected_value(backend, case):
    call, exc, message = BAD_BACKWARD[case[9:]] if case.startswith("backward ") else BAD_FORWARD[case]
    with fastdl.use_backend(backend), pytest.raises(exc, match=message) as info:
        call()
    assert type(info.value) is exc, (type(info.value), info.value)  # not a subclass (e.g. NotImplementedError)


@pytest.mark.parametrize("case", list(BAD_FORWARD))
def test_bad_inputs_raise_the_same_error_when_a_gradient_is_needed(case, monkeypatch):
    # an eager call that needs a gradient runs the op's autograd.Function (not the dispatcher's autograd): the same
    # checks, exception types and words as without gradients
    monkeypatch.setattr(sys.modules[__name__], "_X", _X.clone().requires_grad_())
    call, exc, message = BAD_FORWARD[case]
    with pytest.raises(exc, match=message) as info:
        call()
    assert type(info.value) is exc, (type(info.value), info.value)


def _op_node(out):
    node = out.grad_fn  # the op's node (under the non-view of a 3-D output)
    return node.next_functions[0][0] if type(node).__name__ == "UnsafeViewBackward0" else node


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_eager_autograd_matches_the_dispatcher_autograd(activation, backend):
    # an eager call that needs a gradient runs the C++ backend's own autograd kernel (csrc/fused_linear_autograd.cpp)
    # or, on the other backends, the op's autograd.Function - not the dispatcher's autograd: the same results
    if backend not in cpu_backends("fused_linear"):
        pytest.skip(f"backend {backend} is not available here")
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    r = torch.randn(3, 5, 24, requires_grad=True)
    g = torch.randn(3, 5, 24)
    results = []
    with fastdl.use_backend(backend):
        for mode in (None, Passthrough()):
            for t in (x, w, b, r):
                t.grad = None
            if mode is None:
                out = fused_linear(x, w, b, activation, r)
            else:
                with mode:
                    out = fused_linear(x, w, b, activation, r)
            results.append((type(_op_node(out)).__name__, out.detach(), out._base))
            out.backward(g)
            results[-1] += tuple(t.grad.clone() for t in (x, w, b, r))
    (eager_fn, *eager), (disp_fn, *disp) = results
    assert eager_fn != disp_fn  # two different paths were taken
    assert eager_fn == ("CppFunction" if backend == "cpp" else "fused_linear_eagerBackward"), eager_fn
    assert eager[1] is None and disp[1] is None  # neither hands out a view
    for a, c in zip(eager[:1] + eager[2:], disp[:1] + disp[2:]):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize(
    "needs", [(1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (1, 1, 0, 1), (0, 1, 1, 0)], ids=str
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_cpp_autograd_gives_exactly_the_gradients_asked_for(needs, with_bias):
    # the C++ autograd kernel maps each argument to its autograd edge (bias and residual are optional): every subset
    # of x / weight / bias / residual needing a gradient gets the float64 reference's gradients and None elsewhere
    if "cpp" not in cpu_backends("fused_linear"):
        pytest.skip("the compiled extension is not loaded")
    torch.manual_seed(1)
    x = torch.randn(2, 7, 33)
    w = torch.randn(20, 33) / 33**0.5
    b = torch.randn(20) if with_bias else None
    r = torch.randn(2, 7, 20)
    leaves = [x, w, b, r]
    for t, need in zip(leaves, needs):
        if t is not None and need:
            t.requires_grad_()
    if not any(t is not None and t.requires_grad for t in leaves):
        pytest.skip("bias is absent: nothing needs a gradient")
    g = torch.randn(2, 7, 20)
    with fastdl.use_backend("cpp"):
        out = fused_linear(x, w, b, "silu", r)
    assert type(_op_node(out)).__name__ == "CppFunction"
    out.backward(g)
    ref_leaves = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    xr, wr, br, rr = ref_leaves
    ref = F.silu(F.linear(xr, wr, br)) + rr
    ref.backward(g.double())
    for t, tr in zip(leaves, ref_leaves):
        if t is None:
            continue
        if not t.requires_grad:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype
        torch.testing.assert_close(t.grad.double(), tr.grad, rtol=1e-4, atol=1e-5)


def test_cpp_autograd_kernels_record_no_graph_when_no_argument_needs_one():
    # The C++ Autograd kernels of fused_linear, int8_linear_qat and sparse24_linear call the device kernel directly when
    # grad mode is off or no argument requires a gradient: the same output, and no graph node; with a gradient needed,
    # a node that backpropagates.
    if "cpp" not in cpu_backends("fused_linear"):
        pytest.skip("the compiled extension is not loaded")
    from fastdl.ops import sparse24 as sp

    torch.manual_seed(2)
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    values, meta = sp.compress_2_4(sp.mask_2_4(w) * w)
    cpp = torch.ops.fastdl_cpp
    calls = {
        "fused_linear": lambda x, w, b: cpp.fused_linear(x, w, b, "gelu", None, True)[0],
        "int8_linear_qat": lambda x, w, b: cpp.int8_linear_qat(x, w, b, False),
        "sparse24_linear": lambda x, w, b: cpp.sparse24_linear(x, values if w is None else w, meta, b),
    }
    for name, call in calls.items():
        wt = None if name == "sparse24_linear" else w
        with torch.no_grad():
            ref = call(x, wt, b)
        frozen = call(x, wt, b)  # grad mode on, nothing requires a gradient
        assert frozen.grad_fn is None and not frozen.requires_grad, name
        assert torch.equal(frozen, ref), name
        xg = x.clone().requires_grad_()
        out = call(xg, wt, b)
        assert type(out.grad_fn).__name__ == "CppFunction", name
        assert torch.equal(out.detach(), ref), name
        out.sum().backward()
        assert xg.grad is not None and xg.grad.shape == x.shape and torch.isfinite(xg.grad).all(), name


def test_cpp_autograd_without_saved_preact_says_how_to_fix_it():
    if "cpp" not in cpu_backends("fused_linear"):
        pytest.skip("the compiled extension is not loaded")
    from fastdl.ops.fused_linear import fused_linear_op

    x = torch.randn(4, 8, requires_grad=True)
    with fastdl.use_backend("cpp"):
        out, _ = fused_linear_op(x, torch.randn(6, 8), None, "gelu", None, False)
    assert type(out.grad_fn).__name__ == "CppFunction"
    with pytest.raises(RuntimeError, match="save_preact=False"):
        out.sum().backward()


@pytest.mark.parametrize("needs_grad", [False, True])
def test_autocast_fast_path_matches_the_dispatcher_autocast(needs_grad):
    # under autocast an eager call applies the op's autocast rule itself (x to bf16, fp32 master weights and bias
    # kept) instead of going through the dispatcher's Autocast kernel: the same outputs, dtypes and gradients
    torch.manual_seed(2)
    x = torch.randn(3, 9, 32)
    w = torch.randn(40, 32) / 32**0.5
    b = torch.randn(40)
    for t in (x, w, b):
        t.requires_grad_(needs_grad)
    g = torch.randn(3, 9, 40, dtype=torch.bfloat16)
    results = []
    for mode in (None, Passthrough()):
        for t in (x, w, b):
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16), (mode or contextlib.nullcontext()):
            out = fused_linear(x, w, b, "gelu")
        assert out.dtype == torch.bfloat16
        grads = ()
        if needs_grad:
            out.backward(g)
            grads = tuple(t.grad.clone() for t in (x, w, b))
            assert [t.dtype for t in grads] == [torch.float32] * 3
        results.append((out.detach(), *grads))
    for a, c in zip(*results):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_autocast_for_another_device_leaves_cpu_calls_alone():
    # autocast on for CUDA only: a CPU call is not cast (as the dispatcher's AutocastCPU key is off)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    was = torch.is_autocast_enabled("cuda")
    torch.set_autocast_enabled("cuda", True)  # (torch.autocast("cuda") turns itself off on a machine without CUDA)
    try:
        assert torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
        out = fused_linear(x, w)
    finally:
        torch.set_autocast_enabled("cuda", was)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w.t())


def test_vmap_over_the_op_matches_per_sample_calls():
    # under a torch.func transform the op goes through the dispatcher (not the eager fast paths)
    x, w, b = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(5)
    out = torch.func.vmap(lambda xx: fused_linear(xx, w, b, "gelu"))(x)
    torch.testing.assert_close(out, torch.stack([fused_linear(xi, w, b, "gelu") for xi in x]))


def test_backend_request_is_read_on_every_call_after_the_choice_is_cached(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    monkeypatch.delenv("FASTDL_BACKEND", raising=False)
    fused_linear(x, w)
    auto = backends.select("fused_linear", "cpu", (x, w))
    monkeypatch.setenv("FASTDL_BACKEND", "torch")
    assert backends.select("fused_linear", "cpu", (x, w)) == "torch"
    with fastdl.use_backend("auto"):
        assert backends.select("fused_linear", "cpu", (x, w)) == auto
    monkeypatch.setenv("FASTDL_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="FASTDL_BACKEND='nonsense' is not one of"):
        fused_linear(x, w)
    monkeypatch.setenv("FASTDL_BACKEND", " AUTO ")
    assert backends.select("fused_linear", "cpu", (x, w)) == auto


@requires_cuda
def test_device_mismatch_raises():
    with pytest.raises(RuntimeError, match=r"weight must be on device cpu \(the device of x\), got cuda:0"):
        fused_linear(torch.randn(4, 8), torch.randn(5, 8, device="cuda"))


def test_explicit_backend_that_cannot_serve_raises():
    # Triton cannot serve bf16 on the CPU (interpreter mode) nor anything on the CPU without it: explicit -> error
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    with fastdl.use_backend("triton"):
        with pytest.raises(fastdl.BackendUnavailableError, match="triton"):
            fused_linear(x, w)
    with pytest.raises(ValueError, match="unknown fastdl backend"):
        with fastdl.use_backend("cudnn"):
            pass


def test_env_backend_choice(monkeypatch):
    monkeypatch.setenv("FASTDL_BACKEND", "torch")
    assert backends.select("fused_linear", "cpu", ()) == "torch"
    monkeypatch.setenv("FASTDL_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="FASTDL_BACKEND"):
        backends.requested()


def test_auto_falls_back_for_unsupported_dtype():
    x = torch.randn(3, 4, dtype=torch.float64)
    assert backends.select("fused_linear", "cpu", (x, torch.randn(2, 4, dtype=torch.float64))) == "torch"


# ------------------------------------------------------------------------------------------------- module
def test_module_is_drop_in_for_linear():
    lin = nn.Linear(20, 30)
    fl = FusedLinear(20, 30, activation="none")
    assert set(fl.state_dict()) == set(lin.state_dict())
    fl.load_state_dict(lin.state_dict())
    x = torch.randn(6, 20)
    torch.testing.assert_close(fl(x), lin(x), rtol=1e-5, atol=1e-5)
    fl2 = FusedLinear.from_linear(lin, activation="gelu")
    assert fl2.weight is lin.weight
    torch.testing.assert_close(fl2(x), F.gelu(lin(x)), rtol=1e-5, atol=1e-5)
    back = fl2.to_linear()
    assert isinstance(back, nn.Sequential) and back[0].weight is lin.weight
    torch.testing.assert_close(back(x), fl2(x), rtol=1e-5, atol=1e-5)
    assert isinstance(FusedLinear(3, 4, bias=False, activation="none").to_linear(), nn.Linear)
    with pytest.raises(ValueError, match="activation"):
        FusedLinear(3, 4, activation="swish")


def test_module_residual_and_save_load():
    m = FusedLinear(16, 16, activation="silu")
    x = torch.randn(5, 16)
    y = m(x, residual=x)
    torch.testing.assert_close(y, F.silu(F.linear(x, m.weight, m.bias)) + x, rtol=1e-5, atol=1e-5)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.pt")
        torch.save(m.state_dict(), path)
        m2 = FusedLinear(16, 16, activation="silu")
        m2.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(m2(x, residual=x), y)


def test_module_autocast_bf16_cpu_trains_fp32_master_weights():
    torch.manual_seed(0)
    model = nn.Sequential(FusedLinear(16, 32, activation="gelu"), FusedLinear(32, 1, activation="none"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(64, 16)
    y = x[:, :1] * 2 - x[:, 1:2]
    losses = []
    for _ in range(30):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
            assert out.dtype == torch.bfloat16
            loss = F.mse_loss(out.float(), y)
        loss.backward()
        assert model[0].weight.grad.dtype == torch.float32
        opt.step()
        losses.append(loss.item())
    assert model[0].weight.dtype == torch.float32
    assert losses[-1] < 0.5 * losses[0]


def test_info_lists_backend_per_op():
    d = fastdl.info(print_result=False)
    assert "fused_linear" in d["ops"] and d["ops"]["fused_linear"]["cpu"]["backend"] in ("cpp", "torch")
    assert d["cpu_isa"] in ("avx512_bf16", "avx512", "avx2", "scalar")
    assert d["cpu"]["level"] == d["cpu_isa"] and d["cpu"]["model"]
    assert set(d["cpu"]["kernels"]) == {"fused_linear", "int8", "sparse24", "int4"}
    assert d["extension"]["source"] in ("aot", "jit", "missing")


# ---------------------------------------------------------------------------------------------------- DDP
def _ddp_worker(rank, world, result_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    # file:// rendezvous: no TCP port to race for with other test runs on the machine
    dist.init_process_group("gloo", init_method=f"file://{result_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(FusedLinear(12, 24, activation="gelu"), FusedLinear(24, 3, activation="none"))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(64, 12, generator=g)
    target = torch.randn(64, 3, generator=g)
    shard = slice(rank * 32, (rank + 1) * 32)
    for _ in range(5):
        opt.zero_grad()
        F.mse_loss(ddp(data[shard]), target[shard]).backward()
        opt.step()
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def test_ddp_two_processes_gloo_matches_single_process():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ddp_worker, args=(2, d), nprocs=2, join=True)
        r0 = torch.load(os.path.join(d, "rank0.pt"))
        r1 = torch.load(os.path.join(d, "rank1.pt"))
    torch.manual_seed(0)
    model = nn.Sequential(FusedLinear(12, 24, activation="gelu"), FusedLinear(24, 3, activation="none"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(64, 12, generator=g)
    target = torch.randn(64, 3, generator=g)
    for _ in range(5):  # the global batch; DDP averages the two half-batch gradients = mean over 64
        opt.zero_grad()
        F.mse_loss(model(data), target).backward()
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)
        torch.testing.assert_close(r0[k], v, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------------- CUDA
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ACTIVATIONS)
def test_cuda_forward_backward_every_backend(dtype, act):
    for backend in ("triton", "cpp", "torch"):
        if not backends.available(backend, "fused_linear", "cuda")[0]:
            continue
        x, w, b, r = (t.cuda() if t is not None else None for t in make(127, 96, 33, dtype, res=True))
        with fastdl.use_backend(backend):
            out = fused_linear(x, w, b, act, r)
        check_close(out.cpu(), x.cpu(), w.cpu(), b.cpu(), act, r.cpu())


@requires_cuda
def test_cuda_module_autocast_fp16_gradscaler():
    model = FusedLinear(64, 64, activation="gelu").cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert model.weight.dtype == torch.float32 and torch.isfinite(model.weight).all()

