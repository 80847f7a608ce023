"""Save and load converted models like any other: ``fastdl.save`` / ``fastdl.load`` for any ``nn.Module``, and Hugging
Face ``model.save_pretrained(dir)`` / ``fastdl.load_pretrained(ModelClass, dir)`` for ``transformers`` models.

    fastdl.convert(model, "int8_weight_only")
    fastdl.save(model, "model.safetensors")          # or "model.pt" (torch.save format)
    ...
    model = fastdl.load(Net(), "model.safetensors")  # a plain, unconverted skeleton is enough

    model.save_pretrained("out")                     # a converted transformers model: safetensors + config.json
    model = fastdl.load_pretrained(LlamaForCausalLM, "out", dtype=torch.float32)

The weights are the model's ``state_dict`` (only tensors: every fastdl module keeps its format record in a small
uint8 tensor, see ``fastdl.nn._base``). Beside them goes the *recipe*: which layer is which fastdl module with which
arguments (``recipe(model)``), so that ``load`` can convert an unconverted skeleton the same way
(``apply_recipe``) before loading the weights into it. Where the recipe is kept:

* ``fastdl.save(model, "x.safetensors")``: in the safetensors header metadata (``"fastdl.recipe"``, JSON); tensors
  that share memory (tied weights) are stored once and their other names listed in ``"fastdl.aliases"``;
* ``fastdl.save(model, "x.pt")`` (any other suffix): ``torch.save({"fastdl_recipe": ..., "state_dict": ...})``,
  loadable with ``torch.load(weights_only=True)``;
* ``save_pretrained``: in ``config.json`` as ``quantization_config = {"quant_method": "fastdl", ...}``. Every fastdl
  conversion (``fastdl.convert``, ``quant.quantize_model`` / ``freeze_model``, ``sparsity.prune`` / ``sparsify``)
  of a ``transformers`` model sets ``model.config.quantization_config`` to an object that computes the recipe from
  the model when the config is written, so it always describes the model as it is saved.

``quant_method: "fastdl"`` is the quantization method ``import fastdl`` registers with transformers (``fastdl.hf``),
so ``ModelClass.from_pretrained(dir)`` rebuilds the model by itself; ``load_pretrained`` is a thin alias for it (and
still loads directories of older fastdl versions, whose int8 / 2:4 configs had no ``quant_method``). Without fastdl,
transformers would skip the unknown method and load int8 / 2:4 tensors into plain Linear layers; a model holding such
layers therefore also gets a ``transformers_weights`` guard in ``config.json`` that makes transformers alone stop with
an error naming ``import fastdl`` (see ``fastdl.hf``). A ``"fused"`` or pruned model keeps float ``nn.Linear``
weights and loads correctly either way (transformers logs "Unknown quantization type, got fastdl ... we will skip
the quantization").
"""

from __future__ import annotations

import json
import os
import weakref
from typing import Any

import torch
from torch import nn

from .nn._base import CheckpointError

RECIPE_FORMAT = "fastdl.recipe"
RECIPE_VERSION = 1
QUANT_METHOD = "fastdl"
_META_RECIPE = "fastdl.recipe"
_META_ALIASES = "fastdl.aliases"

__all__ = ["apply_recipe", "load", "load_pretrained", "note_conversion", "recipe", "save"]


# ------------------------------------------------------------------------------------------------------ recipe
def _module_types() -> dict[str, type]:
    from .nn import FusedActivation, FusedLinear, Int4Linear, Int8Linear, Sparse24Linear

    return {t.__name__: t for t in (FusedActivation, FusedLinear, Int4Linear, Int8Linear, Sparse24Linear)}


def recipe(model: nn.Module) -> dict:
    """Which layers of ``model`` are fastdl modules (with the arguments that rebuild them from an ``nn.Linear``) and
    which Linear layers are 2:4-pruned: ``{"format": "fastdl.recipe", "version": 1, "root": <model class>,
    "layers": {qualified name: {"type": ..., ...}}}`` (plain JSON values)."""
    from . import __version__
    from .sparsity import PERM_BUFFER, is_pruned

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
    from .sparsity import prepare_pruned

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


