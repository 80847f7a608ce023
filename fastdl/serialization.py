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
from typing import Any

import torch
from torch import nn

from ._recipe import (  # the recipe itself (below this module, fastdl.sparsity and fastdl.hf)
    QUANT_METHOD,
    _apply_recipe,
    _error,
    apply_recipe,
    is_fastdl_quantization_config,
    note_conversion,
    recipe,
)
from .nn._base import CheckpointError

_META_RECIPE = "fastdl.recipe"
_META_ALIASES = "fastdl.aliases"

__all__ = ["apply_recipe", "load", "load_pretrained", "note_conversion", "recipe", "save"]


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

