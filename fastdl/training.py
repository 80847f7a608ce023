"""The training recipe for this machine: the precision a training loop should compute in (not to be confused with
the conversion recipe of ``fastdl._recipe``, which records how a model was converted).

    dtype = fastdl.training_dtype()              # torch.bfloat16 or torch.float32, for the default device
    with fastdl.training_autocast():             # torch.autocast(..., dtype=bfloat16), or nothing for float32
        loss = loss_fn(model(x), y)
    print(fastdl.training_recipe().reason)       # the rule that chose it, in words

The rule, per device type:

* CPU: ``bfloat16`` only where fastdl's CPU kernels run at the level ``avx512_bf16`` (AVX512-BF16: ``vdpbf16ps``
  multiplies bf16 pairs and accumulates in fp32 in one instruction); ``float32`` at ``avx512``, ``avx2`` and
  ``scalar``, where bf16 products are widened to fp32 in software: the step then costs what the fp32 step costs (or
  more) and loses precision. The level is the one ``fastdl info`` prints (cpuid + XGETBV, capped by
  ``FASTDL_CPU_ISA``), so a capped run gets the capped CPU's recipe.
  Measured (AMD EPYC Zen 4, torch 2.14.1, 1 thread, ``fastdl.convert(mlp, "fused")``, forward + backward + fused
  AdamW, CPU time per step, calls interleaved, 1-3 runs each; a machine shared with other jobs, so indicative),
  fastdl bf16 autocast step / fastdl fp32 step: at the demo's MLP 64-512-512-64-10 on 64 rows 0.68-0.75x native
  (avx512_bf16), 0.94-1.02x capped at avx2, 1.02-1.04x capped at avx512; at 64-1024-1024-64-10 on 256 rows
  0.59-0.65x native, 1.00-1.03x at avx2, 1.01-1.03x at avx512. Without the instruction bf16 buys nothing and costs
  precision. On an AMD EPYC Zen 3 (AVX2) the demo's bf16 training ran 0.74-1.11x PyTorch fp32 (issue 31); PyTorch's
  own bf16 there is its slow path (7x its fp32 step at the demo's shapes, 25x at 1024 wide, capped on the Zen 4).
* CUDA: ``bfloat16`` where ``torch.cuda.is_bf16_supported()`` (Ampere and newer: bf16 tensor cores, fp32's
  exponent range, no loss scaling needed); ``float32`` otherwise (fp16 autocast would need a ``GradScaler``: a
  change to the training loop that a precision choice should not make silently).
* any other device type: ``float32`` (no rule measured).

The recipe is advice: it never changes what a user asks for. ``torch.autocast(..., dtype=torch.bfloat16)`` around
fastdl's layers computes in bf16 on every CPU (on one without AVX512-BF16 through the software-widened kernels).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

# The one CPU level at which bf16 training pays (see the module docstring for the measurements).
NATIVE_BF16_LEVEL = "avx512_bf16"


@dataclasses.dataclass(frozen=True)
class TrainingRecipe:
    """What ``training_recipe`` chose: ``dtype`` (torch.bfloat16 or torch.float32), the ``device_type`` it is for,
    ``autocast`` (True when the loop should run under ``torch.autocast(device_type, dtype)``) and ``reason``."""

    dtype: torch.dtype
    device_type: str
    reason: str

    @property
    def autocast(self) -> bool:
        return self.dtype != torch.float32


def _device_type(device) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"fastdl.training_recipe: device must name a torch device, got {device!r}") from exc
    if not isinstance(device, torch.device):
        raise TypeError(f"fastdl.training_recipe: device must be None, a str or a torch.device, got "
                        f"{type(device).__name__}")  # fmt: skip
    return device.type


def training_recipe(device=None) -> TrainingRecipe:
    """The precision a training loop should use on ``device`` (None: CUDA when available, else the CPU), with the
    reason; the rule and its measurements are in ``fastdl.training``'s docstring."""
    kind = _device_type(device)
    if kind == "cpu":
        from . import _extension

        _extension.ensure_loaded()
        cpu = _extension.cpu_info()
        level = cpu.get("level", "scalar")
        capped = f" (capped by FASTDL_CPU_ISA; the CPU has {cpu.get('detected_level')})" if cpu.get("capped") else ""
        if level == NATIVE_BF16_LEVEL:
            return TrainingRecipe(torch.bfloat16, kind, f"CPU level {level}{capped}: native bf16 dot products "
                                  "(AVX512-BF16), bf16 autocast steps ~0.6-0.75x the fp32 step")  # fmt: skip
        return TrainingRecipe(torch.float32, kind, f"CPU level {level}{capped}: no AVX512-BF16, bf16 products would be "
                              "widened to fp32 in software (0.94-1.04x the fp32 step, less precise)")  # fmt: skip
    if kind == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return TrainingRecipe(torch.bfloat16, kind, "CUDA GPU with bf16 support: bf16 autocast")
        return TrainingRecipe(torch.float32, kind, "CUDA GPU without bf16 support (or none visible): fp32 "
                              "(fp16 autocast would need a GradScaler)")  # fmt: skip
    return TrainingRecipe(torch.float32, kind, f"device type {kind!r}: no measured rule, fp32")


def training_dtype(device=None) -> torch.dtype:
    """``torch.bfloat16`` or ``torch.float32``: the precision a training loop should use on ``device`` (None: CUDA
    when available, else the CPU). bf16 only where the hardware multiplies bf16 natively (CPU: AVX512-BF16 at
    fastdl's ISA level, capped by FASTDL_CPU_ISA; CUDA: ``torch.cuda.is_bf16_supported()``). See ``fastdl.training``."""
    return training_recipe(device).dtype


def training_autocast(device=None):
    """A context manager for the forward pass and the loss: ``torch.autocast(device_type, dtype=torch.bfloat16)``
    when ``training_dtype(device)`` is bf16, else one that does nothing (fp32)."""
    recipe = training_recipe(device)
    if recipe.autocast:
        return torch.autocast(recipe.device_type, dtype=recipe.dtype)
    return contextlib.nullcontext()


__all__ = ["NATIVE_BF16_LEVEL", "TrainingRecipe", "training_autocast", "training_dtype", "training_recipe"]
