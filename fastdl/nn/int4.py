"""``Int4Linear``: an inference ``nn.Linear`` with 4-bit weights.

Modes (as ``Int8Linear``'s): ``"weight_only"`` (default) keeps the activations in floating point
(``fastdl.ops.int4_weight_only_linear``: the exact product with the dequantized weight); ``"dynamic"`` (W4A8)
quantizes them to int8 per row and per group of ``group_size`` features first and multiplies in integers
(``fastdl.ops.int4_a8_linear``: what llama.cpp does on CPUs; the kernels then run at the memory's speed; the extra
error is ~0.2 % of the output, about 1/50 of int4's own weight error).

The layer holds the packed codes (``qweight`` uint8 ``[out, in / 2]``), one float16 scale per group of
``group_size`` input features (``scales [out, in / group_size]``), optional zero points (``zeros`` uint8, same shape;
None: symmetric, z = 8), an optional input permutation (``input_permutation`` int64 ``[in]``: act-order GPTQ
checkpoints; the layer computes ``x[..., perm] @ W.T``) and the bias: 4 + 16 / group_size bits per weight (0.13x the
fp32 layer at group_size=128, 0.14x at 32), and nothing else on any path: its forward calls the op with the packed
tensors (no dense copy is ever kept; the PyTorch reference dequantizes per call, the C++ kernel reads the bytes; with
bf16 activations from 16 rows on an AVX512-BF16 CPU it dequantizes 8 MiB blocks of rows per call into a workspace
freed with the call, see ``fastdl.ops.int4``).
``memory_bytes()`` says what it holds. Inference only: x and bias get gradients (the op's frozen backward), the
weight does not.

Made with ``Int4Linear.from_linear(linear, group_size=128, method="search")`` (``fastdl.ops.quantize_int4``), from
a GPTQ or AWQ checkpoint (``from_gptq`` / ``from_awq``, exact), ``fastdl.convert(model, "int4_weight_only")``, or
``Int4Linear(in, out)`` (initialised like ``nn.Linear``, quantized with round-to-nearest) filled by
``load_state_dict``.

state_dict (format version 1): ``qweight``, ``scales``, ``zeros`` (asymmetric only), ``input_permutation`` (when
set), ``bias`` (if any) and ``_extra_state`` = the record ``{"format": "fastdl.Int4Linear", "version": 1,
"in_features", "out_features", "group_size", "symmetric", "method", "permuted", "quantization"}`` stored as a uint8
tensor of its JSON text: only tensors, so it saves as safetensors and loads with ``torch.load(weights_only=True)``.
The loaded tensors define the layer (group size, zero points and permutation are taken from the checkpoint); a plain
``nn.Linear`` checkpoint (``weight``) loads too: quantized on load with the layer's group_size / method / symmetric.
A checkpoint this layer cannot load raises ``fastdl.CheckpointError`` naming the key, before anything is copied.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import int4 as int4_ops
from ..runtime_choice import RuntimeChoice
from ._base import (
    FLOAT_DTYPES,
    CheckedForward,
    VersionedModule,
    check_dtype_arg,
    check_input,
    linear_init,
    resident_bytes,
    set_bias,
)

FORMAT = "fastdl.Int4Linear"
FORMAT_VERSION = 1
GROUP_SIZES = int4_ops.GROUP_SIZES
_KNOWN_KEYS = {"qweight", "scales", "zeros", "input_permutation", "bias", "_extra_state", "weight"}


MODES = ("weight_only", "dynamic")


def _check_config(in_features: int, group_size, method: str, mode: str = "weight_only") -> None:
    if mode not in MODES:
        raise ValueError(f"Int4Linear: mode must be 'weight_only' or 'dynamic', got {mode!r}")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise ValueError(f"Int4Linear: group_size must be one of 32, 64, 128, got {group_size!r}")
    if in_features % group_size:
        raise ValueError(f"Int4Linear: in_features = {in_features} must be a multiple of group_size = {group_size}")
    if method not in int4_ops.METHODS:
        raise ValueError(f"Int4Linear: method must be 'search' or 'rtn', got {method!r}")


def _quant_doc(group_size: int, symmetric: bool) -> str:
    z = "z = 8" if symmetric else "a uint8 zero point z (0..15)"
    return (f"int4 weight-only: W = (u - z) * float32(s), codes u 0..15 packed two per byte (llama.cpp Q4_0 order), "
            f"a float16 scale s and {z} per group of {group_size} input features")  # fmt: skip


class Int4Linear(CheckedForward, RuntimeChoice, VersionedModule):
    """Drop-in (inference) for ``nn.Linear(in_features, out_features, bias)`` with int4 weights; see the module
    docstring. ``dtype``: of the float weight it is initialised from and of the bias."""

    __constants__ = ["in_features", "out_features", "group_size"]
    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 group_size: int = 128, method: str = "search", symmetric: bool = True,
                 mode: str = "weight_only") -> None:  # fmt: skip
        super().__init__()
        _check_config(int(in_features), group_size, method, mode)
        self.mode = mode
        check_dtype_arg("Int4Linear", dtype)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.group_size, self.method, self.symmetric = group_size, method, bool(symmetric)
        self.quantization_error: float | None = None
        w, b = linear_init(in_features, out_features, bias, device, dtype or torch.float32)
        set_bias(self, b)
        # a random initial weight: round to nearest (cheap); ``method`` is what a float checkpoint is quantized with
        self._set(*int4_ops.quantize_int4(w, group_size, "rtn", self.symmetric), None)

    @classmethod
    def _blank(cls, in_features: int, out_features: int, group_size: int, method: str = "search",
               symmetric: bool = True, mode: str = "weight_only") -> Int4Linear:  # fmt: skip
        _check_config(in_features, group_size, method, mode)
        mod = cls.__new__(cls)
        VersionedModule.__init__(mod)
        mod.mode = mode
        mod.in_features, mod.out_features = int(in_features), int(out_features)
        mod.group_size, mod.method, mod.symmetric = group_size, method, bool(symmetric)
        mod.quantization_error = None
        return mod

    def _set(self, qweight, scales, zeros, perm) -> None:
        """Hold the packed tensors (buffers, as the state dict names them)."""
        self._buffers["qweight"] = qweight
        self._buffers["scales"] = scales
        self._buffers["zeros"] = zeros
        self._buffers["input_permutation"] = perm
        self.symmetric = zeros is None

    # ------------------------------------------------------------------------------------------ conversions
    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, method: str = "search",
                    symmetric: bool = True, mode: str = "weight_only") -> Int4Linear:  # fmt: skip
        """Quantize an ``nn.Linear`` (``fastdl.ops.quantize_int4``: ``method="search"`` or ``"rtn"``, symmetric or
        with zero points). ``quantization_error`` is then the relative weight error ``||W - Wq|| / ||W||``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int4Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        mod = cls._blank(linear.in_features, linear.out_features, group_size, method, symmetric, mode)
        w = linear.weight.detach()
        try:
            q, s, z = int4_ops.quantize_int4(w, group_size, method, symmetric)
        except ValueError as err:
            raise ValueError(f"Int4Linear.from_linear: linear.weight: {err}") from None
        mod._set(q, s, z, None)
        mod._take_bias(linear.bias)
        if not w.is_meta and w.numel():
            wf = w.float()
            err = (int4_ops.dequantize_int4(q, s, z, group_size) - wf).norm() / wf.norm().clamp_min(1e-30)
            mod.quantization_error = float(err)
        return mod.train(linear.training)

    @classmethod
    def from_recipe(cls, linear: nn.Linear, group_size: int = 128, method: str = "search",
                    symmetric: bool = True, mode: str = "weight_only") -> Int4Linear:  # fmt: skip
        """The layer ``recipe()`` describes, built from ``linear`` to load a checkpoint into (``fastdl.load``,
        ``load_pretrained``): quantized with round to nearest (one pass, instead of the scale search whose result
        the checkpoint's tensors replace); ``method`` is kept for float checkpoints loaded later."""
        mod = cls.from_linear(linear, group_size, "rtn", symmetric, mode)
        _check_config(mod.in_features, group_size, method)
        mod.method, mod.quantization_error = method, None
        return mod

    def _take_bias(self, bias) -> None:
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
                  format: str = "v1") -> Int4Linear:  # fmt: skip
        """A layer from a 4-bit GPTQ layer's checkpoint tensors (``fastdl.ops.import_gptq``: exact; act-order
        ``g_idx`` becomes ``input_permutation``)."""
        q, s, z, g, perm = int4_ops.import_gptq(qweight, qzeros, scales, g_idx, format=format)
        return cls._imported(q, s, z, g, perm, bias)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> Int4Linear:  # fmt: skip
        """A layer from a 4-bit AutoAWQ (GEMM) layer's checkpoint tensors (``fastdl.ops.import_awq``: exact)."""
        q, s, z, g = int4_ops.import_awq(qweight, qzeros, scales)
        return cls._imported(q, s, z, g, None, bias)

    @classmethod
    def _imported(cls, q, s, z, g, perm, bias) -> Int4Linear:
        N, K = q.shape[0], q.shape[1] * 2
        if bias is not None and (not isinstance(bias, torch.Tensor) or not bias.is_floating_point()
                                 or tuple(bias.shape) != (N,)):  # fmt: skip
            raise ValueError(f"Int4Linear: bias must be a floating tensor of shape [{N}], got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
        mod = cls._blank(K, N, g, "search", z is None)
        mod._set(q, s, z, perm)
        mod._take_bias(bias.float() if bias is not None else None)
        return mod.eval()

    def to_linear(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """The equivalent ``nn.Linear`` with the dequantized weight (input permutation undone)."""
        b = self._buffers
        w = int4_ops.dequantize_int4(b["qweight"], b["scales"], b["zeros"], self.group_size)
        perm = b.get("input_permutation")
        if perm is not None:
            full = torch.empty_like(w)
            full[:, perm] = w  # x[..., perm] @ w.T == x @ full.T
            w = full
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=w.device, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin

    # ----------------------------------------------------------------------------------------------- forward
    # forward(x) (CheckedForward): self._forward(x), with the layer's own error for an x it cannot take
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers  # not self.qweight: nn.Module.__getattr__ costs ~1 us per name
        perm = b.get("input_permutation")
        if perm is not None:
            x = x.index_select(-1, perm)
        op = int4_ops.int4_a8_linear if self.mode == "dynamic" else int4_ops.int4_weight_only_linear
        return op(x, b["qweight"], b["scales"], b["zeros"], self._parameters.get("bias"), self.group_size)

    # One path (the op): the run-time choice has nothing to choose; these serve fastdl.convert("auto").
    def _choice_layer(self) -> tuple:
        return ("Int4Linear", self.mode, self.group_size, self.symmetric, self.in_features, self.out_features,
                self.bias is not None)  # fmt: skip

    def _choice_paths(self, x: torch.Tensor) -> tuple[str, ...]:
        check_input(self, x)
        return ("kernel",)

    def _run_path(self, path: str, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x)

    def memory_bytes(self) -> int:
        """Bytes of storage held by the layer's parameters and buffers (each storage counted once)."""
        return resident_bytes(self, self._weight_cache)

    def release_caches(self) -> None:  # nothing derived is kept
        self._weight_cache.clear()

    def _apply(self, fn, recurse=True):
        """.to() / .half() / .cuda(): the codes, zero points and permutation are integers (unchanged by float casts);
        the scales stay float16 (only moved)."""
        scales = self._buffers.get("scales")
        super()._apply(fn, recurse)
        new = self._buffers.get("scales")
        if new is not None and new.dtype != torch.float16:
            self._buffers["scales"] = scales.to(new.device)
        return self

    def extra_repr(self) -> str:
        extra = "" if self.symmetric else ", zeros=True"
        if self._buffers.get("input_permutation") is not None:
            extra += ", input_permutation=True"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, mode={self.mode!r}{extra}")  # fmt: skip

    # ---------------------------------------------------------------------------------------------- state_dict
    def _record_fields(self) -> dict:
        return {
            **super()._record_fields(),
            "group_size": self.group_size,
            "mode": self.mode,
            "symmetric": self.symmetric,
            "method": self.method,
            "permuted": self._buffers.get("input_permutation") is not None,
            "quantization": _quant_doc(self.group_size, self.symmetric),
        }

    def _check_record(self, record: dict, where: str) -> None:
        if "mode" in record and record["mode"] not in MODES:
            raise self._error(where, f"_extra_state records mode = {record['mode']!r}; it must be one of {MODES}")
        super()._check_record(record, where)
        g = record.get("group_size")
        if "group_size" in record and (g not in GROUP_SIZES or isinstance(g, bool) or self.in_features % g):
            raise self._error(where, f"_extra_state records group_size = {g!r}; it must be 32, 64 or 128 and divide "
                                     f"in_features = {self.in_features}")  # fmt: skip

    def recipe(self) -> dict:
        """How to rebuild this layer from an ``nn.Linear`` of its shape (``fastdl.save``/``load`` use it; the tensors
        loaded afterwards set zero points and permutation)."""
        return {"group_size": self.group_size, "method": self.method, "symmetric": self.symmetric, "mode": self.mode}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name in ("qweight", "scales", "zeros", "input_permutation"):
            t = self._buffers.get(name)
            if t is not None:
                destination[prefix + name] = t if keep_vars else t.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # fmt: skip
        for key in state_dict:
            if key.startswith(prefix) and key[len(prefix):].split(".", 1)[0] not in _KNOWN_KEYS:
                unexpected_keys.append(key)
        record = None
        if prefix + "_extra_state" in state_dict:
            record = self.read_record(state_dict[prefix + "_extra_state"], prefix)
            self._check_record(record, prefix)
            self.mode = record.get("mode", self.mode)  # the checkpoint's activations mode (version 1 files: as is)
        on_meta = self._buffers["qweight"].is_meta
        take = on_meta and bool(local_metadata.get("assign_to_params_buffers", False))
        b = self._checked_bias(state_dict, prefix, missing_keys, unexpected_keys, on_meta)
        loaded = self._checked_weight(state_dict, prefix, record, missing_keys, on_meta)  # all checked first
        if loaded is not None:
            self._load_weight(*loaded, device=None if take else self._buffers["qweight"].device, take=take)
        self._load_bias(b, take)

    def _checked_weight(self, state_dict, prefix, record, missing_keys, on_meta):
        """``("float", weight)`` (a plain nn.Linear checkpoint, quantized on load), ``("int4", qweight, scales, zeros,
        perm, group_size)`` or None (reported as missing keys); raises CheckpointError for anything else."""
        N, K = self.out_features, self.in_features
        q = state_dict.get(prefix + "qweight")
        w = state_dict.get(prefix + "weight")
        if q is None:
            if w is None:
                missing_keys.append(prefix + "qweight")
                return None
            self._check_loaded(prefix, "weight", w, FLOAT_DTYPES, (N, K), target_meta=on_meta,
                               what="a floating tensor (a plain nn.Linear checkpoint) or absent (qweight)")
            if not w.is_meta and w.numel() and not bool(torch.isfinite(w).all()):
                raise self._error(prefix, "weight (a float checkpoint to quantize) holds NaN or Inf")
            return ("float", w)
        self._check_loaded(prefix, "qweight", q, (torch.uint8,), (N, K // 2), target_meta=on_meta,
                           what="uint8 (two 4-bit codes per byte)")
        s = state_dict.get(prefix + "scales")
        if s is None:
            missing_keys.append(prefix + "scales")
            return None
        self._check_loaded(prefix, "scales", s, (torch.float16,), target_meta=on_meta, what="float16")
        groups = s.shape[1] if s.dim() == 2 else 0
        g = K // groups if groups and K % groups == 0 else None
        if s.dim() != 2 or s.shape[0] != N or g not in GROUP_SIZES:
            raise self._error(prefix, f"size mismatch for scales: the checkpoint has shape {tuple(s.shape)}, this "
                                      f"layer needs [{N}, {K} / group_size] with group_size 32, 64 or "
                                      "128")  # fmt: skip
        if record is not None and record.get("group_size", g) != g:
            raise self._error(prefix, f"scales has {groups} groups per row (group_size {g}), _extra_state records "
                                      f"group_size = {record['group_size']}")  # fmt: skip
        if not s.is_meta and s.numel() and not bool(torch.isfinite(s).all()):
            bad = (~torch.isfinite(s)).nonzero()[0].tolist()
            raise self._error(prefix, f"scales must be finite; scales{bad} = {float(s[tuple(bad)])}")
        z = state_dict.get(prefix + "zeros")
        if z is not None:
            self._check_loaded(prefix, "zeros", z, (torch.uint8,), (N, groups), target_meta=on_meta,
                               what="uint8 (zero points 0..15)")
            if not z.is_meta and z.numel() and int(z.max()) > 15:
                raise self._error(prefix, f"zeros must hold zero points 0..15, got a maximum of {int(z.max())}")
        if record is not None and "symmetric" in record and record["symmetric"] != (z is None):
            raise self._error(prefix, f"_extra_state records symmetric = {record['symmetric']}, but zeros is "
                                      f"{'absent' if z is None else 'present'}")  # fmt: skip
        perm = state_dict.get(prefix + "input_permutation")
        if perm is not None:
            self._check_loaded(prefix, "input_permutation", perm, (torch.int64,), (K,), target_meta=on_meta,
                               what="int64 (a permutation of the input features)")
            if not perm.is_meta and not torch.equal(torch.sort(perm).values, torch.arange(K, device=perm.device)):
                raise self._error(prefix, f"input_permutation must be a permutation of 0..{K - 1}")
        if record is not None and "permuted" in record and record["permuted"] != (perm is not None):
            raise self._error(prefix, f"_extra_state records permuted = {record['permuted']}, but input_permutation "
                                      f"is {'absent' if perm is None else 'present'}")  # fmt: skip
        return ("int4", q, s, z, perm, g)

    @torch.no_grad()
    def _load_weight(self, kind, *tensors, device=None, take=False) -> None:
        if kind == "float":
            (w,) = tensors
            dev = w.device if take else device
            q, s, z = int4_ops.quantize_int4(w.to(dev), self.group_size, self.method, self.symmetric)
            self._set(q, s, z, None)
            return
        q, s, z, perm, g = tensors
        if not take:  # into this layer's device; the checkpoint's tensors are not aliased
            q, s = q.to(device, copy=True).contiguous(), s.to(device, copy=True).contiguous()
            z = z.to(device, copy=True).contiguous() if z is not None else None
            perm = perm.to(device, copy=True) if perm is not None else None
        self.group_size = g
        self._set(q, s, z, perm)
