"""What a user meets installing and JIT-building fastdl (issue 33): the `python -m fastdl` entry point, a loud
failure for an isolated build, a JIT build that cannot run reported instead of crashing, the tested torch range,
RUNPATH and debug info of the built library, the license. The wheel itself is checked end to end by
scripts/test_wheel.sh (CI): built in one environment, installed into another, run from outside the checkout."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from fastdl import _build, _extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _run(args, env=None, cwd=ROOT, timeout=300):
    full = dict(os.environ, **(env or {}))
    return subprocess.run(args, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def test_python_m_fastdl_is_the_cli():
    r = _run([sys.executable, "-m", "fastdl", "info", "--json"])
    assert r.returncode == 0, r.stderr[-2000:]
    facts = json.loads(r.stdout)
    assert facts["extension"]["source"] in ("aot", "jit", "missing")
    r = _run([sys.executable, "-m", "fastdl", "bench", "nope"])
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_jit_build_that_cannot_run_is_reported_not_a_crash(tmp_path):
    """FASTDL_JIT=1 without a working ninja: `fastdl info` exits 0, says why, and the ops run their references."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ninja").write_text("#!/bin/sh\necho 'no ninja here' >&2\nexit 1\n")
    (fake / "ninja").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}", "FASTDL_JIT": "1",
           "FASTDL_JIT_DIR": str(tmp_path / "jit")}  # fmt: skip
    r = _run([sys.executable, "-m", "fastdl", "info"], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "JIT build of fastdl._C failed" in r.stderr and "Ninja is required" in r.stderr
    assert "extension fastdl._C: MISSING" in r.stdout and "JIT build failed" in r.stdout
    code = "import torch, fastdl; print(fastdl.ops.fused_linear(torch.ones(2, 4), torch.ones(3, 4)).sum().item())"
    r = _run([sys.executable, "-c", code], env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("24.0"), r.stderr[-3000:]
    assert r.stderr.count("JIT build of fastdl._C failed") == 1  # said once, not on every call


def test_explicit_jit_load_still_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(_extension, "_jit_build", lambda verbose=False: (_ for _ in ()).throw(RuntimeError("boom")))
    saved = dict(_extension._state)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            _extension.load_extension(jit=True)
    finally:
        _extension._state.clear()
        _extension._state.update(saved)


def test_isolated_build_fails_loudly_naming_the_flag():
    """pip's build isolation has no torch: setup.py must fail (not build a pure-Python wheel) and name the fix."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
            "runpy.run_path('setup.py', run_name='__main__')")  # fmt: skip
    r = _run([sys.executable, "-c", code], env={"FASTDL_NO_EXTENSION": ""})
    assert r.returncode != 0
    assert "--no-build-isolation" in r.stderr and "FASTDL_NO_EXTENSION=1" in r.stderr
    r = _run([sys.executable, "-c", code], env={"FASTDL_NO_EXTENSION": "1"})  # asked for: no extension, no error
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "version,tested",
    [("2.11.0", True), ("2.14.1+cu130", True), ("2.13.0+cpu", True), ("2.15.0", False), ("2.10.1", False),
     ("3.0.0", False), ("garbage", False)],
)  # fmt: skip
def test_tested_torch_range(version, tested):
    assert _extension.torch_version_tested(version) is tested


def test_untested_torch_warns_naming_the_range(monkeypatch):
    import torch

    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.warns(RuntimeWarning, match=r"outside the tested range 2\.11-2\.14"):
        _extension.warn_if_untested_torch()
    lo, hi = _extension.TESTED_TORCH
    deps = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]
    assert f"torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1] + 1}" in [d.split(";")[0].strip() for d in deps]


def test_pip_builds_name_no_absolute_runpath():
    site_lib = os.path.join(os.sep, "x", "lib", "python3.11", "site-packages", "nvidia", "cu13", "lib")
    assert _build._runpath(site_lib, jit=False) == "$ORIGIN/../nvidia/cu13/lib"
    assert _build._runpath(site_lib, jit=True) == site_lib  # a JIT build stays on this machine
    cfg = _build.build_config(jit=False)
    if cfg.enabled and cfg.with_cuda:
        rpaths = [f for f in cfg.ldflags if f.startswith("-Wl,-rpath,")]
        assert rpaths and all("$ORIGIN" in f for f in rpaths), cfg.ldflags
    assert "-Wl,--strip-debug" in cfg.ldflags or os.environ.get("FASTDL_DEBUG") or not cfg.enabled


def test_built_library_has_no_build_path_and_no_debug_info():
    libs = glob.glob(os.path.join(ROOT, "fastdl", "_C*.so"))
    if not libs or shutil.which("readelf") is None:
        pytest.skip("no in-place build of fastdl._C in this checkout, or no readelf")
    dyn = _run(["readelf", "-d", libs[0]]).stdout
    runpaths = [line for line in dyn.splitlines() if "RPATH" in line or "RUNPATH" in line]
    assert not any("site-packages" in line or ROOT in line for line in runpaths), runpaths
    if not os.environ.get("FASTDL_DEBUG"):
        sections = _run(["readelf", "-S", "-W", libs[0]]).stdout
        assert ".debug_info" not in sections
        assert os.path.getsize(libs[0]) < 15 * 2**20


def test_license_file_matches_pyproject():
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    assert project["license"] == "BSD-3-Clause"  # the SPDX string form (PEP 639)
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert text.startswith("BSD 3-Clause License") and "Neither the name of the copyright holder" in text


def test_info_shows_what_the_build_compiled_and_skipped(tmp_path):
    """pip hides the build's own lines without -v: the build writes them next to the package (fastdl/_build.py:
    build_summary) and `fastdl info` prints them."""
    cfg = _build.build_config(jit=False)
    summary = _build.build_summary(cfg)
    assert summary["notes"] == cfg.notes and "source files" in summary["compiled"] or not cfg.enabled
    _build.write_build_notes(summary, str(tmp_path))
    assert _build.read_build_notes(str(tmp_path)) == summary
    assert _build.build_summary(None, "FASTDL_NO_EXTENSION=1")["notes"] == ["FASTDL_NO_EXTENSION=1"]
    if glob.glob(os.path.join(ROOT, "fastdl", "_C*.so")) and os.path.exists(
        os.path.join(ROOT, "fastdl", _build.BUILD_NOTES)
    ):
        r = _run([sys.executable, "-m", "fastdl", "info"])
        assert r.returncode == 0 and "the build compiled:" in r.stdout, r.stdout[-2000:]
