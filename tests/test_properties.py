"""Property-based tests (hypothesis) of fastdl's public API (issue 34, "What must be true" 3).

Every generated case - dtypes (float32, bfloat16, float16, float64 and invalid ones: int, bool) x shapes (0, 1, odd,
K = 4096 at M = 1, leading dimensions) x layouts (contiguous, transposed, strided, expanded (stride 0), storage
offset) x special values (zeros, huge and tiny magnitudes, NaN, +-Inf, ties) x backends (cpp, triton in the
interpreter, torch) - either matches a float64 reference of the documented contract within the bound the other
tests use (the same NaN/Inf pattern, ``rel_err`` on the finite entries), or raises the documented error: TypeError
for a dtype, ValueError for a shape or value, RuntimeError for a device, with a message naming the op and the
argument. The C++ kernels run again at every ISA level (FASTDL_CPU_ISA is read once per process: one subprocess per
level, ``test_properties_at_isa_level``), and the cases that reach raw pointers with extreme sizes and offsets
(``loader_fill``) run in a subprocess that must not die of a signal.

Budget: a fixed seed (``derandomize``) and a few examples per property (the whole file ~90 s on 2 cores);
``FASTDL_FUZZ=long`` multiplies the examples by 25 for release checks. The profiles are registered here
(``fastdl-ci``, ``fastdl-long``); every property takes its settings from the selected one.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import subprocess
import sys

import _props_strategies as S
import pytest
import torch
import torch.nn.functional as F
from conftest import TESTS_DIR, cpu_backends
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import fastdl
from fastdl import backends, ops
from fastdl.nn import FusedLinear, Int8Linear, Sparse24Linear

# ------------------------------------------------------------------------------------------------ budget
settings.register_profile(
    "fastdl-ci",
    derandomize=True,  # a fixed seed per property: the same cases on every run and machine
    database=None,
    deadline=None,  # kernels' first calls (packing, Triton's interpreter) take a while
    max_examples=10,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
    # no shrinking in CI: a failing case is printed as drawn (every draw is labelled and replays exactly), and
    # shrinking cases of slow kernels (the Triton interpreter) can take minutes
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
settings.register_profile("fastdl-long", settings.get_profile("fastdl-ci"), max_examples=250, phases=tuple(Phase))
LONG = os.environ.get("FASTDL_FUZZ", "") == "long"
PROFILE = "fastdl-long" if LONG else "fastdl-ci"
# "isa": a subprocess of test_properties_at_isa_level (cpp only, at the level FASTDL_CPU_ISA caps);
# "raw-<category>": a subprocess of test_raw_pointer_cases_in_subprocess
CHILD = os.environ.get("FASTDL_PROPS_CHILD", "")


def budget(n: int):
    """Settings of a property run ``n`` times (25 n under FASTDL_FUZZ=long; about half in an ISA subprocess)."""
    if CHILD == "isa":
        n = max(4, n // 2)
    return settings(settings.get_profile(PROFILE), max_examples=n * (25 if LONG else 1))


CPU = fastdl.info(print_result=False)["cpu"]
KERNELS = CPU.get("kernels", {})  # the kernel family per capability in this process (capped by FASTDL_CPU_ISA)
HAS_CPP = backends.available("cpp", "fused_linear", "cpu")[0]


def backends_for(op: str) -> list[str]:
    """The CPU backends of ``op`` here (only cpp in an ISA subprocess: the level only changes the C++ kernels)."""
    found = cpu_backends(op)
    return [b for b in found if b == "cpp"] if CHILD == "isa" else found


skip_in_child = pytest.mark.skipif(CHILD != "", reason="runs in the parent process only")


# ------------------------------------------------------------------------------------- known bugs (TEMPORARY)
# Issue 34 items that other branches fix. A case that hits one and fails is recorded, not raised; the test then ends
# as xfail naming the items. Remove each entry (and its known_bug() uses) once its fix is merged: the properties
# state the correct contract, so they then hold.
KNOWN_BUGS: dict = {
    # none open: every bug these properties found is fixed (issue 34). A new one goes here, with its signature in a
    # known_bug() use, until its fix lands.
}
_HITS: list[str] = []


@contextlib.contextmanager
def pruned_positions_may_be_skipped(applies):
    """sparse24_linear's documented contract for non-finite x: the kernels that read only the kept half skip the pruned
    positions, so a NaN / Inf of x there may leave an output finite (as cuSPARSELt does), where x @ W.T gives NaN
    (NaN * 0). ``applies`` (a callable asked after a failure) checks the output against the kept-positions-only sum."""
    try:
        yield
    except AssertionError:
        if not (applies and applies()):
            raise


@contextlib.contextmanager
def known_bug(item, applies):
    """Where ``applies`` (the case has the signature of the known bug ``item``; a callable is asked only after a
    failure), a failure inside is recorded instead of raised."""
    if not applies:
        yield
        return
    try:
        yield
    except Exception as e:  # noqa: BLE001
        if callable(applies) and not applies():
            raise
        _HITS.append(f"{KNOWN_BUGS[item]} (a known bug: remove this mark once fixed): {type(e).__name__}: "
                     f"{str(e)[:300]}")


def xfail_known(test):
    """Ends the test as xfail (strict=False) when a known_bug() case failed during it."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        del _HITS[:]
        test(*args, **kwargs)
        if _HITS:
            pytest.xfail(_HITS[0] + (f" (+{len(_HITS) - 1} more cases)" if len(_HITS) > 1 else ""))

    return run


# ------------------------------------------------------------------------------------------------ helpers
def draw_tensor(data, label, shape, dtype, scale=1.0, specials=S.SPECIALS, layouts=S.LAYOUTS):
    return S.build(shape, dtype, data.draw(S.specs(specials, layouts), label=label), scale)


def run(backend: str, fn, *args):
    with fastdl.use_backend(backend):
        return fn(*args)


def tol_for(dtype: torch.dtype, fp32=2e-5, low=1e-4) -> float:
    return {torch.float32: fp32, torch.float64: 1e-12}.get(dtype, low)


def activation_alt(pre: torch.Tensor, act: str) -> torch.Tensor | None:
    """The activations at -inf: PyTorch gives NaN (-inf * 0), the limit is -0; either is accepted."""
    if act in ("gelu", "gelu_tanh", "silu") and bool((pre == -math.inf).any()):
        return pre.clamp(min=-1e300)
    return None


def invalid_float(valid: tuple) -> st.SearchStrategy:
    return st.sampled_from(S.NOT_FLOAT + tuple(d for d in S.FLOATS if d not in valid))


