"""The checkpoint side of fastdl's Hugging Face quantizer (fastdl/hf.py): safetensors headers read before any
weight, each fastdl layer checked against them on the meta device, and each layer finished after transformers set its
tensors."""

from __future__ import annotations

from ._recipe import _NEEDS_FASTDL

_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}  # fmt: skip


def _read_headers(checkpoint_files) -> dict | None:
    """{key: (file, shape, dtype name)} of the safetensors checkpoint files (headers only); None for other files."""
    if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
        return None
    from safetensors import safe_open

    out = {}
    for f in checkpoint_files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                out[k] = (f, tuple(sl.get_shape()), sl.get_dtype())
    return out


def _check_layer_against_checkpoint(model, name: str, m, header: dict, where: str) -> None:
    """Load the checkpoint's tensors of one fastdl layer as meta tensors of their shape and dtype (the small format
    record for real) into the meta layer: the layer's own checks run before any weight is read, and the layer takes
    the checkpoint's dtypes (so transformers casts nothing)."""
    import torch
    from safetensors import safe_open

    from .nn import CheckpointError

    prefix = getattr(model, "base_model_prefix", "")
    candidates = [name + "."] + ([f"{prefix}.{name}."] if prefix else []) + (
        [name[len(prefix) + 1:] + "."] if prefix and name.startswith(prefix + ".") else [])
    sd = {}
    for p in candidates:
        sd = {k[len(p):]: v for k, v in header.items() if k.startswith(p) and "." not in k[len(p):]}
        if sd:
            break
    tensors = {}
    for key, (file, shape, dt) in sd.items():
        dtype = getattr(torch, _ST_DTYPES.get(dt, ""), None)
        if key == "_extra_state":
            with safe_open(file, framework="pt") as st:
                tensors[key] = st.get_tensor(p + key)
        elif dtype is None:
            raise CheckpointError(f"fastdl checkpoint {where!r}, layer {name!r}: tensor {key} has dtype {dt}, "
                                  "which no fastdl layer stores")  # fmt: skip
        else:
            tensors[key] = torch.empty(shape, dtype=dtype, device="meta")
    try:
        m.load_state_dict(tensors, strict=True, assign=True)
    except Exception as err:
        raise CheckpointError(f"fastdl checkpoint {where!r}, layer {name!r} ({type(m).__name__}): "
                              f"{err}") from err  # fmt: skip


def _finish_loaded_layer(m, name: str, where: str) -> None:
    """After transformers set the layer's tensors: every one must have data, then the layer loads its own state (its
    checks on the values, and what it derives from them: packed weights, caches)."""
    from .nn import CheckpointError

    if type(m).__name__ not in _NEEDS_FASTDL:
        return
    sd = m.state_dict()
    meta = [k for k, v in sd.items() if v.is_meta]
    if meta:
        raise CheckpointError(f"fastdl checkpoint {where!r}, layer {name!r}: tensors {meta} were not loaded")
    try:
        m.load_state_dict(sd, strict=True)
    except Exception as err:
        raise CheckpointError(f"fastdl checkpoint {where!r}, layer {name!r} ({type(m).__name__}): "
                              f"{err}") from err  # fmt: skip
