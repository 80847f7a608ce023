"""Fail when the extension's build log has a compiler warning from the project's own code (issue 33).

Usage: python scripts/check_build_warnings.py [LOG]   (default: $VENV/.fastdl-build.log, VENV defaulting to .venv)

scripts/setup_env.sh keeps the output of the last build (the first `pip install -e .` and every incremental
`setup.py build_ext --inplace`) in $VENV/.fastdl-build.log; scripts/test.sh runs this check on it after setup, so CI
fails on a new warning. csrc/ compiles clean at -Wall -Wextra (fastdl/_build.py); third-party headers are silenced
at the flag level there, so a warning reported in a csrc/ file, or in a header inlined into csrc/ code ("In function
... inlined from ... csrc/..."), is the project's. Warnings elsewhere (e.g. setuptools) are counted, not fatal.
Exit status: 0 clean, 1 warnings from csrc/, 2 no log.
"""

from __future__ import annotations

import os
import re
import sys

# GCC / clang: "path/file.cpp:12:5: warning: ..."; nvcc's front end: "path/file.cu(12): warning #177-D: ..."
WARNING = re.compile(r"^(?P<path>[^\s:(]+?)(?::\d+(?::\d+)?:|\(\d+\):)\s+warning\b")
INLINED = re.compile(
    r"^\s*(?:inlined from|In function|In member function|In instantiation).*?(?P<path>\S*csrc/\S+?):\d+"
)


def own(path: str) -> bool:
    parts = path.replace("\\", "/").split("/")
    return "csrc" in parts


def scan(lines: list[str]) -> tuple[list[str], int]:
    """(the warnings from csrc/, the number of other warnings)."""
    mine, other = [], 0
    context_in_csrc = False  # the "In function ... inlined from csrc/..." lines that precede a header's warning
    for line in lines:
        if INLINED.match(line):
            context_in_csrc = True
            continue
        m = WARNING.match(line)
        if m:
            if own(m.group("path")) or context_in_csrc:
                mine.append(line.rstrip())
            else:
                other += 1
        if not line.startswith((" ", "\t")) and not line.startswith(("In ", "    inlined")):
            context_in_csrc = False
    return mine, other


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        log = argv[1]
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        log = os.path.join(os.environ.get("VENV", os.path.join(root, ".venv")), ".fastdl-build.log")
    if not os.path.exists(log):
        print(f"check_build_warnings: no build log at {log} (scripts/setup_env.sh writes it)", file=sys.stderr)
        return 2
    with open(log, encoding="utf-8", errors="replace") as f:
        mine, other = scan(f.readlines())
    if mine:
        print(f"check_build_warnings: {len(mine)} compiler warning(s) from csrc/ in {log}:", file=sys.stderr)
        for line in mine[:50]:
            print("  " + line, file=sys.stderr)
        print("csrc/ must compile without warnings at -Wall -Wextra (issue 33): fix them", file=sys.stderr)
        return 1
    print(f"check_build_warnings: no compiler warning from csrc/ in {log} ({other} from elsewhere)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
