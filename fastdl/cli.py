"""``fastdl`` command line: ``fastdl info``, ``fastdl demo``, ``fastdl bench <name> [options]``, ``fastdl summary``.

``--isa avx2|avx512|avx512_bf16|native`` (demo and every benchmark) runs the command in a subprocess where fastdl and
PyTorch's CPU libraries are capped to that level together (``fastdl.bench.isa``)."""

from __future__ import annotations

import argparse
import importlib
import sys


def _add_isa(p: argparse.ArgumentParser) -> None:
    from .bench.isa import CHOICES

    p.add_argument("--isa", choices=CHOICES, default=None,
                   help="run in a subprocess with fastdl AND PyTorch (ATen, oneDNN, MKL, fbgemm) capped to this CPU "
                        "ISA level (native: no caps); see fastdl.bench.isa")  # fmt: skip


def _sigterm_as_interrupt() -> None:
    """A benchmark stopped by SIGTERM (``timeout``, a CI limit) or Ctrl-C prints and writes the rows measured so far;
    ``bench all`` then stops and writes its summary of what ran."""
    import signal

    from .bench.common import request_stop

    def handler(signum, frame):
        request_stop()
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


def build_parser() -> argparse.ArgumentParser:
    from . import demo
    from .bench import BENCHMARKS
    from .bench import all as bench_all

    parser = argparse.ArgumentParser(prog="fastdl", description="fastdl: fast Linear kernels for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, CPU ISA, GPU, extension, backend per op and device")
    p_info.add_argument("--json", action="store_true", help="print the facts as JSON")
    p_demo = sub.add_parser("demo", help="train/prune/quantize a small model with DDP, compare with plain PyTorch")
    demo.add_arguments(p_demo)
    _add_isa(p_demo)
    p_sum = sub.add_parser("summary", help="the main job's closing summary from the results of demo and bench all")
    p_sum.add_argument("dir", nargs="?", default="bench-out", help="folder holding demo.json and summary.json")
    p_bench = sub.add_parser("bench", help="benchmarks vs PyTorch")
    bench_sub = p_bench.add_subparsers(dest="bench", required=True)
    p_all = bench_sub.add_parser("all", help="every benchmark, time-boxed; a summary of ratios, CSV and a PNG plot")
    bench_all.add_arguments(p_all)
    _add_isa(p_all)
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
        _add_isa(p)
        p.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    isa = getattr(args, "isa", None)
    if isa is not None:
        from .bench import isa as isa_mod

        if not isa_mod.in_child(isa):
            try:
                return isa_mod.rerun(argv, isa)
            except ValueError as exc:
                print(f"fastdl: {exc}", file=sys.stderr)
                return 2

    if args.command == "info":
        from ._info import collect, format_info

        d = collect()
        if args.json:
            import json

            print(json.dumps(d, indent=2, default=str))
        else:
            print(format_info(d))
        return 0
    if args.command == "summary":
        from .bench.report import main_job_summary

        return main_job_summary(args.dir)
    from .bench.common import start_heartbeat

    start_heartbeat()
    _sigterm_as_interrupt()
    if args.command == "demo":
        from . import demo

        results = demo.run(args)
        return 1 if results["missed"] else 0
    if args.command == "bench":
        mod = getattr(args, "_module", None)
        if mod is None:
            print(f"fastdl bench {args.bench}: this benchmark is not available in this build", file=sys.stderr)
            return 2
        mod.run(args)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
