"""``fastdl`` command line: ``fastdl info``, ``fastdl bench <name> [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    from .bench import BENCHMARKS

    parser = argparse.ArgumentParser(prog="fastdl", description="fastdl: fast Linear kernels for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, CPU ISA, GPU, extension, backend per op and device")
    p_info.add_argument("--json", action="store_true", help="print the facts as JSON")
    p_demo = sub.add_parser("demo", help="train/prune/quantize a small model with DDP, compare with plain PyTorch")
    from . import demo

    demo.add_arguments(p_demo)
    p_bench = sub.add_parser("bench", help="kernel microbenchmarks vs PyTorch")
    bench_sub = p_bench.add_subparsers(dest="bench", required=True)
    from .bench import all as bench_all

    p_all = bench_sub.add_parser("all", help="every microbenchmark, a summary of ratios, CSV and a PNG plot")
    bench_all.add_arguments(p_all)
    p_all.set_defaults(_module=bench_all)
    for name, module in BENCHMARKS.items():
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # a capability that is not built yet
            bench_sub.add_parser(name, help=f"(unavailable: {exc})")
            continue
        p = bench_sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0] if mod.__doc__ else name)
        mod.add_arguments(p)
        p.set_defaults(_module=mod)
    args = parser.parse_args(argv)

    if args.command == "info":
        from ._info import collect, format_info

        d = collect()
        if args.json:
            import json

            print(json.dumps(d, indent=2, default=str))
        else:
            print(format_info(d))
        return 0
    if args.command == "demo":
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