# ---------------------------------------------------------------------------------------------- fused_linear
FL_DTYPES = {"cpp": (torch.float32, torch.bfloat16, torch.float16), "triton": (torch.float32, torch.float16),
             "torch": S.FLOATS}


def eager_fused(x, w, b, act, r):
    """PyTorch's own computation at x's dtype (the bar of 16-bit results)."""
    c = x.dtype
    y = S.ACT64[act](F.linear(x, w.to(c), None if b is None else b.to(c)))
    return y if r is None else y + r.to(c)


def check_fused(out, x, w, b, act, r, what, backend="cpp", atol=0.0):
    pre, ref = S.fused_linear_64(x, w, b, act, r)

    alt = activation_alt(pre, act)
    if alt is not None:
        alt = S.ACT64[act](alt) + (0 if r is None else r.double().reshape(alt.shape))
    S.assert_close_to_reference(out, ref, x.dtype, tol_for(x.dtype), eager=lambda: eager_fused(x, w, b, act, r),
                                alt=alt, atol=atol, what=what)


@pytest.mark.parametrize("backend", backends_for("fused_linear"))
@xfail_known
@given(data=st.data())
@budget(14)
def test_fused_linear_matches_float64(backend, data):
    dt = data.draw(st.sampled_from(FL_DTYPES[backend]), label="x dtype")
    wdt = data.draw(st.sampled_from((dt, torch.float32)), label="weight dtype")
    lead, M, K, N = data.draw(S.linear_shapes(), label="lead, M, K, N")
    act = data.draw(st.sampled_from(ops.ACTIVATIONS), label="activation")
    bdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="bias dtype")
    rdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="residual dtype")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w = draw_tensor(data, "weight", (N, K), wdt, scale=1 / math.sqrt(max(K, 1)))
    b = None if bdt is None else draw_tensor(data, "bias", (N,), bdt)
    r = None if rdt is None else draw_tensor(data, "residual", (*lead, M, N), rdt)
    out = run(backend, ops.fused_linear, x, w, b, act, r)
    check_fused(out, x, w, b, act, r, f"fused_linear[{backend}]", backend)


@pytest.mark.parametrize("backend", backends_for("fused_linear"))
@xfail_known
@given(data=st.data())
@budget(40)
def test_fused_linear_activations_at_extremes(backend, data):
    """Every activation at pre-activations where its approximation saturates, underflows or overflows (x @ 1)."""
    dt = data.draw(st.sampled_from(FL_DTYPES[backend]), label="x dtype")
    act = data.draw(st.sampled_from(ops.ACTIVATIONS[1:]), label="activation")
    pre = data.draw(st.lists(st.sampled_from(S.EXTREMES), min_size=4, max_size=40), label="pre-activations")
    N = data.draw(st.sampled_from((1, 3, 17)), label="N")
    x = torch.tensor(pre, dtype=torch.float64).to(dt)[:, None]
    w = torch.ones(N, 1, dtype=dt)
    out = run(backend, ops.fused_linear, x, w, None, act, None)
    # atol: PyTorch's float64 gelu_tanh(-9.5) is -0 (1 + tanh cancels), the kernels' -6.7e-33 is closer to the truth
    check_fused(out, x, w, None, act, None, f"fused_linear[{backend}] {act}", backend, atol=1e-25)


FL_INVALID = {
    "x dtype": (TypeError, "x"),
    "weight dtype": (TypeError, "weight"),
    "bias dtype": (TypeError, "bias"),
    "residual dtype": (TypeError, "residual"),
    "x 0-d": (ValueError, "x"),
    "weight rank": (ValueError, "weight"),
    "K mismatch": (ValueError, "weight"),
    "bias shape": (ValueError, "bias"),
    "residual shape": (ValueError, "residual"),
    "activation": (ValueError, "activation"),
    "weight device": (RuntimeError, "weight"),
    "bias device": (RuntimeError, "bias"),
}


@pytest.mark.parametrize("backend", backends_for("fused_linear"))
@given(data=st.data())
@budget(16)
def test_fused_linear_invalid_raises_documented_error(backend, data):
    dt = data.draw(st.sampled_from(FL_DTYPES[backend][:1] + FL_DTYPES[backend][-1:]), label="x dtype")
    kind = data.draw(st.sampled_from(sorted(FL_INVALID)), label="what is wrong")
    lead, M, K, N = data.draw(S.linear_shapes(large_k=0), label="lead, M, K, N")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w = draw_tensor(data, "weight", (N, K), dt)
    b = draw_tensor(data, "bias", (N,), dt)
    r, act = None, "gelu"
    if kind == "x dtype":
        x = x.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "weight dtype":
        w = w.to(data.draw(invalid_float((dt, torch.float32)), label="weight dtype"))
    elif kind == "bias dtype":
        b = b.to(data.draw(st.sampled_from(S.NOT_FLOAT), label="bias dtype"))
    elif kind == "residual dtype":
        r = torch.zeros((*lead, M, N), dtype=data.draw(st.sampled_from(S.NOT_FLOAT), label="residual dtype"))
    elif kind == "x 0-d":
        x = torch.tensor(1.0, dtype=dt)
    elif kind == "weight rank":
        w = w.reshape(-1) if data.draw(st.booleans()) else w[None]
    elif kind == "K mismatch":
        w = torch.zeros(N, K + data.draw(st.sampled_from((1, 3, 4))), dtype=dt)
    elif kind == "bias shape":
        b = torch.zeros(N + 1, dtype=dt) if data.draw(st.booleans()) else b[None]
    elif kind == "residual shape":
        r = torch.zeros((*lead, M, N + 1), dtype=dt)
    elif kind == "activation":
        act = data.draw(st.sampled_from(("tanh", "GELU", "", "relu6")), label="activation")
    elif kind == "weight device":
        w = w.to("meta")
    elif kind == "bias device":
        b = b.to("meta")
    exc, arg = FL_INVALID[kind]
    S.assert_raises_naming(lambda: run(backend, ops.fused_linear, x, w, b, act, r), exc, arg, "fused_linear")


# -------------------------------------------------------------------------------------------------- int8 ops
X8_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT8_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # tests/test_int8.py: output rounding


