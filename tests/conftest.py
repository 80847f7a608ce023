import importlib.util
import json
import os
import warnings

# Without a GPU, Triton kernels are tested in Triton's interpreter on CPU tensors. Set for the whole session before
# anything imports triton, so every test file sees the same mode (the CPU router then offers the triton backend).
if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _backport_interpreter_index():
    """triton 3.6's interpreter (numpy >= 2.4 only): a loop bound that is a runtime scalar (``range(0, tl.cdiv(K,
    BLOCK_K))``, ``range(0, K, BLOCK_K)``) fails with "only 0-dimensional arrays can be converted to Python scalars".
    Every scalar there is a shape-(1,) numpy array and ``tensor.__index__`` is ``int(data)``, which numpy 2.4 made an
    error; triton 3.7 changed it to ``int(data.squeeze())``. The kernels cannot avoid it (any runtime loop bound is
    such a scalar, and a ``while`` loop would lose software pipelining on the GPU), so the tests apply triton 3.7's
    one-line fix to the interpreter of older triton versions. The GPU compile path is not touched."""
    import numpy as np
    import triton

    try:
        major, minor = (int(v) for v in triton.__version__.split(".")[:2])
        numpy_major, numpy_minor = (int(v) for v in np.__version__.split(".")[:2])
    except ValueError:
        return
    if (major, minor) >= (3, 7) or (numpy_major, numpy_minor) < (2, 4):
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_fastdl_backport", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._fastdl_backport = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _backport_interpreter_index()

