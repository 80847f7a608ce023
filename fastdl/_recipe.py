"""The conversion recipe: what a model converted by fastdl records about itself, and how the record travels.

``recipe(model)`` says which layers are which fastdl module with which arguments (and which Linear layers are
2:4-pruned); ``apply_recipe`` converts an unconverted skeleton the same way. Every fastdl conversion calls
``note_conversion``: on a ``transformers`` model it sets ``config.quantization_config`` to an object that computes
the recipe when ``save_pretrained`` writes ``config.json``, and makes ``save_pretrained`` also write the guard entry
that stops transformers without fastdl (``fastdl.hf``). Where the recipe is stored is ``fastdl.serialization``'s
business (it re-exports ``recipe``, ``apply_recipe`` and ``note_conversion``); the transformers quantizer is
``fastdl.hf``'s. This module sits below both, and below ``fastdl.sparsity``, which records its pruning here.
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import torch
from torch import nn

from ._pruned import PERM_BUFFER, is_pruned, prepare_pruned
from ._version import __version__
from .nn._base import CheckpointError

RECIPE_FORMAT = "fastdl.recipe"
RECIPE_VERSION = 1
QUANT_METHOD = "fastdl"
GUARD_KEY = "transformers_weights"
GUARD = ("this checkpoint was quantized by fastdl (config.json: quantization_config.quant_method = 'fastdl'); "
         "run `import fastdl` (pip install fastdl) before from_pretrained, transformers alone cannot load its "
         "int8 / 2:4 layers")  # fmt: skip
_NEEDS_FASTDL = ("Int8Linear", "Sparse24Linear", "Int4Linear")  # stored form is not a float nn.Linear weight


# ------------------------------------------------------------------------------------------------------ recipe
def _module_types() -> dict[str, type]:
    from .nn import FusedActivation, FusedLinear, Int4Linear, Int8Linear, Sparse24Linear

    return {t.__name__: t for t in (FusedActivation, FusedLinear, Int4Linear, Int8Linear, Sparse24Linear)}


def recipe(model: nn.Module) -> dict:
    """Which layers of ``model`` are fastdl modules (with the arguments that rebuild them from an ``nn.Linear``) and
    which Linear layers are 2:4-pruned: ``{"format": "fastdl.recipe", "version": 1, "root": <model class>,
    "layers": {qualified name: {"type": ..., ...}}}`` (plain JSON values)."""
    types = _module_types()
    layers: dict[str, dict] = {}
    for name, m in model.named_modules():
        entry = None
        if type(m).__name__ in types and type(m) is types[type(m).__name__]:
            entry = {"type": type(m).__name__, **m.recipe()}
        if is_pruned(m):
            entry = entry or {"type": type(m).__name__}
            entry["pruned"] = {"permuted": getattr(m, PERM_BUFFER, None) is not None}
        if entry is not None:
            layers[name] = entry
    return {"format": RECIPE_FORMAT, "version": RECIPE_VERSION, "fastdl_version": __version__,
            "root": type(model).__name__, "layers": layers}


def _error(where: str, problem: str) -> CheckpointError:
    """The wording of every fastdl checkpoint error (as fastdl.nn._base.VersionedModule._error)."""
    return CheckpointError(f"{RECIPE_FORMAT} checkpoint {where!r}: {problem}")


def _check_recipe(rec: Any, where: str) -> dict:
    if not isinstance(rec, dict) or rec.get("format") != RECIPE_FORMAT or not isinstance(rec.get("layers"), dict):
        raise _error(where, f"not a fastdl conversion recipe: {rec!r:.300}")
    version = rec.get("version")
    if type(version) is not int or version < 1:
        raise _error(where, f"the recipe's format version must be an int from 1 to {RECIPE_VERSION}, got {version!r}")
    if version > RECIPE_VERSION:
        raise _error(where, f"format version {version!r} is newer than this fastdl's ({RECIPE_VERSION}); "
                            "upgrade fastdl to load it")  # fmt: skip
    root = rec.get("root")
    if root is not None and not isinstance(root, str):
        raise _error(where, f"the recipe's 'root' must be a class name (str), got {root!r:.100}")
    for name, entry in rec["layers"].items():
        if not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise _error(where, f"the recipe's layer {name!r:.100} must map to a dict with a 'type' name, got "
                                f"{entry!r:.200}")  # fmt: skip
    return rec


def _root_prefix(model: nn.Module, root: str | None) -> str:
    """The name of the submodule the recipe's names are relative to: a recipe recorded on an inner module (e.g. a
    transformers model's ``model.model``) applies to the same module of the full model."""
    if not root or type(model).__name__ == root:
        return ""
    for name, m in model.named_modules():
        if type(m).__name__ == root:
            return name + "."
    return ""


