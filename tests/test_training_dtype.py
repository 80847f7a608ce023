"""fastdl.training_dtype / training_recipe / training_autocast (fastdl/training.py): bf16 only at the CPU level
avx512_bf16 (capped by FASTDL_CPU_ISA), fp32 below it, fp32 on a device type without a rule; a user's own bf16 autocast
is never changed by the recipe (fastdl's layers compute in bf16 under it on every level)."""

import json

import pytest
import torch
from conftest import native_cpu_kernels, run_at_isa

import fastdl
from fastdl import _extension

LEVELS = ("avx2", "avx512", "avx512_bf16")

SCRIPT = """
import json, torch, fastdl
from fastdl.nn import FusedLinear
r = fastdl.training_recipe("cpu")
with fastdl.training_autocast("cpu"):
    recipe_autocast = torch.is_autocast_enabled("cpu")
layer = FusedLinear(24, 20, activation="gelu")
x = torch.randn(5, 24)
with torch.autocast("cpu", dtype=torch.bfloat16):  # the user asks for bf16: bf16 it is, whatever the recipe
    y = layer(x)
print(json.dumps({"level": fastdl._extension.cpu_info()["level"], "dtype": str(r.dtype), "reason": r.reason,
                  "training_dtype": str(fastdl.training_dtype()), "recipe_autocast": recipe_autocast,
                  "user_bf16_out": str(y.dtype)}))
"""


@pytest.mark.parametrize("isa", LEVELS)
def test_recipe_at_each_cpu_level(isa):
    native = native_cpu_kernels()["level"]
    if native not in LEVELS or LEVELS.index(isa) > LEVELS.index(native):
        pytest.skip(f"this CPU runs at {native}: it cannot be raised to {isa}")
    out = json.loads(run_at_isa(isa, SCRIPT).strip().splitlines()[-1])
    assert out["level"] == isa
    bf16 = isa == "avx512_bf16"
    assert out["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), out
    assert out["recipe_autocast"] is bf16
    assert out["user_bf16_out"] == "torch.bfloat16"
    assert isa in out["reason"] and ("capped" in out["reason"]) == (isa != native)
    if not torch.cuda.is_available():  # the default device is the CPU
        assert out["training_dtype"] == out["dtype"]


def test_recipe_in_this_process_and_devices():
    level = _extension.cpu_info()["level"]
    expect = torch.bfloat16 if level == "avx512_bf16" else torch.float32
    assert fastdl.training_dtype("cpu") == fastdl.training_dtype(torch.device("cpu")) == expect
    with fastdl.training_autocast("cpu"):
        assert torch.is_autocast_enabled("cpu") is (expect == torch.bfloat16)
        if expect == torch.bfloat16:
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    r = fastdl.training_recipe("meta")
    assert r.dtype == torch.float32 and not r.autocast and "no measured rule" in r.reason
    if not torch.cuda.is_available():
        r = fastdl.training_recipe("cuda")
        assert r.dtype == torch.float32 and "none visible" in r.reason
    elif torch.cuda.is_bf16_supported():
        assert fastdl.training_dtype("cuda") == torch.bfloat16


def test_recipe_argument_errors():
    with pytest.raises(TypeError, match="device must be None, a str or a torch.device, got int"):
        fastdl.training_dtype(0)
    with pytest.raises(ValueError, match="device must name a torch device, got 'gpu0'"):
        fastdl.training_dtype("gpu0")
