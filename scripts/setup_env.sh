#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install fastdl into it with its compiled extension.
# Usage: source scripts/setup_env.sh      (env: VENV=path to use another location; PYTHON=python3.11 ...;
#                                          FASTDL_REBUILD=1 to build even when nothing changed)
#
# Setup runs once: a second run (the test command after the main job, or either twice) reuses what is there.
#  * requirements/dev.txt is installed again only when the file (or the venv's Python) changed: its hash is kept in
#    $VENV/.fastdl-requirements.sha256.
#  * the extension is built again only when an input of the build changed: every file under csrc/, setup.py,
#    pyproject.toml, fastdl/_build.py, the torch version, the Python version and the build switches
#    (FASTDL_NO_EXTENSION, FASTDL_NO_CUDA, FASTDL_DEBUG, TORCH_CUDA_ARCH_LIST, CUDA_HOME, CUDA_PATH). Their hash is kept in
#    $VENV/.fastdl-build.sha256 and checked with fastdl._C present and the editable install pointing at this checkout.
#    When only those inputs changed and the install is in place, the rebuild is incremental
#    (setup.py build_ext --inplace: ninja recompiles the changed translation units only).
#  * the output of the last build (either kind) is kept in $VENV/.fastdl-build.log: scripts/check_build_warnings.py
#    (run by scripts/test.sh) fails on a compiler warning from csrc/ in it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi

_fastdl_hash() { sha256sum | cut -d' ' -f1; }

req_stamp="$VENV/.fastdl-requirements.sha256"
req_hash="$( { cat "$ROOT/requirements/dev.txt"; "$VENV/bin/python" -c 'import sys; print(sys.version)'; } | _fastdl_hash)"
if [ "${FASTDL_REBUILD:-0}" != "1" ] && [ -f "$req_stamp" ] && [ "$(cat "$req_stamp")" = "$req_hash" ]; then
    echo "== requirements unchanged since the last install (requirements/dev.txt): not reinstalling"
else
    echo "== installing requirements (requirements/dev.txt)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/requirements/dev.txt"
    echo "$req_hash" >"$req_stamp"
fi

# The inputs of the build (see the header). Reading torch's version from its metadata does not import torch (~0.1 s).
build_hash="$(
    cd "$ROOT"
    {
        find csrc -type f | LC_ALL=C sort | xargs -r sha256sum
        sha256sum setup.py pyproject.toml fastdl/_build.py
        "$VENV/bin/python" - <<'PY'
import importlib.metadata as md, os, sys
print(sys.version, md.version("torch"))
for var in ("FASTDL_NO_EXTENSION", "FASTDL_NO_CUDA", "FASTDL_DEBUG", "TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH"):
    print(var, os.environ.get(var, ""))
PY
    } | _fastdl_hash
)"
build_stamp="$VENV/.fastdl-build.sha256"
# Is the editable install of this checkout in place, with its compiled extension (unless built without one)?
install_state="$("$VENV/bin/python" - "$ROOT" <<'PY'
import importlib.util, os, sys
root = os.path.realpath(sys.argv[1])
spec = importlib.util.find_spec("fastdl")
if spec is None or os.path.dirname(os.path.realpath(spec.origin)) != os.path.join(root, "fastdl"):
    print("missing")
elif os.environ.get("FASTDL_NO_EXTENSION", "").lower() in ("1", "true", "yes", "on"):
    print("ok")
else:
    import glob
    print("ok" if glob.glob(os.path.join(root, "fastdl", "_C*.so")) else "no-extension")
PY
)"
t0=$(date +%s)
if [ "${FASTDL_REBUILD:-0}" != "1" ] && [ "$install_state" = "ok" ] && [ -f "$build_stamp" ] \
    && [ "$(cat "$build_stamp")" = "$build_hash" ]; then
    echo "== fastdl is installed and its build inputs are unchanged (csrc/, setup.py, torch, switches): not rebuilding"
elif [ "${FASTDL_REBUILD:-0}" != "1" ] && [ "$install_state" = "ok" ] && [ -f "$build_stamp" ]; then
    echo "== build inputs changed: rebuilding the extension incrementally (setup.py build_ext --inplace; log in" \
        "$VENV/.fastdl-build.log)"
    if ! ( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VENV/bin/python" setup.py build_ext --inplace ) \
        >"$VENV/.fastdl-build.log" 2>&1; then
        tail -40 "$VENV/.fastdl-build.log"
        echo "== the build failed: see $VENV/.fastdl-build.log" >&2
        exit 1
    fi
    echo "$build_hash" >"$build_stamp"
    echo "== build took $(( $(date +%s) - t0 )) s"
else
    echo "== building and installing fastdl (editable, compiled extension fastdl._C; log in $VENV/.fastdl-build.log)"
    rm -f "$build_stamp"
    # pip -v: the compiler's output (warnings included) goes to the log, which scripts/check_build_warnings.py reads
    if ! ( cd "$ROOT" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$VENV/bin/python" -m pip install -v \
        --disable-pip-version-check --no-build-isolation --no-deps -e . ) >"$VENV/.fastdl-build.log" 2>&1; then
        tail -40 "$VENV/.fastdl-build.log"
        echo "== the build failed: see $VENV/.fastdl-build.log" >&2
        exit 1
    fi
    grep '^fastdl setup:' "$VENV/.fastdl-build.log" || true
    echo "$build_hash" >"$build_stamp"
    echo "== build took $(( $(date +%s) - t0 )) s"
fi
unset -f _fastdl_hash
unset req_stamp req_hash build_hash build_stamp install_state t0
export PATH="$VENV/bin:$PATH"
