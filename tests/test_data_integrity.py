"""PrefetchLoader loses nothing and hands out nothing wrong (issue 34, items 9, 12, 14): independent passes over a
re-iterable source (``zip(L, L)``, nested loops), every element of a one-shot source exactly once and in order
across ``break`` / ``del`` / errors, no producer thread left behind, nested tensors, and clear errors for a bad
``load_state_dict`` state and for the copy ops' bad arguments (huge and negative offsets, sparse tensors)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import LOADER_THREAD, wait_no_loader_thread
from torch.utils.data import DataLoader, TensorDataset

import fastdl
from fastdl import backends
from fastdl.data import PrefetchLoader
from fastdl.ops import loader_fill, loader_use_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD = LOADER_THREAD
CPP, _CPP_WHY = backends.available("cpp", "loader_fill", "cpu")
needs_cpp = pytest.mark.skipif(not CPP, reason=f"the C++ loader kernels are not available: {_CPP_WHY}")
BACKENDS = ["torch", pytest.param("cpp", marks=needs_cpp)]
# a CPU target's two paths: pass-through (the default) and staged through the ring with each copy backend
MODES = [{}, {"stage": True, "copy_backend": "torch"},
         pytest.param({"stage": True, "copy_backend": "cpp"}, marks=needs_cpp)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.fixture(autouse=True)
def _no_leftover_threads():
    yield
    assert wait_no_loader_thread(), "a fastdl-prefetch thread outlived its test"


def _ints(loader) -> list[int]:
    return [int(b[0]) for b in loader]


class _Counting:
    """A one-shot source (a generator) that records how many elements were taken from it."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.taken = 0
        self.gen = self._gen(n, fail_at)

    def _gen(self, n, fail_at):
        for i in range(n):
            if i == fail_at:
                raise KeyError(f"sample {i} is broken")
            self.taken += 1
            yield torch.tensor([i, -i])

    def wait_taken(self, k: int, timeout: float = 60.0) -> None:
        """Until the producer has taken ``k`` elements (it prefetches them): the mechanism, not a sleep. The timeout
        only guards against a hang; reaching it fails the test."""
        deadline = time.monotonic() + timeout
        while self.taken < k:
            assert time.monotonic() < deadline, f"the producer took {self.taken} elements, not {k}"
            time.sleep(0.005)


# ---------------------------------------------------------------------------------------------------------------
# re-iterable sources: each iter() its own pass


@pytest.mark.parametrize("mode", MODES)
def test_zip_of_a_loader_with_itself_gives_every_pair(mode):
    src = [torch.tensor([i]) for i in range(5)]
    loader = PrefetchLoader(src, device="cpu", **mode)
    pairs = [(int(a), int(b)) for a, b in zip(loader, loader)]
    assert pairs == [(i, i) for i in range(5)]
    st = loader.stats()
    assert st["batches"] == 10, st  # both passes counted (zip stops at the first one's end: 1 epoch completed)


def test_nested_loops_see_every_pair_in_order():
    src = [torch.tensor([i]) for i in range(3)]
    loader = PrefetchLoader(src, device="cpu", depth=1)
    pairs = [(int(a), int(b)) for a in loader for b in loader]
    assert pairs == [(i, j) for i in range(3) for j in range(3)]
    assert wait_no_loader_thread()


def test_concurrent_passes_have_their_own_ring_and_keep_values():
    """Two passes at once over batches of varying size: each pass's batches stay intact (a kept batch is never
    overwritten by the other pass's producer)."""
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(int(n), generator=g) for n in torch.randint(1, 5000, (12,), generator=g)]
    loader = PrefetchLoader(src, device="cpu", depth=2, stage=True)
    kept = [(a, b) for a, b in zip(loader, loader)]
    for (a, b), ref in zip(kept, src, strict=True):
        assert torch.equal(a, ref) and torch.equal(b, ref)
        assert a.data_ptr() != b.data_ptr()


