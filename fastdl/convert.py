"""One call to accelerate a model: ``fastdl.convert(model, policy)`` and ``fastdl.report(model)``.

Policies:
  "fused"             nn.Linear followed by ReLU/GELU/SiLU inside an nn.Sequential becomes one FusedLinear with that
                      activation (the activation module becomes fastdl.nn.FusedActivation, an nn.Identity, so
                      state_dict keys do not move); every other Linear becomes FusedLinear(activation="none")
  "int8"              Int8Linear(mode="dynamic")   (W8A8, per-token activations, per-channel weights)
  "int8_weight_only"  Int8Linear(mode="weight_only")
  "sparse24"          Sparse24Linear (weights pruned to 2:4 now if they are not already)
  "auto"              for each layer, times every applicable candidate on the layer's real inputs (captured from
                      ``example_inputs``) on the model's device, measures its error against the original, and keeps
                      the fastest candidate within ``max_error``, never one slower than the original (do no harm)

Layers are matched by exact type (``nn.Linear``; subclasses are left alone): the rule of ``fastdl._layers``, shared
with ``fastdl.quant`` and ``fastdl.sparsity``. Decisions of "auto" are cached per (device, dtype, layer shape, input
shape), so converting the same kind of model a second time does not re-measure. ``fastdl.save`` / ``fastdl.load``
and, for Hugging Face models, ``save_pretrained`` / ``fastdl.load_pretrained`` keep the converted layers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._layers import LayerSite, find_layers, replace_layer
from .nn.fused_linear import FusedActivation, FusedLinear
from .serialization import note_conversion

POLICIES = ("fused", "int8", "int8_weight_only", "sparse24", "auto")
_ACTS: dict[type, Callable[[nn.Module], str | None]] = {
    nn.ReLU: lambda m: "relu",
    nn.SiLU: lambda m: "silu",
    nn.GELU: lambda m: "gelu" if m.approximate == "none" else "gelu_tanh",
}
_DECISIONS: dict[tuple, str] = {}


@dataclass
class _Site:
    """One Linear layer to convert, with the activation module that follows it (if fusable)."""

    layer: LayerSite
    act_attr: str | None = None
    activation: str = "none"

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def parent(self) -> nn.Module | None:
        return self.layer.parent

    @property
    def linear(self) -> nn.Linear:
        return self.layer.module


def _activation_of(mod: nn.Module) -> str | None:
    fn = _ACTS.get(type(mod))
    return fn(mod) if fn else None


def _find_sites(model: nn.Module, filter_fn, fuse_activations: bool) -> tuple[list[_Site], list[str]]:
    skipped: dict[str, str] = {}
    sites = []
    for layer in find_layers(model, filter_fn=filter_fn, skipped=skipped, where="fastdl.convert"):
        site = _Site(layer)
        following = layer.next_sibling() if fuse_activations and isinstance(layer.parent, nn.Sequential) else None
        if following is not None and _activation_of(following[1]) is not None:
            site.act_attr, site.activation = following[0], _activation_of(following[1])
        sites.append(site)
    return sites, [f"{name}: {why}" for name, why in skipped.items()]


def _nbytes(mod: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _candidate(kind: str, site: _Site) -> nn.Module | None:
    """Build the replacement module of ``kind`` for a site; None when the kind does not apply."""
    lin = site.linear
    if kind == "fused":
        return FusedLinear.from_linear(lin, activation=site.activation)
    if kind in ("int8", "int8_weight_only"):
        from .nn import int8 as int8_mod

        mode = "dynamic" if kind == "int8" else "weight_only"
        return int8_mod.Int8Linear.from_linear(lin, mode=mode)
    if kind == "sparse24":
        if lin.in_features % 4 != 0:
            return None
        from .nn import sparse24 as sp_mod

        return sp_mod.Sparse24Linear.from_linear(lin)
    raise ValueError(f"unknown conversion kind {kind!r}")


def _is_2_4(weight: torch.Tensor) -> bool:
    from .sparsity import is_2_4

    return is_2_4(weight)


def _replace(model: nn.Module, site: _Site, new: nn.Module, fused_act: bool) -> nn.Module:
    model = replace_layer(model, site.layer, new)
    if fused_act and site.act_attr is not None:
        setattr(site.parent, site.act_attr, FusedActivation(site.activation))
    return model


def _time(fn, x, device: str, reps: int = 15) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(reps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _capture_inputs(model: nn.Module, sites: list[_Site], example_inputs) -> dict[str, torch.Tensor]:
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for s in sites:

        def hook(mod, args, name=s.name):
            captured.setdefault(name, args[0].detach())

        hooks.append(s.linear.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            if isinstance(example_inputs, dict):
                model(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                model(*example_inputs)
            else:
                model(example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return captured


def convert(
    model: nn.Module,
    policy: str = "fused",
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    example_inputs=None,
    *,
    max_error: float = 0.02,
    candidates: tuple[str, ...] = ("fused", "int8", "int8_weight_only", "sparse24"),
    verbose: bool = False,
) -> nn.Module:
    """Convert the Linear layers of ``model`` in place and return it; ``fastdl.report(model)`` describes the result.

    filter_fn(name, linear) -> bool chooses layers (default: all). ``example_inputs`` (a tensor, a tuple of positional
    arguments or a dict of keyword arguments) is required by "auto". ``max_error`` bounds the relative error of a
    candidate's output vs the original layer's on the captured inputs ("auto" only). When ``model`` itself is an
    ``nn.Linear``, the converted layer is returned (use the return value).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastdl.convert: model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"fastdl.convert: unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
    if policy == "auto" and example_inputs is None:
        raise ValueError("fastdl.convert(policy='auto') needs example_inputs to time the layers on real shapes")
    sites, skipped = _find_sites(model, filter_fn, fuse_activations=policy in ("fused", "auto"))
    rows = [{"layer": s, "kernel": "original", "note": "skipped"} for s in skipped]
    if policy == "auto":
        model, auto_rows = _convert_auto(model, sites, example_inputs, max_error, candidates, verbose)
        rows += auto_rows
    else:
        built: dict[int, nn.Module | None] = {}  # a layer registered under several names is converted once
        for site in sites:
            before = _nbytes(site.linear)
            if policy == "sparse24" and not _is_2_4(site.linear.weight):
                note = "pruned to 2:4 now (fine-tune with fastdl.sparsity.MaskedTraining to recover accuracy)"
            else:
                note = ""
            if id(site.linear) not in built:
                built[id(site.linear)] = _candidate(policy, site)
            new = built[id(site.linear)]
            if new is None:
                rows.append({"layer": site.name, "kernel": "original", "note": f"{policy} does not apply"})
                continue
            model = _replace(model, site, new, fused_act=policy == "fused")
            rows.append({
                "layer": site.name, "kernel": policy if policy != "fused" else f"fused[{site.activation}]",
                "in": site.linear.in_features, "out": site.linear.out_features,
                "bytes_before": before, "bytes_after": _nbytes(new), "note": note,
            })
    model._fastdl_report = rows  # noqa: SLF001 (read by report())
    return note_conversion(model)


