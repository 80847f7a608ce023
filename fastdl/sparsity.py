"""2:4 sparsity workflow: prune, fine-tune with the masks kept, report, and convert for inference.

    report = fastdl.sparsity.prune(model)               # 2:4 masks by magnitude on every eligible Linear
    with fastdl.sparsity.MaskedTraining(model, opt):     # masked gradients keep pruned weights at zero
        train(model, opt)                                # also inside DistributedDataParallel, unchanged
    print(fastdl.sparsity.sparsity_report(model))
    fastdl.sparsity.sparsify(model)                      # pruned layers -> fastdl.nn.Sparse24Linear (inference)

Masks are deterministic functions of the weights (``fastdl.ops.mask_2_4``: ties to the lower index, NaN kept), so
identical weights give identical masks on every DDP rank; DDP also broadcasts the packed mask buffers from rank 0
with the other buffers. Each pruned layer holds its mask as the buffer ``weight_mask`` (uint8, bit-packed in the
``compress_2_4`` meta layout: 4 bits per group of 4, 1/8 of a byte per weight), so it is saved in the
``state_dict`` and restored by ``load_state_dict`` (prune the fresh model first so the buffer exists).

Optional: ``prune(model, permute=True)`` searches an input-channel permutation per layer that keeps more weight
magnitude under the 2:4 constraint (greedy channel swaps); the permutation is applied to the layer's weight columns
and, to keep the function unchanged, must be undone on its input: fastdl stores it as the buffer
``input_permutation`` and gathers the input with it in a forward pre-hook. The report gives the kept-magnitude
fraction with and without the permutation.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._layers import find_layers, replace_layers
from ._pruned import (  # the state a pruned layer carries (shared with the conversion recipe)
    MASK_BUFFER,
    PERM_BUFFER,
    attach_mask,
    attach_permutation,
    get_mask,
    is_pruned,
    kept_magnitude_fraction,
    prepare_pruned,
    remask,
)
from ._recipe import note_conversion
from .nn._base import is_dtensor
from .ops import sparse24 as sp_ops


# ----------------------------------------------------------------------------------------------- selection
def _linear_types() -> tuple[type, ...]:
    """The layers 2:4 pruning applies to (matched exactly, as everywhere in fastdl: see ``fastdl._layers``)."""
    from .nn.fused_linear import FusedLinear

    return (nn.Linear, FusedLinear)


def is_2_4(weight: torch.Tensor) -> bool:
    """True when every group of 4 consecutive input weights (along the last dimension) has at most 2 non-zeros;
    False when the last dimension is not a multiple of 4. The one 2:4 pattern check of fastdl."""
    if weight.dim() < 1 or weight.shape[-1] % 4:
        return False
    if weight.numel() == 0:
        return True
    w = weight.detach()
    return bool(((w.reshape(-1, w.shape[-1] // 4, 4) != 0).sum(-1) <= 2).all())


@dataclasses.dataclass
class PruneReport:
    """What ``prune`` did: the pruned layers with their kept-magnitude fraction, and the skipped ones with why."""

    pruned: dict[str, float] = dataclasses.field(default_factory=dict)  # name -> kept |w| fraction
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> reason
    kept_without_permutation: dict[str, float] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"2:4 pruning: {len(self.pruned)} layer(s) pruned, {len(self.skipped)} skipped"]
        for name, kept in self.pruned.items():
            extra = ""
            if name in self.kept_without_permutation:
                extra = f" (without permutation {self.kept_without_permutation[name]:.4f})"
            lines.append(f"  pruned  {name or '<root>'}: kept |w| fraction {kept:.4f}{extra}")
        for name, why in self.skipped.items():
            lines.append(f"  skipped {name or '<root>'}: {why}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- masks
@torch.no_grad()
def apply_masks(model: nn.Module) -> None:
    """Zero the pruned weights of every pruned layer (``weight *= mask``)."""
    for m in model.modules():
        if is_pruned(m):
            remask(m)


# ----------------------------------------------------------------------------------------------- permutation
def _group_kept(wabs: torch.Tensor) -> torch.Tensor:
    """Kept magnitude of each group of 4 columns: wabs [N, 4] groups -> sum of the 2 largest per row, summed."""
    top2 = wabs.topk(2, dim=-1).values
    return top2.sum()


@torch.no_grad()
def search_permutation(weight: torch.Tensor, iters: int = 2, max_pairs: int = 20000, seed: int = 0) -> torch.Tensor:
    """A permutation of the input channels (columns) of ``weight`` that keeps more magnitude under 2:4.

    Greedy channel swaps between groups: a random sample of column pairs (i in group a, j in group b) is scored by
    the change of kept magnitude of the two groups if i and j trade places; improving swaps are applied, best
    first, each group at most once per round. Deterministic for a given seed. Returns perm such that
    ``weight[:, perm]`` is the permuted weight.
    """
    w = weight.detach().float().abs()
    N, K = w.shape
    G = K // 4
    perm = torch.arange(K, device=w.device)
    if G < 2:
        return perm
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for _ in range(iters):
        wp = w[:, perm].reshape(N, G, 4)
        base = wp.topk(2, dim=-1).values.sum(dim=(0, 2))  # [G]
        n = min(max_pairs, G * (G - 1) * 8)
        ga = torch.randint(0, G, (n,), generator=gen)
        gb = torch.randint(0, G, (n,), generator=gen)
        keep = ga != gb
        ga, gb = ga[keep], gb[keep]
        ia = torch.randint(0, 4, (ga.numel(),), generator=gen)
        ib = torch.randint(0, 4, (ga.numel(),), generator=gen)
        ga, gb, ia, ib = (t.to(w.device) for t in (ga, gb, ia, ib))
        A = wp[:, ga].clone()  # [N, P, 4]
        B = wp[:, gb].clone()
        P = ga.numel()
        ar = torch.arange(P, device=w.device)
        ca, cb = A[:, ar, ia].clone(), B[:, ar, ib].clone()
        A[:, ar, ia], B[:, ar, ib] = cb, ca
        gain = A.topk(2, dim=-1).values.sum(dim=(0, 2)) + B.topk(2, dim=-1).values.sum(dim=(0, 2))
        gain = gain - base[ga] - base[gb]
        order = torch.argsort(gain, descending=True)
        used = set()
        applied = 0
        # plain Python lists: one tensor element access per candidate made this loop ~10 us a step
        gain_l, ga_l, gb_l, ia_l, ib_l, perm_l = (t.tolist() for t in (gain, ga, gb, ia, ib, perm))
        for k in order.tolist():
            if gain_l[k] <= 1e-12:
                break
            a, b = ga_l[k], gb_l[k]
            if a in used or b in used:
                continue
            used.update((a, b))
            pa, pb = a * 4 + ia_l[k], b * 4 + ib_l[k]
            perm_l[pa], perm_l[pb] = perm_l[pb], perm_l[pa]
            applied += 1
        perm = torch.tensor(perm_l, dtype=perm.dtype, device=perm.device)
        if applied == 0:
            break
    return perm


# ----------------------------------------------------------------------------------------------- prune
@torch.no_grad()
def prune(model: nn.Module, filter_fn=None, *, permute: bool = False) -> PruneReport:
    """Apply 2:4 magnitude masks to the chosen Linear layers of ``model`` (in place) and return a report.

    Candidates are ``nn.Linear`` and ``fastdl.nn.FusedLinear`` modules (exactly those types: subclasses are left
    alone, as everywhere in fastdl - see ``fastdl._layers``); ``filter_fn(name, module) -> bool`` selects among them
    (default: all). Layers whose ``in_features`` is not a multiple of 4 are skipped and listed with the reason, as
    are layers already pruned. Each pruned layer gets the buffer ``weight_mask`` (packed) and its weight is
    multiplied by the mask. ``permute=True`` also searches an input-channel permutation per layer (see the module
    docstring). Call it before wrapping the model in DistributedDataParallel or FSDP (or on ``ddp.module``).
    """
    report = PruneReport()
    for site in find_layers(model, _linear_types(), filter_fn, report.skipped, where="fastdl.sparsity.prune"):
        name, m = site.name, site.module
        if is_pruned(m):
            report.skipped[name] = "already pruned"
            continue
        K = m.weight.shape[1]
        if K % 4:
            report.skipped[name] = f"in_features = {K} is not a multiple of 4"
            continue
        w = m.weight
        if permute:
            report.kept_without_permutation[name] = kept_magnitude_fraction(w)
            perm = search_permutation(w)
            if not torch.equal(perm, torch.arange(K, device=perm.device)):
                w.copy_(w[:, perm])
                attach_permutation(m, perm)
        mask = sp_ops.mask_2_4(w.detach())
        kept = kept_magnitude_fraction(w, mask)
        attach_mask(m, mask, kept)
        report.pruned[name] = kept
    note_conversion(model)
    return report


@torch.no_grad()
def _mask_like_weight(module: nn.Module, t: torch.Tensor) -> None:
    """``t *= mask`` for a tensor shaped like the module's weight (its gradient, an optimizer state); a tensor
    sharded by FSDP2 (a DTensor) is multiplied by the same shard of the mask."""
    mask = get_mask(module, t.dtype)
    if is_dtensor(t):
        from torch.distributed.tensor import distribute_tensor

        mask = distribute_tensor(mask, t.device_mesh, t.placements, src_data_rank=None)  # local split, no comm
    t.mul_(mask)


@torch.no_grad()
def _drift(module: nn.Module) -> int:
    """How many weights of this rank's (shard of the) weight are non-zero where the mask prunes them."""
    w, keep = module.weight.detach(), get_mask(module)
    if is_dtensor(w):
        from torch.distributed.tensor import distribute_tensor

        keep = distribute_tensor(keep, w.device_mesh, w.placements, src_data_rank=None).to_local()
        w = w.to_local()
    return int(torch.count_nonzero(w.masked_select(~keep)))


