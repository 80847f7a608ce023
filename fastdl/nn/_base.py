"""What the fastdl modules with derived weights share: a versioned extra state and caches of derived weights.

Extra state (``_extra_state`` in the state dict) is a record ``{"format": FORMAT, "version": FORMAT_VERSION, ...}``
of plain values (str, int, bool, None), stored as a 1-D ``uint8`` tensor holding its UTF-8 JSON text: the state dict
then holds only tensors, so it saves as safetensors (Hugging Face's format) as well as with ``torch.save``, and
loads with ``torch.load(weights_only=True)``. Records saved as a Python dict (older formats) still load.
``decode_extra_state`` reads either form.

Every problem with a checkpoint a fastdl module finds raises ``CheckpointError`` with the same wording:
``"<format> checkpoint '<key prefix>': <what is wrong>"``; every tensor is checked (a meta tensor without data, the
dtype, the shape, values the kernels rely on) before any is copied, so a checkpoint that does not load leaves the
module as it was.

Inputs: a forward input a module cannot take raises, in every mode and on every path, the same error naming the
layer (``"Sparse24Linear(in_features=8, out_features=4): x ..."``), the argument, what it accepts and what it got:
TypeError for a dtype (integer, bool, complex; Int8Linear also float64), ValueError for the shape (``x.shape[-1] !=
in_features``, a 0-d x), RuntimeError for a device other than the weights'. The hot path pays nothing for it: the
check runs where the run-time choice first sees an input (its key holds the dtype, so a rejected dtype never gets a
path) and in an ``except`` clause when a kernel raised (``input_error`` / ``check_input`` / ``raise_input_error``;
``CheckedForward`` is that ``forward`` for the modules whose work is one ``_forward(x)``).
"""

from __future__ import annotations

import json
import math
import reprlib
import sys
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["CheckedForward", "CheckpointError", "FLOAT_DTYPES", "VersionedModule", "WeightCache", "check_dtype_arg",
           "check_input", "decode_extra_state", "encode_extra_state", "input_error", "is_dtensor", "layer_name",
           "not_a_view", "raise_input_error"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# A JSON record of plain values is a few hundred bytes; a record nested deeper than this is not one (and json would
# recurse once per level: a deeply nested text raises RecursionError instead of a checkpoint error).
_MAX_RECORD_DEPTH = 32
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_REPR = reprlib.Repr()  # records in error messages: bounded in depth and length (a nested one made repr recurse)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 4, 12, 12, 120, 200


def is_dtensor(t) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (e.g. a parameter sharded by FSDP2), without importing
    torch.distributed: no tensor is a DTensor before that module is loaded."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint (state dict) a fastdl module cannot load: wrong format record, a newer format version, a missing
    key, or a tensor of the wrong dtype or shape. A RuntimeError, like torch's own ``load_state_dict`` errors (and a
    ValueError, what ``Sparse24Linear`` raised before this type existed)."""


def encode_extra_state(record: dict) -> torch.Tensor:
    """A record of plain values as a uint8 tensor of its UTF-8 JSON text."""
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode_extra_state(state: Any) -> dict | None:
    """The record of an ``_extra_state`` entry (a uint8 JSON tensor, or a dict from an older format); None when it is
    neither."""
    if isinstance(state, dict):
        return state
    if isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1 and not state.is_meta:
        data = bytes(state.detach().cpu().tolist())
        if _nesting_depth(data) > _MAX_RECORD_DEPTH:
            return None
        try:
            record = json.loads(data.decode())
        except (UnicodeDecodeError, ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return None
        return record if isinstance(record, dict) else None
    return None


def _nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings counted too: an upper bound)."""
    depth = deepest = 0
    for c in data.translate(None, delete=_NOT_BRACKETS):
        if c in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_dtype_arg(where: str, dtype, accepted: tuple = FLOAT_DTYPES, name: str = "dtype") -> None:
    """A ``dtype=`` argument (of a constructor or a conversion): None or one of ``accepted``, else TypeError."""
    if dtype is not None and dtype not in accepted:
        raise TypeError(f"{where}: {name} must be one of {dtype_names(accepted)} (or None), got {dtype!r}")


def layer_name(module: nn.Module) -> str:
    """``"Cls(in_features=K, out_features=N)"``: how the modules' input errors name the layer."""
    return f"{type(module).__name__}(in_features={module.in_features}, out_features={module.out_features})"


