"""Two-process DDP tests on the CPU: ``run_ddp(worker, tmp_path)`` starts ``world`` processes (torch.multiprocessing
spawn, gloo, a file rendezvous in ``tmp_path``), each of which calls ``worker(rank, world)`` (a module-level function:
it is pickled by name) with one thread, saves what it returns, waits for the others and leaves through
``fastdl._distributed.finish_worker``; ``run_ddp`` returns the ranks' results in rank order."""

import os

import torch

from fastdl._distributed import finish_worker


def _entry(rank, worker, world, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = worker(rank, world)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def run_ddp(worker, tmp_path, world: int = 2, weights_only: bool = True) -> list:
    import torch.multiprocessing as mp

    mp.spawn(_entry, args=(worker, world, str(tmp_path)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=weights_only) for r in range(world)]
