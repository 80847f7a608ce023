"""Loads fastdl checkpoints in ``transformers.from_pretrained`` without ``import fastdl`` (installed packages only).

pip installs this file twice: as ``fastdl/_hf_autoload.py`` and as the top-level module ``_fastdl_hf_autoload``,
which the file ``fastdl-kernels-hf.pth`` (site-packages, next to the packages; see setup.py) imports at every
interpreter start. A ``.pth`` line that begins with ``import`` is executed by ``site``; it cannot import
``fastdl._hf_autoload`` itself, because that would run ``fastdl/__init__.py`` (and import torch) in every Python
process of the environment.

At start-up this module only puts a small finder at the front of ``sys.meta_path`` (no import beyond ``sys`` and
``os``, both loaded already; a few microseconds). When, later, ``transformers.quantizers.auto`` (transformers'
quantization registry, imported by ``modeling_utils``) is imported, the finder steps aside, lets the module run, and
then imports ``fastdl.hf``, which registers the ``"fastdl"`` quantization method. A process that never imports
transformers' models never imports torch or fastdl because of this file.

It never raises: a ``.pth`` line that fails prints a traceback at every start of every Python in the environment. A
failing ``import fastdl.hf`` (a broken install) is a warning, and transformers then stops on a fastdl checkpoint
with the message that asks for ``import fastdl`` (which shows the real error).

Opt-out: ``FASTDL_NO_HF_AUTOLOAD=1`` (any value but ``""`` and ``"0"``) in the environment of the process.
Editable installs (``pip install -e``) and source checkouts do not get the ``.pth`` file: there, ``import fastdl``
(or ``import fastdl.hf``) before ``from_pretrained``.
"""

import os
import sys

ENV = "FASTDL_NO_HF_AUTOLOAD"
WATCHED = "transformers.quantizers.auto"  # fastdl.hf._REGISTRY


class FastdlHfAutoload:
    """A one-shot ``sys.meta_path`` finder: after ``transformers.quantizers.auto`` has run, ``import fastdl.hf``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        try:
            _remove()
            import importlib.util

            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _import_fastdl_hf()

            spec.loader.exec_module = exec_module
            return spec
        except Exception:  # transformers' own import must go on as without this finder
            return None

    def invalidate_caches(self) -> None:
        pass


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, FastdlHfAutoload)]


def _import_fastdl_hf() -> None:
    try:
        import importlib

        importlib.import_module("fastdl.hf")
    except Exception as exc:
        try:
            import warnings

            warnings.warn(f"fastdl: could not import fastdl.hf to register the 'fastdl' quantization method with "
                          f"transformers ({type(exc).__name__}: {exc}); fastdl checkpoints will not load. Set "
                          f"{ENV}=1 to skip this step.", stacklevel=2)  # fmt: skip
        except Exception:
            pass


def install() -> bool:
    """Put the finder in place (once); False when opted out or nothing to do."""
    try:
        if os.environ.get(ENV, "") not in ("", "0"):
            return False
        if WATCHED in sys.modules:  # imported before this ran (not at start-up): register now
            _import_fastdl_hf()
            return False
        if not any(isinstance(f, FastdlHfAutoload) for f in sys.meta_path):
            sys.meta_path.insert(0, FastdlHfAutoload())
        return True
    except Exception:
        return False


if __name__ == "_fastdl_hf_autoload":  # the top-level copy, imported by the .pth line; fastdl._hf_autoload: inert
    install()
