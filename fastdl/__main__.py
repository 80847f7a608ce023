"""``python -m fastdl ...``: the ``fastdl`` command (info, demo, bench, summary) where the console script is not
installed, e.g. a source checkout on PYTHONPATH during JIT development."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
