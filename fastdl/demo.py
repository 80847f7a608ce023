"""``fastdl demo``: the whole workflow on a real (small) data set, side by side with plain PyTorch.

1. train an MLP on scikit-learn's handwritten digits (shipped with the package: nothing is downloaded) with
   DistributedDataParallel on 2 processes (gloo on the CPU; NCCL when there are GPUs), FusedLinear layers and the
   PrefetchLoader over a DataLoader with a DistributedSampler; the same model with nn.Linear is trained alongside;
2. prune to 2:4 and fine-tune with the masks kept (fastdl.sparsity.MaskedTraining);
3. convert for inference with int8 (W8A8) and with 2:4 sparsity;
4. print one table: test accuracy, training step time and inference time per stage, fastdl beside every PyTorch
   option a user could pick on this machine (fp32 and bf16 autocast/eager; PyTorch's own int8 - dynamic quantization
   with fbgemm - for the int8 stage), and a closing verdict per stage that judges speed (against the fastest of them)
   as well as accuracy, and says plainly where fastdl is slower and the likely cause on this CPU.
"""

from __future__ import annotations

import argparse
import contextlib
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


def _loader(x, y, batch, rank, world, device, seed=0, prefetch=True):
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    from .data import PrefetchLoader

    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    dl = DataLoader(ds, batch_size=batch, sampler=sampler)
    return PrefetchLoader(dl, device=device) if prefetch else dl


