"""One call to accelerate a model: ``fastdl.convert(model, policy)`` and ``fastdl.report(model)``.

Policies:
  "fused"             nn.Linear followed by ReLU/GELU/SiLU inside an nn.Sequential becomes one FusedLinear with that
                      activation (the activation module becomes fastdl.nn.FusedActivation, an nn.Identity, so
                      state_dict keys do not move); every other Linear becomes FusedLinear(activation="none")
  "int8"              Int8Linear(mode="dynamic")   (W8A8, per-token activations, per-channel weights)
  "int8_weight_only"  Int8Linear(mode="weight_only")
  "int8_act7"         Int8Linear(mode="dynamic", act_bits=7): W8A8 with 7-bit unsigned activations and a zero point
                      per token (fbgemm's reduce_range class: coarser activations, the int32 products still exact);
                      among "auto"'s default candidates only where its GEMM is faster (the AVX2 int8 kernels: CPUs
                      without AVX512-VNNI), and chosen, like every candidate, only within ``max_error``
  "sparse24"          Sparse24Linear (weights pruned to 2:4 now if they are not already)
  "int4_weight_only"  Int4Linear (group_size 128, or 64 / 32 where in_features needs it; scale search); opt-in only:
                      never among "auto"'s default candidates (name it in ``candidates=``, and raise ``max_error``:
                      int4's output error is ~0.1 on Gaussian weights)
  "int4"              Int4Linear(mode="dynamic"): the same weights, activations quantized to int8 per group (W4A8,
                      integer products); opt-in like "int4_weight_only"
  "auto"              per layer, the candidate policy that is fastest over a *workload* of example inputs, within
                      ``max_error`` of the original layer's output and never slower than the original layer at any
                      of the workload's input shapes by more than ``noise`` (do no harm); else the original layer

Every converted layer chooses its execution path per bucket of input rows at run time (``fastdl.runtime_choice``: e.g.
an ``Int8Linear`` runs ``F.linear`` on its dequantized weight where that beats its int8 kernel), so "a policy's time at
a shape" is the time of the path it chooses there. "auto" times, per layer and per bucket of the workload, the
original layer and every path of every candidate on the layer's real input (captured with hooks while the workload
runs through the unconverted model), interleaved, and records the paths it chose as the layers' run-time decisions.
When the layers' weights together exceed the CPU's last-level cache, each timed call starts with the caches evicted:
in such a model a layer's weights come from memory at every forward pass (decoding a language model, M = 1).

The workload: ``example_inputs`` (one example: a tensor, a tuple of positional arguments or a dict of keyword
arguments), or ``workload=[example, ...]`` (several, e.g. batches of 1, 8 and 32 sequences), or
``example_inputs=... , batch_sizes=(1, 8, 32)`` (the example resized along dim 0: every tensor whose dim 0 is the
example's batch size is cut or repeated to each size). A layer's score is the geometric mean of its speed-ups over
the workload's buckets, so a batch of 1 counts as much as a batch of 32.

Layers are matched by exact type (``nn.Linear``; subclasses are left alone): the rule of ``fastdl._layers``, shared
with ``fastdl.quant`` and ``fastdl.sparsity``. Times measured by "auto" are cached per (machine, device, dtype,
layer shape, bucket), so converting the same kind of model a second time does not re-time (errors are always
measured, on the new weights). ``fastdl.save`` / ``fastdl.load`` and, for Hugging Face models, ``save_pretrained`` /
``fastdl.load_pretrained`` keep the converted layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import runtime_choice as choice  # (convert also has an argument runtime_choice)
from ._layers import LayerSite, find_layers, replace_layer
from ._recipe import note_conversion
from .nn.fused_linear import FusedActivation, FusedLinear
from .ops.fused_linear import activation_fn, activation_of

POLICIES = ("fused", "int8", "int8_weight_only", "int8_act7", "sparse24", "auto")
DEFAULT_CANDIDATES = ("fused", "int8", "int8_weight_only", "sparse24")  # "auto", plus int8_act7 where it pays
OPT_IN_POLICIES = ("int4", "int4_weight_only")  # accepted by convert and as "auto" candidates, never chosen unasked
# "auto" times each (layer shape, bucket) once, when asked: longer than a run-time decision (fastdl.runtime_choice), so
# that one noisy timing does not reject a candidate (it must not be slower than the original at *any* bucket): at least
# 10 ms per path until two calls agree within 3 %, at most 40 ms per path or 40 rounds.
CONVERT_TIMING = {"budget_s": 10e-3, "max_budget_s": 40e-3, "max_reps": 40}
# Cold timing (see _weights_exceed_cache) up to this many rows: the weight-streaming regime, where the weights
# come from decides the time. Above it a layer reads each weight byte once per 64+ rows of products (compute bound),
# and an eviction (reading twice the cache, ~2 ms) before every timed call would only lengthen the conversion.
COLD_MAX_ROWS = 64
ORIGINAL_TWIN = "original#2"
_DECISIONS: dict[tuple, dict] = {}  # timings of "auto": (machine, device, dtype, layer, calls, bucket, cold) -> seconds


@dataclass
class _Site:
    """One Linear layer to convert, with the activation module that follows it (if fusable)."""

    layer: LayerSite
    act_attr: str | None = None
    activation: str = "none"
    tied: tuple[str, ...] = ()  # parameters of other modules that are this layer's weight or bias (weight tying)

    @property
    def name(self) -> str:
        return self.layer.name

    @property
    def parent(self) -> nn.Module | None:
        return self.layer.parent

    @property
    def linear(self) -> nn.Linear:
        return self.layer.module


def _find_sites(model: nn.Module, filter_fn, fuse_activations: bool) -> tuple[list[_Site], list[str]]:
    """The Linear layers to convert. Shared and tied layers:

    * a module registered in several places (``nn.Sequential(l, nn.ReLU(), l)``, a block reused by two parents) is
      converted once and every place gets the same new module; an activation that follows it in one place is *not*
      fused into it (its other uses would apply it too), unless the module has one registration (a parent reused
      as a whole: the activation slot is shared as well);
    * a layer whose weight or bias is also another module's parameter (tied embeddings / lm_head, two Linears with
      one weight) records the other owners in ``site.tied``: "fused" keeps the parameters shared (still tied);
      the policies that replace the weight by another form would untie it, so they leave the layer as it is."""
    skipped: dict[str, str] = {}
    sites = []
    for layer in find_layers(model, filter_fn=filter_fn, skipped=skipped, where="fastdl.convert"):
        site = _Site(layer)
        following = layer.next_sibling() if fuse_activations and isinstance(layer.parent, nn.Sequential) else None
        if following is not None and activation_of(following[1]) is not None:
            site.act_attr, site.activation = following[0], activation_of(following[1])
        sites.append(site)
    places: dict[int, set] = {}
    for site in sites:
        places.setdefault(id(site.linear), set()).add((id(site.parent), site.layer.attr))
    owners: dict[int, list[tuple[int, str]]] = {}
    for name, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((id(mod), f"{name}.{pname}" if name else pname))
    for site in sites:
        if len(places[id(site.linear)]) > 1:  # the same module in several places: no activation fused into it
            site.act_attr, site.activation = None, "none"
        mine = {id(site.linear.weight), id(site.linear.bias)} - {id(None)}
        site.tied = tuple(sorted({n for pid in mine for mid, n in owners.get(pid, ()) if mid != id(site.linear)}))
    return sites, [f"{name}: {why}" for name, why in skipped.items()]


def _tied_note(site: _Site, policy: str) -> str:
    shown = ", ".join(site.tied[:4]) + (", ..." if len(site.tied) > 4 else "")
    return (f"left as is: its parameters are shared with {shown} (weight tying), which {policy} would untie; "
            "'fused' keeps them shared")


def _nbytes(mod: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _default_candidates(model: nn.Module) -> tuple[str, ...]:
    """"auto"'s candidates: DEFAULT_CANDIDATES, plus "int8_act7" for a CPU model where the int8 kernels are the AVX2
    family (its GEMM takes the 7-bit codes directly there, 1.1-1.4x the exact kernel; on VNNI CPUs it is the same
    kernel with coarser activations, and on CUDA PyTorch code: never faster, not worth timing)."""
    from ._extension import int8_cpu_kernels

    p = next(iter(model.parameters()), None)
    on_cpu = p is None or p.device.type == "cpu"
    return DEFAULT_CANDIDATES + (("int8_act7",) if on_cpu and int8_cpu_kernels() == "avx2" else ())


def _candidate(kind: str, site: _Site) -> nn.Module | None:
    """Build the replacement module of ``kind`` for a site; None when the kind does not apply."""
    lin = site.linear
    if kind == "fused":
        return FusedLinear.from_linear(lin, activation=site.activation)
    if kind in ("int8", "int8_weight_only", "int8_act7"):
        from .nn import int8 as int8_mod

        return int8_mod.Int8Linear.from_linear(lin, **int8_mod.POLICY_ARGS[kind])
    if kind in ("int4", "int4_weight_only"):
        group = next((g for g in (128, 64, 32) if lin.in_features % g == 0), None)
        if group is None:
            return None
        from .nn.int4 import Int4Linear

        return Int4Linear.from_linear(lin, group_size=group, mode="dynamic" if kind == "int4" else "weight_only")
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


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _act_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation as an out-of-place function (the model's own module may be in-place)."""
    if activation == "none":
        return lambda t: t
    return lambda t: activation_fn(t, activation)


