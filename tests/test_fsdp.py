"""fastdl's modules under FSDP2 (torch.distributed.fsdp.fully_shard), 2 processes on gloo: FusedLinear training,
QAT Int8Linear training, 2:4 MaskedTraining (masks kept on every shard) and Int8Linear / Sparse24Linear inference
match single-process results; a sharded torch.distributed.checkpoint saves and loads; FSDP2 sees no view outputs.

All scenarios run in one pair of spawned workers (one start-up, ~10 s); the single-process references run here."""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastdl
from fastdl import quant, sparsity
from fastdl._distributed import finish_worker
from fastdl.nn import FusedLinear, Int8Linear, Sparse24Linear

WORLD, STEPS, ROWS = 2, 5, 8  # ROWS per step (global batch), split evenly over the ranks
TRAINING = ("fused", "qat", "masked")
INFERENCE = ("int8", "int8_weight_only", "sparse24")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available in this torch build"
)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        return None
    return fully_shard


def _base(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def _model(kind: str) -> nn.Module:
    """The single-process model of a scenario, before sharding (identical on every rank: same seed)."""
    m = _base()
    if kind == "fused":
        return fastdl.convert(m, "fused")
    if kind == "qat":
        return quant.quantize_model(m, trainable=True)
    if kind == "masked":
        sparsity.prune(m)
        return m
    if kind == "sparse24":
        sparsity.prune(m)
        return sparsity.sparsify(m)
    return fastdl.convert(m, kind)  # int8, int8_weight_only


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, ROWS, 12, generator=g), torch.randn(STEPS, ROWS, 4, generator=g)


def _optimizer(kind, params):
    if kind == "masked":  # momentum and weight decay move pruned weights off zero unless re-masked
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.Adam(params, lr=1e-2)


def _rows(rank):
    per = ROWS // WORLD
    return slice(rank * per, (rank + 1) * per)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, (nn.Linear, FusedLinear, Int8Linear, Sparse24Linear))]


def _shard(model, mesh):
    fully_shard = _fully_shard()
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _masks_hold(model) -> bool:
    """Every pruned weight is 2:4 and zero off its mask, on this rank's shard and gathered."""
    from fastdl.nn._base import is_dtensor

    for m in model.modules():
        if sparsity.is_pruned(m):
            w, mask = m.weight, sparsity.get_mask(m)
            if is_dtensor(w):
                local, rows = w.to_local(), mask.chunk(WORLD, 0)[torch.distributed.get_rank()]
                if local.shape[0] and not bool((local[~rows] == 0).all()):
                    return False
            full = _full(w.detach())
            if not (sparsity.is_2_4(full) and bool((full[~mask] == 0).all())):
                return False
    return True


def _train(model, kind, rank=None):
    """5 steps; returns the losses (of this rank's rows when rank is given, else of the global batch)."""
    x, y = _data()
    opt = _optimizer(kind, model.parameters())
    masked = sparsity.MaskedTraining(model, opt) if kind == "masked" else None
    losses, masks_ok = [], True
    for step in range(STEPS):
        xb, yb = (x[step], y[step]) if rank is None else (x[step][_rows(rank)], y[step][_rows(rank)])
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if masked is not None:
            masks_ok = masks_ok and _masks_hold(model)
    if masked is not None:
        masked.remove()
    return losses, masks_ok


def _probe():
    return torch.linspace(-2, 2, 6 * 12).reshape(6, 12)


def _worker(rank, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kind in TRAINING:
            model = _shard(_model(kind), mesh)
            losses, masks_ok = _train(model, kind, rank)
            model.eval()
            with torch.no_grad():
                probe_out = model(_probe())
            state = {k: _full(v).clone() for k, v in get_model_state_dict(model).items()}
            ckpt = os.path.join(out_dir, f"dcp_{kind}")
            dcp.save(get_model_state_dict(model), checkpoint_id=ckpt)
            fresh = _shard(_model(kind), mesh)
            sd = get_model_state_dict(fresh)
            dcp.load(sd, checkpoint_id=ckpt)
            set_model_state_dict(fresh, sd)
            fresh.eval()
            with torch.no_grad():
                reloaded = fresh(_probe())
            results[kind] = {"losses": losses, "masks_ok": masks_ok, "probe": probe_out, "reloaded": reloaded,
                             "state": state}  # fmt: skip
        x, _ = _data()
        for kind in INFERENCE:
            model = _shard(_model(kind).eval(), mesh)
            with torch.no_grad():
                results[kind] = {"out": model(x[0][_rows(rank)])}
    results["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    if _fully_shard() is None:
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch")
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp")
    mp.spawn(_worker, args=(str(out),), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("kind", TRAINING)
def test_fsdp2_training_matches_single_process(kind, fsdp_results):
    """The mean of the ranks' losses is the global batch's loss, step by step (fp32 tolerance); the trained weights
    and the eval outputs equal single-process training on the same global batches; the sharded checkpoint
    (torch.distributed.checkpoint) reloads into a fresh sharded model with the same outputs."""
    model = _model(kind)
    losses, masks_ok = _train(model, kind)
    model.eval()
    with torch.no_grad():
        probe = model(_probe())
    fsdp = [r[kind] for r in fsdp_results]
    mean = [sum(r["losses"][i] for r in fsdp) / WORLD for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for r in fsdp:
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-5, msg=k)
        torch.testing.assert_close(r["probe"], probe, rtol=1e-4, atol=1e-5)
        assert torch.equal(r["reloaded"], r["probe"])
    if kind == "masked":
        assert masks_ok and all(r["masked"]["masks_ok"] for r in fsdp_results)


@pytest.mark.parametrize("kind", INFERENCE)
def test_fsdp2_inference_matches_single_process(kind, fsdp_results):
    x, _ = _data()
    model = _model(kind).eval()
    for rank, r in enumerate(fsdp_results):
        with torch.no_grad():
            assert torch.equal(r[kind]["out"], model(x[0][_rows(rank)]))


def test_fsdp2_sees_no_view_outputs(fsdp_results):
    """FSDP2 warns when a module returns a view (an in-place op on it would drop the pre-backward hook)."""
    for r in fsdp_results:
        assert not [w for w in r["warnings"] if "view" in w], r["warnings"]


def test_outputs_are_not_views():
    """Outputs that take part in autograd are not views (inference outputs may be: nothing hooks them)."""
    x = torch.randn(3, 5, 12, requires_grad=True)
    for kind in ("fused", "qat", "int8", "int8_weight_only", "sparse24"):
        out = _model(kind)[0](x)
        assert out._base is None, kind
    out = FusedLinear(12, 8, activation="none")(x, residual=torch.randn(3, 5, 8))
    assert out._base is None
    out += 1  # an in-place op on the output is an ordinary in-place op
    out.sum().backward()