def _plain_linear(m: nn.Module, name: str) -> nn.Linear:
    """The ``nn.Linear`` a recipe entry is built from: the skeleton's layer, or a converted one turned back."""
    if type(m) is nn.Linear:
        return m
    if type(m).__name__ == "Conv1D" and hasattr(m, "nf") and type(m).__module__.startswith("transformers"):
        lin = nn.Linear(m.weight.shape[0], m.nf, bias=m.bias is not None, device="meta")  # GPT-2: weight [in, out]
        lin.weight = nn.Parameter(m.weight.detach().t(), requires_grad=m.weight.requires_grad)
        if m.bias is not None:
            lin.bias = m.bias
        return lin
    to_linear = getattr(m, "to_linear", None)
    if to_linear is not None:
        lin = to_linear()
        return lin[0] if isinstance(lin, nn.Sequential) else lin
    raise _error(name, f"this model has a {type(m).__name__} there; the checkpoint needs an nn.Linear (or a fastdl "
                       "layer)")  # fmt: skip


def _build(current: nn.Module, entry: dict, name: str) -> nn.Module:
    """The module ``entry`` describes, built from ``current``. Arguments a fastdl module rejects (a tampered or
    foreign recipe: unknown keys, wrong values) raise CheckpointError naming the layer and the entry."""
    try:
        return _build_entry(current, entry, name)
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise _error(name, f"the recipe's entry {entry!r:.300} cannot be built ({type(err).__name__}: "
                           f"{err})") from err  # fmt: skip


def _build_entry(current: nn.Module, entry: dict, name: str) -> nn.Module:
    types = _module_types()
    kind = entry.get("type")
    args = {k: v for k, v in entry.items() if k not in ("type", "pruned")}
    if kind in types and type(current) is types[kind] and current.recipe() == args:
        return current
    if kind == "FusedActivation":
        return types[kind](**args)
    lin = _plain_linear(current, name)
    if kind == "Linear":
        return lin
    if kind == "FusedLinear":
        return types[kind].from_linear(lin, **args)
    if kind == "Int8Linear":
        return types[kind].from_linear(lin, **args)
    if kind == "Int4Linear":  # round to nearest (not the scale search): the checkpoint's tensors replace it
        return types[kind].from_recipe(lin, **args)
    if kind == "Sparse24Linear":
        dtype_name = args.pop("dtype")
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise _error(name, f"the recipe's Sparse24Linear dtype must name a torch dtype, got {dtype_name!r:.100}")
        return types[kind].from_linear(lin, dtype=dtype, **args)
    raise _error(name, f"unknown layer type {kind!r} (written by a newer fastdl?)")


def apply_recipe(model: nn.Module, rec: dict) -> nn.Module:
    """Convert the layers of ``model`` as ``rec`` (from ``recipe``) says, in place; layers already converted that way
    are kept. Returns the model (the new module when the model itself is a recorded layer). A recipe that is not
    one, or one that does not fit the model, raises CheckpointError."""
    return _apply_recipe(model, rec, "")


def _apply_recipe(model: nn.Module, rec: Any, source: str) -> nn.Module:
    """``apply_recipe``; ``source`` (a file) is named in the errors."""
    def where(name: str) -> str:
        return f"{source}, layer {name}" if source else name

    rec = _check_recipe(rec, source or type(model).__name__)
    prefix = _root_prefix(model, rec.get("root"))
    for rel_name, entry in rec["layers"].items():
        name = prefix + rel_name if rel_name else prefix.rstrip(".")
        try:
            current = model.get_submodule(name) if name else model
        except AttributeError:
            raise _error(where(name), f"the checkpoint has a layer {name!r} ({entry.get('type')}) that this "
                                      f"{type(model).__name__} does not have") from None  # fmt: skip
        new = _build(current, entry, where(name))
        if new is not current:
            if name:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, new)
            else:
                model = new
        pruned = entry.get("pruned")
        if pruned:
            if not isinstance(pruned, dict):
                raise _error(where(name), f"the recipe's 'pruned' must be a dict, got {pruned!r:.100}")
            prepare_pruned(new, permuted=bool(pruned.get("permuted")))
    return model


