"""``fastdl demo``: the whole workflow on a real (small) data set, side by side with plain PyTorch.

1. train an MLP on scikit-learn's handwritten digits (shipped with the package: nothing is downloaded) with
   DistributedDataParallel on 2 processes (gloo on the CPU; NCCL when there are GPUs), FusedLinear layers and the
   PrefetchLoader over a DataLoader with a DistributedSampler; the same model with nn.Linear is trained alongside;
2. prune to 2:4 and fine-tune with the masks kept (fastdl.sparsity.MaskedTraining);
3. convert for inference with int8 (W8A8) and with 2:4 sparsity;
4. print one table: test accuracy, training step time and inference time per stage, fastdl vs plain PyTorch.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN = 512


def load_digits_split(seed: int = 0):
    """The digits data set (1797 8x8 images), standardised, split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = len(x) // 5
    test, train = perm[:n_test], perm[n_test:]
    mean, std = x[train].mean(0), x[train].std(0).clamp_min(1e-3)
    x = (x - mean) / std
    return (x[train], y[train]), (x[test], y[test])


def make_model(fused: bool, seed: int = 0) -> nn.Module:
    """An MLP 64 -> 512 -> 512 -> 10: nn.Linear + activations, or the same thing converted to FusedLinear."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 16 * 4), nn.SiLU(),
        nn.Linear(64, 10),
    )
    if fused:
        from .convert import convert

        convert(model, "fused")
    return model


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(-1)
    return (pred == y).float().mean().item() * 100


def _loader(x, y, batch, rank, world, device, seed=0):
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from .data import PrefetchLoader

    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return PrefetchLoader(DataLoader(ds, batch_size=batch, sampler=sampler), device=device)


def _train(ddp, loader, opt, epochs, device, sync, bar_desc=None, masked=None):
    """Train; returns the median step time (forward + backward + optimizer) in ms."""
    steps = []
    rng = range(epochs)
    if bar_desc:
        from tqdm.auto import tqdm

        rng = tqdm(rng, desc=bar_desc, leave=False)
    for epoch in rng:
        loader.sampler.set_epoch(epoch)
        ddp.train()
        for xb, yb in loader:
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(ddp(xb).float(), yb)
            loss.backward()
            opt.step()
            if masked is not None:
                masked.apply()
            sync()
            steps.append(time.perf_counter() - t0)
    return statistics.median(steps[len(steps) // 5 :]) * 1e3


def _worker(rank: int, world: int, args, out_path: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import sparsity
    from ._distributed import finish_worker

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world and not args.cpu
    device = torch.device(f"cuda:{rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    rendezvous = f"file://{os.path.dirname(out_path)}/rendezvous"  # no TCP port to pick or race for
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method=rendezvous, rank=rank, world_size=world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    sync = torch.cuda.synchronize if use_cuda else (lambda: None)
    (xtr, ytr), (xte, yte) = load_digits_split()
    xte, yte = xte.to(device), yte.to(device)
    show = rank == 0 and not args.quiet
    results = {"backend": dist.get_backend(), "world": world, "device": str(device)}

    # 1. dense training: fastdl (FusedLinear + PrefetchLoader) and plain PyTorch, same init, same data order
    for name, fused in (("fastdl", True), ("pytorch", False)):
        model = make_model(fused).to(device)
        ddp = DDP(model, device_ids=[rank] if use_cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-4)
        loader = _loader(xtr, ytr, args.batch, rank, world, device)
        step_ms = _train(ddp, loader, opt, args.epochs, device, sync, f"dense [{name}]" if show else None)
        results[f"dense_{name}"] = {"acc": accuracy(model, xte, yte), "step_ms": step_ms}
        if fused:
            fused_model = model

    # 2. prune to 2:4 and fine-tune with the masks kept (fastdl); plain PyTorch keeps training dense for comparison
    pruned = copy.deepcopy(fused_model)
    prune_report = sparsity.prune(pruned)
    ddp = DDP(pruned, device_ids=[rank] if use_cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr / 3, weight_decay=1e-4)
    masked = sparsity.MaskedTraining(pruned, opt)
    acc_pruned = accuracy(pruned, xte, yte)
    loader = _loader(xtr, ytr, args.batch, rank, world, device, seed=1)
    step_ms = _train(ddp, loader, opt, args.finetune_epochs, device, sync, "2:4 fine-tune" if show else None,
                     masked=masked)
    masks = torch.cat([m.flatten().float() for m in sparsity.masks(pruned).values()])
    gathered = [torch.zeros_like(masks) for _ in range(world)]
    dist.all_gather(gathered, masks)
    results["sparse_fastdl"] = {
        "acc": accuracy(pruned, xte, yte), "acc_right_after_pruning": acc_pruned, "step_ms": step_ms,
        "masks_identical_on_all_ranks": all(torch.equal(gathered[0], g) for g in gathered),
        "skipped_layers": getattr(prune_report, "skipped", []),
    }

    if rank == 0:
        results.update(_inference_stage(fused_model, pruned, xte, yte, device, sync, args))
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def _time_inference(model, x, sync, reps=30) -> float:
    model.eval()
    with torch.no_grad():
        for _ in range(5):
            model(x)
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            model(x)
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _inference_stage(dense_fused, pruned, xte, yte, device, sync, args) -> dict:
    """Inference conversions on rank 0: the float models, int8 W8A8 and 2:4-sparse versions, vs plain PyTorch."""
    from . import sparsity
    from .convert import convert

    out = {}
    plain = make_model(False).to(device)
    plain.load_state_dict(dense_fused.state_dict())  # FusedLinear keeps nn.Linear's keys
    x_bf16 = xte.to(torch.bfloat16)
    plain_bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    out["infer_pytorch_fp32"] = {"acc": accuracy(plain, xte, yte), "ms": _time_inference(plain, xte, sync)}
    out["infer_pytorch_bf16"] = {"acc": accuracy(plain_bf16, x_bf16, yte),
                                 "ms": _time_inference(plain_bf16, x_bf16, sync)}
    fused_bf16 = copy.deepcopy(dense_fused).to(torch.bfloat16)
    out["infer_fastdl_fused_bf16"] = {"acc": accuracy(fused_bf16, x_bf16, yte),
                                      "ms": _time_inference(fused_bf16, x_bf16, sync)}
    int8 = convert(copy.deepcopy(plain), "int8")
    out["infer_fastdl_int8"] = {"acc": accuracy(int8, xte, yte), "ms": _time_inference(int8, xte, sync),
                                "float_acc": out["infer_pytorch_fp32"]["acc"]}
    sparse_plain = make_model(False).to(device)
    sparse_plain.load_state_dict(sparsity.dense_state_dict(pruned))
    sparse = sparsity.sparsify(copy.deepcopy(pruned)).to(torch.bfloat16)
    sparse_ref = copy.deepcopy(sparse_plain).to(torch.bfloat16)
    out["infer_fastdl_sparse24_bf16"] = {"acc": accuracy(sparse, x_bf16, yte),
                                         "ms": _time_inference(sparse, x_bf16, sync),
                                         "pytorch_ms": _time_inference(sparse_ref, x_bf16, sync)}
    return out


def format_table(r: dict) -> str:
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    d_f, d_p, sp = r["dense_fastdl"], r["dense_pytorch"], r["sparse_fastdl"]
    rows = [
        ("dense training (DDP)", f(d_f["acc"]), f(d_p["acc"]), f(d_f["step_ms"], "{:.3f}"), f(d_p["step_ms"], "{:.3f}"),
         "-", "-"),
        ("2:4 prune + fine-tune (DDP)", f(sp["acc"]), f(d_p["acc"]), f(sp["step_ms"], "{:.3f}"),
         f(d_p["step_ms"], "{:.3f}"), "-", "-"),
        ("inference bf16 FusedLinear", f(r["infer_fastdl_fused_bf16"]["acc"]), f(r["infer_pytorch_bf16"]["acc"]), "-",
         "-", f(r["infer_fastdl_fused_bf16"]["ms"], "{:.3f}"), f(r["infer_pytorch_bf16"]["ms"], "{:.3f}")),
        ("inference int8 W8A8", f(r["infer_fastdl_int8"]["acc"]), f(r["infer_pytorch_fp32"]["acc"]), "-", "-",
         f(r["infer_fastdl_int8"]["ms"], "{:.3f}"), f(r["infer_pytorch_fp32"]["ms"], "{:.3f}")),
        ("inference 2:4 sparse bf16", f(r["infer_fastdl_sparse24_bf16"]["acc"]), f(r["infer_pytorch_bf16"]["acc"]),
         "-", "-", f(r["infer_fastdl_sparse24_bf16"]["ms"], "{:.3f}"),
         f(r["infer_fastdl_sparse24_bf16"]["pytorch_ms"], "{:.3f}")),
    ]
    head = ("stage", "acc % fastdl", "acc % PyTorch", "step ms fastdl", "step ms PyTorch", "infer ms fastdl",
            "infer ms PyTorch")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def check_bars(r: dict) -> list[str]:
    """The demo's accuracy bars; returns the ones missed (empty when all hold)."""
    missed = []
    dense = r["dense_fastdl"]["acc"]
    if dense < 95:
        missed.append(f"dense test accuracy {dense:.2f}% < 95%")
    if r["sparse_fastdl"]["acc"] < dense - 1:
        missed.append(f"2:4 accuracy {r['sparse_fastdl']['acc']:.2f}% is more than 1 point under dense {dense:.2f}%")
    i8 = r["infer_fastdl_int8"]
    if i8["acc"] < i8["float_acc"] - 0.5:
        missed.append(
            f"int8 accuracy {i8['acc']:.2f}% is more than 0.5 point under its float model {i8['float_acc']:.2f}%"
        )
    if not r["sparse_fastdl"]["masks_identical_on_all_ranks"]:
        missed.append("2:4 masks differ between DDP ranks")
    return missed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--finetune-epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--world", type=int, default=2, help="DDP processes")
    p.add_argument("--cpu", action="store_true", help="stay on the CPU even with GPUs")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args) -> dict:
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    world = args.world
    if torch.cuda.is_available() and not args.cpu:
        world = min(world, torch.cuda.device_count())  # NCCL needs one GPU per rank
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "results.pt")
        mp.spawn(_worker, args=(world, args, out_path), nprocs=world, join=True)
        results = torch.load(out_path, weights_only=False)
    print(f"fastdl demo: digits (sklearn), MLP 64-{HIDDEN}-{HIDDEN}-64-10, DDP {results['backend']} x{world} on "
          f"{results['device'].split(':')[0]}, {args.epochs} epochs + {args.finetune_epochs} 2:4 fine-tune epochs")
    print(format_table(results))
    sp = results["sparse_fastdl"]
    print(f"2:4 masks identical on all ranks: {sp['masks_identical_on_all_ranks']}; accuracy right after pruning "
          f"{sp['acc_right_after_pruning']:.2f}%, after fine-tuning {sp['acc']:.2f}%")
    missed = check_bars(results)
    print("bars: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    print(f"total {time.perf_counter() - t0:.0f} s")
    results["missed"] = missed
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="fastdl demo", description=__doc__)
    add_arguments(p)
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()
