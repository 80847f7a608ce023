"""fastdl.convert / fastdl.report: policies, the do-no-harm rule of "auto", decision cache, checkpoints."""

import copy
import importlib
import os
import tempfile

import pytest
import torch
from torch import nn

import fastdl
from fastdl.nn import FusedLinear

convert_mod = importlib.import_module("fastdl.convert")  # the module (fastdl.convert is the function)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 96), nn.SiLU(),
        nn.Linear(96, 10),
    )


def test_fused_policy_fuses_activations_and_keeps_keys():
    model = _model()
    x = torch.randn(16, 64)
    ref = model(x)
    keys = set(model.state_dict())
    fastdl.convert(model, "fused")
    assert isinstance(model[0], FusedLinear) and model[0].activation == "gelu"
    assert model[2].activation == "relu" and model[4].activation == "silu" and model[6].activation == "none"
    assert isinstance(model[1], nn.Identity)
    assert set(model.state_dict()) == keys
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    rep = fastdl.report(model)
    assert [r["kernel"] for r in rep] == ["fused[gelu]", "fused[relu]", "fused[silu]", "fused[none]"]
    assert "fused[gelu]" in str(rep)


def test_filter_fn_and_unknown_policy():
    model = _model()
    fastdl.convert(model, "fused", filter_fn=lambda name, m: name != "6")
    assert type(model[6]) is nn.Linear
    assert any(r.get("note", "").startswith("skipped") or "filter_fn" in r["layer"] for r in fastdl.report(model))
    with pytest.raises(ValueError, match="policy"):
        fastdl.convert(_model(), "fp4")
    with pytest.raises(ValueError, match="example_inputs"):
        fastdl.convert(_model(), "auto")


@pytest.fixture
def timer():
    """Install a fake timer: ``timer.set(fn)`` with ``fn(name, info) -> seconds``; records every timed name."""
    from fastdl import dispatch

    class T:
        calls: list = []

        def set(self, fn):
            def fake(calls, device, info):
                self.calls.extend(calls)
                return {name: fn(name, info) for name in calls}

            dispatch.set_timer(fake)

    convert_mod._DECISIONS.clear()
    dispatch.clear_decisions()
    t = T()
    t.calls = []
    yield t
    dispatch.set_timer(None)
    dispatch.clear_decisions()
    convert_mod._DECISIONS.clear()


def test_auto_never_picks_a_slower_candidate(timer):
    """With a timer that makes every candidate path slower than the original, auto keeps every original layer."""
    model = _model()
    x = torch.randn(8, 64)
    ref = model(x)
    timer.set(lambda name, info: 1.0 if name.startswith("original") else 2.0)
    fastdl.convert(model, "auto", example_inputs=(x,), candidates=("fused",))
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 4, 6))
    torch.testing.assert_close(model(x), ref)
    assert all(r["kernel"] == "original" for r in fastdl.report(model))


def test_auto_takes_faster_candidate_within_error_and_caches(timer):
    model = _model()
    x = torch.randn(8, 64)
    ref = model(x)
    timer.set(lambda name, info: 1.0 if name.startswith("original") else 0.5)
    fastdl.convert(model, "auto", example_inputs=(x,), candidates=("fused",))
    assert all(isinstance(model[i], FusedLinear) for i in (0, 2, 4, 6))
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    rep = fastdl.report(model)
    assert all(r["speedup"] == pytest.approx(2.0) and r["error"] < 1e-5 for r in rep)
    n_calls = len(timer.calls)
    model2 = fastdl.convert(_model(), "auto", example_inputs=(x,), candidates=("fused",))
    assert len(timer.calls) == n_calls, "second conversion of the same shapes must not re-time"
    assert all(r["note"] == "cached timings" for r in fastdl.report(model2))


def test_auto_rejects_candidates_over_the_error_bound(timer, monkeypatch):
    model = _model()
    x = torch.randn(8, 64)
    timer.set(lambda name, info: 1.0 if name.startswith("original") else 0.1)
    monkeypatch.setattr(convert_mod, "_rel_err", lambda out, ref: 0.5)
    fastdl.convert(model, "auto", example_inputs=(x,), candidates=("fused",), max_error=0.01)
    assert all(type(model[i]) is nn.Linear for i in (0, 2, 4, 6))
    assert all("error" in r["candidates"]["fused"]["rejected"] for r in fastdl.report(model))


def test_auto_with_the_real_timer_measures_every_layer_and_reports_its_choice():
    """The real timer (no fake): every layer is timed against its original on the captured inputs, and what the
    report states is what the layer runs: a layer is replaced only where its candidate was measured faster.
    (That the choice is faster than the original in another measurement is the benchmarks' claim, `fastdl bench
    model`: a wall-time assertion here would flake on a busy machine.)"""
    convert_mod._DECISIONS.clear()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))  # too small for any kernel to matter
    x = torch.randn(2, 8)
    ref = model(x)
    fastdl.convert(model, "auto", example_inputs=(x,), candidates=("fused",))
    rep = fastdl.report(model)
    assert len(rep) == 2
    for r, layer in zip(rep, (model[0], model[2]), strict=True):
        cand = r["candidates"]["fused"]
        assert r["orig_ms"] > 0 and cand["ms"] and all(t > 0 for t in cand["ms"])  # both were really timed
        replaced = r["kernel"] != "original"
        assert replaced == isinstance(layer, FusedLinear) == ("rejected" not in cand), (r, layer)
        assert not replaced or r["time_ms"] < r["orig_ms"]
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)


def test_converted_checkpoint_loads_in_another_process_state():
    model = fastdl.convert(_model(), "fused")
    x = torch.randn(4, 64)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt.pt")
        torch.save(model.state_dict(), path)
        fresh = fastdl.convert(_model(), "fused")
        for p in fresh.parameters():
            torch.nn.init.zeros_(p)
        fresh.load_state_dict(torch.load(path, weights_only=True))
    torch.testing.assert_close(fresh(x), model(x))
    plain = copy.deepcopy(_model())
    plain.load_state_dict(model.state_dict())  # keys unchanged: loads back into the unconverted model
