"""Side-by-side markdown table of two or more ``fastdl bench all`` runs (e.g. native and ``--isa avx2``), for the
README: one row per measurement, per run the ratio to the PyTorch path fastdl replaces and to the fastest PyTorch
option measured there (``x repl`` / ``x best``), with the CPU and ISA level of each run in the header.

    python scripts/bench_tables.py bench-native bench-avx2 > tables.md

Or one column of an existing table refreshed from a new run, in place (rows the run did not reach read ``- / -``,
rows only the run has are listed, not added), e.g. the README's Zen 2 column:

    python scripts/bench_tables.py --update README.md "avx2 (native Zen 2)" bench-zen2
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
        print("| " + " | ".join(k) + " | " + " | ".join(_cell(s) if s else "-" for s in cells) + " |")


def _cell(s: dict) -> str:
    mark = " **slower**" if _beyond_noise(s.get("slower") or "") else ""
    return f"{_fmt(s['x_replaced'])} / {_fmt(s['x_best'])}{mark}"


def update_column(text: str, column: str, summary: list[dict]) -> tuple[str, list[tuple]]:
    """text with the cells of the table column whose header starts with `column` taken from `summary` (a run's
    rows); returns the new text and the keys of the run's rows the table has no row for."""
    cells = {(s["bench"], s["mode"], s["what"], s["shape"]): _cell(s) for s in summary}
    seen = set()
    out, col = [], None
    for line in text.split("\n"):
        parts = line.split("|")
        if line.startswith("| bench | mode | what |"):
            heads = [p.strip() for p in parts]
            col = next((i for i, h in enumerate(heads) if h.startswith(column)), None)
            if col is None:
                raise SystemExit(f"no column starting with {column!r} in {heads[1:-1]}")
        elif col is not None and line.startswith("|") and not line.startswith("|---"):
            key = tuple(p.strip() for p in parts[1:5])
            seen.add(key)
            parts[col] = f" {cells.get(key, '- / -')} "
            line = "|".join(parts)
        elif col is not None and not line.startswith("|"):
            col = None  # the table ended
        out.append(line)
    return "\n".join(out), [k for k in cells if k not in seen]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--update":
        if len(sys.argv) != 5:
            sys.exit(__doc__)
        doc, column, folder = sys.argv[2:]
        with open(doc) as f:
            new, missing = update_column(f.read(), column, _load(folder)["summary"])
        with open(doc, "w") as f:
            f.write(new)
        for k in missing:
            print("not in the table (not added): " + " | ".join(k))
    else:
        main(sys.argv[1:])