def _weight_device(module: nn.Module) -> torch.device | None:
    for t in module._parameters.values():
        if t is not None:
            return t.device
    for t in module._buffers.values():
        if t is not None:
            return t.device
    return None


def input_error(module: nn.Module, x: Any, dtypes: tuple = FLOAT_DTYPES) -> Exception | None:
    """The error a linear module (``in_features``, ``out_features``) raises for a forward input ``x`` it cannot
    take, or None when ``x`` is fine. Called where an input is first seen (the run-time choice) and when a kernel
    raised (the hot path checks nothing itself): TypeError for the dtype, ValueError for the shape, RuntimeError for
    the device (the house rule), each naming the layer, the argument, what it accepts and what it got."""
    where = layer_name(module)
    if not isinstance(x, torch.Tensor):
        return TypeError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        return TypeError(f"{where}: x must be a floating tensor of dtype {dtype_names(dtypes)}, got dtype {x.dtype}")
    k = module.in_features
    if x.dim() == 0:
        return ValueError(f"{where}: x must have at least 1 dimension [..., in_features = {k}], got a 0-d tensor")
    if x.shape[-1] != k:
        return ValueError(f"{where}: x.shape[-1] must equal in_features = {k}, got x of shape {tuple(x.shape)}")
    device = _weight_device(module)
    if device is not None and x.device != device:
        return RuntimeError(f"{where}: x is on device {x.device}, the layer's weights on {device}; move one of "
                            "them (.to(device)) so that both are on the same device")
    return None


def raise_input_error(module: nn.Module, x: Any, exc: BaseException, dtypes: tuple = FLOAT_DTYPES) -> None:
    """In a forward's ``except`` clause: raise the module's input error (from ``exc``) when ``x`` is what this module
    cannot take; return (the caller re-raises ``exc``) when ``x`` is fine or ``exc`` already is that error."""
    err = input_error(module, x, dtypes)
    if err is None or (type(err) is type(exc) and str(err) == str(exc)):
        return
    raise err from exc


def linear_init(in_features: int, out_features: int, bias: bool, device=None,
                dtype=None) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """``nn.Linear(in_features, out_features, bias)``'s initial weight ``[out, in]`` (kaiming-uniform) and bias
    (uniform in +-1/sqrt(in_features); None without one), drawn in that order: the fastdl layers start from it."""
    w = torch.empty((out_features, in_features), device=device, dtype=dtype)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    if not bias:
        return w, None
    bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
    return w, torch.empty(out_features, device=device, dtype=dtype).uniform_(-bound, bound)


def set_bias(module: nn.Module, b: torch.Tensor | None, requires_grad: bool = True) -> None:
    """``module.bias``: ``b`` as a parameter, or registered as None (no bias)."""
    if b is None:
        module.register_parameter("bias", None)
    else:
        module.bias = nn.Parameter(b, requires_grad=requires_grad)


def check_input(module: nn.Module, x: Any, dtypes: tuple = FLOAT_DTYPES) -> None:
    """Raise ``input_error(module, x, dtypes)`` when there is one: where the run-time choice first sees an input (no
    decision is kept for an input the layer rejects)."""
    err = input_error(module, x, dtypes)
    if err is not None:
        raise err


class CheckedForward:
    """``forward(x)`` of the linear modules whose work is ``self._forward(x)``: its output as a tensor that is not a
    view, and, when anything in it raises, the layer's own error for an ``x`` of a dtype outside ``INPUT_DTYPES``,
    a wrong shape or device (``raise_input_error``: no cost on calls that succeed; the ops name any other problem)."""

    INPUT_DTYPES: ClassVar[tuple] = FLOAT_DTYPES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return not_a_view(self._forward(x))
        except Exception as exc:
            raise_input_error(self, x, exc, self.INPUT_DTYPES)
            raise


def not_a_view(out: torch.Tensor) -> torch.Tensor:
    """``out`` as a tensor that is not a view, when it takes part in autograd. The ops compute ``[M, N]`` and return
    it reshaped to ``[..., N]``: a view of a tensor nothing else holds, which FSDP2 warns about in a module's output
    (an in-place op on a view drops its pre-backward hook). Same storage, no copy (~2 us, so inference calls, whose
    outputs need no gradient, skip it); safe because none of these ops saves its output for backward."""
    if not out.requires_grad or torch.compiler.is_compiling() or out._base is None:
        return out
    return torch.ops.aten._unsafe_view.default(out, out.shape)


