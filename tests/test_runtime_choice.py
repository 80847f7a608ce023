"""Run-time choice of a layer's path per bucket of input rows (fastdl.runtime_choice), its decision cache, and
convert("auto") over a workload. Timings are forced with a fake timer, so every choice here is deterministic."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from torch import nn

import fastdl
from fastdl import runtime_choice
from fastdl.nn import FusedLinear, Int8Linear, Sparse24Linear
from fastdl.ops import int8 as int8_ops


class FakeTimer:
    """``fn(name, rows) -> seconds`` for every timed call; remembers what was timed. A path ``fn`` does not know
    (KeyError: e.g. Int8Linear's "dequant_fused", offered only with the C++ kernels) gets ``UNLISTED`` s, never
    chosen."""

    UNLISTED = 1e3

    def __init__(self):
        self.fn = None
        self.timed: list[tuple[str, int]] = []

    def __call__(self, calls, device, info):
        if self.fn is None:
            raise AssertionError(f"nothing may be timed here (asked to time {sorted(calls)} at {info})")
        out = {}
        for name, call in calls.items():
            call()  # run each path once, as the real timer does (it must work on this input)
            self.timed.append((name, info["rows"]))
            try:
                out[name] = self.fn(name, info["rows"])
            except KeyError:
                out[name] = self.UNLISTED
        return out


@pytest.fixture
def timer():
    import importlib

    convert_mod = importlib.import_module("fastdl.convert")
    t = FakeTimer()
    prev_mode = runtime_choice.set_choice_mode("measure")
    runtime_choice.clear_decisions()
    convert_mod._DECISIONS.clear()
    runtime_choice.set_timer(t)
    yield t
    runtime_choice.set_timer(None)
    runtime_choice.set_choice_mode(prev_mode)
    runtime_choice.clear_decisions()
    convert_mod._DECISIONS.clear()


def _paths(mod):
    return {d["bucket"]: d["path"] for d in mod.runtime_decisions()}


def _linear(k=64, n=48, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, n)


# ------------------------------------------------------------------------------------------------ buckets and keys
def test_buckets_are_powers_of_two():
    rows = (0, 1, 2, 3, 4, 7, 8, 15, 16, 480, 512)
    assert [runtime_choice.bucket_of(m) for m in rows] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 9, 10]
    assert runtime_choice.bucket_label(5) == "M 16-31" and runtime_choice.bucket_label(1) == "M 1"


def test_decision_key_names_the_cpu_isa_threads_dtype_shape_and_bucket(timer):
    timer.fn = lambda name, rows: 1.0
    f = FusedLinear.from_linear(_linear(), "gelu")
    with torch.no_grad():
        f(torch.randn(5, 64))
    [d] = runtime_choice.decisions()
    cpu = fastdl.info()["cpu"]
    assert cpu["model"] in d["machine"] and f"|{cpu['level']}|" in d["machine"]
    assert d["machine"].endswith(f"|{torch.get_num_threads()}t")
    assert (d["device"], d["dtype"], d["bucket"], d["rows"]) == ("cpu", "float32", 3, "M 4-7")
    assert d["layer"] == ["FusedLinear", 64, 48, True, "gelu", False]  # kind, in, out, bias, activation, residual
    assert d["path"] == "fused" and set(d["times_ms"]) == {"fused", "aten"} and d["source"] == "measured"


# ------------------------------------------------------------------------------------------------ choice per bucket
def test_fused_linear_picks_the_faster_path_per_bucket(timer):
    # aten faster below 16 rows, fused faster from 16
    timer.fn = lambda name, rows: {"aten": 1.0 if rows < 16 else 3.0, "fused": 2.0}[name]
    lin = _linear()
    f = FusedLinear.from_linear(lin, "gelu")
    for m in (1, 3, 40, 300):
        x = torch.randn(m, 64)
        with torch.no_grad():
            torch.testing.assert_close(f(x), torch.nn.functional.gelu(lin(x)), rtol=1e-5, atol=1e-5)
    assert _paths(f) == {1: "aten", 2: "aten", 6: "fused", 9: "fused"}
    n = len(timer.timed)
    with torch.no_grad():
        f(torch.randn(2, 64))  # bucket 2 again (rows 2-3): decided, nothing timed
        f(torch.randn(7, 3, 64))  # 21 rows: bucket 5, new -> timed
    assert len(timer.timed) == n + 2 and _paths(f)[5] == "fused"


def test_residual_is_part_of_the_key_and_both_paths_add_it(timer):
    timer.fn = lambda name, rows: {"aten": 1.0, "fused": 2.0}[name]
    lin = _linear()
    f = FusedLinear.from_linear(lin, "relu")
    x, r = torch.randn(4, 64), torch.randn(4, 48)
    with torch.no_grad():
        torch.testing.assert_close(f(x, r), torch.relu(lin(x)) + r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f(x), torch.relu(lin(x)), rtol=1e-5, atol=1e-5)
    extras = sorted(d["extra"] for d in f.runtime_decisions())
    assert extras == [(False,), (True,)]
    # a residual of another dtype or shape: only the fused op (which casts, or names the problem)
    assert f._choice_paths(x, r.double()) == ("fused",)
    assert f._choice_paths(x, torch.randn(48)) == ("fused",)


def test_margin_keeps_the_default_path(timer):
    timer.fn = lambda name, rows: {"aten": 0.99, "fused": 1.0}[name]  # 1 % faster: noise
    f = FusedLinear.from_linear(_linear(), "none")
    with torch.no_grad():
        f(torch.randn(4, 64))
    assert _paths(f) == {3: "fused"}


def test_default_path_without_a_decision_keeps_master_weights_fused(timer):
    timer.fn = lambda name, rows: {"aten": 0.1, "fused": 1.0}[name]
    f = FusedLinear.from_linear(_linear(), "gelu")
    with torch.no_grad():
        f(torch.randn(4, 64, dtype=torch.bfloat16))  # fp32 weight, bf16 input: F.linear would not round the same way
    assert _paths(f) == {3: "fused"} and not timer.timed


def test_int8_weight_only_takes_the_dequantized_gemm_at_large_m_within_the_ops_bound(timer):
    timer.fn = lambda name, rows: {"kernel": 1.0 if rows < 64 else 3.0, "dequant": 2.0}[name]
    lin = _linear(96, 80)
    q = Int8Linear.from_linear(lin, mode="weight_only")
    w_q, s, g = q.qweight, q.weight_scale, q.weight_group_scale
    w_deq = int8_ops.grouped_weight(w_q, g) * s[:, None]
    for m, dtype in ((200, torch.float32), (3, torch.float32), (130, torch.bfloat16)):
        x = torch.randn(m, 96, dtype=dtype)
        with torch.no_grad():
            out = q(x)
        ref = int8_ops._weight_only_reference(x.float(), w_q, s, q.bias, g)  # the op's contract, in fp32
        # the bound: fp32 rounding, or twice the error of PyTorch's own bf16 GEMM on the dequantized weight
        own = torch.nn.functional.linear(x, w_deq.to(dtype), q.bias.to(dtype))
        bound = 2e-6 if dtype == torch.float32 else 2 * rel_err(own, ref)
        assert out.dtype == dtype
        assert rel_err(out, ref) <= bound, (m, dtype, rel_err(out, ref), bound)
    assert _paths(q) == {8: "dequant", 2: "kernel"}
    # the dequantized weight is held only for the dtypes whose buckets chose it, and is counted
    assert q.cache_bytes() == 96 * 80 * 4 + 96 * 80 * 2
    assert q.memory_bytes() >= q.cache_bytes()


@pytest.mark.skipif(not fastdl.backends.available("cpp", "fused_linear", "cpu")[0],
                    reason="needs the compiled extension fastdl._C (the path is offered only with the C++ kernels)")
def test_int8_dequant_fused_path_runs_the_fused_op_on_the_cached_weight(timer):
    timer.fn = lambda name, rows: {"kernel": 3.0, "dequant": 2.0, "dequant_fused": 1.0 if rows >= 64 else 4.0}[name]
    lin = _linear(96, 80)
    q = Int8Linear.from_linear(lin, mode="weight_only")
    assert q._choice_paths(torch.randn(2, 96)) == ("kernel", "dequant", "dequant_fused")
    assert q._choice_paths(torch.randn(2, 96, dtype=torch.float16)) == ("kernel", "dequant")  # no CPU fp16 kernel
    w_deq = q.dequantized_weight(torch.float32)
    for m in (200, 3):
        x = torch.randn(m, 96)
        with torch.no_grad():
            out = q(x)
        want = fastdl.ops.fused_linear(x, w_deq, q.bias) if m >= 64 else torch.nn.functional.linear(x, w_deq, q.bias)
        assert torch.equal(out, want), m
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w_deq, q.bias), rtol=1e-5, atol=1e-5)
    assert _paths(q) == {8: "dequant_fused", 2: "dequant"}
    assert q.cache_bytes() == 96 * 80 * 4  # one dequantized weight serves both paths
    timer.fn = lambda name, rows: {"kernel": 1.0, "dequant": 2.0, "dequant_fused": 3.0}[name]
    q2 = Int8Linear.from_linear(lin, mode="weight_only")
    with torch.no_grad():
        q2(torch.randn(300, 96))
    assert _paths(q2) == {9: "kernel"} and q2.cache_bytes() == 0


def test_int8_dequantized_weight_is_dropped_when_no_bucket_chooses_it(timer):
    timer.fn = lambda name, rows: {"kernel": 1.0, "dequant": 2.0}[name]
    q = Int8Linear.from_linear(_linear(), mode="weight_only")
    with torch.no_grad():
        q(torch.randn(300, 64))  # the timing builds the dequantized weight; the decision (kernel) drops it
    assert _paths(q) == {9: "kernel"} and q.cache_bytes() == 0


def test_int8_dynamic_dequant_path_is_closer_to_the_original(timer):
    timer.fn = lambda name, rows: {"kernel": 2.0, "dequant": 1.0}[name]
    lin = _linear(128, 64)
    q = Int8Linear.from_linear(lin, mode="dynamic")
    x = torch.randn(33, 128)
    with torch.no_grad():
        out = q(x)
        kernel_out = q._run_path("kernel", x)
    assert _paths(q) == {6: "dequant"}
    torch.testing.assert_close(out, torch.nn.functional.linear(x, q.to_linear().weight, q.bias), rtol=1e-5,
                               atol=1e-5)
    assert rel_err(out, lin(x)) <= rel_err(kernel_out, lin(x))
    # the weights changed (load_state_dict): the cached dequantized weight follows
    q.load_state_dict(_linear(128, 64, seed=1).state_dict())
    with torch.no_grad():
        torch.testing.assert_close(q(x), q._run_path("kernel", x), rtol=0.05, atol=0.05)
        torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.to_linear().weight, q.bias))


def test_sparse24_choice_is_measured_not_the_threshold(timer):
    # opposite of the fixed rule (sparse below 256 rows): dense at small M, sparse at large M
    timer.fn = lambda name, rows: {"dense": 1.0 if rows < 256 else 2.0, "sparse": 1.5}[name]
    s = Sparse24Linear.from_linear(_linear(64, 32))
    x_small, x_large = torch.randn(4, 64), torch.randn(300, 64)
    assert s.path_for(x_small) == "sparse" and s.path_for(x_large) == "dense"  # the fixed rule, nothing decided
    with torch.no_grad():
        for x in (x_small, x_large):
            torch.testing.assert_close(s(x), s.to_linear()(x), rtol=1e-4, atol=1e-4)
    assert s.path_for(x_small) == "dense" and s.path_for(x_large) == "sparse" and s.last_path == "sparse"
    assert s.cache_bytes() > 0  # the dense copy is held: a bucket uses it
    forced = Sparse24Linear.from_linear(_linear(64, 32), mode="sparse")
    with torch.no_grad():
        forced(x_small)
    assert forced.path_for(x_small) == "sparse" and forced.last_path == "sparse"


@pytest.mark.skipif(not fastdl.backends.available("cpp", "fused_linear", "cpu")[0],
                    reason="needs the compiled extension fastdl._C (the path is offered only with the C++ kernels)")
def test_sparse24_dense_fused_path_fuses_activation_and_residual(timer):
    timer.fn = lambda name, rows: {"sparse": 2.0, "dense": 3.0, "dense_fused": 1.0}[name]
    lin = _linear(64, 32)
    s = Sparse24Linear.from_linear(lin, activation="gelu")
    x, r = torch.randn(40, 64), torch.randn(40, 32)
    assert s._choice_paths(x) == ("sparse", "dense", "dense_fused")
    with torch.no_grad():
        out = s(x, r)
    dense = s.dense_weight()
    assert s.last_path == "dense_fused" and _paths(s) == {6: "dense_fused"} and s.cache_bytes() > 0
    assert torch.equal(out, fastdl.ops.fused_linear(x, dense, s.bias, "gelu", r))
    torch.testing.assert_close(out, torch.nn.functional.gelu(torch.nn.functional.linear(x, dense, s.bias)) + r)
    xb = x.bfloat16()  # bf16: the dense weight in bf16, the fp32 bias in the epilogue
    with torch.no_grad():
        outb = s(xb)
    assert outb.dtype == torch.bfloat16 and s.last_path == "dense_fused"
    assert rel_err(outb, torch.nn.functional.gelu(torch.nn.functional.linear(x, dense, s.bias))) < 1e-2


# ------------------------------------------------------------------------------------------------ no timing here
def test_nothing_is_timed_under_grad_and_decisions_are_used_there(timer):
    lin = _linear()
    f = FusedLinear.from_linear(lin, "gelu")
    x = torch.randn(4, 64, requires_grad=True)
    f(x).sum().backward()  # grad mode, no decision: default path, no timing (the timer would raise)
    assert _paths(f) == {}
    timer.fn = lambda name, rows: {"aten": 1.0, "fused": 2.0}[name]
    with torch.no_grad():
        f(x)
    assert _paths(f) == {3: "aten"}
    timer.fn = None
    x.grad = None
    f.weight.grad = None
    f(x).sum().backward()  # uses the decision; differentiable
    x2 = x.detach().clone().requires_grad_()
    lin.zero_grad()
    torch.nn.functional.gelu(torch.nn.functional.linear(x2, lin.weight, lin.bias)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(f.weight.grad, lin.weight.grad)


def test_trainable_sparse24_takes_the_fixed_rule_not_an_inference_decision(timer):
    """A decision measured on inference calls (here "dense_fused" for the layer's shape and bucket, made by another
    module of that shape) is not used by a call that trains the values: it takes the fixed rule's path (the sparse op
    with its one-call backward below 256 rows), and its gradients are those of the dense layer on the masked weight."""
    timer.fn = lambda name, rows: {"sparse": 3.0, "dense": 2.0, "dense_fused": 1.0}[name]
    lin = _linear(64, 32)
    inference = Sparse24Linear.from_linear(lin, activation="gelu")
    x = torch.randn(4, 64)
    with torch.no_grad():
        inference(x)
    assert inference.last_path == "dense_fused"
    timer.fn = None  # nothing is timed from here on
    trainable = Sparse24Linear.from_linear(lin, activation="gelu", trainable=True)
    xg = x.clone().requires_grad_()
    assert trainable.path_for(xg) == "sparse"
    out = trainable(xg)
    assert trainable.last_path == "sparse"
    out.sum().backward()
    dense = trainable.dense_weight().detach().requires_grad_()
    x2 = x.clone().requires_grad_()
    torch.nn.functional.gelu(torch.nn.functional.linear(x2, dense, trainable.bias.detach())).sum().backward()
    torch.testing.assert_close(xg.grad, x2.grad)
    keep = dense.detach() != 0
    torch.testing.assert_close(trainable.values.grad.reshape(-1), dense.grad[keep])
    with torch.no_grad():  # inference calls of the trainable layer still use the decision
        trainable(x)
    assert trainable.last_path == "dense_fused"


def test_no_timing_under_autocast_or_inside_torch_compile(timer):
    f = FusedLinear.from_linear(_linear(), "gelu")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        f(torch.randn(4, 64))
    assert not timer.timed
    q = Int8Linear.from_linear(_linear(), mode="weight_only")
    s = Sparse24Linear.from_linear(_linear())
    for mod in (f, q, s):
        torch._dynamo.reset()
        compiled = torch.compile(mod, fullgraph=True)
        x = torch.randn(6, 64)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), mod._run_path(mod._choice_default(x), x), rtol=1e-5, atol=1e-5)
    assert not timer.timed


def test_compiled_layer_uses_a_decision_made_before_tracing(timer):
    timer.fn = lambda name, rows: {"kernel": 2.0, "dequant": 1.0}[name]
    q = Int8Linear.from_linear(_linear(), mode="weight_only")
    x = torch.randn(6, 64)
    with torch.no_grad():
        eager = q(x)
    timer.fn = None
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager)
    xg = x.clone().requires_grad_()
    compiled(xg).sum().backward()  # the dequant path under autograd, compiled
    assert xg.grad is not None and torch.isfinite(xg.grad).all()


# ------------------------------------------------------------------------------------------------ off / cached modes
def test_off_mode_and_per_layer_switch_run_the_default_path(timer):
    f = FusedLinear.from_linear(_linear(), "gelu")
    prev = runtime_choice.set_choice_mode("off")
    try:
        with torch.no_grad():
            f(torch.randn(4, 64))  # the timer would raise
        assert _paths(f) == {3: "fused"}
    finally:
        runtime_choice.set_choice_mode(prev)
    assert _paths(f) == {}  # a mode change forgets the local decisions
    g = FusedLinear.from_linear(_linear(), "gelu")
    g.runtime_choice = False
    with torch.no_grad():
        g(torch.randn(4, 64))
    assert _paths(g) == {3: "fused"} and not timer.timed
    with pytest.raises(ValueError, match="mode must be one of"):
        runtime_choice.set_choice_mode("fast")


def test_env_var_sets_the_mode_in_a_fresh_process():
    code = "import fastdl; print(fastdl.runtime_choice.choice_mode())"
    for value, expected in (("off", "off"), ("cached", "cached"), ("measure", "measure"), ("fastest", "measure")):
        env = dict(os.environ, FASTDL_CHOICE=value)
        out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == expected
        assert ("is not one of" in out.stderr) == (value == "fastest")


def test_convert_runtime_choice_false_pins_every_layer(timer):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    fastdl.convert(model, "int8", runtime_choice=False)
    with torch.no_grad():
        model(torch.randn(4, 64))
    assert not timer.timed and model[0].runtime_choice is False


# ------------------------------------------------------------------------------------------------ save / load
def test_save_load_round_trip_and_cached_mode(timer, tmp_path):
    timer.fn = lambda name, rows: {"aten": 1.0 if rows < 8 else 3.0, "fused": 2.0}[name]
    f = FusedLinear.from_linear(_linear(), "silu")
    with torch.no_grad():
        f(torch.randn(2, 64))
        f(torch.randn(100, 64))
    path = tmp_path / "decisions.json"
    assert fastdl.save_decisions(path) == 2
    doc = json.loads(path.read_text())
    assert doc["format"] == "fastdl.decisions" and doc["version"] == 1
    assert {(e["bucket"], e["path"]) for e in doc["decisions"]} == {(2, "aten"), (7, "fused")}
    saved = fastdl.runtime_choice.decisions()
    runtime_choice.clear_decisions()
    assert fastdl.runtime_choice.decisions() == []
    assert fastdl.load_decisions(path) == 2
    loaded = fastdl.runtime_choice.decisions()
    assert [{**e, "source": None} for e in loaded] == [{**e, "source": None} for e in saved]
    assert all(e["source"] == "loaded" for e in loaded)
    timer.fn = None  # nothing may be timed now: a new layer of the same shape uses the loaded decisions
    g = FusedLinear.from_linear(_linear(seed=3), "silu")
    with torch.no_grad():
        g(torch.randn(3, 64))
        g(torch.randn(120, 64))
    assert _paths(g) == {2: "aten", 7: "fused"}
    prev = runtime_choice.set_choice_mode("cached")  # cached: a new bucket runs the default path, untimed, undecided
    try:
        with torch.no_grad():
            g(torch.randn(20, 64))
            g(torch.randn(3, 64))
        assert _paths(g) == {2: "aten"}
    finally:
        runtime_choice.set_choice_mode(prev)


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="not a fastdl decisions file"):
        fastdl.load_decisions(p)
    p.write_text("not json")
    with pytest.raises(ValueError, match="not JSON"):
        fastdl.load_decisions(p)
    p.write_text('{"format": "fastdl.decisions", "version": 99, "decisions": []}')
    with pytest.raises(ValueError, match="version 99"):
        fastdl.load_decisions(p)


def test_cache_directory_is_written_and_read(timer, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDL_DECISIONS_DIR", str(tmp_path / "cache"))
    timer.fn = lambda name, rows: {"kernel": 2.0, "dequant": 1.0}[name]
    q = Int8Linear.from_linear(_linear(), mode="dynamic")
    with torch.no_grad():
        q(torch.randn(4, 64))
    f = tmp_path / "cache" / runtime_choice.FILE_NAME
    assert f.is_file() and json.loads(f.read_text())["decisions"][0]["path"] == "dequant"
    runtime_choice.clear_decisions()
    monkeypatch.setattr(runtime_choice._STATE, "dir_loaded", False)  # as in a new process
    timer.fn = None
    q2 = Int8Linear.from_linear(_linear(seed=2), mode="dynamic")
    with torch.no_grad():
        q2(torch.randn(5, 64))
    assert _paths(q2) == {3: "dequant"}


def test_deepcopy_and_device_moves_keep_modules_consistent(timer):
    import copy

    timer.fn = lambda name, rows: {"aten": 1.0, "fused": 2.0}[name]
    f = FusedLinear.from_linear(_linear(), "gelu")
    with torch.no_grad():
        f(torch.randn(4, 64))
    g = copy.deepcopy(f)
    assert _paths(g) == {3: "aten"}
    prev = runtime_choice.set_choice_mode("off")  # the copy is registered too: it forgets its decisions with the others
    runtime_choice.set_choice_mode(prev)
    assert _paths(g) == {}
    f.double()
    assert _paths(f) == {}


# ------------------------------------------------------------------------------------------ convert over a workload
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 32))


def test_convert_auto_over_a_workload_picks_per_layer_consistently(timer):
    """Forced timings (seconds; the original layer takes 1.0 everywhere), small = 16 rows, large = 128 rows:
    layer 0 (64->128, gelu): the fused op is 2x faster at both sizes.
    layer 2 (128->64): int8 2x faster at small M but 1.5x slower at large M with both its paths -> never picked;
    int8_weight_only: its kernel (0.8) at small M, the dequantized GEMM (0.7) at large M -> picked; fused 1.0.
    layer 3 (64->32): every candidate 1.2 -> the original stays."""
    tables = {
        "0": lambda kind, path, small: 0.5 if (kind, path) == ("fused", "fused") else 2.0,
        "2": lambda kind, path, small: {
            "fused": 1.0, "int8": 0.5 if small else 1.5,
            "int8_weight_only": (0.8 if path == "kernel" else 1.2) if small else (0.8 if path == "kernel" else 0.7),
        }[kind],
        "3": lambda kind, path, small: 1.2,
    }

    def fake(calls, device, info):
        assert info["purpose"] == "convert", info  # the converted layers use what convert decided: no timing later
        for c in calls.values():
            c()
        out = {}
        for name in calls:
            kind, _, path = name.partition("/")
            out[name] = 1.0 if name.startswith("original") else tables[info["layer"]](kind, path, info["rows"] < 64)
        return out

    runtime_choice.set_timer(fake)
    model = _mlp()
    ref_model = _mlp()
    workload = [torch.randn(b, 16, 64) for b in (1, 8)]  # 16 and 128 rows
    fastdl.convert(model, "auto", workload=workload, candidates=("fused", "int8", "int8_weight_only"), max_error=0.05)
    assert isinstance(model[0], FusedLinear) and model[0].activation == "gelu"
    assert isinstance(model[1], nn.Identity)
    assert isinstance(model[2], Int8Linear) and model[2].mode == "weight_only"
    assert type(model[3]) is nn.Linear
    rep = fastdl.report(model)
    by = {r["layer"]: r for r in rep}
    assert [b["rows"] for b in by["2"]["buckets"]] == [16, 128]
    assert [b["path"] for b in by["2"]["buckets"]] == ["kernel", "dequant"]
    assert _paths(model[2]) == {5: "kernel", 8: "dequant"}  # what the layer runs: convert's decisions
    assert _paths(model[0]) == {5: "fused", 8: "fused"}
    assert by["2"]["speedup"] == pytest.approx((1 / 0.8 * 1 / 0.7) ** 0.5)
    assert by["0"]["speedup"] == pytest.approx(2.0) and by["3"]["kernel"] == "original"
    assert "slower at M 128-255" in by["2"]["candidates"]["int8"]["rejected"]
    text = str(rep)
    assert "M 16-31" in text and "M 128-255" in text and "dequant" in text
    with torch.no_grad():
        for x in workload:  # runs with the decisions made by convert: the fake timer would fail on new timing
            assert rel_err(model(x), ref_model(x)) < 0.05
    # a single example still works (one bucket)
    one = fastdl.convert(_mlp(), "auto", example_inputs=workload[0], candidates=("fused",))
    assert isinstance(one[0], FusedLinear) and len(fastdl.report(one)[0]["buckets"]) == 1


def test_convert_auto_never_slower_by_more_than_noise(timer):
    # fused 2x faster at 16 rows, 5 % slower at 128 rows with both paths: over the 3 % noise -> rejected
    timer.fn = lambda name, rows: 1.0 if name.startswith("original") else (0.5 if rows < 64 else 1.05)
    model = _mlp()
    fastdl.convert(model, "auto", workload=[torch.randn(1, 16, 64), torch.randn(8, 16, 64)], candidates=("fused",))
    assert all(type(m) is nn.Linear for m in (model[0], model[2], model[3]))
    model = _mlp()
    fastdl.convert(model, "auto", workload=[torch.randn(1, 16, 64), torch.randn(8, 16, 64)], candidates=("fused",),
                   noise=0.1)
    assert isinstance(model[0], FusedLinear)
    # the noise measured at a bucket (the original timed twice: 1.0 and 1.04) widens the tolerance there
    import importlib

    importlib.import_module("fastdl.convert")._DECISIONS.clear()
    runtime_choice.clear_decisions()
    timer.fn = lambda name, rows: {"original": 1.0, "original#2": 1.04}.get(name, 0.5 if rows < 64 else 1.07)
    model = _mlp()
    fastdl.convert(model, "auto", workload=[torch.randn(1, 16, 64), torch.randn(8, 16, 64)], candidates=("fused",))
    assert isinstance(model[0], FusedLinear)
    assert fastdl.report(model)[0]["buckets"][1]["noise"] == pytest.approx(0.04)


def test_batch_sizes_make_the_workload():
    from fastdl.convert import make_workload

    x = torch.randn(4, 10, 8)
    mask = torch.ones(4, 10)
    wl = make_workload({"x": x, "mask": mask, "scale": 2.0}, None, (1, 8))
    assert [tuple(e["x"].shape) for e in wl] == [(1, 10, 8), (8, 10, 8)]
    assert [tuple(e["mask"].shape) for e in wl] == [(1, 10), (8, 10)] and wl[0]["scale"] == 2.0
    torch.testing.assert_close(wl[1]["x"][4:], x)
    with pytest.raises(ValueError, match="batch_sizes"):
        make_workload(x, None, (0,))
    with pytest.raises(ValueError, match="not both"):
        make_workload(x, [x], None)
    with pytest.raises(ValueError, match="empty"):
        make_workload(None, [], None)
    with pytest.raises(TypeError, match="list of examples"):
        make_workload(None, x, None)


def test_fixed_policy_with_a_workload_decides_now_and_reports_buckets(timer):
    timer.fn = lambda name, rows: {"kernel": 1.0 if rows < 64 else 2.0, "dequant": 1.5}[name]
    model = _mlp()
    fastdl.convert(model, "int8_weight_only", example_inputs=torch.randn(2, 16, 64), batch_sizes=[1, 8])
    assert _paths(model[0]) == {5: "kernel", 8: "dequant"}
    text = str(fastdl.report(model))
    assert "M 16-31" in text and "kernel 1e+03" in text and "dequant" in text


def _counted_calls(clock, counts: dict, **costs):
    """{name: a call that counts its runs in counts[name] and takes costs[name] seconds on the virtual clock: a number,
    or a list (one cost per call, the last one repeated)}."""

    def call(name, cost):
        seq = list(cost) if isinstance(cost, (list, tuple)) else [cost]

        def f():
            clock.spend(seq[min(counts[name], len(seq) - 1)])
            counts[name] += 1

        return f

    return {name: call(name, cost) for name, cost in costs.items()}


def test_timer_keeps_each_paths_fastest_call_and_stops_once_two_calls_agree(virtual_clock):
    clock = virtual_clock(runtime_choice)
    counts = {"fast": 0, "slow": 0}
    # the warm-up, then fast's first timed call is hit by interference (3 ms instead of 1 ms)
    calls = _counted_calls(clock, counts, fast=[0.001, 0.003, 0.001], slow=0.004)
    times, settled = runtime_choice._time_calls(calls, torch.device("cpu"), None)
    assert settled and times == pytest.approx({"fast": 0.001, "slow": 0.004})  # the minimum, not the first or median
    # one warm-up, then MIN_REPS rounds: BUDGET_S per path is spent by then and two calls of each path agree
    assert counts == {"fast": 1 + runtime_choice.MIN_REPS, "slow": 1 + runtime_choice.MIN_REPS}


def test_timer_stops_after_the_round_that_spends_its_max_budget_when_calls_never_agree(virtual_clock):
    clock = virtual_clock(runtime_choice)
    counts = {"a": 0, "b": 0}
    growth = 1.1  # each call 10 % slower than the one before: no two calls of a path agree within SETTLED (3 %)
    cost = {"a": 0.001, "b": 0.0015}
    calls = _counted_calls(clock, counts, **{n: [c * growth**i for i in range(40)] for n, c in cost.items()})
    times, settled = runtime_choice._time_calls(calls, torch.device("cpu"), None)
    assert not settled and times == pytest.approx({n: c * growth for n, c in cost.items()})  # the first timed call
    rounds = spent = 0.0
    while True:  # the rule: after MIN_REPS rounds, stop at the first round that ends past MAX_BUDGET_S per path
        rounds += 1
        spent += sum(c * growth**rounds for c in cost.values())
        if rounds >= runtime_choice.MIN_REPS and spent >= 2 * runtime_choice.MAX_BUDGET_S:
            break
        if rounds == runtime_choice.MAX_REPS:
            break
    assert counts == {"a": 1 + rounds, "b": 1 + rounds} and runtime_choice.MIN_REPS < rounds < runtime_choice.MAX_REPS
    # the bound: the timed rounds overshoot 2 x MAX_BUDGET_S by less than one round
    last_round = sum(c * growth**rounds for c in cost.values())
    assert 2 * runtime_choice.MAX_BUDGET_S <= spent < 2 * runtime_choice.MAX_BUDGET_S + last_round


def test_an_unsettled_timing_is_provisional_and_timed_again_at_most_retries_times(timer, monkeypatch):
    # each timing stopped before two calls of each path agreed: the decision is provisional, the next no-grad calls
    # at the bucket time again (each path keeps its fastest time over the timings), RETRIES more times at most
    results = iter([{"fused": 3e-3, "aten": 5e-3}, {"fused": 3e-3, "aten": 1e-3}, {"fused": 3e-3, "aten": 4e-3}])
    timings = []

    def unsettled(calls, device, info, *a, **k):
        timings.append(info["rows"])
        return next(results), False

    monkeypatch.setattr(runtime_choice, "_time_calls", unsettled)
    f = FusedLinear.from_linear(_linear(), "gelu")
    x = torch.randn(5, 64)
    with torch.no_grad():
        ref = f(x)
        [d] = runtime_choice.decisions()
        assert (d["path"], d["source"]) == ("fused", "provisional")
        with torch.enable_grad():
            f(x)  # a call that may not time uses the provisional decision and does not time
        assert len(timings) == 1
        f(x)
        [d] = runtime_choice.decisions()
        assert (d["path"], d["source"], d["times_ms"]) == ("aten", "provisional", {"fused": 3.0, "aten": 1.0})
        out = f(x)
        [d] = runtime_choice.decisions()
        assert (d["path"], d["source"]) == ("aten", "measured")  # the last retry decides for good
        f(x)
        f(torch.randn(7, 64))
    assert timings == [5, 5, 5] and len(timings) == 1 + runtime_choice.RETRIES
    torch.testing.assert_close(out, ref)


class _TimedLayer(runtime_choice.RuntimeChoice, nn.Module):
    """Two paths whose calls take ``seconds[path]`` on the virtual clock (a number, or one per call, the last one
    repeated), counting their calls."""

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock, self.seconds = clock, seconds
        self.calls = {p: 0 for p in seconds}
        self._init_choice()

    def _choice_layer(self):
        return ("TimedLayer", id(self))

    def _choice_paths(self, x):
        return tuple(self.seconds)

    def _run_path(self, path, x):
        cost = self.seconds[path]
        seq = list(cost) if isinstance(cost, (list, tuple)) else [cost]
        self.clock.spend(seq[min(self.calls[path], len(seq) - 1)])
        self.calls[path] += 1
        return x + 0

    def forward(self, x):
        key = self._choice_key(x)
        return self._run_path(self._choice_local.get(key) or self._choose(x, key), x)


@pytest.mark.parametrize("seconds, chosen, times_ms", [
    ({"a": 0.012, "b": [0.030, 0.006]}, "b", {"a": 12.0, "b": 6.0}),  # b's warm-up builds a cache: its timed call wins
    ({"a": [0.006, 0.040], "b": 0.012}, "a", {"a": 6.0, "b": 12.0}),  # a's timed call is hit by interference
])  # fmt: skip
def test_long_calls_are_timed_twice_per_path_and_the_decision_is_final(seconds, chosen, times_ms, virtual_clock):
    # calls of LONG_CALL_S or more (e.g. 45+ ms at M >= 128, K = N = 4096): the warm-up and one timed call of each path
    # (the faster of the two is the path's time), a final decision (never provisional, so no re-timing on the next
    # calls), and never the path measured slower
    clock = virtual_clock(runtime_choice)
    prev_timer, prev_mode = runtime_choice.set_timer(None), runtime_choice.set_choice_mode("measure")
    runtime_choice.clear_decisions()
    try:
        layer = _TimedLayer(clock, seconds)
        x = torch.randn(256, 8)
        with torch.no_grad():
            layer(x)
            assert layer.calls[chosen] == 3 and sum(layer.calls.values()) == 5  # 2 timing calls each, then its own
            [d] = runtime_choice.decisions()
            assert d["path"] == chosen and d["source"] == "measured"
            assert d["times_ms"] == pytest.approx(times_ms)
            for _ in range(3):
                layer(x)  # settled: only the chosen path runs
            assert layer.calls[chosen] == 6 and sum(layer.calls.values()) == 8
    finally:
        runtime_choice.set_timer(prev_timer)
        runtime_choice.set_choice_mode(prev_mode)
        runtime_choice.clear_decisions()


def test_time_calls_long_call_bound_counts_calls(virtual_clock):
    clock = virtual_clock(runtime_choice)
    counts = {"fast": 0, "slow": 0}
    calls = _counted_calls(clock, counts, fast=0.0055, slow=0.011)
    times = runtime_choice.time_calls(calls, torch.device("cpu"), long_call_s=runtime_choice.LONG_CALL_S)
    assert counts == {"fast": 2, "slow": 2} and times == pytest.approx({"fast": 0.0055, "slow": 0.011})
    counts.update(fast=0, slow=0)
    runtime_choice.time_calls(calls, torch.device("cpu"))  # no bound given (fastdl.convert): MIN_REPS rounds at least
    assert counts == {"fast": 1 + runtime_choice.MIN_REPS, "slow": 1 + runtime_choice.MIN_REPS}
