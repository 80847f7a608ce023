"""``fastdl.info()`` / ``fastdl info``: versions, CPU ISA, GPU, where the extension came from, and which backend
serves each op on each device (and why the others do not)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch

from . import _extension, backends
from ._version import __version__


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def collect() -> dict:
    _extension.ensure_loaded()  # imports fastdl._C if built; JIT-builds only under FASTDL_JIT=1
    gpu = None
    if torch.cuda.is_available():  # info is the one place that may initialise CUDA: it is asked to
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
    devices = ["cpu"] + (["cuda"] if gpu else [])
    ops = {}
    for op in backends.registered_ops():
        ops[op] = {}
        for dev in devices:
            try:
                chosen = backends.select(op, dev)
                error = None
            except backends.BackendUnavailableError as exc:
                chosen, error = None, str(exc)
            ops[op][dev] = {
                "backend": chosen,
                "error": error,
                "candidates": [
                    {"backend": b, "available": ok, "why_not": why} for b, ok, why in backends.explain(op, dev)
                ],
            }
    from .data import loader_info

    li = loader_info()
    why = li["copy_backend_reason"]
    loader_mode = f"{li['mode']} (copy: {li['copy_backend']}" + (f"; {why}" if why else "") + ")"
    return {
        "fastdl": __version__,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda_runtime": torch.version.cuda,
        "cpu_isa": _extension.cpu_isa(),
        "cpu": _extension.cpu_info(),
        "cpu_features": _extension.cpu_features(),
        "int8_cpu_kernels": _extension.int8_cpu_kernels(),
        "threads": torch.get_num_threads(),
        "gpu": gpu,
        "extension": _extension.extension_info(),
        "backend_requested": backends.requested(),
        "loader_mode": loader_mode,
        "ops": ops,
    }


def format_cpu_level(cpu: dict) -> str:
    """'avx2 (capped by FASTDL_CPU_ISA; the CPU has avx512_bf16)' or just the level."""
    if cpu["capped"]:
        return f"{cpu['level']} (capped by FASTDL_CPU_ISA; the CPU has {cpu['detected_level']})"
    return cpu["level"]


def format_info(d: dict) -> str:
    ext = d["extension"]
    lines = [
        f"fastdl {d['fastdl']}  torch {d['torch']}  triton {d['triton'] or 'not installed'}  "
        f"CUDA {d['cuda_runtime'] or 'none (CPU build of torch)'}",
        f"CPU: {d['cpu']['model']}, {d['threads']} threads",
        f"CPU ISA level: {format_cpu_level(d['cpu'])}  "
        f"({', '.join(k for k, v in d['cpu_features'].items() if v) or 'none'})",
        "CPU kernels: " + ", ".join(f"{cap} {fam}" for cap, fam in d["cpu"]["kernels"].items()),
    ]
    if d["cpu"].get("fused_linear_onednn"):
        lines.append(f"  fused_linear also routes {d['cpu']['fused_linear_onednn']} to oneDNN (PyTorch's "
                     "mkldnn::_linear_pointwise) at the large shapes where it is faster (FASTDL_CPU_ONEDNN=0: never)")
    if d["gpu"]:
        g = d["gpu"]
        lines.append(f"GPU: {g['name']} ({g['capability']}, {g['memory_gib']} GiB) x{g['count']}")
    else:
        lines.append("GPU: none visible")
    src = {"aot": "built by pip (AOT)", "jit": "JIT-built with ninja", "missing": "MISSING"}[ext["source"]]
    lines.append(f"extension fastdl._C: {src}" + (f" [{ext['path']}]" if ext["path"] else ""))
    if ext["source"] != "missing":
        lines.append(f"  CUDA kernels compiled in: {'yes' if ext['with_cuda'] else 'no'}")
    elif ext["error"]:
        lines.append(f"  why: {ext['error']}")
        lines.append(f"  fix: {_extension.FIX}")
    if ext.get("build"):
        lines.append(f"  the build compiled: {ext['build']['compiled']}")
        lines.extend(f"  the build noted: {note}" for note in ext["build"]["notes"])
    lines.append(f"backend requested: {d['backend_requested']} (FASTDL_BACKEND / fastdl.use_backend)")
    lines.append(f"loader mode: {d['loader_mode']}")
    lines.append("ops:")
    for op, per_dev in d["ops"].items():
        for dev, r in per_dev.items():
            head = f"  {op:<28} {dev:<5} -> {r['backend'] or 'ERROR'}"
            notes = [f"{c['backend']}: {c['why_not']}" for c in r["candidates"] if not c["available"]]
            if r["error"]:
                notes = [r["error"]]
            lines.append(head + (f"   (passed over: {'; '.join(notes)})" if notes else ""))
    return "\n".join(lines)


def info(print_result: bool = True) -> dict:
    """Collect (and by default print) what fastdl runs with here. Returns the facts as a dict."""
    d = collect()
    if print_result:
        print(format_info(d))
    return d


def env_summary() -> dict:
    """Short facts for benchmark CSV rows."""
    d = {"fastdl": __version__, "torch": torch.__version__, "triton": _triton_version(),
         "cpu_isa": _extension.cpu_isa()}
    d["threads"] = torch.get_num_threads()
    d["host"] = os.uname().nodename if hasattr(os, "uname") else ""
    return d