def _call(model: nn.Module, example):
    if isinstance(example, dict):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def _first_tensor(obj):
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for v in items:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def _with_batch(example, batch: int, size: int):
    """``example`` with every tensor whose dim 0 is ``batch`` cut or repeated (cyclically) to ``size`` rows."""
    if isinstance(example, torch.Tensor):
        if example.dim() == 0 or example.shape[0] != batch:
            return example
        if size <= batch:
            return example[:size]
        reps = -(-size // batch)
        return example.repeat(reps, *([1] * (example.dim() - 1)))[:size]
    if isinstance(example, dict):
        return type(example)({k: _with_batch(v, batch, size) for k, v in example.items()})
    if isinstance(example, tuple):
        return tuple(_with_batch(v, batch, size) for v in example)
    if isinstance(example, list):
        return [_with_batch(v, batch, size) for v in example]
    return example


def make_workload(example_inputs=None, workload=None, batch_sizes=None) -> list:
    """The list of examples ``convert`` runs: see the module docstring. Raises ValueError/TypeError naming the
    argument when it cannot build one."""
    if workload is not None:
        if example_inputs is not None or batch_sizes is not None:
            raise ValueError(
                "fastdl.convert: pass workload=[...] alone, or example_inputs (with batch_sizes), not both"
            )
        if isinstance(workload, (torch.Tensor, dict)):
            raise TypeError("fastdl.convert: workload must be a list of examples (each a tensor, a tuple of "
                            f"positional arguments or a dict of keyword arguments), got a {type(workload).__name__}")
        examples = list(workload)
        if not examples:
            raise ValueError("fastdl.convert: workload is empty; give at least one example")
        return examples
    if example_inputs is None:
        return []
    if batch_sizes is None:
        return [example_inputs]
    sizes = list(batch_sizes) if not isinstance(batch_sizes, int) else [batch_sizes]
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"fastdl.convert: batch_sizes must be positive ints, got {batch_sizes!r}")
    t = _first_tensor(example_inputs)
    if t is None or t.dim() == 0:
        raise ValueError("fastdl.convert: batch_sizes needs example_inputs holding a tensor with a batch dimension "
                         "(dim 0)")
    return [_with_batch(example_inputs, t.shape[0], b) for b in sizes]


