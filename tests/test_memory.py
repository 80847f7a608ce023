"""The memory promise of the quantized and sparse layers: a layer holds its stored (quantized / compressed) bytes and
nothing else at every M and on every path, unless its user opts in to a dense copy (``dense_copy = True``).

The run-time choice is driven by a fake timer that makes every path needing a dense copy look fastest: if such a
path were a candidate it would be chosen and its copy kept, so each check here fails when a kept copy reappears
(the ``dense_copy = True`` cases show that the same measurement sees the copy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import fastdl
from fastdl import runtime_choice as dispatch
from fastdl.nn import DENSE_COPY_FREE_BYTES, Int8Linear, Sparse24Linear

DENSE_PATHS = ("dequant", "dequant_fused", "dense", "dense_fused")


def _dense_wins(calls, device, info):
    for c in calls.values():
        c()
    return {p: (0.1 if p in DENSE_PATHS else 1.0) for p in calls}


@pytest.fixture
def dense_favoured():
    prev_mode = dispatch.set_choice_mode("measure")
    dispatch.clear_decisions()
    prev = dispatch.set_timer(_dense_wins)
    yield
    dispatch.set_timer(prev)
    dispatch.set_choice_mode(prev_mode)
    dispatch.clear_decisions()


def _layer(kind: str, lin: nn.Linear) -> nn.Module:
    if kind == "sparse24":
        return Sparse24Linear.from_linear(lin)
    if kind == "sparse24_bf16":
        return Sparse24Linear.from_linear(lin.to(torch.bfloat16))
    mode, _, gs = kind.partition(":")
    return Int8Linear.from_linear(lin, mode=mode, group_size=None if gs == "pc" else "auto")


KINDS = ("weight_only", "weight_only:pc", "dynamic", "sparse24", "sparse24_bf16")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_dense_copy_at_any_m(kind, dtype, dense_favoured):
    torch.manual_seed(0)
    lin = nn.Linear(256, 160)  # a bf16 copy is 80 KiB > DENSE_COPY_FREE_BYTES
    assert 256 * 160 * 2 > DENSE_COPY_FREE_BYTES
    layer = _layer(kind, lin).eval()
    stored = layer.memory_bytes()
    with torch.no_grad():
        layer(torch.randn(1, 256, dtype=dtype))
    held = layer.memory_bytes()  # (a packed W8A8 layer adds its 1-byte stride-0 placeholder of the weight)
    assert held <= stored + 1
    ref = None
    with torch.no_grad():
        for m in (3, 16, 64, 300):
            x = torch.randn(m, 256, dtype=dtype)
            out = layer(x)
            assert out.shape == (m, 160) and torch.isfinite(out).all()
            if m == 16:
                ref = (x, out)
    assert layer.cache_bytes() == 0
    assert layer.memory_bytes() == held
    paths = {d["path"] for d in layer.runtime_decisions()}
    assert not paths & set(DENSE_PATHS), paths
    # the same calls with the opt-in: the fake timer now picks a dense path and the copy is kept (and counted)
    layer.dense_copy = True
    with torch.no_grad():
        out = layer(ref[0])
    torch.testing.assert_close(out.float(), ref[1].float(), rtol=2e-2, atol=2e-2)  # same product, another GEMM
    assert layer.cache_bytes() >= 256 * 160 * ref[0].element_size()
    assert layer.memory_bytes() >= held + layer.cache_bytes()
    layer.dense_copy = False  # turning it off drops the copy
    assert layer.cache_bytes() == 0 and layer.memory_bytes() <= held


@pytest.mark.parametrize("kind", ("weight_only", "sparse24"))
def test_tiny_layer_may_keep_its_copy(kind, dense_favoured):
    """Layers whose copy is at most DENSE_COPY_FREE_BYTES keep the dense paths (the op's per-call cost shows)."""
    layer = _layer(kind, nn.Linear(64, 64)).eval()
    with torch.no_grad():
        layer(torch.randn(4, 64))
    assert {d["path"] for d in layer.runtime_decisions()} & set(DENSE_PATHS)
    assert 0 < layer.cache_bytes() <= DENSE_COPY_FREE_BYTES


def test_dequantized_weight_is_not_kept():
    layer = _layer("weight_only", nn.Linear(256, 256))
    held = layer.memory_bytes()
    w = layer.dequantized_weight(torch.float32)
    assert w.shape == (256, 256)
    assert layer.memory_bytes() == held


def test_sparse24_fixed_rule_keeps_no_copy():
    """Without a decision (FASTDL_CHOICE=off, the test default) large M used to take the cached dense path."""
    prev = dispatch.set_choice_mode("off")
    try:
        layer = _layer("sparse24", nn.Linear(256, 256)).eval()
        held = layer.memory_bytes()
        with torch.no_grad():
            layer(torch.randn(layer.dense_threshold + 5, 256))
        assert layer.last_path == "sparse"
        assert layer.memory_bytes() == held
        layer.dense_copy = True
        with torch.no_grad():
            layer(torch.randn(layer.dense_threshold + 5, 256))
        assert layer.last_path == "dense" and layer.cache_bytes() > 0
    finally:
        dispatch.set_choice_mode(prev)


def test_report_shows_resident_bytes(dense_favoured):
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128))
    fastdl.convert(model, "int8_weight_only")
    with torch.no_grad():
        model(torch.randn(32, 256))
    rows = fastdl.report(model)
    assert [r["resident"] for r in rows] == [model[0].memory_bytes(), model[2].memory_bytes()]
    assert all(r["resident"] == r["bytes_after"] for r in rows)
    assert "resident now" in str(rows)


