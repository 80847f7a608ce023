"""The main job, `fastdl demo`, end to end on a short schedule: DDP (2 processes, gloo), FusedLinear, PrefetchLoader,
2:4 pruning with masks kept, int8 and 2:4 inference conversions, and the accuracy bars."""

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