def test_break_over_a_dataloader_then_a_new_epoch_starts_anew():
    dl = DataLoader(TensorDataset(torch.arange(20)), batch_size=3)
    loader = PrefetchLoader(dl, device="cpu", depth=2)
    first = []
    for b in loader:
        first.append(b[0].tolist())
        if len(first) == 2:
            break
    assert wait_no_loader_thread()  # the pass was stopped when the loop dropped its iterator
    assert loader.state_dict()["batches_consumed"] == 2
    full = [b[0].tolist() for b in loader]
    assert full == [b[0].tolist() for b in dl]  # a whole epoch, from the start
    assert first == full[:2]
    assert loader.state_dict()["batches_consumed"] == 0


def test_state_dict_follows_the_pass_started_last():
    loader = PrefetchLoader([torch.tensor([i]) for i in range(6)], device="cpu")
    it1 = iter(loader)
    next(it1), next(it1), next(it1)
    it2 = iter(loader)
    next(it2)
    assert loader.state_dict()["batches_consumed"] == 1
    next(it1)  # the older pass does not move the position of the current one
    assert loader.state_dict()["batches_consumed"] == 1
    del it1, it2


def test_second_pass_over_a_persistent_workers_dataloader_is_a_clear_error():
    dl = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, num_workers=1, persistent_workers=True)
    loader = PrefetchLoader(dl, device="cpu")
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    it = iter(loader)
    next(it)
    with pytest.raises(RuntimeError, match="persistent_workers=True"):
        iter(loader)
    assert [b[0].tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]  # the running pass is untouched
    del it
    assert len([b for b in loader]) == 4  # sequential passes work as before
    del loader, dl


# ---------------------------------------------------------------------------------------------------------------
# one-shot sources: every element exactly once, in order


