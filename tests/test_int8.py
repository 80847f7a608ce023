"""int8 quantized GEMM: every op on every CPU backend (cpp when built, Triton in interpreter mode, torch) against
independent exact references, opcheck, torch.compile, accuracy, the Int8Linear module (state_dict, packing, memory)
and quantization-aware training under 2-process DDP."""

import copy
import io
import os
import tempfile

import numpy as np
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
import fastdl.nn.int8 as nn_int8
import fastdl.ops.int8 as int8_ops  # registers the int8 ops
from fastdl import backends, quant
from fastdl._distributed import finish_worker
from fastdl.nn._base import decode_extra_state, encode_extra_state
from fastdl.nn.int8 import FORMAT_VERSION, Int8Linear
from fastdl.ops.int8 import (
    int8_linear,
    int8_linear_qat,
    int8_mm,
    int8_pack_weight,
    int8_weight_only_linear,
    quantize_per_channel,
    quantize_per_group,
    quantize_per_token,
)

FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def op_backends(op: str) -> list[str]:
    """cpp (when built), triton (in the Triton interpreter: conftest turns it on when there is no GPU) and torch."""
    return cpu_backends(op)


Q_BACKENDS = op_backends("quantize_per_token")
PACK_BACKENDS = op_backends("int8_pack_weight")
MM_BACKENDS = op_backends("int8_mm")
LIN_BACKENDS = op_backends("int8_linear")
WO_BACKENDS = op_backends("int8_weight_only_linear")
NOT_TRITON = [b for b in LIN_BACKENDS if b != "triton"]


# ------------------------------------------------------------------------------------ independent references
def quant_np(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's formula in numpy float32 (IEEE division and multiply, np.rint = round half to even)."""
    K = x.shape[-1]
    M = int(np.prod(x.shape[:-1]))
    xf = x.reshape(M, K).float().numpy()
    if K == 0 or M == 0:
        return torch.zeros(x.shape, dtype=torch.int8), torch.zeros(x.shape[:-1])
    a = np.abs(xf)
    amax = np.where(np.isnan(a), np.float32(np.inf), a).max(axis=1).astype(np.float32)
    finite = np.isfinite(amax)
    ok = finite & (amax > 0)
    safe = np.where(ok, amax, np.float32(1)).astype(np.float32)
    with np.errstate(all="ignore"):
        inv = (np.float32(127) / safe).astype(np.float32)
        v = (xf * inv[:, None]).astype(np.float32)
    v = np.rint(np.clip(np.where(np.isnan(v), np.float32(0), v), -127, 127))
    q = np.where(ok[:, None], v, 0).astype(np.int8)
    scale = np.where(ok, (safe / np.float32(127)).astype(np.float32), np.where(finite, 0, np.nan)).astype(np.float32)
    return torch.from_numpy(q).reshape(x.shape), torch.from_numpy(scale).reshape(x.shape[:-1])


def acc_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T in int64 (exact), checked to fit int32."""
    if a.numel() == 0 or b.numel() == 0:
        return torch.zeros(a.shape[0], b.shape[0], dtype=torch.int32)
    acc = (a.long()[:, None, :] * b.long()[None, :, :]).sum(-1)
    assert acc.abs().max().item() < 2**31
    return acc.to(torch.int32)


def dequant(acc, a_scale, b_scale, bias, dtype):
    out = acc.float() * a_scale[:, None]
    out = out * b_scale[None, :]
    if bias is not None:
        out = out + bias.float()[None, :]
    return out.to(dtype)


def linear_exact(x, w_q, w_scale, bias):
    K, N = x.shape[-1], w_q.shape[0]
    q, s = quant_np(x.reshape(-1, K))
    return dequant(acc_exact(q, w_q), s, w_scale, bias, x.dtype).reshape(*x.shape[:-1], N)


def quant_u7_np(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 7-bit mode's contract formula (int8_linear act_bits=7) in numpy float32, row by row: the int8 a = q - z
    and the scale."""
    K = x.shape[-1]
    xf = x.reshape(-1, K).float().numpy()
    a = np.zeros(xf.shape, dtype=np.int8)
    scale = np.zeros(xf.shape[0], dtype=np.float32)
    f32 = np.float32
    for r, row in enumerate(xf):
        if K == 0:
            continue
        if not np.isfinite(row).all():
            scale[r] = np.nan
            continue
        lo, hi = min(f32(0), row.min()), max(f32(0), row.max())
        with np.errstate(all="ignore"):
            rng = f32(hi - lo)
            inv = f32(f32(127) / rng) if rng != 0 else f32(np.inf)
        if not np.isfinite(rng):
            scale[r] = np.nan
            continue
        if rng == 0 or not np.isfinite(inv):
            continue
        z = np.clip(np.rint(f32(-lo * inv)), 0, 127)
        q = np.clip(np.rint((row * inv).astype(np.float32)) + z, 0, 127)
        a[r] = (q - z).astype(np.int8)
        scale[r] = f32(rng / f32(127))
    return torch.from_numpy(a).reshape(x.shape), torch.from_numpy(scale).reshape(x.shape[:-1])


def linear_u7_exact(x, w_q, w_scale, bias):
    K, N = x.shape[-1], w_q.shape[0]
    q, s = quant_u7_np(x.reshape(-1, K))
    return dequant(acc_exact(q, w_q), s, w_scale, bias, x.dtype).reshape(*x.shape[:-1], N)


def u7_rows(K: int) -> torch.Tensor:
    """Rows at the edges of the 7-bit mode: one-signed rows (z = 0: q = 127 everywhere; z = 127: q = 0), mixed signs,
    a zero row, NaN and Inf rows, a range below 127 / FLT_MAX (quantized to 0), a range that overflows fp32 (NaN),
    and random rows."""
    x = torch.randn(12, K)
    x[0] = 3.0  # q = 127, z = 0 everywhere: with w = -128 every vpmaddubsw pair is -32512
    x[1] = -3.0  # z = 127, q = 0: a = -127
    x[2] = x[2].abs() + 0.25
    x[3] = 0.0
    x[4, K // 2] = float("nan")
    x[5, 0] = float("-inf")
    x[6] = 1e-38
    x[7, 0], x[7, -1] = 3e38, -3e38
    x[8, ::2] = -x[8, ::2].abs() * 40.0
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN == NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    return torch.equal(a, b)


def rand_int8(*shape, full_range=True):
    lo = -128 if full_range else -127
    return torch.randint(lo, 128, shape, dtype=torch.int8)


def make_weight(N, K):
    w_q = rand_int8(N, K, full_range=False)
    w_scale = torch.rand(N) * 0.02 + 1e-3
    return w_q, w_scale


SHAPES = [(1, 7, 33), (7, 33, 1), (33, 127, 7), (70, 64, 65), (5, 300, 48), (2, 1, 3)]


# ------------------------------------------------------------------------------------------ quantize_per_token
@pytest.mark.parametrize("backend", Q_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 127), (2, 300), (4, 1000), (65, 16)])
def test_quantize_formula_bit_exact(backend, dtype, shape):
    x = (torch.randn(shape) * 3).to(dtype)
    with fastdl.use_backend(backend):
        q, s = quantize_per_token(x)
    qr, sr = quant_np(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.is_contiguous()
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    assert same(q, qr) and same(s, sr)
    assert q.abs().max() <= 127


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("backend", Q_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_quantize_special_rows(backend, dtype):
    K = 40
    x = torch.randn(9, K)
    x[0] = 0.0  # zero row: scale 0, q 0
    x[1, 5] = float("nan")  # NaN row: scale NaN, q 0
    x[2, 7] = float("inf")
    x[3, 0] = float("-inf")
    x[4] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.0] * (K - 6))  # inv = 1: ties round to even
    x[5, :3] = torch.tensor([-127.0, 126.5, 125.5])
    x[5, 3:] = 0.0
    if dtype == torch.float32:
        x[6] = 0.0
        x[6, :2] = torch.tensor([1e-38, -2e-38])  # 127 / amax overflows to inf; zeros give 0 * inf -> q = 0
    x = x.to(dtype)
    with fastdl.use_backend(backend):
        q, s = quantize_per_token(x)
    qr, sr = quant_np(x)
    assert same(q, qr) and same(s, sr)
    assert s[0] == 0 and (q[0] == 0).all()
    assert s[1:4].isnan().all() and (q[1:4] == 0).all()
    assert q[4, :6].tolist() == [127, 2, -4, 0, 0, 2]
    assert q[5, :3].tolist() == [-127, 126, 126]
    assert torch.isfinite(s[4:]).all()
    if dtype == torch.float32:
        assert q[6, :3].tolist() == [127, -127, 0]


@pytest.mark.parametrize("backend", Q_BACKENDS)
def test_quantize_noncontiguous_empty_and_per_channel(backend):
    base = torch.randn(6, 50, 3)
    x = base[..., 1].t()  # [50, 6], last dim strided
    y = torch.randn(4, 3, 80)[:, ::2, 10:70]  # strided rows
    with fastdl.use_backend(backend):
        for t in (x, y):
            q, s = quantize_per_token(t)
            qr, sr = quant_np(t.contiguous())
            assert same(q, qr) and same(s, sr)
        q, s = quantize_per_token(torch.randn(0, 7))
        assert q.shape == (0, 7) and s.shape == (0,)
        q, s = quantize_per_token(torch.randn(3, 0))
        assert q.shape == (3, 0) and s.shape == (3,) and (s == 0).all()
        w = torch.randn(9, 31)
        wq, ws = quantize_per_channel(w)
        qr, sr = quant_np(w)
        assert same(wq, qr) and same(ws, sr)
        assert (quant.dequantize(wq, ws) - w).abs().max() <= ws.max() / 2 + 1e-7


