"""``fastdl bench loader``: fastdl's PrefetchLoader vs ``torch.utils.data.DataLoader`` on a synthetic dataset.

Each batch costs the producer ``--produce-ms`` of real work and the consumer step ``--step-ms`` of real work (torch
matmuls), measured in one process on the same data:

  dl0          DataLoader(num_workers=0): producer and step run one after the other
  dl2          DataLoader(num_workers=2, persistent workers, + pin_memory on a GPU)
  fastdl       PrefetchLoader(DataLoader(num_workers=0)): the producer runs on fastdl's background thread
  fastdl+dl2   PrefetchLoader(DataLoader(num_workers=2)): worker processes produce, fastdl stages and copies (on a
               CPU target it passes the batches through: nothing to copy)

Like with like: each fastdl row is compared with the DataLoader it wraps (``x_baseline``: fastdl vs dl0, fastdl+dl2
vs dl2; the wrapped loader is measured whenever its fastdl row is), and one row per producer kind, ``fastest``,
compares the fastest fastdl configuration with the fastest PyTorch one (``baseline`` names it; among the PyTorch
loaders that the measured fastdl configurations wrap). Ratios are paired:
the median over the repeats of (baseline epoch / fastdl epoch) in the same round. ``x_best`` is a row's ratio to
the fastest PyTorch loader; ``speedup_vs_dl0`` its ratio to dl0. A fastdl row is marked slower (``slower``, what
``fastdl bench all`` reports) only against its own baseline.

Producer kinds: ``torch`` (the batch is generated and transformed with torch ops, which release the GIL, so a thread
overlaps them with the step), ``python`` (pure-Python work that holds the GIL: a thread cannot overlap it with
the Python parts of the step; worker processes can), ``sleep`` (I/O-like waiting).

Overlap efficiency = max(total producer time, total step time) / epoch time, with the two totals measured in the
serial dl0 run (where each runs alone), so 1.0 means the epoch took exactly as long as the busier side.
On a GPU it also measures host-to-device GB/s for ``--h2d-mb`` batches: pageable ``.to()``, a raw pinned copy and
fastdl (end to end from pageable tensors, and the device-timed copy out of its pinned ring).

Standalone: ``python -m fastdl.bench.loader --csv out.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

from ..data import PrefetchLoader
from .common import activity, env_columns, mark_slower, over_time, print_header, print_table, say, write_csv

LOADERS = ("dl0", "dl2", "fastdl", "fastdl+dl2")
WRAPS = {"fastdl": "dl0", "fastdl+dl2": "dl2"}  # the PyTorch loader each fastdl configuration wraps
LABELS = {"dl0": "DataLoader(num_workers=0)", "dl2": "DataLoader(num_workers=2)"}
KINDS = ("torch", "python", "sleep")
QUICK_ARGS = ["--quick", "--kinds", "torch"]
_MM = 192  # matmul size of the calibrated work units (fp32, one core: ~0.1-0.2 ms each)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu or cuda (the step runs there; batches are moved there)")
    p.add_argument("--batches", type=int, default=200, help="batches per epoch")
    p.add_argument("--produce-ms", type=float, default=10.0, help="producer work per batch (ms)")
    p.add_argument("--step-ms", type=float, default=10.0, help="consumer step work per batch (ms)")
    p.add_argument("--batch-mb", type=float, default=4.0, help="size of one batch (MB of float32)")
    p.add_argument("--kinds", nargs="+", default=["torch", "python"], choices=KINDS, help="producer work kinds")
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=LOADERS)
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per loader (median), after one warm-up")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: one core for the step, one for the producer)")
    p.add_argument("--depth", type=int, default=2, help="PrefetchLoader depth")
    p.add_argument("--h2d-mb", type=float, default=64.0, help="GPU only: batch size of the host-to-device test (MB)")
    p.add_argument("--h2d-batches", type=int, default=40, help="GPU only: batches of the host-to-device test")
    p.add_argument("--quick", action="store_true",
                   help="short run: 20 batches, 3 repeats (paired rounds: the like-with-like rows are ~1.0x by "
                        "construction, and one round of 40 batches flipped them across 1.0 with the machine's load)")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


# ---------------------------------------------------------------------------------------------------------------
# calibrated work


def _mm_unit(a: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, a)


def _py_unit(n: int = 2000) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


def _median_time(fn, reps: int = 15) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


class Work:
    """Per-batch producer work and per-step consumer work, calibrated here (alone) to the requested times."""

    def __init__(self, produce_ms: float, step_ms: float, batch_mb: float, device: torch.device):
        self.numel = max(1, int(batch_mb * 1e6 / 4))
        self.device = device
        a = torch.randn(_MM, _MM)
        self.a = a
        t_mm = _median_time(lambda: [_mm_unit(a) for _ in range(10)]) / 10
        t_py = _median_time(lambda: _py_unit()) or 1e-6
        gen = _median_time(lambda: self._generate(0), reps=5)
        budget = max(produce_ms / 1e3 - gen, 0.0)
        self.produce_mm = int(round(budget / t_mm))
        self.produce_py = int(round(budget / t_py))
        self.produce_sleep = budget
        self.gen_s = gen
        self.unit_mm_s, self.unit_py_s = t_mm, t_py
        if device.type == "cuda":
            n = 4096
            self.ga = torch.randn(n, n, device=device, dtype=torch.bfloat16)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                torch.mm(self.ga, self.ga)
            torch.cuda.synchronize()
            t_g = (time.perf_counter() - t0) / 10
            self.step_units = max(1, int(round(step_ms / 1e3 / t_g)))
        else:
            self.step_units = max(1, int(round(step_ms / 1e3 / t_mm)))

    def _generate(self, i: int) -> dict:
        # "decode + augment": fill a batch and normalise it, all torch ops (the GIL is released inside them)
        x = torch.empty(self.numel).uniform_(0, 255)
        x.sub_(127.5).div_(64.0)
        return {"x": x, "y": torch.full((16,), i, dtype=torch.int64)}

    def produce(self, kind: str, i: int) -> dict:
        if kind == "torch":
            a = self.a
            for _ in range(self.produce_mm):
                _mm_unit(a)
        elif kind == "python":
            for _ in range(self.produce_py):
                _py_unit()
        elif kind == "sleep":
            time.sleep(self.produce_sleep)
        return self._generate(i)

    def step(self, batch: dict) -> float:
        x = batch["x"]
        if self.device.type == "cuda":
            x = x if x.is_cuda else x.to(self.device, non_blocking=True)
            g = self.ga
            for _ in range(self.step_units):
                g2 = torch.mm(g, g)
            return float(x[:1024].sum() + g2[0, 0].float())  # syncs: the step ends when the GPU is done
        s = x.sum()
        a = self.a
        for _ in range(self.step_units):
            _mm_unit(a)
        return float(s)


class SyntheticBatches(Dataset):
    """Map-style dataset whose items are whole batches (use with ``batch_size=None``). Records producer time."""

    def __init__(self, work: Work, kind: str, n: int):
        self.work, self.kind, self.n = work, kind, n
        self.produce_s = 0.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        t0 = time.perf_counter()
        out = self.work.produce(self.kind, i)
        self.produce_s += time.perf_counter() - t0
        return out


# ---------------------------------------------------------------------------------------------------------------
# epochs


def _make_loader(name: str, ds: SyntheticBatches, device: torch.device, depth: int):
    cuda = device.type == "cuda"
    if name == "dl0":
        return DataLoader(ds, batch_size=None, num_workers=0)
    if name == "dl2":
        return DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, pin_memory=cuda)
    inner = (
        DataLoader(ds, batch_size=None, num_workers=0)
        if name == "fastdl"
        else DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    )
    return PrefetchLoader(inner, device=device, depth=depth)


def _epoch(loader, work: Work) -> tuple[float, float]:
    """(epoch seconds, summed step seconds)."""
    step_s = 0.0
    t0 = time.perf_counter()
    for batch in loader:
        t1 = time.perf_counter()
        work.step(batch)
        step_s += time.perf_counter() - t1
    return time.perf_counter() - t0, step_s


def _shutdown(loader) -> None:
    if isinstance(loader, PrefetchLoader):
        loader.close()
        loader = loader.loader
    it = getattr(loader, "_iterator", None)  # persistent DataLoader workers
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()


def _run_overlap(args, device: torch.device, work: Work, kind: str) -> list[dict]:
    """Epoch times of every loader. The timed epochs are interleaved round-robin (dl0, dl2, fastdl, ... then
    again), so a change in machine load during the run hits every loader alike. The loader a fastdl configuration
    wraps runs too (its baseline), and dl0 always (the serial totals)."""
    wanted = {"dl0", *args.loaders, *(WRAPS[n] for n in args.loaders if n in WRAPS)}
    order = [n for n in LOADERS if n in wanted]
    sets = {}
    for name in order:
        ds = SyntheticBatches(work, kind, args.batches)
        loader = _make_loader(name, ds, device, args.depth)
        _epoch(loader, work)  # warm-up: workers start, ring allocated, caches warm
        sets[name] = {"ds": ds, "loader": loader, "epochs": [], "steps": [], "prods": [], "waits": [], "copy": []}
    t_start = time.perf_counter()
    try:
        for rep in range(args.repeats):
            activity(f"loader {kind}: repeat {rep + 1} of {args.repeats}")
            for name in order:
                d = sets[name]
                loader = d["loader"]
                d["ds"].produce_s = 0.0
                if isinstance(loader, PrefetchLoader):
                    loader.reset_stats()
                e, s = _epoch(loader, work)
                d["epochs"].append(e)
                d["steps"].append(s)
                d["prods"].append(d["ds"].produce_s)
                if isinstance(loader, PrefetchLoader):
                    st = loader.stats()
                    d["waits"].append(st["wait_s"])
                    d["copy"].append(st["copy_s"])
            say(f"  producer {kind}: timed epoch {rep + 1} of {args.repeats} of every loader done "
                f"({time.perf_counter() - t_start:.0f} s)")
    finally:
        for d in sets.values():
            _shutdown(d["loader"])
    d0 = sets["dl0"]
    serial = (statistics.median(d0["prods"]), statistics.median(d0["steps"]))  # each side alone
    base = statistics.median(d0["epochs"])
    rows = []
    for name in order:
        d = sets[name]
        epoch = statistics.median(d["epochs"])
        row = {
            "name": f"overlap/{kind}/{name}",
            "device": str(device),
            "kind": kind,
            "loader": name,
            "batches": args.batches,
            "produce_ms": args.produce_ms,
            "step_ms": args.step_ms,
            "batch_mb": args.batch_mb,
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "epoch_s": epoch,
            "epoch_s_min": min(d["epochs"]),
            "epoch_s_max": max(d["epochs"]),
            "producer_total_s": serial[0],
            "step_total_s": serial[1],
            "overlap_eff": max(serial) / epoch,
            "speedup_vs_dl0": base / epoch,
            # per-repeat ratio to the dl0 epoch run right before it: robust to slow drifts of the machine load
            "paired_speedup_vs_dl0": statistics.median(b / e for b, e in zip(d0["epochs"], d["epochs"])),
        }
        loader = d["loader"]
        if isinstance(loader, PrefetchLoader):
            row["mode"] = loader.mode
            row["copy_backend"] = loader.copy_backend
            row["wait_s"] = statistics.median(d["waits"])
            row["wait_ms_per_batch"] = 1e3 * row["wait_s"] / args.batches
            row["exposed_pct_of_step"] = 100 * row["wait_s"] / max(serial[1], 1e-9)
            row["copy_s"] = statistics.median(d["copy"])
        rows.append(row)
    return _compare(rows, sets, kind, device)


def _paired(base: list[float], epochs: list[float]) -> float:
    """Median over the repeats of base / epoch, each pair measured in the same round."""
    return statistics.median(b / e for b, e in zip(base, epochs))


def _compare(rows: list[dict], sets: dict, kind: str, device: torch.device) -> list[dict]:
    """Like with like: each fastdl row against the DataLoader it wraps, every row against the fastest PyTorch loader,
    and a ``fastest`` row: the fastest fastdl configuration against the fastest PyTorch one among those the measured
    fastdl configurations wrap (with ``--loaders fastdl+dl2`` alone: dl2, not the dl0 that runs for the totals)."""
    by_name = {r["loader"]: r for r in rows}
    epoch = {n: r["epoch_s"] for n, r in by_name.items()}
    best_any = min((n for n in by_name if n not in WRAPS), key=epoch.__getitem__)
    for r in rows:
        name = r["loader"]
        r["x_best"] = _paired(sets[best_any]["epochs"], sets[name]["epochs"])
        r["best_pytorch"] = best_any
        if name in WRAPS:
            base = WRAPS[name]
            r["baseline"] = base
            r["x_baseline"] = _paired(sets[base]["epochs"], sets[name]["epochs"])
            mark_slower(r, {f"{LABELS[base]}, the loader it wraps": r["x_baseline"]})
    fastdl = [n for n in by_name if n in WRAPS]
    if fastdl:
        best_fd = min(fastdl, key=epoch.__getitem__)
        best_pt = min({WRAPS[n] for n in fastdl}, key=epoch.__getitem__)
        ratio = _paired(sets[best_pt]["epochs"], sets[best_fd]["epochs"])
        f = by_name[best_fd]
        row = {
            "name": f"overlap/{kind}/fastest",
            "device": str(device),
            "kind": kind,
            "loader": "fastest",
            "mode": f.get("mode"),
            "fastest_fastdl": best_fd,
            "baseline": best_pt,
            "x_baseline": ratio,
            "best_pytorch": best_any,
            "x_best": _paired(sets[best_any]["epochs"], sets[best_fd]["epochs"]),
            **{k: f[k] for k in ("batches", "produce_ms", "step_ms", "batch_mb", "threads", "repeats", "epoch_s")},
        }
        # no "; " in the label: it separates the comparisons of a row's note (scripts/bench_tables.py splits on it)
        mark_slower(row, {f"{LABELS[best_pt]} (the fastest PyTorch loader, vs fastdl's fastest: {best_fd})": ratio})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# GPU: host-to-device bandwidth


def _run_h2d(args, device: torch.device) -> list[dict]:
    nbytes = int(args.h2d_mb * 2**20)
    n = args.h2d_batches
    src = torch.randn(nbytes // 4)
    pinned = src.pin_memory()
    dst = torch.empty_like(src, device=device)
    rows = []

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return n * nbytes / (time.perf_counter() - t0) / 1e9

    pageable = timed(lambda: dst.copy_(src))
    raw = timed(lambda: dst.copy_(pinned, non_blocking=True))
    loader = PrefetchLoader([src] * n, device=device, depth=2)
    for _ in loader:  # warm-up: ring allocation and pinning
        pass
    loader.reset_stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _b in loader:
        pass
    torch.cuda.synchronize()
    e2e = n * nbytes / (time.perf_counter() - t0) / 1e9
    st = loader.stats()
    for name, gbps in (
        ("pageable .to()", pageable),
        ("raw pinned copy", raw),
        ("fastdl end-to-end (pageable source)", e2e),
        ("fastdl ring->device copy (device-timed)", st["h2d_gbps"]),
    ):
        rows.append(
            {
                "name": f"h2d/{name}",
                "device": str(device),
                "batch_mb": args.h2d_mb,
                "batches": n,
                "gbps": gbps,
                "pct_of_raw_pinned": 100 * gbps / raw if gbps else None,
                "copy_threads": loader.copy_threads if name.startswith("fastdl") else None,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------------


def run(args) -> list[dict]:
    if args.quick:
        args.batches, args.repeats = min(args.batches, 20), min(args.repeats, 3)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        print_header("loader", str(device))
        env = env_columns(str(device))
        activity("loader: calibrating the work units")
        work = Work(args.produce_ms, args.step_ms, args.batch_mb, device)
        say(
            f"loader bench on {device}: {args.batches} batches of {args.batch_mb} MB, producer {args.produce_ms} ms "
            f"({work.produce_mm} x {_MM}^2 matmul or {work.produce_py} Python units + {1e3 * work.gen_s:.1f} ms "
            f"to generate), step {args.step_ms} ms ({work.step_units} matmuls), torch threads "
            f"{torch.get_num_threads()}, {os.cpu_count()} CPUs, load average {_loadavg()}"
        )
        probe = PrefetchLoader([], device=device, depth=args.depth)
        say(f"fastdl PrefetchLoader: mode {probe.mode}, copy backend {probe.copy_backend}, depth {args.depth}; "
              f"timed epochs interleaved across loaders, {args.repeats} each (median)")
        rows: list[dict] = []
        for kind in args.kinds:
            if over_time(f"the producer kinds from {kind} on"):
                break
            rows += [{**r, **env} for r in _run_overlap(args, device, work, kind)]
        cols = [
            ("kind", "producer"), ("loader", "loader"), ("epoch_s", "epoch s"), ("baseline", "vs"),
            ("x_baseline", "x vs"), ("x_best", "x fastest PyTorch"), ("paired_speedup_vs_dl0", "x dl0"),
            ("overlap_eff", "overlap eff"), ("wait_ms_per_batch", "exposed ms/batch"),
            ("exposed_pct_of_step", "exposed % step"), ("epoch_s_min", "min s"), ("epoch_s_max", "max s"),
        ]
        print_table(rows, cols)
        if rows:
            p, s = rows[0].get("producer_total_s"), rows[0].get("step_total_s")
            print(f"(serial totals of the first kind: producer {p:.2f} s, step {s:.2f} s; ideal epoch = max; each "
                  "fastdl row vs the DataLoader it wraps, paired per round)")
        for r in rows:
            if r["loader"] == "fastest":
                say(f"producer {r['kind']}: fastest fastdl ({r['fastest_fastdl']}, {r['epoch_s']:.3f} s/epoch) vs "
                    f"fastest PyTorch ({LABELS[r['baseline']]}): {r['x_baseline']:.2f}x"
                    + (f"  <<< SLOWER: {r['slower']}" if r["slower"] else ""))
        if device.type == "cuda":
            h2d = _run_h2d(args, device)
            print_table(h2d, [("name", "host-to-device"), ("gbps", "GB/s"), ("pct_of_raw_pinned", "% raw pinned")])
            rows += h2d
        return rows
    finally:
        torch.set_num_threads(prev_threads)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m fastdl.bench.loader", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    rows = run(args)
    if args.csv:
        write_csv(rows, args.csv)
    return rows


if __name__ == "__main__":
    main()
