"""What a 2:4-pruned layer carries: its packed mask (the buffer ``weight_mask`` and an unpacked cache), an optional
input permutation (the buffer ``input_permutation``, undone on the input by a forward pre-hook) and the hook that
re-applies the mask after ``load_state_dict``. ``fastdl.sparsity`` prunes layers with these; the conversion recipe
(``fastdl._recipe``) records pruned layers and rebuilds them from a checkpoint (``prepare_pruned``), so both stand on
this module and neither on the other. The public names are ``fastdl.sparsity``'s."""

from __future__ import annotations

import torch
from torch import nn

from .nn._base import is_dtensor
from .ops import sparse24 as sp_ops

MASK_BUFFER = "weight_mask"
PERM_BUFFER = "input_permutation"


def is_pruned(module: nn.Module) -> bool:
    """True when ``prune`` gave this module a 2:4 mask."""
    return isinstance(getattr(module, MASK_BUFFER, None), torch.Tensor) and hasattr(module, "_sp24_state")


# ----------------------------------------------------------------------------------------------- masks
class _State:
    """Per pruned module: the unpacked mask, cached (not a buffer: DDP broadcasts buffers and gloo has no bool),
    also in the dtypes it is applied in."""

    def __init__(self, kept_fraction: float):
        self.kept_fraction = kept_fraction
        self.mask: torch.Tensor | None = None
        self.cast: dict = {}
        self.key = None

    def invalidate(self) -> None:
        self.mask, self.cast, self.key = None, {}, None


def get_mask(module: nn.Module, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The ``[out, in]`` mask of a pruned module (bool, or 0/1 in ``dtype``), unpacked from its ``weight_mask``
    buffer and cached. The cache follows the buffer's storage and device and is refreshed by ``load_state_dict``;
    it deliberately ignores in-place writes of the same values (DDP re-broadcasts buffers on every forward)."""
    packed = getattr(module, MASK_BUFFER)
    st: _State = module._sp24_state
    key = (packed.data_ptr(), packed.device, module.weight.device)
    if st.mask is None or st.key != key:
        st.invalidate()
        st.mask = sp_ops.unpack_meta(packed, module.weight.shape[1]).to(module.weight.device)
        st.key = key
    if dtype == torch.bool:
        return st.mask
    m = st.cast.get(dtype)
    if m is None:
        m = st.cast[dtype] = st.mask.to(dtype)
    return m


def kept_magnitude_fraction(weight: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """``sum |w * mask| / sum |w|`` (the 2:4 magnitude mask of w when mask is None)."""
    w = weight.detach().float().abs()
    if mask is None:
        mask = sp_ops.mask_2_4(weight.detach())
    total = w.sum().item()
    return (w * mask).sum().item() / total if total > 0 else 1.0


@torch.no_grad()
def remask(module: nn.Module) -> None:
    """``weight *= mask``; a weight sharded by FSDP2 (a DTensor) is multiplied by the same shard of the mask."""
    w = module.weight
    mask = get_mask(module, w.dtype)
    if is_dtensor(w):
        from torch.distributed.tensor import distribute_tensor

        mask = distribute_tensor(mask, w.device_mesh, w.placements, src_data_rank=None)  # local split, no comm
    w.mul_(mask)


def _load_hook(module, incompatible_keys) -> None:
    """After load_state_dict: the packed mask may have changed; re-apply it to the loaded weight."""
    module._sp24_state.invalidate()
    remask(module)


# ----------------------------------------------------------------------------------------------- layers
def _permute_pre_hook(module, args):
    x, perm = args[0], getattr(module, PERM_BUFFER)
    if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[-1] != perm.shape[0]):
        # index_select would gather a wider x without error (and the layer compute on the wrong features)
        raise ValueError(f"{type(module).__name__}(in_features={perm.shape[0]}) with an input permutation: x.shape[-1] "
                         f"must equal in_features = {perm.shape[0]}, got x of shape {tuple(x.shape)}")
    return (x.index_select(-1, perm), *args[1:])


def attach_mask(m: nn.Module, mask: torch.Tensor, kept: float) -> None:
    """Make ``m`` a pruned layer: the packed ``weight_mask`` buffer, its cache, the load hook; weight *= mask."""
    m.register_buffer(MASK_BUFFER, sp_ops.pack_mask(mask.cpu()).to(m.weight.device))
    m._sp24_state = _State(kept)
    m.weight.mul_(mask.to(m.weight.dtype))
    m.register_load_state_dict_post_hook(_load_hook)


def attach_permutation(m: nn.Module, perm: torch.Tensor) -> None:
    m.register_buffer(PERM_BUFFER, perm.to(m.weight.device))
    m.register_forward_pre_hook(_permute_pre_hook)


@torch.no_grad()
def prepare_pruned(m: nn.Module, permuted: bool = False) -> None:
    """Give a fresh (unpruned) layer the buffers and hooks of a pruned one, so that the ``state_dict`` of a pruned
    layer of this shape loads into it (``fastdl.load`` uses it). The mask is the weight's 2:4 magnitude mask until
    the checkpoint replaces it."""
    if is_pruned(m):
        return
    if permuted:
        attach_permutation(m, torch.arange(m.weight.shape[1]))
    mask = sp_ops.mask_2_4(m.weight.detach())
    attach_mask(m, mask, kept_magnitude_fraction(m.weight, mask))
