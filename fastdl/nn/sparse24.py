"""``Sparse24Linear``: an ``nn.Linear`` whose weight is stored 2:4-compressed (values + 4-bit position masks).

The weight ``W [out, in]`` keeps 2 of every 4 consecutive input weights; the module holds only the kept values
(``values [out, in/2]``) and the metadata (``meta uint8 [out, ceil(in/8)]``, see ``fastdl.ops.sparse24``): 0.5625x
the bytes of the dense layer in the same dtype. ``forward`` runs one of three paths and says which
(``module.path_for(x)``, ``module.last_path``, ``repr``):

``sparse``  ``fastdl.ops.sparse24_linear``: the CPU kernel reads only the compressed weight (2 Zen 5 cores,
            K = 4096: ~4x dense bf16 ``F.linear`` at M = 1, ~1.7x at M = 16, ~1.15x at M = 128);
``dense``   ``F.linear`` on the dense weight decompressed from the same values/meta (kept only by opt-in, below): large
            batches are compute-bound and the sparse kernel does the multiply-adds of the dense GEMM, so the dense
            GEMM (oneDNN / cuBLAS) is as fast or faster there;
``dense_fused`` CPU, C++ kernels: the same dense weight through ``fastdl.ops.fused_linear``, activation and residual
            fused into its epilogue (its packed kernels beat ``F.linear``'s GEMM at compute-bound shapes on some
            CPUs);
``semi``    CUDA: PyTorch's semi-structured sparse GEMM (``torch.sparse.to_sparse_semi_structured``: cuSPARSELt, or
            CUTLASS where cuSPARSELt is missing), built once from the decompressed weight and cached. Needs compute
            capability >= 8.0, fp16/bf16 (fp32 with CUTLASS), and shapes that are multiples of the backend's tile.
            Inference only: while the values need gradients the module uses the dense path (decompressed per call,
            differentiable) instead of the caches.

Memory: the module keeps no dense copy of its weight unless its user asks for one: ``dense_copy = True`` or
``mode="dense"`` (the copy costs ``out x in x itemsize`` bytes: 1.78x the compressed bytes), or the copy is tiny (at
most ``fastdl.nn.DENSE_COPY_FREE_BYTES``, 64 KiB). Without that, the ``dense`` / ``dense_fused`` paths are not
candidates on the CPU (where the ``sparse`` kernel reads only the compressed weight at every M), and where a dense
path must run anyway (a dtype with no CPU kernel, CUDA without the semi-structured path) it decompresses per call
(the copy is freed with the call). ``memory_bytes()`` says what the module holds. The CUDA ``semi`` tensor is kept:
it is the compressed weight in cuSPARSELt's layout.

``mode="auto"`` (default) chooses per bucket of input rows M (powers of two) among the paths that apply, measured
on the first no-grad call at the bucket (``fastdl.runtime_choice``: the decision is kept per process, keyed by CPU/GPU,
dtype, shape and bucket, and can be saved). Without a decision (calls with autograd or inside ``torch.compile`` at
a new bucket, ``FASTDL_CHOICE=off``, ``runtime_choice = False``) it uses the fixed rule: CPU: ``sparse``, or, where
the dense copy may be kept, ``sparse`` below ``dense_threshold`` (default 256) rows and ``dense`` from there; CUDA:
``semi`` from ``semi_min_rows`` (default 1024; cuSPARSELt pads small batches and loses to cuBLAS there) when
supported, else ``dense`` where the copy may be kept, else ``sparse``. A kept dense copy stays only while a bucket
uses a dense path. ``mode="sparse"`` / ``"dense"`` force a path (``sparse`` on CUDA means ``semi`` when supported,
else the fastdl op). Under ``torch.compile`` no cache is built and nothing is timed inside the graph: call
``prepare(x_example)`` first (it decides the path for that shape and builds its cache), or the dense path
decompresses per call.

State dict: ``values``, ``meta``, ``bias`` and an extra state, the record ``{"format": "fastdl.sparse24",
"version": 2, "in_features": ..., "out_features": ..., "meta_layout": ...}`` stored as a uint8 tensor of its JSON
text (``fastdl.nn.decode_extra_state`` reads it): only tensors, so it saves as safetensors and loads with
``torch.load(weights_only=True)``. Version 1 is the same record kept as a Python dict; it still loads. A plain
``nn.Linear`` checkpoint (``weight``) loads too: it is pruned to 2:4 by magnitude and compressed. A checkpoint this
module cannot load raises ``fastdl.CheckpointError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import sparse24 as sp_ops
from ..ops.fused_linear import apply_activation, check_activation, fused_linear
from ..ops.fused_linear import has_cpu_kernel as _fused_linear_on_cpu
from ..runtime_choice import RuntimeChoice
from ._base import (
    FLOAT_DTYPES,
    DenseCopyOption,
    VersionedModule,
    check_dtype_arg,
    check_input,
    dense_copy_allowed,
    input_error,
    layer_name,
    linear_init,
    not_a_view,
    raise_input_error,
    resident_bytes,
    set_bias,
)
from ._sparse24_support import _compress, _decompress, _meta_is_valid, _semi_tensors, semi_structured_support

FORMAT = "fastdl.sparse24"
FORMAT_VERSION = 2  # 2: the extra state is a JSON uint8 tensor (1: a dict)
PATHS = ("sparse", "dense", "dense_fused", "semi")
MODES = ("auto", "sparse", "dense")

# CPU: below this many rows the sparse kernel beats dense bf16 F.linear. Measured on the 2-core Zen 5 dev machine,
# K = 4096, N = 4096 / 11008, 2 threads: M = 1 3.8-4.6x, M = 16 1.7-1.8x, M = 128 1.12-1.18x, M = 512 1.00x.
DEFAULT_DENSE_THRESHOLD = 256
# CUDA: cuSPARSELt / CUTLASS 2:4 GEMMs beat cuBLAS only on large batches (small M is padded to the tile).
DEFAULT_SEMI_MIN_ROWS = 1024


class Sparse24Linear(DenseCopyOption, RuntimeChoice, VersionedModule):
    """Drop-in for ``nn.Linear(in_features, out_features, bias)`` with a 2:4-compressed weight. An inference
    module by default; with ``trainable=True`` the values and bias train (the sparsity pattern is fixed by ``meta``).

    Build it with ``Sparse24Linear.from_linear(linear)`` (prunes by magnitude unless the weight is already 2:4) or
    ``fastdl.sparsity.sparsify(model)``; ``to_linear()`` gives the dense ``nn.Linear`` back. ``activation`` (as in
    ``FusedLinear``) and ``forward(x, residual=None)`` make it a drop-in for ``FusedLinear`` too.
    """

    __constants__ = ["in_features", "out_features", "activation"]
    FORMAT = FORMAT
    FORMAT_VERSION = FORMAT_VERSION

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        activation: str = "none",
        mode: str = "auto",
        dense_threshold: int = DEFAULT_DENSE_THRESHOLD,
        semi_min_rows: int = DEFAULT_SEMI_MIN_ROWS,
        trainable: bool = False,
    ) -> None:
        super().__init__()
        if in_features % 4:
            raise ValueError(
                f"Sparse24Linear: in_features = {in_features} is not a multiple of 4 (2:4 groups run along the "
                "input features)"
            )
        check_activation(activation)
        if mode not in MODES:
            raise ValueError(f"Sparse24Linear: mode must be one of {', '.join(MODES)}, got {mode!r}")
        check_dtype_arg("Sparse24Linear", dtype)
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.mode, self.dense_threshold, self.semi_min_rows = mode, int(dense_threshold), int(semi_min_rows)
        # Default initialisation: nn.Linear's, pruned to 2:4 (so a fresh module is usable as is).
        w, b = linear_init(in_features, out_features, bias, device, dtype)
        values, meta = _compress(w)
        self.values = nn.Parameter(values, requires_grad=trainable)
        self.register_buffer("meta", meta)
        set_bias(self, b, requires_grad=trainable)
        self.register_buffer("input_permutation", None)
        self.last_path: str | None = None

    # ------------------------------------------------------------------------------------------ conversion
    @classmethod
    def from_linear(cls, linear: nn.Module, *, dtype: torch.dtype | None = None, trainable: bool = False,
                    **kwargs) -> Sparse24Linear:
        """Compress an ``nn.Linear`` (or ``fastdl.nn.FusedLinear``, whose activation is kept).

        The mask is chosen on the weight as it is (``mask_2_4``: for a weight pruned by ``fastdl.sparsity.prune``
        it keeps exactly the non-zeros) and the kept values are then cast to ``dtype`` (default: the weight's).
        ``trainable=True`` makes the values and bias require gradients (fine-tuning with the pattern fixed);
        by default the module is an inference module (its parameters do not require gradients).
        """
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"Sparse24Linear.from_linear expects an nn.Linear-like module, got {type(linear).__name__}")
        check_dtype_arg("Sparse24Linear.from_linear", dtype)
        if weight.dtype not in FLOAT_DTYPES:
            raise TypeError(f"Sparse24Linear.from_linear: the weight must be a floating tensor of dtype "
                            f"float32, bfloat16, float16, float64, got dtype {weight.dtype}")
        out_features, in_features = weight.shape
        kwargs.setdefault("activation", getattr(linear, "activation", "none"))
        mod = cls.__new__(cls)
        VersionedModule.__init__(mod)
        check_activation(kwargs["activation"])
        mode = kwargs.get("mode", "auto")
        if mode not in MODES:
            raise ValueError(f"Sparse24Linear: mode must be one of {', '.join(MODES)}, got {mode!r}")
        mod.in_features, mod.out_features, mod.activation = in_features, out_features, kwargs["activation"]
        mod.mode = mode
        mod.dense_threshold = int(kwargs.get("dense_threshold", DEFAULT_DENSE_THRESHOLD))
        mod.semi_min_rows = int(kwargs.get("semi_min_rows", DEFAULT_SEMI_MIN_ROWS))
        if in_features % 4:
            raise ValueError(
                f"Sparse24Linear.from_linear: in_features = {in_features} is not a multiple of 4; leave this layer "
                "dense (fastdl.sparsity.prune skips such layers)"
            )
        with torch.no_grad():
            values, meta = _compress(weight.detach())
            if dtype is not None:
                values = values.to(dtype)
        mod.values = nn.Parameter(values, requires_grad=trainable)
        mod.register_buffer("meta", meta)
        bias = getattr(linear, "bias", None)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone().to(dtype or bias.dtype), requires_grad=trainable)
        else:
            mod.register_parameter("bias", None)
        perm = getattr(linear, "input_permutation", None)
        mod.register_buffer("input_permutation", perm.clone() if isinstance(perm, torch.Tensor) else None)
        mod.last_path = None
        return mod

    def dense_weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` weight (zeros at pruned positions), in the values' dtype."""
        return _decompress(self.values.detach(), self.meta, self.in_features)

    def to_linear(self) -> nn.Module:
        """The dense ``nn.Linear`` (``nn.Sequential(Linear, activation)`` when an activation is fused)."""
        from ..ops.fused_linear import activation_module

        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        w = self.dense_weight()
        if self.input_permutation is not None:  # undo it: the dense layer takes the inputs in their own order
            w = torch.empty_like(w).index_copy_(1, self.input_permutation, w)
        lin.weight = nn.Parameter(w.clone())
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().clone())
        act = activation_module(self.activation)
        return lin if act is None else nn.Sequential(lin, act)

    # ------------------------------------------------------------------------------------------ caches
    # self._weight_cache (fastdl.nn._base.WeightCache, valid while values and meta are unchanged) holds "dense"
    # (the decompressed weight), "semi" (the semi-structured tensor), "semi_reason" (why it could not be built) and
    # "support" (dtype -> semi_structured_support result).
    def _check_cache(self) -> None:
        self._weight_cache.sync(self.values, self.meta)

    def cache_bytes(self) -> int:
        """Bytes held by the caches (not part of the state dict)."""
        n = 0
        dense, semi = self._weight_cache.get("dense"), self._weight_cache.get("semi")
        if dense is not None:
            n += dense.numel() * dense.element_size()
        if semi is not None:
            n += sum(t.numel() * t.element_size() for t in _semi_tensors(semi))
        return n

    def memory_bytes(self) -> int:
        """Bytes of storage the layer holds resident: parameters, buffers and caches (each storage counted once)."""
        return resident_bytes(self, self._weight_cache)

    def weight_bytes(self) -> int:
        """Bytes of the compressed weight, metadata and bias (what the state dict holds)."""
        n = self.values.numel() * self.values.element_size() + self.meta.numel()
        if self.bias is not None:
            n += self.bias.numel() * self.bias.element_size()
        return n

    def _semi_support(self, dtype: torch.dtype) -> tuple[type | None, str]:
        support = self._weight_cache.get("support") or {}
        if dtype not in support:
            if torch.compiler.is_compiling():  # decided eagerly (prepare() or a first eager call), never in a graph
                return None, "not prepared before torch.compile (call module.prepare(x))"
            support[dtype] = semi_structured_support((self.out_features, self.in_features), dtype, self.values.device)
            self._weight_cache.set("support", support)
        return support[dtype]

    def semi_structured_reason(self, dtype: torch.dtype | None = None) -> str | None:
        """None when the CUDA semi-structured path can serve ``dtype`` here, else why not."""
        cls, why = self._semi_support(dtype or self.values.dtype)
        return why if cls is None else self._weight_cache.get("semi_reason")

    def _training_values(self) -> bool:
        # values from _parameters: through nn.Module.__getattr__ the read costs ~1.2 us, on every forward
        return torch.is_grad_enabled() and self._parameters["values"].requires_grad

    def _dense_for(self, dtype: torch.dtype) -> torch.Tensor:
        if self._training_values():  # the cache is detached: decompress per call so that values get gradients
            return _decompress(self.values, self.meta, self.in_features).to(dtype)
        dense = self._weight_cache.get("dense")
        if torch.compiler.is_compiling():  # no state changes inside a graph: decompress per call
            return dense if dense is not None and dense.dtype == dtype else (
                _decompress(self.values, self.meta, self.in_features).to(dtype)
            )
        self._check_cache()
        dense = self._weight_cache.get("dense")
        if dense is None or dense.dtype != dtype:
            with torch.no_grad():
                dense = _decompress(self.values.detach(), self.meta, self.in_features).to(dtype)
            if self._may_keep_dense(dtype):  # else a per-call copy, freed with the call (the memory promise)
                self._weight_cache.set("dense", dense)
        return dense

    def _may_keep_dense(self, dtype: torch.dtype) -> bool:
        """A dense copy may be kept: the user asked for it (``dense_copy = True`` or ``mode="dense"``) or it is tiny
        (``fastdl.nn.DENSE_COPY_FREE_BYTES``)."""
        return self.mode == "dense" or dense_copy_allowed(self, dtype)

    def _semi_for(self, dtype: torch.dtype):
        semi = self._weight_cache.get("semi")
        if torch.compiler.is_compiling():
            return semi if semi is not None and semi.dtype == dtype else None
        self._check_cache()
        semi = self._weight_cache.get("semi")
        if semi is None or semi.dtype != dtype:
            cls, why = self._semi_support(dtype)
            if cls is None:
                self._weight_cache.set("semi_reason", why)
                return None
            with torch.no_grad():
                dense = sp_ops.decompress_2_4(self.values.detach(), self.meta).to(dtype).contiguous()
                try:
                    semi = cls.from_dense(dense)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. cuSPARSELt init failure
                    self._weight_cache.set("semi_reason", f"{cls.__name__}.from_dense failed: {exc}")
                    return None
            self._weight_cache.set("semi", semi)
        return semi

    def prepare(self, x: torch.Tensor | None = None, *, dtype: torch.dtype | None = None) -> str:
        """Build the cache the path for ``x`` needs (before ``torch.compile``, or to move the cost out of the first
        call) and return the path. Without ``x``, builds what ``mode`` implies for ``dtype`` (default: values')."""
        dtype = dtype or (x.dtype if x is not None else self.values.dtype)
        if x is not None:
            err = input_error(self, x)
            if err is not None:
                raise err
            if self.input_permutation is not None:
                x = x.index_select(-1, self.input_permutation)
            with torch.no_grad():  # decide (measure) the path of x's bucket now, outside any graph
                key = self._choice_key(x)
                path = self._choice_local.get(key) or self._choose(x, key)
        else:
            path = {"dense": "dense", "sparse": "sparse"}.get(self.mode, "sparse")
        if path in ("dense", "dense_fused"):
            self._dense_for(dtype)
        elif path == "semi":
            self._semi_for(dtype)
        return path

    # ------------------------------------------------------------------------------------------ forward
    def path_for(self, x: torch.Tensor) -> str:
        """Which path ``forward(x)`` takes now: ``"sparse"``, ``"dense"``, ``"dense_fused"`` or ``"semi"`` (the
        decision of x's bucket if one was made, else the fixed rule; the fixed rule for calls that train the values;
        nothing is timed)."""
        if self._training_values():
            return self._fixed_path(x)  # never "semi": _semi_ok excludes training calls
        path = self.known_path(x) if self.mode == "auto" else None
        return path or self._fixed_path(x)

    def _fixed_path(self, x: torch.Tensor) -> str:
        """The path of the fixed rule (thresholds) for x. Every input reaches it before its bucket has a path (the
        run-time choice calls it first) and on every call that trains the values: x is checked here, so that an
        input no path computes correctly (an integer x would make the dense path cast the weight to integers)
        raises and no decision is cached for it."""
        if x.dtype not in FLOAT_DTYPES or x.dim() == 0 or x.shape[-1] != self.in_features:
            raise input_error(self, x)
        rows = x.numel() // max(self.in_features, 1)
        if self.values.numel() == 0 or self.values.is_meta:
            return "dense"  # nothing to multiply (out_features or in_features 0) / shapes only: F.linear does both
        if x.is_cuda:
            # the semi-structured cache is an inference copy: with gradients for the values, stay on dense/sparse
            semi_ok = self._semi_ok(x.dtype)
            if self.mode == "dense":
                return "dense"
            if self.mode == "sparse":
                return "semi" if semi_ok else "sparse"
            if semi_ok and rows >= self.semi_min_rows:
                return "semi"
            return "dense" if self._may_keep_dense(x.dtype) else "sparse"
        if self.mode != "auto":
            return self.mode
        if x.is_cpu and x.dtype not in (torch.float32, torch.bfloat16):
            return "dense"  # no CPU kernel for this dtype: the op would run the (slow) reference (a per-call copy)
        return "sparse" if rows < self.dense_threshold or not self._may_keep_dense(x.dtype) else "dense"

    def _semi_ok(self, dtype: torch.dtype) -> bool:
        return (self._semi_support(dtype)[0] is not None and self._weight_cache.get("semi_reason") is None
                and not self._training_values())

    # ------------------------------------------------------------------------------ run-time choice (dispatch)
    def _choice_key(self, x: torch.Tensor) -> tuple:
        k = self.in_features
        return ((x.numel() // k if k else 0).bit_length(), x.dtype)

    def _choice_layer(self) -> tuple:
        return ("Sparse24Linear", self.in_features, self.out_features, self.bias is not None, self.activation,
                str(self.values.dtype).removeprefix("torch.")) + (("dense_copy",) if self.dense_copy else ())

    def _choice_default(self, x) -> str:
        check_input(self, x)  # the first call at a bucket: no decision is kept for an input the layer rejects
        return self._fixed_path(x)

    def _choice_paths(self, x: torch.Tensor) -> tuple[str, ...]:
        check_input(self, x)  # (the run-time choice's key has no device: a meta x must not decide for CPU)
        default = self._fixed_path(x)
        if self.mode != "auto" or self.values.numel() == 0 or x.is_meta:
            return (default,)
        dense = self._may_keep_dense(x.dtype)  # the dense paths are candidates only where the copy may be kept
        if x.device.type == "cuda":
            paths = ("semi",) if self._semi_ok(x.dtype) else ()
            paths += ("dense", "sparse") if dense else ("sparse",)
        elif x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            paths = ("sparse",)
            if dense:
                paths += ("dense",)
                if _fused_linear_on_cpu():
                    paths += ("dense_fused",)
        else:
            paths = ("dense",)
        return (default,) + tuple(p for p in paths if p != default)

    def _choice_released(self, kept: set) -> None:
        # the dense copy (1.78x the compressed bytes) stays only while a bucket's decision needs it
        if not any(p in ("dense", "dense_fused") for p, _ in kept) and self.mode != "dense":
            self._weight_cache.pop("dense")

    def _run_path(self, path: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = None
        if path == "semi":
            semi = self._semi_for(x.dtype)
            if semi is not None:
                x2 = x.reshape(-1, self.in_features).contiguous()
                b = self.bias.to(x.dtype) if self.bias is not None else None
                out = F.linear(x2, semi, b).reshape(*x.shape[:-1], self.out_features)
            else:
                path = "dense" if self.mode == "auto" else "sparse"
        if path == "dense_fused":  # activation and residual in the op's epilogue
            if not torch.compiler.is_compiling():
                self.__dict__["last_path"] = path
            return fused_linear(x, self._dense_for(x.dtype), self.bias, self.activation, residual)
        if path == "dense":
            b = self.bias.to(x.dtype) if self.bias is not None else None
            out = F.linear(x, self._dense_for(x.dtype), b)
        elif path == "sparse":
            out = sp_ops.sparse24_linear(x, self.values, self.meta, self.bias)
        if not torch.compiler.is_compiling():
            self.__dict__["last_path"] = path  # not nn.Module.__setattr__: ~5 us a call, seen at M = 1
        out = apply_activation(out, self.activation)
        if residual is not None:  # as fused_linear (the dense_fused path): [..., N], result in x's dtype
            if residual.shape != out.shape or not residual.is_floating_point():
                raise ValueError(f"{layer_name(self)}: residual must be a floating tensor of shape "
                                 f"{list(out.shape)} (the output's), got {residual.dtype} {list(residual.shape)}")
            out = out + residual if residual.dtype == out.dtype else (out + residual).to(out.dtype)
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Parameters and buffers are read from _parameters / _buffers on this path: through nn.Module.__getattr__
        # each read costs ~1.2 us, and a call at M = 1 made eight of them (AMD EPYC Zen 2).
        # Inputs are checked where they are first seen (_fixed_path, on the way to a bucket's path) and, for
        # shape and device, when a kernel raises (the except clause: no cost on calls that succeed).
        try:
            perm = self._buffers.get("input_permutation")
            if perm is not None:  # from fastdl.sparsity.prune(..., permute=True)
                if x.dim() == 0 or x.shape[-1] != self.in_features:  # a wider x would be gathered without error
                    raise input_error(self, x)
                x = x.index_select(-1, perm)
            k = self.in_features
            if self._training_values():
                # The run-time choice measures inference calls (with the weight cached); a call that trains the
                # values takes the fixed rule: the sparse op and its one-call backward at small M. A decision
                # measured without gradients ("dense_fused") made a trainable step at M = 1, K = N = 64 + gelu 1.81x
                # the time of nn.Linear + gelu instead of 1.47x (AMD EPYC Zen 2, after another layer of that shape
                # was timed).
                return not_a_view(self._run_path(self._fixed_path(x), x, residual))
            key = ((x.numel() // k if k else 0).bit_length(), x.dtype)
            path = self._choice_local.get(key) or self._choose(x, key)
            if path == "dense" and x.dtype == torch.float32 and residual is None:
                out = self._dense_fast(x)  # the path of tiny shapes, where ~1 us per call shows
                if out is not None:
                    return out
            return not_a_view(self._run_path(path, x, residual))
        except Exception as exc:
            raise_input_error(self, x, exc)
            raise

    def _dense_fast(self, x: torch.Tensor) -> torch.Tensor | None:
        """The "dense" path of ``_run_path`` for fp32 inference calls with the decompressed weight cached and fresh,
        without its per-call casts and checks (same result); None when it does not apply. At M = 1, K = N = 64 +
        gelu: 1.73x -> see ``fastdl bench overhead`` (thread CPU time, loaded machine)."""
        if torch.compiler.is_compiling() or self._training_values():
            return None
        cache = self._weight_cache
        dense = cache.get("dense")
        if (dense is None or dense.dtype != torch.float32
                or not cache.is_fresh(self._parameters["values"], self._buffers["meta"])):
            return None
        b = self._parameters.get("bias")
        out = F.linear(x, dense, b if b is None or b.dtype == torch.float32 else b.float())
        self.__dict__["last_path"] = "dense"
        return not_a_view(apply_activation(out, self.activation))

    # ------------------------------------------------------------------------------------------ state dict
    def _record_fields(self) -> dict:
        return {
            **super()._record_fields(),
            "meta_layout": "uint8 [out, ceil(in/8)], 4-bit kept-position mask per group of 4, low nibble first",
        }

    def recipe(self) -> dict:
        """How to rebuild this layer from an ``nn.Linear`` of its shape (``fastdl.save``/``load`` use it)."""
        return {"activation": self.activation, "mode": self.mode, "dense_threshold": self.dense_threshold,
                "semi_min_rows": self.semi_min_rows, "trainable": bool(self.values.requires_grad),
                "dtype": str(self.values.dtype).removeprefix("torch.")}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # Every tensor is checked before any is copied (a CheckpointError names the key): a tampered checkpoint
        # must not load and then compute garbage or fail at forward.
        N, K = self.out_features, self.in_features
        on_meta = self.values.is_meta  # a layer built on the meta device: meta tensors load (as no-ops) too
        floating = "a floating tensor (float32, bfloat16, float16, float64)"
        wkey = prefix + "weight"
        if wkey in state_dict and prefix + "values" not in state_dict:  # a dense nn.Linear checkpoint
            w = self._check_loaded(prefix, "weight", state_dict.pop(wkey), FLOAT_DTYPES, (N, K),
                                   target_meta=on_meta, what=floating)
            # compressed where the layer is; a layer on the meta device (filled by load_state_dict(assign=True))
            # where the checkpoint is, so that the values it takes have data
            values, meta = _compress(w.to(w.device if on_meta else self.values.device))
            state_dict[prefix + "values"] = values.to(self.values.dtype)
            state_dict[prefix + "meta"] = meta
            state_dict.setdefault(prefix + "_extra_state", self.get_extra_state())
        ekey = prefix + "_extra_state"
        if ekey in state_dict:
            self._check_record(self.read_record(state_dict[ekey], prefix), prefix)
        if prefix + "values" in state_dict:
            self._check_loaded(prefix, "values", state_dict[prefix + "values"], FLOAT_DTYPES, (N, K // 2),
                               target_meta=on_meta, what=floating)
        if prefix + "meta" in state_dict:
            meta = self._check_loaded(prefix, "meta", state_dict[prefix + "meta"], (torch.uint8,), (N, (K + 7) // 8),
                                      target_meta=on_meta, what="torch.uint8")
            if not _meta_is_valid(meta, K):
                raise self._error(prefix, "meta is not a 2:4 mask: every 4-bit group must have exactly 2 bits set "
                                          "(and an unused high nibble must be 0), as compress_2_4 writes it")
        if prefix + "bias" in state_dict and self.bias is not None:
            self._check_loaded(prefix, "bias", state_dict[prefix + "bias"], FLOAT_DTYPES, (N,), target_meta=on_meta,
                               what=floating)
        pkey = prefix + "input_permutation"
        if pkey in state_dict:
            perm = self._check_loaded(prefix, "input_permutation", state_dict[pkey], (torch.int64, torch.int32), (K,),
                                      target_meta=on_meta, what="an int64 tensor")
            if not perm.is_meta and K and not torch.equal(perm.sort().values, torch.arange(K, device=perm.device)):
                outside = int(((perm < 0) | (perm >= K)).sum())
                raise self._error(prefix, f"input_permutation must be a permutation of 0..{K - 1} (each input "
                                          f"feature once), got values in {int(perm.min())}..{int(perm.max())}: "
                                          f"{outside} out of range, {K - perm.unique().numel()} repeated")
            if self.input_permutation is None:
                self.register_buffer("input_permutation", torch.empty_like(perm, device=self.meta.device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self.release_caches()

    def extra_repr(self) -> str:
        paths = {"auto": f"auto (sparse below {self.dense_threshold} rows on CPU, semi-structured from "
                         f"{self.semi_min_rows} rows on CUDA, else dense)"}.get(self.mode, self.mode)
        s = (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={self.values.dtype}, mode={paths}"
        )
        if self.activation != "none":
            s += f", activation={self.activation!r}"
        if self.last_path is not None:
            s += f", last_path={self.last_path}"
        return s
