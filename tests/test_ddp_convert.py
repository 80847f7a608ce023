"""A model converted with fastdl.convert("fused") trained under DistributedDataParallel (2 processes, gloo) with
fastdl's PrefetchLoader over a DataLoader with a DistributedSampler: identical on both ranks, equal to single-process
training on the same global batches, and its checkpoint, saved by rank 0, loads in another process (this one) and
gives the same outputs."""

import torch
import torch.nn.functional as F
from _ddp import run_ddp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import fastdl
from fastdl.nn import FusedLinear

BATCH, STEPS_DATA, LR = 8, 64, 0.05


def _model():
    torch.manual_seed(0)
    return fastdl.convert(nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 3)), "fused")


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS_DATA, 12, generator=g), torch.randn(STEPS_DATA, 3, generator=g)


def _worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastdl.data import PrefetchLoader

    model = _model()
    assert isinstance(model[0], FusedLinear) and model[0].activation == "gelu"
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ds = TensorDataset(*_data())
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = PrefetchLoader(DataLoader(ds, batch_size=BATCH, sampler=sampler), device="cpu")
    for epoch in range(2):
        loader.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            F.mse_loss(ddp(xb), yb).backward()
            opt.step()
    probe = torch.linspace(-1, 1, 5 * 12).reshape(5, 12)
    with torch.no_grad():
        out = model(probe)
    loader.close()
    return {"state": model.state_dict(), "probe_out": out}


def test_fused_model_ddp_prefetchloader_matches_single_process(tmp_path):
    world = 2
    r0, r1 = run_ddp(_worker, tmp_path, world)
    for k in r0["state"]:  # (a) identical on every rank
        torch.testing.assert_close(r0["state"][k], r1["state"][k], rtol=0, atol=0)

    # single process on the same global batches: rank r takes dataset rows r, r + 2, ... (shuffle=False); the
    # global batch of a step is both ranks' batches, and DDP's mean of the two gradients = the mean over 2 * BATCH
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _data()
    per_rank = [torch.arange(r, STEPS_DATA, world) for r in range(world)]
    for _ in range(2):
        for i in range(0, STEPS_DATA // world, BATCH):
            idx = torch.cat([p[i: i + BATCH] for p in per_rank])
            opt.zero_grad()
            F.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(r0["state"][k], v, rtol=1e-4, atol=1e-5)

    # (c) the checkpoint saved by rank 0 loads here (another process) and gives the same outputs
    fresh = _model()
    fresh.load_state_dict(r0["state"])
    probe = torch.linspace(-1, 1, 5 * 12).reshape(5, 12)
    with torch.no_grad():
        torch.testing.assert_close(fresh(probe), r0["probe_out"], rtol=0, atol=0)