def _train(ddp, loader, opt, epochs, device, sync, bar_desc=None, masked=None, autocast=True):
    """Train; returns the median step time (forward + backward + optimizer) in ms."""
    steps = []
    rng = range(epochs)
    if bar_desc:
        from tqdm.auto import tqdm

        rng = tqdm(rng, desc=bar_desc, leave=False)
    sampler = loader.sampler if hasattr(loader, "sampler") else loader.loader.sampler
    ctx = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    for epoch in rng:
        sampler.set_epoch(epoch)
        ddp.train()
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = F.cross_entropy(ddp(xb).float(), yb)
            loss.backward()
            opt.step()
            if masked is not None:
                masked.apply()
            sync()
            steps.append(time.perf_counter() - t0)
    return statistics.median(steps[len(steps) // 5 :]) * 1e3


# The dense training runs: (name, FusedLinear?, autocast bf16?, trained to the end?). PyTorch's plain nn.Linear model
# is trained in fp32 (the accuracy reference) and timed in bf16 autocast for a few epochs only: on a CPU without
# AVX512-BF16 PyTorch's bf16 is its slow path (8x the fp32 step time, capped on the Zen 4), where training it to the end
# would double the demo's time for a number a user would not pick.
DENSE_RUNS = (("fastdl", True, True, True), ("pytorch_fp32", False, False, True), ("pytorch_bf16", False, True, False))
TIMING_EPOCHS = 3
LABELS = {
    "fastdl": "fastdl FusedLinear, bf16 autocast",
    "pytorch_bf16": "PyTorch nn.Linear, bf16 autocast",
    "pytorch_fp32": "PyTorch nn.Linear, fp32",
}


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

    # 1. dense training: fastdl (FusedLinear + PrefetchLoader) and plain PyTorch (bf16 autocast and fp32), same init,
    # same data order
    for name, fused, autocast, full in DENSE_RUNS:
        t0 = time.perf_counter()
        model = make_model(fused).to(device)
        ddp = DDP(model, device_ids=[rank] if use_cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-4)
        loader = _loader(xtr, ytr, args.batch, rank, world, device, prefetch=fused)
        epochs = args.epochs if full else min(args.epochs, TIMING_EPOCHS)
        step_ms = _train(ddp, loader, opt, epochs, device, sync, f"dense [{name}]" if show else None,
                         autocast=autocast)
        acc = accuracy(model, xte, yte) if full else None
        results[f"dense_{name}"] = {"acc": acc, "step_ms": step_ms, "epochs": epochs}
        if rank == 0:
            what = f"test accuracy {acc:.2f}%" if full else f"timed over {epochs} epochs (not trained to the end)"
            print(f"  [{time.perf_counter() - args.t0:5.0f} s] dense training {LABELS[name]}: {step_ms:.3f} ms/step, "
                  f"{what} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if fused:
            fused_model = model
    results["dense_pytorch"] = results["dense_pytorch_fp32"]  # the name earlier versions used

    # 2. prune to 2:4 and fine-tune with the masks kept (fastdl); plain PyTorch keeps training dense for comparison
    t0 = time.perf_counter()
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
        print(f"  [{time.perf_counter() - args.t0:5.0f} s] 2:4 prune + fine-tune: {step_ms:.3f} ms/step, test accuracy "
              f"{results['sparse_fastdl']['acc']:.2f}% ({time.perf_counter() - t0:.0f} s)", flush=True)

    if rank == 0:
        results.update(_inference_stage(fused_model, pruned, xte, yte, device, sync, args))
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()
    finish_worker()  # see fastdl._distributed: avoids an abort in gloo teardown


def _time_calls(fns: dict, sync, budget_s: float = 0.6) -> dict:
    """Median ms per call of each model call, interleaved (the same machine load for all)."""
    from .bench.common import interleaved

    with torch.no_grad():
        t = interleaved(fns, "cuda" if sync is not None and sync is torch.cuda.synchronize else "cpu",
                        budget_s=budget_s, min_reps=20)  # fmt: skip
    return {k: v * 1e3 for k, v in t.items()}


def _pytorch_int8(plain: nn.Module):
    """PyTorch's own int8 inference: dynamic quantization of the Linear layers (fbgemm), or (None, why)."""
    try:
        import warnings

        from torch.ao.quantization import quantize_dynamic

        if "fbgemm" not in torch.backends.quantized.supported_engines:
            return None, "fbgemm engine unavailable"
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return quantize_dynamic(copy.deepcopy(plain).float(), {nn.Linear}, dtype=torch.qint8), None
    except Exception as exc:  # removed in a future torch, or unsupported here
        return None, f"{type(exc).__name__}: {exc}"


def _inference_stage(dense_fused, pruned, xte, yte, device, sync, args) -> dict:
    """Inference conversions on rank 0, each beside every PyTorch option a user could pick for it."""
    from . import sparsity
    from .convert import convert

    t0 = time.perf_counter()
    out = {}
    plain = make_model(False).to(device)
    plain.load_state_dict(dense_fused.state_dict())  # FusedLinear keeps nn.Linear's keys
    x_bf16 = xte.to(torch.bfloat16)
    plain_bf16 = copy.deepcopy(plain).to(torch.bfloat16)
    fused_bf16 = copy.deepcopy(dense_fused).to(torch.bfloat16)
    int8 = convert(copy.deepcopy(plain), "int8")
    for m in (plain, plain_bf16, fused_bf16, int8):
        m.eval()
    float_providers = {"pytorch_fp32": (plain, xte), "pytorch_bf16": (plain_bf16, x_bf16)}
    acc = {k: accuracy(m, x, yte) for k, (m, x) in float_providers.items()}

    def calls(provs):
        return {k: (lambda m=m, x=x: m(x)) for k, (m, x) in provs.items()}

    # FusedLinear bf16 vs eager fp32 / bf16
    provs = {"fastdl": (fused_bf16, x_bf16), **float_providers}
    ms = _time_calls(calls(provs), sync)
    out["infer_fused"] = {"fastdl": {"acc": accuracy(fused_bf16, x_bf16, yte), "ms": ms["fastdl"]},
                          **{k: {"acc": acc[k], "ms": ms[k]} for k in float_providers}}
    # int8 W8A8 vs eager fp32 / bf16 and PyTorch's own int8 (fbgemm dynamic quantization)
    provs = {"fastdl": (int8, xte), **float_providers}
    q, why = _pytorch_int8(plain) if device.type == "cpu" else (None, "CPU only")
    if q is not None:
        provs["pytorch_int8"] = (q, xte)
    ms = _time_calls(calls(provs), sync)
    out["infer_int8"] = {"fastdl": {"acc": accuracy(int8, xte, yte), "ms": ms["fastdl"]},
                         **{k: {"acc": acc[k], "ms": ms[k]} for k in float_providers}}
    if q is not None:
        out["infer_int8"]["pytorch_int8"] = {"acc": accuracy(q, xte, yte), "ms": ms["pytorch_int8"]}
    else:
        out["infer_int8"]["pytorch_int8_missing"] = why
    # 2:4 sparse bf16 vs the same pruned weights dense, bf16 and fp32
    sparse_plain = make_model(False).to(device)
    sparse_plain.load_state_dict(sparsity.dense_state_dict(pruned))
    sparse = sparsity.sparsify(copy.deepcopy(pruned)).to(torch.bfloat16)
    sparse_bf16 = copy.deepcopy(sparse_plain).to(torch.bfloat16)
    for m in (sparse_plain, sparse, sparse_bf16):
        m.eval()
    provs = {"fastdl": (sparse, x_bf16), "pytorch_fp32": (sparse_plain, xte), "pytorch_bf16": (sparse_bf16, x_bf16)}
    ms = _time_calls(calls(provs), sync)
    out["infer_sparse24"] = {k: {"acc": accuracy(m, x, yte), "ms": ms[k]} for k, (m, x) in provs.items()}
    print(f"  [{time.perf_counter() - args.t0:5.0f} s] inference stages timed ({time.perf_counter() - t0:.0f} s)",
          flush=True)
    return out


# ------------------------------------------------------------------------------------------------- verdict
# Stage -> (title, the results key of each provider, what "ms" counts, what the fastdl kernel needs to be fast)
STAGES = (
    ("dense training (DDP)", "train", "step"),
    ("2:4 prune + fine-tune (DDP)", "finetune", "step"),
    ("inference FusedLinear bf16", "infer_fused", "call"),
    ("inference int8 W8A8", "infer_int8", "call"),
    ("inference 2:4 sparse bf16", "infer_sparse24", "call"),
)
PROVIDER_LABELS = {
    "fastdl": "fastdl",
    "pytorch_fp32": "PyTorch fp32",
    "pytorch_bf16": "PyTorch bf16",
    "pytorch_int8": "PyTorch int8 (fbgemm dynamic quant)",
}
FASTDL_LABELS = {
    "train": "fastdl FusedLinear bf16 autocast",
    "finetune": "fastdl 2:4 masked fine-tune (bf16)",
    "infer_fused": "fastdl FusedLinear bf16",
    "infer_int8": "fastdl Int8Linear W8A8",
    "infer_sparse24": "fastdl Sparse24Linear bf16",
}


ACC_MARGIN = 1.0  # accuracy points under PyTorch fp32 beyond which a PyTorch option is not one a user would pick


def stages(r: dict) -> list[dict]:
    """Per stage: fastdl's accuracy and time, each PyTorch option's, the best PyTorch option and the ratio."""
    out = []
    for title, key, unit in STAGES:
        if key == "train":
            prov = {"fastdl": r["dense_fastdl"], "pytorch_fp32": r.get("dense_pytorch_fp32"),
                    "pytorch_bf16": r.get("dense_pytorch_bf16")}  # fmt: skip
            prov = {k: {"acc": v["acc"], "ms": v["step_ms"]} for k, v in prov.items() if v}
        elif key == "finetune":
            prov = {"fastdl": {"acc": r["sparse_fastdl"]["acc"], "ms": r["sparse_fastdl"]["step_ms"]}}
            for k in ("pytorch_fp32", "pytorch_bf16"):  # PyTorch has no 2:4 training: its dense step is the baseline
                if r.get(f"dense_{k}"):
                    prov[k] = {"acc": r[f"dense_{k}"]["acc"], "ms": r[f"dense_{k}"]["step_ms"]}
        elif key in r:
            prov = {k: v for k, v in r[key].items() if isinstance(v, dict)}
        else:
            continue
        # A PyTorch option counts only if a user would keep it: accuracy within ACC_MARGIN points of PyTorch fp32 on
        # the same stage (PyTorch's int8 quantizes activations per tensor; one outlier row can wreck the others).
        ref = (prov.get("pytorch_fp32") or prov["fastdl"])["acc"]
        unusable = [k for k, v in prov.items()
                    if k != "fastdl" and v["acc"] is not None and ref is not None and v["acc"] < ref - ACC_MARGIN]
        base = {k: v for k, v in prov.items() if k != "fastdl" and k not in unusable}
        best = min(base, key=lambda k: base[k]["ms"]) if base else None
        ratio = base[best]["ms"] / prov["fastdl"]["ms"] if best else None
        out.append({"stage": title, "key": key, "unit": unit, "providers": prov, "best": best, "ratio": ratio,
                    "slower": ratio is not None and ratio < 1.0, "unusable": unusable})  # fmt: skip
    return out


def slow_reasons(key: str, cpu: dict, fastdl_ms: float) -> list[str]:
    """Likely causes of a slower stage, from the CPU level, the stage and the size of the work (facts about this
    demo's model, not measurements of the cause)."""
    level = cpu.get("level", "")
    capped = " (capped)" if cpu.get("capped") else ""
    why = []
    if key in ("train", "finetune", "infer_fused", "infer_sparse24") and level in ("scalar", "avx2", "avx512"):
        why.append(f"{level}{capped}: no AVX512-BF16, so bf16 products are widened to fp32 in software, "
                   "while PyTorch's fp32 runs at full speed")  # fmt: skip
    if key == "infer_int8" and level in ("scalar", "avx2"):
        why.append(f"{level}{capped}: no AVX512-VNNI, int8 dot products take 3 instructions (vpmaddubsw, vpmaddwd, "
                   "vpaddd) instead of 1")  # fmt: skip
    if key == "finetune":
        why.append("the 2:4 fine-tune step also re-applies the masks to every weight after the optimizer step "
                   "(MaskedTraining), work the dense PyTorch step it is compared with does not do")  # fmt: skip
    if key == "infer_sparse24":
        why.append("CPUs have no 2:4 sparse arithmetic: the sparse kernel saves weight traffic, which pays at a few "
                   "rows; the demo infers 359 rows through layers of at most 512 x 512 (weights in cache), where "
                   "the work is arithmetic")  # fmt: skip
    if key in ("train", "finetune"):
        why.append("a 0.6 M-parameter MLP in 2-process DDP: per-layer Python, autograd and all-reduce overhead "
                   "weigh more than the GEMMs")  # fmt: skip
    elif fastdl_ms < 2.0:
        why.append(f"layers 64-512 wide on {fastdl_ms:.2f} ms calls: per-call overhead (Python, dispatcher, thread "
                   "start) is a large share")  # fmt: skip
    from .bench.common import busy_warning

    if busy_warning():
        why.append(busy_warning())
    return why


def verdict(r: dict, cpu: dict) -> list[str]:
    """Closing lines: per stage, speed vs the fastest PyTorch option and accuracy, plainly; the last line sums up."""
    lines = []
    slower = []
    for st in stages(r):
        if st["best"] is None:
            continue
        fd = st["providers"]["fastdl"]
        best = PROVIDER_LABELS[st["best"]]
        for k in st["unusable"]:
            ref = st["providers"].get("pytorch_fp32", fd)["acc"]
            lines.append(f"  {st['stage']}: {PROVIDER_LABELS.get(k, k)} not counted: accuracy "
                         f"{st['providers'][k]['acc']:.2f}% vs PyTorch fp32 {ref:.2f}%")
        if st["slower"]:
            why = slow_reasons(st["key"], cpu, fd["ms"])
            noise = " (within 5%: may be noise)" if st["ratio"] >= 0.95 else ""
            lines.append(f"  {st['stage']}: SLOWER than {best}: {st['ratio']:.2f}x{noise} ({fd['ms']:.3f} vs "
                         f"{st['providers'][st['best']]['ms']:.3f} ms/{st['unit']}); likely cause: "
                         + ("; ".join(why) or "unknown"))  # fmt: skip
            slower.append(f"{st['stage']} ({st['ratio']:.2f}x {best})")
        else:
            lines.append(f"  {st['stage']}: faster than the best PyTorch option ({best}): {st['ratio']:.2f}x")
    missed = check_bars(r)
    lines.append("  accuracy bars: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    where = f"{cpu.get('model', 'CPU')}, ISA {cpu.get('level', '?')}{' (capped)' if cpu.get('capped') else ''}"
    if slower:
        lines.append(f"verdict ({where}): fastdl is SLOWER than PyTorch in {len(slower)} of {len(stages(r))} stages: "
                     + "; ".join(slower))  # fmt: skip
    else:
        lines.append(f"verdict ({where}): fastdl is at least as fast as the best PyTorch option in every stage"
                     + ("" if not missed else ", but accuracy bars are missed"))  # fmt: skip
    return lines


def format_table(r: dict) -> str:
    head = ("stage", "run", "acc %", "ms", "fastdl vs it")
    rows = []
    for st in stages(r):
        fd = st["providers"]["fastdl"]
        for k, v in st["providers"].items():
            label = FASTDL_LABELS[st["key"]] if k == "fastdl" else PROVIDER_LABELS.get(k, k)
            ratio = "" if k == "fastdl" else f"{v['ms'] / fd['ms']:.2f}x"
            if k in st["unusable"]:
                ratio += f"  (accuracy > {ACC_MARGIN:g} point under PyTorch fp32: not counted)"
            elif k != "fastdl" and v["ms"] / fd["ms"] < 1.0:
                ratio += "  <<< fastdl SLOWER"
            elif k == st["best"]:
                ratio += "  (fastest PyTorch)"
            rows.append((st["stage"] if k == "fastdl" else "", label, "-" if v["acc"] is None else f"{v['acc']:.2f}",
                         f"{v['ms']:.3f}/{st['unit']}", ratio))  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def check_bars(r: dict) -> list[str]:
    """The demo's accuracy bars; returns the ones missed (empty when all hold)."""
    missed = []
    dense = r["dense_fastdl"]["acc"]
    if dense < 95:
        missed.append(f"dense test accuracy {dense:.2f}% < 95%")
    if r["sparse_fastdl"]["acc"] < dense - 1:
        missed.append(f"2:4 accuracy {r['sparse_fastdl']['acc']:.2f}% is more than 1 point under dense {dense:.2f}%")
    i8 = r["infer_int8"]
    if i8["fastdl"]["acc"] < i8["pytorch_fp32"]["acc"] - 0.5:
        missed.append(f"int8 accuracy {i8['fastdl']['acc']:.2f}% is more than 0.5 point under its float model "
                      f"{i8['pytorch_fp32']['acc']:.2f}%")  # fmt: skip
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
    p.add_argument("--json", default=None, help="also write the results and the verdict to this JSON file")


def _cpu() -> dict:
    from ._extension import cpu_info

    return cpu_info()


def run(args) -> dict:
    import torch.multiprocessing as mp

    from .bench.common import activity
    from .bench.isa import describe, run_context

    t0 = time.perf_counter()
    args.t0 = t0
    world = args.world
    if torch.cuda.is_available() and not args.cpu:
        world = min(world, torch.cuda.device_count())  # NCCL needs one GPU per rank
    ctx = run_context()
    print(f"fastdl demo: {describe(ctx)}", flush=True)
    from .bench.common import busy_warning

    for w in ctx["warnings"] + ([busy_warning()] if busy_warning() else []):
        print(f"  WARNING: {w}", flush=True)
    print(f"  training 3 models ({', '.join(LABELS.values())}) for {args.epochs} epochs with DDP x{world}, 2:4 "
          f"fine-tuning for {args.finetune_epochs} epochs, then timing inference; each stage prints when done",
          flush=True)  # fmt: skip
    activity("fastdl demo (DDP workers)")
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
    cpu = _cpu()
    lines = verdict(results, cpu)
    print("verdict per stage (speed: fastdl vs the fastest PyTorch option a user could pick here; accuracy: the bars):")
    print("\n".join(lines))
    results["missed"] = missed
    results["stages"] = stages(results)
    results["slower"] = [st["stage"] for st in results["stages"] if st["slower"]]
    results["verdict"] = lines
    results["cpu"] = {k: cpu.get(k) for k in ("model", "level", "detected_level", "capped", "kernels")}
    results["seconds"] = time.perf_counter() - t0
    print(f"total {results['seconds']:.0f} s")
    if args.json:
        import json

        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


def main(argv=None):
    from .bench.common import module_main

    return module_main("fastdl demo", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
