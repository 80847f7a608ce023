"""``Int8Linear``: an ``nn.Linear`` with int8 weights, for inference and for quantization-aware training (QAT).

Modes
  ``"dynamic"``      W8A8: activations are quantized per token on the fly, the GEMM runs in int8 with int32
                     accumulation, dequant + bias in the epilogue (``fastdl.ops.int8_linear``). Per-output-channel
                     weight scales. ``act_bits=7`` (opt-in, inference layers) quantizes activations to 7-bit unsigned
                     codes with a zero point per token (the accuracy class of fbgemm's ``reduce_range``): on CPUs
                     without AVX512-VNNI its GEMM runs ``vpmaddubsw`` on the codes directly, 1.1-1.4x the exact 8-bit
                     kernel there; elsewhere it is the same kernel with coarser activations.
  ``"weight_only"``  activations stay float; the int8 weight is converted inside the kernel
                     (``fastdl.ops.int8_weight_only_linear``). By default (``group_size=16``) the weight has a
                     per-channel fp32 scale and an 8-bit code per group of 16 input features
                     (``fastdl.ops.quantize_per_group``: 8.5 bits per weight, about half the error of per-channel
                     scales: 0.47 % instead of 0.87 % on Gaussian data); ``group_size=None`` gives per-channel scales.

Inference (``trainable=False``, the default) holds only the int8 weight, its fp32 scales and the bias (about a quarter
of the fp32 layer's bytes). On the CPU, when the C++ kernels are available, a dynamic-mode layer holds its weight
*once*, in the VNNI-packed layout of the kernel (``weight_packed``/``weight_comp``, non-persistent buffers made at
construction, load and device move - never per call); ``weight`` is then None and ``qweight`` unpacks it.

Memory: an inference layer holds its int8 weight, scales and bias, and nothing else (``memory_bytes()``), at every
M and on every path: where a GEMM needs float weights the kernels dequantize them panel by panel as they pack them
(the AVX2 family from 64 rows, the AVX-512 families for grouped weights from 128 rows; ``csrc/cpu/int8.cpp``), never
into a kept full-size copy.

Paths (inference layers): the layer runs its int8 op (``"kernel"``). Two more paths need a dense copy of the weight
(``out x in`` in x's dtype: in fp32 4x the int8 weight, what the original ``nn.Linear`` held): ``"dequant"``
(``F.linear`` on it) and, on the CPU with the C++ kernels, ``"dequant_fused"`` (``fastdl.ops.fused_linear`` on it).
They are candidates of the run-time choice (per bucket of input rows, ``fastdl.runtime_choice``: measured on the first
no-grad call at the bucket, cached, saved with ``fastdl.save_decisions``) only when the layer may keep that copy: a
user opts in with ``layer.dense_copy = True`` (the copy is then kept while a bucket of that dtype chooses one of
them; ``cache_bytes()`` counts it, ``release_caches()`` drops it), or the copy is tiny (at most
``fastdl.nn.DENSE_COPY_FREE_BYTES``, 64 KiB: e.g. 64 x 64 fp32, where the op's per-call cost shows). Neither
``fastdl.convert`` nor the run-time choice opts in. ``runtime_choice = False`` pins the op.

``activation`` (one of ``fastdl.ops.ACTIVATIONS``, default "none"; as ``FusedLinear`` and ``Sparse24Linear`` take it) is
applied to the layer's output on every path: ``fastdl.ops.activation`` on the CPU (fp32 compute, one rounding;
ATen's fp32 GELU builds a oneDNN primitive per call, which dominates small layers), PyTorch's function elsewhere.

QAT (``trainable=True``) holds fp32 master weights (``weight``, a Parameter, like ``nn.Linear``): in training mode the
forward runs the int8 GEMM on the quantized weight and activations and the backward is straight-through in the float
dtype (``fastdl.ops.int8_linear_qat``), so a standard (DDP) loop fine-tunes it; in eval mode it serves inference from
int8 weights re-quantized from the master weights (on ``eval()``, or on the first eval call after an update).
``freeze()`` turns it into an inference layer (drops the master weights).

state_dict (format version 3)
  inference: ``weight`` int8 ``[out, in]`` (the plain layout, also when held packed), ``weight_scale`` fp32 ``[out]``,
             ``weight_group_scale`` uint8 ``[out, ceil(in / 16)]`` (grouped weight-only layers only), ``bias``
             ``[out]`` (if any), ``_extra_state``
  trainable: ``weight`` fp32 master ``[out, in]``, ``bias``, ``_extra_state``
  ``_extra_state`` = the record ``{"format": "fastdl.Int8Linear", "version": 3, "mode": ..., "trainable": ...,
  "in_features": ..., "out_features": ..., "group_size": 16 or None, "act_bits": 8 or 7, "quantization": <one line
  describing it>}`` and ``"activation"`` when it is not "none" (``act_bits`` and ``activation`` are informative: the
  layer's own settings stand, as ``mode``'s does)
  stored as a uint8 tensor of its JSON text (``fastdl.nn.decode_extra_state`` reads it), so the state dict holds only
  tensors: it saves as safetensors and loads with ``torch.load(weights_only=True)``. Version 2 is the same record
  kept as a Python dict; version 1 (fastdl before group scales) is that without ``group_size`` and
  ``weight_group_scale``: per-channel scales. Any of these loads into any ``Int8Linear`` of the same shape, and so
  does a plain ``nn.Linear`` checkpoint: float weights are quantized on load the layer's way; an int8 weight keeps the
  checkpoint's scales exactly (a per-channel checkpoint makes a layer per-channel, a grouped one grouped - which only
  ``mode="weight_only"`` serves); an int8 weight loaded into a trainable layer becomes its dequantized master weight.
  The checkpoint is device independent. A checkpoint this layer cannot load raises ``fastdl.CheckpointError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import int8 as int8_ops
from ..ops.fused_linear import activation_module, apply_activation, check_activation
from ..ops.fused_linear import fused_linear as _fused_linear
from ..ops.fused_linear import has_cpu_kernel as _fused_linear_on_cpu
from ..runtime_choice import RuntimeChoice
from ._base import (
    CheckedForward,
    DenseCopyOption,
    VersionedModule,
    check_dtype_arg,
    check_input,
    dense_copy_allowed,
    is_dtensor,
    linear_init,
    resident_bytes,
    set_bias,
)
from ._int8_support import (  # noqa: F401 (MODES, GROUP_SIZES, POLICY_ARGS: part of this module's interface)
    _QUANT_DOC,
    FORMAT,
    FORMAT_VERSION,
    GROUP_SIZES,
    MODES,
    POLICY_ARGS,
    X_DTYPES,
    _check_act_bits,
    _check_mode,
    _cpu_packing_available,
    _dequantize,
    _quantize_weight,
    _resolve_group_size,
)


class Int8Linear(CheckedForward, DenseCopyOption, RuntimeChoice, VersionedModule):
    """Drop-in for ``nn.Linear(in_features, out_features, bias)`` with int8 weights. See the module docstring.

    ``Int8Linear(in, out)`` is initialised like ``nn.Linear`` (then quantized); usually it is made with
    ``Int8Linear.from_linear(linear, mode=...)`` or filled by ``load_state_dict``.
    """

    __constants__ = ["in_features", "out_features", "mode", "trainable", "group_size", "act_bits", "activation"]
    INPUT_DTYPES = X_DTYPES  # the int8 ops take no float64
    act_bits: int = 8  # (a class default too: a layer pickled before act_bits existed has none of its own)
    activation: str = "none"  # (likewise)
    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        mode: str = "dynamic",
        trainable: bool = False,
        device=None,
        dtype=None,
        group_size="auto",
        act_bits: int = 8,
        activation: str = "none",
    ) -> None:
        super().__init__()
        _check_mode(mode)
        check_activation(activation, "Int8Linear")
        self.activation = activation
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.mode, self.trainable = mode, bool(trainable)
        self.group_size = _resolve_group_size(mode, group_size, self.trainable)
        self.act_bits = _check_act_bits(act_bits, mode, self.trainable)
        # dtype is that of the float weight the layer is initialised (quantized) from and of the bias: a float dtype
        check_dtype_arg("Int8Linear", dtype)
        master_dtype = dtype or torch.float32
        w, b = linear_init(in_features, out_features, bias, device, master_dtype)
        set_bias(self, b)
        self._init_weight(w)

    # ------------------------------------------------------------------------------------------ representation
    # Two kinds of layer share this class, told apart by ``self.trainable`` once, at each entry point (construction,
    # forward, device moves, loading), which then runs the named step of that kind:
    #   frozen (inference)  int8 weight (or only its VNNI packing), fp32 scales: _set_quantized, _frozen_weights,
    #                       _apply_frozen, _load_frozen_weight
    #   trainable (QAT)     fp32 master weight, quantized copy cached for eval: _init_master, _qat_forward,
    #                       _eval_weights, _apply_trainable, _load_master_weight
    @classmethod
    def _blank(cls, in_features: int, out_features: int, mode: str, trainable: bool, group_size,
               act_bits: int = 8, activation: str = "none") -> Int8Linear:  # fmt: skip
        """A module with its configuration set and no tensors yet (``from_linear`` and ``freeze`` fill it)."""
        _check_mode(mode)
        check_activation(activation, "Int8Linear")
        mod = cls.__new__(cls)
        VersionedModule.__init__(mod)
        mod.in_features, mod.out_features = int(in_features), int(out_features)
        mod.mode, mod.trainable = mode, bool(trainable)
        mod.group_size = _resolve_group_size(mode, group_size, mod.trainable)
        mod.act_bits = _check_act_bits(act_bits, mode, mod.trainable)
        mod.activation = activation
        return mod

    def _init_weight(self, w: torch.Tensor) -> None:
        """Set the weight from a float ``[out, in]`` tensor (a copy is kept as master weight when trainable)."""
        self._weight_cache.clear()
        if self.trainable:
            self._init_master(w)
        else:
            self._set_quantized(*_quantize_weight(w, self.group_size))

    def _init_master(self, w: torch.Tensor) -> None:
        """Trainable layers: ``weight`` is an fp32 Parameter (a copy of ``w``); the inference buffers are empty."""
        self.weight = nn.Parameter(w.detach().clone())
        for name in ("weight_scale", "weight_group_scale", "weight_packed", "weight_comp"):
            self.register_buffer(name, None, persistent=False)

    def _set_quantized(self, q: torch.Tensor, s: torch.Tensor, g: torch.Tensor | None = None) -> None:
        """Inference layers: hold ``q`` plainly, or only its VNNI packing on the CPU when the C++ kernel reads it."""
        self._weight_cache.clear()  # the dequantized weights of the "dequant" path belong to the old weights
        self._buffers["weight_scale"] = s.float()
        self._buffers["weight_group_scale"] = g
        packed, comp = self._pack(q)
        self._buffers["weight_packed"] = packed
        self._buffers["weight_comp"] = comp
        self._buffers["weight"] = None if packed is not None else q  # held once: packed, or plain

    def _pack(self, q: torch.Tensor):
        if self.mode != "dynamic" or q.device.type != "cpu" or q.numel() <= 1 or not _cpu_packing_available():
            return None, None
        with torch.no_grad():
            return int8_ops.int8_pack_weight_op(q)

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight ``[out, in]`` in the plain layout (unpacked if held packed; quantized from the master
        weight if trainable)."""
        if self.trainable:
            return _quantize_weight(self.weight, self.group_size, search=False)[0]
        w = self._buffers.get("weight")
        if w is not None:
            return w
        return int8_ops.unpack_reference(self.weight_packed, self.out_features, self.in_features)

    def _frozen_weights(self):
        """Frozen layers: (w_q or None, w_scale, w_group_scale, w_packed, w_comp) for ``_int8_op``. Read from
        ``_buffers`` directly: through ``nn.Module.__getattr__`` the five cost ~5.6 us a call (AMD EPYC Zen 2)."""
        b = self._buffers
        return (b.get("weight"), b.get("weight_scale"), b.get("weight_group_scale"), b.get("weight_packed"),
                b.get("weight_comp"))

    def _eval_weights(self):
        """Trainable layers in eval mode: the quantized copy of the master weights (re-quantized first when they
        changed, outside ``torch.compile``), the same tuple as ``_frozen_weights``; None when there is none (compiled
        before any sync)."""
        if not torch.compiler.is_compiling() and self._cache_stale():
            self.sync_quantized()
        return self._weight_cache.get("quantized")

    def _cache_stale(self) -> bool:
        return self._weight_cache.get("quantized") is None or not self._weight_cache.is_fresh(self.weight)

    @torch.no_grad()
    def sync_quantized(self) -> None:
        """Trainable layers: re-quantize the master weights for inference (done by ``eval()`` and, outside
        ``torch.compile``, by the first eval-mode call after the weights changed). A sharded master weight (a DTensor,
        e.g. under FSDP2 outside forward) is quantized on the first eval call instead, when it is whole."""
        if not self.trainable or is_dtensor(self.weight):
            return
        q, s, g = _quantize_weight(self.weight, self.group_size, search=False)
        packed, comp = self._pack(q)
        self._weight_cache.sync(self.weight)
        self._weight_cache.set("quantized", (None if packed is not None else q, s, g, packed, comp))

    # ----------------------------------------------------------------------------------------------- forward
    # forward(x) (CheckedForward): self._forward(x), with the layer's own error for an x it cannot take (INPUT_DTYPES)
    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear_forward(x)
        return out if self.activation == "none" else apply_activation(out, self.activation)

    def _linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer without its activation (the paths the run-time choice times)."""
        if self.trainable:
            return self._qat_forward(x)
        k = self.in_features
        key = ((x.numel() // k if k else 0).bit_length(), x.dtype)
        path = self._choice_local.get(key) or self._choose(x, key)
        if path == "dequant":  # inlined: this is the path of tiny shapes, where ~1 us per call shows
            w = self._weight_cache.get(("dequant", x.dtype))
            if w is None:
                w = self.dequantized_weight(x.dtype)
            b = self._parameters.get("bias")  # not self.bias: nn.Module.__getattr__ costs ~1.2 us
            return F.linear(x, w, b if b is None or b.dtype == x.dtype else b.to(x.dtype))
        if path == "dequant_fused":
            return self._run_path(path, x)
        return self._int8_op(x, *self._frozen_weights())

    def _qat_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Trainable layers: in training mode the QAT op (int8 forward, straight-through backward); in eval mode the
        inference op on the cached quantized master weights (the QAT op when there is no cache: compiled before any
        sync, quantized on the fly)."""
        if not self.training:
            quantized = self._eval_weights()
            if quantized is not None:
                return self._int8_op(x, *quantized)
        return int8_ops.int8_linear_qat(x, self.weight, self.bias, self.mode == "weight_only")

    def _int8_op(self, x, w_q, w_scale, w_group, w_packed, w_comp) -> torch.Tensor:
        """The inference op of this layer's mode. A weight held only packed (``w_q`` None) is passed as a stride-0
        placeholder of shape [out, in] (1 byte; kept only in the weight cache, never as a buffer, so that no
        state dict, clone or ``to_linear`` takes it for the weight)."""
        if w_q is None:  # made once per packed weight (~5 us), kept in the weight cache beside it
            held = self._weight_cache.get("placeholder")
            if held is None or held[0] is not w_packed:
                held = (w_packed, w_packed.new_zeros(()).expand(self.out_features, self.in_features))
                if not torch.compiler.is_compiling():
                    self._weight_cache.set("placeholder", held)
            w_q = held[1]
        bias = self._parameters.get("bias")  # not self.bias: nn.Module.__getattr__ costs ~1.2 us
        if self.mode == "weight_only":
            return int8_ops.int8_weight_only_linear(x, w_q, w_scale, bias, w_group)
        return int8_ops.int8_linear(x, w_q, w_scale, bias, w_packed, w_comp, self.act_bits)

    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The int8 op path ("kernel") of either kind of layer."""
        if self.trainable:
            return self._qat_forward(x)
        return self._int8_op(x, *self._frozen_weights())

    # ------------------------------------------------------------------------------ run-time choice (dispatch)
    # Inference layers choose per bucket of input rows between "kernel" (the int8 op of their mode, the default) and
    # "dequant": F.linear on the dequantized weight w_q * scales (* group scales), made once per dtype and held in
    # the weight cache ONLY while "dequant" is the decision of at least one bucket of that dtype (and while a new
    # bucket is timed): N x K x itemsize bytes, in fp32 4x the int8 weight, i.e. what the original nn.Linear held.
    # Compute-bound shapes (large M) are faster as a GEMM than through an int8 kernel that converts weights tile by
    # tile. On the CPU with the C++ kernels, "dequant_fused" runs that GEMM as fastdl's fused_linear op (its packed
    # fp32 / bf16 kernels) on the same cached weight: on the 2-core Zen 4 (AVX-512) they beat MKL's sgemm under
    # F.linear at the compute-bound shapes (see csrc/cpu/fused_linear.cpp, the pb rules). Trainable (QAT) layers
    # always run their op.
    def _choice_layer(self) -> tuple:
        layer = ("Int8Linear", self.mode, self.group_size, self.in_features, self.out_features, self.bias is not None)
        layer += (("act_bits", self.act_bits),) if self.act_bits != 8 else ()
        return layer + (("dense_copy",) if self.dense_copy else ())

    def _choice_default(self, x) -> str:
        return "kernel"

    def _choice_paths(self, x: torch.Tensor) -> tuple[str, ...]:
        check_input(self, x, X_DTYPES)  # the first call at a bucket: no decision is kept for a bad input
        if self.trainable or x.is_meta or not dense_copy_allowed(self, x.dtype):
            return ("kernel",)
        if x.device.type == "cpu" and x.dtype != torch.float16 and _fused_linear_on_cpu():
            return ("kernel", "dequant", "dequant_fused")
        return ("kernel", "dequant")

    def _run_path(self, path: str, x: torch.Tensor) -> torch.Tensor:
        if path == "kernel":
            return self._kernel_forward(x)
        b = self.bias
        if b is not None and b.dtype != x.dtype:
            b = b.to(x.dtype)
        if path == "dequant_fused":
            return _fused_linear(x, self.dequantized_weight(x.dtype), b)
        return F.linear(x, self.dequantized_weight(x.dtype), b)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``w_q * weight_scale`` (times the group scales) as a ``[out, in]`` tensor of ``dtype``: cached while the
        "dequant" path is chosen for ``dtype`` and the layer may keep the copy (see above), else made per call. The
        cache is dropped whenever the quantized weights are replaced (``load_state_dict``, a device move); int8
        buffers changed in place by hand are not seen: call ``release_caches()`` after doing that."""
        cache = self._weight_cache
        w = cache.get(("dequant", dtype))
        if w is not None:
            return w
        with torch.no_grad():
            w = _dequantize(self.qweight, self.weight_scale, self.weight_group_scale).to(dtype).contiguous()
        # no state changes inside a graph: made per call there; and no kept copy the layer may not keep
        if not torch.compiler.is_compiling() and dense_copy_allowed(self, dtype):
            cache.set(("dequant", dtype), w)
        return w

    def _choice_released(self, kept: set) -> None:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if ("dequant", dtype) not in kept and ("dequant_fused", dtype) not in kept:
                self._weight_cache.pop(("dequant", dtype))

    def cache_bytes(self) -> int:
        """Bytes of the dequantized weights held for the "dequant" path (0 while no bucket chose it)."""
        cache = self._weight_cache
        return sum(cache.get(k).numel() * cache.get(k).element_size() for k in cache.names()
                   if isinstance(k, tuple) and k[0] == "dequant")

    def train(self, mode: bool = True):
        super().train(mode)
        if not mode and self.trainable:
            self.sync_quantized()
        return self

    def _apply(self, fn, recurse=True):
        if self.trainable:
            return self._apply_trainable(fn, recurse)
        return self._apply_frozen(fn, recurse)

    def _apply_trainable(self, fn, recurse):
        super()._apply(fn, recurse)  # drops the cache
        if not self.training:
            self.sync_quantized()
        return self

    def _apply_frozen(self, fn, recurse):
        """Move/convert the plain int8 weight (never the packed copy or the placeholder), keep the scales fp32, then
        re-derive the packing for the new device."""
        q = self.qweight
        scale = self.weight_scale
        self._buffers["weight"] = q
        self._buffers["weight_packed"] = self._buffers["weight_comp"] = None
        super()._apply(fn, recurse)
        q = self._buffers["weight"]
        new_scale = self._buffers["weight_scale"]
        if new_scale.dtype != torch.float32:  # e.g. .half(): scales stay fp32 (not rounded through fp16)
            new_scale = scale.to(new_scale.device)
        self._set_quantized(q, new_scale, self._buffers["weight_group_scale"])
        return self

    # ---------------------------------------------------------------------------------------------- state_dict
    def _record_fields(self) -> dict:
        return {
            **super()._record_fields(),
            "mode": self.mode,
            "trainable": self.trainable,
            "group_size": self.group_size,
            "act_bits": self.act_bits,
            "quantization": _QUANT_DOC[self.group_size],
            **({"activation": self.activation} if self.activation != "none" else {}),
        }

    def recipe(self) -> dict:
        """How to rebuild this layer from an ``nn.Linear`` of its shape (``fastdl.save``/``load`` use it)."""
        r = {"mode": self.mode, "trainable": self.trainable, "group_size": self.group_size}
        if self.act_bits != 8:  # (recipes written before act_bits existed stay equal to a default layer's)
            r["act_bits"] = self.act_bits
        if self.activation != "none":  # (likewise)
            r["activation"] = self.activation
        return r

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        def val(t):
            return t if keep_vars else t.detach()

        if self.trainable:
            destination[prefix + "weight"] = val(self.weight)
        else:
            destination[prefix + "weight"] = self.qweight.detach()
            destination[prefix + "weight_scale"] = val(self.weight_scale)
            if self.weight_group_scale is not None:
                destination[prefix + "weight_group_scale"] = val(self.weight_group_scale)
        if self.bias is not None:
            destination[prefix + "bias"] = val(self.bias)
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):  # fmt: skip
        known = {"weight", "weight_scale", "weight_group_scale", "bias", "_extra_state"}
        for key in state_dict:
            if key.startswith(prefix) and key[len(prefix):].split(".", 1)[0] not in known:
                unexpected_keys.append(key)
        if prefix + "_extra_state" in state_dict:
            self.read_record(state_dict[prefix + "_extra_state"], prefix)
        # A layer built on the meta device: meta tensors load into it (a no-op, as for torch's modules), and with
        # load_state_dict(assign=True) it takes the checkpoint's tensors and device (how large models are loaded).
        on_meta = (self.weight if self.trainable else self.weight_scale).is_meta
        take = on_meta and bool(local_metadata.get("assign_to_params_buffers", False))
        w = state_dict.get(prefix + "weight")
        b = self._checked_bias(state_dict, prefix, missing_keys, unexpected_keys, on_meta)  # all checked first
        if w is None:
            missing_keys.append(prefix + "weight")
        else:
            s, g = self._checked_scales(state_dict, prefix, w, missing_keys, on_meta)
            if s is not None or w.is_floating_point():
                self._load_weight(w, s, g, w.device if take else None)
        self._load_bias(b, take)

    def _checked_scales(self, state_dict, prefix, w, missing_keys, on_meta=False):
        """(weight_scale, weight_group_scale) that go with a checkpoint's weight, checked; (None, None) for a float
        weight (quantized on load) or when weight_scale is missing (reported as a missing key)."""
        shape = (self.out_features, self.in_features)
        self._check_loaded(prefix, "weight", w, target_meta=on_meta)
        if tuple(w.shape) != shape:
            raise self._error(prefix, f"size mismatch for weight: the checkpoint has shape {tuple(w.shape)}, this "
                                      f"layer {shape}")  # fmt: skip
        if w.is_floating_point():
            return None, None
        if w.dtype != torch.int8:
            raise self._error(prefix, f"weight must be int8 (with weight_scale) or floating, got {w.dtype}")
        s = state_dict.get(prefix + "weight_scale")
        g = state_dict.get(prefix + "weight_group_scale")
        if s is None:
            missing_keys.append(prefix + "weight_scale")
            return None, None
        self._check_loaded(prefix, "weight_scale", s, target_meta=on_meta)
        if s.dtype != torch.float32 or tuple(s.shape) != (self.out_features,):
            raise self._error(prefix, f"weight_scale must be float32 of shape [{self.out_features}], got {s.dtype} "
                                      f"{tuple(s.shape)}")  # fmt: skip
        if not s.is_meta and s.numel() and not bool(torch.isfinite(s).all()):  # NaN / inf: every output of the row
            bad = (~torch.isfinite(s)).nonzero().flatten()
            raise self._error(prefix, f"weight_scale must be finite; {bad.numel()} of {s.numel()} output channels "
                                      f"are not (first: channel {int(bad[0])} = {float(s[bad[0]])})")  # fmt: skip
        if g is not None:
            self._check_loaded(prefix, "weight_group_scale", g, target_meta=on_meta)
        gshape = (self.out_features, int8_ops.group_count(self.in_features))
        if g is not None and (g.dtype != torch.uint8 or tuple(g.shape) != gshape):
            raise self._error(prefix, f"weight_group_scale must be uint8 of shape {list(gshape)}, got {g.dtype} "
                                      f"{tuple(g.shape)}")  # fmt: skip
        if g is not None and self.mode != "weight_only" and not self.trainable:
            raise self._error(prefix, "weight has group scales (weight_group_scale), which only Int8Linear("
                                      "mode='weight_only') serves; this layer's mode is 'dynamic'")  # fmt: skip
        return s, g

    def _load_weight(self, w: torch.Tensor, s: torch.Tensor | None, g: torch.Tensor | None, device=None) -> None:
        """A checked checkpoint weight (float, or int8 with its scales) into this layer (onto ``device``: a layer on
        the meta device loaded with ``assign=True``; else where the layer is)."""
        if self.trainable:
            self._load_master_weight(w, s, g, device)
        else:
            self._load_frozen_weight(w, s, g, device)

    @torch.no_grad()
    def _load_master_weight(self, w, s, g, device=None) -> None:
        if w.dtype == torch.int8:
            w = _dequantize(w, s, g)  # the dequantized weight becomes the master weight
        if device is not None:
            self.weight = nn.Parameter(w.to(device, self.weight.dtype), requires_grad=self.weight.requires_grad)
        else:
            self.weight.copy_(w)
        self._weight_cache.clear()
        if not self.training:
            self.sync_quantized()

    @torch.no_grad()
    def _load_frozen_weight(self, w, s, g, device=None) -> None:
        dev = device or self.weight_scale.device
        if w.dtype == torch.int8:  # the checkpoint's quantization is kept as it is
            q, s = w.to(dev), s.to(dev)
            g = g.to(dev).contiguous() if g is not None else None
            self.group_size = int8_ops.WEIGHT_GROUP if g is not None else None
        else:
            q, s, g = _quantize_weight(w.to(dev), self.group_size)
        self._set_quantized(q.contiguous(), s.contiguous(), g)

    # ------------------------------------------------------------------------------------------ conversions
    @classmethod
    def from_linear(
        cls, linear: nn.Linear, mode: str = "dynamic", trainable: bool = False, group_size="auto", act_bits: int = 8,
        activation: str = "none",
    ) -> Int8Linear:
        """Quantize an ``nn.Linear``: per output channel (``mode="dynamic"``), or with group scales
        (``mode="weight_only"``, unless ``group_size=None``). ``trainable=True`` keeps an fp32 copy of its weights as
        QAT master weights (the linear itself is not modified). ``act_bits=7``: 7-bit activations (see the module
        docstring; dynamic inference layers only). ``activation``: applied to the output (the module docstring)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int8Linear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        mod = cls._blank(linear.in_features, linear.out_features, mode, trainable, group_size, act_bits, activation)
        w = linear.weight.detach()
        if trainable:
            w = w.float()
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().float().clone(), requires_grad=linear.bias.requires_grad)
        else:
            mod.register_parameter("bias", None)
        mod._init_weight(w)
        mod.train(linear.training)
        return mod

    def to_linear(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The equivalent ``nn.Linear`` with the dequantized weight ``qweight * weight_scale`` (for a trainable
        layer: the dequantized master weight, i.e. what eval mode computes with); ``nn.Sequential(Linear,
        activation)`` when the layer has an activation."""
        if self.trainable:
            q, s, g = _quantize_weight(self.weight, self.group_size, search=False)
        else:
            q, s, g = self.qweight, self.weight_scale, self.weight_group_scale
        dev = q.device
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=dev, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(_dequantize(q, s, g))
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        act = activation_module(self.activation)
        return lin if act is None else nn.Sequential(lin, act)

    def freeze(self) -> Int8Linear:
        """An inference ``Int8Linear`` with this layer's current quantized weights (a trainable layer's master
        weights are dropped); an inference layer returns itself."""
        if not self.trainable:
            return self
        q, s, g = _quantize_weight(self.weight, self.group_size, search=False)
        mod = Int8Linear._blank(self.in_features, self.out_features, self.mode, False, self.group_size,
                                activation=self.activation)
        if self.bias is not None:
            mod.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        else:
            mod.register_parameter("bias", None)
        mod._set_quantized(q, s, g)
        mod.eval()
        return mod

    def memory_bytes(self) -> int:
        """Bytes of storage held by the layer's parameters, buffers and cached tensors (each storage counted once):
        what it keeps resident."""
        return resident_bytes(self, self._weight_cache)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"mode={self.mode!r}, trainable={self.trainable}"
            + (f", group_size={self.group_size}" if self.mode == "weight_only" else "")
            + (f", act_bits={self.act_bits}" if self.act_bits != 8 else "")
            + (f", activation={self.activation!r}" if self.activation != "none" else "")
        )
