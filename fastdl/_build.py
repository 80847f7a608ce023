"""Build configuration of the compiled extension ``fastdl._C``.

Shared by ``setup.py`` (ahead-of-time build with pip) and ``fastdl._extension`` (JIT build with ninja), so the
two builds compile the same sources with the same flags. This module imports nothing heavy at import time;
torch is imported inside the functions that need it.

Switches (environment variables):
  FASTDL_NO_EXTENSION=1   build no compiled extension at all (pure-PyTorch reference kernels only)
  FASTDL_NO_CUDA=1        compile only the C++ CPU sources, even with a CUDA build of torch
  TORCH_CUDA_ARCH_LIST    CUDA targets, e.g. "8.0;9.0a" (default for pip builds: "8.0;9.0a";
                          default for JIT builds: the GPUs that are visible, else the pip default)
  CUDA_HOME / CUDA_PATH   the CUDA toolkit (default: found from nvcc on PATH, or /usr/local/cuda)
  FASTDL_DEBUG=1          keep the debug info in the library (stripped at link time otherwise)
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
DEFAULT_ARCHS = "8.0;9.0a"

# Warnings: the project's own code compiles clean at -Wall -Wextra (scripts/check_build_warnings.py fails the test
# run on a warning from csrc/); third-party headers are silenced at the flag level, never csrc's own diagnostics:
#  * -Wno-init-self: GCC 12's own AVX-512 headers define _mm512_undefined_*() as `__m512i __Y = __Y;`, which -Wall in
#    C++ reported ~1,500 times ("'__Y' is used uninitialized", at every intrinsic inlined into csrc; GCC bug 105593,
#    fixed in GCC 13). Only self-initialisation is exempted: any other uninitialized use in csrc is still reported.
#  * torch's headers (and the nvidia wheels' ones) warn at -Wextra (unused parameters): build_config includes them
#    with -isystem (GCC then ignores the -I that torch adds for the same directories).
WARN_FLAGS = ["-Wall", "-Wextra", "-Wno-init-self"]
# The C++ standard is the one torch asks for (C++20 in 2.14). -fopenmp is required: ATen's at::parallel_for is
# inline header code that runs serially in a translation unit compiled without OpenMP.
CXX_FLAGS = ["-O3", "-fvisibility=hidden", "-fopenmp", *WARN_FLAGS]
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-Xcompiler=" + ",".join(WARN_FLAGS)]


def _system_includes(dirs: list[str]) -> list[str]:
    """-isystem flags for third-party header directories (their warnings are not the project's)."""
    return [flag for d in dirs for flag in ("-isystem", d)]


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cpp_sources(root: str = ROOT) -> list[str]:
    pats = ["csrc/*.cpp", "csrc/cpu/*.cpp"]
    return sorted(p for pat in pats for p in glob.glob(os.path.join(root, pat)))


def cuda_sources(root: str = ROOT) -> list[str]:
    return sorted(glob.glob(os.path.join(root, "csrc/cuda/*.cu")))


def all_source_files(root: str = ROOT) -> list[str]:
    """Every file whose change requires a rebuild (sources and headers)."""
    exts = (".cpp", ".cu", ".h", ".cuh", ".hpp")
    out = []
    for dirpath, _, files in os.walk(os.path.join(root, "csrc")):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(exts)]
    return sorted(out)