def _convert_auto(model, sites, example_inputs, max_error, kinds, verbose) -> tuple[nn.Module, list[dict]]:
    captured = _capture_inputs(model, sites, example_inputs)
    rows = []
    for site in sites:
        x = captured.get(site.name)
        if x is None:
            rows.append({"layer": site.name, "kernel": "original", "note": "not reached by example_inputs"})
            continue
        device = x.device.type
        act_mod = getattr(site.parent, site.act_attr) if site.act_attr else nn.Identity()
        is24 = _is_2_4(site.linear.weight)
        key = (device, str(x.dtype), tuple(x.shape), site.linear.in_features, site.linear.out_features,
               site.linear.bias is not None, site.activation, is24, max_error, tuple(kinds))
        cached = _DECISIONS.get(key)
        if cached is None:
            cached = _DECISIONS[key] = _measure_site(site, x, act_mod, device, max_error, kinds, is24, verbose)
            note = ""
        else:
            note = "cached decision"
        best = cached["kernel"]
        new = _candidate(best, site) if best != "original" else site.linear
        if best != "original":
            model = _replace(model, site, new, fused_act=best == "fused")
        rows.append({
            "layer": site.name, "kernel": best if best != "fused" else f"fused[{site.activation}]",
            "in": site.linear.in_features, "out": site.linear.out_features, "input_shape": tuple(x.shape),
            "orig_ms": cached["orig_ms"], "time_ms": cached["time_ms"],
            "speedup": cached["orig_ms"] / cached["time_ms"],
            "error": cached["error"], "bytes_before": _nbytes(site.linear), "bytes_after": _nbytes(new),
            "candidates": cached["candidates"], "note": note,
        })
        if verbose:
            print(f"fastdl.convert: {site.name}: {rows[-1]['kernel']} ({rows[-1]['speedup']:.2f}x vs original)")
    return model, rows


def _measure_site(site, x, act_mod, device, max_error, kinds, is24, verbose) -> dict:
    """Time the original layer and every applicable candidate on x; pick the fastest within max_error."""

    def original(inp, lin=site.linear, a=act_mod):
        return a(lin(inp))

    with torch.no_grad():
        ref = original(x)
    results = {"original": (_time(original, x, device), 0.0)}
    for kind in kinds:
        if kind == "sparse24" and not is24:
            continue
        try:
            mod = _candidate(kind, site)
        except (ImportError, RuntimeError, ValueError) as exc:
            if verbose:
                print(f"fastdl.convert: {site.name}: {kind} unavailable ({exc})")
            continue
        if mod is None:
            continue

        def run(inp, m=mod, k=kind, a=act_mod):
            out = m(inp)
            return out if k == "fused" else a(out)

        with torch.no_grad():
            err = _rel_err(run(x), ref)
        results[kind] = (_time(run, x, device), err)
    t_orig = results["original"][0]
    ok = {k: v for k, v in results.items() if v[1] <= max_error}
    best = min(ok, key=lambda k: ok[k][0])
    if ok[best][0] >= t_orig:  # do no harm: never slower than the original layer
        best = "original"
    return {
        "kernel": best, "orig_ms": t_orig * 1e3, "time_ms": results[best][0] * 1e3, "error": results[best][1],
        "candidates": {k: {"ms": v[0] * 1e3, "error": v[1]} for k, v in results.items()},
    }


class Report(list):
    """Per-layer conversion report: a list of dicts that prints as a table."""

    COLUMNS = (("layer", "layer"), ("kernel", "kernel"), ("orig_ms", "orig ms"), ("time_ms", "ms"),
               ("speedup", "x orig"), ("error", "rel err"), ("bytes_before", "bytes before"),
               ("bytes_after", "bytes after"), ("note", "note"))

    def __str__(self) -> str:
        def fmt(v):
            if v is None or v == "":
                return "-"
            if isinstance(v, float):
                return f"{v:.3g}"
            return str(v)

        cells = [[fmt(r.get(k)) for k, _ in self.COLUMNS] for r in self]
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(self.COLUMNS)]
        lines = ["  ".join(h.ljust(w) for (_, h), w in zip(self.COLUMNS, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)) for c in cells]
        return "\n".join(lines)


def report(model: nn.Module) -> Report:
    """The per-layer table of the last ``fastdl.convert`` on this model (chosen kernel, time, error, bytes)."""
    return Report(getattr(model, "_fastdl_report", []))