def convert(
    model: nn.Module,
    policy: str = "fused",
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    example_inputs=None,
    *,
    workload=None,
    batch_sizes=None,
    max_error: float = 0.02,
    noise: float = 0.03,
    candidates: tuple[str, ...] | None = None,
    runtime_choice: bool = True,
    verbose: bool = False,
) -> nn.Module:
    """Convert the Linear layers of ``model`` in place and return it; ``fastdl.report(model)`` describes the result.

    filter_fn(name, linear) -> bool chooses layers (default: all). The workload (``example_inputs``, ``workload`` or
    ``example_inputs`` + ``batch_sizes``: see the module docstring) is required by "auto"; with another policy it is
    run once after converting (without gradients) so that the layers make their run-time decisions for its shapes
    now. ``max_error`` bounds the relative error ``||out - ref|| / ||ref||`` of a candidate's output vs the original
    layer's at every workload input, and ``noise`` how much slower than the original layer a candidate may be at any
    of them (0.03 = 3 %, plus the noise measured there: the original is timed twice, and how far apart the two land
    is added) ("auto" only). ``candidates``: the policies "auto" considers (default ``DEFAULT_CANDIDATES``, plus
    "int8_act7" for a CPU model where the int8 kernels are the AVX2 family). ``runtime_choice=False`` pins every
    converted layer to its
    default path (``fastdl.runtime_choice``). When ``model`` itself is an ``nn.Linear``, the converted layer is returned
    (use the return value).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastdl.convert: model must be a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    if not isinstance(policy, str) or policy not in POLICIES + OPT_IN_POLICIES:
        raise ValueError(f"fastdl.convert: unknown policy {policy!r}; expected one of "
                         f"{', '.join(POLICIES + OPT_IN_POLICIES)}")
    if not (isinstance(noise, (int, float)) and 0 <= noise < 1):
        raise ValueError(f"fastdl.convert: noise must be a fraction in [0, 1), got {noise!r}")
    examples = make_workload(example_inputs, workload, batch_sizes)
    if policy == "auto" and not examples:
        raise ValueError("fastdl.convert(policy='auto') needs example_inputs (or workload=[...]) to time the layers on "
                         "real shapes")
    sites, skipped = _find_sites(model, filter_fn, fuse_activations=policy in ("fused", "auto"))
    rows = [{"layer": s, "kernel": "original", "note": "skipped"} for s in skipped]
    if policy == "auto":
        if candidates is None:
            candidates = _default_candidates(model)
        model, auto_rows = _convert_auto(model, sites, examples, max_error, noise, candidates, runtime_choice,
                                         verbose)
        rows += auto_rows
    else:
        built: dict[int, nn.Module | None] = {}  # a layer registered under several names is converted once
        for site in sites:
            if site.tied and policy != "fused":
                rows.append({"layer": site.name, "kernel": "original", "note": _tied_note(site, policy)})
                continue
            before = _nbytes(site.linear)
            if policy == "sparse24" and not _is_2_4(site.linear.weight):
                note = "pruned to 2:4 now (fine-tune with fastdl.sparsity.MaskedTraining to recover accuracy)"
            else:
                note = ""
            if id(site.linear) not in built:
                built[id(site.linear)] = _candidate(policy, site)
                if built[id(site.linear)] is not None and not runtime_choice:
                    built[id(site.linear)].runtime_choice = False
            new = built[id(site.linear)]
            if new is None:
                rows.append({"layer": site.name, "kernel": "original", "note": f"{policy} does not apply"})
                continue
            model = _replace(model, site, new, fused_act=policy == "fused")
            rows.append({
                "layer": site.name, "kernel": policy if policy != "fused" else f"fused[{site.activation}]",
                "in": site.linear.in_features, "out": site.linear.out_features,
                "bytes_before": before, "bytes_after": _nbytes(new), "note": note,
                **({"error": new.quantization_error, "note": "rel err: of the weight, ||W - Wq|| / ||W||"}
                   if getattr(new, "quantization_error", None) is not None else {}),
            })
        if examples:
            with torch.no_grad():
                for ex in examples:  # the layers decide their paths for these shapes now
                    _call(model, ex)
    model._fastdl_report = rows  # noqa: SLF001 (read by report())
    return note_conversion(model)


def _convert_auto(model, sites, examples, max_error, noise, kinds, runtime_choice, verbose):
    """Measure every site over the workload (hooks on the unconverted model), then replace each by its best policy.

    Memory: each layer's candidates (int8: ~0.27x and weight-only ~0.27x of the fp32 layer's bytes; 2:4: 0.56x,
    only for weights that are 2:4 already; fused shares the weights) live until the workload has run; derived weights
    made for a timing are dropped right after it."""
    state: dict[tuple, dict] = {}  # (id(linear), activation) -> {"site", "cands", "buckets": {bucket: result}}
    for site in sites:
        state.setdefault((id(site.linear), site.activation), {"site": site, "cands": None, "buckets": {}})

    def build(entry) -> dict:
        site = entry["site"]
        cands = {}
        is24 = _is_2_4(site.linear.weight)
        for kind in kinds:
            if kind == "sparse24" and not is24:
                continue
            if site.tied and kind != "fused":  # would untie the shared parameters (see _find_sites)
                continue
            try:
                mod = _candidate(kind, site)
            except (ImportError, RuntimeError, ValueError) as exc:
                if verbose:
                    print(f"fastdl.convert: {site.name}: {kind} unavailable ({exc})")
                continue
            if mod is not None:
                if not runtime_choice:
                    mod.runtime_choice = False
                cands[kind] = mod
        return cands

    def hook_for(entry):
        def hook(mod, args, out):
            if not args or not isinstance(args[0], torch.Tensor):
                return
            x = args[0].detach()
            if x.dim() < 1 or x.numel() == 0:
                return
            b = choice.bucket_of(x.numel() // x.shape[-1])
            if (b, x.dtype) in entry["buckets"]:
                return  # this bucket is measured already (an earlier example, or a second call)
            if entry["cands"] is None:
                entry["cands"] = build(entry)
            entry["buckets"][(b, x.dtype)] = _measure_bucket(entry["site"], entry["cands"], x, out.detach(), cold)
            for mod in entry["cands"].values():  # derived weights made for the timing (dequantized, decompressed)
                release = getattr(mod, "release_caches", None)  # are rebuilt on first use by the layer kept
                if release is not None:
                    release()
        return hook

    cold = _weights_exceed_cache(sites)
    hooks = [e["site"].linear.register_forward_hook(hook_for(e)) for e in state.values()]
    try:
        with torch.no_grad():
            for ex in examples:
                _call(model, ex)
    finally:
        for h in hooks:
            h.remove()

    rows = []
    for site in sites:
        entry = state[(id(site.linear), site.activation)]
        if not entry["buckets"]:
            rows.append({"layer": site.name, "kernel": "original", "note": "not reached by the workload"})
            continue
        best, row = _choose_policy(site, entry, max_error, noise)
        new = site.linear if best == "original" else entry["cands"][best]
        if best != "original":
            model = _replace(model, site, new, fused_act=best == "fused")
        row.update({"bytes_before": _nbytes(site.linear), "bytes_after": _nbytes(new)})
        if site.tied:
            row["note"] = (row.get("note", "") + "; " if row.get("note") else "") + (
                f"parameters shared with {', '.join(site.tied[:4])}: only 'fused' (which keeps them shared) tried")
        rows.append(row)
        if verbose:
            print(f"fastdl.convert: {site.name}: {row['kernel']} ({row['speedup']:.2f}x vs original)")
    return model, rows


def _weights_exceed_cache(sites) -> bool:
    """Whether the layers' weights together exceed the CPU's last-level cache: then a forward pass reads each layer's
    weights from memory (the other layers evicted them), and "auto" times the layers with their weights cold. Timed
    warm, a TinyLlama-shaped decoder's 2048 x 2048 projections at M = 1 read their 16 MB fp32 weight from the 32 MB L3
    and int8 lost its memory-bound lead: "auto" chose fp32 kernels that decoded at 0.68x the int8 policy."""
    weights = {id(s.linear.weight): s.linear.weight for s in sites}
    if not any(w.device.type == "cpu" for w in weights.values()):
        return False
    from ._machine import llc_bytes

    return sum(w.numel() * w.element_size() for w in weights.values()) > (llc_bytes() or (32 << 20))


def _measure_bucket(site: _Site, cands: dict, x: torch.Tensor, lin_out: torch.Tensor, cold: bool = False) -> dict:
    """Time the original layer and every path of every candidate on x (one interleaved run, or cached times; weights
    cold with ``cold``: see _weights_exceed_cache); the error of each against the original's output; each candidate's
    chosen path. Returns the bucket's result."""
    act = _act_fn(site.activation)
    lin = site.linear
    ref = act(lin_out)
    rows = x.numel() // x.shape[-1]
    b = choice.bucket_of(rows)
    cold = cold and rows <= COLD_MAX_ROWS
    # every call without nn.Module.__call__ (hooks: this runs inside one), like the candidates' _run_path
    # the original twice (an A/A pair): how far apart two timings of the same call land is this bucket's noise
    calls: dict[str, Callable] = {"original": lambda: act(lin.forward(x)), ORIGINAL_TWIN: lambda: act(lin.forward(x))}
    paths: dict[str, tuple[str, ...]] = {}
    for kind, mod in cands.items():
        paths[kind] = mod._choice_paths(x)
        for p in paths[kind]:
            if kind == "fused":
                calls[f"{kind}/{p}"] = lambda m=mod, p=p: m._run_path(p, x)
            else:
                calls[f"{kind}/{p}"] = lambda m=mod, p=p: act(m._run_path(p, x))
    key = (choice.machine_key(x.device), x.device.type, str(x.dtype), lin.in_features, lin.out_features,
           lin.bias is not None, site.activation, tuple(sorted(calls)), b, cold)
    times = _DECISIONS.get(key)
    was_cached = times is not None
    if times is None:
        info = {"rows": rows, "bucket": b, "layer": site.name, "purpose": "convert"}
        times = _DECISIONS[key] = choice.time_calls(calls, x.device, info, cold=cold, **CONVERT_TIMING)
    with torch.no_grad():
        errors = {name: _rel_err(fn(), ref) for name, fn in calls.items() if not name.startswith("original")}
    t1, t2 = times["original"], times.get(ORIGINAL_TWIN, times["original"])
    result = {"rows": rows, "bucket": b, "dtype": x.dtype, "input_shape": tuple(x.shape), "orig_s": (t1 + t2) / 2,
              "noise": abs(t1 - t2) / min(t1, t2) if min(t1, t2) > 0 else 0.0,
              "cached_times": was_cached, "kinds": {}}
    for kind, mod in cands.items():
        ptimes = {p: times[f"{kind}/{p}"] for p in paths[kind]}
        if mod.runtime_choice and choice.choice_mode() != "off":
            path = mod.known_path(x)  # a decision this process made already stands (layers of this shape use it)
            if path is None:
                path = choice.pick(ptimes, paths[kind][0])
                mod.record_choice(x, mod._choice_key(x), path, ptimes, source="convert")
            else:
                mod._choice_local[mod._choice_key(x)] = path
        else:
            path = paths[kind][0]
        result["kinds"][kind] = {
            "s": ptimes[path], "error": errors[f"{kind}/{path}"], "path": path,
            "paths": {p: {"ms": t * 1e3, "error": errors[f"{kind}/{p}"]} for p, t in ptimes.items()},
        }
    return result