class WeightCache:
    """Tensors derived from a module's weights (a quantized copy, a decompressed weight, ...), valid while the source
    tensors are the same storages with the same version: an optimizer step, ``load_state_dict`` (in-place copies) or
    a device move (new storages) invalidate it. Not part of the state dict."""

    def __init__(self) -> None:
        self._key = None
        self._items: dict = {}

    @staticmethod
    def _key_of(sources) -> tuple:
        return tuple((t.data_ptr(), t._version, t.device) for t in sources)

    def is_fresh(self, *sources: torch.Tensor) -> bool:
        """True when the cache was filled from exactly these tensors as they are now."""
        return self._key is not None and self._key == self._key_of(sources)

    def sync(self, *sources: torch.Tensor) -> None:
        """Drop everything if any source changed since the cache was filled; then it belongs to ``sources``."""
        key = self._key_of(sources)
        if key != self._key:
            self._items.clear()
            self._key = key

    def get(self, name, default=None):
        return self._items.get(name, default)

    def set(self, name, value) -> None:
        self._items[name] = value

    def pop(self, name, default=None):
        return self._items.pop(name, default)

    def names(self) -> list:
        return list(self._items)

    def clear(self) -> None:
        self._items.clear()
        self._key = None

    def tensors(self) -> list[torch.Tensor]:
        """The cached tensors (for byte counts)."""
        out = []

        def walk(v):
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (tuple, list)):
                for x in v:
                    walk(x)

        for v in self._items.values():
            walk(v)
        return out


# The memory promise of the quantized and sparse layers: a layer keeps no full-precision (dense) copy of its weight
# unless its user opts in with ``layer.dense_copy = True`` (the run-time choice may then also time the dense paths,
# whose copy costs out x in x itemsize bytes per dtype: in fp32 4x an int8 weight, 1.78x a 2:4 one). A copy of at most
# DENSE_COPY_FREE_BYTES may be kept without asking: a tiny layer (e.g. 64 x 64 fp32), where the op's per-call cost
# shows and the copy is a few KiB. fastdl.convert (also "auto") and the run-time choice never opt in by themselves.
DENSE_COPY_FREE_BYTES = 64 * 1024


