"""Unusual and bad inputs to the compiled kernels (issue 34): out-of-range offsets and sizes never reach memory,
invalid 2:4 meta is a ValueError on every backend and ISA level, empty inputs give empty results, the activations
match PyTorch at extreme values at every level, and the C++ autograd nodes give gradients with a graph under
create_graph=True. The crash-prone cases run in subprocesses (a regression is a failed test, not a dead runner)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import Passthrough, cpu_backends, run_at_isa

import fastdl
import fastdl.ops.sparse24 as sp
from fastdl.ops.int8 import int8_linear_qat

HAS_CPP = "cpp" in cpu_backends("sparse24_linear")
LEVELS = ["scalar", "avx2", "avx512", "avx512_bf16"]
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")


# ------------------------------------------------------------------------------------------------ loader_fill
# Each case: (src expression, dst bytes, offset). All must raise ValueError on every backend.
LOADER_CASES = [
    ("torch.ones(1, dtype=torch.uint8)", 64, 2**63 - 1),  # the crash of issue 34: off + nbytes wrapped around
    ("torch.ones(8, dtype=torch.uint8)", 64, 2**63 - 4),
    ("torch.ones(2, dtype=torch.float32)", 64, 2**63 - 4),
    ("torch.ones(1, dtype=torch.uint8)", 64, 64),  # one past the end
    ("torch.ones(16, dtype=torch.float32)", 64, 4),  # 64 bytes from 4: 4 past the end
    ("torch.ones(1, dtype=torch.uint8)", 64, -1),
    ("torch.ones(1, dtype=torch.uint8)", 64, -(2**63)),
    ("torch.ones(1, 1).expand(2**61, 2)", 64, 0),  # numel 2^62, 2^64 bytes: numel * itemsize overflows int64
    ("torch.ones(1).expand(2**62)", 64, 8),
]

_LOADER_SCRIPT = """
import json, torch, fastdl
cases, res = json.loads({cases!r}), []
for backend in {backends!r}:
    for src, cap, off in cases:
        s = eval(src)
        try:
            with fastdl.use_backend(backend):
                fastdl.ops.loader_fill([s], torch.zeros(cap, dtype=torch.uint8), [off], [0])
            res.append([backend, src, off, "no error"])
        except Exception as e:
            res.append([backend, src, off, type(e).__name__, str(e).splitlines()[0]])