_NEEDS_FASTDL = ("Int8Linear", "Sparse24Linear", "Int4Linear")  # stored form is not a float nn.Linear weight


def hf_quantization_config(rec: dict) -> dict:
    """What ``save_pretrained`` writes as ``quantization_config``: ``quant_method: "fastdl"`` (the quantizer that
    ``import fastdl`` registers with transformers, ``fastdl.hf``), the recipe (whose ``version`` is the format
    version) and ``load_with``. When a layer is int8 or 2:4-compressed, transformers alone would load those tensors
    into plain ``nn.Linear`` layers (it skips an unknown method); so ``model.save_pretrained`` of such a model also
    writes ``config.json``'s ``transformers_weights`` guard (``fastdl.hf.GUARD``), which makes transformers alone stop
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
    from .hf import install_save_guard

    install_save_guard(model)  # save_pretrained also writes the guard that stops transformers without fastdl
    return model


# ------------------------------------------------------------------------------------------------ files
def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError as exc:
        raise ImportError("fastdl: .safetensors files need the safetensors package (pip install safetensors)") from exc
    return st


def _dedupe(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors that are views of the same memory (tied weights) kept once; returns (tensors, {alias: kept name})."""
    out, aliases, seen = {}, {}, {}
    for k, t in sd.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            aliases[k] = seen[key]
            continue
        seen[key] = k
        out[k] = t.contiguous()
    return out, aliases


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Save ``model``'s weights with its conversion recipe: safetensors for a ``.safetensors`` path, else the
    ``torch.save`` format. ``fastdl.load`` restores it into an unconverted (or converted) instance of the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastdl.save: model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"fastdl.save: the state dict has entries that are not tensors: {bad[:5]}")
    rec = recipe(model)
    if path.endswith(".safetensors"):
        tensors, aliases = _dedupe(sd)
        tensors = {k: v.cpu() for k, v in tensors.items()}
        meta = {"format": "pt", _META_RECIPE: json.dumps(rec), _META_ALIASES: json.dumps(aliases)}
        _safetensors().save_file(tensors, path, metadata=meta)
    else:
        torch.save({"fastdl_recipe": rec, "state_dict": sd}, path)


# errors of the file system or the environment, not of the file's content: raised as they are
_NOT_THE_FILE = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ImportError, MemoryError)


def _damaged(path: str, what: str, err: BaseException) -> CheckpointError:
    said = " ".join(str(err).split())  # one line (torch's load_state_dict message has tabs and newlines)
    return _error(path, f"{what} ({type(err).__name__}: {said[:300]})")


def _read_file(path: str, map_location) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The state dict and recipe of one file. A file that is not a readable checkpoint (truncated, random bytes,
    empty, a corrupted safetensors header, bad recipe metadata) raises CheckpointError naming the file, chained to
    the reader's own error; a missing file stays FileNotFoundError."""
    _check_map_location(map_location)
    if path.endswith(".safetensors"):
        st = _safetensors()
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
            sd = st.load_file(path, device=str(map_location))
        except _NOT_THE_FILE:
            raise
        except Exception as err:
            raise _damaged(path, "not a readable safetensors file", err) from err
        aliases = _json_meta(path, meta, _META_ALIASES, {})
        if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in aliases.items()):
            raise _error(path, f"its {_META_ALIASES} metadata must map names to names, got {aliases!r:.200}")
        for alias, kept in aliases.items():
            if kept not in sd:
                raise _error(path, f"its {_META_ALIASES} metadata makes {alias!r} an alias of {kept!r:.100}, which is "
                                   "not a tensor of the file")  # fmt: skip
            sd[alias] = sd[kept]
        rec = _json_meta(path, meta, _META_RECIPE, None)
        return sd, rec
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except _NOT_THE_FILE:
        raise
    except Exception as err:  # EOFError, UnpicklingError, miniz RuntimeError, OSError(EINVAL), UnicodeDecodeError
        raise _damaged(path, "not a readable torch.save checkpoint", err) from err
    if isinstance(obj, dict) and "state_dict" in obj and "fastdl_recipe" in obj:
        sd, rec = obj["state_dict"], obj["fastdl_recipe"]
    else:
        sd, rec = obj, None  # a plain state dict
    _check_state_dict(sd, path)
    return sd, rec