def dense_copy_allowed(layer: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``layer`` may keep a dense copy of its weight in ``dtype`` (see DENSE_COPY_FREE_BYTES)."""
    if layer.__dict__.get("_dense_copy", False):
        return True
    itemsize = torch.empty((), dtype=dtype).element_size() if dtype.is_floating_point else 4
    return layer.in_features * layer.out_features * itemsize <= DENSE_COPY_FREE_BYTES


class DenseCopyOption:
    """The ``dense_copy`` opt-in of a quantized or sparse layer (see DENSE_COPY_FREE_BYTES). Setting it forgets the
    layer's run-time decisions (the candidate paths change); turning it off drops a kept copy."""

    @property
    def dense_copy(self) -> bool:
        return self.__dict__.get("_dense_copy", False)

    @dense_copy.setter
    def dense_copy(self, value: bool) -> None:
        self.__dict__["_dense_copy"] = bool(value)
        self._choice_reset()
        if not value:
            self.release_caches()


def resident_bytes(module: nn.Module, cache: WeightCache | None = None) -> int:
    """Bytes of storage a layer holds: its own parameters and buffers and the tensors of its weight cache, each
    storage counted once (a view shares its base's storage)."""
    seen, total = set(), 0
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    for t in tensors + (cache.tensors() if cache is not None else []):
        if t.is_meta:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


class VersionedModule(nn.Module):
    """Base class of the fastdl modules with a versioned extra state and a ``WeightCache``.

    A subclass sets ``FORMAT`` (the record's name) and ``FORMAT_VERSION``, returns its fields from
    ``_record_fields()`` and checks a loaded record in ``_check_record(record, where)`` (raise ``self._error``).
    """

    FORMAT: ClassVar[str] = ""
    FORMAT_VERSION: ClassVar[int] = 1

    def __init__(self) -> None:
        super().__init__()
        self._weight_cache = WeightCache()
        init_choice = getattr(self, "_init_choice", None)  # modules that choose a path per input (runtime_choice.py)
        if init_choice is not None:
            init_choice()

    # ------------------------------------------------------------------------------------------ extra state
    def _record_fields(self) -> dict:
        """The record's fields: the layer's shape here; a subclass adds its own
        (``{**super()._record_fields(), ...}``)."""
        return {"in_features": self.in_features, "out_features": self.out_features}

    def _check_record(self, record: dict, where: str) -> None:
        """Check a loaded record against this module; called after the format and version checks. Here: the shape it
        records is this layer's; a subclass checks its own fields after ``super()._check_record``."""
        for key, mine in (("in_features", self.in_features), ("out_features", self.out_features)):
            if key in record and record[key] != mine:
                raise self._error(where, f"_extra_state records {key} = {record[key]!r}, this layer has {mine}")

    def get_extra_state(self) -> torch.Tensor:
        return encode_extra_state({"format": self.FORMAT, "version": self.FORMAT_VERSION, **self._record_fields()})

    @classmethod
    def _error(cls, where: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{cls.FORMAT} checkpoint {where!r}: {problem}")

    @classmethod
    def read_record(cls, state: Any, where: str = "") -> dict:
        """The record of an ``_extra_state`` entry, checked: this module's format, a version this fastdl reads."""
        record = decode_extra_state(state)
        if record is None or record.get("format") != cls.FORMAT:
            shown = record if record is not None else state
            raise cls._error(where, f"_extra_state is not a {cls.FORMAT} record: {_REPR.repr(shown)}"[:400])
        version = record.get("version", 0)
        if not isinstance(version, int) or version < 1:
            raise cls._error(where, f"_extra_state has no valid format version: {_REPR.repr(record)}")
        if version > cls.FORMAT_VERSION:
            raise cls._error(
                where,
                f"format version {version} is newer than this fastdl's ({cls.FORMAT_VERSION}); upgrade fastdl to "
                "load it",
            )
        return record

    def set_extra_state(self, state: Any) -> None:
        self._check_record(self.read_record(state), "")

    @classmethod
    def _check_loaded(cls, where: str, key: str, t: Any, dtypes: tuple | None = None, shape: tuple | None = None,
                      *, target_meta: bool = False, what: str = "") -> torch.Tensor:
        """A checkpoint tensor ``key``, checked before anything is copied: a tensor with data (a meta tensor loads
        only into a layer that is on the meta device itself), of one of ``dtypes`` and of ``shape``."""
        if not isinstance(t, torch.Tensor):
            raise cls._error(where, f"{key} must be a tensor, got {type(t).__name__}")
        if t.is_meta and not target_meta:
            raise cls._error(where, f"{key} is a meta tensor (shape only, no data): the checkpoint was saved from a "
                                    "model on the meta device before its weights were loaded")
        if dtypes is not None and t.dtype not in dtypes:
            raise cls._error(where, f"{key} must be {what or 'of dtype ' + dtype_names(dtypes)}, got dtype {t.dtype}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise cls._error(where, f"size mismatch for {key}: the checkpoint has shape {tuple(t.shape)}, this layer "
                                    f"{tuple(shape)}")
        return t

    def _checked_bias(self, state_dict, prefix, missing_keys, unexpected_keys, on_meta=False):
        """The checkpoint's ``bias`` for a linear layer (``out_features``), checked; None when the layer has none
        (a checkpoint bias is then reported unexpected) or the checkpoint lacks it (reported missing)."""
        b = state_dict.get(prefix + "bias")
        if self.bias is None:
            if b is not None:
                unexpected_keys.append(prefix + "bias")
            return None
        if b is None:
            missing_keys.append(prefix + "bias")
            return None
        self._check_loaded(prefix, "bias", b, FLOAT_DTYPES, (self.out_features,), target_meta=on_meta,
                           what="a floating tensor (float32, bfloat16, float16, float64)")
        return b

    def _load_bias(self, b: torch.Tensor | None, take: bool) -> None:
        """A checked checkpoint bias (``_checked_bias``; None: nothing to load) into ``self.bias``: the tensor itself
        (cast to the bias dtype) when ``take`` (``load_state_dict(assign=True)`` into a meta layer), else copied."""
        if b is None:
            return
        if take:
            self.bias = nn.Parameter(b.detach().to(self.bias.dtype), requires_grad=self.bias.requires_grad)
        else:
            with torch.no_grad():
                self.bias.copy_(b)

    # ------------------------------------------------------------------------------------------ caches
    def release_caches(self) -> None:
        """Drop the cached derived weights (they are rebuilt on demand)."""
        self._weight_cache.clear()

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): the caches belong to the old tensors
        self._weight_cache.clear()
        reset = getattr(self, "_choice_reset", None)  # and run-time decisions to the old device / dtype
        if reset is not None:
            reset()
        return super()._apply(fn, recurse)
