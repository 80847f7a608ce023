"""Tests of the int4 Triton kernels (kernels/int4.py, installed as fastdl.kernels.int4): both launchers against
float64 references built here from the codes (the nibble packing, the dequantization and the activations'
quantization written out independently of fastdl), the split-K GEMV and its reduction, the W4A8 quantization
kernel bit for bit, strided inputs, NaN rows, empty shapes, and the op routed to the launchers with the triton
backend.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 before triton
is imported); the shapes stay small because the interpreter is slow. With a GPU (and the interpreter off) the same
tests run on CUDA tensors.
"""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from _int4_refs import dequant_ref, groups_for, pack_ref, random_int4  # noqa: E402
from conftest import rel_err  # noqa: E402

import fastdl  # noqa: E402
from fastdl import backends  # noqa: E402
from fastdl.ops.int4 import int4_a8_linear, int4_weight_only_linear, quantize_groups  # noqa: E402

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not _INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)


def _load_kernels():
    """fastdl.kernels.int4: the module fastdl's op router calls (fastdl/ops/_library.py), not a copy."""
    from fastdl.kernels import int4 as mod

    assert getattr(mod, "_INTERPRET", None) == _INTERPRET, (
        "fastdl.kernels.int4 was imported before TRITON_INTERPRET was set (tests/conftest.py sets it first)"
    )
    return mod


i4 = _load_kernels()
DEV = "cpu" if _INTERPRET else "cuda"
# ||out - ref64|| / ||ref64||: one rounding of the output (fp32: accumulation order); bf16 x with M > 16 also rounds
# the dequantized weight to bf16 once (the GEMM's tensor-core operands)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPS = {"weight_only": i4.int4_weight_only_linear, "a8": i4.int4_a8_linear}