def find_cuda_home() -> str | None:
    """The CUDA toolkit root. torch guesses it from the nvcc on PATH (``/usr/local/bin/nvcc`` -> ``/usr/local``),
    which breaks linking (-lcudart is looked for in /usr/local/lib); resolve symlinks and check for the headers."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        path = os.environ.get(var)
        if path and os.path.exists(os.path.join(path, "include", "cuda_runtime.h")):
            return path
    nvcc = shutil.which("nvcc")
    candidates = []
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"]
    for path in candidates:
        if os.path.exists(os.path.join(path, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(path, "bin", "nvcc")
        ):
            return path
    return None


def _nvidia_wheel_dirs() -> tuple[list[str], list[str]]:
    """Include and library dirs of the nvidia-* wheels that come with a CUDA build of torch (they carry the
    cuBLAS/cuSPARSE headers the toolkit may lack)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    incs, libs = [], []
    if spec is None or not spec.submodule_search_locations:
        return incs, libs
    for base in spec.submodule_search_locations:
        for sub in ("cu13", "cu12"):
            inc, lib = os.path.join(base, sub, "include"), os.path.join(base, sub, "lib")
            if os.path.exists(os.path.join(inc, "cublasLt.h")):
                incs.append(inc)
                if os.path.isdir(lib):
                    libs.append(lib)
        for sub in ("cublas", "cusparse", "cuda_runtime"):  # older per-library wheel layout (cu12)
            inc, lib = os.path.join(base, sub, "include"), os.path.join(base, sub, "lib")
            if os.path.isdir(inc):
                incs.append(inc)
            if os.path.isdir(lib):
                libs.append(lib)
    return incs, libs


def _runpath(lib_dir: str, jit: bool) -> str:
    """Where the loader looks for cuBLASLt at run time. A pip build (a wheel, or an install) must not carry the
    build environment's absolute path: the nvidia wheel's lib dir is named relative to the installed fastdl/_C*.so
    (``$ORIGIN/../nvidia/cu13/lib`` in the same site-packages; torch also loads cuBLASLt itself on import). A JIT
    build stays on this machine and keeps the absolute path."""
    parts = os.path.normpath(lib_dir).split(os.sep)
    if not jit and "nvidia" in parts:
        return "$ORIGIN/../" + "/".join(parts[parts.index("nvidia"):])
    return lib_dir


