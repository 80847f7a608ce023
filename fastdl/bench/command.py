"""The ``bench`` sub-command: ``fastdl bench <name> [options]`` and ``python -m fastdl.bench <name> [options]``.

One sub-command per module of ``BENCHMARKS`` plus ``all``; ``--isa`` (here and on ``fastdl demo``) runs the command
in a subprocess capped to another CPU family (``fastdl.bench.isa``). ``fastdl.cli`` puts these parsers under its own;
``python -m fastdl.bench`` uses them alone."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import BENCHMARKS
from . import all as bench_all
from .isa import CHOICES


def add_isa(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isa", choices=CHOICES, default=None,
                   help="run in a subprocess with fastdl AND PyTorch (ATen, oneDNN, MKL, fbgemm) capped to this CPU "
                        "ISA level (native: no caps); see fastdl.bench.isa")  # fmt: skip


def add_parsers(bench_sub) -> None:
    """``all`` and one parser per benchmark under ``bench_sub`` (an ``add_subparsers`` result, dest "bench")."""
    p_all = bench_sub.add_parser("all", help="every benchmark, time-boxed; a summary of ratios, CSV and a PNG plot")
    bench_all.add_arguments(p_all)
    add_isa(p_all)
    p_all.set_defaults(_module=bench_all)
    for name, module in BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # a capability that is not built yet
            bench_sub.add_parser(name, help=f"(unavailable: {exc})")
            continue
        doc = (mod.__doc__ or name).strip().splitlines()[0]
        p = bench_sub.add_parser(name, help=doc, description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        mod.add_arguments(p)
        add_isa(p)
        p.set_defaults(_module=mod)


def rerun_capped(argv: list[str], isa: str | None) -> int | None:
    """With ``--isa`` given, outside the capped subprocess: run ``fastdl <argv>`` there and return its exit status;
    else None (run here)."""
    if isa is None:
        return None
    from . import isa as isa_mod

    if isa_mod.in_child(isa):
        return None
    try:
        return isa_mod.rerun(argv, isa)
    except ValueError as exc:
        print(f"fastdl: {exc}", file=sys.stderr)
        return 2


def start_long_command() -> None:
    """Before a benchmark or the demo: the heartbeat line, and SIGTERM (``timeout``, a CI limit) or Ctrl-C print and
    write the rows measured so far (``bench all`` then stops and writes its summary of what ran)."""
    import signal

    from .common import request_stop, start_heartbeat

    start_heartbeat()

    def handler(signum, frame):
        request_stop()
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args`` were parsed for (by ``add_parsers``' parsers)."""
    mod = getattr(args, "_module", None)
    if mod is None:
        print(f"fastdl bench {args.bench}: this benchmark is not available in this build", file=sys.stderr)
        return 2
    start_long_command()
    mod.run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fastdl.bench <name> [options]`` (``fused_linear`` when no name is given)."""
    argv = list(sys.argv[1:] if argv is None else argv) or ["fused_linear"]
    parser = argparse.ArgumentParser(prog="python -m fastdl.bench",
                                     description="fastdl's benchmarks vs PyTorch (the same as `fastdl bench`)")
    add_parsers(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(argv)
    status = rerun_capped(["bench", *argv], getattr(args, "isa", None))
    return run(args) if status is None else status
