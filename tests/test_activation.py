"""fastdl.ops.activation: an activation of fused_linear's list on its own (the layers whose kernels have no activation
epilogue apply theirs with it), against float64 PyTorch, forward and backward, every dtype, odd shapes, every CPU
kernel family; errors; opcheck; double backward; and Sparse24Linear using it."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err, run_at_isa

import fastdl
from fastdl.ops import ACTIVATIONS, activation
from fastdl.ops.fused_linear import activation_fn

BACKENDS = ("cpp", "torch")
SHAPES = ((1, 64), (3, 5, 7), (130, 33), (65,), (), (0, 4), (2, 0))
# one rounding of the result to the dtype (fp32: both sides compute the function in fp32, ~1 ulp apart)
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float64: 1e-12}


def _cpp_kernel() -> bool:
    return fastdl.backends.available("cpp", "activation", "cpu")[0]


def check_values(dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64)) -> int:
    """Forward and backward against float64 for every activation, dtype and shape; returns the cases checked."""
    g = torch.Generator().manual_seed(3)
    n = 0
    for dt in dtypes:
        for act in ACTIVATIONS:
            for shape in SHAPES:
                x = (torch.randn(shape, generator=g) * 3).to(dt).requires_grad_()
                gout = torch.randn(shape, generator=g).to(dt)
                y = activation(x, act)
                assert y.dtype == dt and y.shape == x.shape and y.is_contiguous(), (dt, act, shape)
                y.backward(gout)
                x64 = x.detach().double().requires_grad_()
                ref = activation_fn(x64, act)
                ref.backward(gout.double())
                if y.numel():
                    assert rel_err(y, ref) <= TOL[dt], (dt, act, shape, rel_err(y, ref))
                    assert rel_err(x.grad, x64.grad) <= TOL[dt], (dt, act, shape, rel_err(x.grad, x64.grad))
                else:
                    assert x.grad.shape == x.shape
                n += 1
    return n


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_float64_every_dtype_activation_and_shape(backend):
    if backend == "cpp" and not _cpp_kernel():
        pytest.skip("no C++ activation kernel in this build")
    dtypes = (torch.float32, torch.bfloat16, torch.float16) + ((torch.float64,) if backend == "torch" else ())
    with fastdl.use_backend(backend):  # (float64 runs the reference: the cpp backend refuses it, by name)
        assert check_values(dtypes) == len(ACTIVATIONS) * len(SHAPES) * len(dtypes)


def test_eager_calls_run_the_cpp_kernel_and_its_cpp_autograd_node():
    if not _cpp_kernel():
        pytest.skip("no C++ activation kernel in this build")
    x = torch.randn(4, 8, requires_grad=True)
    assert fastdl.backends.select("activation", "cpu", (x, "gelu")) == "cpp"
    assert type(activation(x, "gelu").grad_fn).__name__ == "CppFunction"  # no Python autograd.Function


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "native"])
def test_cpp_kernels_of_every_isa_level(isa):
    if not _cpp_kernel():
        pytest.skip("no C++ activation kernel in this build")
    out = run_at_isa(isa, "import fastdl, test_activation as t\nwith fastdl.use_backend('cpp'):\n"
                          "    print(t.check_values((__import__('torch').float32, __import__('torch').bfloat16)))")
    assert int(out.strip().splitlines()[-1]) == len(ACTIVATIONS) * len(SHAPES) * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_name_the_op(backend):
    with fastdl.use_backend(backend):
        with pytest.raises(ValueError, match=r"activation: activation must be one of 'none', 'relu'.*got 'tanh'"):
            activation(torch.randn(3), "tanh")
        with pytest.raises(TypeError, match="activation: x must be a floating tensor"):
            activation(torch.ones(3, dtype=torch.int32), "relu")
        with pytest.raises(ValueError, match=r"activation_backward: grad_out must have shape \[3\]"):
            torch.ops.fastdl.activation_backward(torch.randn(4), torch.randn(3), "gelu")


def test_nan_inf_and_extremes_as_the_float64_function():
    """NaN and +-inf give the float64 function's values (gelu(+inf) = +inf, where ATen's fp32 GELU, through
    oneDNN, gives NaN), and silu's tiny negative tail is kept (subnormal, not flushed)."""
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 2.0, 30.0, -30.0, 100.0, -100.0])
    for act in ACTIVATIONS:
        ref = activation_fn(x.double(), act).float()
        torch.testing.assert_close(activation(x, act), ref, equal_nan=True, rtol=2e-6, atol=1e-40)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    with fastdl.use_backend(backend):
        for act in ("gelu", "silu"):
            torch.library.opcheck(torch.ops.fastdl.activation.default, (torch.randn(5, 7, requires_grad=True), act))
            torch.library.opcheck(torch.ops.fastdl.activation.default, (torch.randn(2, 3).bfloat16(), act))


def test_double_backward_matches_float64():
    """create_graph=True: the gradient has a graph whose derivative is act'' (the C++ node re-runs the public op)."""
    for act in ("gelu", "gelu_tanh", "silu"):
        x = torch.randn(6, 5, requires_grad=True)
        (gx,) = torch.autograd.grad(activation(x, act).sum(), x, create_graph=True)
        (gxx,) = torch.autograd.grad(gx.sum(), x)
        x64 = x.detach().double().requires_grad_()
        (r,) = torch.autograd.grad(activation_fn(x64, act).sum(), x64, create_graph=True)
        (rr,) = torch.autograd.grad(r.sum(), x64)
        assert rel_err(gx, r) <= 1e-5 and rel_err(gxx, rr) <= 1e-4, act
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: activation(t, "gelu"), (x,))


def test_autocast_keeps_x_dtype_and_the_fast_path():
    """Under CPU autocast the op runs in x's dtype (as F.gelu does), eager calls keep the C++ node."""
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 8, dtype=dt, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = activation(x, "gelu")
        assert y.dtype == dt
        if _cpp_kernel():
            assert type(y.grad_fn).__name__ == "CppFunction"
        y.sum().backward()
        x64 = x.detach().double().requires_grad_()
        activation_fn(x64, "gelu").sum().backward()
        assert rel_err(x.grad, x64.grad) <= TOL[dt]


def test_compile_fullgraph():
    x = torch.randn(3, 16)
    f = torch.compile(lambda t: activation(t, "gelu") * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(f(x), activation_fn(x, "gelu") * 2, rtol=2e-6, atol=0)


def test_sparse24_layer_applies_its_activation_with_it():
    """Sparse24Linear's activation (its kernels have no epilogue) runs through the op on the CPU: the trainable
    layer's step matches nn.Linear + GELU on the same 2:4 weight, values and gradients."""
    from fastdl.nn import Sparse24Linear
    from fastdl.ops import compress_2_4, decompress_2_4

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(decompress_2_4(*compress_2_4(lin.weight)))
    layer = Sparse24Linear.from_linear(lin, activation="gelu", trainable=True)
    x = torch.randn(3, 64, requires_grad=True)
    y = layer(x)
    if _cpp_kernel():
        assert "Cpp" in type(y.grad_fn).__name__
    g = torch.randn_like(y)
    y.backward(g)
    x64 = x.detach().double().requires_grad_()
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x64, lin.weight.double(), lin.bias.double()))
    ref.backward(g.double())
    assert rel_err(y, ref) <= 1e-5 and rel_err(x.grad, x64.grad) <= 1e-5