# ------------------------------------------------------------------------------------------------ HF config hook
class _HFRecipe:
    """``config.quantization_config`` of a transformers model converted by fastdl: transformers writes
    ``to_dict()`` into config.json, which computes the recipe from the model at that moment."""

    quant_method = QUANT_METHOD

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)

    def to_dict(self) -> dict:
        m = self._model()
        rec = recipe(m) if m is not None else {}
        return hf_quantization_config(rec)

    def to_json_string(self, use_diff: bool = True) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def __deepcopy__(self, memo):  # inside a deepcopy of the model: follow the copy; else (config.to_dict): share
        m = self._model()
        if m is not None and id(m) in memo:
            return _HFRecipe(memo[id(m)])
        return self

    def __reduce__(self):  # pickled (torch.save(model), multiprocessing) as a plain snapshot
        return (dict, (self.to_dict(),))

    def __repr__(self) -> str:
        return f"_HFRecipe(quant_method={QUANT_METHOD!r}, model={type(self._model()).__name__})"


def hf_quantization_config(rec: dict) -> dict:
    """What ``save_pretrained`` writes as ``quantization_config``: ``quant_method: "fastdl"`` (the quantizer that
    ``import fastdl`` registers with transformers, ``fastdl.hf``), the recipe (whose ``version`` is the format
    version) and ``load_with``. When a layer is int8 or 2:4-compressed, transformers alone would load those tensors
    into plain ``nn.Linear`` layers (it skips an unknown method); so ``model.save_pretrained`` of such a model also
    writes ``config.json``'s ``transformers_weights`` guard (``GUARD``, below), which makes transformers alone stop
    with an error naming ``import fastdl``. A ``"fused"`` or pruned model keeps float ``nn.Linear`` weights and loads
    correctly either way."""
    needs = sorted({e.get("type") for e in rec.get("layers", {}).values()} & set(_NEEDS_FASTDL))
    head = {"quant_method": QUANT_METHOD, "load_with": "fastdl.load_pretrained(ModelClass, path)"}
    if needs:
        head["note"] = (f"written by fastdl: the {' and '.join(needs)} layers need fastdl: `import fastdl`, then "
                        "ModelClass.from_pretrained(path) (or fastdl.load_pretrained(ModelClass, path))")
    return {**head, **rec}


def is_fastdl_quantization_config(qc: Any) -> bool:
    return isinstance(qc, dict) and (qc.get("quant_method") == QUANT_METHOD or qc.get("format") == RECIPE_FORMAT)


def _hf_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "save_pretrained", None)):
        return None
    return config if callable(getattr(config, "to_json_string", None)) else None


def note_conversion(model: nn.Module) -> nn.Module:
    """Called by every fastdl conversion: on a transformers model, make ``save_pretrained`` record the recipe (see
    the module docstring). Returns ``model``."""
    config = _hf_config(model)
    if config is None:
        return model
    existing = getattr(config, "quantization_config", None)
    if isinstance(existing, _HFRecipe):
        owner = existing._model()
        if owner is not None and any(m is model for m in owner.modules()):
            return model  # already recorded for this model or the model it is part of (configs are shared)
    elif existing is not None and not is_fastdl_quantization_config(existing):
        return model  # another quantization method's config: leave it
    config.quantization_config = _HFRecipe(model)
    install_save_guard(model)  # save_pretrained also writes the guard that stops transformers without fastdl
    return model


# ------------------------------------------------------------------------------------------------ save guard
class _GuardedSave:
    """``model.save_pretrained`` of a model with fastdl layers: transformers' own, then ``config.json`` gets the
    guard entry (see ``fastdl.hf``) when the model holds layers transformers alone cannot load."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        out = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        write_guard(save_directory, self.model)
        return out


def needs_fastdl(model) -> bool:
    return any(type(m).__name__ in _NEEDS_FASTDL for m in model.modules())


def write_guard(save_directory, model) -> None:
    path = os.path.join(os.fspath(save_directory), "config.json")
    if not os.path.isfile(path) or not needs_fastdl(model):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return
    config[GUARD_KEY] = GUARD
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def install_save_guard(model) -> None:
    """Make ``model.save_pretrained`` write the guard entry (a per-instance attribute; ``dequantize`` removes it)."""
    if callable(getattr(type(model), "save_pretrained", None)) and "save_pretrained" not in model.__dict__:
        object.__setattr__(model, "save_pretrained", _GuardedSave(model))
