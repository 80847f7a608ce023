"""Build script of fastdl-kernels: the Python package ``fastdl`` and its compiled extension ``fastdl._C``.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension compiles against the torch
already installed, so pip must not build in an isolated environment with a second torch.
Switches: FASTDL_NO_EXTENSION=1 (no compiled extension), FASTDL_NO_CUDA=1 (CPU sources only),
TORCH_CUDA_ARCH_LIST (CUDA targets, default "8.0;9.0a"). See fastdl/_build.py.
"""

import importlib.util
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_module():
    spec = importlib.util.spec_from_file_location("fastdl_build", os.path.join(ROOT, "fastdl", "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _extensions():
    build = _load_build_module()
    if build.no_extension_requested():
        print("fastdl setup: FASTDL_NO_EXTENSION=1: building no compiled extension (PyTorch reference kernels only)")
        SUMMARY.update(build.build_summary(None, "FASTDL_NO_EXTENSION=1"))
        return [], {}
    try:
        import torch  # noqa: F401
    except ImportError:
        # Almost always pip's build isolation: it builds in a fresh environment without the user's torch. A wheel
        # built there would have no fastdl._C and "succeed" quietly (212 KB, pure Python): fail loudly instead.
        sys.exit(
            "fastdl setup: ERROR: torch is not importable in the build environment, so the compiled extension "
            "fastdl._C cannot be built.\n"
            "  If torch is installed: pip built in an isolated environment. Install with\n"
            "      pip install --no-build-isolation .      (or -e . while developing)\n"
            "  If it is not: install torch first (tested: torch>=2.11,<2.15), then the command above.\n"
            "  To build without the extension on purpose (PyTorch reference kernels only): FASTDL_NO_EXTENSION=1."
        )
    cfg = build.build_config(jit=False)
    for note in cfg.notes:
        print(f"fastdl setup: {note}")
    # pip shows none of these lines without -v: the build commands below write them next to the package, and
    # `fastdl info` prints them
    SUMMARY.update(build.build_summary(cfg))
    if not cfg.enabled:
        return [], {}
    build.use_cuda_home(cfg.cuda_home)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    rel = [os.path.relpath(s, ROOT) for s in cfg.sources]
    if cfg.with_cuda:
        ext = CUDAExtension(
            "fastdl._C",
            rel,
            include_dirs=cfg.include_dirs,
            extra_compile_args={"cxx": cfg.cxx_flags, "nvcc": cfg.nvcc_flags},
            extra_link_args=cfg.ldflags,
        )
    else:
        ext = CppExtension(
            "fastdl._C",
            rel,
            include_dirs=cfg.include_dirs,
            extra_compile_args={"cxx": cfg.cxx_flags},
            extra_link_args=cfg.ldflags,
        )
    print(f"fastdl setup: compiling {len(rel)} source file(s), CUDA: {'yes' if cfg.with_cuda else 'no'}")

    class BuildExt(BuildExtension.with_options(use_ninja=True)):
        def run(self):
            super().run()
            _write_notes(self.build_lib)

    return [ext], {"build_ext": BuildExt}


SUMMARY: dict = {}  # what this build compiles and skips (fastdl/_build.py: build_summary)


def _write_notes(build_lib: str) -> None:
    """fastdl/_build_notes.json in the build (the wheel) and in the source tree (in-place and editable builds)."""
    if not SUMMARY:
        return
    build = sys.modules["fastdl_build"]
    for package_dir in (os.path.join(build_lib, "fastdl"), os.path.join(ROOT, "fastdl")):
        if os.path.isdir(package_dir):
            build.write_build_notes(SUMMARY, package_dir)


class BuildPy(build_py):
    """Writes fastdl/kernels/__init__.py into the build. The source folder kernels/ has none on purpose: a regular
    top-level package named ``kernels`` in the repository root would shadow Hugging Face's ``kernels`` for any Python
    started there (fastdl/__init__.py maps the folder in a source checkout)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "fastdl", "kernels", "__init__.py")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write('"""fastdl\'s Triton kernels, one module per capability (kernels/ in the source tree)."""\n')
        _write_notes(self.build_lib)
        # from_pretrained of fastdl checkpoints without `import fastdl` (fastdl/_hf_autoload.py): a .pth file and the
        # top-level module it imports, at the root of the build, so that the wheel puts them into site-packages
        # itself. Editable installs do not get them (there, `import fastdl` first).
        for src, dst in (("fastdl-kernels-hf.pth", "fastdl-kernels-hf.pth"),
                         ("_hf_autoload.py", "_fastdl_hf_autoload.py")):  # fmt: skip
            self.copy_file(os.path.join(ROOT, "fastdl", src), os.path.join(self.build_lib, dst))


ext_modules, cmdclass = _extensions()
cmdclass["build_py"] = BuildPy

setup(
    packages=find_packages(include=["fastdl", "fastdl.*"]) + ["fastdl.kernels"],
    package_dir={"fastdl.kernels": "kernels"},
    package_data={"fastdl": ["fastdl-kernels-hf.pth"]},  # in the sdist; BuildPy puts it at the wheel's root
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