def _json_meta(path: str, meta: dict, key: str, default):
    text = meta.get(key)
    if text is None:
        return default
    try:
        return json.loads(text)
    except ValueError as err:  # JSONDecodeError
        raise _damaged(path, f"its {key} metadata is not valid JSON: {text[:80]!r}", err) from err


def _check_state_dict(sd: Any, path: str) -> None:
    if not isinstance(sd, dict):
        raise _error(path, f"it holds a {type(sd).__name__}, not a state dict (a dict of tensors)")
    for k, v in sd.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise _error(path, f"it is not a state dict: entry {k!r:.100} holds a {type(v).__name__}, not a tensor")


def _check_map_location(map_location) -> None:
    """A device that cannot be used here is the caller's error, raised before the file is read (so that it is not
    taken for a damaged file)."""
    if isinstance(map_location, (str, torch.device)):
        dev = torch.device(map_location)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"fastdl.load: map_location={map_location!r}, but CUDA is not available")


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except _NOT_THE_FILE:
        raise
    except (ValueError, OSError) as err:  # JSONDecodeError, UnicodeDecodeError, EINVAL
        raise _damaged(path, f"not a readable {what} (JSON)", err) from err


def _hf_weight_files(path: str) -> list[str]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        p = os.path.join(path, index)
        if os.path.isfile(p):
            weight_map = _read_json(p, "weight index")
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise _error(p, "its 'weight_map' must map tensor names to file names")
            return [os.path.join(path, n) for n in sorted(set(weight_map.values()))]
    for single in ("model.safetensors", "pytorch_model.bin"):
        p = os.path.join(path, single)
        if os.path.isfile(p):
            return [p]
    raise FileNotFoundError(f"fastdl: no model.safetensors, pytorch_model.bin or their index in {path}")


def _read_hf_dir(path: str, map_location) -> tuple[dict[str, torch.Tensor], dict | None]:
    sd: dict[str, torch.Tensor] = {}
    for f in _hf_weight_files(path):
        sd.update(_read_file(f, map_location)[0])
    rec = None
    cfg = os.path.join(path, "config.json")
    if os.path.isfile(cfg):
        config = _read_json(cfg, "config.json")
        qc = config.get("quantization_config") if isinstance(config, dict) else None
        if is_fastdl_quantization_config(qc):
            rec = qc
    return sd, rec


def _load_weights(model: nn.Module, sd: dict[str, torch.Tensor], strict: bool, where: str) -> None:
    """``load_state_dict``; keys missing from the checkpoint because they are tied to a loaded tensor (a
    transformers checkpoint stores ``lm_head.weight`` once when it is the embedding) are not an error."""
    try:
        result = model.load_state_dict(sd, strict=False)
    except CheckpointError as err:  # a fastdl layer's own check (names the layer): name the file too
        raise CheckpointError(f"{where}: {err}") from err
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as err:  # size mismatch, wrong dtype, ...
        raise _damaged(where, f"its weights do not fit this {type(model).__name__}", err) from err
    if not strict:
        return
    live = model.state_dict(keep_vars=True)
    loaded = {id(live[k]) for k in sd if k in live}
    missing = [k for k in result.missing_keys if id(live.get(k)) not in loaded]
    if missing or result.unexpected_keys:
        raise _error(where, f"it does not fit this {type(model).__name__}: missing keys {missing[:8]}, unexpected "
                            f"keys {result.unexpected_keys[:8]}")  # fmt: skip


