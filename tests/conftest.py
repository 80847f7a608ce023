import os
import warnings

import pytest
import torch

# Tests must not depend on how many cores the machine has; 2 threads is the CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import fastdl  # noqa: F401  (defines the ops; loads fastdl._C when built)

from fastdl import backends  # noqa: E402

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not CUDA, reason="needs an NVIDIA GPU (none visible: torch.cuda.is_available() is False)"
)


def cpu_backends(op: str) -> list[str]:
    """Backends that can serve `op` on the CPU in this environment (triton only in interpreter mode)."""
    return [b for b in ("cpp", "torch") if backends.available(b, op, "cpu")[0]]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    denom = ref.norm().item()
    diff = (out.double() - ref).norm().item()
    return diff / denom if denom > 0 else diff


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield
