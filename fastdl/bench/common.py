"""Shared pieces of fastdl's microbenchmarks: timing (median of many runs after warm-up), a measured peak, tables,
CSV. Every benchmark times fastdl and its PyTorch baseline in the same process on the same inputs."""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


_FLUSH: dict = {}


def flush_caches(device: str) -> None:
    """Evict the last-level cache by writing a buffer larger than it (64 MiB on the CPU: the development machine has
    32 MiB of L3; 256 MiB on a GPU, as ``triton.testing.do_bench`` does), so the next call reads its operands from
    DRAM - as a layer of a model whose weights exceed the cache does."""
    buf = _FLUSH.get(device)
    if buf is None:
        n = (256 if device.startswith("cuda") else 64) << 20
        buf = _FLUSH[device] = torch.empty(n, dtype=torch.uint8, device=device)
    buf.zero_()
    sync(device)


def time_fn(fn: Callable[[], object], device: str = "cpu", warmup: int = 3, min_reps: int = 10,
            max_reps: int = 200, budget_s: float = 1.0, cold: bool = False) -> float:
    """Median seconds per call. Runs ``warmup`` calls, then at least ``min_reps`` timed calls and more while the
    time budget lasts (up to ``max_reps``). GPU calls are timed with CUDA events. ``cold``: flush the caches before
    every timed call (``flush_caches``; the flush itself is not timed)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times: list[float] = []
    t_start = time.perf_counter()
    if device.startswith("cuda"):
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < budget_s):
            if cold:
                flush_caches(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < budget_s):
            if cold:
                flush_caches(device)
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


_PEAK_CACHE: dict = {}


def measured_matmul_peak(device: str, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a large square ``torch.mm`` in ``dtype`` here: the "peak" that % columns refer to."""
    key = (device, dtype)
    if key not in _PEAK_CACHE:
        n = 8192 if device.startswith("cuda") else 2048
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t = time_fn(lambda: torch.mm(a, b), device, warmup=2, min_reps=5, budget_s=1.0)
        _PEAK_CACHE[key] = 2 * n**3 / t
    return _PEAK_CACHE[key]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model or 'CPU'} ({torch.get_num_threads()} threads)"


def env_columns(device: str) -> dict:
    from .._info import env_summary

    d = env_summary()
    d.pop("host", None)
    d["device_name"] = device_name(device)
    d["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return d


def write_csv(rows: list[dict], path: str) -> None:
    if not rows:
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {path}")


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, header). Floats print with 3 significant digits."""

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h), w in zip(columns, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def progress(iterable, total: int | None = None, desc: str = ""):
    """tqdm progress bar when tqdm is installed and stderr is a terminal, else the plain iterable."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None)