@pytest.mark.parametrize("backend", backends_for("quantize_per_token"))
@xfail_known
@given(data=st.data())
@budget(12)
def test_quantize_per_token_contract(backend, data):
    dt = data.draw(st.sampled_from(X8_DTYPES), label="x dtype")
    lead, M, K, _ = data.draw(S.linear_shapes(), label="lead, M, K, _")
    x = draw_tensor(data, "x", (*lead, M, K), dt, specials=S.SPECIALS + ("ties",))
    q, s = run(backend, ops.quantize_per_token, x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.is_contiguous(), f"q is not contiguous (strides {q.stride()}, x's {x.stride()})"
    assert q.shape == x.shape and s.shape == x.shape[:-1]
    qr, sr = S.quantize_rows_np(S.rows(x))
    assert torch.equal(S.rows(q), qr), "q differs from the documented formula"
    assert torch.equal(s.reshape(-1).isnan(), sr.isnan()) and torch.equal(s.reshape(-1).nan_to_num(), sr.nan_to_num())
    # and in float64: every finite row is within half a step (plus the fp32 rounding of x * 127 / amax)
    x2, s2 = S.rows(x).double(), sr.double()[:, None]
    ok = torch.isfinite(s2) & (s2 > 0)
    err = (x2 - qr.double() * s2).abs()
    assert bool((err <= s2 * (0.5 + 1e-5) + 1e-45)[ok.expand_as(err)].all()), "a value is off by more than half a step"
    assert bool((qr.abs() <= 127).all())


@given(data=st.data())
@budget(12)
def test_quantize_per_group_contract(data):
    dt = data.draw(st.sampled_from(S.FLOATS), label="w dtype")
    N, K = data.draw(st.sampled_from(S.SIZES), label="N"), data.draw(st.sampled_from(S.K_SIZES + (300,)), label="K")
    w = draw_tensor(data, "w", (N, K), dt, specials=S.SPECIALS + ("ties",))
    search = data.draw(st.booleans(), label="search")
    q, scale, code = ops.quantize_per_group(w, search=search)
    G = (K + 15) // 16
    assert q.shape == (N, K) and q.dtype == torch.int8 and scale.shape == (N,) and scale.dtype == torch.float32
    assert code.shape == (N, G) and code.dtype == torch.uint8
    wd = w.double()
    bad_row = ~torch.isfinite(wd).all(dim=1) if K else torch.zeros(N, dtype=torch.bool)
    zero_row = (wd == 0).all(dim=1) & ~bad_row
    assert bool(scale[bad_row].isnan().all()) and bool((q[bad_row] == 0).all()) and bool((code[bad_row] == 0).all())
    assert bool((scale[zero_row] == 0).all()) and bool((q[zero_row] == 0).all())
    ok = ~bad_row & ~zero_row
    amax = wd.abs().amax(dim=1) if K else torch.zeros(N, dtype=torch.float64)
    want = (amax.float() / torch.tensor(127.0 * 255.0)).double()
    assert torch.equal(scale[ok].double(), want[ok]), "scale is not amax / (127 * 255) in fp32"
    assert bool((q.abs() <= 127).all())
    step = code.double().repeat_interleave(16, dim=1)[:, :K] * scale.double()[:, None]
    err = (wd - q.double() * step).where(ok[:, None], 0.0)
    if not search:  # the smallest code that clips nothing: every weight within half a step
        within = err.abs() <= step * (0.5 + 1e-5) + 1e-300
        assert bool(within[ok].all()), "a weight is off by more than half a step"
    else:  # the search keeps the code with the least squared error: never worse than without it
        q0, s0, c0 = ops.quantize_per_group(w, search=False)
        step0 = c0.double().repeat_interleave(16, dim=1)[:, :K] * s0.double()[:, None]
        err0 = (wd - q0.double() * step0).where(ok[:, None], 0.0)
        err = err.where(ok[:, None], 0.0)
        pad = G * 16 - K
        sse = F.pad(err.square(), (0, pad)).reshape(N, G, 16).sum(-1)
        sse0 = F.pad(err0.square(), (0, pad)).reshape(N, G, 16).sum(-1)
        assert bool((sse <= sse0 * (1 + 1e-6) + 1e-300).all()), "the search made a group worse"


@pytest.mark.parametrize("backend", backends_for("int8_mm"))
@xfail_known
@given(data=st.data())
@budget(12)
def test_int8_mm_matches_exact_reference(backend, data):
    _, M, K, N = data.draw(S.linear_shapes(), label="_, M, K, N")
    a_q = draw_tensor(data, "a_q", (M, K), torch.int8)
    b_q = draw_tensor(data, "b_q", (N, K), torch.int8)
    a_scale = draw_tensor(data, "a_scale", (M,), torch.float32, scale=0.01)
    b_scale = draw_tensor(data, "b_scale", (N,), torch.float32, scale=0.01)
    bdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="bias dtype")
    bias = None if bdt is None else draw_tensor(data, "bias", (N,), bdt)
    out_dtype = data.draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16, torch.int32)), label="out")
    plain, packed, comp = b_q, None, None
    if data.draw(st.booleans(), label="packed"):
        packed, comp = ops.int8_pack_weight(b_q)
        assert torch.equal(_unpack(packed, N, K), b_q), "int8_pack_weight is not the documented VNNI layout"
        assert torch.equal(comp[:N].long(), 128 * b_q.long().sum(1)) and not comp[N:].any()
        if data.draw(st.booleans(), label="placeholder b_q") and N * K > 1:
            b_q = torch.zeros((), dtype=torch.int8).expand(N, K)
    out = run(backend, ops.int8_mm, a_q, b_q, a_scale, b_scale, bias, out_dtype, packed, comp)
    acc = S.int_acc(a_q, plain)
    if out_dtype == torch.int32:
        assert out.dtype == torch.int32 and torch.equal(out.long(), acc), "int32 accumulator is not exact"
        return
    ref = S.dequant_64(acc, a_scale, b_scale, bias)
    S.assert_close_to_reference(out, ref, out_dtype, INT8_TOL[out_dtype], what=f"int8_mm[{backend}]")