def _choose_policy(site: _Site, entry: dict, max_error: float, noise: float) -> tuple[str, dict]:
    """The best candidate over the site's buckets: within max_error and not slower than the original by more than
    ``noise`` plus the bucket's measured noise (how far apart the two timings of the original landed) at every bucket,
    the highest geometric-mean speed-up (> 1); else "original"."""
    buckets = [entry["buckets"][k] for k in sorted(entry["buckets"], key=lambda k: (k[0], str(k[1])))]
    scores, why_not = {}, {}
    for kind in entry["cands"] or {}:
        res = [bk["kinds"].get(kind) for bk in buckets]
        if any(r is None for r in res):
            continue
        worst_err = max(r["error"] for r in res)
        slow = [bk for bk, r in zip(buckets, res) if r["s"] > bk["orig_s"] * (1.0 + noise + bk["noise"])]
        if worst_err > max_error:
            why_not[kind] = f"error {worst_err:.3g} > max_error"
        elif slow:
            why_not[kind] = f"slower at {choice.bucket_label(slow[0]['bucket'])}"
        else:
            scores[kind] = math.exp(sum(math.log(bk["orig_s"] / r["s"]) for bk, r in zip(buckets, res)) / len(res))
    best = max(scores, key=scores.get) if scores else "original"
    if best != "original" and scores[best] <= 1.0:
        best = "original"
    per_bucket = []
    for bk in buckets:
        r = bk["kinds"].get(best) if best != "original" else None
        t = r["s"] if r else bk["orig_s"]
        per_bucket.append({
            "rows": bk["rows"], "bucket": bk["bucket"], "label": choice.bucket_label(bk["bucket"]),
            "dtype": str(bk["dtype"]).removeprefix("torch."), "input_shape": bk["input_shape"],
            "orig_ms": bk["orig_s"] * 1e3, "time_ms": t * 1e3, "speedup": bk["orig_s"] / t, "noise": bk["noise"],
            "path": r["path"] if r else "original",
            "times": ", ".join(f"{p} {v['ms']:.3g}" for p, v in r["paths"].items()) if r else "",
        })
    candidates = {kind: {"ms": [bk["kinds"][kind]["s"] * 1e3 for bk in buckets if kind in bk["kinds"]],
                         "error": max((bk["kinds"][kind]["error"] for bk in buckets if kind in bk["kinds"]),
                                      default=None),
                         "paths": [bk["kinds"][kind]["path"] for bk in buckets if kind in bk["kinds"]],
                         **({"rejected": why_not[kind]} if kind in why_not else {})}
                  for kind in entry["cands"] or {}}
    orig_ms = sum(b["orig_ms"] for b in per_bucket)
    time_ms = sum(b["time_ms"] for b in per_bucket)
    speedup = math.exp(sum(math.log(b["speedup"]) for b in per_bucket) / len(per_bucket))
    error = 0.0 if best == "original" else max(bk["kinds"][best]["error"] for bk in buckets)
    return best, {
        "layer": site.name, "kernel": best if best != "fused" else f"fused[{site.activation}]",
        "in": site.linear.in_features, "out": site.linear.out_features, "input_shape": buckets[0]["input_shape"],
        "orig_ms": orig_ms, "time_ms": time_ms, "speedup": speedup, "error": error,
        "candidates": candidates, "buckets": per_bucket,
        "note": "cached timings" if all(bk.get("cached_times") for bk in buckets) else "",
    }