# Layers choose their paths per input shape by timing them (fastdl.runtime_choice); a choice made by timing can differ
# between runs and between processes, and many tests compare outputs bit for bit across processes. So the suite runs
# the fixed paths unless a test sets the mode (test_runtime_choice.py forces timings with runtime_choice.set_timer).
# FASTDL_CHOICE=measure runs the suite with real choices; then the tests that compare processes bit for bit can fail
# (each process times for itself: share decisions with fastdl.save_decisions / FASTDL_DECISIONS_DIR).
os.environ.setdefault("FASTDL_CHOICE", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

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
    return [b for b in ("cpp", "triton", "torch") if backends.available(b, op, "cpu")[0]]


def skip_unsupported(backend: str, *tensors) -> None:
    """The Triton interpreter cannot run bf16 dots: skip those combinations with the reason."""
    if backend == "triton" and any(t is not None and t.dtype == torch.bfloat16 for t in tensors):
        if os.environ.get("TRITON_INTERPRET") == "1":
            pytest.skip("bf16 is not supported by the Triton interpreter (tested on the GPU)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 on the CPU (||out - ref|| when ref is 0)."""
    ref = ref.double().cpu()
    denom = ref.norm().item()
    diff = (out.double().cpu() - ref).norm().item()
    return diff / denom if denom > 0 else diff


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def run_at_isa(isa: str, script: str, timeout: float = 300) -> str:
    """Run `script` in a fresh Python process whose fastdl CPU kernels are capped at `isa` (scalar, avx2, avx512,
    avx512_bf16 or native: FASTDL_CPU_ISA is read once per process). The tests directory is on its path, so it can
    import helpers from a test module. Returns stdout; fails with the process's output on a non-zero exit."""
    import subprocess
    import sys

    env = dict(os.environ)
    env.pop("FASTDL_CPU_ISA", None)
    if isa != "native":
        env["FASTDL_CPU_ISA"] = isa
    env["PYTHONPATH"] = TESTS_DIR + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        pytest.fail(f"FASTDL_CPU_ISA={isa}: the subprocess failed\n{res.stdout}\n{res.stderr}")
    return res.stdout


_NATIVE_KERNELS: dict = {}


def native_cpu_kernels() -> dict:
    """The kernel family per capability on this CPU uncapped (`fastdl.info()["cpu"]["kernels"]` of a process without
    FASTDL_CPU_ISA): what a capped subprocess is compared with, also when this process itself runs capped."""
    if not _NATIVE_KERNELS:
        out = run_at_isa("native", "import json, fastdl; print(json.dumps(fastdl.info(print_result=False)['cpu']))")
        cpu = json.loads(out.strip().splitlines()[-1])
        _NATIVE_KERNELS.update(cpu["kernels"], level=cpu["level"])
    return _NATIVE_KERNELS


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


class Passthrough(torch.overrides.TorchFunctionMode):
    """A torch-function mode that changes nothing: fastdl's ops then go through the dispatcher and its registered
    (Python) autograd instead of the eager fast paths (the C++ autograd kernels, the autograd.Function)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def grads_eager_and_dispatcher(fn, leaves, grad_out):
    """``fn()`` run eagerly and under ``Passthrough``, ``backward(grad_out)`` after each: for both, the type name of
    the output's grad_fn, the output and the gradients of ``leaves`` (None where a leaf needs none)."""
    results = []
    for mode in (None, Passthrough()):
        for t in leaves:
            t.grad = None
        if mode is None:
            out = fn()
        else:
            with mode:
                out = fn()
        name = type(out.grad_fn).__name__
        out.backward(grad_out)
        results.append((name, out.detach(), [None if t.grad is None else t.grad.clone() for t in leaves]))
    return results


def check_cpp_autograd_matches_dispatcher(fn, tensors, needs, grad_out) -> None:
    """The tensors flagged in ``needs`` (None entries skipped) are made to need a gradient; then ``fn()`` run eagerly
    must record the extension's C++ autograd node (csrc/<op>_autograd.cpp) and give, bit for bit, the output and the
    gradients of the op's registered autograd reached through the dispatcher."""
    leaves = [t for t, need in zip(tensors, needs) if t is not None and need]
    if not leaves:
        pytest.skip("no tensor of this subset is given: nothing needs a gradient")
    for t in leaves:
        t.requires_grad_()
    (eager_fn, out_e, grads_e), (disp_fn, out_d, grads_d) = grads_eager_and_dispatcher(fn, leaves, grad_out)
    assert eager_fn == "CppFunction" and disp_fn != eager_fn, (eager_fn, disp_fn)
    torch.testing.assert_close(out_e, out_d, rtol=0, atol=0, equal_nan=True)
    for ge, gd in zip(grads_e, grads_d):
        assert ge is not None
        torch.testing.assert_close(ge, gd, rtol=0, atol=0, equal_nan=True)


# The loader's producer threads (fastdl.data.PrefetchLoader), for the tests that check none outlives its pass
LOADER_THREAD = "fastdl-prefetch"


def loader_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == LOADER_THREAD and t.is_alive()]


def wait_no_loader_thread(timeout: float = 5.0) -> bool:
    """True once no producer thread is alive (collecting garbage meanwhile: a dropped iterator ends its pass)."""
    import gc
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not loader_threads():
            return True
        gc.collect()
        time.sleep(0.02)
    return False


class VirtualClock:
    """A stand-in for the ``time`` module of a timing loop under test (``virtual_clock``): time passes only when a
    call under test says how long it took (``spend``), plus ``tick`` seconds at each reading. A test then checks
    the loop's rules (warm-up, rounds, budgets, slow-call bounds, which time counts) exactly, without reading the
    wall clock of a shared machine."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now = 0.0
        self.tick = tick

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    monotonic = perf_counter
    time = perf_counter

    def spend(self, seconds: float) -> None:
        self.now += seconds

    sleep = spend


@pytest.fixture
def virtual_clock(monkeypatch):
    """``clock = virtual_clock(module, ..., tick=0.0)``: a VirtualClock as the ``time`` of those modules (each reads
    the clock through its own ``import time``) for this test."""

    def install(*modules, tick: float = 0.0) -> VirtualClock:
        clock = VirtualClock(tick)
        for module in modules:
            monkeypatch.setattr(module, "time", clock)
        return clock

    return install
