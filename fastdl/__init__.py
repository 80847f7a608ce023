"""fastdl: fused mixed-precision, int8 and 2:4-sparse Linear kernels and a prefetching loader for PyTorch.

``import fastdl`` is cheap: it defines the ops, imports the compiled extension if pip built it (no compile, no CUDA
initialisation) and warns once, naming the fix, when it is missing. ``FASTDL_JIT=1`` builds ``csrc/`` on first use.
"""

import os as _os

__version__ = "0.1.0"

# In a source checkout (not installed), make ``fastdl.kernels`` resolve to the top-level ``kernels/`` directory,
# which pip installs as the sub-package fastdl.kernels (setup.py: package_dir).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # noqa: F821  (package __path__)

from . import (  # noqa: E402
    _extension,  # noqa: E402
    backends,
    dispatch,
    nn,
    ops,
)
from ._extension import load_extension  # noqa: E402
from ._info import info  # noqa: E402
from .backends import BackendUnavailableError, use_backend  # noqa: E402
from .convert import convert, report  # noqa: E402
from .dispatch import clear_decisions, load_decisions, save_decisions, set_choice_mode  # noqa: E402
from .nn import CheckpointError  # noqa: E402
from .serialization import load, load_pretrained, save  # noqa: E402

_extension.warn_if_untested_torch()
_extension.warn_if_missing()

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "backends",
    "clear_decisions",
    "convert",
    "dispatch",
    "info",
    "load",
    "load_decisions",
    "load_extension",
    "load_pretrained",
    "nn",
    "ops",
    "report",
    "save",
    "save_decisions",
    "set_choice_mode",
    "use_backend",
    "__version__",
]


def __getattr__(name):  # lazy sub-modules (they import nothing heavy, but keep `import fastdl` minimal)
    if name in ("data", "bench", "cli", "quant", "sparsity", "demo"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fastdl' has no attribute {name!r}")