# ----------------------------------------------------------------------------------------------- training
# Optimizers whose step keeps a weight at exactly 0 when its gradient is 0 at every step and its state starts at 0
# there (matched exactly, as layer types are everywhere in fastdl):
#   SGD (momentum, dampening, nesterov, weight_decay, maximize): buf = momentum * buf + (1 - dampening) * (g + wd * w)
#       = 0 and w -= lr * buf leaves 0;
#   Adam and AdamW (weight_decay both ways, amsgrad, maximize; for-loop, foreach and fused): m = 0 and
#       w -= lr * m / (sqrt(v) + eps) leaves 0 for any v >= 0 as long as eps > 0 (eps = 0 would be 0 / 0); AdamW's
#       decoupled decay multiplies w by 1 - lr * wd and Adam's adds wd * w to g: 0 either way.
# Any other optimizer may move a weight whose gradient is 0 (a non-zero initial state, a decay that adds, a
# non-elementwise update): MaskedTraining re-masks the weights after each of its steps, as before.
ZERO_KEEPING_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
CHECK_EVERY = 100  # steps between two checks of the safety net (one pass over the pruned weights: ~1% of one pass)


def _why_remask(optimizer) -> str | None:
    """None when ``optimizer`` keeps zero weights at zero under zero gradients (see ZERO_KEEPING_OPTIMIZERS), else
    why MaskedTraining must re-mask after each step."""
    kind = type(optimizer)
    if kind not in ZERO_KEEPING_OPTIMIZERS:
        return (f"{kind.__module__}.{kind.__qualname__} is not one of the optimizers known to keep zero weights at "
                "zero under zero gradients (SGD, Adam, AdamW)")  # fmt: skip
    if kind is not torch.optim.SGD:
        eps = [g.get("eps", 1e-8) for g in optimizer.param_groups]
        if not all(float(e) > 0 for e in eps):
            return f"{kind.__name__} with eps = {min(float(e) for e in eps)}: its update is 0 / 0 where m = v = 0"
    return None


