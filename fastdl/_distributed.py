"""Helpers for processes started with ``torch.multiprocessing.spawn`` (the demo, the DDP tests)."""

import os
import sys


def finish_worker() -> None:
    """End a spawned worker that has finished its work and destroyed its process group.

    With torch 2.14 and the gloo backend, a worker that exits normally after ``destroy_process_group()`` aborts in
    about 1 run of 4 during interpreter teardown ("terminate called without an active exception"): measured 4 of 16
    runs of a plain-PyTorch DDP script on the CI machine, with or without fastdl imported. Leaving with
    ``os._exit(0)`` once the output is flushed skips the C++ static destructors where that happens (0 of 16).
    Call it only on the success path: an exception must still end the process with an error.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