# --------------------------------------------------------------------------------------- independent references
def quant_ref(x2: torch.Tensor, G: int):
    """The activations' contract in numpy float32 per row and group: amax (NaN counts as inf), inv = fp32(127 / amax)
    (IEEE division), q = rint(clamp(fp32(x * inv), -127, 127)) (round half to even), s = fp32(amax / 127); groups
    that are not finite: q = 0, s = NaN; all-zero groups: q = 0, s = 0."""
    M, K = x2.shape
    xf = x2.float().cpu().numpy().reshape(M, K // G, G)
    a = np.abs(xf)
    amax = np.where(np.isnan(a), np.float32(np.inf), a).max(axis=2).astype(np.float32)
    finite = np.isfinite(amax)
    ok = finite & (amax > 0)
    safe = np.where(ok, amax, np.float32(1)).astype(np.float32)
    with np.errstate(all="ignore"):
        inv = (np.float32(127) / safe).astype(np.float32)
        v = (xf * inv[..., None]).astype(np.float32)
    v = np.rint(np.clip(np.where(np.isnan(v), np.float32(0), v), -127, 127))
    q = np.where(ok[..., None], v, 0).astype(np.int8).reshape(M, K)
    s = np.where(ok, (safe / np.float32(127)).astype(np.float32), np.where(finite, 0, np.nan)).astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(s)


def ref64(op, x, u, s, z, bias, G):
    """float64: x @ W.T + bias (weight-only) or sum_g s_x s_w sum_k q_x (u - z) + bias (W4A8)."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).cpu()
    if op == "a8":
        q, sx = quant_ref(x2, G)
        x2 = (q.double().reshape(-1, K // G, G) * sx.double()[..., None]).reshape(-1, K)
    out = x2.double() @ dequant_ref(u, s, z, G).t()
    if bias is not None:
        out = out + bias.double().cpu()
    return out.reshape(*x.shape[:-1], u.shape[0])


def dev(*ts):
    return [None if t is None else t.to(DEV) for t in ts]


# ------------------------------------------------------------------------------------------------ the launchers
# M 1, 3: the split-K GEMV (1 and 4 accumulator rows); 17, 40: the GEMMs
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["weight_only", "a8"])
def test_launchers_match_float64_odd_shapes(op, dtype):
    g = torch.Generator().manual_seed(5)
    i = 0
    for N in (1, 7, 33):
        for K in (32, 96, 256):
            for G in groups_for(K):
                for M in (1, 3, 17, 40):
                    i += 1
                    zeros, has_bias = i % 2 == 0, i % 3 != 0
                    u, s, z = random_int4(N, K, G, zeros, seed=i)
                    x = torch.randn(M, K, generator=g).to(dtype)
                    bias = torch.randn(N, generator=g) if has_bias else None
                    out = OPS[op](*dev(x, pack_ref(u), s, z, bias), G)
                    assert out.dtype == dtype and out.shape == (M, N) and out.device.type == DEV
                    err = rel_err(out, ref64(op, x, u, s, z, bias, G))
                    assert err <= TOL[dtype], (op, dtype, N, K, G, M, zeros, has_bias, err)


@pytest.mark.parametrize("op", ["weight_only", "a8"])
def test_split_k_gemv_and_its_reduction(op, monkeypatch):
    """Forced K slices (the GPU launcher's choice depends on the SM count): each slice's fp32 partials, summed in
    order by _splitk_sum_kernel with the bias and one rounding; every accumulator-row count (1, 4, 8, 16)."""
    g = torch.Generator().manual_seed(6)
    for split in (2, 3, 8):
        monkeypatch.setattr(i4, "SPLIT_K", split)
        for N, K, M, G, dtype in [(7, 384, 1, 32, torch.float32), (33, 512, 6, 128, torch.bfloat16),
                                  (9, 256, 16, 64, torch.float32), (40, 384, 3, 128, torch.float32)]:  # fmt: skip
            n_split, ks = i4._split(N, K, torch.device(DEV))
            chunks = -(-K // i4._CHUNK)
            assert ks % i4._CHUNK == 0 and n_split == -(-K // ks) and min(2, chunks) <= n_split <= min(split, chunks)
            u, s, z = random_int4(N, K, G, M % 2 == 0, seed=N + K + split)
            x = torch.randn(M, K, generator=g).to(dtype)
            bias = torch.randn(N, generator=g).bfloat16()
            out = OPS[op](*dev(x, pack_ref(u), s, z, bias), G)
            err = rel_err(out, ref64(op, x, u, s, z, bias, G))
            assert err <= TOL[dtype], (op, split, N, K, M, G, err)


def test_a8_quantization_kernel_is_the_contract_bit_for_bit():
    """The GEMM path's quantization: q in the weight's pairing order and s_x, equal bit for bit to fastdl's
    quantize_groups and to the numpy contract here (ties, zero groups, NaN and inf groups, huge and tiny groups)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(19, 512, generator=g) * torch.logspace(-3, 3, 512)
    x[1, :64] = 0.0
    x[2, 70] = float("nan")
    x[3, 200] = float("inf")
    x[4, :32] = torch.arange(32) - 15.5  # amax 16.5: k * 127 / 16.5 lands near halves
    x[5, 32:64] = 127.0 / 254.0 * 3.0
    x[5, 40] = 3.0
    x[6, :128] = 1e-30
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        for G in (32, 64, 128):
            q, sx = i4._quantize_pairs(xd.to(DEV), G)
            qr, sr = quant_ref(xd, G)
            qf, sf = quantize_groups(xd, G)
            assert torch.equal(qr, qf) and torch.equal(sr.nan_to_num(-1), sf.nan_to_num(-1))
            # pairing order: within a group, position 2 p + h holds k = 32 (p // 16) + p % 16 + 16 h
            p = torch.arange(G // 2)
            k = (p // 16) * 32 + p % 16
            order = torch.stack([k, k + 16], dim=1).reshape(G)
            perm = (torch.arange(512 // G)[:, None] * G + order[None, :]).reshape(512)
            assert torch.equal(q.cpu(), qr[:, perm]), (dtype, G)
            assert torch.equal(sx.cpu().isnan(), sr.isnan()) and torch.equal(sx.cpu().nan_to_num(), sr.nan_to_num())


def test_strided_inputs_give_the_same_bits():
    """x transposed and sliced, qweight a column slice of a wider buffer, scales / zeros column-major: the kernels
    read every tensor by its strides (same bits as contiguous inputs)."""
    N, K, G = 33, 256, 64
    u, s, z = random_int4(N, K, G, True, seed=9)
    q = pack_ref(u)
    bias = torch.randn(N)
    wide = torch.zeros(N, K, dtype=torch.uint8)
    wide[:, : K // 2] = q
    q_nc, s_nc, z_nc = wide[:, : K // 2], s.t().contiguous().t(), z.t().contiguous().t()
    assert not (q_nc.is_contiguous() or s_nc.is_contiguous() or z_nc.is_contiguous())
    for M in (3, 20):
        base = torch.randn(2, K, M)
        x = base.transpose(1, 2)  # [2, M, K], K strided
        for op, fn in OPS.items():
            a = fn(*dev(x, q, s, z, bias), G)
            b = fn(*dev(x.contiguous(), q_nc, s_nc, z_nc, bias), G)
            assert a.shape == (2, M, N)
            assert torch.equal(a, b), (op, M)
            assert rel_err(a, ref64(op, x, u, s, z, bias, G)) <= 1e-5


@pytest.mark.parametrize("M", [3, 20])
def test_nan_rows_zero_rows_empty_and_zero_k(M):
    N, K, G = 9, 128, 32
    u, s, _ = random_int4(N, K, G, False, seed=2)
    x = torch.randn(M, K)
    x[1, 40] = float("nan")
    x[2] = 0.0
    for op, fn in OPS.items():
        out = fn(*dev(x, pack_ref(u), s, None, None), G).cpu()
        assert out[1].isnan().all(), op
        assert not out[[0, 2]].isnan().any() and (out[2] == 0).all(), op
        assert fn(*dev(torch.randn(0, K), pack_ref(u), s, None, None), G).shape == (0, N)
        b = torch.randn(N)
        y = fn(*dev(torch.randn(2, 0), torch.zeros(N, 0, dtype=torch.uint8), torch.zeros(N, 0).half(), None, b), G)
        assert torch.equal(y.cpu(), b.expand(2, N)), op
        one_d = fn(*dev(torch.randn(K), pack_ref(u), s, None, None), G)
        assert one_d.shape == (N,)


def test_launcher_errors_name_the_argument():
    N, K, G = 8, 64, 32
    u, s, z = random_int4(N, K, G, True, seed=1)
    q, x = pack_ref(u), torch.randn(2, K)
    cases = [
        (TypeError, "x must be float32, bfloat16 or float16", (x.double(), q, s, z, None, G)),
        (ValueError, "group_size must be one of 32, 64, 128", (x, q, s, z, None, 16)),
        (ValueError, "must be a multiple of group_size", (torch.randn(2, 96), q, s, None, None, 64)),
        (TypeError, "qweight must be uint8", (x, q.to(torch.int8), s, z, None, G)),
        (ValueError, "qweight must have shape", (x, q[:, :16], s, z, None, G)),
        (TypeError, "scales must be float16", (x, q, s.float(), z, None, G)),
        (ValueError, "zeros must have shape", (x, q, s, z[:4], None, G)),
        (TypeError, "bias must be a floating tensor", (x, q, s, z, torch.ones(N, dtype=torch.int32), G)),
        (ValueError, "bias must have shape", (x, q, s, z, torch.ones(N + 1), G)),
    ]
    for name, fn in (("int4_weight_only_linear", i4.int4_weight_only_linear), ("int4_a8_linear", i4.int4_a8_linear)):
        for exc, words, args in cases:
            with pytest.raises(exc, match=words) as info:
                fn(*dev(*args[:5]), args[5])
            assert name in str(info.value)


# ------------------------------------------------------------------------------------------- routing from the op
class _Spy:
    """Stands in for a module-level kernel: records each launch and forwards it."""

    def __init__(self, kernel, calls, name):
        self.kernel, self.calls, self.name = kernel, calls, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(self.name)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.skipif(not _INTERPRET, reason="the CPU router offers triton only under TRITON_INTERPRET=1")
def test_ops_route_to_the_launchers_with_the_triton_backend_on_cpu(monkeypatch):
    for op in ("int4_weight_only_linear", "int4_a8_linear"):
        assert backends.available("triton", op, "cpu") == (True, "")
    calls = []
    for name in ("_gemv_kernel", "_wo_mm_kernel", "_a8_quant_kernel", "_a8_mm_kernel", "_splitk_sum_kernel"):
        monkeypatch.setattr(i4, name, _Spy(getattr(i4, name), calls, name))
    N, K, G = 7, 256, 64
    u, s, z = random_int4(N, K, G, True, seed=4)
    q, bias = pack_ref(u), torch.randn(N)
    monkeypatch.setenv("FASTDL_BACKEND", "triton")
    for fn, op, M, want in [
        (int4_weight_only_linear, "weight_only", 2, ["_gemv_kernel"]),
        (int4_weight_only_linear, "weight_only", 18, ["_wo_mm_kernel"]),
        (int4_a8_linear, "a8", 1, ["_gemv_kernel"]),
        (int4_a8_linear, "a8", 18, ["_a8_quant_kernel", "_a8_mm_kernel"]),
    ]:
        x = torch.randn(M, K)
        assert backends.select(fn.__name__, "cpu", (x, q, s, z, bias, G)) == "triton"
        calls.clear()
        out = fn(x, q, s, z, bias, G)
        assert calls == want, (fn.__name__, M, calls)
        assert rel_err(out, ref64(op, x, u, s, z, bias, G)) <= 1e-5
    monkeypatch.setattr(i4, "SPLIT_K", 2)
    calls.clear()
    int4_weight_only_linear(torch.randn(1, K), q, s, z, bias, G)
    assert calls == ["_gemv_kernel", "_splitk_sum_kernel"]
    # float64 x is not the Triton backend's: asked for explicitly, the op says so
    with pytest.raises(fastdl.BackendUnavailableError, match="float64"):
        int4_weight_only_linear(torch.randn(1, K, dtype=torch.float64), q, s, z, bias, G)
