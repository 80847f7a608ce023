"""PrefetchLoader's nested batches: flatten a batch to its list of tensors and a spec, and rebuild it around new
tensors (part of ``fastdl.data``; see its docstring for what a batch may hold)."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Iterator, Mapping, MutableMapping

import torch


def flatten(obj, out: list, path: str = "batch"):
    """Append the tensors of ``obj`` to ``out``; return a spec to rebuild it. Containers without tensors and
    non-tensor leaves are kept by identity; containers with tensors are not referenced (the spec must not keep the
    source batch alive while the staged copy waits in the queue): a Mapping or list subclass is rebuilt from an
    emptied shallow copy (so a defaultdict keeps its factory, a transformers BatchEncoding its other attributes).
    A leaf that is none of these but holds tensors (a dataclass, a set, an object with tensor attributes) raises
    TypeError naming it: the loader could not move those tensors and would hand out the object unchanged."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return None
    n = len(out)
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        specs = [flatten(obj[k], out, f"{path}[{k!r}]") for k in keys]
        if len(out) == n:
            return ("o", obj)
        if type(obj) in (dict, collections.OrderedDict) or not isinstance(obj, MutableMapping):
            return ("d", type(obj), keys, specs, path)
        return ("m", _emptied_copy(obj, path), keys, specs, path)
    if isinstance(obj, (list, tuple)):
        specs = [flatten(x, out, f"{path}[{i}]") for i, x in enumerate(obj)]
        if len(out) == n:
            return ("o", obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return ("n", type(obj), specs, path)
        if isinstance(obj, list) and type(obj) is not list:
            return ("l", _emptied_copy(obj, path), specs, path)
        return ("s", type(obj), specs, path)
    where = _tensor_inside(obj)
    if where is not None:
        raise TypeError(
            f"fastdl PrefetchLoader: {path} is a {type(obj).__module__}.{type(obj).__qualname__} that holds tensors "
            f"({where}); the loader moves tensors that are batch leaves or inside Mappings, lists and tuples only, and "
            "would hand this object out unchanged. Return its tensors in a dict or tuple (e.g. "
            "dataclasses.asdict), or move them yourself."
        )
    return ("o", obj)


def _emptied_copy(obj, path: str):
    try:
        c = copy.copy(obj)
        c.clear()
        return c
    except Exception as exc:
        raise TypeError(
            f"fastdl PrefetchLoader: cannot rebuild {path}, a {type(obj).__qualname__} holding tensors "
            f"(copy.copy + clear() failed: {exc}); return a dict or list instead"
        ) from exc


def _tensor_inside(obj) -> str | None:
    """Where a non-container leaf holds a tensor (one level deep: its fields, attributes or set elements)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        values = {f.name: getattr(obj, f.name, None) for f in dataclasses.fields(obj)}
    elif isinstance(obj, (set, frozenset)):
        values = {"element": next((x for x in obj if isinstance(x, torch.Tensor)), None)}
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        values = vars(obj)
    else:
        return None
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            return f"{name}: Tensor"
        if isinstance(v, (list, tuple, Mapping)):
            inner = v.values() if isinstance(v, Mapping) else v
            if any(isinstance(x, torch.Tensor) for x in inner):
                return f"{name}: {type(v).__name__} of tensors"
    return None


def unflatten(spec, it: Iterator):
    if spec is None:
        return next(it)
    kind = spec[0]
    if kind == "o":
        return spec[1]
    if kind in ("d", "m"):
        items = [(k, unflatten(s, it)) for k, s in zip(spec[2], spec[3])]
        if kind == "m":
            rebuilt = spec[1]
            for k, v in items:
                rebuilt[k] = v
            return rebuilt
        return _construct(spec[1], items, spec[4])
    items = [unflatten(s, it) for s in spec[2]]
    if kind == "n":  # namedtuple
        return spec[1](*items)
    if kind == "l":
        spec[1].extend(items)
        return spec[1]
    return _construct(spec[1], items, spec[3])


def _construct(typ, items, path: str):
    try:
        return typ(items)
    except Exception as exc:
        raise TypeError(
            f"fastdl PrefetchLoader: cannot rebuild {path}, a {typ.__qualname__} holding tensors ({typ.__qualname__}"
            f"(items) failed: {exc}); return a dict, list or tuple instead"
        ) from exc


def tensor_bytes(obj) -> int:
    """Bytes of the strided tensors of a batch (in Mappings, lists and tuples), for the stats of a pass that hands
    batches out as they are: a walk, no copy, no check (nothing is moved, so nothing can be missed)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() if obj.layout == torch.strided and not obj.is_nested else 0
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
