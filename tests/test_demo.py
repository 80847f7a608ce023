"""The main job, `fastdl demo`, end to end on a short schedule: DDP (2 processes, gloo), FusedLinear, PrefetchLoader,
2:4 pruning with masks kept, int8 and 2:4 inference conversions, the accuracy bars, and the speed verdict per stage."""

import argparse

import pytest

from fastdl import demo


def test_demo_short_schedule_meets_bars(capsys):
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    args = p.parse_args(["--epochs", "8", "--finetune-epochs", "3", "--quiet", "--cpu"])
    results = demo.run(args)
    out = capsys.readouterr().out
    assert "dense training (DDP)" in out and "inference int8 W8A8" in out
    assert results["world"] == 2 and results["backend"] == "gloo"
    assert results["sparse_fastdl"]["masks_identical_on_all_ranks"]
    assert results["missed"] == [], results["missed"]
    # every stage is judged on speed against the fastest PyTorch option, and the verdict says which are slower
    assert [st["stage"] for st in results["stages"]] == [t for t, _, _ in demo.STAGES]
    assert all(st["ratio"] is not None and st["best"].startswith("pytorch_") for st in results["stages"])
    assert "verdict (" in out and "all met" not in out.splitlines()[-2]
    assert results["slower"] == [st["stage"] for st in results["stages"] if st["ratio"] < 1.0]
    assert {"fastdl", "pytorch_fp32", "pytorch_bf16"} <= set(results["infer_int8"])
