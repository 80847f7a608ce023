"""Find the compiled extension ``fastdl._C``: built by pip (AOT), JIT-built from ``csrc/`` with ninja, or missing.

Loading the extension registers its C++/CUDA kernels with the dispatcher under ``fastdl_cpp::*``. Nothing here
compiles unless asked (``FASTDL_JIT=1`` or ``load_extension(jit=True)``), and nothing initialises CUDA.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import threading
import time
import warnings

from . import _build

_lock = threading.RLock()
_state: dict = {"attempted": False, "module": None, "source": "missing", "error": None, "path": None,
                "jit_failed": False}

FIX = (
    "build it with `pip install --no-build-isolation .` (or `-e .`) in the fastdl source tree, "
    "or set FASTDL_JIT=1 in a source checkout to JIT-compile csrc/ with ninja"
)


def _jit_requested() -> bool:
    return os.environ.get("FASTDL_JIT", "").strip().lower() in ("1", "true", "yes", "on")


def is_source_checkout() -> bool:
    return os.path.isdir(_build.CSRC) and os.path.exists(os.path.join(_build.ROOT, "setup.py"))


def jit_build_dir() -> str:
    import torch

    base = os.environ.get("FASTDL_JIT_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fastdl", "jit"
    )
    tag = f"torch{torch.__version__.replace('+', '_')}"
    return os.path.join(base, tag)


def _jit_build(verbose: bool = False):
    if not is_source_checkout():
        raise RuntimeError("fastdl: JIT build needs a source checkout (csrc/ next to the fastdl package)")
    cfg = _build.build_config(jit=True)
    _state["build_notes"] = _build.build_summary(cfg)
    if not cfg.enabled:
        raise RuntimeError("fastdl: JIT build requested but " + "; ".join(cfg.notes))
    _build.use_cuda_home(cfg.cuda_home or _build.find_cuda_home())
    from torch.utils import cpp_extension

    build_dir = jit_build_dir()
    os.makedirs(build_dir, exist_ok=True)
    stamp_path = os.path.join(build_dir, "fastdl.stamp")
    fingerprint = cfg.fingerprint()
    try:
        with open(stamp_path) as f:
            up_to_date = f.read().strip() == fingerprint
    except OSError:
        up_to_date = False
    t0 = time.perf_counter()
    compiles = not up_to_date or _ninja_has_work(build_dir)
    if compiles:
        what = f"{len(cfg.sources)} sources, CUDA {'for ' + cfg.archs if cfg.with_cuda else 'skipped'}"
        print(f"fastdl: JIT-compiling csrc/ ({what}) into {build_dir} ...", flush=True)
    mod = cpp_extension.load(
        name="fastdl_C",
        sources=cfg.sources,
        extra_cflags=cfg.cxx_flags,
        extra_cuda_cflags=cfg.nvcc_flags,
        extra_include_paths=cfg.include_dirs,
        extra_ldflags=cfg.ldflags,
        build_directory=build_dir,
        with_cuda=cfg.with_cuda,
        is_python_module=True,
        verbose=verbose,
    )
    if compiles:
        print(f"fastdl: JIT build done in {time.perf_counter() - t0:.1f} s", flush=True)
    if not up_to_date:
        with open(stamp_path, "w") as f:
            f.write(fingerprint)
    _state["path"] = getattr(mod, "__file__", build_dir)
    return mod


def _ninja_has_work(build_dir: str) -> bool:
    """Whether ninja will recompile something in ``build_dir`` (a source newer than its object, e.g. after a
    ``touch``, although its content and so the fingerprint did not change): then the compile line is printed too.
    ``ninja -n`` is a dry run (~10 ms)."""
    if not os.path.exists(os.path.join(build_dir, "build.ninja")):
        return True
    try:
        r = subprocess.run(["ninja", "-n", "-C", build_dir], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return "no work to do" not in r.stdout


def load_extension(jit: bool | None = None, verbose: bool = False):
    """Load ``fastdl._C`` and return it (or None when it is missing and no JIT build was asked for).

    ``jit=True`` (or FASTDL_JIT=1) builds ``csrc/`` with ninja into a cache and loads that build; it rebuilds only
    when a source changed. ``jit=None`` follows FASTDL_JIT; otherwise the pip-built module is imported.
    """
    if jit is None:
        jit = _jit_requested()
    with _lock:
        if _state["module"] is not None and (not jit or _state["source"] == "jit"):
            return _state["module"]
        if jit:
            _state["attempted"] = True
            try:
                _state.update(module=_jit_build(verbose), source="jit", error=None)
            except Exception as exc:  # report, then let the caller see it
                _state.update(error=f"JIT build failed: {exc}")
                raise
            return _state["module"]
        if not _state["attempted"]:
            _state["attempted"] = True
            try:
                mod = importlib.import_module("fastdl._C")
                _state.update(module=mod, source="aot", error=None, path=getattr(mod, "__file__", None))
            except ImportError as exc:
                _state.update(error=str(exc))
        return _state["module"]


def ensure_loaded() -> bool:
    """True when the compiled kernels are registered (loads them on first call). Under FASTDL_JIT=1 a JIT build that
    fails (no ninja, no compiler, a compile error) is reported once as a warning with its reason and the ops run
    their PyTorch reference kernels; ``load_extension(jit=True)`` called explicitly raises instead."""
    if _state["jit_failed"]:
        return False
    try:
        return load_extension() is not None
    except Exception as exc:  # only a JIT build raises here
        _state["jit_failed"] = True
        warnings.warn(
            f"fastdl: FASTDL_JIT=1 but the JIT build of fastdl._C failed: {type(exc).__name__}: {exc}; using the "
            "PyTorch reference kernels (`fastdl info` says what serves each op). To fix: install ninja and a C++ "
            "compiler (`pip install ninja`), or build once with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=2,
        )
        return False


def warn_if_missing() -> None:
    """Called once by ``import fastdl``: import the AOT module (cheap: no compile, no CUDA init) and say so once
    when it is missing. With FASTDL_JIT=1 the JIT build happens on first use instead."""
    if _jit_requested():
        return
    if not ensure_loaded() and not os.environ.get("FASTDL_NO_EXTENSION_WARNING"):
        warnings.warn(
            f"fastdl: compiled extension fastdl._C not available ({_state['error']}); "
            f"using the PyTorch reference kernels. To fix: {FIX}.",
            RuntimeWarning,
            stacklevel=3,
        )


# The torch releases CI builds and tests against (requirements/oldest.txt and requirements/dev.txt; pyproject's
# dependency range says the same).
TESTED_TORCH = ((2, 11), (2, 14))


def torch_version_tested(version: str) -> bool:
    """Whether ``version`` ("2.14.1+cu130") is within TESTED_TORCH (by major.minor)."""
    try:
        major, minor = (int(v) for v in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return TESTED_TORCH[0] <= (major, minor) <= TESTED_TORCH[1]


def warn_if_untested_torch() -> None:
    """Called once by ``import fastdl``: a warning naming the tested range when this torch is outside it."""
    import torch

    if not torch_version_tested(torch.__version__):
        lo, hi = (f"{a}.{b}" for a, b in TESTED_TORCH)
        warnings.warn(
            f"fastdl: torch {torch.__version__} is outside the tested range {lo}-{hi} (CI builds and tests torch "
            f"{lo} and {hi}); fastdl may work, but its compiled extension and kernels were not tested with it. "
            f'To stay in range: pip install "torch>={lo},<{TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1] + 1}".',
            RuntimeWarning,
            stacklevel=3,
        )


def extension_info() -> dict:
    mod = _state["module"]
    return {
        "source": _state["source"] if mod is not None else "missing",
        "path": _state["path"],
        "with_cuda": bool(getattr(mod, "with_cuda", False)),
        "error": _state["error"],
        # what the build compiled and skipped, with the reasons (pip hides the build's own lines without -v)
        "build": _state.get("build_notes") or _build.read_build_notes(os.path.dirname(os.path.abspath(__file__))),
    }


_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16")


def _proc_cpuinfo() -> tuple[str, set[str]]:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return model, flags


def _env_cap() -> str:
    want = os.environ.get("FASTDL_CPU_ISA", "").strip().lower()
    return {"none": "scalar", "avx512_vnni": "avx512", "avx512bf16": "avx512_bf16"}.get(want, want)


def cpu_info() -> dict:
    """The CPU as fastdl's kernels see it: ``model``, ``detected_level`` and ``level`` (one of scalar, avx2, avx512,
    avx512_bf16; ``level`` is capped by FASTDL_CPU_ISA, ``capped`` says whether the cap lowered it), ``features``
    and, per capability, the CPU ``kernels`` this process runs. From the extension (cpuid + XGETBV, csrc/cpu/cpu_isa.h)
    when it is loaded, else read from /proc/cpuinfo with the kernels given as the PyTorch reference."""
    mod = _state["module"]
    if mod is not None and hasattr(mod, "cpu_info"):
        return dict(mod.cpu_info())
    model, flags = _proc_cpuinfo()
    feats = {n: n in flags for n in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                                      "avx512_vnni", "avx512_bf16", "avx512_vbmi2")}  # fmt: skip
    detected = "scalar"
    if feats["avx2"] and feats["fma"] and feats["f16c"]:
        detected = "avx2"
        if all(feats[n] for n in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
            detected = "avx512_bf16" if feats["avx512_bf16"] else "avx512"
    cap = _env_cap()
    level = detected
    if cap in _LEVELS and _LEVELS.index(cap) < _LEVELS.index(detected):
        level = cap
    ref = "PyTorch reference (no extension)"
    return {
        "model": model,
        "detected_level": detected,
        "level": level,
        "capped": level != detected,
        "features": feats,
        "kernels": {"fused_linear": ref, "int8": ref, "sparse24": ref},
    }


def cpu_features() -> dict:
    """ISA extensions of this CPU as the kernels use them (capped by FASTDL_CPU_ISA)."""
    return dict(cpu_info()["features"])


def int8_cpu_kernels() -> str | None:
    """The int8 CPU kernels this process runs ("avx512_vnni+bf16", "avx512_vnni", "avx2" or "scalar": cpuid, capped
    by FASTDL_CPU_ISA), or None without the extension."""
    mod = _state["module"]
    if mod is not None and hasattr(mod, "int8_cpu_kernels"):
        return str(mod.int8_cpu_kernels())
    return None


def cpu_isa() -> str:
    """The ISA level fastdl's CPU kernels run at here: scalar, avx2, avx512 or avx512_bf16 (capped by
    FASTDL_CPU_ISA)."""
    return str(cpu_info()["level"])