print(json.dumps(res))
"""


def test_loader_fill_out_of_range_offsets_and_sizes_raise_value_error_in_a_subprocess():
    backends = cpu_backends("loader_fill")
    script = _LOADER_SCRIPT.format(cases=json.dumps(LOADER_CASES), backends=backends)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}, a signal if < 0)\n{proc.stderr[-3000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == len(LOADER_CASES) * len(backends)
    for backend, src, off, kind, *msg in res:
        assert kind == "ValueError", (backend, src, off, kind, msg)
        assert "loader_fill" in msg[0] and ("offsets[0]" in msg[0] or "bytes" in msg[0]), (backend, src, msg)


@pytest.mark.parametrize("backend", cpu_backends("loader_fill"))
def test_loader_fill_in_range_edges_still_copy(backend):
    dst = torch.zeros(64, dtype=torch.uint8)
    with fastdl.use_backend(backend):
        fastdl.ops.loader_fill([torch.full((4,), 7, dtype=torch.uint8)], dst, [60], [0])  # ends exactly at the end
        fastdl.ops.loader_fill([torch.empty(0, dtype=torch.float32)], dst, [64], [0])  # empty, at the end
        fastdl.ops.loader_fill([torch.arange(4, dtype=torch.int32).expand(2, 4)], dst, [0], [0])  # expanded: copied
    assert dst[60:].tolist() == [7] * 4
    assert dst[:32].view(torch.int32).tolist() == [0, 1, 2, 3] * 2


# ------------------------------------------------------------------------------------------------ invalid 2:4 meta
def _bad_metas(K: int):
    """(values, meta, (row, byte)) with one invalid byte each, for a [5, K] weight."""
    values, meta = sp.compress_2_4(torch.randn(5, K))
    cases = []
    for r, j, byte in [(1, 0, 0xFF), (0, 1, 0x00), (4, 0, 0x37), (2, 1, 0x13), (3, 0, 0xC5 ^ 0x40)]:
        if j >= meta.shape[1]:
            continue
        bad = meta.clone()
        bad[r, j] = byte
        cases.append((values, bad, (r, j)))
    if K % 8 == 4:  # the unused high nibble of a row's last byte must stay 0
        bad = meta.clone()
        bad[2, -1] = bad[2, -1] | 0x30
        cases.append((values, bad, (2, meta.shape[1] - 1)))
    return cases


def check_invalid_meta_everywhere() -> int:
    """Every op that reads meta, on every backend of this process, rejects invalid meta with a ValueError naming meta
    and the first bad byte (run at each ISA level by the test below; returns the number of checked calls)."""
    checked = 0
    for K in (16, 12, 40):
        for values, bad, (r, j) in _bad_metas(K):
            calls = [  # float16 / float64: the backends that take them ("auto" below)
                ("decompress_2_4", sp.decompress_2_4, (values.half(), bad)),
                ("decompress_2_4", sp.decompress_2_4, (values.double(), bad)),
                ("sparse24_linear", sp.sparse24_linear, (torch.randn(2, K).double(), values.double(), bad, None)),
                ("sparse24_linear", sp.sparse24_linear, (torch.randn(2, K).half(), values.half(), bad, None)),
            ]
            auto_only = len(calls)
            for vdt in (torch.float32, torch.bfloat16):
                v = values.to(vdt)
                calls.append(("decompress_2_4", sp.decompress_2_4, (v, bad)))
                for xdt in (torch.float32, torch.bfloat16):
                    for M in (0, 1, 7, 40):
                        x = torch.randn(M, K, dtype=xdt)
                        calls.append(("sparse24_linear", sp.sparse24_linear, (x, v, bad, None)))
                    g, x = torch.randn(3, 5, dtype=xdt), torch.randn(3, K, dtype=xdt)
                    for mask in ([True, False, False], [False, True, False], [False, False, True]):
                        calls.append(("sparse24_linear_backward", sp.sparse24_linear_backward_op, (g, x, v, bad, mask)))
            for backend in [*cpu_backends("sparse24_linear"), "auto"]:
                for i, (op, fn, args) in enumerate(calls):
                    if i < auto_only and backend != "auto":
                        continue
                    msg = rf"{op}: meta must .*meta\[{r}, {j}\]"
                    with fastdl.use_backend(backend), pytest.raises(ValueError, match=msg):
                        fn(*args)
                    checked += 1
    return checked


@needs_cpp
@pytest.mark.parametrize("isa", LEVELS)
def test_invalid_meta_raises_value_error_at_every_level(isa):
    out = run_at_isa(isa, "import test_input_safety as t; print('checked', t.check_invalid_meta_everywhere())")
    assert int(out.split()[-1]) > 100, out


def check_invalid_meta_in_kernels() -> int:
    """The C++ kernels check meta as they read each block of weight rows (no separate pass): an invalid byte deep in a
    larger weight (first / middle / last row and byte, K % 8 == 0 and 4, rows split between threads) is found by every
    kernel path of the level (direct M <= 4, panel / pairs / broadcast above, the dense route, decompress), and the
    error names the first bad byte in row-major order even where another thread meets a later one first. Valid meta
    through the same paths matches the float64 reference. Returns the number of checked calls."""
    checked = 0
    for N, K in ((53, 1024), (29, 1036)):
        torch.manual_seed(N)
        values, meta = sp.compress_2_4(torch.randn(N, K))
        mb = meta.shape[1]
        cases = [((N - 1, mb - 1), 0x0F if K % 8 == 0 else 0x35), ((N // 2, mb // 2), 0x01), ((0, 0), 0xFF)]
        for vdt in (torch.float32, torch.bfloat16):
            v = values.to(vdt)
            w = sp._decompress_reference(v.double(), meta)
            for xdt in (torch.float32, torch.bfloat16):
                for M in (1, 2, 3, 4, 5, 8, 16, 24, 40):
                    x = torch.randn(M, K, dtype=xdt)
                    out = sp.sparse24_linear(x, v, meta, None)
                    ref = x.double() @ w.to(xdt).double().T
                    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * K**0.5)
                    for (r, j), byte in cases:
                        bad = meta.clone()
                        bad[r, j] = byte
                        with pytest.raises(ValueError, match=rf"sparse24_linear: meta must .*meta\[{r}, {j}\]"):
                            sp.sparse24_linear(x, v, bad, None)
                        checked += 1
                    bad = meta.clone()
                    bad[N - 1, 0], bad[3, 5] = 0x07, 0x00  # the last row usually goes to another thread
                    with pytest.raises(ValueError, match=r"sparse24_linear: meta must .*meta\[3, 5\] = 0 "):
                        sp.sparse24_linear(x, v, bad, None)
                    checked += 1
            for (r, j), byte in cases:
                bad = meta.clone()
                bad[r, j] = byte
                with pytest.raises(ValueError, match=rf"decompress_2_4: meta must .*meta\[{r}, {j}\]"):
                    sp.decompress_2_4(v, bad)
                checked += 1
    return checked


@needs_cpp
@pytest.mark.parametrize("route", ["kernels", "dense", "pb"])
@pytest.mark.parametrize("isa", LEVELS)
def test_invalid_meta_found_by_every_kernel(isa, route):
    script = "import torch, test_input_safety as t; torch.set_num_threads(2); print(t.check_invalid_meta_in_kernels())"
    env = {"kernels": "FASTDL_CPU_PB_ROWS", "dense": "FASTDL_SPARSE24_DENSE_ROWS", "pb": "FASTDL_CPU_PB_ROWS"}[route]
    rows = str(2**40) if route == "kernels" else "1"  # every call through that route, or none (read once per process)
    script = f"import os; os.environ['{env}'] = '{rows}'; " + script
    if route == "pb":  # (the AVX-512 families, K % 16 == 0: fused_linear's pb kernel; the others ignore the variable)
        script = "import os; os.environ['FASTDL_SPARSE24_DENSE_ROWS'] = str(2**40); " + script
    assert int(run_at_isa(isa, script).split()[-1]) == 300


@pytest.mark.parametrize("backend", cpu_backends("sparse24_linear"))
def test_invalid_meta_in_process(backend):
    values, bad, _ = _bad_metas(16)[0]
    msg = r"decompress_2_4: meta must .*meta\[1, 0\] = 255"
    with fastdl.use_backend(backend), pytest.raises(ValueError, match=msg):
        sp.decompress_2_4(values, bad)
    # a module weight that requires a gradient: the C++ autograd node's forward checks it too
    x = torch.randn(3, 16, requires_grad=True)
    with fastdl.use_backend(backend), pytest.raises(ValueError, match=r"sparse24_linear: meta must"):
        sp.sparse24_linear(x, values.clone().requires_grad_(), bad, None)


def test_meta_check_accepts_every_valid_nibble():
    nibbles = [0x3, 0x5, 0x6, 0x9, 0xA, 0xC]
    meta = torch.tensor([[lo | hi << 4 for hi in nibbles] for lo in nibbles], dtype=torch.uint8)  # [6, 6]: K = 48
    values = torch.randn(6, 24)
    w = sp._decompress_reference(values, meta)
    assert torch.equal(sp.unpack_meta(meta, 48), w != 0) or bool((values == 0).any())
    for backend in cpu_backends("decompress_2_4"):
        with fastdl.use_backend(backend):
            assert torch.equal(sp.decompress_2_4(values, meta), w), backend


# ------------------------------------------------------------------------------------------------ empty inputs
@pytest.mark.parametrize("backend", cpu_backends("sparse24_linear"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sparse24_empty_inputs(backend, dtype):
    # the C++ kernels take float32/bfloat16 (decompress: float16 too): other dtypes run where "auto" sends them
    cpp_takes = (torch.float32, torch.bfloat16)
    lin_backend = "auto" if backend == "cpp" and dtype not in cpp_takes else backend
    dec_backend = "auto" if backend == "cpp" and dtype == torch.float64 else backend
    for N, K in [(0, 16), (3, 0), (0, 0), (0, 12)]:
        values, meta = torch.zeros(N, K // 2, dtype=dtype), torch.zeros(N, (K + 7) // 8, dtype=torch.uint8)
        with fastdl.use_backend(dec_backend):
            assert sp.decompress_2_4(values, meta).shape == (N, K)
        assert sp.unpack_meta(meta, K).shape == (N, K)
        with fastdl.use_backend(lin_backend):
            for lead in [(2,), (0,), (2, 3)]:
                x = torch.randn(*lead, K, dtype=dtype)
                bias = torch.randn(N, dtype=dtype)
                out = sp.sparse24_linear(x, values, meta, bias)
                assert out.shape == (*lead, N) and out.dtype == dtype, (N, K, lead, out.shape)
                torch.testing.assert_close(out, bias.expand(*lead, N))  # K = 0 or no rows: just the bias
                g = torch.randn(*lead, N, dtype=dtype)
                gx, gv, gb = sp.sparse24_linear_backward_op(g, x, values, meta, [True, True, True])
                assert gx.shape == x.shape and gv.shape == values.shape and gb.shape == (N,)
                assert not gx.any() and not gv.any()


def test_unpack_meta_and_pack_mask_argument_errors():
    meta = torch.zeros(2, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"unpack_meta: meta must be a torch.uint8 tensor, got torch.float32"):
        sp.unpack_meta(meta.float(), 16)
    with pytest.raises(ValueError, match=r"unpack_meta: meta must have shape \[N, ceil\(K/8\)\] = \[2, 4\] for K = 32"):
        sp.unpack_meta(meta, 32)  # K too large for meta
    with pytest.raises(ValueError, match=r"unpack_meta: K must be a non-negative multiple of 4, got 6"):
        sp.unpack_meta(meta, 6)
    with pytest.raises(ValueError, match=r"unpack_meta: meta must be 2-D"):
        sp.unpack_meta(meta[0], 16)
    with pytest.raises(TypeError, match=r"pack_mask: mask must be a torch.bool tensor .*got dtype torch.float32"):
        sp.pack_mask(torch.ones(2, 8))
    mask = sp.mask_2_4(torch.randn(3, 12))
    assert torch.equal(sp.unpack_meta(sp.pack_mask(mask), 12), mask)


# ------------------------------------------------------------------------------------------------ activations
EXTREMES = [-float("inf"), -1e38, -3e4, -200.0, -100.0, -90.0, -88.5, -87.4, -87.2, -20.0, -10.5, -10.0, -9.0,
            -1.0, -0.0, 0.0, 1.0, 9.0, 88.0, 100.0, 3e4, 1e38, float("inf"), float("nan")]  # fmt: skip
ACTS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def _matches_torch(out, x, fn, scale, rtol):
    """Elementwise: out equals scale * fn(x) of PyTorch at float64 or at float32 (they differ where float32
    overflows inside PyTorch's formula, e.g. gelu(inf) = nan, gelu_tanh'(1e38) = nan), NaN where PyTorch gives NaN,
    within rtol and 1e-6 absolute. Returns the mismatches."""
    bad = []
    refs = []
    for dt in (torch.float64, torch.float32):
        xr = x.to(dt).requires_grad_()
        y = fn(xr)
        refs.append((y.detach(), torch.autograd.grad(y.sum(), xr)[0]))
    for i in range(len(x)):
        ok = False
        for ref in refs:
            r = (ref[0] if scale is None else ref[1] * scale)[i].double()
            o = out[i].double()
            if torch.isnan(r):
                ok |= bool(torch.isnan(o))
            elif torch.isinf(r):
                ok |= bool(o == r)
            else:
                ok |= bool((o - r).abs() <= 1e-6 + rtol * r.abs())
        if not ok:
            bad.append((x[i].item(), out[i].item(), [(ref[0] if scale is None else ref[1] * scale)[i].item()
                                                     for ref in refs]))  # fmt: skip
    return bad


def check_activation_extremes() -> str:
    """fused_linear's activations and their derivatives at extreme inputs against PyTorch, at the level of this process
    (the test below runs every level), through the vector epilogues (N = 32 columns) and the C++ backward."""
    failures = []
    N = 32
    for dtype in (torch.float32, torch.bfloat16):
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        x = torch.tensor(EXTREMES, dtype=dtype)
        for act, fn in ACTS.items():
            for rows in (len(EXTREMES), 1):  # every row kernel: many rows and M = 1
                for r0 in range(0, len(EXTREMES), rows):
                    xs = x[r0 : r0 + rows]
                    xr = xs.reshape(-1, 1).clone().requires_grad_()
                    w = torch.ones(N, 1, dtype=dtype)
                    y = fastdl.ops.fused_linear(xr, w, None, act)
                    (gx,) = torch.autograd.grad(y.sum(), xr)  # sum over the N equal columns: N * act'(x)
                    same = (y == y[:, :1]) | (y.isnan() & y[:, :1].isnan())
                    assert bool(same.all()), (act, "columns differ")
                    for kind, out, scale in (("fwd", y[:, 0], None), ("bwd", gx[:, 0], N)):
                        for xi, oi, refs in _matches_torch(out.float(), xs.float(), fn, scale, rtol):
                            if act == "relu" and kind == "bwd" and xi != xi:
                                continue  # relu'(NaN): PyTorch passes the gradient (NaN <= 0 is false), fastdl 0
                            failures.append(f"{dtype} {act} {kind} M={rows} x={xi}: got {oi}, torch {refs}")
    return "ok" if not failures else "FAIL\n" + "\n".join(sorted(set(failures)))


@needs_cpp
@pytest.mark.parametrize("isa", LEVELS)
def test_activations_at_extreme_values_match_torch_at_every_level(isa):
    out = run_at_isa(isa, "import test_input_safety as t; print(t.check_activation_extremes())")
    assert out.strip().endswith("ok"), out


# ------------------------------------------------------------------------------------------------ create_graph
def _linear_cases():
    torch.manual_seed(0)
    x = torch.randn(3, 2, 16, dtype=torch.float64).float()
    w = torch.randn(8, 16) / 4
    b = torch.randn(8)
    r = torch.randn(3, 2, 8)
    values, meta = sp.compress_2_4(torch.randn(8, 16))
    return {
        "fused_linear": (lambda t: fastdl.ops.fused_linear(t[0], t[1], t[2], "gelu", t[3]), [x, w, b, r]),
        "int8_linear_qat": (lambda t: int8_linear_qat(t[0], t[1], t[2]), [x, w, b]),
        "sparse24_linear": (lambda t: sp.sparse24_linear(t[0], t[1], meta, t[2]), [x, values, b]),
    }


@needs_cpp
@pytest.mark.parametrize("op", ["fused_linear", "int8_linear_qat", "sparse24_linear"])
def test_cpp_autograd_node_create_graph_gives_gradients_with_a_graph(op):
    fn, tensors = _linear_cases()[op]
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = fn(leaves)
    assert type(out.grad_fn).__name__ == "CppFunction", type(out.grad_fn).__name__  # the C++ node
    first = torch.autograd.grad(out.square().sum(), leaves)  # first order, no graph
    assert all(g.grad_fn is None for g in first)
    grads = torch.autograd.grad(fn(leaves).square().sum(), leaves, create_graph=True)
    for g, g0 in zip(grads, first):
        assert g.requires_grad and g.grad_fn is not None, op
        # the same first-order values: a backward that records a graph computes them from the op's PyTorch formulas
        # (differentiable), not the kernels, so they agree to rounding, not bit for bit
        torch.testing.assert_close(g.detach(), g0, rtol=1e-5, atol=1e-6)
    # second order: the C++ node (eager call) gives what the op's registered autograd gives through the dispatcher
    penalty = sum(g.square().sum() for g in grads)
    second = torch.autograd.grad(penalty, leaves, allow_unused=True)
    with Passthrough():
        out_d = fn(leaves)
    assert type(out_d.grad_fn).__name__ != "CppFunction"
    grads_d = torch.autograd.grad(out_d.square().sum(), leaves, create_graph=True)
    for g, gd in zip(grads, grads_d):
        torch.testing.assert_close(g.detach(), gd.detach(), rtol=1e-6, atol=1e-6)
    second_d = torch.autograd.grad(sum(g.square().sum() for g in grads_d), leaves, allow_unused=True)
    for s, sd in zip(second, second_d):
        assert (s is None) == (sd is None)
        if s is not None:
            torch.testing.assert_close(s, sd, rtol=1e-5, atol=1e-6)


@needs_cpp
def test_cpp_autograd_node_first_order_ignores_in_place_change_of_bias():
    """bias is kept for a create_graph backward only: changing it in place after the forward does not break a first-
    order backward (which never reads it), and a create_graph backward says what happened."""
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    y = fastdl.ops.fused_linear(x, w, b, "silu")
    with torch.no_grad():
        b.add_(1)
    y.sum().backward()
    assert w.grad is not None and b.grad is not None
    y = fastdl.ops.fused_linear(x, w, b, "silu")
    with torch.no_grad():
        b.add_(1)
    with pytest.raises(RuntimeError, match=r"fused_linear: the bias needed for a create_graph=True backward has been "
                                           r"modified by an inplace operation"):  # fmt: skip
        torch.autograd.grad(y.sum(), [x, w], create_graph=True)


@needs_cpp
def test_onednn_route_takes_any_bias_layout_and_float_dtype():
    """bf16 x and weight with M >= 64 run PyTorch's oneDNN linear: a sliced, expanded, fp16 or fp64 bias must give the
    contract's result (the bias added in fp32), as on every other route (found by tests/test_properties.py)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 127, generator=g).bfloat16()
    w = (torch.randn(6, 127, generator=g) / 11).bfloat16()
    base = torch.randn(12, generator=g)
    for bias in (base[::2], base[:1].expand(6), base[:6].half(), base[:6].double(), base[:6].bfloat16()):
        with fastdl.use_backend("cpp"):
            out = fastdl.ops.fused_linear(x, w, bias, "gelu")
        ref = torch.nn.functional.gelu(x.double() @ w.double().t() + bias.float().double())
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (bias.dtype, bias.stride(), err)


@needs_cpp
@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512", "avx512_bf16"])
def test_weight_only_with_empty_k_gives_the_bias_at_every_level(level):
    """K = 0: out = 0 * w_scale + bias at every M (the AVX2 route from 64 rows returned uninitialized memory)."""
    code = (
        "import torch, fastdl\n"
        "for M in (1, 4, 64, 200):\n"
        "    for dt in (torch.float32, torch.bfloat16):\n"
        "        out = fastdl.ops.int8_weight_only_linear(torch.randn(M, 0).to(dt),"
        " torch.zeros(3, 0, dtype=torch.int8), torch.ones(3), torch.tensor([1.0, -2.0, 3.0]))\n"
        "        assert torch.equal(out.float(), torch.tensor([[1.0, -2.0, 3.0]]).expand(M, 3)), (M, dt, out)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, FASTDL_CPU_ISA=level)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]
