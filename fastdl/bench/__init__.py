"""Kernel-level microbenchmarks: ``fastdl bench <name>`` or ``python -m fastdl.bench <name>``.

Each benchmark module defines ``add_arguments(parser)`` and ``run(args) -> list[dict]`` (rows, also written as CSV
with ``--csv``) and times fastdl against its PyTorch baseline in the same process.
"""

BENCHMARKS = {
    "fused_linear": "fastdl.bench.fused_linear",
    "int8": "fastdl.bench.int8",
    "sparse24": "fastdl.bench.sparse24",
    "loader": "fastdl.bench.loader",
}
