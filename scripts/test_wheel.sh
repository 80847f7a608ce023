#!/usr/bin/env bash
# The wheel a user gets travels: build it in the main job's environment (.venv, scripts/setup_env.sh), install it into
# a second, fresh virtual environment in another folder (torch from requirements/dev.txt, nothing of the checkout),
# and from outside the checkout check that
#   * `python -m fastdl info` loads the compiled extension and a converted model runs (int8_weight_only, fused);
#   * fastdl.kernels is the installed package's kernels/ and fastdl.__path__ is the package folder alone;
#   * `readelf -d` of fastdl/_C*.so names no path of the build environment (RUNPATH is $ORIGIN-relative);
#   * the installed package is at most 15 MB (debug info stripped; FASTDL_DEBUG=1 would keep it).
# Usage: bash scripts/test_wheel.sh     (env: VENV=the build environment, default .venv; KEEP=1 keeps the temp folder)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
WORK="$(mktemp -d)"
trap '[ "${KEEP:-0}" = 1 ] || rm -rf "$WORK"' EXIT
t0=$(date +%s)
echo "== building the wheel with $VENV (pip wheel --no-build-isolation; reuses the build folder's objects)"
"$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w "$WORK/dist" "$ROOT"
wheel="$(ls "$WORK"/dist/fastdl_kernels-*.whl)"
echo "== $(basename "$wheel"): $(( $(stat -c %s "$wheel") / 1024 )) KiB; a fresh environment in another folder"
python3 -m venv "$WORK/env"
torch_pin="$(grep -E '^torch==' "$ROOT/requirements/dev.txt")"
"$WORK/env/bin/python" -m pip install -q --disable-pip-version-check "$torch_pin" numpy tqdm
"$WORK/env/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
cd "$WORK"  # outside the checkout: nothing of it on sys.path
site="$("$WORK/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
so="$(ls "$site"/fastdl/_C*.so)"
runpath="$(readelf -d "$so" | grep -E 'RPATH|RUNPATH' || true)"
echo "== RUNPATH of the installed _C: ${runpath:-none}"
if echo "$runpath" | grep -qE "$ROOT|$VENV|site-packages"; then
    echo "!! the installed library names a path of the build environment: $runpath" >&2
    exit 1
fi
size_kb="$(du -sk "$site/fastdl" | cut -f1)"
echo "== installed size of fastdl: $(( size_kb / 1024 )) MiB"
if [ "$size_kb" -gt $(( 15 * 1024 )) ]; then
    echo "!! the installed package is over 15 MB ($size_kb KiB)" >&2
    exit 1
fi
# the Hugging Face hook (fastdl/_hf_autoload.py): the .pth and its module at site-packages' root, run at start-up
# without importing torch or fastdl
[ -f "$site/fastdl-kernels-hf.pth" ] && [ -f "$site/_fastdl_hf_autoload.py" ] || {
    echo "!! the wheel did not install fastdl-kernels-hf.pth / _fastdl_hf_autoload.py into site-packages" >&2
    exit 1
}
"$WORK/env/bin/python" -c "import sys; assert '_fastdl_hf_autoload' in sys.modules and 'torch' not in sys.modules"
echo "== the Hugging Face hook is installed and runs at start-up without importing torch"
"$WORK/env/bin/python" -m fastdl info >"$WORK/info.txt"
head -12 "$WORK/info.txt"
grep -q "the build compiled:" "$WORK/info.txt" || { echo "!! fastdl info does not show what the build compiled" >&2; exit 1; }
"$WORK/env/bin/python" - <<'PY'
import copy
import os

import torch

import fastdl
import fastdl.kernels.constants

assert fastdl.info(print_result=False)["extension"]["source"] == "aot", "the wheel's compiled extension did not load"
assert "site-packages" in fastdl.__file__, fastdl.__file__
# the package path is the package folder alone; fastdl.kernels is the wheel's (with the __init__.py setup.py wrote)
here = os.path.dirname(fastdl.__file__)
assert list(fastdl.__path__) == [here], fastdl.__path__
assert os.path.dirname(fastdl.kernels.constants.__file__) == os.path.join(here, "kernels"), fastdl.kernels.constants
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
x = torch.randn(4, 64)
ref = model(x)
for policy, tol in (("fused", 1e-5), ("int8_weight_only", 2e-2)):
    m = fastdl.convert(copy.deepcopy(model), policy)
    with torch.no_grad():
        out = m(x)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < tol, (policy, err)
    print(f"converted model ({policy}) from the installed wheel: relative error {err:.2e}")
PY
echo "== wheel check passed in $(( $(date +%s) - t0 )) s"