def load(model: nn.Module, path: str | os.PathLike, *, strict: bool = True, map_location="cpu") -> nn.Module:
    """Load what ``fastdl.save`` (or ``save_pretrained``, given its directory) wrote into ``model``: its layers are
    converted first as the stored recipe says (an unconverted skeleton of the same architecture is enough), then the
    weights are loaded. A plain state dict (``torch.save(model.state_dict())``) loads too. Returns the model (use
    the return value: it is a new module when the model itself is a converted layer)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fastdl.load: model must be a torch.nn.Module, got {type(model).__name__}")
    path = os.fspath(path)
    sd, rec = _read_hf_dir(path, map_location) if os.path.isdir(path) else _read_file(path, map_location)
    if rec is not None:
        model = _apply_recipe(model, rec, path)
    _load_weights(model, sd, strict, path)
    return note_conversion(model)


# ------------------------------------------------------------------------------------------------ transformers
_LOAD_ARGS = ("dtype", "torch_dtype", "device_map", "attn_implementation")


def load_pretrained(model_class, path: str | os.PathLike, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` for a directory written by ``save_pretrained`` of a model
    converted by fastdl (a thin alias: fastdl's registered quantizer rebuilds it, see ``fastdl.hf``). A directory
    of an older fastdl (no ``quant_method``) is loaded here: the model is built from its config, its layers converted
    as ``config.json`` records, and the safetensors weights loaded into them; it comes back in eval mode. ``kwargs``:
    ``dtype`` (or ``torch_dtype``), ``attn_implementation``, ``device_map`` (one device: ``"cpu"``, ``"cuda:0"``,
    ``{"": device}``) and config overrides. A directory without a fastdl recipe is passed to
    ``model_class.from_pretrained`` as is."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"fastdl.load_pretrained: {path!r} is not a directory (a local save_pretrained "
                                "output is needed)")  # fmt: skip
    config_kwargs = {k: v for k, v in kwargs.items() if k not in _LOAD_ARGS}
    config, unused = model_class.config_class.from_pretrained(path, return_unused_kwargs=True, **config_kwargs)
    if unused:
        raise TypeError(f"fastdl.load_pretrained: unsupported arguments {sorted(unused)} (supported: "
                        f"{', '.join(_LOAD_ARGS)} and config attributes)")  # fmt: skip
    qc = getattr(config, "quantization_config", None)
    if not is_fastdl_quantization_config(qc) or qc.get("quant_method") == QUANT_METHOD:
        # a directory written by this fastdl: transformers loads it through fastdl's quantizer (fastdl.hf)
        from .hf import register

        register()
        return model_class.from_pretrained(path, **kwargs)
    # a checkpoint of an older fastdl (no quant_method): built, converted and loaded here
    del config.quantization_config
    build_kwargs = {k: kwargs[k] for k in ("dtype", "torch_dtype", "attn_implementation") if k in kwargs}
    model = model_class._from_config(config, **build_kwargs)
    model = _apply_recipe(model, qc, os.path.join(path, "config.json"))
    sd = _read_hf_dir(path, "cpu")[0]
    _load_weights(model, sd, True, path)
    _load_generation_config(model, path)
    device = _single_device(kwargs.get("device_map"))
    if device is not None:
        model.to(device)
    model.eval()
    return note_conversion(model)


def _single_device(device_map):
    if device_map is None:
        return None
    if isinstance(device_map, dict) and set(device_map) == {""}:
        device_map = device_map[""]
    if isinstance(device_map, (str, int, torch.device)) and device_map != "auto":
        return torch.device(device_map)
    raise ValueError(f"fastdl.load_pretrained: device_map must name one device (e.g. 'cpu', 'cuda:0' or "
                     f"{{'': 'cuda:0'}}), got {device_map!r}")  # fmt: skip


def _load_generation_config(model: nn.Module, path: str) -> None:
    if not os.path.isfile(os.path.join(path, "generation_config.json")) or not hasattr(model, "generation_config"):
        return
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig.from_pretrained(path)

