"""The benchmark tooling: --isa subprocess environment, argument parsing, slow-call timing, the loud reporting of a
fastdl row slower than PyTorch (tables, bench all summary, demo verdict, main-job summary)."""

import os
import re
import subprocess
import sys

import pytest
import torch

from fastdl import cli, demo
from fastdl.bench import all as bench_all
from fastdl.bench import common, isa, report


def test_isa_argument_on_every_benchmark_and_demo():
    parser = cli.build_parser()
    for name in ("fused_linear", "int8", "int4", "sparse24", "overhead", "model", "loader", "all"):
        args = parser.parse_args(["bench", name, "--isa", "avx2"])
        assert args.isa == "avx2"
    assert parser.parse_args(["demo", "--isa", "native"]).isa == "native"
    assert parser.parse_args(["bench", "overhead"]).isa is None
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "int8", "--isa", "avx9"])


def test_child_env_caps_fastdl_and_every_pytorch_library():
    base = {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "FASTDL_CPU_ISA": "scalar"}
    env = isa.child_env("avx2", base)
    assert env["PATH"] == "/bin"
    assert env["FASTDL_CPU_ISA"] == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env["FBGEMM_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env[isa.CHILD_MARK] == "avx2"
    native = isa.child_env("native", base)  # native: every cap the parent had is removed
    assert not any(k in native for k in isa.CAP_VARS)
    assert set(isa.CAPS["avx512"]) == set(isa.CAP_VARS) == set(isa.CAPS["avx512_bf16"])


def test_isa_above_the_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(isa, "detected_level", lambda: "avx2")
    with pytest.raises(ValueError, match="can only lower it"):
        isa.check_level("avx512_bf16")
    isa.check_level("avx2")
    isa.check_level("native")


def test_cli_isa_reruns_in_a_subprocess(monkeypatch):
    seen = {}

    def fake_call(cmd, env):
        seen["cmd"], seen["env"] = cmd, env
        return 0

    monkeypatch.setattr(isa, "detected_level", lambda: "avx512_bf16")
    monkeypatch.setattr(subprocess, "call", fake_call)
    monkeypatch.delenv(isa.CHILD_MARK, raising=False)
    argv = ["bench", "overhead", "--isa", "avx2", "--budget", "0.1"]
    assert cli.main(argv) == 0
    assert seen["cmd"][:3] == [sys.executable, "-m", "fastdl.cli"] and seen["cmd"][3:] == argv
    assert seen["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and seen["env"][isa.CHILD_MARK] == "avx2"


def test_capped_subprocess_really_caps_pytorch():
    """The child of --isa avx2 reports fastdl at avx2 and ATen at AVX2, oneDNN without bf16 (PyTorch's bf16 matmul
    then takes the path of an AVX2-only CPU)."""
    if isa.detected_level() == "scalar":
        pytest.skip("this CPU has no AVX2: a cap cannot add it")
    env = isa.child_env("avx2")
    code = ("from fastdl.bench.isa import run_context, describe; import json; c = run_context(); "
            "print(json.dumps({'level': c['isa_level'], 'pt': c['pytorch'], 'warn': c['warnings']})); "
            "print(describe(c))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    d = json.loads(out.stdout.splitlines()[0])
    assert d["level"] == "avx2"
    assert d["pt"]["aten"] == "AVX2"
    assert d["pt"]["onednn_bf16"] in (False, None)
    assert d["warn"] == []
    assert "ISA level avx2" in out.stdout


def test_mismatched_caps_are_warned(monkeypatch):
    monkeypatch.setattr("fastdl._extension.cpu_info", lambda: {
        "model": "X", "level": "avx2", "detected_level": "avx512_bf16", "capped": True, "kernels": {}})
    monkeypatch.setattr(isa, "pytorch_levels", lambda: {
        "aten": "AVX512", "onednn_bf16": True, "onednn_max_isa": "native", "mkl_cap": "native", "fbgemm_cap": "native"})
    ctx = isa.run_context()
    assert any("ATen runs at AVX512" in w for w in ctx["warnings"])
    assert any("oneDNN" in w for w in ctx["warnings"])


@pytest.mark.parametrize("level,warned", [("avx512_bf16", True), ("avx2", False)])
def test_pytorch_capped_below_fastdl_is_warned(monkeypatch, level, warned):
    """PyTorch capped to AVX2 while fastdl runs uncapped: a warning on an AVX-512 CPU (the ratios mix two levels),
    none on an AVX2-only CPU, where --isa avx2 caps nothing for either."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setattr("fastdl._extension.cpu_info", lambda: {
        "model": "X", "level": level, "detected_level": level, "capped": False, "kernels": {}})
    monkeypatch.setattr(isa, "pytorch_levels", lambda: {
        "aten": "AVX2", "onednn_bf16": False, "onednn_max_isa": "AVX2", "mkl_cap": "AVX2", "fbgemm_cap": "AVX2"})
    warnings = isa.run_context()["warnings"]
    assert any("but fastdl is not" in w for w in warnings) == warned, warnings


def test_slow_call_is_timed_fewer_times_and_marked(virtual_clock):
    clock = virtual_clock(common)  # calls take the time they say, on a clock only they advance
    calls = []

    def slow():
        calls.append(1)
        clock.spend(0.03)

    def fast():
        clock.spend(0.001)

    t = common.time_fn(slow, slow_call_s=0.01, min_reps=10, budget_s=5)
    # the probe (30 ms > 10 ms) makes it a slow baseline: 2 more calls (1 beyond 4 x slow_call_s), no warm-up
    assert t.reduced and t.reps == 2 and len(calls) == 3 and t == pytest.approx(0.03)
    calls.clear()
    t = common.time_fn(slow, slow_call_s=0.005, min_reps=10, budget_s=5)
    assert t.reduced and t.reps == 1 and len(calls) == 2
    t = common.time_fn(lambda: clock.spend(2 * common.VERY_SLOW_CALL_S), min_reps=10)
    assert t.reduced and t.reps == 1  # past VERY_SLOW_CALL_S the probe is the measurement
    t = common.time_fn(fast, min_reps=10, budget_s=0.01)
    assert not t.reduced and t.reps == 10 and t == pytest.approx(0.001)  # min_reps calls fill the 10 ms budget
    out = common.interleaved({"slow": slow, "fast": fast}, budget_s=0.02, min_reps=5, slow_call_s=0.01)
    assert out["slow"].reduced and out["slow"].reps == 2 and not out["fast"].reduced
    assert out["fast"].reps == 20 and out["fast"] == pytest.approx(0.001)  # min_reps rounds, then the 20 ms budget


def test_interleaved_rounds_rotate_so_no_function_always_follows_the_same_one():
    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    common.interleaved(fns, budget_s=0, min_reps=6, max_reps=6)
    timed = calls[6:]  # after the probe and the warm-up call of each
    assert len(timed) == 18
    rounds = [timed[i : i + 3] for i in range(0, 18, 3)]
    for pos in range(3):  # every function takes every place in a round equally often
        assert sorted(r[pos] for r in rounds) == ["a", "a", "b", "b", "c", "c"]
    follows = set(zip(timed, timed[1:]))
    assert follows >= {(x, y) for x in "abc" for y in "abc" if x != y}  # each is preceded by each other one


def test_call_predictor_skips_only_a_predicted_slow_call():
    p = common.CallPredictor(max_call_s=2.0)
    assert p.allowed("eager", 16) == (True, None)  # nothing seen yet
    p.record("eager", 1, 0.5)
    assert p.allowed("eager", 16) == (True, None)  # 16x from M = 1: no prediction (weight-read bound there)
    p.record("eager", 16, 0.5)
    ok, pred = p.allowed("eager", 128)
    assert not ok and abs(pred - 4.0) < 1e-9
    assert p.allowed("eager", 32)[0]
    assert p.allowed("fastdl", 128) == (True, None)


def test_slower_row_is_loud_and_listed_at_the_end(capsys, monkeypatch):
    monkeypatch.setitem(common._CTX, "ctx", {"cpu_model": "Test CPU", "isa_level": "avx2", "isa_capped": True,
                                             "detected_level": "avx512_bf16", "kernels": {}, "pytorch": {},
                                             "warnings": []})  # fmt: skip
    table = common.LiveTable([("provider", "provider"), ("M", "M"), ("ms", "ms"), ("x_eager", "x eager")])
    fast = {"op": "fused_linear", "provider": "fastdl", "M": 16, "ms": 1.0, "x_eager": 1.5}
    slow = {"op": "fused_linear", "provider": "fastdl", "M": 128, "ms": 2.0, "x_eager": 0.8}
    assert common.mark_slower(fast, {"eager bf16": 1.5}) == ""
    assert "0.80x eager bf16" in common.mark_slower(slow, {"eager bf16": 0.8, "eager fp32": 1.2})
    table.add(fast)
    table.add(slow)
    slower = table.close("fastdl", "PyTorch")
    out = capsys.readouterr().out
    assert slower == [slow]
    row_lines = [line for line in out.splitlines() if "<<< SLOWER" in line]
    assert len(row_lines) == 1 and " 128 " in row_lines[0]
    assert "SLOWER than PyTorch in 1 of 2" in out and "M=128" in out
    assert "at least as fast" not in out


def test_bench_all_summary_keeps_slower_rows():
    rows = {
        "fused_linear": [
            {"provider": "eager", "M": 1, "K": 8, "N": 8, "x_eager": 1.0},  # a baseline: not judged
            {"provider": "fastdl", "mode": "fwd", "M": 1, "K": 8, "N": 8, "x_eager": 0.7, "x_best": 0.5,
             "slower": "0.70x eager bf16", "slower_than_pytorch": True},
            {"provider": "fastdl", "mode": "fwd", "M": 16, "K": 8, "N": 8, "x_eager": 2.0, "x_best": 1.5,
             "slower": "", "slower_than_pytorch": False},
        ],
        "loader": [{"loader": "fastdl", "kind": "torch", "speedup_vs_dl0": 0.9}, {"loader": "dl0"}],
    }
    summ = bench_all.summarize(rows)
    assert len(summ) == 3
    assert [s["slower"] != "" for s in summ] == [True, False, True]
    assert summ[0]["x_replaced"] == 0.7 and summ[0]["shape"] == "1x8x8"


def _fake_demo_results(int8_ms: float) -> dict:
    acc = {"acc": 97.0}
    return {
        "dense_fastdl": {"acc": 97.0, "step_ms": 1.0},
        "dense_pytorch_bf16": {"acc": 97.0, "step_ms": 2.0},
        "dense_pytorch_fp32": {"acc": 97.1, "step_ms": 1.5},
        "sparse_fastdl": {"acc": 96.8, "step_ms": 1.0, "masks_identical_on_all_ranks": True,
                          "acc_right_after_pruning": 90.0},
        "infer_fused": {"fastdl": {**acc, "ms": 0.1}, "pytorch_fp32": {**acc, "ms": 0.2},
                        "pytorch_bf16": {**acc, "ms": 0.5}},
        "infer_int8": {"fastdl": {**acc, "ms": int8_ms}, "pytorch_fp32": {**acc, "ms": 0.2},
                       "pytorch_bf16": {**acc, "ms": 0.5}, "pytorch_int8": {"acc": 96.9, "ms": 0.15}},
        "infer_sparse24": {"fastdl": {**acc, "ms": 0.1}, "pytorch_fp32": {**acc, "ms": 0.2},
                           "pytorch_bf16": {**acc, "ms": 0.3}},
    }  # fmt: skip


def test_demo_verdict_never_calls_a_slower_stage_met():
    cpu = {"model": "Test CPU", "level": "avx2", "capped": True}
    r = _fake_demo_results(int8_ms=0.3)  # slower than PyTorch's int8 (0.15) and fp32 (0.2)
    assert demo.check_bars(r) == []  # the accuracy bars alone hold...
    st = {s["key"]: s for s in demo.stages(r)}
    assert st["infer_int8"]["slower"] and st["infer_int8"]["best"] == "pytorch_int8"
    assert abs(st["infer_int8"]["ratio"] - 0.5) < 1e-9
    assert not st["train"]["slower"] and st["train"]["best"] == "pytorch_fp32"
    lines = demo.verdict(r, cpu)
    int8_line = next(line for line in lines if line.strip().startswith("inference int8"))
    assert "SLOWER" in int8_line and "AVX2" in int8_line.upper() and "VNNI" in int8_line
    assert "SLOWER" in lines[-1] and "inference int8 W8A8" in lines[-1]
    assert "all met" not in lines[-1]
    table = demo.format_table(r)
    assert "<<< fastdl SLOWER" in table and "PyTorch int8" in table
    ok = demo.verdict(_fake_demo_results(int8_ms=0.1), cpu)
    assert "at least as fast" in ok[-1] and "SLOWER" not in "".join(ok)


def test_demo_does_not_count_a_pytorch_option_with_broken_accuracy():
    r = _fake_demo_results(int8_ms=0.18)  # slower than PyTorch int8 (0.15), faster than fp32 (0.2)
    r["infer_int8"]["pytorch_int8"]["acc"] = 13.4  # per-tensor activation scale wrecked by an outlier
    st = {s["key"]: s for s in demo.stages(r)}["infer_int8"]
    assert st["unusable"] == ["pytorch_int8"] and st["best"] == "pytorch_fp32" and not st["slower"]
    assert "not counted" in demo.format_table(r)
    assert any("not counted" in line for line in demo.verdict(r, {"level": "avx2"}))


def test_main_job_summary_last_line_says_slower():
    r = _fake_demo_results(int8_ms=0.3)
    r["stages"] = demo.stages(r)
    r["missed"] = []
    r["cpu"] = {"model": "Test CPU", "level": "avx2", "detected_level": "avx512_bf16", "capped": True,
                "kernels": {"fused_linear": "avx2", "int8": "avx2", "sparse24": "avx2"}}
    bench = {"context": {"cpu_model": "Test CPU", "isa_level": "avx2", "detected_level": "avx512_bf16",
                         "isa_capped": True, "kernels": r["cpu"]["kernels"], "pytorch": {"aten": "AVX2"}},
             "quick": True, "seconds": 100, "summary": [
                 {"bench": "int8", "mode": "", "what": "fastdl_w8a8", "shape": "16x4096x4096", "M": 16,
                  "x_replaced": 1.2, "x_best": 1.2, "slower": ""}]}  # fmt: skip
    lines = report.summary_lines(r, bench, elapsed=300)
    text = "\n".join(lines)
    assert "Test CPU" in text and "avx2" in text and "CAPPED" in text and "int8: avx2" in text
    assert lines[-1].startswith("RESULT") and "SLOWER" in lines[-1] and "inference int8" in lines[-1]
    r2 = _fake_demo_results(int8_ms=0.1)
    r2["stages"], r2["missed"], r2["cpu"] = demo.stages(r2), [], r["cpu"]
    assert "at least as fast" in report.summary_lines(r2, bench)[-1]


def test_overhead_bench_runs_and_judges(capsys):
    import argparse

    from fastdl.bench import overhead

    p = argparse.ArgumentParser()
    overhead.add_arguments(p)
    rows = overhead.run(p.parse_args(["--budget", "0.01"]))
    modules = {r["module"] for r in rows}
    assert "FusedLinear" in modules
    fastdl_rows = [r for r in rows if r["provider"] == "fastdl"]
    assert fastdl_rows and all("slower" in r and "bar_met" in r for r in fastdl_rows)
    assert all(r["cpu_model"] and r["isa_level"] and "isa_capped" in r for r in rows)
    out = capsys.readouterr().out
    assert "ISA level" in out


def test_model_bench_builtin_encoder(tmp_path):
    import argparse

    from fastdl.bench import model

    p = argparse.ArgumentParser()
    model.add_arguments(p)
    args = p.parse_args(["--builtin", "--models", "encoder", "--batch", "2", "--seq", "8", "--policies", "fp32",
                         "fused", "int8", "--budget", "0.01", "--csv", str(tmp_path / "model.csv")])  # fmt: skip
    rows = model.run(args)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"fp32", "fused", "int8"}
    assert by["fp32"]["x_fp32"] == 1.0 and by["fused"]["cosine"] > 0.999 and by["int8"]["cosine"] > 0.98
    assert "slower" in by["fused"] and "slower" not in by["fp32"]
    assert os.path.exists(tmp_path / "model.csv")


def test_model_bench_judges_against_the_best_pytorch_policy_so_far():
    from fastdl.bench.model import _judge

    best = ("fp32", 1.0)
    bf16 = {"policy": "bf16_autocast", "x_fp32": 1.6}
    best = _judge(bf16, best)
    assert best == ("bf16_autocast", 1.6) and bf16["x_best"] == 1.0 and "slower" not in bf16
    fused = {"policy": "fused", "x_fp32": 1.2}  # faster than fp32, slower than bf16 autocast
    assert _judge(fused, best) == best
    assert abs(fused["x_best"] - 0.75) < 1e-12 and "best PyTorch (bf16_autocast)" in fused["slower"]
    int8 = {"policy": "int8", "x_fp32": 2.0}
    _judge(int8, best)
    assert int8["slower"] == "" and abs(int8["x_best"] - 1.25) < 1e-12
    compiled = {"policy": "compile", "x_fp32": 0.9}  # a slower PyTorch policy does not become the best
    assert _judge(compiled, best) == best


def _bench_tables():
    """scripts/bench_tables.py as a module (scripts/ is not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_tables.py")
    spec = importlib.util.spec_from_file_location("bench_tables", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_tables_marks_a_row_slower_when_any_comparison_is_beyond_noise():
    # a row's note joins its comparisons with "; ": one within the noise band must not hide another beyond it
    mod = _bench_tables()
    assert not mod._beyond_noise("")
    assert not mod._beyond_noise("0.97x best PyTorch (compile) (within 5%: may be noise)")
    assert mod._beyond_noise("0.90x best PyTorch (compile)")
    assert mod._beyond_noise("0.99x fp32 original (within 5%: may be noise); 0.89x best PyTorch (compile)")


def test_bench_tables_update_refreshes_one_column_by_row_key():
    mod = _bench_tables()
    text = "\n".join([
        "intro",
        "| bench | mode | what | M x K x N | avx512: x repl / x best | avx2 (native Zen 2): x repl / x best |",
        "|---|---|---|---|---|---|",
        "| fused_linear | fwd | fastdl | 1x64x64 | 1.50x / 1.50x | 1.00x / 1.00x |",
        "| int8 | w8a8 | fastdl | 16x64x64 | 1.20x / 1.20x | 0.90x / 0.90x **slower** |",
        "",
        "| not | the | table | row |",
    ])  # fmt: skip
    run = [{"bench": "int8", "mode": "w8a8", "what": "fastdl", "shape": "16x64x64", "x_replaced": 1.04,
            "x_best": 0.8, "slower": "0.80x best PyTorch (x)"},
           {"bench": "loader", "mode": "cpu", "what": "fastdl", "shape": "", "x_replaced": 1.3,
            "x_best": None}]  # fmt: skip
    new, missing = mod.update_column(text, "avx2 (native Zen 2)", run)
    lines = new.split("\n")
    assert lines[3] == "| fused_linear | fwd | fastdl | 1x64x64 | 1.50x / 1.50x | - / - |"  # not in the run
    assert lines[4] == "| int8 | w8a8 | fastdl | 16x64x64 | 1.20x / 1.20x | 1.04x / 0.80x **slower** |"
    assert lines[0] == "intro" and lines[6] == "| not | the | table | row |"  # outside the table: untouched
    assert missing == [("loader", "cpu", "fastdl", "")]
    with pytest.raises(SystemExit):
        mod.update_column(text, "avx9", run)


def test_compile_baseline_is_warmed_up_not_timed_as_its_compile(monkeypatch, capsys, virtual_clock):
    """The first call of a compiled function compiles it (seconds): the fused_linear bench makes that call untimed
    and reports the compile time on its own line, so the compile row is a per-call time (issue 33)."""
    import argparse

    import torch

    from fastdl.bench import fused_linear as bench_fl

    # the bench's clock: time passes only as the calls say (the compile: 0.4 s), 1 us at each reading; the matmul
    # peak (% columns) is given, not measured (its time budget would never run out on this clock)
    clock = virtual_clock(common, bench_fl, tick=1e-6)
    for dtype in (torch.bfloat16, torch.float32):
        monkeypatch.setitem(common._PEAK_CACHE, ("cpu", dtype), 1e11)

    def fake_compile(fn, **_):  # a "compiled" function whose first call takes 0.4 s, like a compile
        state = {"compiled": False}

        def call(*a):
            if not state["compiled"]:
                clock.spend(0.4)
                state["compiled"] = True
            return fn(*a)

        return call

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(common, "SLOW_CALL_S", 0.1)
    monkeypatch.setattr(common, "VERY_SLOW_CALL_S", 0.2)
    bench_fl._COMPILED.clear()
    p = argparse.ArgumentParser()
    bench_fl.add_arguments(p)
    rows = bench_fl.run(p.parse_args(["--m", "1", "--kn", "64", "64", "--modes", "fwd_fp32", "--budget", "0.01"]))
    bench_fl._COMPILED.clear()
    compiled = [r for r in rows if r["provider"] == "compile"]
    assert compiled and compiled[0]["ms"] < 1, compiled  # a call (a few clock readings), not the 400 ms compile
    assert "0.4 s to compile fwd_fp32 M=1 K=64 N=64" in capsys.readouterr().out


def test_dram_read_bandwidth_is_a_positive_finite_rate():
    import math

    bw = common.dram_read_bandwidth(1 << 20, passes=3)  # a small buffer (it measures the cache): the function works
    assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValueError, match="nbytes"):
        common.dram_read_bandwidth(0)
    with pytest.raises(ValueError, match="passes"):
        common.dram_read_bandwidth(1 << 10, passes=0)
    llc = common.llc_bytes()
    assert llc is None or llc >= 1 << 10


def test_int4_bench_copies_exceed_the_cache_within_the_cap():
    from fastdl.bench import int4 as bench_int4

    n = bench_int4.copies_for(100, 1000, 3.0, cap_bytes=1e6)
    assert n * 100 > 3000 and (n - 1) * 100 <= 3000  # just enough copies to exceed 3x the cache
    assert bench_int4.copies_for(600, 1000, 3.0, cap_bytes=1000) == 2  # the cap, but never fewer than 2
    assert bench_int4.copies_for(400, 1000, 3.0, cap_bytes=2000) == 5
    seen = []
    pos = [0]
    a = bench_int4.Rotation(lambda c: seen.append(("a", c)), [(0,), (1,), (2,)], pos)
    b = bench_int4.Rotation(lambda c: seen.append(("b", c)), [(0,), (1,), (2,)], pos)
    for f in (a, a, b, a):
        f()
    assert seen == [("a", 0), ("a", 1), ("b", 2), ("a", 0)]  # rotations over shared copies share the position


def test_int4_bench_providers_compute_the_same_product():
    """Every provider of ``bench int4`` computes x @ W.T of one weight: ATen's int4 op (its packing and its
    scales_and_zeros made by the bench) gives fastdl's dequantized int4 product."""
    import argparse

    from fastdl.bench import int4 as bench_int4
    from fastdl.ops import dequantize_int4

    p = argparse.ArgumentParser()
    bench_int4.add_arguments(p)
    w = bench_int4.Weights(256, 64, p.parse_args([]), 1 << 16, set())
    w.set_x(3, 256)
    x = w.x[torch.float32]
    ref = {g: x @ dequantize_int4(*w.providers[f"fastdl_int4_g{g}"]["rot"].copies[0], g).T for g in (32, 128)}
    ref[None] = x @ w.providers["fp32"]["rot"].copies[0][0].T  # the float weight (int4: ~10 % away from it)
    for name, prov in w.providers.items():
        if prov["rot"] is not None:
            g = int(name.rsplit("_g", 1)[1].split("_")[0]) if "_g" in name else None
            exact = name.startswith("fastdl_int4") and not name.endswith("_bf16")
            tol = 1e-4 if exact else 0.03  # bf16, int8, int8 activations (w4a8)
            out = prov["rot"]().float()
            assert (out - ref[g]).norm() / ref[g].norm() < tol, name
    if bench_int4._aten_available() is None:
        for g in (32, 128):  # ATen's op at each group size the fastdl rows use
            for dt, tol in (("float32", 1e-5), ("bfloat16", 2e-2)):
                out = w.aten[g][dt]().float()
                assert (out - ref[g]).norm() / ref[g].norm() < tol, (g, dt)


def test_int4_bench_runs_on_tiny_shapes(tmp_path):
    """``fastdl bench int4`` on K x N = 256 x 512 with a 1 MiB "cache" and a 1.1 MB cap per provider: every provider
    at both M, bytes per call as the formats say, GB/s and % of the given bandwidth, the ratios, the copies (the fp32
    ones capped below the cache: marked not cold) and issue 29's bars on the int4 rows."""
    import argparse

    from fastdl.bench import int4 as bench_int4

    p = argparse.ArgumentParser()
    bench_int4.add_arguments(p)
    csv_path = tmp_path / "int4.csv"
    rows = bench_int4.run(p.parse_args(["--m", "1", "4", "--kn", "256", "512", "--budget", "0.01", "--min-rounds", "3",
                                        "--llc-mb", "1", "--max-mb", "1.1", "--bandwidth", "20",
                                        "--csv", str(csv_path)]))  # fmt: skip
    K, N, llc = 256, 512, 1 << 20
    expected = {"fp32": 4 * N * K, "bf16": 2 * N * K, "fastdl_int8_wo": N * K + 4 * N}
    for g in (32, 128):
        for sfx in ("", "_bf16"):  # the fastdl int4 rows in both activation dtypes (the default --x-dtype both)
            expected[f"fastdl_int4_g{g}{sfx}"] = expected[f"fastdl_w4a8_g{g}{sfx}"] = N * K // 2 + 2 * N * K // g
    if bench_int4._aten_available() is None:
        expected["aten_int4_g32"] = expected["aten_int4_g128"] = None  # scales_and_zeros in its activation dtype
    by = {(r["M"], r["provider"]): r for r in rows}
    assert set(by) == {(m, name) for m in (1, 4) for name in expected}
    for r in rows:
        M, name = r["M"], r["provider"]
        nbytes = expected[name]
        if name.startswith("aten"):
            assert r["x_dtype"] in ("fp32", "bf16") and ("x float32" in r["note"] or "x bfloat16" in r["note"])
            g = int(name.rsplit("_g", 1)[1])
            nbytes = N * K // 2 + (K // g) * N * 2 * (4 if r["x_dtype"] == "fp32" else 2)
        assert r["bytes_per_call"] == nbytes, name
        assert r["ms"] > 0 and r["dram_gbps"] == 20
        assert r["gbps"] == pytest.approx(nbytes / (r["ms"] / 1e3) / 1e9)
        assert r["pct_dram"] == pytest.approx(5 * r["gbps"])
        assert r["copies"] >= 2 and r["copies"] * nbytes <= 1.1e6 or r["copies"] == 2
        assert r["cold"] == (r["copies"] * nbytes > llc) and ("not cold" in r["note"]) == (not r["cold"])
        assert r["x_replaced"] == pytest.approx(by[(M, "fp32")]["ms"] / r["ms"])
        assert r["x_int8"] == pytest.approx(by[(M, "fastdl_int8_wo")]["ms"] / r["ms"])
        judged = name.startswith(("fastdl_int4", "fastdl_w4a8"))
        assert ("slower" in r) == judged and ("bar" in r) == judged
        if judged:
            assert r["group_size"] == int(name.split("_g")[1].split("_")[0]) and r["bar"] in ("met", "MISSED")
            assert (r["bar"] == "MISSED") == bool(r["bar_missed"])
            # like with like: each row is judged against eager F.linear in its own activation dtype (and ATen int4)
            assert r["x_dtype"] == ("bf16" if name.endswith("_bf16") else "fp32"), name
            assert r["best_pytorch"] in (r["x_dtype"], f"aten_int4_g{r['group_size']}"), (name, r["best_pytorch"])
            aten = by.get((M, f"aten_int4_g{r['group_size']}"))
            if aten is not None:  # x aten: ATen at the row's own group size
                assert r["x_aten"] == pytest.approx(aten["ms"] / r["ms"]), name
    assert not by[(1, "fp32")]["cold"] and by[(1, "fastdl_int8_wo")]["cold"]  # the cap vs the cache, both ways
    assert "pct_dram" in csv_path.read_text().splitlines()[0]


# A LLaMA of the TinyLlama layout (GQA: 4 heads, 2 KV heads; untied lm_head), small enough for a test
TINY_LLAMA = ["hidden_size=64", "intermediate_size=176", "num_hidden_layers=2", "num_attention_heads=4",
              "num_key_value_heads=2", "vocab_size=128"]  # fmt: skip


def _model_args(argv):
    import argparse

    from fastdl.bench import model

    p = argparse.ArgumentParser()
    model.add_arguments(p)
    return p.parse_args(argv)


def _expected_bytes_per_token(policy: str | None) -> int:
    """The bytes a decode step reads, counted here independently of fastdl.bench.decode: Int8Linear's own
    memory_bytes(), every other module's parameters and buffers, one row of the embedding table (policy None: the
    fp32 model as built)."""
    import itertools

    import fastdl
    from fastdl.bench import decode
    from fastdl.nn import Int8Linear

    m = decode.build(decode.llama_config(decode.parse_overrides(TINY_LLAMA)))
    if policy is not None:
        m = fastdl.convert(m, policy)
    total = 0
    for mod in m.modules():
        if isinstance(mod, Int8Linear):
            total += mod.memory_bytes()
        elif isinstance(mod, torch.nn.Embedding):
            total += mod.embedding_dim * mod.weight.element_size()
        else:
            total += sum(t.numel() * t.element_size()
                         for t in itertools.chain(mod.parameters(recurse=False), mod.buffers(recurse=False)))
    return total


def test_tinyllama_decode_bench_end_to_end_on_a_tiny_config(tmp_path, capsys):
    """--decoder tinyllama on a 2-layer hidden-64 LLaMA, in process: every row has its decode rate, bytes per token
    (as counted independently from the converted model's modules), ceiling, % of it and resident memory; --profile
    prints the ops of one decode step."""
    pytest.importorskip("transformers")
    from fastdl.bench import model

    csv_path = tmp_path / "model.csv"
    args = _model_args(["--decoder", "tinyllama", "--llama-config", *TINY_LLAMA, "--new-tokens", "5", "--reps", "2",
                        "--in-process", "--bandwidth", "20", "--policies", "fp32", "int8_weight_only", "sparse24",
                        "--profile", "int8_weight_only", "--csv", str(csv_path)])  # fmt: skip
    rows = model.run(args)
    by = {r["policy"]: r for r in rows}
    assert list(by) == ["fp32", "int8_weight_only", "sparse24"]
    for r in rows:
        assert r["model"] == "tinyllama" and r["layers"] == 2 and r["hidden"] == 64 and r["tokens"] == 5
        assert 0 < r["per_s"] < float("inf") and r["prefill_ms"] > 0
        assert r["ms"] * r["per_s"] == pytest.approx(1e3)
        assert r["ceiling_per_s"] == pytest.approx(20e9 / r["bytes_per_token"])
        # a 0.4 MB model at a 20 GB/s ceiling of ~50000 tok/s: far below it, never above
        assert 0 < r["pct_ceiling"] < 100
        assert r["pct_ceiling"] == pytest.approx(100 * r["per_s"] / r["ceiling_per_s"])
        for k in ("rss_fp32_mb", "rss_converted_mb", "rss_generate_mb", "peak_generate_mb", "peak_build_mb"):
            assert r[k] > 0, k
        assert r["peak_generate_mb"] >= r["rss_generate_mb"] and r["cached_mb"] >= 0
        assert r["same_tokens_each_run"]
        # a fastdl layer on a dense copy streams up to the fp32 bytes, never fewer than it stores
        assert r["mb_per_token"] <= r["mb_per_token_as_run"] + 1e-9
        assert r["mb_per_token_as_run"] <= by["fp32"]["mb_per_token"] + 1e-9
    assert by["fp32"]["mb_per_token_as_run"] == by["fp32"]["mb_per_token"] and by["fp32"]["paths_decode"] == ""
    assert sum(int(n) for n in re.findall(r" (\d+)", by["int8_weight_only"]["paths_decode"])) == 2 * 7 + 1
    assert by["fp32"]["x_fp32"] == 1.0 and "slower" in by["int8_weight_only"] and "slower" not in by["fp32"]
    assert by["int8_weight_only"]["bytes_per_token"] == _expected_bytes_per_token("int8_weight_only")
    assert by["fp32"]["bytes_per_token"] == _expected_bytes_per_token(None)
    # int8: 1 byte a weight + an fp32 scale per output row (of 64 inputs here); 2:4 leaves the lm_head dense
    assert by["int8_weight_only"]["bytes_per_token"] < 0.3 * by["fp32"]["bytes_per_token"]
    assert by["sparse24"]["bytes_per_token"] < 0.7 * by["fp32"]["bytes_per_token"]
    out = capsys.readouterr().out
    assert "profile of one decode step, policy int8_weight_only" in out and "Self CPU time total" in out
    assert "pct_ceiling" in csv_path.read_text().splitlines()[0]


def test_tinyllama_decode_policy_runs_in_its_own_process():
    """Without --in-process each policy is a subprocess (its VmHWM its own): the row comes back through stdout."""
    pytest.importorskip("transformers")
    from fastdl.bench import decode

    row = decode._child({"policy": "int8", "config": decode.parse_overrides(TINY_LLAMA), "prompt": 8,
                         "new_tokens": 3, "reps": 1})  # fmt: skip
    assert row["policy"] == "int8" and row["per_s"] > 0 and row["rss_generate_mb"] > 0
    assert row["bytes_per_token"] == _expected_bytes_per_token("int8")


def test_tinyllama_options_leave_the_default_model_bench_unchanged():
    from fastdl.bench import decode, model

    args = _model_args([])
    assert args.decoder == "small" and args.models is None and args.policies is None
    assert model._policy_list(args) == list(model.POLICIES)
    assert model._policy_list(args, decoder=True) == [p for p in model.POLICIES if p != "compile"]
    assert model._policy_list(_model_args(["--policies", "fp32", "bf16", "int8"])) == ["fp32", "int8"]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        decode.parse_overrides(["hidden_size"])
    assert decode.parse_overrides(["hidden_size=64", "hidden_act=silu"]) == {"hidden_size": 64, "hidden_act": "silu"}
