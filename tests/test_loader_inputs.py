"""PrefetchLoader and batches it cannot move: leaves without tensors pass through untouched (the same object),
containers keep their type, and a leaf that holds tensors the loader cannot reach raises a TypeError naming the
element and its type - it never silently yields something else. The staging path is tested on the CPU with
``stage=True`` (the same code as a GPU target's); a plain CPU target passes every batch through unchanged."""

import collections
import dataclasses

import pytest
import torch

from fastdl.data import PrefetchLoader


class _Opaque:
    """An arbitrary Python object without tensors."""


class _HoldsTensor:
    def __init__(self):
        self.t = torch.ones(2)


@dataclasses.dataclass
class _Pair:
    x: torch.Tensor
    n: int = 3


class _MyDict(dict):
    pass


BACKENDS = ["auto", "torch"]  # auto: the C++ copy when the extension is built


def _one(batch, backend, stage=True):
    out = list(PrefetchLoader([batch], device="cpu", copy_backend=backend, stage=stage))
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_without_tensors_pass_through_untouched(backend):
    obj, arr = _Opaque(), object()
    x = torch.randn(3, 4)
    out = _one({"x": x, "obj": obj, "meta": {"id": 7, "name": "a", "none": None}, "raw": arr}, backend)
    assert out["obj"] is obj and out["raw"] is arr and out["meta"] == {"id": 7, "name": "a", "none": None}
    assert torch.equal(out["x"], x) and out["x"].data_ptr() != x.data_ptr()  # the tensor went through the ring


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_tensors_in_a_list_are_moved_one_by_one(backend):
    ragged = [torch.randn(2), torch.randn(3, 5), torch.zeros(0, 4), torch.arange(7)]
    out = _one(ragged, backend)
    assert type(out) is list and len(out) == 4
    for a, b in zip(out, ragged):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_containers_keep_their_type(backend):
    dd = collections.defaultdict(list, {"a": torch.ones(3)})
    out = _one(dd, backend)
    assert type(out) is collections.defaultdict and out.default_factory is list and torch.equal(out["a"], dd["a"])
    out = _one(_MyDict(b=torch.ones(2)), backend)
    assert type(out) is _MyDict
    pair = collections.namedtuple("pair", "x y")(torch.ones(1), "label")
    out = _one(pair, backend)
    assert type(out) is type(pair) and out.y == "label"


_UNREACHABLE = [
    ({"x": torch.ones(2), "o": _HoldsTensor()}, r"batch\['o'\]", "_HoldsTensor"),
    ([_Pair(torch.ones(2))], r"batch\[0\]", "_Pair"),
    ({"s": {torch.ones(1)}}, r"batch\['s'\]", "set"),
]


@pytest.mark.parametrize("batch, where, typename", _UNREACHABLE)
def test_a_leaf_holding_tensors_raises_naming_it(batch, where, typename):
    with pytest.raises(TypeError, match=rf"{where} is a .*{typename} that holds tensors"):
        list(PrefetchLoader([batch], device="cpu", stage=True))


@pytest.mark.parametrize("batch", [b for b, _, _ in _UNREACHABLE])
def test_cpu_passthrough_hands_out_any_batch_unchanged(batch):
    """Nothing is moved on a plain CPU target, so nothing can be missed: the batch itself, even one a staging pass
    would refuse."""
    assert _one(batch, "auto", stage=None) is batch