@pytest.mark.parametrize("depth", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_break_then_continue_over_a_generator_loses_nothing(depth, mode):
    n = 23
    src = _Counting(n)
    loader = PrefetchLoader(src.gen, device="cpu", depth=depth, **mode)
    got, stops = [], [1, 2, 5, 6, 11, 17]
    for stop in stops:
        for b in loader:
            got.append(b)
            if len(got) == stop:
                src.wait_taken(min(stop + depth, n))  # the producer has prefetched ahead: those must not be lost
                break
        assert wait_no_loader_thread()  # each break stops the pass (no thread left behind)
    got += list(loader)  # the rest
    assert [int(b[0]) for b in got] == list(range(n))
    for i, b in enumerate(got):  # the values too (views of ring slots that later passes reused)
        assert b.tolist() == [i, -i], i
    assert list(loader) == []  # the generator is exhausted


def test_del_of_a_started_iterator_keeps_its_prefetched_batches():
    src = _Counting(10)
    loader = PrefetchLoader(src.gen, device="cpu", depth=3)
    it = iter(loader)
    assert int(next(it)[0]) == 0
    src.wait_taken(5)
    del it
    assert wait_no_loader_thread()
    it = iter(loader)
    assert int(next(it)[0]) == 1
    it.close()  # explicit close: the same
    assert _ints(loader) == list(range(2, 10))


def test_zip_over_a_generator_is_like_zip_over_the_generator():
    """One iterator shared by both sides, as ``zip(g, g)``: consecutive pairs, each element once."""
    loader = PrefetchLoader((torch.tensor([i]) for i in range(6)), device="cpu")
    assert [(int(a), int(b)) for a, b in zip(loader, loader)] == [(0, 1), (2, 3), (4, 5)]


def test_error_after_a_break_is_raised_at_its_place():
    src = _Counting(10, fail_at=4)
    loader = PrefetchLoader(src.gen, device="cpu", depth=4)
    got = []
    for b in loader:
        got.append(int(b[0]))
        src.wait_taken(4)
        break
    with pytest.raises(KeyError, match="sample 4 is broken"):
        for b in loader:
            got.append(int(b[0]))
    assert got == [0, 1, 2, 3]


def test_one_shot_position_carries_over_passes():
    loader = PrefetchLoader(iter([torch.tensor([i]) for i in range(7)]), device="cpu")
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert loader.state_dict()["batches_consumed"] == 3
    it = iter(loader)
    next(it)
    assert loader.state_dict()["batches_consumed"] == 4
    assert len(list(it)) == 3
    assert loader.state_dict()["batches_consumed"] == 0


def test_no_thread_after_break_and_del_of_the_loader():
    for src in ([torch.ones(4)] * 50, (torch.ones(4) for _ in range(50))):
        loader = PrefetchLoader(src, device="cpu")
        for i, _ in enumerate(loader):
            if i == 3:
                break
        it = iter(loader)
        next(it)
        del loader, it
        gc.collect()
        assert wait_no_loader_thread(), type(src)


# ---------------------------------------------------------------------------------------------------------------
# nested tensors (item 12)


def _nested(layout):
    g = torch.Generator().manual_seed(1)
    return torch.nested.nested_tensor([torch.randn(2, 3, generator=g), torch.randn(5, 3, generator=g)], layout=layout)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@pytest.mark.parametrize("mode", MODES)
def test_nested_tensors_pass_through(layout, mode):
    nt = _nested(layout)
    batch = {"nt": nt, "x": torch.arange(6.0).view(2, 3), "w": _nested(layout).requires_grad_()}
    out = list(PrefetchLoader([batch, batch], device="cpu", **mode))
    assert len(out) == 2
    for b in out:
        assert b["nt"].is_nested and b["nt"].layout == layout
        for got, ref in zip(b["nt"].unbind(), nt.unbind(), strict=True):
            assert torch.equal(got, ref)
        assert torch.equal(b["x"], batch["x"])
        # staged: detached, as every other tensor; pass-through: the batch itself
        assert b["w"].requires_grad == (not mode) and (b is batch) == (not mode)
        assert all(torch.equal(a, r) for a, r in zip(b["w"].unbind(), batch["w"].unbind(), strict=True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_device_buffers_view_its_memory(layout):
    """What the CUDA path passes to record_stream for a nested tensor: plain tensors on its memory (checked here on
    the CPU, where the same views exist)."""
    from fastdl._loader_pass import device_buffers as _device_buffers

    nt = _nested(layout)
    bufs = _device_buffers(nt)
    assert bufs and all(type(b) is torch.Tensor and not b.is_nested for b in bufs)
    ptrs = {b.untyped_storage().data_ptr() for b in bufs}
    assert {p.untyped_storage().data_ptr() for p in nt.unbind()} <= ptrs
    assert _device_buffers(torch.ones(2))[0].shape == (2,)


@needs_cuda
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_move_to_the_gpu(layout):
    nt = _nested(layout)
    out = list(PrefetchLoader([{"nt": nt, "x": torch.ones(3)}], device="cuda"))
    b = out[0]
    assert b["nt"].is_cuda and b["nt"].is_nested and b["nt"].layout == layout and b["x"].is_cuda
    torch.cuda.synchronize()
    for got, ref in zip(b["nt"].unbind(), nt.unbind(), strict=True):
        assert torch.equal(got.cpu(), ref)


# ---------------------------------------------------------------------------------------------------------------
# clear errors (item 14, item 1's Python side)


@pytest.mark.parametrize(
    "state, exc, match",
    [
        ({"version": 1}, ValueError, r"state\['batches_consumed'\] is missing"),
        ({"version": 2, "batches_consumed": 0}, ValueError, "version 2 .*expected 1"),
        ({"batches_consumed": 0}, ValueError, "version None"),
        ({"version": "1", "batches_consumed": 0}, ValueError, "version '1'"),
        ({"version": 1, "batches_consumed": -1}, ValueError, r"batches_consumed'\] must be >= 0, got -1"),
        ({"version": 1, "batches_consumed": 1.5}, TypeError, r"batches_consumed'\] must be an int >= 0, got float"),
        ({"version": 1, "batches_consumed": True}, TypeError, "got bool"),
        ({"version": 1, "batches_consumed": 0, "epoch": "3"}, TypeError, r"epoch'\] must be an int or None, got str"),
        ({"version": 1, "batches_consumed": 0, "batch": 3}, ValueError, r"unknown keys \['batch'\]"),
        ([("version", 1)], TypeError, "state must be a dict .* got list"),
        (None, TypeError, "got NoneType"),
    ],
)
def test_load_state_dict_rejects_a_bad_state_clearly(state, exc, match):
    loader = PrefetchLoader([torch.ones(1)] * 3, device="cpu")
    with pytest.raises(exc, match=f"PrefetchLoader.load_state_dict: .*{match}"):
        loader.load_state_dict(state)
    assert loader.state_dict() == {"version": 1, "batches_consumed": 0, "epoch": None}  # nothing changed
    assert len(list(loader)) == 3


def test_load_state_dict_round_trip():
    loader = PrefetchLoader([torch.tensor([i]) for i in range(5)], device="cpu")
    loader.load_state_dict({"version": 1, "batches_consumed": 2, "epoch": None})
    assert _ints(loader) == [2, 3, 4]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.parametrize("backend", BACKENDS)
def test_use_count_of_a_tensor_without_a_strided_storage_is_a_type_error(backend):
    bad = [
        torch.eye(3).to_sparse(),
        torch.eye(3).to_sparse_csr(),
        _nested(torch.strided),
        _nested(torch.jagged),
    ]
    with fastdl.use_backend(backend):
        for t in bad:
            with pytest.raises(TypeError, match=f"loader_use_count: t must be a strided tensor .* got layout "
                                                f"{t.layout}"):
                loader_use_count(t)
        with pytest.raises(TypeError, match="loader_use_count: t must be a Tensor, got str"):
            loader_use_count("x")
        assert loader_use_count(torch.ones(3)) == 1


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("backend", BACKENDS)
def test_fill_rejects_nested_and_non_tensor_sources(backend):
    dst = torch.zeros(64, dtype=torch.uint8)
    with fastdl.use_backend(backend):
        for src in (_nested(torch.strided), _nested(torch.jagged)):
            with pytest.raises(TypeError, match=r"loader_fill: src\[0\] must be a strided, non-quantized tensor, got "
                                                r".*nested"):
                loader_fill([src], dst, [0], [0])
        with pytest.raises(TypeError, match=r"loader_fill: src\[1\] must be a Tensor, got int"):
            loader_fill([torch.ones(1), 3], dst, [0, 8], [0, 0])


_HUGE = [  # (case, src expression, offset)
    ("offset 2**63 - 1", "torch.ones(1, dtype=torch.uint8)", 2**63 - 1),
    ("offset 2**63 - 4, 8 bytes", "torch.ones(8, dtype=torch.uint8)", 2**63 - 4),
    ("offset -1", "torch.ones(1, dtype=torch.uint8)", -1),
    ("offset -2**63", "torch.ones(1, dtype=torch.uint8)", -(2**63)),
    ("offset 2**64", "torch.ones(1, dtype=torch.uint8)", 2**64),
    ("2**64 bytes (expanded)", "torch.ones(1).expand(2**62)", 0),
    ("2**63 bytes (expanded)", "torch.ones(1, dtype=torch.int16).expand(2**62)", 0),
]


_FILL_CASES = (
    "import torch, fastdl\n"
    "from fastdl.ops import loader_fill\n"
    "def run(backend, cases):\n"
    "    for name, src, off in cases:\n"
    "        for keep in (0, 1):\n"
    "            dst = torch.zeros(64, dtype=torch.uint8)\n"
    "            print(name, keep, end=': ', flush=True)\n"
    "            try:\n"
    "                with fastdl.use_backend(backend):\n"
    "                    loader_fill([eval(src)], dst, [off], [keep])\n"
    "                print('NO ERROR', flush=True)\n"
    "            except Exception as e:\n"
    "                print(type(e).__name__, str(e)[:200], flush=True)\n"
    "            assert int(dst.sum()) == 0, 'dst was written'\n"
)


def _check_fill_output(out: str) -> None:
    lines = [ln for ln in out.splitlines() if ": " in ln]
    assert len(lines) == 2 * len(_HUGE), out
    for ln in lines:
        assert ": ValueError loader_fill: offsets[0]" in ln, ln


def test_fill_rejects_huge_and_negative_offsets_and_sizes_torch():
    import contextlib
    import io

    ns: dict = {}
    exec(_FILL_CASES, ns)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ns["run"]("torch", _HUGE)
    _check_fill_output(buf.getvalue())


@needs_cpp
def test_fill_rejects_huge_and_negative_offsets_and_sizes_cpp():
    """A ValueError, never a write out of bounds (the C++ bounds check must not overflow): in a subprocess, so that
    a crash fails this test and names the case, not the whole run."""
    code = _FILL_CASES + f"run('cpp', {_HUGE!r})\n"
    env = dict(os.environ, PYTHONPATH=ROOT, FASTDL_NO_EXTENSION_WARNING="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit code {r.returncode}; last case printed:\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    _check_fill_output(r.stdout)
