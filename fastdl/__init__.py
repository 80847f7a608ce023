"""fastdl: fused mixed-precision, int8 and 2:4-sparse Linear kernels and a prefetching loader for PyTorch.

``import fastdl`` is cheap: it defines the ops, imports the compiled extension if pip built it (no compile, no CUDA
initialisation) and warns once, naming the fix, when it is missing. ``FASTDL_JIT=1`` builds ``csrc/`` on first use.
"""

import os as _os

from ._version import __version__

# In a source checkout (and an editable install), ``fastdl.kernels`` is the top-level ``kernels/`` folder, which pip
# installs as the sub-package fastdl.kernels (setup.py: package_dir, and an __init__.py written into the wheel).
# kernels/ has no __init__.py of its own: a regular top-level package named ``kernels`` would shadow Hugging Face's
# ``kernels`` (which transformers imports) for any Python started in the repository root. So the sub-package is
# registered here, with only that folder on its path (not the repository root: no fastdl.tests, fastdl.setup, ...).
_kernels_dir = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))), "kernels")
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_kernels_dir, "constants.py")
):
    import importlib.machinery as _machinery
    import importlib.util as _util
    import sys as _sys

    if "fastdl.kernels" not in _sys.modules:
        _spec = _machinery.ModuleSpec("fastdl.kernels", None, is_package=True)
        _spec.submodule_search_locations = [_kernels_dir]
        _sys.modules["fastdl.kernels"] = _util.module_from_spec(_spec)
        del _spec
    kernels = _sys.modules["fastdl.kernels"]
    del _machinery, _util, _sys

from . import (  # noqa: E402
    _extension,  # noqa: E402
    backends,
    hf,  # noqa: E402,F401  (registers "fastdl" with transformers when it imports its quantizers)
    nn,
    ops,
    runtime_choice,
)
from ._extension import load_extension  # noqa: E402
from ._info import info  # noqa: E402
from .backends import BackendUnavailableError, use_backend  # noqa: E402
from .convert import convert, report  # noqa: E402
from .nn import CheckpointError  # noqa: E402
from .runtime_choice import clear_decisions, load_decisions, save_decisions, set_choice_mode  # noqa: E402
from .serialization import load, load_pretrained, save  # noqa: E402
from .training import training_autocast, training_dtype, training_recipe  # noqa: E402

_extension.warn_if_untested_torch()
_extension.warn_if_missing()

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "backends",
    "clear_decisions",
    "convert",
    "info",
    "load",
    "load_decisions",
    "load_extension",
    "load_pretrained",
    "nn",
    "ops",
    "report",
    "runtime_choice",
    "save",
    "save_decisions",
    "set_choice_mode",
    "training_autocast", "training_dtype", "training_recipe",
    "use_backend",
    "__version__",
]


def __getattr__(name):  # lazy sub-modules (they import nothing heavy, but keep `import fastdl` minimal)
    if name in ("data", "bench", "cli", "quant", "sparsity", "demo"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name == "dispatch":  # the old name of fastdl.runtime_choice (it was in __all__): `fastdl.dispatch.x` and
        import warnings  # `from fastdl import dispatch` keep working, with a warning; `import fastdl.dispatch` does not

        warnings.warn("fastdl.dispatch was renamed fastdl.runtime_choice (the decision functions are also on fastdl: "
                      "fastdl.save_decisions, ...)", DeprecationWarning, stacklevel=2)  # fmt: skip
        return runtime_choice
    raise AttributeError(f"module 'fastdl' has no attribute {name!r}")
