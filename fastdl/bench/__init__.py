"""Benchmarks: ``fastdl bench <name>`` or ``python -m fastdl.bench <name>``.

Each benchmark module defines ``add_arguments(parser)``, ``run(args) -> list[dict]`` (rows, also written as CSV with
``--csv``) and ``QUICK_ARGS`` (its arguments in ``fastdl bench all --quick``), and times fastdl against its PyTorch
baselines in the same process. ``--isa`` (every benchmark) runs it in a subprocess capped to another CPU family
(``fastdl.bench.isa``).
"""

BENCHMARKS = {
    "fused_linear": "fastdl.bench.fused_linear",
    "int8": "fastdl.bench.int8",
    "int4": "fastdl.bench.int4",
    "sparse24": "fastdl.bench.sparse24",
    "overhead": "fastdl.bench.overhead",
    "model": "fastdl.bench.model",
    "loader": "fastdl.bench.loader",
}