# ------------------------------------------------------------------------------------------- int8_pack_weight
def pack_loops(w: torch.Tensor):
    N, K = w.shape
    Np, Kp = -(-N // 16) * 16, -(-K // 4) * 4
    flat = torch.zeros(Np * Kp, dtype=torch.int8)
    for n in range(N):
        for k in range(K):
            flat[((n // 16) * (Kp // 4) + k // 4) * 64 + (n % 16) * 4 + k % 4] = w[n, k]
    comp = torch.zeros(Np, dtype=torch.int32)
    comp[:N] = 128 * w.long().sum(1).int()
    return flat.view(Np, Kp), comp


@pytest.mark.parametrize("backend", PACK_BACKENDS)
@pytest.mark.parametrize("N,K", [(1, 1), (16, 4), (17, 5), (33, 70), (5, 64)])
def test_pack_layout_exact(backend, N, K):
    w = rand_int8(N, K)
    with fastdl.use_backend(backend):
        packed, comp = int8_pack_weight(w)
    ref_p, ref_c = pack_loops(w)
    assert packed.dtype == torch.int8 and comp.dtype == torch.int32
    assert packed.shape == ref_p.shape and packed.is_contiguous()
    assert torch.equal(packed, ref_p) and torch.equal(comp, ref_c)
    assert torch.equal(int8_ops.unpack_reference(packed, N, K), w)


# ---------------------------------------------------------------------------------------------------- int8_mm
@pytest.mark.parametrize("backend", MM_BACKENDS)
@pytest.mark.parametrize("M,K,N", SHAPES + [(3, 4096, 20)])
def test_int8_mm_int32_bit_exact(backend, M, K, N):
    a, b = rand_int8(M, K), rand_int8(N, K)
    sa, sb = torch.rand(M), torch.rand(N)
    with fastdl.use_backend(backend):
        acc = int8_mm(a, b, sa, sb, torch.randn(N), torch.int32)
    assert acc.dtype == torch.int32 and acc.shape == (M, N)
    assert torch.equal(acc, acc_exact(a, b))


@pytest.mark.parametrize("backend", MM_BACKENDS)
def test_int8_mm_extreme_values(backend):
    K = 4096
    a = torch.full((2, K), -128, dtype=torch.int8)
    a[1] = 127
    b = torch.full((3, K), -128, dtype=torch.int8)
    b[1] = 127
    b[2, ::2] = 127
    with fastdl.use_backend(backend):
        acc = int8_mm(a, b, torch.ones(2), torch.ones(3), None, torch.int32)
    assert torch.equal(acc, acc_exact(a, b))
    assert acc[0, 0].item() == 128 * 128 * K


def test_torch_reference_exact_where_int_mm_saturates():
    """On an AVX2-only CPU (here: oneDNN capped at AVX2, as on a Zen 2) torch._int_mm saturates its int16 pair sums;
    the torch backend then uses its float64 product, bit for bit exact at +-127 x +-127 / -128."""
    script = """
import torch
from fastdl.ops import _int8_formats as o
K = 4096
a = torch.full((2, K), 127, dtype=torch.int8); a[1, ::2] = -127
b = torch.full((3, K), 127, dtype=torch.int8); b[1] = -128; b[2, 1::2] = -128
ref = (a.double() @ b.double().t()).to(torch.int64)
print(o._cpu_int_mm_exact(), torch.equal(o.int32_acc_reference(a, b).to(torch.int64), ref))
"""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FASTDL_CPU_ISA"}
    env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "True", res.stdout  # (the probe, first word, is False with torch 2.14.1)


@pytest.mark.parametrize("backend", MM_BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_int8_mm_dequant_epilogue_bit_exact(backend, out_dtype, M, K, N):
    a, b = rand_int8(M, K, full_range=False), rand_int8(N, K, full_range=False)
    sa, sb = torch.rand(M) * 0.05, torch.rand(N) * 0.05
    bias = torch.randn(N).to(torch.bfloat16) if N % 2 else None  # any float dtype, read as fp32
    with fastdl.use_backend(backend):
        out = int8_mm(a, b, sa, sb, bias, out_dtype)
    assert same(out, dequant(acc_exact(a, b), sa, sb, bias, out_dtype))


@pytest.mark.parametrize("backend", MM_BACKENDS)
def test_int8_mm_packed_args_and_placeholder(backend):
    M, K, N = 9, 70, 33
    a, b = rand_int8(M, K), rand_int8(N, K)
    sa, sb, bias = torch.rand(M), torch.rand(N), torch.randn(N)
    packed, comp = int8_pack_weight(b)
    ref = dequant(acc_exact(a, b), sa, sb, bias, torch.float32)
    placeholder = torch.zeros((), dtype=torch.int8).expand(N, K)
    with fastdl.use_backend(backend):
        assert same(int8_mm(a, b, sa, sb, bias, torch.float32, packed, comp), ref)
        assert same(int8_mm(a, placeholder, sa, sb, bias, torch.float32, packed, comp), ref)
        assert torch.equal(int8_mm(a, b, sa, sb, None, torch.int32, packed, comp), acc_exact(a, b))


@pytest.mark.parametrize("backend", MM_BACKENDS)
def test_int8_mm_empty_and_noncontiguous(backend):
    with fastdl.use_backend(backend):
        out = int8_mm(rand_int8(0, 16), rand_int8(8, 16), torch.rand(0), torch.rand(8), None, torch.bfloat16)
        assert out.shape == (0, 8) and out.dtype == torch.bfloat16
        bias = torch.randn(5)
        out = int8_mm(rand_int8(3, 0), rand_int8(5, 0), torch.rand(3), torch.rand(5), bias, torch.float32)
        assert same(out, bias.expand(3, 5).contiguous())
        a = rand_int8(40, 2, 33)[:, 0]  # strided rows
        b = rand_int8(33, 25).t()  # [25, 33] transposed
        acc = int8_mm(a, b, torch.rand(40), torch.rand(25), None, torch.int32)
        assert torch.equal(acc, acc_exact(a.contiguous(), b.contiguous()))


# ------------------------------------------------------------------------------------------------ int8_linear
@pytest.mark.parametrize("backend", LIN_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,K,N", SHAPES + [(130, 40, 17)])
def test_int8_linear_bit_exact(backend, dtype, M, K, N):
    x = torch.randn(M, K).to(dtype)
    w_q, w_scale = make_weight(N, K)
    bias = torch.randn(N) if M % 2 else None
    with fastdl.use_backend(backend):
        out = int8_linear(x, w_q, w_scale, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    assert same(out, linear_exact(x, w_q, w_scale, bias))


@pytest.mark.parametrize("backend", LIN_BACKENDS)
def test_int8_linear_nan_rows_leading_dims_noncontiguous(backend):
    K, N = 48, 20
    x = torch.randn(2, 4, 2 * K)[..., ::2].transpose(0, 1)  # [4, 2, K], not contiguous
    x[1, 0, 3] = float("nan")
    x[2, 1, 0] = float("inf")
    x[3, 0] = 0.0
    w_q, w_scale = make_weight(N, K)
    bias = torch.randn(N)
    packed, comp = int8_pack_weight(w_q)
    with fastdl.use_backend(backend):
        out = int8_linear(x, w_q, w_scale, bias)
        out_p = int8_linear(x, w_q, w_scale, bias, packed, comp)
        out_ph = int8_linear(x, torch.zeros((), dtype=torch.int8).expand(N, K), w_scale, bias, packed, comp)
    assert out.shape == (4, 2, N)
    assert out[1, 0].isnan().all() and out[2, 1].isnan().all()
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[1, 0] = bad[2, 1] = True
    assert torch.isfinite(out[~bad]).all()
    assert same(out[3, 0], bias)  # zero row: only the bias
    ref = linear_exact(x, w_q, w_scale, bias)
    assert same(out, ref) and same(out_p, ref) and same(out_ph, ref)


@pytest.mark.parametrize("backend", LIN_BACKENDS)
def test_int8_linear_empty(backend):
    w_q, w_scale = make_weight(8, 16)
    with fastdl.use_backend(backend):
        assert int8_linear(torch.randn(0, 16), w_q, w_scale).shape == (0, 8)
        assert int8_linear(torch.randn(2, 0, 16), w_q, w_scale).shape == (2, 0, 8)
        b = torch.randn(8)
        out = int8_linear(torch.randn(3, 0), torch.zeros(8, 0, dtype=torch.int8), w_scale, b)
        assert same(out, b.expand(3, 8).contiguous())


U7_BACKENDS = NOT_TRITON  # the 7-bit mode has no Triton kernel (the router takes it elsewhere)


@pytest.mark.parametrize("backend", U7_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,K,N", SHAPES + [(12, 4100, 20)])
def test_int8_linear_7bit_activations_bit_exact(backend, dtype, M, K, N):
    """act_bits=7 against the contract formula in numpy (an independent reference), bit for bit, on the edge rows
    (u7_rows) and random ones; packed and plain weights."""
    x = torch.cat([u7_rows(K), torch.randn(M, K)]).to(dtype)
    w_q, w_scale = make_weight(N, K)
    w_q[0] = -128
    w_q[-1] = 127
    bias = torch.randn(N) if M % 2 else None
    packed, comp = int8_pack_weight(w_q)
    with fastdl.use_backend(backend):
        out = int8_linear(x, w_q, w_scale, bias, None, None, 7)
        out_p = int8_linear(x, w_q, w_scale, bias, packed, comp, 7)
    ref = linear_u7_exact(x, w_q, w_scale, bias)
    assert same(out, ref) and same(out_p, ref)
    assert out[4].isnan().all() and out[5].isnan().all() and (K == 1 or out[7].isnan().all())
    zero = bias.to(dtype) if bias is not None else torch.zeros(N, dtype=dtype)
    assert same(out[3], zero) and same(out[6], zero)


def test_int8_linear_7bit_error_bound_and_arguments():
    """The 7-bit mode's dequantized activations are within half a step (range / 127) of x, its result within the
    bound that gives, and one-signed rows (post-ReLU) quantize as finely as 8-bit symmetric. Bad act_bits: a
    ValueError naming the argument, on every backend."""
    from fastdl.ops._int8_formats import quantize_rows_u7_reference

    x = torch.randn(64, 1000)
    a, s = quantize_rows_u7_reference(x)
    assert a.min() >= -127 and a.max() <= 127
    rng = x.amax(1).clamp(min=0) - x.amin(1).clamp(max=0)
    assert ((a.float() * s[:, None] - x).abs() <= (rng / 127)[:, None] * 0.5 * (1 + 1e-5)).all()
    relu = x.clamp(min=0)
    q8, s8 = quantize_per_token(relu)
    a7, s7 = quantize_rows_u7_reference(relu)
    assert torch.equal(s7, s8)  # range = amax for a one-signed row: the same step
    w_q, w_scale = make_weight(48, 1000)
    ref = relu.double() @ (w_q.double() * w_scale.double()[:, None]).t()
    e7 = rel_err(int8_linear(relu, w_q, w_scale, act_bits=7), ref)
    e8 = rel_err(int8_linear(relu, w_q, w_scale), ref)
    assert e7 < 0.02 and e7 <= 1.5 * e8, (e7, e8)
    for backend in LIN_BACKENDS:
        with fastdl.use_backend(backend), pytest.raises(ValueError, match="act_bits must be 8 or 7, got 6"):
            int8_linear(x, w_q, w_scale, None, None, None, 6)


# ------------------------------------------------------------------------------------- int8_weight_only_linear
def weight_only_64(x, w_q, w_scale, bias):
    out = (x.double() @ w_q.double().t()) * w_scale.double()
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("backend", WO_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,K,N", SHAPES + [(3, 70, 40), (4, 300, 17)])
def test_weight_only_matches_reference(backend, dtype, M, K, N):
    x = torch.randn(M, K).to(dtype)
    w_q, w_scale = make_weight(N, K)
    bias = torch.randn(N) if N % 2 else None
    with fastdl.use_backend(backend):
        out = int8_weight_only_linear(x, w_q, w_scale, bias)
    assert out.dtype == dtype and out.shape == (M, N)
    ref = weight_only_64(x, w_q, w_scale, bias)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # output rounding
    assert rel_err(out, ref) <= tol


@pytest.mark.parametrize("backend", WO_BACKENDS)
def test_weight_only_nan_rows_noncontiguous_empty(backend):
    K, N = 40, 24
    x = torch.randn(3, 2 * K)[:, ::2]
    x[1, 4] = float("nan")
    w_q, w_scale = make_weight(N, K)
    with fastdl.use_backend(backend):
        out = int8_weight_only_linear(x, w_q, w_scale)
        assert out[1].isnan().all() and torch.isfinite(out[[0, 2]]).all()
        ref = weight_only_64(x[[0, 2]], w_q, w_scale, None)
        assert rel_err(out[[0, 2]], ref) <= 1e-5
        wt = w_q.t().contiguous().t()  # column-major weight
        assert rel_err(int8_weight_only_linear(x[[0, 2]], wt, w_scale), ref) < 1e-5
        assert int8_weight_only_linear(torch.randn(0, K), w_q, w_scale).shape == (0, N)
        b = torch.randn(N)
        out = int8_weight_only_linear(torch.randn(2, 0), torch.zeros(N, 0, dtype=torch.int8), w_scale, b)
        assert same(out, b.expand(2, N).contiguous())


@pytest.mark.skipif(not backends.available("cpp", "int8_linear", "cpu")[0], reason="needs the compiled extension")
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("M,K,N", [(1, 384, 1536), (1, 1536, 384), (3, 200, 701)])
def test_cpp_weight_only_thread_split_matches_one_thread(grouped, M, K, N):
    # Sizes above the AVX2 weight-only kernel's serial limit (128 Ki MACs; the other kernels' limit is 1 Mi MACs): the
    # column split over threads gives the bits one thread gives, and both match float64.
    x = torch.randn(M, K)
    w = torch.randn(N, K) * torch.rand(N, 1)
    q = quantize_per_group(w) if grouped else (*quantize_per_channel(w), None)
    bias = torch.randn(N)
    threads = torch.get_num_threads()
    try:
        with fastdl.use_backend("cpp"):
            torch.set_num_threads(1)
            one = int8_weight_only_linear(x, q[0], q[1], bias, q[2])
            torch.set_num_threads(max(2, threads))
            many = int8_weight_only_linear(x, q[0], q[1], bias, q[2])
    finally:
        torch.set_num_threads(threads)
    assert same(one, many)
    ref = grouped_64(x, *q[:2], bias, q[2]) if grouped else weight_only_64(x, *q[:2], bias)
    assert rel_err(many, ref) <= 1e-5


# ------------------------------------------------------------------- weight-only with group scales (format v2)
def grouped_64(x, w_q, w_scale, bias, w_group):
    d = w_q.double() * w_group.double().repeat_interleave(16, dim=1)[:, : w_q.shape[1]]
    out = (x.double() @ d.t()) * w_scale.double()
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("backend", WO_BACKENDS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("M,K,N", SHAPES + [(4, 300, 17), (17, 100, 33), (5, 16, 7), (16, 2049, 9), (3, 31, 40)])
def test_weight_only_grouped_matches_reference(backend, dtype, M, K, N):
    x = torch.randn(M, K).to(dtype)
    w_q, w_scale, w_group = quantize_per_group(torch.randn(N, K) * torch.rand(N, 1))
    bias = torch.randn(N) if N % 2 else None
    with fastdl.use_backend(backend):
        out = int8_weight_only_linear(x, w_q, w_scale, bias, w_group)
        nc = int8_weight_only_linear(x, w_q, w_scale, bias, w_group.t().contiguous().t())  # any strides
    assert out.dtype == dtype and out.shape == (M, N) and same(nc, out)
    ref = grouped_64(x, w_q, w_scale, bias, w_group)
    # fp32: exact products; 16-bit x: d = q * code (up to 15 bits) may be rounded to x's dtype, then the output
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert rel_err(out, ref) <= tol, rel_err(out, ref)


@pytest.mark.parametrize("K", [1, 15, 16, 17, 33, 100, 257])
def test_quantize_per_group_format(K):
    N, G = 8, (K + 15) // 16
    w = torch.randn(N, K) * torch.rand(N, 1) * 3
    w[2] = 0.0
    w[3, :16] = 0.0  # a zero group in a non-zero row (when K > 16)
    w[4, 0] = float("nan")
    w[5, -1] = float("inf")
    q0, s0, g0 = quantize_per_group(w, search=False)
    q, s, g = quantize_per_group(w)
    for qq, ss, gg in ((q0, s0, g0), (q, s, g)):
        assert qq.dtype == torch.int8 and qq.shape == (N, K) and qq.abs().max() <= 127
        assert ss.dtype == torch.float32 and ss.shape == (N,)
        assert gg.dtype == torch.uint8 and gg.shape == (N, G)
        assert ss[2] == 0 and ss[4].isnan() and ss[5].isnan()
        for n in (2, 4, 5):
            assert not qq[n].any() and not gg[n].any()
    ok = [0, 1, 6, 7] + ([3] if K > 16 else [])
    amax = w[ok].abs().amax(1)
    assert torch.equal(s0[ok], amax / torch.full_like(amax, 127.0 * 255.0))  # IEEE fp32 division
    assert (g0[ok].amax(1) == 255).all()  # the group holding the row's max uses the full code range
    if K > 16:
        assert g0[3, 0] == 0 and not q0[3, :16].any()
    wp = torch.nn.functional.pad(w[ok], (0, G * 16 - K)).view(len(ok), G, 16)

    def group_err(qq, ss, gg):
        step = gg[ok].float() * ss[ok, None]
        deq = torch.nn.functional.pad(qq[ok].float(), (0, G * 16 - K)).view(len(ok), G, 16) * step[..., None]
        return (deq - wp).abs(), step

    err0, step0 = group_err(q0, s0, g0)
    assert (err0 <= step0[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all()  # no clipping without the search
    err, _ = group_err(q, s, g)
    assert (err.square().sum(2) <= err0.square().sum(2) * (1 + 1e-6)).all()  # the search never loses
    diff = g0[ok].int() - g[ok].int()
    assert ((diff >= 0) & (diff <= 2)).all()
    assert same(s, s0)


def test_v1_per_channel_checkpoint_loads_into_weight_only_layer():
    """A checkpoint of the per-channel format (version 1) keeps its scales: the layer becomes per-channel."""
    lin = nn.Linear(40, 24)
    w_q, w_scale = quantize_per_channel(lin.weight.detach())
    extra = {"format": "fastdl.Int8Linear", "version": 1, "mode": "weight_only", "trainable": False,
             "in_features": 40, "out_features": 24, "quantization": "symmetric per-channel int8"}  # fmt: skip
    sd = {"weight": w_q, "weight_scale": w_scale, "bias": lin.bias.detach(), "_extra_state": extra}
    m = Int8Linear(40, 24, mode="weight_only")
    assert m.group_size == 16
    m.load_state_dict(sd)
    x = torch.randn(3, 40)
    assert m.group_size is None and m.weight_group_scale is None
    assert same(m(x), int8_weight_only_linear(x, w_q, w_scale, lin.bias.detach()))
    assert "weight_group_scale" not in m.state_dict()
    assert decode_extra_state(m.state_dict()["_extra_state"])["group_size"] is None
    per_channel = Int8Linear.from_linear(lin, mode="weight_only", group_size=None)
    assert same(per_channel(x), m(x))
    with pytest.raises(ValueError, match="group_size"):
        Int8Linear(40, 24, mode="dynamic", group_size=16)
    with pytest.raises(ValueError, match="group_size"):
        Int8Linear(40, 24, mode="weight_only", group_size=32)
    with pytest.raises(ValueError, match="group_size"):
        Int8Linear(40, 24, mode="weight_only", trainable=True, group_size=None)


def test_grouped_weight_only_trainable_module_and_compile():
    torch.manual_seed(0)
    teacher = nn.Linear(48, 6)
    m = Int8Linear(48, 6, mode="weight_only", trainable=True)
    x = torch.randn(128, 48)
    y = teacher(x).detach()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    with torch.no_grad():
        before = F.mse_loss(m.eval()(x), y).item()
    m.train()
    for _ in range(40):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    m.eval()
    assert F.mse_loss(m(x), y).item() < 0.1 * before
    w_q, w_scale, w_group = quantize_per_group(m.weight.detach(), search=False)  # what training used
    assert same(m(x), int8_weight_only_linear(x, w_q, w_scale, m.bias.detach(), w_group))
    frozen = m.freeze()
    assert same(frozen(x), m(x)) and frozen.group_size == 16
    assert same(torch.compile(frozen, fullgraph=True)(x), frozen(x))
    sd = frozen.state_dict()
    t2 = Int8Linear(48, 6, mode="dynamic", trainable=True)
    t2.load_state_dict(sd)  # grouped int8 -> dequantized master weight, whatever the mode
    torch.testing.assert_close(t2.weight, int8_ops.grouped_weight(w_q, w_group) * w_scale[:, None])


@pytest.mark.skipif(not backends.available("cpp", "int8_linear", "cpu")[0], reason="needs the compiled extension")
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "native"])
def test_cpp_isa_levels_match_reference(isa):
    """The int8 kernels are chosen once per process from cpuid, capped by FASTDL_CPU_ISA: run every level in a
    subprocess against the references (W8A8, int8_mm, weight-only with and without group scales, fp32 and bf16)."""
    script = r"""
import torch, fastdl
from fastdl.ops import int8 as I
torch.manual_seed(0)
def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
for M, K, N in [(1, 33, 17), (3, 100, 40), (5, 64, 33), (17, 257, 70), (40, 2049, 24)]:
    w = torch.randn(N, K)
    b = torch.randn(N)
    wq, ws = I.quantize_per_channel(w)
    gq, gs, gg = I.quantize_per_group(w)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        x = torch.randn(M, K).to(dt)
        with fastdl.use_backend("cpp"):
            outs = [I.int8_linear(x, wq, ws, b), I.int8_weight_only_linear(x, wq, ws, b),
                    I.int8_weight_only_linear(x, gq, gs, b, gg)]
        with fastdl.use_backend("torch"):
            refs = [I.int8_linear(x.float(), wq, ws, b), I.int8_weight_only_linear(x.float(), wq, ws, b),
                    I.int8_weight_only_linear(x.float(), gq, gs, b, gg)]
        for o, r in zip(outs, refs):
            assert rel(o, r) <= tol, (M, K, N, dt, rel(o, r))
    a = torch.randint(-128, 128, (M, K), dtype=torch.int8)
    with fastdl.use_backend("cpp"):
        acc = I.int8_mm(a, wq, torch.rand(M), ws, None, torch.int32)
    assert torch.equal(acc, (a.long() @ wq.long().t()).int())
print("ok", fastdl.info()["int8_cpu_kernels"])
"""
    out = run_at_isa(isa, script)
    assert "ok" in out, out
    native = native_cpu_kernels()["int8"]
    expect = {"scalar": "scalar", "avx2": "avx2" if native != "scalar" else "scalar"}.get(isa)
    if isa == "avx512":
        expect = "avx512_vnni" if native.startswith("avx512") else native
    assert out.split()[-1] == (expect or native), (isa, out)


@pytest.mark.skipif(not backends.available("cpp", "int8_linear", "cpu")[0], reason="needs the compiled extension")
@pytest.mark.parametrize("isa", ["avx512", "native"])
def test_cpp_pb_route_weight_only(isa):
    """FASTDL_CPU_PB_ROWS=1: every weight-only call of an AVX-512 family takes fused_linear's fp32 pb kernel with the
    int8 weight dequantized per chunk of panels while packed (the route large M takes: held_pb_min_rows), on every
    shape of check_weight_only_paths against float64; other families ignore the variable."""
    out = run_at_isa(isa, "import os; os.environ['FASTDL_CPU_PB_ROWS'] = '1'; import test_int8 as t; "
                          "print('weight_only', t.check_weight_only_paths())")
    assert "weight_only" in out, out


# ---------------------------------------------------------------------------------------- accuracy, K = 4096
@pytest.mark.parametrize("backend", LIN_BACKENDS)
def test_accuracy_gaussian_k4096(backend):
    """W8A8 within 1.5% of the fp32 layer; weight-only with group scales (the default format) within 0.5%.
    Per-channel weight-only int8 cannot reach 0.5% on Gaussian weights: the rounding noise alone is
    step / sqrt(12) = (max|w| / 127) / sqrt(12) ~ 3.8 sigma / 440 ~ 0.87% of sigma; no 8-bit scalar quantizer of a
    Gaussian with one scale per row gets below 0.64% (Panter-Dite) - so it is bounded by 1.0%. Both must add
    nothing beyond their dequantized layer."""
    M, K, N = 16, 4096, 64 if backend == "triton" else 256
    x = torch.randn(M, K)
    w = torch.randn(N, K) / K**0.5
    b = torch.randn(N) * 0.1
    ref = F.linear(x.double(), w.double(), b.double())
    w_q, w_scale = quantize_per_channel(w)
    with fastdl.use_backend(backend):
        w8a8 = int8_linear(x, w_q, w_scale, b)
        wo = int8_weight_only_linear(x, w_q, w_scale, b)
    e_w8a8, e_wo = rel_err(w8a8, ref), rel_err(wo, ref)
    assert e_w8a8 <= 0.015, e_w8a8
    assert e_wo <= 0.010, e_wo
    deq = F.linear(x.double(), quant.dequantize(w_q, w_scale).double(), b.double())
    assert rel_err(wo, deq) <= 1e-5
    assert e_wo < e_w8a8
    g_q, g_s, g_g = quantize_per_group(w)
    with fastdl.use_backend(backend):
        wo_g = int8_weight_only_linear(x, g_q, g_s, b, g_g)
        wo_g16 = int8_weight_only_linear(x.bfloat16(), g_q, g_s, b, g_g)
    e_g = rel_err(wo_g, ref)
    assert e_g <= 0.005, e_g
    deq_g = F.linear(x.double(), (int8_ops.grouped_weight(g_q, g_g) * g_s[:, None]).double(), b.double())
    assert rel_err(wo_g, deq_g) <= 1e-5
    # bf16 activations: no worse than the group error plus twice PyTorch's own bf16 error on this layer
    e_torch_bf16 = rel_err(F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()), ref)
    assert rel_err(wo_g16, ref) <= e_g + 2 * e_torch_bf16, (rel_err(wo_g16, ref), e_g, e_torch_bf16)


# ------------------------------------------------------------------------------------------------- bad inputs
# Each bad argument: (call, exception type, message naming the argument and the expected value); the type is the
# kind of mistake (TypeError: dtype, ValueError: shape or value, RuntimeError: device), the same on every backend.
def _bad_linear_cases():
    x = torch.randn(4, 8)
    w_q, w_scale = make_weight(5, 8)
    a_q = rand_int8(4, 8)
    wo = int8_weight_only_linear
    return {
        "mismatched K": (lambda: int8_linear(x, rand_int8(5, 7), w_scale), ValueError,
                         r"int8_linear: w_q must have shape \[N, K\] with K = x.shape\[-1\] = 8, got \(5, 7\)"),
        "int x": (lambda: int8_linear(x.to(torch.int32), w_q, w_scale), TypeError,
                  r"x must be float32, bfloat16 or float16, got dtype torch.int32"),
        "float w_q": (lambda: int8_linear(x, w_q.float(), w_scale), TypeError,
                      r"w_q must be int8, got dtype torch.float32"),
        "w_scale shape": (lambda: int8_linear(x, w_q, torch.rand(4)), ValueError,
                          r"w_scale must have shape \[N\] = \[5\], got \(4,\)"),
        "w_scale dtype": (lambda: int8_linear(x, w_q, w_scale.half()), TypeError,
                          r"w_scale must be float32, got dtype torch.float16"),
        "bias shape": (lambda: int8_linear(x, w_q, w_scale, torch.randn(6)), ValueError,
                       r"bias must have shape \[N\] = \[5\], got \(6,\)"),
        "w_packed shape": (lambda: int8_linear(x, w_q, w_scale, None, torch.zeros(16, 4, dtype=torch.int8),
                                               torch.zeros(16, dtype=torch.int32)), ValueError,
                           r"w_packed must have shape \[roundup\(N, 16\), roundup\(K, 4\)\] = \[16, 8\]"),
        "w_comp alone": (lambda: int8_linear(x, w_q, w_scale, None, None, torch.zeros(16, dtype=torch.int32)),
                         ValueError, r"w_packed and w_comp must be given together"),
        "weight-only mismatched K": (lambda: wo(x, rand_int8(5, 9), w_scale), ValueError,
                                     r"w_q must have shape \[N, K\] with K = x.shape\[-1\] = 8, got \(5, 9\)"),
        "w_group_scale dtype": (lambda: wo(x, w_q, w_scale, None, torch.ones(5, 1, dtype=torch.int32)), TypeError,
                                r"w_group_scale must be uint8 \(from quantize_per_group\), got dtype torch.int32"),
        "w_group_scale shape": (lambda: wo(x, w_q, w_scale, None, torch.ones(4, 1, dtype=torch.uint8)), ValueError,
                                r"w_group_scale must have shape \[N, ceil\(K / \d+\)\] = \[5, 1\], got \(4, 1\)"),
        "mm mismatched K": (lambda: int8_mm(a_q, rand_int8(5, 9), torch.rand(4), torch.rand(5)), ValueError,
                            r"b_q must have shape \[N, K\] with K = a_q.shape\[1\] = 8, got \(5, 9\)"),
        "mm out_dtype": (lambda: int8_mm(a_q, w_q, torch.rand(4), w_scale, None, torch.float64), TypeError,
                         r"out_dtype must be one of float32, bfloat16, float16, int32, got torch.float64"),
        "mm a_scale shape": (lambda: int8_mm(a_q, w_q, torch.rand(3), w_scale), ValueError,
                             r"a_scale must have shape \[M\] = \[4\], got \(3,\)"),
        "mm float a_q": (lambda: int8_mm(x, w_q, torch.rand(4), w_scale), TypeError,
                         r"a_q must be int8, got dtype torch.float32"),
    }


BAD_LINEAR = _bad_linear_cases()


@pytest.mark.parametrize("backend", LIN_BACKENDS)
@pytest.mark.parametrize("case", list(BAD_LINEAR))
def test_bad_inputs_raise_one_type_naming_argument_and_expected_value(backend, case):
    call, exc, message = BAD_LINEAR[case]
    with fastdl.use_backend(backend), pytest.raises(exc, match=message) as info:
        call()
    assert type(info.value) is exc, (type(info.value), info.value)


@pytest.mark.parametrize("backend", Q_BACKENDS)
def test_bad_quantize_and_pack_inputs(backend):
    with fastdl.use_backend(backend), pytest.raises(TypeError, match=r"quantize_per_token: x must be float32, "
                                                                        r"bfloat16 or float16, got dtype torch.int64"):
        quantize_per_token(torch.randint(0, 5, (3, 4)))
    with pytest.raises(TypeError, match=r"int8_pack_weight: w_q must be int8, got dtype torch.float32"):
        int8_pack_weight(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"int8_pack_weight: w_q must be 2-D \[N, K\], got shape \(4,\)"):
        int8_pack_weight(rand_int8(4, 1)[:, 0])


@requires_cuda
def test_device_mismatch_raises():
    w_q, w_scale = make_weight(5, 8)
    with pytest.raises(RuntimeError, match=r"w_q must be on the same device as x \(cpu\), got cuda:0"):
        int8_linear(torch.randn(4, 8), w_q.cuda(), w_scale)


# ------------------------------------------------------------------------------------------ autograd, QAT op
def test_frozen_int8_linear_gradients_flow_to_x_and_bias():
    K, N = 24, 10
    w_q, w_scale = make_weight(N, K)
    for fn in (int8_linear, int8_weight_only_linear):
        x = torch.randn(3, 5, K, requires_grad=True)
        b = torch.randn(N, requires_grad=True)
        g = torch.randn(3, 5, N)
        fn(x, w_q, w_scale, b).backward(g)
        deq = w_q.float() * w_scale[:, None]
        torch.testing.assert_close(x.grad, (g.reshape(-1, N) @ deq).reshape(x.shape), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.grad, g.reshape(-1, N).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_only", [False, True])
def test_qat_forward_and_straight_through_backward(weight_only):
    K, N = 40, 12
    x = torch.randn(2, 7, K, requires_grad=True)
    w = torch.randn(N, K, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    out = int8_linear_qat(x, w, b, weight_only)
    if weight_only:  # the group-scaled format, quantized without the search at every step
        w_q, w_scale, w_group = quantize_per_group(w.detach(), search=False)
        expect = int8_weight_only_linear(x.detach(), w_q, w_scale, b.detach(), w_group)
    else:
        w_q, w_scale = quantize_per_channel(w.detach())
        expect = int8_linear(x.detach(), w_q, w_scale, b.detach())
    assert same(out.detach(), expect)
    g = torch.randn(2, 7, N)
    out.backward(g)
    g2, x2 = g.reshape(-1, N), x.detach().reshape(-1, K)
    torch.testing.assert_close(x.grad, (g2 @ w.detach()).reshape(x.shape), rtol=1e-5, atol=1e-5)  # g @ W
    torch.testing.assert_close(w.grad, g2.t() @ x2, rtol=1e-5, atol=1e-5)  # g^T @ x
    torch.testing.assert_close(b.grad, g2.sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("needs", [(1, 1, 1), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_qat_cpp_autograd_matches_the_dispatcher_autograd(needs, with_bias):
    # with the C++ backend an eager QAT call that needs a gradient records the extension's C++ autograd node
    # (csrc/int8_autograd.cpp): the same output and straight-through gradients, bit for bit, as the op's registered
    # autograd (reached through the dispatcher), for every subset of x / weight / bias needing one
    if not backends.available("cpp", "int8_linear_qat", "cpu")[0]:
        pytest.skip("needs the compiled extension")
    K, N = 40, 12
    x, w = torch.randn(2, 7, K), torch.randn(N, K)
    b = torch.randn(N) if with_bias else None
    check_cpp_autograd_matches_dispatcher(lambda: int8_linear_qat(x, w, b), (x, w, b), needs, torch.randn(2, 7, N))


def test_qat_w8a8_is_one_cpp_call_with_the_composite_s_result_and_words():
    # the C++ CPU kernel of int8_linear_qat (quantize the master weight + int8_linear) gives the composite's bits; a
    # bad input is reported in int8_linear_qat's words on every backend
    from fastdl import backends

    if not backends.available("cpp", "int8_linear_qat", "cpu")[0]:
        pytest.skip("needs the compiled extension")
    K, N = 40, 12
    x, w, b = torch.randn(2, 7, K), torch.randn(N, K), torch.randn(N)
    assert backends.select("int8_linear_qat", "cpu", (x, w, b, False)) == "cpp"
    assert backends.select("int8_linear_qat", "cpu", (x, w, b, True)) == "torch"  # group scales: the composite
    out = int8_linear_qat(x, w, b)
    with fastdl.use_backend("torch"):
        ref = int8_linear_qat(x, w, b)
    assert same(out, ref)
    for backend in ("cpp", "torch"):
        with fastdl.use_backend(backend):
            with pytest.raises(TypeError, match=r"int8_linear_qat: weight \(the float master weight\) must have x's "
                                                r"dtype \(torch.float32\) or float32, got torch.float64"):
                int8_linear_qat(x, w.double(), b)
            with pytest.raises(ValueError, match=r"int8_linear_qat: weight must have shape \[N, K\] with K = "
                                                 r"x.shape\[-1\] = 40, got \(12, 39\)"):
                int8_linear_qat(x.requires_grad_(), w[:, :39], b)
            with pytest.raises(ValueError, match=r"int8_linear_qat: bias must have shape \[N\] = \[12\], got \(5,\)"):
                int8_linear_qat(x, w, torch.randn(5))


def test_qat_autocast_bf16_keeps_fp32_master_grads():
    x = torch.randn(16, 32)
    w = torch.randn(8, 32, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = int8_linear_qat(x, w, b)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


# --------------------------------------------------------------------------------------- opcheck and compile
@pytest.mark.parametrize("backend", NOT_TRITON)
def test_opcheck_every_op(backend):
    M, K, N = 5, 36, 18
    x = torch.randn(M, K)
    w_q, w_scale = make_weight(N, K)
    packed, comp = int8_pack_weight(w_q)
    a = rand_int8(M, K)
    sa = torch.rand(M)
    bias = torch.randn(N)
    ops = torch.ops.fastdl
    with fastdl.use_backend(backend):
        torch.library.opcheck(ops.quantize_per_token.default, (x,))
        torch.library.opcheck(ops.quantize_per_token.default, (torch.randn(2, 3, K).bfloat16(),))
        torch.library.opcheck(ops.int8_pack_weight.default, (w_q,))
        for od in (torch.int32, torch.float32, torch.bfloat16):
            torch.library.opcheck(ops.int8_mm.default, (a, w_q, sa, w_scale, bias, od, None, None))
        torch.library.opcheck(ops.int8_mm.default, (a, w_q, sa, w_scale, None, torch.float16, packed, comp))
        xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
        torch.library.opcheck(ops.int8_linear.default, (xg, w_q, w_scale, bg, None, None))
        torch.library.opcheck(ops.int8_linear.default, (x.bfloat16(), w_q, w_scale, None, packed, comp))
        torch.library.opcheck(ops.int8_linear.default, (xg, w_q, w_scale, bg, packed, comp, 7))
        torch.library.opcheck(ops.int8_weight_only_linear.default, (xg, w_q, w_scale, bg))
        gq, gs, gg = quantize_per_group(torch.randn(N, K))
        torch.library.opcheck(ops.int8_weight_only_linear.default, (xg, gq, gs, bg, gg))
        torch.library.opcheck(ops.int8_weight_only_linear.default, (x.bfloat16(), gq, gs, None, gg))
    # the composite QAT op (its backward is fused_linear_backward, served by whichever backend has it)
    wg = torch.randn(N, K, requires_grad=True)
    torch.library.opcheck(ops.int8_linear_qat.default, (xg, wg, bg, False))
    torch.library.opcheck(ops.int8_linear_qat.default, (xg, wg, None, True))


def test_compile_fullgraph_ops():
    def f(x, w):
        w_q, w_scale = quantize_per_channel(w)
        q, s = quantize_per_token(x)
        packed, comp = int8_pack_weight(w_q)
        y1 = int8_mm(q, w_q, s, w_scale, None, torch.float32, packed, comp)
        y2 = int8_linear(x, w_q, w_scale, None, packed, comp)
        y3 = int8_weight_only_linear(x, w_q, w_scale)
        return y1 + y2 + y3

    x, w = torch.randn(6, 40), torch.randn(24, 40)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    assert same(out, f(x, w))


def test_compile_fullgraph_modules_inference_and_qat():
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    model = quant.quantize_model(copy.deepcopy(float_model)).eval()
    model[2] = Int8Linear.from_linear(float_model[2], mode="weight_only")
    x = torch.randn(8, 32)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert same(compiled(x), model(x))

    qat = quant.quantize_model(copy.deepcopy(float_model), trainable=True)
    ref = copy.deepcopy(qat)
    xg = x.clone().requires_grad_()
    out = torch.compile(qat, fullgraph=True, backend="aot_eager")(xg)
    out.square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(qat.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    assert xg.grad is not None


@pytest.mark.slow
def test_compile_inductor_module():
    m = Int8Linear.from_linear(nn.Linear(48, 20)).eval()
    x = torch.randn(5, 48)
    assert same(torch.compile(m, fullgraph=True)(x), m(x))


# ---------------------------------------------------------------------------------------------------- module
def test_module_7bit_activations_forward_checkpoint_and_errors():
    """Int8Linear(act_bits=7): its forward is int8_linear(..., act_bits=7) bit for bit (on every path the run-time
    choice may take: the op's); the setting survives state_dict, fastdl.save / fastdl.load and deepcopy; bad
    combinations are refused with the argument named."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 96)
    m = Int8Linear.from_linear(lin, act_bits=7).eval()
    x = torch.randn(10, 256)
    w_q, w_scale = quantize_per_channel(lin.weight.detach())
    with torch.no_grad():
        out = m(x)
    assert m.act_bits == 7 and "act_bits=7" in repr(m)
    assert same(out, int8_linear(x, w_q, w_scale, lin.bias.detach(), None, None, 7))
    assert not same(out, int8_linear(x, w_q, w_scale, lin.bias.detach()))  # the 8-bit result differs
    assert rel_err(out, lin(x).detach()) <= 0.03
    assert decode_extra_state(m.state_dict()["_extra_state"])["act_bits"] == 7
    assert m.recipe()["act_bits"] == 7 and "act_bits" not in Int8Linear.from_linear(lin).recipe()
    model = nn.Sequential(copy.deepcopy(lin))
    fastdl.convert(model, "int8_act7")
    assert isinstance(model[0], Int8Linear) and model[0].act_bits == 7
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.pt")
        fastdl.save(model, path)
        loaded = fastdl.load(nn.Sequential(nn.Linear(256, 96)), path).eval()
    assert loaded[0].act_bits == 7 and same(loaded(x), model.eval()(x))
    assert copy.deepcopy(m).act_bits == 7
    for kwargs, msg in (({"act_bits": 6}, "act_bits must be 8 or 7"),
                        ({"act_bits": 7, "mode": "weight_only"}, "act_bits=7"),
                        ({"act_bits": 7, "trainable": True}, "act_bits=7")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            Int8Linear.from_linear(lin, **kwargs)


def test_auto_considers_7bit_activations_only_where_its_kernel_pays(monkeypatch):
    """convert("auto")'s default candidates add int8_act7 for a CPU model on the AVX2 int8 kernels only."""
    import fastdl._extension as ext
    from fastdl.convert import DEFAULT_CANDIDATES, _default_candidates

    model = nn.Sequential(nn.Linear(8, 8))
    monkeypatch.setattr(ext, "int8_cpu_kernels", lambda: "avx2")
    assert _default_candidates(model) == DEFAULT_CANDIDATES + ("int8_act7",)
    assert _default_candidates(model.to("meta")) == DEFAULT_CANDIDATES
    monkeypatch.setattr(ext, "int8_cpu_kernels", lambda: "avx512_vnni+bf16")
    assert _default_candidates(nn.Sequential(nn.Linear(8, 8))) == DEFAULT_CANDIDATES


@pytest.mark.parametrize("mode", ["dynamic", "weight_only"])
def test_module_from_linear_to_linear(mode):
    lin = nn.Linear(256, 96)
    m = Int8Linear.from_linear(lin, mode=mode).eval()
    x = torch.randn(10, 256)
    assert rel_err(m(x), lin(x)) <= (0.015 if mode == "dynamic" else 0.006)
    if mode == "dynamic":
        w_q, w_scale = quantize_per_channel(lin.weight.detach())
        assert m.group_size is None and same(m(x), int8_linear(x, w_q, w_scale, lin.bias.detach()))
        deq = quant.dequantize(w_q, w_scale)
    else:
        w_q, w_scale, w_group = quantize_per_group(lin.weight.detach())
        assert m.group_size == 16 and torch.equal(m.weight_group_scale, w_group)
        assert same(m(x), int8_weight_only_linear(x, w_q, w_scale, lin.bias.detach(), w_group))
        deq = int8_ops.grouped_weight(w_q, w_group) * w_scale[:, None]
    back = m.to_linear()
    assert isinstance(back, nn.Linear) and back.weight.dtype == torch.float32
    torch.testing.assert_close(back.weight, deq)
    assert rel_err(back(x), lin(x)) <= 0.01
    assert "mode=" in repr(m)
    with pytest.raises(ValueError, match="mode"):
        Int8Linear(4, 4, mode="int4")
    with pytest.raises(TypeError, match="nn.Linear"):
        Int8Linear.from_linear(nn.Conv1d(3, 3, 1))
    assert m(x.bfloat16()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert m(x).dtype == torch.bfloat16


@pytest.mark.parametrize("mode", ["dynamic", "weight_only"])
def test_module_state_dict_round_trip(mode):
    lin = nn.Linear(40, 24)
    m = Int8Linear.from_linear(lin, mode=mode)
    sd = m.state_dict()
    grouped = {"weight_group_scale"} if mode == "weight_only" else set()
    assert set(sd) == {"weight", "weight_scale", "bias", "_extra_state"} | grouped
    assert sd["weight"].dtype == torch.int8 and sd["weight"].shape == (24, 40)
    assert sd["weight_scale"].dtype == torch.float32 and sd["weight_scale"].shape == (24,)
    record = decode_extra_state(sd["_extra_state"])  # a uint8 JSON tensor: the state dict holds only tensors
    assert sd["_extra_state"].dtype == torch.uint8 and record["version"] == FORMAT_VERSION and record["mode"] == mode
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = Int8Linear(40, 24, mode=mode)
    fresh.load_state_dict(loaded)
    x = torch.randn(3, 40)
    assert same(fresh(x), m(x))
    other_mode = Int8Linear(40, 24, mode="weight_only" if mode == "dynamic" else "dynamic")
    if mode == "dynamic":
        other_mode.load_state_dict(loaded)  # per-channel int8 weights serve both modes, kept as they are
        assert torch.equal(other_mode.qweight, m.qweight) and other_mode.group_size is None
    else:  # group scales: only weight-only layers serve them
        with pytest.raises(RuntimeError, match="weight_only"):
            other_mode.load_state_dict(loaded)
    from_float = Int8Linear(40, 24, mode=mode)
    from_float.load_state_dict(lin.state_dict())  # a plain nn.Linear checkpoint: quantized on load
    assert same(from_float(x), m(x))
    no_bias = Int8Linear(40, 24, bias=False, mode=mode)
    with pytest.raises(RuntimeError, match="bias"):
        no_bias.load_state_dict(loaded)
    with pytest.raises(RuntimeError, match="size mismatch"):
        Int8Linear(41, 24).load_state_dict(loaded)
    newer = dict(loaded)
    newer["_extra_state"] = encode_extra_state({**record, "version": FORMAT_VERSION + 1})
    with pytest.raises(RuntimeError, match="newer"):
        Int8Linear(40, 24, mode=mode).load_state_dict(newer)
    missing = {k: v for k, v in loaded.items() if k != "weight_scale"}
    with pytest.raises(RuntimeError, match="weight_scale"):
        Int8Linear(40, 24, mode=mode).load_state_dict(missing)


def test_module_packed_cpu_weight_held_once(monkeypatch):
    """With a CPU kernel that reads the VNNI layout, a dynamic layer holds only the packed weight (made at
    construction/load/move, not per call); results, state_dict, deepcopy and dtype moves are unchanged."""
    monkeypatch.setattr(nn_int8, "_cpu_packing_available", lambda: True)
    lin = nn.Linear(70, 33)
    m = Int8Linear.from_linear(lin)
    assert m.weight is None and m.weight_packed is not None and m.weight_packed.shape == (48, 72)
    monkeypatch.setattr(nn_int8, "_cpu_packing_available", lambda: False)
    plain = Int8Linear.from_linear(lin)
    assert plain.weight is not None and plain.weight_packed is None
    monkeypatch.setattr(nn_int8, "_cpu_packing_available", lambda: True)
    x = torch.randn(4, 70)
    assert same(m(x), plain(x))
    calls = []
    monkeypatch.setattr(int8_ops, "int8_pack_weight_op", lambda *a: calls.append(1) or int8_ops.pack_reference(*a))
    for _ in range(3):
        m(x)
    assert not calls  # never per call
    assert torch.equal(m.state_dict()["weight"], plain.state_dict()["weight"])
    assert "weight_packed" not in m.state_dict()
    assert same(copy.deepcopy(m)(x), m(x))
    loaded = Int8Linear(70, 33)
    loaded.load_state_dict(plain.state_dict())
    assert loaded.weight is None and same(loaded(x), m(x))
    m.half()
    assert m.weight_scale.dtype == torch.float32 and m.weight_packed is not None
    assert same(m(x), int8_linear(x, plain.weight, plain.weight_scale, lin.bias.detach().half()))


@pytest.mark.parametrize("packed", [False, True])
def test_module_memory_at_most_027_of_fp32(monkeypatch, packed):
    monkeypatch.setattr(nn_int8, "_cpu_packing_available", lambda: packed)
    lin = nn.Linear(1024, 1000)
    fp32_bytes = sum(p.numel() * p.element_size() for p in lin.parameters())
    for mode in ("dynamic", "weight_only"):
        m = Int8Linear.from_linear(lin, mode=mode)
        assert m.memory_bytes() <= 0.27 * fp32_bytes, m.memory_bytes() / fp32_bytes
        held = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
        assert held <= 0.27 * fp32_bytes
        assert (m.weight_packed is not None) == (packed and mode == "dynamic")


def test_quantize_model_and_freeze():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8), nn.Linear(8, 2)))
    x = torch.randn(4, 16)
    ref = model(x)
    q = quant.quantize_model(copy.deepcopy(model), filter_fn=lambda name, lin: name != "2.1")
    assert isinstance(q[0], Int8Linear) and isinstance(q[2][0], Int8Linear) and type(q[2][1]) is nn.Linear
    assert rel_err(q(x), ref) < 0.03
    t = quant.quantize_model(copy.deepcopy(model), trainable=True).eval()
    frozen = quant.freeze_model(copy.deepcopy(t))
    assert all(not m.trainable for m in frozen.modules() if isinstance(m, Int8Linear))
    assert same(frozen(x), t(x))
    assert isinstance(quant.quantize_model(nn.Linear(3, 4)), Int8Linear)


def test_trainable_module_checkpoints_interchange():
    lin = nn.Linear(30, 20)
    t = Int8Linear.from_linear(lin, trainable=True)
    sd = t.state_dict()
    assert set(sd) == {"weight", "bias", "_extra_state"} and sd["weight"].dtype == torch.float32
    assert decode_extra_state(sd["_extra_state"])["trainable"] is True
    inf = Int8Linear(30, 20)
    inf.load_state_dict(sd)  # master weights are quantized on load
    x = torch.randn(5, 30)
    assert same(inf(x), t.eval()(x))
    t2 = Int8Linear(30, 20, trainable=True)
    t2.load_state_dict(inf.state_dict())  # int8 -> dequantized master weight
    torch.testing.assert_close(t2.weight, quant.dequantize(inf.qweight, inf.weight_scale))
    assert same(t2.eval()(x), inf(x))


def test_trainable_module_trains_then_serves_int8():
    torch.manual_seed(0)
    teacher = nn.Linear(16, 4)
    m = Int8Linear(16, 4, trainable=True)
    x = torch.randn(256, 16)
    y = teacher(x).detach()
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    with torch.no_grad():
        before = F.mse_loss(m.eval()(x), y).item()
    m.train()
    for _ in range(60):
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()
    m.eval()
    after = F.mse_loss(m(x), y).item()
    assert after < 0.1 * before
    w_q, w_scale = quantize_per_channel(m.weight.detach())
    assert same(m(x), int8_linear(x, w_q, w_scale, m.bias.detach()))  # eval = int8 inference of the master weights
    with torch.no_grad():
        m.weight.mul_(0.5)  # an update made in eval mode is noticed (outside torch.compile)
    w_q, w_scale = quantize_per_channel(m.weight.detach())
    assert same(m(x), int8_linear(x, w_q, w_scale, m.bias.detach()))


# ---------------------------------------------------------------------------------------------------- DDP QAT
def _qat_ddp_worker(rank, world, port, result_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(128, 12, generator=g)
    target = torch.tanh(data @ torch.randn(12, 3, generator=g))
    model = quant.quantize_model(nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3)), trainable=True)
    with torch.no_grad():
        before = F.mse_loss(model.eval()(data), target).item()
    model.train()
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.02)
    shard = slice(rank * 64, (rank + 1) * 64)
    for _ in range(40):
        opt.zero_grad()
        F.mse_loss(ddp(data[shard]), target[shard]).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        after = F.mse_loss(model(data), target).item()
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    torch.save({"state": state, "before": before, "after": after}, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def test_qat_ddp_two_processes_gloo():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_qat_ddp_worker, args=(2, port, d), nprocs=2, join=True)
        r0 = torch.load(os.path.join(d, "rank0.pt"))
        r1 = torch.load(os.path.join(d, "rank1.pt"))
    assert set(r0["state"]) == set(r1["state"]) and r0["state"]
    for k in r0["state"]:
        assert torch.equal(r0["state"][k], r1["state"][k]), k
    assert r0["after"] == r1["after"]
    assert r0["after"] < 0.5 * r0["before"], (r0["before"], r0["after"])


# ---------------------------------------------------------------------------------------------------- CUDA
def cuda_backends(op):
    return [b for b in ("triton", "cpp", "torch") if backends.available(b, op, "cuda")[0]]


@requires_cuda
@pytest.mark.parametrize("dtype", FLOATS)
def test_cuda_quantize_bit_exact_every_backend(dtype):
    x = (torch.randn(300, 4100) * 2).to(dtype)
    x[3, 7] = float("nan")
    x[5] = 0
    for shape in ((300, 4100), (64, 512), (7, 33), (1, 4096)):
        xs = x[: shape[0], : shape[1]]
        ref_q, ref_s = quant_np(xs)
        for backend in cuda_backends("quantize_per_token"):
            with fastdl.use_backend(backend):
                q, s = quantize_per_token(xs.cuda())
                q2, s2 = quantize_per_token(xs.cuda().t().contiguous().t())  # strided: last dim not contiguous
                q3, s3 = quantize_per_token(x.cuda()[: shape[0], : shape[1]])  # strided rows
            for qq, ss in ((q, s), (q2, s2), (q3, s3)):
                assert same(qq.cpu(), ref_q) and same(ss.cpu(), ref_s), (backend, shape)


@requires_cuda
@pytest.mark.parametrize("M", [1, 5, 17, 64, 65, 300])
def test_cuda_gemms_every_backend(M):
    K, N = 4096, 1000
    x = torch.randn(M, K)
    if M > 2:
        x[0, 5] = float("nan")
    w_q, w_scale = make_weight(N, K)
    bias = torch.randn(N)
    a = rand_int8(M, K)
    sa = torch.rand(M)
    acc_ref = (a.double() @ w_q.double().t()).to(torch.int32)
    xc, wc, sc, bc, ac, sac = (t.cuda() for t in (x, w_q, w_scale, bias, a, sa))
    g_q, g_s, g_g = quantize_per_group(torch.randn(N, K))
    gqc, gsc, ggc = g_q.cuda(), g_s.cuda(), g_g.cuda()
    for backend in cuda_backends("int8_linear"):
        with fastdl.use_backend(backend):
            assert torch.equal(int8_mm(ac, wc, sac, sc, None, torch.int32).cpu(), acc_ref), backend
            out = int8_mm(ac, wc, sac, sc, bc, torch.float32).cpu()
            assert same(out, dequant(acc_ref, sa, w_scale, bias, torch.float32)), backend
            for dtype in FLOATS:
                y = int8_linear(xc.to(dtype), wc, sc, bc).cpu()
                assert same(y, linear_exact(x.to(dtype), w_q, w_scale, bias)), (backend, dtype)
                wo = int8_weight_only_linear(xc.to(dtype), wc, sc, bc).cpu()
                ok_rows = torch.isfinite(wo).all(1)
                ref = weight_only_64(x.to(dtype), w_q, w_scale, bias)
                tol = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]  # TF32 allowed
                assert rel_err(wo[ok_rows], ref[ok_rows]) <= tol, (backend, dtype)
                wg = int8_weight_only_linear(xc.to(dtype), gqc, gsc, bc, ggc).cpu()
                ref_g = grouped_64(x.to(dtype), g_q, g_s, bias, g_g)
                assert rel_err(wg[ok_rows], ref_g[ok_rows]) <= tol, (backend, dtype, "grouped")


@requires_cuda
def test_cuda_module_same_checkpoint_and_compile():
    lin = nn.Linear(512, 256)
    cpu = Int8Linear.from_linear(lin)
    sd = cpu.state_dict()
    gpu = Int8Linear(512, 256, device="cuda")
    gpu.load_state_dict(sd)
    x = torch.randn(33, 512)
    assert same(gpu(x.cuda()).cpu(), cpu(x))
    moved = copy.deepcopy(cpu).cuda()
    assert same(moved(x.cuda()).cpu(), cpu(x))
    assert torch.equal(moved.cpu().state_dict()["weight"], sd["weight"])
    grouped = Int8Linear.from_linear(lin, mode="weight_only")  # group scales: the same checkpoint on either device
    g_gpu = Int8Linear(512, 256, mode="weight_only", device="cuda")
    g_gpu.load_state_dict(grouped.state_dict())
    assert torch.equal(g_gpu.weight_group_scale.cpu(), grouped.weight_group_scale)
    assert rel_err(g_gpu(x.cuda()).cpu(), grouped(x)) <= 2e-3  # TF32 allowed on the GPU
    assert same(torch.compile(gpu, fullgraph=True)(x.cuda()).cpu(), cpu(x))
    qat = Int8Linear.from_linear(lin, trainable=True).cuda()
    qat(x.cuda().bfloat16()).float().sum().backward()
    assert qat.weight.grad is not None and qat.weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------ CPU kernel families at every ISA level
# Each level's kernels run in a subprocess (FASTDL_CPU_ISA is read once per process) against exact references:
# these helpers are the subprocess's body (run_at_isa puts this directory on its path).
ISA_LEVELS = ["scalar", "avx2", "avx512", "native"]


def saturation_cases():
    """int8 operands at the extremes of vpmaddubsw: pairs of +-127 products of one sign (pair sums 32258, the most a
    pair of [-127, 127] values reaches), and -128 in A, in B and in both (int8_mm accepts the full int8 range)."""
    K = 4096 + 4  # two K slices of the W8A8 driver (4096 + 4)
    a = torch.full((6, K), 127, dtype=torch.int8)
    a[1] = -127
    a[2, ::2] = -127
    a[3] = -128
    a[4, 1::2] = -128
    a[5, ::3] = -128
    b = torch.full((7, K), 127, dtype=torch.int8)
    b[1] = -127
    b[2, ::2] = -127
    b[3] = -128
    b[4, ::3] = -128
    b[5, 1::4] = 0
    b[6] = torch.randint(-128, 128, (K,), dtype=torch.int8)
    return a, b


def check_w8a8_exact() -> str:
    """int8_mm (int32 and float outputs) and int8_linear bit for bit against the exact references, at the saturation
    extremes and on random data with odd shapes (register-tile and 16-column tails, K slices)."""
    torch.manual_seed(0)
    cases = [saturation_cases()]
    for M, K, N in [(1, 33, 17), (5, 64, 33), (13, 4100, 20), (4, 7, 16), (9, 259, 70)]:
        cases.append((rand_int8(M, K), rand_int8(N, K)))
    for a, b in cases:
        M, N = a.shape[0], b.shape[0]
        packed, comp = int8_pack_weight(b)
        sa, sb, bias = torch.rand(M), torch.rand(N), torch.randn(N)
        with fastdl.use_backend("cpp"):
            acc = int8_mm(a, b, sa, sb, None, torch.int32, packed, comp)
            acc_np = int8_mm(a, b, sa, sb, None, torch.int32)  # packed inside the op
            out = int8_mm(a, b, sa, sb, bias, torch.bfloat16, packed, comp)
            out_nc = int8_mm(a.t().contiguous().t(), b, sa, sb, bias, torch.float32, packed, comp)  # column-major a
        ref = acc_exact(a, b)
        assert torch.equal(acc, ref) and torch.equal(acc_np, ref), (a.shape, b.shape)
        assert same(out, dequant(ref, sa, sb, bias, torch.bfloat16))
        assert same(out_nc, dequant(ref, sa, sb, bias, torch.float32))
    # int8_linear: rows of +-1 quantise to +-127 everywhere, weights +-127: every pair sum at its maximum
    K = 1000
    x = torch.ones(5, K)
    x[1] = -1
    x[2, ::2] = -1
    x[3:] = torch.randn(2, K)
    w_q = torch.full((40, K), 127, dtype=torch.int8)
    w_q[1::2, ::2] = -127
    w_scale = torch.rand(40) * 0.01
    packed, comp = int8_pack_weight(w_q)
    for dt in FLOATS:
        with fastdl.use_backend("cpp"):
            out = int8_linear(x.to(dt), w_q, w_scale, None, packed, comp)
        assert same(out, linear_exact(x.to(dt), w_q, w_scale, None)), dt
    # the 7-bit mode: the AVX2 level's direct kernel (codes as vpmaddubsw's unsigned operand, z * sum_k w
    # subtracted in the epilogue, also after K slices), the exact kernels elsewhere; K = 2^17 + 4 takes the
    # exact kernel at every level (the compensation would not fit int32)
    for M, K, N in [(1, 33, 17), (5, 64, 33), (13, 4100, 20), (4, 7, 16), (9, 259, 70), (2, 2**17 + 4, 17)]:
        x = torch.cat([u7_rows(K), torch.randn(M, K)])
        if K > 2**17:
            x = x[[0, 1, 8]]  # acc_exact's int64 products stay small
        w_q, w_scale = rand_int8(N, K), torch.rand(N) * 0.01
        w_q[0] = -128
        packed, comp = int8_pack_weight(w_q)
        bias = torch.randn(N)
        for dt in FLOATS:
            with fastdl.use_backend("cpp"):
                out = int8_linear(x.to(dt), w_q, w_scale, bias, packed, comp, 7)
            assert same(out, linear_u7_exact(x.to(dt), w_q, w_scale, bias)), (M, K, N, dt)
    return fastdl.info(print_result=False)["int8_cpu_kernels"]


def check_weight_only_paths() -> str:
    """int8_weight_only_linear on the shapes that take every kernel path of a level (the dot form for few rows, the
    GEMM on dequantised blocks for many: row blocks of 240, column blocks of 128, several K slices, K and N tails; at
    the AVX2 level from 64 rows fused_linear's fgemm on the int8 weight: 6-row and 16-column tails, K blocks of 256
    and a K tail inside a group), per channel and with group codes, fp32 / bf16 / fp16 x, non-contiguous x with
    leading dims, against float64."""
    torch.manual_seed(0)
    worst = 0.0
    for M, K, N in [(1, 7, 5), (2, 100, 9), (7, 515, 33), (8, 33, 130), (16, 384, 20), (33, 1100, 7), (250, 70, 131),
                    (64, 33, 17), (97, 515, 70), (70, 1100, 49)]:
        w = torch.randn(N, K)
        bias = torch.randn(N)
        wq, ws = quantize_per_channel(w)
        gq, gs, gg = quantize_per_group(w)
        d_pc = wq.double() * ws.double()[:, None]
        d_g = int8_ops.grouped_weight(gq, gg).double() * gs.double()[:, None]
        for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
            base = torch.randn(3, M, K + 3).to(dt)
            x = base[1:2, :, 1 : K + 1]  # [1, M, K], rows 1 element apart from their neighbours' ends
            with fastdl.use_backend("cpp"):
                o_pc = int8_weight_only_linear(x, wq, ws, bias)
                o_g = int8_weight_only_linear(x, gq, gs, bias, gg)
            for o, d in ((o_pc, d_pc), (o_g, d_g)):
                assert o.shape == (1, M, N) and o.dtype == dt
                e = rel_err(o, x.double() @ d.t() + bias.double())
                worst = max(worst, e)
                assert e <= tol, (M, K, N, dt, e)
    return f"{fastdl.info(print_result=False)['int8_cpu_kernels']} worst {worst:.2e}"


@pytest.mark.skipif(not backends.available("cpp", "int8_linear", "cpu")[0], reason="needs the compiled extension")
@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_cpp_isa_levels_exact_w8a8_and_weight_only_paths(isa):
    """Every int8 kernel family (scalar, AVX2 sign-trick W8A8 and panel GEMM, AVX-512) at its own level in a
    subprocess: W8A8 exact at the vpmaddubsw saturation extremes (int8_mm with -128 too), the 7-bit mode bit for bit,
    weight-only on every path."""
    out = run_at_isa(
        isa,
        "import test_int8 as t; print('w8a8', t.check_w8a8_exact()); print('weight_only', t.check_weight_only_paths())",
    )
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines() if line.startswith(("w8a8", "weight_only")))
    assert set(lines) == {"w8a8", "weight_only"}, out
    kernels = lines["w8a8"].split()[0]
    if isa == "scalar":
        assert kernels == "scalar"
    elif isa == "avx2" and fastdl.info(print_result=False)["int8_cpu_kernels"] != "scalar":
        assert kernels == "avx2"


# ------------------------------------------------------------------------------------------ activation
@pytest.mark.parametrize("kind", ["dynamic", "weight_only", "qat"])
def test_activation_applied_on_every_path_and_kept_through_save_load_freeze_to_linear(kind, tmp_path):
    """Int8Linear(activation=...) is the layer followed by the activation (values and, for QAT, gradients), around
    whichever path the run-time choice takes; recipe, record, fastdl.save / load, freeze and to_linear keep it; a bad
    name is refused naming the layer."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 48)
    trainable = kind == "qat"
    mode = "weight_only" if kind == "weight_only" else "dynamic"
    plain = Int8Linear.from_linear(copy.deepcopy(lin), mode=mode, trainable=trainable).train(trainable)
    layer = Int8Linear.from_linear(copy.deepcopy(lin), mode=mode, trainable=trainable, activation="gelu")
    layer.train(trainable)
    x = torch.randn(5, 64, requires_grad=trainable)
    x2 = x.detach().clone().requires_grad_(trainable)
    y, ref = layer(x), F.gelu(plain(x2))
    assert rel_err(y, ref) <= 1e-5
    if trainable:
        g = torch.randn_like(y)
        y.backward(g)
        ref.backward(g)
        assert rel_err(x.grad, x2.grad) <= 1e-5 and rel_err(layer.weight.grad, plain.weight.grad) <= 1e-5
    else:  # every path of the run-time choice: the activation is applied around the chosen path
        layer.dense_copy = True
        with torch.no_grad():
            for path in layer._choice_paths(x):
                assert rel_err(layer._forward(x), F.gelu(layer._linear_forward(x))) <= 1e-6
                assert rel_err(F.gelu(layer._run_path(path, x)), F.gelu(plain._run_path(path, x))) <= 1e-6
    assert layer.recipe()["activation"] == "gelu" and "activation" not in plain.recipe()
    assert "activation='gelu'" in repr(layer)
    model = nn.Sequential(copy.deepcopy(lin))
    fastdl.convert(model, "int8" if mode == "dynamic" else "int8_weight_only")
    model[0] = layer
    fastdl.save(model, tmp_path / "m")
    loaded = fastdl.load(nn.Sequential(nn.Linear(64, 48)), tmp_path / "m")
    assert loaded[0].activation == "gelu"
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), layer.eval()(x))
        frozen = layer.freeze()
        assert frozen.activation == "gelu"
        torch.testing.assert_close(frozen(x), layer(x))
        back = layer.to_linear()
        assert isinstance(back, nn.Sequential) and isinstance(back[1], nn.GELU)
        assert torch.equal(back[0].weight, plain.to_linear().weight)
    with pytest.raises(ValueError, match="Int8Linear: activation must be one of"):
        Int8Linear(8, 8, activation="tanh")