_RSS_SCRIPT = textwrap.dedent("""
    import gc, json, sys, torch
    from torch import nn
    import fastdl
    from fastdl import runtime_choice as dispatch

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def dense_wins(calls, device, info):
        for c in calls.values():
            c()
        return {p: (0.1 if p in ("dequant", "dequant_fused", "dense", "dense_fused") else 1.0) for p in calls}

    kind, opt_in = sys.argv[1], sys.argv[2] == "1"
    torch.set_num_threads(1)
    dispatch.set_choice_mode("measure")
    dispatch.set_timer(dense_wins)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 2048) for _ in range(8)])
    fastdl.convert(model, kind)
    gc.collect()
    for m in model:
        m.dense_copy = opt_in
        m.eval()
    before = rss()
    with torch.no_grad():
        for rows in (1, 16, 256):
            for lay in model:
                lay(torch.randn(rows, 1024))
    gc.collect()
    print(json.dumps({"grew": rss() - before, "held": sum(m.memory_bytes() for m in model)}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc (Linux) for the resident set size")
@pytest.mark.parametrize("kind", ("int8_weight_only", "int8", "sparse24"))
def test_resident_memory_does_not_grow(kind):
    """8 layers 1024 -> 2048: their fp32 copies would be 64 MiB. The process's resident set after calls of 1, 16 and
    256 rows grows by less than a quarter of that (the kernels' workspaces); with the opt-in it grows by at least half
    of it (the copies).

    glibc's malloc is pinned to mmap every block of 64 KiB or more and to give freed memory back at once: with its
    default, adaptive threshold, blocks freed while converting (the fp32 weights, the quantizer's temporaries) stay
    resident in the heap and the copies reuse them, so the resident set measures the allocator's history instead of
    the memory held."""
    copies = 8 * 1024 * 2048 * 4
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}

    def run(opt_in: bool) -> dict:
        r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, kind, "1" if opt_in else "0"], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "FASTDL_CHOICE": "measure", **malloc})
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    promise = run(False)
    assert promise["grew"] < copies / 4, promise
    opted = run(True)
    assert opted["grew"] > copies / 2, opted
    assert opted["held"] > promise["held"] + copies / 2