class MaskedTraining:
    """Keep the 2:4 masks of a pruned model through training, at the cost of one in-place pass over each pruned
    weight's gradient (the dense step does none; the masking adds no pass over the weights).

    * the gradient of every pruned weight is multiplied by its mask in place as soon as it is accumulated
      (``register_post_accumulate_grad_hook``: before DDP all-reduces it, no new tensor), so a pruned weight, which
      is zero, only ever gets zero gradients;
    * with SGD, Adam or AdamW (``ZERO_KEEPING_OPTIMIZERS``: their step leaves such a weight at exactly zero, with
      momentum, weight decay, amsgrad, nesterov, foreach or fused; the optimizer's existing state is masked once
      when MaskedTraining starts) nothing else is done per step. Safety net: every ``check_every`` steps (default
      100) and when MaskedTraining is removed, the pruned weights are checked; weights found off zero are
      re-masked, a warning names the optimizer, and from then on the weights are re-masked after every step;
    * with any other optimizer (or Adam/AdamW with eps = 0) the weights are re-masked after each
      ``optimizer.step()``, one more pass over them (``remask_every_step`` is True, ``remask_reason`` says why).

    Without an optimizer only the gradients are masked, and the weights are checked when MaskedTraining is removed.

    Works with a plain model, a ``DistributedDataParallel`` wrapper or an FSDP2 (``fully_shard``) model, unchanged:
    under FSDP2 the hook goes on the sharded parameter (FSDP2 runs its post-accumulate-grad hooks on the sharded
    gradient after the reduce-scatter; masking is linear, so masking the reduced shard equals reducing masked
    gradients) and each rank masks, checks and re-masks its shard with the same shard of the mask. Create it after
    wrapping; a weight replaced later (``fully_shard`` after MaskedTraining, ``load_state_dict(assign=True)``) is
    noticed after the next optimizer step, which is then undone at the pruned positions (weights and optimizer state
    re-masked). Use as a context manager or call ``remove()`` to take the hooks off. Under DDP, the packed masks are
    buffers, and DDP broadcasts buffers before every forward by default: a collective per step the dense model
    (without buffers) does not make, 1.19x the dense step at the demo's MLP (2 ranks, gloo). The masks are identical
    on every rank and never change, so when they are the model's only buffers, wrap with
    ``forward_sync_buffers=False`` (torch 2.14; ``broadcast_buffers=False`` in torch versions without it): 1.01-1.03x.

    Cost (AMD EPYC Zen 4, 1 thread, forward + backward + fused AdamW, CPU time per step on a machine shared with
    other jobs: indicative): the 2:4 step is 1.05-1.12x the dense step at the demo's MLP (64-512-512-64-10, 64
    rows) and 1.09-1.12x at a 4096 x 4096 layer (64 rows), where the mask pass over the gradient reads and writes
    3 x 64 MiB; re-masking the weights after each step and masking the gradient out of place (what MaskedTraining
    did before) cost 1.17-1.21x and 1.6-2.0x. Speed note: Adam/AdamW's for-loop and foreach implementations compute
    ``sqrt(exp_avg_sq)`` with a call that is 6x slower on zeros than on other values on that CPU with torch 2.14
    (0.66 vs 0.11 ms for 512 x 512 floats), and the pruned half of ``exp_avg_sq`` is zero: a 512 x 512 AdamW step
    took 0.67 ms instead of 0.37 (the 2:4 step 1.30-1.35x the dense one at the demo's MLP). ``fused=True``
    (PyTorch's fused CPU/CUDA kernel) has no such slow path (0.23 ms): prefer it for 2:4 fine-tuning.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 check_every: int = CHECK_EVERY) -> None:  # fmt: skip
        if isinstance(check_every, bool) or not isinstance(check_every, int):
            raise TypeError(f"MaskedTraining: check_every must be an int, got {type(check_every).__name__}")
        if check_every < 0:
            raise ValueError(f"MaskedTraining: check_every must be >= 0 (0: check only on remove), got {check_every}")
        self.model = model
        self.optimizer = optimizer
        self.check_every = check_every
        self.modules = [m for m in model.modules() if is_pruned(m)]
        if not self.modules:
            raise ValueError("MaskedTraining: the model has no pruned layers; call fastdl.sparsity.prune(model) first")
        self.steps = 0
        self.remask_reason = _why_remask(optimizer) if optimizer is not None else None
        self._handles = []
        self._hooked: list[torch.Tensor] = [None] * len(self.modules)  # the weight that carries each module's hook
        for i in range(len(self.modules)):
            self._hook_weight(i)
        if optimizer is not None:
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
            if self.remask_reason is None:
                self._mask_optimizer_state()
        self.apply()

    @property
    def remask_every_step(self) -> bool:
        """True when the weights are re-masked after every optimizer step (see the class docstring)."""
        return self.remask_reason is not None

    def _hook_weight(self, i: int) -> None:
        """Put the gradient hook on module i's weight: a post-accumulate-grad hook on a parameter (plain, DDP's,
        or FSDP2's sharded one), else a tensor hook on the gradient flowing into it."""
        m = self.modules[i]
        w = m.weight
        if w.requires_grad and w.is_leaf:  # in place on .grad, right after accumulation (before DDP's all-reduce)
            self._handles.append(w.register_post_accumulate_grad_hook(self._accumulated_grad_hook(m)))
        elif w.requires_grad:  # not a leaf (a parametrization, ...): the gradient flowing into it, out of place
            self._handles.append(w.register_hook(self._grad_hook(m)))
        self._hooked[i] = w  # (a frozen weight gets no gradient: nothing to mask)

    @staticmethod
    def _accumulated_grad_hook(module):
        def hook(param):  # lean: it runs for every pruned weight in every backward (~6 us over the mul_ itself)
            g = param.grad
            if g is None:
                return
            if is_dtensor(g) or g.requires_grad:  # FSDP2's shard; a gradient kept for a higher-order backward
                _mask_like_weight(module, g)
            else:
                g.mul_(get_mask(module, g.dtype))

        return hook

    @staticmethod
    def _grad_hook(module):
        def hook(grad):
            return grad * get_mask(module, grad.dtype)

        return hook

    @torch.no_grad()
    def _mask_optimizer_state(self) -> None:
        """Zero the optimizer's existing state (momentum, Adam's moments) at the pruned positions, so a state built
        before pruning cannot move a pruned weight (the safety net would catch it, but only after it moved)."""
        for m in self.modules:
            for v in self.optimizer.state.get(m.weight, {}).values():
                if isinstance(v, torch.Tensor) and v.shape == m.weight.shape and v.is_floating_point():
                    _mask_like_weight(m, v)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        replaced = [i for i, m in enumerate(self.modules) if m.weight is not self._hooked[i]]
        if replaced:  # wrapped or reassigned after MaskedTraining started: hook the new weights, undo this step
            for i in replaced:
                self._hook_weight(i)
            if self.remask_reason is None:
                self._mask_optimizer_state()
            self.apply()
        elif self.remask_every_step:
            self.apply()
        elif self.check_every and self.steps % self.check_every == 0:
            self.check()

    def check(self) -> int:
        """The safety net: count the pruned weights (of this rank's shards) that are not zero, re-mask the layers
        that have any and return the count. A non-zero count warns (once) and switches to re-masking after every
        step. Run every ``check_every`` optimizer steps and by ``remove()``; may be called at any time."""
        drifted = 0
        for m in self.modules:
            n = _drift(m)
            if n:
                remask(m)
                drifted += n
        if drifted and not self.remask_every_step:
            import warnings

            name = "no optimizer given" if self.optimizer is None else type(self.optimizer).__name__
            self.remask_reason = (f"{drifted} pruned weight(s) found off zero after {self.steps} step(s) ({name}): "
                                  "something other than the masked gradients moved them")  # fmt: skip
            warnings.warn(f"fastdl.sparsity.MaskedTraining: {self.remask_reason}; re-masked, and from now on the "
                          "weights are re-masked after every optimizer step", RuntimeWarning, stacklevel=2)  # fmt: skip
        return drifted

    def apply(self) -> None:
        """Re-mask the weights now (``weight *= mask`` for every pruned layer)."""
        for m in self.modules:
            remask(m)

    def remove(self) -> None:
        """Take the hooks off, after a last ``check()`` (so the model leaves with its masks exact)."""
        if self._handles:
            self.check()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked = [None] * len(self.modules)

    def __enter__(self) -> MaskedTraining:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """The bool ``[out, in]`` mask of every pruned layer, by module name."""
    return {name: get_mask(m) for name, m in model.named_modules() if is_pruned(m)}


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as the unpruned architecture expects it: without the ``weight_mask`` /
    ``input_permutation`` buffers, and with permuted weights put back in the inputs' order (the pruned weights stay
    zero). Loads into a fresh copy of the model that was never pruned (e.g. plain ``nn.Linear`` layers)."""
    sd = model.state_dict()
    for name, m in model.named_modules():
        if not is_pruned(m):
            continue
        prefix = f"{name}." if name else ""
        sd.pop(prefix + MASK_BUFFER, None)
        perm = sd.pop(prefix + PERM_BUFFER, None)
        if perm is not None:
            w = sd[prefix + "weight"]
            sd[prefix + "weight"] = torch.empty_like(w).index_copy_(1, perm, w)
    return sd


# ----------------------------------------------------------------------------------------------- report
def sparsity_report(model: nn.Module) -> list[dict]:
    """One row per Linear layer: shape, whether it is pruned, density (non-zero fraction of the weight), whether
    every group of 4 has at most 2 non-zeros, and the kept-magnitude fraction (for a pruned layer: of the weight at
    pruning time; for a dense layer: what a 2:4 magnitude mask would keep now). The returned list prints as a
    table via ``format_report``."""
    rows = []
    types = _linear_types()
    from .nn.sparse24 import Sparse24Linear

    for name, m in model.named_modules():
        if isinstance(m, Sparse24Linear):
            rows.append({"layer": name, "type": "Sparse24Linear", "shape": (m.out_features, m.in_features),
                         "pruned": True, "density": 0.5, "pattern_2_4": True, "kept_magnitude": None,
                         "bytes": m.weight_bytes()})
            continue
        if type(m) not in types:
            continue
        w = m.weight.detach()
        N, K = w.shape
        density = (w != 0).float().mean().item() if w.numel() else 1.0
        ok = is_2_4(w) if K % 4 == 0 and w.numel() else None
        if is_pruned(m):
            kept = m._sp24_state.kept_fraction
        else:
            kept = kept_magnitude_fraction(w) if K % 4 == 0 and w.numel() else None
        rows.append({"layer": name, "type": type(m).__name__, "shape": (N, K), "pruned": is_pruned(m),
                     "density": density, "pattern_2_4": ok, "kept_magnitude": kept,
                     "bytes": w.numel() * w.element_size()})
    return rows


def format_report(rows: list[dict]) -> str:
    head = f"{'layer':30s} {'type':15s} {'shape':>14s} {'pruned':>6s} {'density':>7s} {'2:4':>5s} {'kept|w|':>7s}"
    lines = [head]
    for r in rows:
        kept = "-" if r["kept_magnitude"] is None else f"{r['kept_magnitude']:.4f}"
        lines.append(f"{r['layer'] or '<root>':30s} {r['type']:15s} {str(r['shape']):>14s} {str(r['pruned']):>6s} "
                     f"{r['density']:7.4f} {str(r['pattern_2_4']):>5s} {kept:>7s}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- inference
def sparsify(model: nn.Module, *, dtype: torch.dtype | None = None, mode: str = "auto", include_2_4: bool = False,
             **kwargs) -> nn.Module:
    """Replace the pruned Linear layers of ``model`` with ``fastdl.nn.Sparse24Linear`` (in place; returns model).

    ``include_2_4=True`` also converts unpruned layers whose weight already has at most 2 non-zeros in every group
    of 4. ``dtype`` casts the kept values (e.g. torch.bfloat16 for inference): a floating dtype (float32, bfloat16,
    float16, float64; anything else raises TypeError); ``mode`` and ``kwargs`` go to
    ``Sparse24Linear``. A layer with an input permutation keeps it (``Sparse24Linear.input_permutation``).
    """
    from .nn._base import check_dtype_arg
    from .nn.sparse24 import Sparse24Linear

    # the kept values are cast to dtype: an integer dtype would silently round them (most to 0)
    check_dtype_arg("fastdl.sparsity.sparsify", dtype)
    if type(model) in _linear_types():
        raise ValueError("sparsify: the model itself is a single Linear; use Sparse24Linear.from_linear(model)")

    def chosen(name: str, m: nn.Module) -> bool:
        return is_pruned(m) or (include_2_4 and is_2_4(m.weight))

    sites = find_layers(model, _linear_types(), chosen, where="fastdl.sparsity.sparsify")
    model = replace_layers(  # takes input_permutation along
        model, sites, lambda s: Sparse24Linear.from_linear(s.module, dtype=dtype, mode=mode, **kwargs)
    )
    return note_conversion(model)


__all__ = [
    "MaskedTraining",
    "is_2_4",
    "PruneReport",
    "apply_masks",
    "dense_state_dict",
    "format_report",
    "get_mask",
    "is_pruned",
    "kept_magnitude_fraction",
    "masks",
    "prepare_pruned",
    "prune",
    "search_permutation",
    "sparsify",
    "sparsity_report",
]
