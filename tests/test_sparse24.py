"""2:4 sparsity: the ops on every CPU backend against the pure-PyTorch contract (masks, exact round trip, sparse GEMM
vs dense GEMM on the masked weight), bad inputs, opcheck, the Triton kernel in interpreter mode (subprocess), the
Sparse24Linear module (state dict, compile, paths), the training workflow (masks kept, DDP, accuracy recovery)."""

import io
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    check_cpp_autograd_matches_dispatcher,
    cpu_backends,
    native_cpu_kernels,
    rel_err,
    requires_cuda,
    run_at_isa,
)
from torch import nn

import fastdl
import fastdl.ops.sparse24 as sp  # registers the ops (until fastdl.ops imports it)
from fastdl import backends, sparsity
from fastdl._distributed import finish_worker
from fastdl.nn import FusedLinear, decode_extra_state
from fastdl.nn.sparse24 import Sparse24Linear

OPS = ("mask_2_4", "compress_2_4", "decompress_2_4", "sparse24_linear")
BACKENDS = cpu_backends("sparse24_linear")
HAS_CPP = "cpp" in BACKENDS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ref_mask(w: torch.Tensor) -> torch.Tensor:
    """The contract written independently: per group, sort by (|w| desc with NaN largest, index asc), keep 2."""
    N, K = w.shape
    a = w.double().abs().reshape(N, K // 4, 4)
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    big = torch.isinf(a) & ~torch.isnan(w.double().reshape(N, K // 4, 4))  # true inf ranks below NaN
    key = torch.where(torch.isnan(w.double().reshape(N, K // 4, 4)), 3.0, torch.where(big, 2.0, 0.0))
    idx = torch.arange(4, dtype=torch.float64).expand_as(a)
    out = torch.zeros(N, K // 4, 4, dtype=torch.bool)
    for n in range(N):
        for g in range(K // 4):
            order = sorted(range(4), key=lambda i: (-key[n, g, i].item(), -a[n, g, i].item() if key[n, g, i] < 2
                                                    else 0.0, idx[n, g, i].item()))
            out[n, g, order[0]] = out[n, g, order[1]] = True
    return out.reshape(N, K)


def random_weight(N, K, dtype, specials=True):
    w = torch.randn(N, K).to(dtype)
    if specials and K >= 12 and N >= 2:
        w[0, :4] = 1.0  # all tied: keep positions 0, 1
        w[0, 4:8] = torch.tensor([0.0, -0.0, 0.0, 0.0])  # zeros (and -0) tie
        w[0, 8:12] = torch.tensor([float("nan"), 1.0, float("inf"), float("-inf")])  # NaN > inf, inf ties -inf
        w[1, :4] = torch.tensor([-2.0, 2.0, 1.0, -2.0])  # |-2| == |2|: lower index wins
    return w


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


SHAPES = [(1, 4), (3, 8), (5, 12), (7, 44), (9, 100), (33, 128), (17, 132), (2, 1028)]


# -------------------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mask_property_and_tie_rule(backend, dtype):
    for N, K in SHAPES:
        w = random_weight(N, K, dtype)
        with fastdl.use_backend(backend):
            m = sp.mask_2_4(w)
        assert m.dtype == torch.bool and m.shape == (N, K)
        assert bool((m.reshape(N, K // 4, 4).sum(-1) == 2).all()), "exactly 2 kept per group of 4"
        if K <= 44:
            assert torch.equal(m, ref_mask(w)), (N, K)
        else:
            assert torch.equal(m, sp._mask_reference(w))
        # the kept elements are the 2 largest magnitudes of their group
        a = w.float().abs().nan_to_num(nan=float("inf")).reshape(N, K // 4, 4)
        kept = torch.where(m.reshape(N, K // 4, 4), a, float("-inf")).topk(2, -1).values.min(-1).values
        dropped = torch.where(m.reshape(N, K // 4, 4), float("-inf"), a).max(-1).values
        assert bool((kept >= dropped).all())
    w = random_weight(4, 12, dtype)
    with fastdl.use_backend(backend):
        m = sp.mask_2_4(w)
    assert m[0, :4].tolist() == [True, True, False, False]
    assert m[0, 8:12].tolist() == [True, False, True, False]  # NaN kept, then inf beats -inf by index
    assert m[1, :4].tolist() == [True, True, False, False]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_is_deterministic_and_noncontiguous_ok(backend):
    w = torch.randn(40, 64)[:, ::2]  # [40, 32] strided
    with fastdl.use_backend(backend):
        assert torch.equal(sp.mask_2_4(w), sp.mask_2_4(w.clone()))
        assert torch.equal(sp.mask_2_4(w), sp._mask_reference(w.contiguous()))


# --------------------------------------------------------------------------------------- compress / decompress
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compress_round_trip_is_exact(backend, dtype):
    for N, K in SHAPES:
        w = random_weight(N, K, dtype)
        with fastdl.use_backend(backend):
            values, meta = sp.compress_2_4(w)
            dense = sp.decompress_2_4(values, meta)
            mask = sp.mask_2_4(w)
        assert values.shape == (N, K // 2) and values.dtype == dtype
        assert meta.shape == (N, (K + 7) // 8) and meta.dtype == torch.uint8
        assert bits_equal(dense, torch.where(mask, w, torch.zeros_like(w))), (N, K)
        rv, rm = sp._compress_reference(w)
        assert bits_equal(values, rv) and torch.equal(meta, rm)
        assert torch.equal(sp.unpack_meta(meta, K), mask)
        if K % 8 == 4:
            assert bool((meta[:, -1] >> 4 == 0).all()), "unused high nibble is 0"


def test_meta_layout_is_the_documented_bitmask():
    w = torch.zeros(1, 40)
    kept = [1, 2, 4, 7, 8, 9, 14, 15, 16, 19, 21, 22, 24, 25, 30, 31, 33, 35, 36, 38]
    w[0, kept] = torch.arange(1, len(kept) + 1, dtype=torch.float32)
    for backend in BACKENDS:
        with fastdl.use_backend(backend):
            values, meta = sp.compress_2_4(w)
        word = int.from_bytes(bytes(meta[0, :4].tolist()), "little")  # positions 0..31 as a little-endian uint32
        assert word == sum(1 << p for p in kept if p < 32)
        assert meta[0, 4].item() == sum(1 << (p - 32) for p in kept if p >= 32)
        assert values[0].tolist() == list(range(1, len(kept) + 1))  # increasing index order


@pytest.mark.parametrize("backend", BACKENDS)
def test_already_2_4_weight_keeps_its_nonzeros(backend):
    w = torch.randn(16, 64)
    w = w * sp._mask_reference(torch.randn(16, 64))
    with fastdl.use_backend(backend):
        values, meta = sp.compress_2_4(w)
        assert torch.equal(sp.decompress_2_4(values, meta), w)


def test_decompress_reference_rejects_bad_meta():
    values, meta = sp.compress_2_4(torch.randn(2, 8))
    meta = meta.clone()
    meta[0, 0] = 0x07  # three bits in a group
    with pytest.raises(ValueError, match="exactly 2 bits"):
        sp._decompress_reference(values, meta)


# ------------------------------------------------------------------------------------------------ sparse GEMM
def dense_ref(x, values, meta, bias):
    w = sp._decompress_reference(values, meta).to(x.dtype).double()
    out = x.double() @ w.t()
    return out + bias.double() if bias is not None else out


def eager_err(x, values, meta, bias, ref):
    w = sp._decompress_reference(values, meta).to(x.dtype)
    return rel_err(F.linear(x, w, None if bias is None else bias.to(x.dtype)), ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,K,N", [(1, 4, 3), (1, 68, 33), (2, 36, 9), (3, 100, 25), (4, 132, 7), (7, 44, 50),
                                   (33, 1000, 30), (127, 64, 65), (16, 4096, 40), (130, 40, 7)])
def test_sparse_linear_matches_dense_gemm(backend, dtype, M, K, N):
    x = torch.randn(M, K).to(dtype)
    values, meta = sp.compress_2_4(torch.randn(N, K).to(dtype))
    bias = torch.randn(N) if M % 2 else None
    with fastdl.use_backend(backend):
        out = sp.sparse24_linear(x, values, meta, bias)
    ref = dense_ref(x, values, meta, bias)
    assert out.shape == (M, N) and out.dtype == dtype and out.is_contiguous()
    err = rel_err(out, ref)
    if dtype == torch.float32:
        assert err <= 2e-5, err
    else:
        assert err <= 2 * eager_err(x, values, meta, bias, ref) + 1e-4, (err, eager_err(x, values, meta, bias, ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_linear_leading_dims_noncontiguous_mixed_dtypes(backend):
    x = torch.randn(3, 40, 5, 2)[..., 0].transpose(1, 2)  # [3, 5, 40], not contiguous
    values, meta = sp.compress_2_4(torch.randn(24, 40))
    bias = torch.randn(48)[::2]
    with fastdl.use_backend(backend):
        out = sp.sparse24_linear(x, values, meta, bias)
        assert out.shape == (3, 5, 24)
        assert rel_err(out, dense_ref(x, values, meta, bias)) <= 2e-5
        xb = x.bfloat16()  # fp32 values with bf16 x: values are rounded to bf16 (the contract)
        out = sp.sparse24_linear(xb, values, meta, bias.bfloat16())
        assert out.dtype == torch.bfloat16
        ref = dense_ref(xb, values, meta, bias.bfloat16())
        assert rel_err(out, ref) <= 2 * eager_err(xb, values, meta, bias.bfloat16(), ref) + 1e-4


LEVEL_LINEAR_SHAPES = [(1, 68, 9), (2, 4, 5), (3, 100, 25), (4, 12, 7), (5, 132, 17), (7, 1028, 26), (9, 520, 3),
                       (33, 260, 10), (200, 36, 5), (250, 268, 50), (24, 4, 17),
                       (5, 4096, 1100),  # the dense route's blocks: 1024 rows in bf16, 256 in fp32, then a tail
                       (70, 528, 50), (33, 64, 20), (130, 272, 49)]  # K % 16 == 0: the pb route where it is forced


def check_cpp_levels_match() -> str:
    """Run in a process capped by FASTDL_CPU_ISA (test below): the C++ kernels at that level against the contract:
    masks / compress / decompress bit for bit (ties, NaN, inf, K % 8 == 4 tails), the sparse linear on both sides of
    every kernel switch (direct M <= 4, blocked, K blocks, M blocks, dense route), fp32 and bf16 x with values of
    either dtype, bias, non-contiguous x."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for N, K in SHAPES + [(24, 1028), (5, 4100)]:
            w = random_weight(N, K, dtype)
            with fastdl.use_backend("cpp"):
                m = sp.mask_2_4(w)
                values, meta = sp.compress_2_4(w)
                dense = sp.decompress_2_4(values, meta)
            assert torch.equal(m, sp._mask_reference(w)), (dtype, N, K)
            rv, rm = sp._compress_reference(w)
            assert bits_equal(values, rv) and torch.equal(meta, rm), (dtype, N, K)
            assert bits_equal(dense, torch.where(m, w, torch.zeros_like(w))), (dtype, N, K)
    for xdt in (torch.float32, torch.bfloat16):
        for vdt in (torch.float32, torch.bfloat16):
            for i, (M, K, N) in enumerate(LEVEL_LINEAR_SHAPES):
                values, meta = sp._compress_reference(torch.randn(N, K).to(vdt))
                x = torch.randn(M, 2 * K).to(xdt)[:, ::2] if i % 2 else torch.randn(M, K).to(xdt)
                bias = torch.randn(N) if i % 3 == 0 else None
                with fastdl.use_backend("cpp"):
                    out = sp.sparse24_linear(x, values, meta, bias)
                ref = dense_ref(x, values, meta, bias)
                assert out.dtype == xdt and out.shape == (M, N)
                bound = 2e-5 if xdt == torch.float32 else 2 * eager_err(x, values, meta, bias, ref) + 1e-4
                assert rel_err(out, ref) <= bound, (xdt, vdt, M, K, N, rel_err(out, ref))
    return fastdl.info(print_result=False)["cpu"]["kernels"]["sparse24"]


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "native"])
def test_cpp_isa_levels_match(isa):
    """FASTDL_CPU_ISA caps the kernels' instruction set (once per process): every level's sparse kernels give the
    contract's results (the dense route is switched off: FASTDL_SPARSE24_DENSE_ROWS above every M), and the process
    runs the kernels of the level it was capped at (avx2: the AVX2 kernels, also on an AVX-512 CPU)."""
    out = run_at_isa(isa, "import os; os.environ['FASTDL_SPARSE24_DENSE_ROWS'] = str(2**40); "
                          "os.environ['FASTDL_CPU_PB_ROWS'] = str(2**40); "
                          "import test_sparse24 as t; print('kernels', t.check_cpp_levels_match())")
    family = out.split()[-1]
    native = native_cpu_kernels()["sparse24"]
    levels = ["scalar", "avx2", "avx512", "avx512_bf16"]
    expect = native if isa == "native" else levels[min(levels.index(isa), levels.index(native))]
    assert family == expect, (isa, out)
    if isa == "avx2" and native != "scalar":
        assert family == "avx2", out


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")
@pytest.mark.parametrize("isa", ["avx512", "native"])
def test_cpp_pb_route_matches(isa):  # the route large M takes on the AVX-512 families (held_pb_min_rows)
    """FASTDL_CPU_PB_ROWS=1: sparse24_linear with K % 16 == 0 on an AVX-512 family runs fused_linear's fp32 pb kernel
    with the weight decompressed per chunk of panels while packed: same contract, every dtype pair, bias,
    non-contiguous x (other families and K ignore the variable)."""
    out = run_at_isa(isa, "import os; os.environ['FASTDL_CPU_PB_ROWS'] = '1'; "
                          "os.environ['FASTDL_SPARSE24_DENSE_ROWS'] = str(2**40); import test_sparse24 as t; "
                          "print('kernels', t.check_cpp_levels_match())")
    assert out.split()[-1] in ("scalar", "avx2", "avx512", "avx512_bf16"), out


@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "native"])
def test_cpp_dense_route_matches(isa):  # the route every scalar call takes, and large M where it is faster
    """From FASTDL_SPARSE24_DENSE_ROWS rows on, sparse24_linear decompresses to fp32 and calls at::mm (the route the
    dispatch takes at large M where that is faster): same contract, every dtype pair, bias, non-contiguous x."""
    out = run_at_isa(isa, "import os; os.environ['FASTDL_SPARSE24_DENSE_ROWS'] = '3'; import test_sparse24 as t; "
                          "print('kernels', t.check_cpp_levels_match())")
    assert out.split()[-1] in ("scalar", "avx2", "avx512", "avx512_bf16"), out


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_inputs(backend):
    values, meta = sp.compress_2_4(torch.randn(6, 16))
    with fastdl.use_backend(backend):
        assert sp.sparse24_linear(torch.randn(0, 16), values, meta, None).shape == (0, 6)
        assert sp.sparse24_linear(torch.randn(2, 0, 16), values, meta, None).shape == (2, 0, 6)
        v0, m0 = sp.compress_2_4(torch.randn(0, 8))
        assert v0.shape == (0, 4) and m0.shape == (0, 1)
        v, m = sp.compress_2_4(torch.randn(3, 0))
        assert v.shape == (3, 0) and m.shape == (3, 0)
        b = torch.randn(3)
        torch.testing.assert_close(sp.sparse24_linear(torch.randn(2, 0), v, m, b), b.expand(2, 3))


# ------------------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("backend", BACKENDS)
def test_k_not_multiple_of_4_is_rejected(backend):
    with fastdl.use_backend(backend):
        for op in (sp.mask_2_4, sp.compress_2_4):
            with pytest.raises(ValueError, match=r"K = w.shape\[1\] = 10 is not a multiple of 4"):
                op(torch.randn(3, 10))
        with pytest.raises(ValueError, match=r"values.shape\[1\] = 3 must be K/2 with K a multiple of 4"):
            sp.sparse24_linear(torch.randn(2, 6), torch.randn(3, 3), torch.zeros(3, 1, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match=r"K = w.shape\[1\] = 6 is not a multiple of 4"):
        sparsity.kept_magnitude_fraction(torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"in_features = 10 is not a multiple of 4"):
        Sparse24Linear.from_linear(nn.Linear(10, 4))


# Each bad argument: (call, exception type, message naming the argument and the expected value); the type is the
# kind of mistake (TypeError: dtype, ValueError: shape or value, RuntimeError: device), the same on every backend.
_VALUES, _META = sp.compress_2_4(torch.randn(5, 16))
BAD = {
    "mismatched K": (lambda: sp.sparse24_linear(torch.randn(2, 12), _VALUES, _META, None), ValueError,
                     r"x.shape\[-1\] = 12 must equal K = 2 \* values.shape\[1\] = 16"),
    "meta shape": (lambda: sp.sparse24_linear(torch.randn(2, 16), _VALUES, _META[:, :1], None), ValueError,
                   r"meta must have shape \[N, ceil\(K/8\)\] = \[5, 2\] .*got \(5, 1\)"),
    "meta dtype": (lambda: sp.decompress_2_4(_VALUES, _META.to(torch.int32)), TypeError,
                   r"decompress_2_4: meta must be torch.uint8, got torch.int32"),
    "bias shape": (lambda: sp.sparse24_linear(torch.randn(2, 16), _VALUES, _META, torch.randn(4)), ValueError,
                   r"bias must have shape \[N\] = \[5\], got \(4,\)"),
    "int w": (lambda: sp.mask_2_4(torch.ones(4, 8, dtype=torch.int32)), TypeError,
              r"mask_2_4: w must be a floating tensor \(float32, bfloat16, float16, float64\), got dtype torch.int32"),
    "3-D w": (lambda: sp.compress_2_4(torch.randn(2, 2, 8)), ValueError,
              r"compress_2_4: w must be 2-D \[N, K\], got shape \(2, 2, 8\)"),
    "int x": (lambda: sp.sparse24_linear(torch.ones(2, 16, dtype=torch.int32), _VALUES, _META, None), TypeError,
              r"x must be a floating tensor \(float32, bfloat16, float16\), got dtype torch.int32"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_one_type_naming_argument_and_expected_value(backend, case):
    call, exc, message = BAD[case]
    with fastdl.use_backend(backend), pytest.raises(exc, match=message) as info:
        call()
    assert type(info.value) is exc, (type(info.value), info.value)


# ------------------------------------------------------------------------------------------ opcheck, autograd
@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck_every_op(backend):
    w = torch.randn(9, 44)
    values, meta = sp.compress_2_4(w)
    x = torch.randn(7, 44, requires_grad=True)
    v = values.clone().requires_grad_()
    b = torch.randn(9, requires_grad=True)
    with fastdl.use_backend(backend):
        torch.library.opcheck(torch.ops.fastdl.mask_2_4.default, (w,))
        torch.library.opcheck(torch.ops.fastdl.compress_2_4.default, (w.bfloat16(),))
        torch.library.opcheck(torch.ops.fastdl.decompress_2_4.default, (values, meta))
        torch.library.opcheck(torch.ops.fastdl.sparse24_linear.default, (x, v, meta, b))
        torch.library.opcheck(torch.ops.fastdl.sparse24_linear.default,
                              (x.detach().bfloat16(), values.bfloat16(), meta, None))
        g = torch.randn(7, 9)
        torch.library.opcheck(torch.ops.fastdl.sparse24_linear_backward.default,
                              (g, x.detach(), values, meta, [True, True, True]))
        torch.library.opcheck(torch.ops.fastdl.sparse24_linear_backward.default,
                              (g.bfloat16(), x.detach().bfloat16(), values.bfloat16(), meta, [True, False, True]))


def test_sparse_linear_gradients():
    values, meta = sp.compress_2_4(torch.randn(6, 12, dtype=torch.float64))
    x = torch.randn(5, 12, dtype=torch.float64, requires_grad=True)
    v = values.clone().requires_grad_()
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, v, b: sp.sparse24_linear(x, v, meta, b), (x, v, b))


@pytest.mark.parametrize("needs", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_sparse_linear_cpp_autograd_matches_the_dispatcher_autograd(needs, with_bias):
    # with the C++ backend an eager call that needs a gradient records the extension's C++ autograd node
    # (csrc/sparse24_autograd.cpp): the same output and gradients, bit for bit, as the op's registered autograd
    # (reached through the dispatcher), for every subset of x / values / bias needing one
    if not backends.available("cpp", "sparse24_linear", "cpu")[0]:
        pytest.skip("needs the compiled extension")
    values, meta = sp.compress_2_4(torch.randn(10, 24))
    x = torch.randn(3, 5, 24)
    b = torch.randn(10) if with_bias else None
    check_cpp_autograd_matches_dispatcher(
        lambda: sp.sparse24_linear(x, values, meta, b), (x, values, b), needs, torch.randn(3, 5, 10)
    )


def backward_float64(g, x, values, meta):
    """The backward of x @ W.T + b written independently: float64, the values' gradient read from the dense weight
    gradient at the positions of the mask ``decompress_2_4(ones)`` (two per group, in increasing order)."""
    N, K = values.shape[0], 2 * values.shape[1]
    w = torch.zeros(N, K, dtype=torch.float64)
    keep = sp.unpack_meta(meta, K)
    w[keep] = values.double().reshape(-1)
    g2, x2 = g.double().reshape(-1, N), x.double().reshape(-1, K)
    return (g2 @ w).reshape(x.shape), (g2.t() @ x2)[keep].reshape(N, K // 2), g2.sum(0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,K,N", [((1,), 4, 1), ((7,), 44, 33), ((2, 3), 100, 9), ((33,), 132, 127)])
def test_sparse_linear_backward_op_matches_float64(backend, dtype, shape, K, N):
    """fastdl::sparse24_linear_backward (one call: grad_x, grad_values, grad_bias) against float64, on odd shapes,
    a non-contiguous x and grad_out, each output_mask; the gradients of sparse24_linear flow through it."""
    values, meta = sp.compress_2_4(torch.randn(N, K))
    values = values.to(dtype)
    x = torch.randn(*shape, 2 * K).to(dtype)[..., ::2]  # non-contiguous
    g = torch.randn(N, *shape).to(dtype).movedim(0, -1)  # non-contiguous
    rx, rv, rb = backward_float64(g, x, values, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with fastdl.use_backend(backend):
        gx, gv, gb = sp.sparse24_linear_backward_op(g, x, values, meta, [True, True, True])
        assert gx.shape == x.shape and gx.dtype == dtype and gv.shape == values.shape and gv.dtype == dtype
        assert gb.dtype == torch.float32 and gb.shape == (N,)
        assert rel_err(gx, rx) < tol and rel_err(gv, rv) < tol and rel_err(gb, rb) < 1e-5
        for mask in ([True, False, False], [False, True, False], [False, False, True]):
            part = sp.sparse24_linear_backward_op(g, x, values, meta, mask)
            for want, got, full in zip(mask, part, (gx, gv, gb)):
                assert (torch.equal(got, full) if want else got.numel() == 0), mask
        xr, vr = x.detach().clone().requires_grad_(), values.clone().requires_grad_()
        br = torch.randn(N, dtype=dtype, requires_grad=True)
        sp.sparse24_linear(xr, vr, meta, br).backward(g)
    assert torch.equal(xr.grad, gx) and torch.equal(vr.grad, gv) and torch.equal(br.grad, gb.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_linear_backward_op_bad_inputs(backend):
    values, meta = sp.compress_2_4(torch.randn(6, 12))
    x, g = torch.randn(5, 12), torch.randn(5, 6)
    with fastdl.use_backend(backend):
        msg = r"sparse24_linear_backward: grad_out must have shape \[5, 6\], got \[5, 7\]"
        with pytest.raises(ValueError, match=msg):
            sp.sparse24_linear_backward_op(torch.randn(5, 7), x, values, meta, [True, True, True])
        with pytest.raises(ValueError, match=r"x.shape\[-1\] = 8 must equal K = 2 \* values.shape\[1\] = 12"):
            sp.sparse24_linear_backward_op(g, torch.randn(5, 8), values, meta, [True, True, True])
        bad = meta.clone()
        bad[0, 0] = 0x11  # one bit in each of the first two groups
        with pytest.raises(ValueError, match="meta must have exactly 2 bits set in every 4-bit group"):
            sp.sparse24_linear_backward_op(g, x, values, bad, [False, True, False])


def test_backend_routing_and_explicit_triton_on_cpu():
    if HAS_CPP:
        args = (torch.randn(2, 8), *sp.compress_2_4(torch.randn(3, 8)), None)
        assert backends.select("sparse24_linear", "cpu", args) == "cpp"
        args16 = (torch.randn(2, 8).half(), *sp.compress_2_4(torch.randn(3, 8).half()), None)
        assert backends.select("sparse24_linear", "cpu", args16) == "torch"  # no fp16 CPU kernel: reference
    if not backends.available("triton", "compress_2_4", "cpu")[0]:
        with pytest.raises(fastdl.BackendUnavailableError, match="triton"):
            with fastdl.use_backend("triton"):
                sp.compress_2_4(torch.randn(4, 8))


TRITON_SCRIPT = r"""
import torch, fastdl
import fastdl.ops.sparse24 as sp
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for N, K in [(1, 4), (5, 12), (7, 44), (17, 132), (33, 200)]:
        w = torch.randn(N, K).to(dtype)
        if K >= 12:
            w[0, :12] = torch.tensor([1., 1, 1, 1, 0, -0., 0, 0, float("nan"), 1, float("inf"), -float("inf")])
        with fastdl.use_backend("triton"):
            v, m = sp.compress_2_4(w)
        rv, rm = sp._compress_reference(w)
        view = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(m, rm), (dtype, N, K)
        assert torch.equal(v.view(view), rv.view(view)), (dtype, N, K)
print("TRITON_OK")
"""


def test_triton_prune_compress_kernel_interpreter():
    """The fused Triton prune+compress kernel on CPU tensors under TRITON_INTERPRET=1 (in a subprocess, so the
    interpreter setting does not leak into the other tests)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", FASTDL_NO_EXTENSION_WARNING="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "TRITON_OK" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------- module
def test_module_from_linear_to_linear_and_numerics():
    lin = nn.Linear(64, 48)
    m = Sparse24Linear.from_linear(lin)
    mask = sp.mask_2_4(lin.weight.detach())
    torch.testing.assert_close(m.dense_weight(), lin.weight.detach() * mask)
    x = torch.randn(5, 64)
    ref = F.linear(x, lin.weight * mask, lin.bias)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)
    back = m.to_linear()
    assert isinstance(back, nn.Linear)
    torch.testing.assert_close(back(x), ref, rtol=1e-5, atol=1e-5)
    fl = FusedLinear(64, 32, activation="gelu")
    ms = Sparse24Linear.from_linear(fl)
    assert ms.activation == "gelu"
    torch.testing.assert_close(ms(x), F.gelu(F.linear(x, fl.weight * sp.mask_2_4(fl.weight.detach()), fl.bias)),
                               rtol=1e-5, atol=1e-5)
    assert isinstance(ms.to_linear(), nn.Sequential)
    with pytest.raises(ValueError, match="mode"):
        Sparse24Linear(8, 4, mode="fast")


def test_module_state_dict_versioned_weights_only_and_linear_checkpoint():
    m = Sparse24Linear.from_linear(nn.Linear(32, 16), dtype=torch.bfloat16)
    sd = m.state_dict()
    assert set(sd) == {"values", "meta", "bias", "_extra_state"}
    record = decode_extra_state(sd["_extra_state"])  # a uint8 JSON tensor: the state dict holds only tensors
    assert record["format"] == "fastdl.sparse24" and record["version"] == 2
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    m2 = Sparse24Linear(32, 16, dtype=torch.bfloat16)
    m2.load_state_dict(loaded)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(m2(x), m(x))
    lin = nn.Linear(32, 16)  # a dense nn.Linear checkpoint loads (pruned + compressed on load)
    m3 = Sparse24Linear(32, 16)
    m3.load_state_dict(lin.state_dict())
    torch.testing.assert_close(m3.dense_weight(), lin.weight.detach() * sp.mask_2_4(lin.weight.detach()))
    bad = dict(sd, _extra_state={"format": "fastdl.sparse24", "version": 99, "in_features": 32, "out_features": 16})
    with pytest.raises(ValueError, match="newer"):
        Sparse24Linear(32, 16, dtype=torch.bfloat16).load_state_dict(bad)


def test_module_memory_is_at_most_0p6_of_dense_bf16():
    m = Sparse24Linear.from_linear(nn.Linear(1024, 512), dtype=torch.bfloat16)
    dense = 1024 * 512 * 2 + 512 * 2
    held = sum(t.numel() * t.element_size() for k, t in m.state_dict().items() if k != "_extra_state")  # + record
    assert held == m.weight_bytes() and held <= 0.6 * dense, held / dense
    m(torch.randn(2, 1024, dtype=torch.bfloat16))  # the sparse path caches nothing
    assert m.cache_bytes() == 0


def test_module_paths_auto_and_forced():
    m = Sparse24Linear.from_linear(nn.Linear(64, 32), dtype=torch.bfloat16)
    small, large = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(300, 64, dtype=torch.bfloat16)
    assert m.path_for(small) == "sparse" and m.path_for(large) == "dense"
    ys, yl = m(small), m(large)
    assert m.last_path == "dense" and m.cache_bytes() == 32 * 64 * 2 and "last_path=dense" in repr(m)
    w = m.dense_weight()
    assert rel_err(ys, F.linear(small.double(), w.double(), m.bias.double())) < 1e-2
    assert rel_err(yl, F.linear(large.double(), w.double(), m.bias.double())) < 1e-2
    m.release_caches()
    assert m.cache_bytes() == 0
    m.mode = "sparse"
    assert m.path_for(large) == "sparse"
    m.mode = "dense"
    assert m.path_for(small) == "dense"
    with torch.no_grad():  # the dense cache follows in-place updates of the values
        m.values.mul_(2)
    torch.testing.assert_close(m(small), F.linear(small, m.dense_weight(), m.bias.to(torch.bfloat16)))


@pytest.mark.parametrize("rows", [32, 300])  # the sparse path and the dense path
def test_module_values_train_with_pattern_fixed(rows):
    m = Sparse24Linear.from_linear(nn.Linear(16, 8), trainable=True)
    assert not Sparse24Linear.from_linear(nn.Linear(16, 8)).values.requires_grad  # inference module by default
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(rows, 16), torch.randn(rows, 8)
    meta, values = m.meta.clone(), m.values.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    assert torch.equal(m.meta, meta) and m.values.grad is not None and not torch.equal(m.values, values)
    w = m.dense_weight().requires_grad_()
    F.mse_loss(F.linear(x, w, m.bias), y).backward()
    m.values.grad = None
    F.mse_loss(m(x), y).backward()
    torch.testing.assert_close(m.values.grad, w.grad[sp.unpack_meta(m.meta, 16)].reshape(8, 8))


def test_module_compile_fullgraph():
    model = nn.Sequential(Sparse24Linear.from_linear(nn.Linear(32, 64)), nn.ReLU(),
                          Sparse24Linear.from_linear(nn.Linear(64, 8)))
    x = torch.randn(5, 32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x))
    big = torch.randn(600, 32)  # dense path: decompressed per call inside the graph (no cache mutation)
    torch.testing.assert_close(compiled(big), model(big), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_module_compile_inductor_fullgraph():
    m = Sparse24Linear.from_linear(nn.Linear(16, 24), dtype=torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(torch.compile(m, fullgraph=True)(x), m(x))


# -------------------------------------------------------------------------------------------------- workflow
def _mlp():
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), FusedLinear(96, 32, activation="relu"), nn.Linear(32, 10),
                         nn.Linear(10, 3))


def _pattern_ok(w):
    N, K = w.shape
    return bool(((w.reshape(N, K // 4, 4) != 0).sum(-1) <= 2).all())


def test_prune_report_skips_and_lists_layers():
    model = _mlp()
    report = sparsity.prune(model)
    assert set(report.pruned) == {"0", "2", "3"}
    assert "not a multiple of 4" in report.skipped["4"]
    assert all(0.5 < k <= 1.0 for k in report.pruned.values())
    assert "skipped 4" in str(report)
    for name in ("0", "2", "3"):
        assert _pattern_ok(model.get_submodule(name).weight)
    again = sparsity.prune(model)
    assert not again.pruned and again.skipped["0"] == "already pruned"
    only = sparsity.prune(_mlp(), filter_fn=lambda name, m: name == "0")
    assert set(only.pruned) == {"0"} and only.skipped["2"] == "excluded by filter_fn"


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_masked_training_keeps_pattern_after_optimizer_steps(opt_name):
    model = _mlp()
    sparsity.prune(model)
    masks = {n: sparsity.get_mask(m).clone() for n, m in model.named_modules() if sparsity.is_pruned(m)}
    if opt_name == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, y = torch.randn(64, 64), torch.randint(0, 3, (64,))
    with sparsity.MaskedTraining(model, opt):
        for _ in range(5):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, mask in masks.items():
                assert bool((model.get_submodule(n).weight.grad[~mask] == 0).all()), "masked gradient"
            opt.step()
    for n, mask in masks.items():
        w = model.get_submodule(n).weight
        assert bool((w[~mask] == 0).all()) and _pattern_ok(w)
        assert torch.equal(sparsity.get_mask(model.get_submodule(n)), mask)
    rows = sparsity.sparsity_report(model)
    by = {r["layer"]: r for r in rows}
    assert by["0"]["pruned"] and abs(by["0"]["density"] - 0.5) < 1e-6 and by["0"]["pattern_2_4"]
    assert not by["4"]["pruned"] and by["4"]["kept_magnitude"] is None
    assert "kept|w|" in sparsity.format_report(rows)


def test_masks_saved_packed_and_reloaded():
    model = _mlp()
    sparsity.prune(model)
    sd = model.state_dict()
    packed = sd["0.weight_mask"]
    assert packed.dtype == torch.uint8 and packed.shape == (96, 8)  # 1 bit per weight
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = _mlp()
    sparsity.prune(fresh)  # creates the mask buffers (its own masks), then the checkpoint overwrites them
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for name in ("0", "2", "3"):
        assert torch.equal(sparsity.get_mask(fresh.get_submodule(name)), sparsity.get_mask(model.get_submodule(name)))
        assert torch.equal(fresh.get_submodule(name).weight, model.get_submodule(name).weight)


def test_sparsify_converts_pruned_layers_and_permutation_search():
    torch.manual_seed(0)
    model = _mlp()
    report = sparsity.prune(model, permute=True)
    for name, kept in report.pruned.items():
        assert kept >= report.kept_without_permutation[name] - 1e-6
    assert any(report.pruned[n] > report.kept_without_permutation[n] for n in report.pruned)
    x = torch.randn(6, 64)
    ref = model(x)
    sparsity.sparsify(model)
    assert isinstance(model[0], Sparse24Linear) and isinstance(model[2], Sparse24Linear)
    assert isinstance(model[4], nn.Linear) and not isinstance(model[4], Sparse24Linear)
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    back = model[0].to_linear()  # the dense layer undoes the permutation
    torch.testing.assert_close(back(x), F.linear(x.index_select(-1, model[0].input_permutation),
                                                 model[0].dense_weight(), model[0].bias), rtol=1e-5, atol=1e-5)


def _classification_task():
    """scikit-learn's digits (8x8 images, 10 classes) if installed, else a synthetic task of the same shape:
    10 classes of 3 Gaussian clusters each in 64 dimensions (not linearly separable)."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target)
        name = "digits"
    except ImportError:
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(30, 64, generator=g)  # 3 clusters per class: not linearly separable
        c = torch.randint(0, 30, (2000,), generator=g)
        x = centers[c] + 0.9 * torch.randn(2000, 64, generator=g)
        y = c % 10
        name = "synthetic"
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    x, y = x[perm], y[perm]
    n_train = int(0.75 * len(y))
    return name, (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def _train(model, data, steps, lr, masked=False):
    x, y = data
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    ctx = sparsity.MaskedTraining(model, opt) if masked else None
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (128,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    if ctx:
        ctx.remove()


def _accuracy(model, data):
    x, y = data
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def test_accuracy_recovers_after_masked_fine_tuning():
    torch.manual_seed(0)
    name, train, test = _classification_task()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    _train(model, train, 400, 3e-3)
    dense_acc = _accuracy(model, test)
    assert dense_acc > 0.85, (name, dense_acc)
    sparsity.prune(model)
    pruned_acc = _accuracy(model, test)
    _train(model, train, 300, 1e-3, masked=True)
    tuned_acc = _accuracy(model, test)
    for m in model.modules():
        if sparsity.is_pruned(m):
            assert _pattern_ok(m.weight)
    assert tuned_acc >= pruned_acc - 0.005 and tuned_acc >= dense_acc - 0.03, (name, dense_acc, pruned_acc, tuned_acc)
    sparsity.sparsify(model)  # and the compressed inference model agrees
    assert abs(_accuracy(model, test) - tuned_acc) < 0.01


# ------------------------------------------------------------------------------------------------------ DDP
def _ddp_worker(rank, world, result_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastdl.ops.sparse24  # noqa: F401  (registers the ops in the spawned process)

    # file rendezvous: no TCP port to pick (a free port picked by one test run can be taken by a concurrent run on
    # a shared machine before the store binds it)
    init = "file://" + os.path.join(result_dir, "rendezvous")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # identical initial weights -> identical masks (deterministic), no broadcast needed
    model = _mlp()
    sparsity.prune(model)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.05)
    g = torch.Generator().manual_seed(1 + rank)  # different data on each rank
    with sparsity.MaskedTraining(ddp, opt):
        for _ in range(5):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 3, (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def test_ddp_two_processes_gloo_identical_masks_and_weights():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ddp_worker, args=(2, d), nprocs=2, join=True)
        r0 = torch.load(os.path.join(d, "rank0.pt"))
        r1 = torch.load(os.path.join(d, "rank1.pt"))
    assert set(r0) == set(r1) and "0.weight_mask" in r0
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    for name in ("0", "2", "3"):
        w, mask = r0[f"{name}.weight"], sp.unpack_meta(r0[f"{name}.weight_mask"], r0[f"{name}.weight"].shape[1])
        assert bool((w[~mask] == 0).all()) and _pattern_ok(w)


# ------------------------------------------------------------------------------------------------------ CUDA
@requires_cuda
def test_cuda_ops_match_reference():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = random_weight(64, 200, dtype).cuda()
        for backend in ("triton", "torch"):
            if not backends.available(backend, "compress_2_4", "cuda")[0]:
                continue
            with fastdl.use_backend(backend):
                values, meta = sp.compress_2_4(w)
            rv, rm = sp._compress_reference(w.cpu())
            assert torch.equal(meta.cpu(), rm) and bits_equal(values.cpu(), rv), (backend, dtype)
        assert torch.equal(sp.mask_2_4(w).cpu(), sp._mask_reference(w.cpu()))
        x = torch.randn(33, 200, device="cuda", dtype=dtype)
        out = sp.sparse24_linear(x, values, meta, None)
        assert rel_err(out.cpu(), dense_ref(x.cpu(), values.cpu(), meta.cpu(), None)) < 1e-2


@requires_cuda
def test_cuda_module_semi_structured_path_or_clear_fallback():
    m = Sparse24Linear.from_linear(nn.Linear(1024, 512), dtype=torch.float16).cuda()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.float16)
    y = m(x)
    ref = F.linear(x.float(), m.dense_weight().float(), m.bias.float())
    assert rel_err(y, ref) < 1e-2
    why = m.semi_structured_reason(torch.float16)
    assert m.last_path == ("semi" if why is None else "dense"), why
    small = torch.randn(3, 1024, device="cuda", dtype=torch.float16)
    assert m.path_for(small) == "dense"
    assert rel_err(m(small), F.linear(small.float(), m.dense_weight().float(), m.bias.float())) < 1e-2
    odd = Sparse24Linear.from_linear(nn.Linear(20, 12), dtype=torch.float16).cuda()
    odd.mode = "sparse"
    assert odd.semi_structured_reason(torch.float16) is not None  # shape not a multiple of the tile
    assert odd.path_for(torch.randn(4, 20, device="cuda", dtype=torch.float16)) == "sparse"
