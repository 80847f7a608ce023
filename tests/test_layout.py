"""The source tree shadows nothing and the Triton layer sits below the Python layer (issue 28, items 2 and 7):
kernels/ is not an importable top-level package from the repository root (Hugging Face's ``kernels``, which
transformers imports, stays reachable), ``fastdl.kernels`` still resolves, and kernels/ imports nothing of fastdl."""

import ast
import os
import subprocess
import sys

import pytest

import fastdl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_root(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_repository_root_does_not_shadow_hf_kernels_and_transformers_imports():
    pytest.importorskip("transformers")
    code = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "origin = None if spec is None else (spec.origin or list(spec.submodule_search_locations or []))\n"
        "print('KERNELS', origin)\n"
        "here = os.path.join(os.getcwd(), 'kernels')\n"
        "assert spec is None or (spec.origin or '').find(here) < 0, origin\n"
        "assert spec is None or here not in list(spec.submodule_search_locations or []), origin\n"
        "import transformers\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "import fastdl\n"
        "print('OK', transformers.__version__)\n"
    )
    r = _in_root(code)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


def test_fastdl_kernels_resolves_to_the_kernels_folder():
    import fastdl.kernels.constants as constants

    assert os.path.dirname(os.path.abspath(constants.__file__)) == os.path.join(ROOT, "kernels")
    assert fastdl.ops.ACTIVATIONS == constants.ACTIVATIONS
    assert fastdl.ops.int8.WEIGHT_GROUP == constants.WEIGHT_GROUP


@pytest.mark.parametrize("name", ["fastdl.tests", "fastdl.setup", "fastdl.csrc", "fastdl.scripts"])
def test_the_repository_root_is_not_part_of_the_package(name):
    with pytest.raises(ImportError):
        __import__(name)


def test_kernels_import_nothing_of_fastdl():
    folder = os.path.join(ROOT, "kernels")
    assert not os.path.exists(os.path.join(folder, "__init__.py")), "kernels/__init__.py makes a top-level package"
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert not any(m == "fastdl" or m.startswith("fastdl.") for m in mods), (name, mods)