def _unpack(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The plain weight back from the documented VNNI layout: (n, k) at ((n // 16) * (Kp // 4) + k // 4) * 64 +
    (n % 16) * 4 + k % 4."""
    Np, Kp = packed.shape
    blocks = packed.reshape(Np // 16, Kp // 4, 16, 4).permute(0, 2, 1, 3)
    return blocks.reshape(Np, Kp)[:N, :K]


def draw_int8_weight(data, N, K, grouped):
    """(w_q, w_scale, w_group or None) quantized from a float weight with special values, each in a drawn layout."""
    w = draw_tensor(data, "float weight", (N, K), torch.float32, scale=1 / math.sqrt(max(K, 1)))
    q, s, g = ops.quantize_per_group(w) if grouped else (*ops.quantize_per_channel(w), None)
    lay = data.draw(st.sampled_from(S.LAYOUTS), label="weight layouts")
    q, s = S.with_layout(q, lay), S.with_layout(s, lay)
    return q, s, None if g is None else S.with_layout(g, lay)


@pytest.mark.parametrize("backend", backends_for("int8_linear"))
@xfail_known
@given(data=st.data())
@budget(12)
def test_int8_linear_matches_exact_reference(backend, data):
    dt = data.draw(st.sampled_from(X8_DTYPES), label="x dtype")
    lead, M, K, N = data.draw(S.linear_shapes(), label="lead, M, K, N")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w_q, w_scale, _ = draw_int8_weight(data, N, K, grouped=False)
    bdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="bias dtype")
    bias = None if bdt is None else draw_tensor(data, "bias", (N,), bdt)
    packed = comp = None
    plain = w_q
    if data.draw(st.booleans(), label="packed"):
        packed, comp = ops.int8_pack_weight(w_q)
        if data.draw(st.booleans(), label="placeholder w_q") and N * K > 1:
            w_q = torch.zeros((), dtype=torch.int8).expand(N, K)
    out = run(backend, ops.int8_linear, x, w_q, w_scale, bias, packed, comp)
    qx, sx = S.quantize_rows_np(S.rows(x))
    ref = S.dequant_64(S.int_acc(qx, plain), sx, w_scale, bias).reshape(*x.shape[:-1], N)
    S.assert_close_to_reference(out, ref, dt, INT8_TOL[dt], what=f"int8_linear[{backend}]")


@pytest.mark.parametrize("backend", backends_for("int8_weight_only_linear"))
@xfail_known
@given(data=st.data())
@budget(12)
def test_int8_weight_only_linear_matches_float64(backend, data):
    dt = data.draw(st.sampled_from(X8_DTYPES), label="x dtype")
    lead, M, K, N = data.draw(S.linear_shapes(), label="lead, M, K, N")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w_q, w_scale, w_group = draw_int8_weight(data, N, K, grouped=data.draw(st.booleans(), label="grouped"))
    bdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="bias dtype")
    bias = None if bdt is None else draw_tensor(data, "bias", (N,), bdt)
    out = run(backend, ops.int8_weight_only_linear, x, w_q, w_scale, bias, w_group)
    ref = S.weight_only_64(x, w_q, w_scale, bias, w_group)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dt]  # tests/test_int8.py
    S.assert_close_to_reference(out, ref, dt, tol, what=f"int8_weight_only_linear[{backend}]")


INT8_INVALID = {
    # kind: (op, exception, argument)
    "x dtype": ("int8_linear", TypeError, "x"),
    "x 0-d": ("int8_linear", ValueError, "x"),
    "w_q dtype": ("int8_linear", TypeError, "w_q"),
    "w_q rank": ("int8_linear", ValueError, "w_q"),
    "K mismatch": ("int8_linear", ValueError, "w_q"),
    "w_scale dtype": ("int8_linear", TypeError, "w_scale"),
    "w_scale shape": ("int8_linear", ValueError, "w_scale"),
    "w_scale device": ("int8_linear", RuntimeError, "w_scale"),
    "bias dtype": ("int8_linear", TypeError, "bias"),
    "bias shape": ("int8_linear", ValueError, "bias"),
    "w_packed shape": ("int8_linear", ValueError, "w_packed"),
    "w_comp dtype": ("int8_linear", TypeError, "w_comp"),
    "wo x dtype": ("int8_weight_only_linear", TypeError, "x"),
    "wo w_group_scale dtype": ("int8_weight_only_linear", TypeError, "w_group_scale"),
    "wo w_group_scale shape": ("int8_weight_only_linear", ValueError, "w_group_scale"),
    "quantize x dtype": ("quantize_per_token", TypeError, "x"),
    "quantize x 0-d": ("quantize_per_token", ValueError, "x"),
    "mm a_q dtype": ("int8_mm", TypeError, "a_q"),
    "mm K mismatch": ("int8_mm", ValueError, "b_q"),
    "mm out_dtype": ("int8_mm", TypeError, "out_dtype"),
    "mm a_scale shape": ("int8_mm", ValueError, "a_scale"),
    "mm b_scale dtype": ("int8_mm", TypeError, "b_scale"),
}


@pytest.mark.parametrize("backend", backends_for("int8_linear"))
@given(data=st.data())
@budget(20)
def test_int8_invalid_raises_documented_error(backend, data):
    kind = data.draw(st.sampled_from(sorted(INT8_INVALID)), label="what is wrong")
    op, exc, arg = INT8_INVALID[kind]
    dt = data.draw(st.sampled_from(X8_DTYPES), label="x dtype")
    lead, M, K, N = data.draw(S.linear_shapes(large_k=0), label="lead, M, K, N")
    K = max(K, 1)
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w_q, w_scale = ops.quantize_per_channel(torch.randn(N, K))
    w_group = ops.quantize_per_group(torch.randn(N, K))[2]
    bias, packed, comp = torch.randn(N), None, None
    bad = data.draw(invalid_float(X8_DTYPES), label="bad dtype")
    if kind in ("x dtype", "wo x dtype", "quantize x dtype"):
        x = x.to(bad)
    elif kind in ("x 0-d", "quantize x 0-d"):
        x = torch.tensor(1.0, dtype=dt)
    elif kind == "w_q dtype":
        w_q = w_q.to(data.draw(st.sampled_from((torch.float32, torch.uint8, torch.int32, torch.bool))))
    elif kind == "w_q rank":
        w_q = w_q.reshape(-1)
    elif kind in ("K mismatch", "mm K mismatch"):
        w_q = torch.zeros(N, K + 1, dtype=torch.int8)
    elif kind == "w_scale dtype":
        w_scale = w_scale.to(data.draw(st.sampled_from((torch.float16, torch.float64, torch.int32))))
    elif kind == "w_scale shape":
        w_scale = torch.ones(N + 1)
    elif kind == "w_scale device":
        w_scale = w_scale.to("meta")
    elif kind == "bias dtype":
        bias = bias.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "bias shape":
        bias = torch.zeros(N + 2)
    elif kind == "w_packed shape":
        packed, comp = ops.int8_pack_weight(w_q)
        packed = packed[:, :-4] if packed.shape[1] >= 4 else torch.zeros(1, 1, dtype=torch.int8)
    elif kind == "w_comp dtype":
        packed, comp = ops.int8_pack_weight(w_q)
        comp = comp.float()
    elif kind == "wo w_group_scale dtype":
        w_group = w_group.to(torch.int8)
    elif kind == "wo w_group_scale shape":
        w_group = w_group[:, :-1] if w_group.shape[1] > 1 else torch.ones(N, 2, dtype=torch.uint8)
    if op == "int8_linear":
        call = (ops.int8_linear, x, w_q, w_scale, bias, packed, comp)
    elif op == "int8_weight_only_linear":
        call = (ops.int8_weight_only_linear, x, w_q, w_scale, bias, w_group)
    elif op == "quantize_per_token":
        call = (ops.quantize_per_token, x)
    else:
        a_q, a_s = ops.quantize_per_token(S.rows(x).float())
        out_dtype = torch.float32
        b_scale = w_scale
        if kind == "mm a_q dtype":
            a_q = a_q.to(data.draw(st.sampled_from((torch.float32, torch.uint8, torch.int32, torch.bool))))
        elif kind == "mm out_dtype":
            out_dtype = data.draw(st.sampled_from((torch.float64, torch.int8, torch.int64, torch.bool)))
        elif kind == "mm a_scale shape":
            a_s = torch.ones(a_s.shape[0] + 1)
        elif kind == "mm b_scale dtype":
            b_scale = b_scale.to(data.draw(st.sampled_from((torch.float16, torch.float64, torch.int32))))
        call = (ops.int8_mm, a_q, w_q, a_s, b_scale, None, out_dtype)
    be = backend if (op != "int8_weight_only_linear" or backend in backends_for(op)) else "auto"
    S.assert_raises_naming(lambda: run(be, *call), exc, arg, op)


# ------------------------------------------------------------------------------------------------ 2:4 sparsity
SP_DTYPES = {"cpp": (torch.float32, torch.bfloat16, torch.float16), "triton": (torch.float32, torch.float16),
             "torch": S.FLOATS}
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN payloads, -0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(_BITS[a.dtype]), b.contiguous().view(_BITS[b.dtype]))


@pytest.mark.parametrize("backend", sorted(set(backends_for("mask_2_4")) | set(backends_for("compress_2_4"))))
@xfail_known
@given(data=st.data())
@budget(14)
def test_mask_compress_decompress_2_4_exact(backend, data):
    dt = data.draw(st.sampled_from(SP_DTYPES[backend]), label="w dtype")
    N, K = data.draw(st.sampled_from(S.SIZES), label="N"), data.draw(st.sampled_from(S.K4_SIZES), label="K")
    w = draw_tensor(data, "w", (N, K), dt, specials=S.SPECIALS + ("ties", "ties"))
    mask = S.mask_2_4_ref(w)
    if backend in backends_for("mask_2_4"):
        m = run(backend, ops.mask_2_4, w)
        assert m.dtype == torch.bool and torch.equal(m, mask), "mask_2_4 differs from the documented rule"
    if backend in backends_for("compress_2_4"):
        values, meta = run(backend, ops.compress_2_4, w)
        assert values.shape == (N, K // 2) and meta.shape == (N, (K + 7) // 8) and meta.dtype == torch.uint8
        assert bits_equal(values, w.contiguous()[mask].reshape(N, K // 2)), "values are not the kept elements"
        assert torch.equal(meta, S.pack_meta_ref(mask)), "meta is not the documented bitmask"
        dense = run(backend if backend in backends_for("decompress_2_4") else "auto", ops.decompress_2_4, values,
                    meta)
        want = torch.where(mask, w, torch.zeros((), dtype=dt))
        assert bits_equal(dense, want), "decompress(compress(w)) != w * mask"


@st.composite
def metas(draw, N, K, allow_invalid=True):
    """(meta, valid): a random 2-of-4 meta, or (when allowed, one case in four) one with a group of 0, 1, 3 or 4."""
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    G = K // 4
    keep = torch.rand(N, G, 4, generator=g).argsort(-1)[..., :2]
    mask = torch.zeros(N, G, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(N, K)
    valid = True
    if allow_invalid and N * G and draw(st.integers(0, 3)) == 0:
        n, grp = draw(st.integers(0, N - 1)), draw(st.integers(0, G - 1))
        count = draw(st.sampled_from((0, 1, 3, 4)))
        mask[n, 4 * grp : 4 * grp + 4] = torch.arange(4) < count
        valid = False
    meta = S.with_layout(S.pack_meta_ref(mask), draw(st.sampled_from(S.LAYOUTS)))
    return meta, valid


@pytest.mark.parametrize("backend", backends_for("decompress_2_4"))
@xfail_known
@given(data=st.data())
@budget(12)
def test_decompress_2_4_exact_or_value_error(backend, data):
    dt = data.draw(st.sampled_from(SP_DTYPES[backend]), label="values dtype")
    N, K = data.draw(st.sampled_from(S.SIZES), label="N"), data.draw(st.sampled_from(S.K4_SIZES), label="K")
    values = draw_tensor(data, "values", (N, K // 2), dt)
    meta, valid = data.draw(metas(N, K), label="meta, valid")
    if not valid:
        S.assert_raises_naming(lambda: run(backend, ops.decompress_2_4, values, meta), ValueError, "meta",
                               "decompress_2_4")
        return
    out = run(backend, ops.decompress_2_4, values, meta)
    assert bits_equal(out, S.decompress_ref(values, meta)), "decompress_2_4 differs from the documented layout"


def pruned_nonfinite_only(x, values, meta, bias, dt, got: dict):
    """A callable for known_bug("sparse-nan-pruned"): the result ``got["out"]`` matches x @ W.T summed over the kept
    positions only (a NaN / Inf of x at a pruned position ignored)."""
    if bool(torch.isfinite(x).all()):
        return False

    def check():
        out = got.get("out")
        if out is None:
            return False
        w = S.decompress_ref(values, meta).to(dt).double()
        keep = S.unpack_meta_ref(meta, w.shape[1])
        x2 = S.rows(x).double()
        prod = torch.where(keep[None], x2[:, None, :] * w[None], 0.0).sum(-1)
        ref = (prod if bias is None else prod + bias.double()).reshape(*x.shape[:-1], w.shape[0])
        try:
            S.assert_close_to_reference(out, ref, dt, tol_for(dt))
        except AssertionError:
            return False
        return True

    return check


SPL_DTYPES = {"cpp": (torch.float32, torch.bfloat16), "torch": S.FLOATS}


def dense_ref_64(x, values, meta, bias):
    w = S.decompress_ref(values, meta).to(x.dtype).double()
    out = S.rows(x).double() @ w.t()
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], values.shape[0])


@pytest.mark.parametrize("backend", backends_for("sparse24_linear"))
@xfail_known
@given(data=st.data())
@budget(14)
def test_sparse24_linear_matches_float64(backend, data):
    dt = data.draw(st.sampled_from(SPL_DTYPES.get(backend, S.FLOATS)), label="x dtype")
    vdt = data.draw(st.sampled_from(SPL_DTYPES.get(backend, S.FLOATS)), label="values dtype")
    lead, M, K, N = data.draw(S.linear_shapes(k_sizes=S.K4_SIZES), label="lead, M, K, N")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    if data.draw(st.booleans(), label="meta from compress_2_4"):
        w = draw_tensor(data, "w", (N, K), vdt, scale=1 / math.sqrt(max(K, 1)))
        values, meta = ops.compress_2_4(w)
        values = S.with_layout(values, data.draw(st.sampled_from(S.LAYOUTS), label="values layout"))
        valid = True
    else:
        values = draw_tensor(data, "values", (N, K // 2), vdt, scale=1 / math.sqrt(max(K, 1)))
        meta, valid = data.draw(metas(N, K), label="meta, valid")
    bdt = data.draw(st.none() | st.sampled_from(S.FLOATS), label="bias dtype")
    bias = None if bdt is None else draw_tensor(data, "bias", (N,), bdt)
    got = {}
    nan_pruned = pruned_nonfinite_only(x, values, meta, bias, dt, got) if backend == "cpp" and valid else False
    with pruned_positions_may_be_skipped(nan_pruned):
        if not valid:
            S.assert_raises_naming(lambda: run(backend, ops.sparse24_linear, x, values, meta, bias), ValueError,
                                   "meta", "sparse24_linear")
            return
        out = got["out"] = run(backend, ops.sparse24_linear, x, values, meta, bias)
        ref = dense_ref_64(x, values, meta, bias)

        def eager():
            w = S.decompress_ref(values, meta).to(dt)
            return F.linear(x, w, None if bias is None else bias.to(dt))

        S.assert_close_to_reference(out, ref, dt, tol_for(dt), eager=eager, what=f"sparse24_linear[{backend}]")


SP_INVALID = {
    "w dtype": ("mask_2_4", TypeError, "w"),
    "w rank": ("compress_2_4", ValueError, "w"),
    "w K % 4": ("compress_2_4", ValueError, "w"),
    "values dtype": ("decompress_2_4", TypeError, "values"),
    "values odd": ("decompress_2_4", ValueError, "values"),
    "meta dtype": ("decompress_2_4", TypeError, "meta"),
    "meta shape": ("decompress_2_4", ValueError, "meta"),
    "x dtype": ("sparse24_linear", TypeError, "x"),
    "x K mismatch": ("sparse24_linear", ValueError, "x"),
    "bias dtype": ("sparse24_linear", TypeError, "bias"),
    "bias shape": ("sparse24_linear", ValueError, "bias"),
    "values device": ("sparse24_linear", RuntimeError, "values"),
}


@pytest.mark.parametrize("backend", backends_for("sparse24_linear"))
@given(data=st.data())
@budget(16)
def test_sparse24_invalid_raises_documented_error(backend, data):
    kind = data.draw(st.sampled_from(sorted(SP_INVALID)), label="what is wrong")
    op, exc, arg = SP_INVALID[kind]
    N, K = data.draw(st.sampled_from(S.SIZES[1:]), label="N"), data.draw(st.sampled_from(S.K4_SIZES[1:]), label="K")
    w = torch.randn(N, K)
    values, meta = ops.compress_2_4(w)
    x, bias = torch.randn(3, K), torch.randn(N)
    if kind == "w dtype":
        w = w.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "w rank":
        w = w.reshape(-1)
    elif kind == "w K % 4":
        w = torch.randn(N, K + data.draw(st.sampled_from((1, 2, 3))))
    elif kind == "values dtype":
        values = values.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "values odd":
        values = torch.randn(N, K // 2 + 1)
    elif kind == "meta dtype":
        meta = meta.to(data.draw(st.sampled_from((torch.int8, torch.int32, torch.float32, torch.bool))))
    elif kind == "meta shape":
        meta = torch.cat([meta, meta], dim=0)
    elif kind == "x dtype":
        x = x.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "x K mismatch":
        x = torch.randn(3, K + 4)
    elif kind == "bias dtype":
        bias = bias.to(data.draw(st.sampled_from(S.NOT_FLOAT)))
    elif kind == "bias shape":
        bias = torch.randn(N + 1)
    elif kind == "values device":
        values = values.to("meta")
    args = {"mask_2_4": (w,), "compress_2_4": (w,), "decompress_2_4": (values, meta),
            "sparse24_linear": (x, values, meta, bias)}[op]
    be = backend if backend in backends_for(op) else "auto"
    S.assert_raises_naming(lambda: run(be, getattr(ops, op), *args), exc, arg, op)


# ---------------------------------------------------------------------------------------------------- modules
def fill_(t: torch.Tensor, data, label, scale=1.0, specials=S.SPECIALS) -> None:
    with torch.no_grad():
        t.copy_(S.values(t.shape, t.dtype, data.draw(S.specs(specials, ("contiguous",)), label=label), scale))


@xfail_known
@given(data=st.data())
@budget(12)
def test_fused_linear_module_matches_float64(data):
    dt = data.draw(st.sampled_from(S.FLOATS), label="x dtype")
    pdt = data.draw(st.sampled_from((dt, torch.float32)), label="parameter dtype")
    lead, M, K, N = data.draw(S.linear_shapes(), label="lead, M, K, N")
    act = data.draw(st.sampled_from(ops.ACTIVATIONS), label="activation")
    m = FusedLinear(K, N, bias=data.draw(st.booleans(), label="bias"), activation=act, dtype=pdt)
    fill_(m.weight, data, "weight", scale=1 / math.sqrt(max(K, 1)))
    if m.bias is not None:
        fill_(m.bias, data, "bias")
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    r = draw_tensor(data, "residual", (*lead, M, N), dt) if data.draw(st.booleans(), label="residual") else None
    with torch.no_grad():
        out = m(x, r)
    check_fused(out, x, m.weight.detach(), None if m.bias is None else m.bias.detach(), act, r, "FusedLinear")
    bad = x.to(data.draw(st.sampled_from(S.NOT_FLOAT), label="invalid x dtype"))
    S.assert_raises_naming(lambda: m(bad), TypeError, "x", ("FusedLinear", "fused_linear"))


@xfail_known
@given(data=st.data())
@budget(12)
def test_int8_linear_module_matches_reference(data):
    dt = data.draw(st.sampled_from(X8_DTYPES), label="x dtype")
    lead, M, K, N = data.draw(S.linear_shapes(), label="lead, M, K, N")
    mode = data.draw(st.sampled_from(("dynamic", "weight_only")), label="mode")
    group_size = data.draw(st.sampled_from(("auto", None)), label="group_size") if mode == "weight_only" else "auto"
    lin = nn.Linear(K, N, bias=data.draw(st.booleans(), label="bias"))
    fill_(lin.weight, data, "weight", scale=1 / math.sqrt(max(K, 1)))
    if lin.bias is not None:
        fill_(lin.bias, data, "bias")
    m = Int8Linear.from_linear(lin, mode=mode, group_size=group_size).eval()
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    with torch.no_grad():
        out = m(x)
    w_q, w_scale, w_group, bias = m.qweight, m.weight_scale, m.weight_group_scale, m.bias
    if mode == "dynamic":
        qx, sx = S.quantize_rows_np(S.rows(x))
        ref = S.dequant_64(S.int_acc(qx, w_q), sx, w_scale, bias).reshape(*x.shape[:-1], N)
        tol = INT8_TOL[dt]
    else:
        ref = S.weight_only_64(x, w_q, w_scale, bias, w_group)
        tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dt]
    S.assert_close_to_reference(out, ref, dt, tol, what=f"Int8Linear({mode}, group_size={group_size})")
    # the layer's weights are the documented quantization of the float weight
    q2, s2, g2 = ops.quantize_per_group(lin.weight) if m.group_size else (*ops.quantize_per_channel(lin.weight), None)
    assert torch.equal(w_q, q2) and torch.equal(w_scale.nan_to_num(), s2.nan_to_num())
    assert (w_group is None) == (g2 is None) and (g2 is None or torch.equal(w_group, g2))
    bad = x.to(data.draw(invalid_float(X8_DTYPES), label="invalid x dtype"))
    S.assert_raises_naming(lambda: m(bad), TypeError, "x", ("Int8Linear", "int8_linear", "int8_weight_only_linear"))


@xfail_known
@given(data=st.data())
@budget(14)
def test_sparse24_linear_module_matches_float64(data):
    dt = data.draw(st.sampled_from(S.FLOATS), label="x dtype")
    vdt = data.draw(st.sampled_from((None, torch.float32, torch.bfloat16)), label="values dtype")
    lead, M, K, N = data.draw(S.linear_shapes(k_sizes=S.K4_SIZES), label="lead, M, K, N")
    mode = data.draw(st.sampled_from(("auto", "sparse", "dense")), label="mode")
    act = data.draw(st.sampled_from(ops.ACTIVATIONS), label="activation")
    lin = nn.Linear(K, N, bias=data.draw(st.booleans(), label="bias"))
    fill_(lin.weight, data, "weight", scale=1 / math.sqrt(max(K, 1)))
    if lin.bias is not None:
        fill_(lin.bias, data, "bias")
    m = Sparse24Linear.from_linear(lin, dtype=vdt, mode=mode, activation=act)
    x = draw_tensor(data, "x", (*lead, M, K), dt)
    w = S.decompress_ref(m.values.detach(), m.meta)
    assert w is not None
    b = None if m.bias is None else m.bias.detach()
    pre, ref = S.fused_linear_64(x, w, b, act, None)
    alt = activation_alt(pre, act)
    alt = None if alt is None else S.ACT64[act](alt)

    def eager():
        return S.ACT64[act](F.linear(x, w.to(dt), None if b is None else b.to(dt)))

    got = {}
    nan_pruned = pruned_nonfinite_only(x, m.values.detach(), m.meta, b, dt, got) if act == "none" \
        else False
    with pruned_positions_may_be_skipped(lambda: m.last_path == "sparse" and nan_pruned and nan_pruned()):
        with torch.no_grad():
            out = got["out"] = m(x)
        S.assert_close_to_reference(out, ref, dt, tol_for(dt), eager=eager, alt=alt,
                                    what=f"Sparse24Linear(mode={mode}, values {vdt}) path {m.last_path}")
    bad = x.to(data.draw(st.sampled_from(S.NOT_FLOAT), label="invalid x dtype"))
    S.assert_raises_naming(lambda: m(bad), TypeError, "x", ("Sparse24Linear", "sparse24_linear"))


# ------------------------------------------------------------------------------------------------ ISA levels
ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")


@skip_in_child
@pytest.mark.skipif(not HAS_CPP, reason="needs the compiled extension fastdl._C (C++ kernels)")
@pytest.mark.parametrize("isa", ISA_LEVELS)
def test_properties_at_isa_level(isa):
    """The C++ kernels at every instruction-set level (FASTDL_CPU_ISA caps them, read once per process): this file's
    cpp properties in a subprocess at ``isa``. A level above this CPU's, or the level of this process (whose
    properties ran above), is skipped."""
    detected, current = CPU.get("detected_level"), CPU.get("level")
    if detected in ISA_LEVELS and ISA_LEVELS.index(isa) > ISA_LEVELS.index(detected):
        pytest.skip(f"this CPU's level is {detected}: {isa} would be capped to it")
    if isa == current:
        pytest.skip(f"{isa} is this process's level: the properties above ran at it")
    res = _pytest_child({"FASTDL_PROPS_CHILD": "isa", "FASTDL_CPU_ISA": isa},
                        ["-k", "not isa_level and not subprocess and not child"], timeout=600)
    _judge_child(res, f"FASTDL_CPU_ISA={isa}")


def _pytest_child(env_extra: dict, args: list, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("FASTDL_CPU_ISA", None)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(TESTS_DIR), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-x", "-p", "no:cacheprovider",
           "-W", "ignore::pytest.PytestUnknownMarkWarning", *args]
    return subprocess.run(cmd, env=env, cwd=os.path.dirname(TESTS_DIR), capture_output=True, text=True,
                          timeout=timeout)


def _judge_child(res: subprocess.CompletedProcess, where: str, known: int | None = None) -> None:
    """No signal, every property held (xfails of the subprocess are reported as this test's xfail). ``known``: the
    known bug whose cases these are (then a signal or failure is an xfail naming it)."""
    tail = (res.stdout + res.stderr)[-6000:]
    what = (f"killed by signal {-res.returncode}" if res.returncode < 0 else
            f"its properties failed (exit {res.returncode})" if res.returncode else "")
    if what and known is not None:
        pytest.xfail(f"{where}: {what}: {KNOWN_BUGS[known]} (a known bug: remove this mark once fixed)\n{tail}")
    if what:
        pytest.fail(f"{where}: the subprocess's {what}\n{tail}")
    xfails = re.findall(r"XFAIL .*", res.stdout)
    if xfails:
        pytest.xfail(f"{where}: " + " | ".join(xfails)[:1500])


# --------------------------------------------------------------------------------- raw pointers (subprocess)
LOADER_DTYPES = (torch.uint8, torch.bool, torch.int16, torch.float32, torch.bfloat16, torch.float64, torch.complex64)
LOADER_FAULTS = ("negative offset", "unaligned offset", "past the end", "offsets length", "keep_strides length",
                 "num_threads", "dst dtype", "dst not contiguous", "too large src", "keep_strides on a strided src")
HUGE_FAULTS = ("offset near 2**63", "nbytes overflow", "offset 2**62")


@st.composite
def loader_cases(draw, category: str):
    """(src, capacity, offsets, keep_strides, num_threads, dst dtype, dst contiguous, fault or None)."""
    faults = LOADER_FAULTS if category == "ordinary" else HUGE_FAULTS
    fault = draw(st.none() | st.sampled_from(faults) if category == "ordinary" else st.sampled_from(faults),
                 label="fault")
    n = draw(st.integers(1, 3))
    i = draw(st.integers(0, n - 1), label="faulty src")
    src, keep = [], []
    for j in range(n):
        dtype = draw(st.sampled_from(LOADER_DTYPES), label=f"src[{j}] dtype")
        shape = tuple(draw(st.lists(st.sampled_from((0, 1, 2, 3, 5)), max_size=3), label=f"src[{j}] shape"))
        spec = draw(S.specs(("none",)), label=f"src[{j}]")
        v = (torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(spec.seed)) if dtype.is_complex
             else S.values(shape, dtype, spec))
        t = S.with_layout(v, spec.layout)
        dense = spec.layout in ("contiguous", "transposed", "offset") or t.numel() == 0 or t.is_contiguous()
        k = int(dense and draw(st.booleans(), label=f"keep_strides[{j}]"))
        if j == i and fault == "too large src":  # 2**40 bytes, no memory behind them (stride 0)
            t = torch.zeros((), dtype=dtype).expand(2**20, 2**20)
        elif j == i and fault == "keep_strides on a strided src":
            t, k = torch.zeros(4, 6, dtype=dtype)[:, ::2], 1
        elif j == i and fault == "nbytes overflow":  # numel * itemsize = 2**65 wraps around 2**64 to 0
            t, k = torch.zeros((), dtype=torch.float64).expand(2**31, 2**31), draw(st.sampled_from((0, 1)))
        src.append(t)
        keep.append(k)
    offsets, end = [], 0
    for j, t in enumerate(src):
        size = t.element_size()
        start = -(-end // size) * size + size * draw(st.integers(0, 3))
        offsets.append(start)
        if not (j == i and fault in ("too large src", "nbytes overflow")):
            end = start + t.numel() * size
    capacity = end + draw(st.integers(0, 16))
    threads = draw(st.integers(1, 4), label="num_threads")
    dst_dtype, dst_contig = torch.uint8, True
    if fault == "negative offset":
        offsets[i] = -src[i].element_size() * draw(st.integers(1, 2**40))
    elif fault == "unaligned offset":
        if src[i].element_size() == 1:
            fault = None
        else:
            offsets[i] += 1
    elif fault == "past the end":
        offsets[i] = capacity - src[i].numel() * src[i].element_size() + src[i].element_size()
    elif fault == "offsets length":
        offsets = offsets[:-1]
    elif fault == "keep_strides length":
        keep = keep + [0]
    elif fault == "num_threads":
        threads = draw(st.sampled_from((0, -1)))
    elif fault == "dst dtype":
        dst_dtype = draw(st.sampled_from((torch.int8, torch.float32, torch.bool)))
    elif fault == "dst not contiguous":
        dst_contig = False
    elif fault == "offset near 2**63":
        offsets[i] = 2**63 - src[i].element_size() * draw(st.integers(1, 64))
    elif fault == "offset 2**62":
        offsets[i] = 2**62
    return src, capacity, offsets, keep, threads, dst_dtype, dst_contig, fault


def _expected_bytes(t: torch.Tensor, keep: int) -> torch.Tensor:
    if t.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8)
    if keep:
        span = t.as_strided((t.numel(),), (1,), t.storage_offset())  # dense: its memory span in storage order
        return span.reshape(-1).view(torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.skipif(not CHILD.startswith("raw-"), reason="runs in test_raw_pointer_cases_in_subprocess's subprocess")
@pytest.mark.parametrize("backend", cpu_backends("loader_fill"))
@given(data=st.data())
@budget(40)
def test_loader_fill_child(backend, data):
    src, capacity, offsets, keep, threads, dst_dtype, dst_contig, fault = data.draw(
        loader_cases(CHILD[len("raw-"):]), label="case")
    canary = 64
    buf = torch.full((capacity + 2 * canary,), 0xA5, dtype=torch.uint8)
    dst = buf[canary : canary + capacity]
    if dst_dtype != torch.uint8:
        dst = torch.zeros(capacity, dtype=dst_dtype)
    if not dst_contig:
        dst = torch.full((2 * capacity + 2,), 0xA5, dtype=torch.uint8)[::2]
    if fault is not None:
        exc, arg = {
            "offsets length": (ValueError, "offsets"), "keep_strides length": (ValueError, "keep_strides"),
            "num_threads": (ValueError, "num_threads"), "dst dtype": (TypeError, "dst"),
            "dst not contiguous": (ValueError, "dst"), "keep_strides on a strided src": (ValueError, "keep_strides"),
        }.get(fault, (ValueError, "offsets"))
        S.assert_raises_naming(lambda: run(backend, ops.loader_fill, src, dst, offsets, keep, threads), exc, arg,
                               "loader_fill")
    else:
        run(backend, ops.loader_fill, src, dst, offsets, keep, threads)
        want = torch.full((capacity,), 0xA5, dtype=torch.uint8)
        for t, off, k in zip(src, offsets, keep):
            b = _expected_bytes(t, k)
            want[off : off + b.numel()] = b
        assert torch.equal(dst, want), "dst bytes differ from the copies"
    assert bool((buf[:canary] == 0xA5).all()) and bool((buf[canary + capacity :] == 0xA5).all()), \
        "loader_fill wrote outside dst"


@skip_in_child
@pytest.mark.parametrize("category", ["ordinary", "huge"])
def test_raw_pointer_cases_in_subprocess(category):
    """loader_fill (raw pointers, byte offsets) with valid, invalid and extreme offsets and sizes, in a subprocess:
    every case copies the right bytes (nothing outside dst) or raises the documented error; no signal."""
    res = _pytest_child({"FASTDL_PROPS_CHILD": f"raw-{category}"}, ["-k", "test_loader_fill_child"], timeout=300)
    _judge_child(res, f"loader_fill ({category} cases)", known=None)