class Report(list):
    """Per-layer conversion report: a list of dicts (one per layer) that prints as a table, then a table of the
    per-bucket times ("auto": the original layer's vs the chosen policy's, and the path it runs) and of the run-time
    path decisions the converted layers have made so far."""

    COLUMNS = (("layer", "layer"), ("kernel", "kernel"), ("orig_ms", "orig ms"), ("time_ms", "ms"),
               ("speedup", "x orig"), ("error", "rel err"), ("bytes_before", "bytes before"),
               ("bytes_after", "bytes after"), ("resident", "resident now"), ("note", "note"))
    BUCKET_COLUMNS = (("layer", "layer"), ("rows", "rows M"), ("label", "bucket"), ("dtype", "dtype"),
                      ("orig_ms", "orig ms"), ("time_ms", "chosen ms"), ("speedup", "x orig"), ("noise", "noise"),
                      ("path", "path"), ("times", "paths timed (ms)"))

    @staticmethod
    def _table(columns, records) -> list[str]:
        def fmt(v):
            if v is None or v == "":
                return "-"
            if isinstance(v, float):
                return f"{v:.3g}"
            return str(v)

        cells = [[fmt(r.get(k)) for k, _ in columns] for r in records]
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
        lines = ["  ".join(h.ljust(w) for (_, h), w in zip(columns, widths)).rstrip()]
        lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
        return lines

    def bucket_rows(self) -> list[dict]:
        """One record per (layer, bucket): the times measured by "auto" and the decisions made at run time."""
        out = []
        for r in self:
            for b in r.get("buckets", []):
                out.append({"layer": r["layer"], **b})
            for d in r.get("runtime", []):
                times = ", ".join(f"{p} {t:.3g}" for p, t in d["times_ms"].items())
                out.append({"layer": r["layer"], "label": d["rows"], "dtype": d["dtype"], "path": d["path"],
                            "time_ms": d["times_ms"].get(d["path"]), "times": times or "(loaded/default)"})
        return out

    def __repr__(self) -> str:  # a REPL or notebook shows the table (fastdl.report returns it; print() prints it)
        return self.__str__()

    def __str__(self) -> str:
        lines = self._table(self.COLUMNS, self)
        buckets = self.bucket_rows()
        if buckets:
            lines += ["", "per bucket of input rows M (orig: the original layer; chosen: the converted layer's path)"]
            lines += self._table(self.BUCKET_COLUMNS, buckets)
        return "\n".join(lines)


def report(model: nn.Module) -> Report:
    """The per-layer table of the last ``fastdl.convert`` on this model (chosen kernel, time, error, bytes), with
    per-bucket times ("auto") and the run-time path decisions each converted layer has made so far. ``resident``
    is what each layer holds now (its ``memory_bytes()``: parameters, buffers and any kept cache), measured when the
    report is made: after inference it equals ``bytes_after`` unless a layer keeps an opted-in dense copy."""
    rows = []
    for r in getattr(model, "_fastdl_report", []):
        r = dict(r)
        try:
            mod = model.get_submodule(r["layer"]) if r["layer"] else model
        except AttributeError:
            mod = None
        if mod is not None:
            r["resident"] = mod.memory_bytes() if hasattr(mod, "memory_bytes") else _nbytes(mod)
        if isinstance(mod, choice.RuntimeChoice):
            seen = {(b["bucket"], b["dtype"]) for b in r.get("buckets", [])}  # measured by "auto": listed already
            r["runtime"] = [d for d in mod.runtime_decisions() if (d["bucket"], d["dtype"]) not in seen]
        rows.append(r)
    return Report(rows)
