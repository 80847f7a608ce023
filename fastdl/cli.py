"""``fastdl`` command line: ``fastdl info``, ``fastdl demo``, ``fastdl bench <name> [options]``, ``fastdl summary``.

``--isa avx2|avx512|avx512_bf16|native`` (demo and every benchmark) runs the command in a subprocess where fastdl and
PyTorch's CPU libraries are capped to that level together (``fastdl.bench.isa``)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from . import demo
    from .bench.command import add_isa, add_parsers

    parser = argparse.ArgumentParser(prog="fastdl", description="fastdl: fast Linear kernels for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, CPU ISA, GPU, extension, backend per op and device")
    p_info.add_argument("--json", action="store_true", help="print the facts as JSON")
    p_demo = sub.add_parser("demo", help="train/prune/quantize a small model with DDP, compare with plain PyTorch")
    demo.add_arguments(p_demo)
    add_isa(p_demo)
    p_sum = sub.add_parser("summary", help="the main job's closing summary from the results of demo and bench all")
    p_sum.add_argument("dir", nargs="?", default="bench-out", help="folder holding demo.json and summary.json")
    p_bench = sub.add_parser("bench", help="benchmarks vs PyTorch")
    add_parsers(p_bench.add_subparsers(dest="bench", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    from .bench.command import rerun_capped

    status = rerun_capped(argv, getattr(args, "isa", None))
    if status is not None:
        return status

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
    if args.command == "demo":
        from . import demo
        from .bench.command import start_long_command

        start_long_command()
        results = demo.run(args)
        return 1 if results["missed"] else 0
    if args.command == "bench":
        from .bench.command import run

        return run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
