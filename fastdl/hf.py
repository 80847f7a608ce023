"""Hugging Face ``transformers`` native: ``from_pretrained`` quantizes fastdl models while loading, and reloads them.

    from fastdl.hf import FastdlConfig
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=FastdlConfig(policy="int8_weight_only"))
    model.save_pretrained("out")             # config.json: quantization_config = {"quant_method": "fastdl", ...}

    model = AutoModelForCausalLM.from_pretrained("out")   # a fresh process: the same model, bit-identical outputs

A pip-installed fastdl registers itself when transformers loads its quantizer registry (``fastdl-kernels-hf.pth``
and ``_fastdl_hf_autoload``, installed with the wheel: fastdl/_hf_autoload.py), so that reload needs no fastdl
import; in editable installs and source checkouts (no .pth) or with ``FASTDL_NO_HF_AUTOLOAD=1``, ``import fastdl``
(or ``import fastdl.hf``) comes first, and transformers alone stops on a fastdl int8 / 2:4 checkpoint with an error
that says so.

``FastdlConfig(policy, group_size="auto", modules_to_not_convert=None)`` is a transformers quantization config
(``QuantizationConfigMixin``) registered under ``quant_method = "fastdl"`` together with ``FastdlHfQuantizer``
(``transformers.quantizers.register_quantization_config`` / ``register_quantizer``). Registration is lazy, so that
``import fastdl`` stays cheap and never imports transformers itself: it happens at once when transformers' quantizer
registry (``transformers.quantizers.auto``) is already imported, else right after it is (an import hook), or when
``fastdl.hf.FastdlConfig`` / ``register()`` is used.

Quantize while loading (``quantization_config=FastdlConfig(policy=...)``): transformers builds the model on the meta
device; each ``nn.Linear`` (and GPT-2's ``Conv1D``) that is converted is replaced by the fastdl layer as soon as its
weight has been read (one layer in full precision at a time, never the whole model); policies ``fused``, ``int8``,
``int8_weight_only`` (``group_size``: ``"auto"``, 16 or None, as ``Int8Linear``), ``int4`` (W4A8) and
``int4_weight_only`` (``Int4Linear`` with its scale search; ``group_size``: ``"auto"`` = 128, 32 or 64; layers whose
in_features is not a multiple of it raise, naming them) and ``sparse24`` (weights that are 2:4 already; other weights
raise, naming the layers). Kept in full precision, as with bitsandbytes / torchao:
``modules_to_not_convert`` (default: transformers' ``get_keys_to_not_convert``: the output embeddings ``lm_head``,
layers tied to the input embeddings, the last layer), layers whose weight is tied to another parameter, embeddings
and norms (not Linear layers); ``fastdl.report(model)`` lists what was converted and what was kept, and why.

Reload (``from_pretrained(dir)`` of a ``save_pretrained`` output, with ``import fastdl`` done first): the recipe in
``config.json`` converts the meta skeleton's layers; every fastdl layer's tensors are checked against the checkpoint
(its format record, dtypes, shapes: ``fastdl.CheckpointError`` naming the layer) before any weight is read; then
transformers loads the weights and each layer re-checks and prepares them (``load_state_dict`` of its own tensors).

Without fastdl imported, transformers 5 does not know the method: it would log "Unknown quantization type, got
fastdl ... we will skip the quantization" and load the int8 / 2:4 tensors into plain ``nn.Linear`` layers (wrong
outputs, no error). So a checkpoint that holds such layers also carries ``"transformers_weights": <GUARD>`` in
``config.json``: transformers alone stops with ``ValueError: The transformers file in the config seems to be
incorrect ...: <GUARD>``, a text that names the fix (``import fastdl``); fastdl's quantizer removes the entry
before transformers reads it. (``config.save_pretrained`` drops that key, so fastdl writes it after
``model.save_pretrained``: models converted by fastdl save through a small per-instance wrapper.)
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
import weakref
from typing import Any

from . import _recipe as recipes
from ._hf_checkpoint import _check_layer_against_checkpoint, _finish_loaded_layer, _read_headers
from ._recipe import GUARD, GUARD_KEY, QUANT_METHOD, install_save_guard

POLICIES = ("fused", "int8", "int8_weight_only", "int8_act7", "sparse24", "int4", "int4_weight_only")
GROUP_SIZES = ("auto", 16, None)  # the int8 policies' (Int8Linear)
INT4_GROUP_SIZES = ("auto", 32, 64, 128)  # the int4 policies' (Int4Linear; "auto": 128)
_REGISTRY = "transformers.quantizers.auto"

__all__ = ["GUARD", "POLICIES", "QUANT_METHOD", "FastdlConfig", "FastdlHfQuantizer", "dequantize",  # noqa: F822
           "register"]

_CLASSES: dict[str, type] | None = None


def __getattr__(name):  # FastdlConfig / FastdlHfQuantizer are defined on first use (they subclass transformers')
    if name in ("FastdlConfig", "FastdlHfQuantizer"):
        return _classes()[name]
    raise AttributeError(f"module 'fastdl.hf' has no attribute {name!r}")


def _classes() -> dict[str, type]:
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _define()
        register()
    return _CLASSES


def register() -> None:
    """Register ``FastdlConfig`` and ``FastdlHfQuantizer`` with transformers under ``quant_method = "fastdl"``
    (idempotent). Imports transformers' quantizer registry."""
    from transformers.quantizers import auto

    classes = _classes()
    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not classes["FastdlConfig"]:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a stale registration (module reloaded)
        auto.register_quantization_config(QUANT_METHOD)(classes["FastdlConfig"])
    if auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not classes["FastdlHfQuantizer"]:
        auto.AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        auto.register_quantizer(QUANT_METHOD)(classes["FastdlHfQuantizer"])


