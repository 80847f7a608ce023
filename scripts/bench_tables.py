"""Side-by-side markdown table of two or more ``fastdl bench all`` runs (e.g. native and ``--isa avx2``), for the
README: one row per measurement, per run the ratio to the PyTorch path fastdl replaces and to the fastest PyTorch
option measured there (``x repl`` / ``x best``), with the CPU and ISA level of each run in the header.

    python scripts/bench_tables.py bench-native bench-avx2 > tables.md
"""

import json
import os
import sys


def _load(folder: str) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _beyond_noise(slower: str) -> bool:
    """Whether a row's "slower" note (its comparisons joined by "; ") has one that is not marked as within noise."""
    return any(part and "noise" not in part for part in slower.split("; "))


def main(folders: list[str]) -> None:
    runs = [_load(f) for f in folders]
    heads = []
    for r in runs:
        c = r["context"]
        level = c["isa_level"] + (" (capped)" if c["isa_capped"] else "")
        heads.append(f"{level}: x repl / x best")
    names = []
    for r in runs:
        c = r["context"]
        cap = f" capped from {c['detected_level']}" if c["isa_capped"] else ""
        names.append(f"{c['cpu_model']}, {c['isa_level']}{cap} ({'quick' if r['quick'] else 'full'} run, "
                     f"{r['seconds']:.0f} s)")  # fmt: skip
    print("CPU: " + "; ".join(names))
    print()
    print("| bench | mode | what | M x K x N | " + " | ".join(heads) + " |")
    print("|---|---|---|---|" + "---|" * len(runs))
    keys: dict[tuple, list] = {}
    for i, r in enumerate(runs):
        for s in r["summary"]:
            k = (s["bench"], s["mode"], s["what"], s["shape"])
            keys.setdefault(k, [None] * len(runs))[i] = s
    for k, cells in keys.items():
        vals = []
        for s in cells:
            if s is None:
                vals.append("-")
                continue
            mark = " **slower**" if _beyond_noise(s.get("slower") or "") else ""
            vals.append(f"{_fmt(s['x_replaced'])} / {_fmt(s['x_best'])}{mark}")
        print("| " + " | ".join(k) + " | " + " | ".join(vals) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
