"""The int4 formats of ``fastdl.ops.int4`` in plain PyTorch (nothing here is an op; each runs once per model): the
nibble layout of ``qweight`` (``pack_int4`` / ``unpack_int4``), its exact dequantized weight (``dequantize_int4``), and
the GPTQ / AutoAWQ checkpoint layouts converted exactly into it (``import_gptq`` / ``import_awq``).

``fastdl.ops.int4`` declares the ops, documents the format and re-exports every public name here.
"""

from __future__ import annotations

import torch

from ._library import require, require_dtype

BLOCK = 32  # input features per 16-byte block of qweight


# ---------------------------------------------------------------------------------------------- layout helpers
def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """Codes ``u [N, K]`` (uint8, 0..15; K a multiple of 32) as ``qweight [N, K / 2]`` in the contract's nibble order:
    byte ``16 b + i`` = ``u[32 b + i] | u[32 b + 16 + i] << 4``. Values above 15 raise ValueError."""
    fn = "pack_int4"
    require_dtype(u.dtype == torch.uint8, lambda: f"{fn}: u must be uint8 (codes 0..15), got dtype {u.dtype}")
    require(u.dim() == 2, lambda: f"{fn}: u must be 2-D [N, K], got shape {tuple(u.shape)}")
    N, K = u.shape
    require(K % BLOCK == 0, lambda: f"{fn}: K = u.shape[1] = {K} must be a multiple of {BLOCK}")
    if not u.is_meta and u.numel():
        require(bool((u <= 15).all()), lambda: f"{fn}: u must hold codes 0..15, got a maximum of {int(u.max())}")
    blocks = u.reshape(N, K // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0, :] | (blocks[:, :, 1, :] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(qweight: torch.Tensor, K: int | None = None) -> torch.Tensor:
    """The codes ``u [N, K]`` (uint8, 0..15) of ``qweight [N, K / 2]`` (inverse of ``pack_int4``)."""
    fn = "unpack_int4"
    require_dtype(qweight.dtype == torch.uint8, lambda: f"{fn}: qweight must be uint8, got dtype {qweight.dtype}")
    require(qweight.dim() == 2, lambda: f"{fn}: qweight must be 2-D [N, K / 2], got shape {tuple(qweight.shape)}")
    N, half = qweight.shape
    if K is None:
        K = 2 * half
    require(
        K == 2 * half and K % BLOCK == 0,
        lambda: f"{fn}: qweight of shape {tuple(qweight.shape)} holds K = {2 * half} codes per row; K must be that "
        f"and a multiple of {BLOCK}, got K = {K}",
    )
    blocks = qweight.reshape(N, K // BLOCK, 1, BLOCK // 2)
    return torch.cat((blocks & 15, blocks >> 4), dim=2).reshape(N, K)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:  # fmt: skip
    """``W [N, K]`` in fp32: ``(u - z) * float32(s)`` per group (exact), z = 8 when ``zeros`` is None."""
    u = unpack_int4(qweight)
    N, K = u.shape
    if K == 0:
        return torch.zeros((N, 0), dtype=torch.float32, device=qweight.device)
    groups = K // group_size
    z = 8.0 if zeros is None else zeros.float().reshape(N, groups, 1)
    w = (u.float().reshape(N, groups, group_size) - z) * scales.float().reshape(N, groups, 1)
    return w.reshape(N, K)


# --------------------------------------------------------------------------------------------------- importers
def _check_int32_2d(fn, name, t, shape_doc):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    require_dtype(t.dtype == torch.int32, lambda: f"{fn}: {name} must be int32 (packed codes), got dtype {t.dtype}")
    require(t.dim() == 2, lambda: f"{fn}: {name} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """The 8 4-bit fields of each int32 of ``t [A, B]`` as ``[A, B, 8]`` (field j = bits 4j..4j+3), int64."""
    shifts = torch.arange(0, 32, 4, device=t.device, dtype=torch.int64)
    return (t.to(torch.int64)[..., None] >> shifts) & 15


def _check_scales(fn, scales, groups, N):
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{fn}: scales must be a torch.Tensor, got {type(scales).__name__}")
    require_dtype(scales.is_floating_point(), lambda: f"{fn}: scales must be float16, got dtype {scales.dtype}")
    require(
        scales.dim() == 2 and scales.shape[1] == N,
        lambda: f"{fn}: scales must have shape [K / group_size, N] with N = {N}, got {tuple(scales.shape)}",
    )
    s16 = scales.to(torch.float16)
    require(
        bool(torch.equal(s16.to(scales.dtype), scales)) if scales.dtype != torch.float16 else True,
        lambda: f"{fn}: scales must be float16 (or hold float16 values exactly), got {scales.dtype} values that "
        "float16 cannot hold",
    )
    require(bool(torch.isfinite(s16).all()), lambda: f"{fn}: scales must be finite")
    return s16


def _regroup(fn, src_group: int, K: int):
    """The fastdl group size for a checkpoint's group size: the largest of 128, 64, 32 that divides it (the source
    group's scale and zero repeat over its sub-groups: exact)."""
    for g in (128, 64, 32):
        if src_group % g == 0 and K % g == 0:
            return g
    raise ValueError(f"{fn}: the checkpoint's group size {src_group} (K = {K}) is not a multiple of 32; fastdl's int4 "
                     "groups are 32, 64 or 128 input features")  # fmt: skip


def _finish_import(fn, u_nk, scales_gn, zeros_gn, src_group, K, N):
    """Codes ``[N, K]``, scales / zeros ``[K / src_group, N]`` (zeros: ints, None = 8) into the contract's tensors."""
    G = _regroup(fn, src_group, K)
    rep = src_group // G
    scales = scales_gn.t().repeat_interleave(rep, dim=1).contiguous()
    zeros = None
    if zeros_gn is not None:
        z = zeros_gn.t().repeat_interleave(rep, dim=1)
        bad = (z < 0) | (z > 15)
        if bool(bad.any()):
            n, g = bad.nonzero()[0].tolist()
            raise ValueError(f"{fn}: qzeros decodes to a zero point of {int(z[n, g])} at output {n}, group {g}; fastdl "
                             "zero points are 0..15 (a GPTQ 'v1' checkpoint stores z - 1: a stored 15 means z = 16, "
                             "which the packing of z = 0 produces by overflow; such a checkpoint is damaged)")
        zeros = None if bool((z == 8).all()) else z.to(torch.uint8).contiguous()
    return pack_int4(u_nk.to(torch.uint8).contiguous()), scales, zeros, G


def _check_checkpoint(fn, qweight, qzeros, scales, packed_along_n: bool):
    """The checks both importers make on ``qweight`` (int32, packed 8 codes per int32 along N when
    ``packed_along_n`` (AWQ), else along K (GPTQ)), ``qzeros`` int32 ``[K / G, N / 8]`` and ``scales`` float16
    ``[K / G, N]``; returns ``(K, N, groups, scales as float16)``."""
    if packed_along_n:
        _check_int32_2d(fn, "qweight", qweight, "[K, N / 8]")
        K, N, k_from = qweight.shape[0], qweight.shape[1] * 8, "qweight.shape[0]"
    else:
        _check_int32_2d(fn, "qweight", qweight, "[K / 8, N]")
        K, N, k_from = qweight.shape[0] * 8, qweight.shape[1], "8 * qweight.shape[0]"
    require(K % BLOCK == 0, lambda: f"{fn}: in_features K = {k_from} = {K} must be a multiple of 32")
    _check_int32_2d(fn, "qzeros", qzeros, "[K / group_size, N / 8]")
    groups = qzeros.shape[0]
    require(
        qzeros.shape[1] * 8 == N and groups >= 1,
        lambda: f"{fn}: qzeros must have shape [K / group_size, N / 8] with N = {N}, got {tuple(qzeros.shape)}",
    )
    s16 = _check_scales(fn, scales, groups, N)
    require(
        s16.shape[0] == groups,
        lambda: f"{fn}: scales must have shape [K / group_size, N] = [{groups}, {N}] (as qzeros), got "
        f"{tuple(s16.shape)}",
    )
    require(K % groups == 0, lambda: f"{fn}: K = {K} is not a whole number of the checkpoint's {groups} groups")
    return K, N, groups, s16


def _unpack_along_n(t: torch.Tensor, N: int, order=None) -> torch.Tensor:
    """The codes of ``t [A, N / 8]`` (int32, 8 codes each along N) as ``[A, N]``: field ``i`` of column ``c`` holds
    output ``8 c + order[i]`` (``order`` None: ``8 c + i``)."""
    f = _nibbles(t)  # [A, N / 8, 8]
    if order is not None:
        f = f[:, :, torch.argsort(torch.tensor(order, device=t.device))]  # field holding output j of each 8
    return f.reshape(t.shape[0], N)


_GPTQ_FORMATS = {"v1": "v1", "gptq": "v1", "v2": "v2", "gptq_v2": "v2"}


def import_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None = None,
                *, format: str = "v1"):  # fmt: skip
    """Convert a 4-bit GPTQ layer as Hugging Face checkpoints store it (AutoGPTQ / optimum / transformers' GPTQ
    integration) into fastdl's int4 format, exactly. Returns ``(qweight, scales, zeros, group_size, perm)``:
    ``zeros`` None when every zero point is 8 (``sym=True``), ``perm`` None or an int64 ``[K]`` input permutation.

    The checkpoint's tensors (K = in_features, N = out_features, G its group size):
      ``qweight`` int32 ``[K / 8, N]``: code of input ``k`` in row ``k // 8``, bits ``4 (k % 8)`` .. ``+3``;
      ``qzeros``  int32 ``[K / G, N / 8]``: zero point of output ``n`` in column ``n // 8``, bits ``4 (n % 8)``;
      ``scales``  float16 ``[K / G, N]``;
      ``g_idx``   int32 ``[K]`` (optional): the group of each input feature; with act-order (``desc_act``) it is
                  not ``k // G``: the inputs are then sorted by group (``perm``) so that groups are contiguous, and the
                  layer computes ``x[..., perm] @ W.T`` (exact).
    ``W[:, k] = (code - zero) * scale`` of group ``g_idx[k]``. ``format="v1"`` (default; ``checkpoint_format:
    "gptq"`` in quantize_config.json, what AutoGPTQ, optimum, transformers and GPTQModel write by default: ``qzeros``
    holds ``zero - 1``, added back when unpacking) or ``"v2"`` (``checkpoint_format: "gptq_v2"``: ``qzeros`` holds the
    zero point); the quantize_config names ``"gptq"`` / ``"gptq_v2"`` are accepted too. (Packing facts from
    AutoGPTQ's ``qlinear_cuda_old.QuantLinear.pack`` and its torch fallback: ``zeros -= 1`` before packing, ``zeros +
    1`` after unpacking.) A checkpoint group size that is a multiple of 32 is supported (256, or ``-1``: one group of
    K, become groups of 128 with repeated scales)."""
    fn = "import_gptq"
    require(format in _GPTQ_FORMATS, lambda: f"{fn}: format must be 'v1' ('gptq') or 'v2' ('gptq_v2'), got {format!r}")
    format = _GPTQ_FORMATS[format]
    K, N, groups, s16 = _check_checkpoint(fn, qweight, qzeros, scales, packed_along_n=False)
    src_group = K // groups
    u_kn = _nibbles(qweight).permute(0, 2, 1).reshape(K, N)  # row r, field j -> input 8 r + j
    z_gn = _unpack_along_n(qzeros, N)  # column c, field j -> output 8 c + j
    if format == "v1":
        z_gn = z_gn + 1
    perm = None
    if g_idx is not None:
        if not isinstance(g_idx, torch.Tensor):
            raise TypeError(f"{fn}: g_idx must be a torch.Tensor or None, got {type(g_idx).__name__}")
        require_dtype(not g_idx.is_floating_point() and g_idx.dtype != torch.bool,
                      lambda: f"{fn}: g_idx must be an integer tensor (int32), got dtype {g_idx.dtype}")
        require(g_idx.shape == (K,), lambda: f"{fn}: g_idx must have shape [K] = [{K}], got {tuple(g_idx.shape)}")
        gi = g_idx.to(torch.int64)
        require(bool(((gi >= 0) & (gi < groups)).all()),
                lambda: f"{fn}: g_idx values must be group indices 0..{groups - 1}")
        counts = torch.bincount(gi, minlength=groups)
        require(bool((counts == src_group).all()),
                lambda: f"{fn}: g_idx must give each of the {groups} groups {src_group} input features, got counts "
                f"{counts.tolist()[:8]}...")
        if not torch.equal(gi, torch.arange(K, device=gi.device) // src_group):
            perm = torch.sort(gi, stable=True).indices
            u_kn = u_kn[perm]
    return (*_finish_import(fn, u_kn.t(), s16, z_gn, src_group, K, N), perm)


# AutoAWQ's GEMM packing (awq/modules/linear/gemm.py WQLinear_GEMM.from_linear, awq/utils/packing_utils.py): int32
# column c of qweight [K, N / 8] holds in bits 4 i .. 4 i + 3 the code of output 8 c + AWQ_ORDER[i]; qzeros likewise;
# zero points are stored as they are (no - 1).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def import_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor):
    """Convert a 4-bit AutoAWQ layer (the GEMM version, as Hugging Face checkpoints of AWQ models store it) into
    fastdl's int4 format, exactly. Returns ``(qweight, scales, zeros, group_size)`` (``zeros`` None when every zero
    point is 8).

    The checkpoint's tensors: ``qweight`` int32 ``[K, N / 8]`` and ``qzeros`` int32 ``[K / G, N / 8]``, packed along N
    in AWQ's interleaved order (field ``i`` of column ``c``, bits ``4 i`` .. ``4 i + 3``, holds output
    ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``scales`` float16 ``[K / G, N]``; ``W[n, k] = (code - zero) * scale``."""
    fn = "import_awq"
    K, N, groups, s16 = _check_checkpoint(fn, qweight, qzeros, scales, packed_along_n=True)
    u_kn, z_gn = _unpack_along_n(qweight, N, AWQ_ORDER), _unpack_along_n(qzeros, N, AWQ_ORDER)
    return _finish_import(fn, u_kn.t(), s16, z_gn, K // groups, K, N)
