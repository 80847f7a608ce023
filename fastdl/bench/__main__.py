"""``python -m fastdl.bench <name> [options]``: ``fastdl bench <name> [options]`` (fastdl.bench.command)."""

import sys

from .command import main

sys.exit(main())