def _cublaslt_link_flags(lib_dirs: list[str], cuda_home: str, jit: bool = False) -> list[str]:
    """Link cuBLASLt. The wheels ship only versioned names (libcublasLt.so.13), so link by file name."""
    for d in lib_dirs + [os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")]:
        for name in sorted(glob.glob(os.path.join(d, "libcublasLt.so*")), key=len):
            base = os.path.basename(name)
            return [f"-L{d}", f"-l:{base}", f"-Wl,-rpath,{_runpath(d, jit)}"]
    return ["-lcublasLt"]


def arch_flags(jit: bool) -> tuple[list[str], str]:
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if not archs and jit:
        import torch

        if torch.cuda.is_available():  # JIT on a GPU machine: build only for the GPUs that are here
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
            archs = ";".join(f"{a}.{b}{'a' if (a, b) == (9, 0) else ''}" for a, b in caps)
    archs = archs or DEFAULT_ARCHS
    flags = []
    for arch in archs.replace(",", ";").replace(" ", ";").split(";"):
        if not arch:
            continue
        ptx = arch.endswith("+PTX")
        arch = arch.removesuffix("+PTX")
        num = arch.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags, archs


@dataclass
class BuildConfig:
    enabled: bool = True
    with_cuda: bool = False
    cuda_home: str | None = None
    sources: list[str] = field(default_factory=list)
    cxx_flags: list[str] = field(default_factory=list)
    nvcc_flags: list[str] = field(default_factory=list)
    include_dirs: list[str] = field(default_factory=list)
    ldflags: list[str] = field(default_factory=list)
    archs: str = ""
    notes: list[str] = field(default_factory=list)

    def fingerprint(self) -> str:
        """Hash of every csrc file and every flag: a change means the JIT build must run."""
        h = hashlib.sha256()
        for path in all_source_files():
            h.update(os.path.relpath(path, ROOT).encode())
            with open(path, "rb") as f:
                h.update(f.read())
        import torch

        meta = [torch.__version__, str(self.with_cuda), self.archs, *self.cxx_flags, *self.nvcc_flags, *self.ldflags]
        h.update("\0".join(meta).encode())
        return h.hexdigest()[:16]


def no_extension_requested() -> bool:
    """FASTDL_NO_EXTENSION=1: build no compiled extension."""
    return _truthy("FASTDL_NO_EXTENSION")


def build_config(jit: bool = False) -> BuildConfig:
    """Decide what to compile. Every skipped part is recorded in ``notes`` with the reason."""
    cfg = BuildConfig()
    if no_extension_requested():
        cfg.enabled = False
        cfg.notes.append("FASTDL_NO_EXTENSION=1: not building fastdl._C (the PyTorch reference kernels serve every op)")
        return cfg
    import torch
    from torch.utils.cpp_extension import include_paths

    cfg.sources = cpp_sources()
    cfg.cxx_flags = list(CXX_FLAGS) + _system_includes(include_paths())
    cfg.ldflags = list(LD_FLAGS)
    if not _truthy("FASTDL_DEBUG"):
        # Python's own CFLAGS carry -g: with debug info the library is 48 MB, without it 9 MB. Stripped at link
        # time (no recompile); FASTDL_DEBUG=1 keeps it.
        cfg.ldflags.append("-Wl,--strip-debug")
    cfg.include_dirs = [CSRC]
    if _truthy("FASTDL_NO_CUDA"):
        cfg.notes.append("FASTDL_NO_CUDA=1: skipping the CUDA sources (csrc/cuda/*.cu)")
        return cfg
    if torch.version.cuda is None:
        cfg.notes.append(f"torch {torch.__version__} is not a CUDA build: skipping the CUDA sources")
        return cfg
    cuda_home = find_cuda_home()
    if cuda_home is None:
        cfg.notes.append("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH): skipping the CUDA sources")
        return cfg
    cu = cuda_sources()
    if not cu:
        return cfg
    incs, libs = _nvidia_wheel_dirs()
    gencode, archs = arch_flags(jit)
    cfg.with_cuda = True
    cfg.cuda_home = cuda_home
    cfg.archs = archs
    cfg.sources += cu
    cfg.cxx_flags.append("-DFASTDL_WITH_CUDA")
    cfg.nvcc_flags = NVCC_FLAGS + ["-DFASTDL_WITH_CUDA"] + gencode + _system_includes(include_paths() + incs)
    cfg.cxx_flags += _system_includes(incs)
    cfg.include_dirs += incs
    cfg.ldflags += _cublaslt_link_flags(libs, cuda_home, jit)
    cfg.notes.append(f"CUDA sources: {len(cu)} file(s) for {archs} with {cuda_home}/bin/nvcc")
    return cfg


BUILD_NOTES = "_build_notes.json"  # in the package: what the last build compiled and skipped (``fastdl info``)


def build_summary(cfg: BuildConfig | None, reason: str | None = None) -> dict:
    """What a build compiled and what it skipped and why: pip shows none of the build's own lines without ``-v``, so
    the build writes this next to the package and ``fastdl info`` prints it."""
    if cfg is None or not cfg.enabled:
        return {"compiled": "nothing (no compiled extension)", "notes": ([reason] if reason else []) + (
            cfg.notes if cfg is not None else [])}  # fmt: skip
    cuda = f"CUDA sources for {cfg.archs}" if cfg.with_cuda else "no CUDA sources"
    return {"compiled": f"{len(cfg.sources)} source files ({cuda})", "notes": list(cfg.notes)}


def write_build_notes(summary: dict, package_dir: str) -> None:
    import json

    try:
        with open(os.path.join(package_dir, BUILD_NOTES), "w") as f:
            json.dump(summary, f, indent=1)
    except OSError:  # a read-only tree: the notes are a convenience
        pass


def read_build_notes(package_dir: str) -> dict | None:
    import json

    try:
        with open(os.path.join(package_dir, BUILD_NOTES)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def use_cuda_home(cuda_home: str | None) -> None:
    """Point torch.utils.cpp_extension at the right toolkit (it caches a guess at import time)."""
    if not cuda_home:
        return
    os.environ["CUDA_HOME"] = cuda_home
    mod = sys.modules.get("torch.utils.cpp_extension")
    if mod is not None:
        mod.CUDA_HOME = cuda_home