def _register_quietly() -> None:
    try:
        register()
    except Exception as exc:  # never break transformers' own import
        warnings.warn(f"fastdl.hf: could not register the 'fastdl' quantization method with transformers: "
                      f"{type(exc).__name__}: {exc}", stacklevel=2)  # fmt: skip


class _RegistryHook:
    """A one-shot ``sys.meta_path`` finder: when ``transformers.quantizers.auto`` is imported, register fastdl right
    after the module has run (so that ``import fastdl`` never imports transformers itself)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_quietly()

        spec.loader.exec_module = exec_module
        return spec

    def invalidate_caches(self) -> None:
        pass


def _install_hook() -> None:
    if _REGISTRY in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _RegistryHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryHook())


# ------------------------------------------------------------------------------------------------ layers
def _is_conv1d(m) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a Linear with its weight stored transposed ``[in, out]``."""
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers") and hasattr(m, "nf")


def _kernel_name(m) -> str:
    name = type(m).__name__
    if name == "Int8Linear":
        from .nn._int8_support import policy_of

        return policy_of(m.mode, m.act_bits)
    if name == "Sparse24Linear":
        return "sparse24"
    if name == "Int4Linear":
        return "int4" if m.mode == "dynamic" else "int4_weight_only"
    if name == "FusedLinear":
        return f"fused[{m.activation}]"
    return name


def _nbytes(mod) -> int:
    seen, total = set(), 0
    for t in list(mod.parameters()) + list(mod.buffers()):
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _release_file_pages(t) -> None:
    """``madvise(MADV_DONTNEED)`` on the whole pages of ``t`` when they are a mapping of a ``.safetensors`` file
    (transformers reads checkpoints through mmap): the weight has been converted and is not read again, and without
    this every page read stays resident until the file is closed, so that a quantize-on-load would peak at the
    checkpoint's size plus the quantized model. File-backed pages only (a later access would re-read the file); never
    anonymous memory. Linux only; a no-op elsewhere."""
    if sys.platform != "linux" or t.device.type != "cpu" or t.numel() == 0:
        return
    import ctypes
    import mmap

    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= start < hi:
                    if len(parts) < 6 or not parts[5].strip().endswith(".safetensors") or end > hi:
                        return
                    break
            else:
                return
        page = mmap.PAGESIZE
        a, b = -(-start // page) * page, end // page * page
        if b > a:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 4)  # DONTNEED
    except (OSError, ValueError, AttributeError):
        return


def _report_rows(model, converted: dict[str, dict], kept: dict[str, str]) -> list[dict]:
    """``fastdl.report`` rows: the converted layers, the Linear layers kept (and why), embeddings and norms."""
    from torch import nn

    rows = []
    norms = 0
    for name, m in model.named_modules():
        if name in converted:
            rows.append(converted[name])
        elif name in kept:
            rows.append({"layer": name, "kernel": "original", "note": kept[name]})
        elif type(m) is nn.Linear or _is_conv1d(m):
            rows.append({"layer": name, "kernel": "original", "note": "kept in full precision"})
        elif isinstance(m, nn.Embedding):
            rows.append({"layer": name, "kernel": "original", "note": "embedding: kept in full precision"})
        elif "norm" in type(m).__name__.lower():
            norms += 1
    if norms:
        rows.append({"layer": f"({norms} norm layers)", "kernel": "original",
                     "note": "norms: kept in full precision"})  # fmt: skip
    return rows


def dequantize(model, dtype=None):
    """Replace every fastdl layer of ``model`` by the plain ``nn.Linear`` it computes (int8 weights dequantized,
    2:4 weights decompressed; ``dtype``: of the new weights, default float32), in place; returns the model. For a
    model loaded by ``from_pretrained`` with a ``FastdlConfig``, ``model.dequantize()`` calls this and also removes
    the quantization config."""
    import torch
    from torch import nn

    from .nn import FusedActivation, FusedLinear, Int4Linear, Int8Linear, Sparse24Linear

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, (Int8Linear, Sparse24Linear, FusedLinear,
                                                                            FusedActivation, Int4Linear))]  # fmt: skip
    for name, m in targets:
        if isinstance(m, FusedActivation):
            new = nn.Identity()
        elif isinstance(m, Int8Linear):
            new = m.to_linear(dtype or torch.float32)
        else:
            new = m.to_linear()
        if dtype is not None:
            new = new.to(dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    model.__dict__.pop("_fastdl_report", None)
    model.__dict__.pop("save_pretrained", None)
    return model


# ------------------------------------------------------------------------------------------------ saving
# The guard entry that save_pretrained writes (install_save_guard) is part of the conversion record
# (fastdl._recipe), which every conversion calls; the quantizer below removes it on load.
def _is_guard(value: Any) -> bool:
    return isinstance(value, str) and "fastdl" in value and not value.endswith((".safetensors", ".json"))


# ------------------------------------------------------------------------------------------------ classes
def _define() -> dict[str, type]:
    import torch
    from torch import nn
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module
    from transformers.utils.quantization_config import QuantizationConfigMixin

    from .nn import CheckpointError

    class FastdlConfig(QuantizationConfigMixin):
        """How ``from_pretrained`` converts the model's Linear layers: ``policy`` (``"fused"``, ``"int8"``,
        ``"int8_weight_only"``, ``"int8_act7"`` (W8A8 with 7-bit activations, ``Int8Linear(act_bits=7)``),
        ``"sparse24"``, ``"int4"``, ``"int4_weight_only"``), ``group_size`` (int8 policies:
        ``"auto"``, 16 or None, as ``fastdl.nn.Int8Linear``; int4 policies: ``"auto"`` (128), 32 or 64) and
        ``modules_to_not_convert`` (names or patterns, as bitsandbytes' and torchao's; None: transformers' default,
        which keeps ``lm_head`` and tied layers). Read back from ``config.json`` it also carries the conversion recipe
        (``layers``) of a saved model."""

        def __init__(self, policy: str | None = None, group_size="auto", modules_to_not_convert=None,
                     **kwargs) -> None:  # fmt: skip
            self.quant_method = QUANT_METHOD
            kwargs.pop("quant_method", None)
            if policy is not None and (not isinstance(policy, str) or policy not in POLICIES):
                raise ValueError(f"FastdlConfig: unknown policy {policy!r}; known policies: "
                                 f"{', '.join(POLICIES)}")  # fmt: skip
            if isinstance(policy, str) and policy.startswith("int4"):
                if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
                    raise ValueError(f"FastdlConfig(policy={policy!r}): group_size must be 'auto' (128), 32, 64 or "
                                     f"128, got {group_size!r}")  # fmt: skip
            elif isinstance(group_size, bool) or group_size not in GROUP_SIZES:
                raise ValueError(f"FastdlConfig: group_size must be 'auto', 16 or None, got {group_size!r}")
            if policy in ("int8", "int8_act7") and group_size == 16:
                raise ValueError("FastdlConfig: group_size=16 needs policy='int8_weight_only' (W8A8 uses one scale "
                                 "per output channel); use group_size='auto' or None")  # fmt: skip
            if modules_to_not_convert is not None:
                if isinstance(modules_to_not_convert, str) or not all(
                        isinstance(n, str) for n in modules_to_not_convert):
                    raise TypeError(f"FastdlConfig: modules_to_not_convert must be a list of module names or "
                                    f"patterns, got {modules_to_not_convert!r:.200}")  # fmt: skip
                modules_to_not_convert = list(modules_to_not_convert)
            self.policy, self.group_size, self.modules_to_not_convert = policy, group_size, modules_to_not_convert
            self._recipe = None
            if "layers" in kwargs or "format" in kwargs:  # read back from a saved model's config.json
                rec = {k: kwargs.pop(k) for k in ("format", "version", "fastdl_version", "root", "layers")
                       if k in kwargs}  # fmt: skip
                self._recipe = recipes._check_recipe(rec, "config.json quantization_config")
            self._extra = kwargs  # load_with, note, entries of a newer fastdl: written back as they are
            self._model = None

        @property
        def recipe(self) -> dict | None:
            return self._recipe

        def bind(self, model) -> None:
            """From now on ``to_dict`` describes ``model`` as it is (the recipe is computed when it is saved)."""
            self._model = weakref.ref(model)

        def to_dict(self) -> dict[str, Any]:
            model = self._model() if self._model is not None else None
            rec = recipes.recipe(model) if model is not None else self._recipe
            out = {"quant_method": QUANT_METHOD, "policy": self.policy, "group_size": self.group_size,
                   "modules_to_not_convert": self.modules_to_not_convert, **self._extra}  # fmt: skip
            if rec is not None:
                out.update(recipes.hf_quantization_config(rec))
            return out

        def __deepcopy__(self, memo):
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            for k, v in self.__dict__.items():
                new.__dict__[k] = v if k == "_model" else __import__("copy").deepcopy(v, memo)
            return new

        def __reduce__(self):  # pickled as the plain dict (no weakref)
            return (_config_from_dict, (self.to_dict(),))

    class FastdlHfQuantizer(HfQuantizer):
        """transformers' quantizer for ``quant_method = "fastdl"`` (see the module docstring)."""

        requires_calibration = False

        def __init__(self, quantization_config, **kwargs) -> None:
            super().__init__(quantization_config, **kwargs)
            self._targets: dict[str, str] = {}  # on-the-fly: layer name -> policy
            self._kept: dict[str, str] = {}  # layer name -> why it stays in full precision
            self._converted: dict[str, dict] = {}  # layer name -> report row
            self._errors: list[str] = []
            self._where = "config.json"

        # -------------------------------------------------------------------------------- checks
        def validate_environment(self, *args, **kwargs) -> None:
            qc = self.quantization_config
            if self.pre_quantized and qc.recipe is None:
                raise CheckpointError("fastdl: config.json's quantization_config names quant_method 'fastdl' but "
                                      "holds no conversion recipe ('layers'); it was not written by fastdl")
            if not self.pre_quantized and qc.policy is None:
                raise ValueError(f"FastdlConfig: policy is required to quantize while loading (one of "
                                 f"{', '.join(POLICIES)})")  # fmt: skip
            device_map = kwargs.get("device_map")
            if isinstance(device_map, dict) and "disk" in device_map.values():
                raise ValueError("fastdl: disk offload (device_map with 'disk') is not supported for fastdl layers")

        def update_attn_implementation(self, config):
            # the guard entry is for transformers without fastdl; with it, the weights load from the usual files
            if _is_guard(getattr(config, GUARD_KEY, None)):
                delattr(config, GUARD_KEY)
            return config

        def is_serializable(self, *args, **kwargs) -> bool:
            return True

        @property
        def is_trainable(self) -> bool:
            return False

        @property
        def is_compileable(self) -> bool:
            return True

        # -------------------------------------------------------------------------------- before loading
        def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
            if checkpoint_files:
                self._where = os.path.dirname(checkpoint_files[0])
            if self.pre_quantized:
                self._prepare_saved(model, checkpoint_files)
            else:
                self._prepare_on_the_fly(model)
            return model

        def _prepare_on_the_fly(self, model) -> None:
            qc = self.quantization_config
            skip = self.get_modules_to_not_convert(model, qc.modules_to_not_convert, model._keep_in_fp32_modules)
            tied = set(model.all_tied_weights_keys) | set(model.all_tied_weights_keys.values())
            # in_features must be a multiple of this (2:4 groups, int4 groups)
            multiple = 4 if qc.policy == "sparse24" else _int4_group(qc.group_size) if qc.policy.startswith("int4") \
                else 1
            bad = []
            for name, m in model.named_modules():
                if type(m) is not nn.Linear and not _is_conv1d(m):
                    continue
                if not should_convert_module(name, skip):
                    default = " (transformers' default: output embeddings, tied and last layers)" \
                        if qc.modules_to_not_convert is None else ""
                    self._kept[name] = f"kept in full precision: modules_to_not_convert{default}"
                    continue
                if f"{name}.weight" in tied or f"{name}.bias" in tied:
                    self._kept[name] = "kept in full precision: its weight is tied to another parameter"
                    continue
                in_features = m.in_features if not _is_conv1d(m) else m.nx
                if in_features % multiple:
                    bad.append(f"{name} (in_features={in_features})")
                    continue
                self._targets[name] = qc.policy
            if bad:
                raise ValueError(f"FastdlConfig(policy={qc.policy!r}): {len(bad)} layer(s) cannot be converted, "
                                 f"in_features must be a multiple of {multiple}: {', '.join(bad[:8])}"
                                 f"{', ...' if len(bad) > 8 else ''}; add them to modules_to_not_convert")

        def _prepare_saved(self, model, checkpoint_files) -> None:
            rec = dict(self.quantization_config.recipe)
            rec["layers"] = _strip_base_prefix(model, rec)
            recipes._apply_recipe(model, rec, os.path.join(self._where, "config.json"))
            header = _read_headers(checkpoint_files)
            for name in rec["layers"]:
                m = model.get_submodule(name) if name else model
                if type(m).__name__ not in ("Int8Linear", "Sparse24Linear", "FusedLinear", "Int4Linear"):
                    continue
                if header is not None:
                    _check_layer_against_checkpoint(model, name, m, header, self._where)
                self._converted[name] = {"layer": name, "kernel": _kernel_name(m), "in": m.in_features,
                                         "out": m.out_features, "note": "loaded"}  # fmt: skip

        # -------------------------------------------------------------------------------- while loading
        def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
            if self.pre_quantized:
                return False
            layer, _, what = param_name.rpartition(".")
            return what == "weight" and layer in self._targets

        def get_quantize_ops(self):
            return _quantize_op(self)

        def convert_layer(self, model, key: str, w: torch.Tensor, missing_keys) -> None:
            """Replace the (meta) layer whose weight ``key`` has just been read by its fastdl layer."""
            name = key.rpartition(".")[0]
            policy = self._targets[name]
            try:
                old = model.get_submodule(name)
                if _is_conv1d(old):
                    w = w.t()
                out_f, in_f = w.shape
                bias = old.bias
                lin = nn.Linear(in_f, out_f, bias=bias is not None, device="meta")
                lin.weight = nn.Parameter(w, requires_grad=policy == "fused" and w.is_floating_point())
                if bias is not None:
                    lin.bias = bias
                new = _build(lin, policy, self.quantization_config.group_size)
            except Exception as exc:  # transformers would only log it: fail the whole load at the end instead
                self._errors.append(f"{name}: {exc}")
                return
            new.train(False)
            if policy != "fused":  # the float weight is not kept: drop its file pages from this process
                _release_file_pages(w)
            for t in list(new.parameters()) + list(new.buffers()):
                t._is_hf_initialized = True
            new._is_hf_initialized = True
            parent, _, attr = name.rpartition(".")
            owner = model.get_submodule(parent) if parent else model
            setattr(owner, attr, new)
            # the parent's _init_weights may reach into its children (GPT-2: init.normal_(attn.c_proj.weight)); this
            # layer has its weights (a dynamic Int8Linear on the CPU holds them packed: ``weight`` is None)
            owner._is_hf_initialized = True
            if missing_keys is not None:
                missing_keys.discard(key)
            self._converted[name] = {
                "layer": name, "kernel": _kernel_name(new), "in": in_f, "out": out_f,
                "bytes_before": sum(t.numel() * t.element_size() for t in (w, bias) if t is not None),
                "bytes_after": _nbytes(new), "note": "converted while loading",
            }

        # -------------------------------------------------------------------------------- after loading
        def _process_model_after_weight_loading(self, model, **kwargs):
            if self._errors:
                policy = self.quantization_config.policy
                raise ValueError(f"fastdl: from_pretrained with FastdlConfig(policy={policy!r}) could not convert"
                                 f" {len(self._errors)} layer(s); nothing was returned: "
                                 + "; ".join(self._errors[:8]) + ("; ..." if len(self._errors) > 8 else ""))
            if not self.pre_quantized:
                unconverted = sorted(set(self._targets) - set(self._converted))
                if unconverted:  # a weight transformers never read (not in the checkpoint)
                    raise CheckpointError(f"fastdl: {self._where}: no weight for the layer(s) {unconverted[:8]}, "
                                          "which were to be converted; nothing was returned")  # fmt: skip
            else:
                for name in self._converted:
                    _finish_loaded_layer(model.get_submodule(name) if name else model, name, self._where)
            model._fastdl_report = _report_rows(model, self._converted, self._kept)
            self.quantization_config.bind(model)
            install_save_guard(model)
            return model

        def _dequantize(self, model, dtype=None):
            dequantize(model, dtype)
            return model

    def _int4_group(group_size) -> int:
        return 128 if group_size == "auto" else group_size

    def _build(lin, policy: str, group_size):
        from .nn import FusedLinear, Int4Linear, Int8Linear, Sparse24Linear
        from .sparsity import is_2_4

        if policy == "fused":
            return FusedLinear.from_linear(lin, activation="none")
        if policy in ("int8", "int8_weight_only", "int8_act7"):
            from .nn._int8_support import POLICY_ARGS

            return Int8Linear.from_linear(lin, group_size=group_size, **POLICY_ARGS[policy])
        if policy == "sparse24":
            if not is_2_4(lin.weight):
                raise ValueError("its weight is not 2:4 sparse (at most 2 non-zeros in every group of 4 inputs); "
                                 "prune it first (fastdl.sparsity.prune, then fine-tune) or use another policy")
            return Sparse24Linear.from_linear(lin)
        if policy in ("int4", "int4_weight_only"):
            mode = "dynamic" if policy == "int4" else "weight_only"
            return Int4Linear.from_linear(lin, group_size=_int4_group(group_size), mode=mode)
        raise ValueError(f"unknown policy {policy!r}")

    return {"FastdlConfig": FastdlConfig, "FastdlHfQuantizer": FastdlHfQuantizer}


def _config_from_dict(d: dict):
    return _classes()["FastdlConfig"](**d)


_OP_CLASS = None


def _quantize_op(quantizer):
    """transformers' ConversionOps that hands each weight to ``quantizer.convert_layer`` (defined on first use:
    ``transformers.core_model_loading`` is imported by modeling_utils, after the registry)."""
    global _OP_CLASS
    if _OP_CLASS is None:
        from transformers.core_model_loading import ConversionOps

        class FastdlQuantize(ConversionOps):
            def __init__(self, hf_quantizer) -> None:
                self.hf_quantizer = hf_quantizer

            def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
                for key, value in input_dict.items():
                    value = value[0] if isinstance(value, list) else value
                    self.hf_quantizer.convert_layer(model, key, value, missing_keys)
                    del value
                return {}

        _OP_CLASS = FastdlQuantize
    return _OP_CLASS(quantizer)


def _strip_base_prefix(model, rec: dict) -> dict:
    """A recipe recorded on ``XForCausalLM`` ("model.layers.0...") applied to the base model (``AutoModel``)."""
    layers = rec["layers"]
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix or rec.get("root") == type(model).__name__ or hasattr(model, prefix):
        return layers
    if layers and all(n.startswith(prefix + ".") for n in layers):
        return {n[len(prefix) + 1:]: e for n, e in layers.items()}
    return layers


_install_hook()
