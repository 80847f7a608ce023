"""Shared pieces of fastdl's microbenchmarks: timing (median of many runs after warm-up, fewer runs for calls slower
than a per-call budget), the run's context (CPU model, ISA level, caps), live tables that print each row as soon as it
is measured and mark loudly every row where fastdl is slower than PyTorch, a time box, a heartbeat, CSV.

Every benchmark times fastdl and its PyTorch baselines in the same process on the same inputs."""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

import torch

from .._machine import llc_bytes  # noqa: F401  (the benchmarks import it from here)
from .memory import dram_read_bandwidth  # noqa: F401  (moved there; still importable from here)

# LLaMA-7B MLP: gate/up projections 4096 -> 11008, down projection 11008 -> 4096
LLAMA_SHAPES = ((4096, 11008), (11008, 4096))
DEFAULT_M = (1, 16, 128, 512)

# A call slower than this is timed with fewer repetitions (and marked so): eager bf16 F.linear at M = 512,
# K = N = 4096 takes ~1.5 s a call on an AVX2-only Zen 2, where 3 warm-up + 10 timed calls would take 20 s.
SLOW_CALL_S = 0.5
# A first call longer than this is the measurement itself (1 run).
VERY_SLOW_CALL_S = 3.0


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- output
class _Watched:
    """sys.stdout wrapper that remembers when something was last written (for the heartbeat)."""

    def __init__(self, stream):
        self._stream = stream
        self.last = time.monotonic()

    def write(self, s):
        self.last = time.monotonic()
        return self._stream.write(s)

    def flush(self):
        return self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


_ACTIVITY = {"what": "", "since": time.monotonic()}
_HEARTBEAT: dict = {}


def activity(what: str) -> None:
    """Name what runs now: the heartbeat names it when nothing has been printed for a while."""
    _ACTIVITY["what"], _ACTIVITY["since"] = what, time.monotonic()


def start_heartbeat(quiet_s: float = 20.0) -> None:
    """From now on, whenever stdout has been silent for ``quiet_s`` seconds, print a line saying what is running and
    for how long (so no command is silent for more than ~``quiet_s`` + 5 s). Idempotent."""
    if _HEARTBEAT.get("thread") is not None:
        return
    out = sys.stdout if isinstance(sys.stdout, _Watched) else _Watched(sys.stdout)
    sys.stdout = out

    def beat():
        while True:
            time.sleep(2.0)
            now = time.monotonic()
            if now - out.last > quiet_s:
                what = _ACTIVITY["what"] or "working"
                print(f"  ... still running: {what} ({now - _ACTIVITY['since']:.0f} s)", flush=True)

    t = threading.Thread(target=beat, name="fastdl-heartbeat", daemon=True)
    t.start()
    _HEARTBEAT["thread"] = t


def say(msg: str = "") -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------------- time box
_DEADLINE: dict = {"t": None}


_STOP = {"stop": False}


def request_stop() -> None:
    """Called on SIGTERM / Ctrl-C: the running benchmark ends after printing its rows, ``bench all`` after it."""
    _STOP["stop"] = True


def stop_requested() -> bool:
    return _STOP["stop"]


def set_deadline(seconds_from_now: float | None) -> None:
    """Time box for the benchmark(s) that run next: ``over_time()`` turns True after it (None: no box)."""
    _DEADLINE["t"] = None if seconds_from_now is None else time.monotonic() + seconds_from_now
    _DEADLINE["told"] = False


def time_left() -> float | None:
    t = _DEADLINE["t"]
    return None if t is None else t - time.monotonic()


def over_time(skipping: str = "") -> bool:
    """True once the time box is spent; says once what is skipped because of it."""
    left = time_left()
    if left is None or left > 0:
        return False
    if not _DEADLINE.get("told"):
        say(f"  time box reached: skipping {skipping or 'the rest'} (the rows above are complete)")
        _DEADLINE["told"] = True
    return True


# ---------------------------------------------------------------------------------------------------- timing
class Seconds(float):
    """Median seconds per call, with how many calls were timed and whether the count was cut for a slow call."""

    reps: int = 0
    reduced: bool = False

    def __new__(cls, value: float, reps: int = 0, reduced: bool = False):
        obj = super().__new__(cls, value)
        obj.reps, obj.reduced = reps, reduced
        return obj


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


def _timed_call(fn, device: str, cold: bool) -> float:
    if cold:
        flush_caches(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_fn(fn: Callable[[], object], device: str = "cpu", warmup: int = 3, min_reps: int = 10,
            max_reps: int = 200, budget_s: float = 1.0, cold: bool = False,
            slow_call_s: float | None = None) -> Seconds:
    """Median seconds per call. The first call is timed as a probe: when it takes longer than ``slow_call_s``
    (default ``SLOW_CALL_S``) the call is a slow baseline and only 2 more calls (1 beyond 4x the budget, none beyond
    ``VERY_SLOW_CALL_S``: the probe is the measurement) are timed (``Seconds.reduced``). Otherwise ``warmup`` calls,
    then at least ``min_reps`` timed calls and more while the time budget lasts (up to ``max_reps``). GPU calls are
    timed with CUDA events. ``cold``: flush the caches before every timed call (``flush_caches``; the flush itself is
    not timed)."""
    slow = SLOW_CALL_S if slow_call_s is None else slow_call_s
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    first = time.perf_counter() - t0
    if first > slow:
        if first > VERY_SLOW_CALL_S:  # the probe is the measurement: warm-up effects are noise at this length
            return Seconds(first, reps=1, reduced=True)
        n = 1 if first > 4 * slow else 2
        times = [_timed_call(fn, device, cold) for _ in range(n)]
        return Seconds(statistics.median(times), reps=n, reduced=True)
    for _ in range(max(0, warmup - 1)):
        fn()
    sync(device)
    times: list[float] = []
    t_start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - t_start < budget_s):
        times.append(_timed_call(fn, device, cold))
    return Seconds(statistics.median(times), reps=len(times))


def interleaved(fns: dict[str, Callable[[], object]], device: str = "cpu", budget_s: float = 1.0, min_reps: int = 5,
                max_reps: int = 200, slow_call_s: float | None = None, before_round=None, block: int = 1,
                cold: bool = False) -> dict[str, Seconds]:
    """Median seconds per call of each function. The first call of each is timed as a probe; a function slower than
    ``slow_call_s`` (default ``SLOW_CALL_S``) is a slow baseline, timed on its own with 1-2 more calls
    (``reduced``); the others are called round robin (every function sees the same machine load), after one more
    warm-up call, for at least ``min_reps`` rounds and more while ``budget_s`` lasts. Each round starts one function
    later than the one before, so every function takes every place in a round equally often: a call right after one
    that allocated and freed large buffers runs slower (allocator and cache state: 8-13% for a 2-layer MLP at M =
    128-256 on a Zen 2), and in a fixed order that cost fell on the same function (the one after the eager baseline)
    every round. ``block`` > 1: each turn of a function is one untimed call (its operands back in the cache) and
    then ``block`` timed calls, so a function whose weights fit the last-level cache is timed warm although the
    others ran in between. ``cold``: flush the caches before every timed call instead (no untimed call)."""
    slow = SLOW_CALL_S if slow_call_s is None else slow_call_s
    first = {name: _timed_call(fn, device, cold) for name, fn in fns.items()}
    out: dict[str, Seconds] = {}
    for name, fn in fns.items():
        if first[name] > VERY_SLOW_CALL_S:
            out[name] = Seconds(first[name], 1, True)
        elif first[name] > slow:
            n = 1 if first[name] > 4 * slow else 2
            out[name] = Seconds(statistics.median([_timed_call(fn, device, cold) for _ in range(n)]), n, True)
    fast = {k: v for k, v in fns.items() if k not in out}
    for fn in fast.values():
        fn()
    sync(device)
    times: dict[str, list[float]] = {k: [] for k in fast}
    start = time.perf_counter()
    reps = 0
    order = list(fast.items())
    while fast and reps < max_reps and (reps < min_reps or time.perf_counter() - start < budget_s):
        if before_round is not None:
            before_round(reps)
        shift = reps % len(order)
        for name, fn in order[shift:] + order[:shift]:
            if block > 1 and not cold:
                fn()
            for _ in range(block):
                times[name].append(_timed_call(fn, device, cold))
        reps += 1
    for k, v in times.items():
        out[k] = Seconds(statistics.median(v), reps=len(v))
    return {k: out[k] for k in fns}


class CallPredictor:
    """Skips a call predicted to take longer than ``max_call_s``: the time of the same provider at a smaller shape of
    the same kind, scaled by the work (flops). Slow baselines (PyTorch's bf16 on AVX2: a 4096 x 4096 training step at
    M = 128 took 24 s a call capped on the Zen 4) would otherwise take a quick run's whole time box; a skipped one is
    said, with its prediction."""

    def __init__(self, max_call_s: float):
        self.max_call_s = max_call_s
        self.seen: dict = {}

    def predict(self, key, work: float) -> float | None:
        """Seconds predicted for ``work``; None without a previous shape at least 1/8 of it (from M = 1, where a call
        is bound by reading the weight, scaling by the work would overestimate a call at M = 16)."""
        prev = self.seen.get(key)
        if prev is None or prev[0] <= 0 or prev[0] * 8 < work:
            return None
        return prev[1] * work / prev[0]

    def allowed(self, key, work: float) -> tuple[bool, float | None]:
        p = self.predict(key, work)
        return (p is None or p <= self.max_call_s), p

    def record(self, key, work: float, seconds: float) -> None:
        prev = self.seen.get(key)
        if prev is None or work >= prev[0]:
            self.seen[key] = (work, float(seconds))


_PEAK_CACHE: dict = {}


def measured_matmul_peak(device: str, dtype: torch.dtype = torch.bfloat16, *more: torch.dtype) -> float:
    """FLOP/s of a large square ``torch.mm`` in ``dtype`` here (the fastest of ``dtype`` and ``more``): the "peak"
    that % columns refer to. On a CPU without a fast path for a dtype (bf16 on AVX2) the problem is 512^3 so that
    measuring the slow path stays short. Measured once per device and dtype."""
    if more:
        return max(measured_matmul_peak(device, d) for d in (dtype, *more))
    key = (device, dtype)
    if key not in _PEAK_CACHE:
        activity("measuring the matmul peak")
        n = 8192 if device.startswith("cuda") else 2048
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        t0 = time.perf_counter()
        torch.mm(a[:512, :512], b[:512, :512])
        if not device.startswith("cuda") and time.perf_counter() - t0 > 0.005:  # 512^3 at < 54 GFLOP/s: slow path
            a, b, n = a[:512, :512].contiguous(), b[:512, :512].contiguous(), 512
        t = time_fn(lambda: torch.mm(a, b), device, warmup=2, min_reps=5, budget_s=1.0)
        _PEAK_CACHE[key] = 2 * n**3 / t
    return _PEAK_CACHE[key]


# ---------------------------------------------------------------------------------------------------- context
def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    from .._extension import cpu_info

    return f"{cpu_info()['model']} ({torch.get_num_threads()} threads)"


_CTX: dict = {}


def context() -> dict:
    """The run's context (``isa.run_context()``), computed once per process."""
    if "ctx" not in _CTX:
        from .isa import run_context

        _CTX["ctx"] = run_context()
    return _CTX["ctx"]


def env_columns(device: str) -> dict:
    """Columns every CSV row carries: versions, threads, device, CPU model, ISA level, whether it was capped, PyTorch's
    ATen capability, and a time stamp."""
    from .._info import env_summary

    d = env_summary()
    d.pop("host", None)
    d["device_name"] = device_name(device)
    ctx = context()
    d["cpu_model"] = ctx["cpu_model"]
    d["isa_level"] = ctx["isa_level"]
    d["isa_capped"] = ctx["isa_capped"]
    d["cpu_detected_level"] = ctx["detected_level"]
    d["pytorch_aten_isa"] = ctx["pytorch"]["aten"]
    d["pytorch_onednn_bf16"] = ctx["pytorch"]["onednn_bf16"]
    d["load_average"] = load_average()
    d["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return d


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def busy_warning() -> str:
    """A warning when the machine is busy: on a shared machine with few cores, a multi-threaded call waits for its
    OpenMP barrier until the scheduler runs the other thread (seen here: a 64-element F.gelu took 20 ms at load 7 on
    2 cores with 2 threads, 11 us with 1), so ratios measured then say more about the load than about kernels."""
    la, n = load_average(), os.cpu_count() or 1
    if la is not None and la > 1.5 * n:
        return (f"the machine is busy (load average {la:.1f} on {n} CPUs): multi-threaded calls wait for the "
                "scheduler, timings are unreliable; re-run when it is idle")
    return ""


def print_header(name: str, device: str = "cpu", extra: str = "") -> dict:
    """The first lines of every benchmark: what runs, on which CPU, at which ISA level (capped or not), PyTorch's
    levels, and any mismatch between the caps of fastdl and PyTorch."""
    from .isa import describe

    ctx = context()
    say(f"== fastdl bench {name}: {describe(ctx)}")
    say("   fastdl CPU kernels: " + ", ".join(f"{k} {v}" for k, v in ctx["kernels"].items()))
    if device.startswith("cuda"):
        say(f"   device: {device_name(device)}")
    if ctx["isa_capped"]:
        say("   (capped run: instructions are removed, not the bigger CPU's caches, bandwidth or clock)")
    for w in ctx["warnings"]:
        say(f"   WARNING: {w}")
    busy = busy_warning()
    if busy:
        say(f"   WARNING: {busy}")
    if extra:
        say(f"   {extra}")
    return ctx


# ---------------------------------------------------------------------------------------------------- tables
def fmt_value(v) -> str:
    if v is None or v == "":
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def mark_slower(row: dict, ratios: dict[str, float | None]) -> str:
    """Record in ``row`` every ratio below 1.0 (fastdl slower than that PyTorch path), as row["slower"] (text) and
    row["slower_than_pytorch"] (bool); returns the text ('' when fastdl is at least as fast as each)."""
    parts = []
    for label, r in ratios.items():
        if r is not None and r < 1.0:
            parts.append(f"{r:.2f}x {label}" + (" (within 5%: may be noise)" if r >= 0.95 else ""))
    row["slower"] = "; ".join(parts)
    row["slower_than_pytorch"] = bool(parts)
    return row["slower"]


class LiveTable:
    """A table printed row by row as the rows are measured (fixed column widths, header on the first row), with the
    seconds since the table started, a ``*`` after the time of a row timed with fewer runs (slow call), and a loud
    ``<<< SLOWER`` marker on rows where fastdl is slower than a PyTorch path (``mark_slower``). ``close()`` lists those
    rows again at the end."""

    def __init__(self, columns: list[tuple], title: str = ""):
        # columns: (key, header) or (key, header, width)
        self.columns = [(c[0], c[1], c[2] if len(c) > 2 else max(len(c[1]), 7)) for c in columns]
        self.title = title
        self.rows: list[dict] = []
        self.t0 = time.monotonic()
        self._printed_header = False

    def header(self) -> None:
        if not self._printed_header:
            if self.title:
                say(self.title)
            say("  ".join(h.rjust(w) for _, h, w in self.columns) + "  elapsed")
            self._printed_header = True

    def add(self, row: dict) -> dict:
        self.header()
        cells = []
        for key, _, w in self.columns:
            v = fmt_value(row.get(key))
            if key in ("ms", "s") and row.get("reduced"):
                v += "*"
            cells.append(v.rjust(w))
        line = "  ".join(cells) + f"  {time.monotonic() - self.t0:6.0f}s"
        if row.get("slower"):
            line += f"   <<< SLOWER: {row['slower']}"
        say(line)
        self.rows.append(row)
        return row

    def note_reduced(self) -> None:
        if any(r.get("reduced") for r in self.rows):
            say(f"  * a call took > {SLOW_CALL_S} s: timed with 1-2 runs instead of many (a slow baseline)")

    def close(self, what: str = "fastdl", baseline: str = "PyTorch") -> list[dict]:
        """Print the closing line(s); returns the slower rows."""
        self.note_reduced()
        slower = [r for r in self.rows if r.get("slower")]
        ctx = context()
        where = f"{ctx['isa_level']}{' capped' if ctx['isa_capped'] else ''} on {ctx['cpu_model']}"
        n = sum(1 for r in self.rows if "slower" in r)
        if slower:
            say(f"!! {what} is SLOWER than {baseline} in {len(slower)} of {n} measurements ({where}):")
            for r in slower:
                say(f"!!   {describe_row(r)}: {r['slower']}")
        elif n:
            say(f"{what} is at least as fast as {baseline} in all {n} measurements ({where}).")
        return slower

    def finish(self, what: str, baseline: str, csv_path: str | None, more_rows: list[dict] = ()) -> list[dict]:
        """The end of a benchmark's ``run``: ``close`` the table, write its rows (and ``more_rows``, measured apart)
        to ``csv_path`` when one is given; returns those rows."""
        self.close(what, baseline)
        rows = self.rows + list(more_rows)
        if csv_path:
            write_csv(rows, csv_path)
        return rows


# The last columns of a float GEMM benchmark's table (fused_linear, sparse24): speed-ups over the fp32 baseline and
# the best other provider, GFLOP/s, % of the matmul peak, weight bytes read per second.
GEMM_RATE_COLUMNS = [("x_fp32", "x fp32", 6), ("x_best", "x best", 6), ("gflops", "GFLOP/s", 7),
                     ("pct_peak", "% peak", 6), ("weight_gbps", "W GB/s", 6)]  # fmt: skip


def describe_row(r: dict) -> str:
    parts = [str(r[k]) for k in ("op", "bench", "model", "mode", "module", "grad", "policy", "provider") if r.get(k)]
    shape = " ".join(f"{k}={r[k]}" for k in ("M", "K", "N", "batch", "seq") if r.get(k) is not None)
    return " ".join(parts + ([shape] if shape else []))


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
    say(f"wrote {len(rows)} rows to {path}")


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """columns: (key, header). Floats print with 3 significant digits."""
    cells = [[fmt_value(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h) in enumerate(columns)]
    say("  ".join(h.rjust(w) for (_, h), w in zip(columns, widths)))
    for c in cells:
        say("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def progress(iterable, total: int | None = None, desc: str = ""):
    """tqdm progress bar on stderr when tqdm is installed and stderr is a terminal, else the plain iterable."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None)


def add_shape_arguments(p: argparse.ArgumentParser, llama_default: str) -> None:
    """--device, --m, --kn and --llama-m, shared by the GEMM benchmarks; read back with :func:`gemm_shapes`."""
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--m", type=int, nargs="+", default=None,
                   help="batch sizes (rows of x) for K = N = 4096; default " + " ".join(map(str, DEFAULT_M)))
    p.add_argument("--kn", type=int, nargs=2, action="append", default=None, metavar=("K", "N"),
                   help="in/out features instead of the defaults (repeatable)")
    p.add_argument("--llama-m", type=int, nargs="*", default=None,
                   help=f"M for the LLaMA-7B MLP shapes (default: {llama_default}; give no value to skip them)")


def gemm_shapes(args, cpu_llama_m: list[int], cuda_llama_m: list[int]) -> list[tuple[int, int, int]]:
    """(M, K, N) to time from :func:`add_shape_arguments`' options: --kn x --m, or K = N = 4096 x --m plus the
    LLaMA-7B MLP shapes x --llama-m (``cpu_llama_m`` / ``cuda_llama_m`` when not given)."""
    ms = args.m or list(DEFAULT_M)
    if args.kn:
        return [(m, k, n) for k, n in args.kn for m in ms]
    out = [(m, 4096, 4096) for m in ms]
    if args.llama_m is not None:
        llama_m = args.llama_m
    else:
        llama_m = cuda_llama_m if args.device.startswith("cuda") else cpu_llama_m
    out += [(m, k, n) for k, n in LLAMA_SHAPES for m in llama_m]
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (said once) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def module_main(prog: str, doc: str | None, add_arguments: Callable, run: Callable, argv: list[str] | None = None):
    """The ``python -m fastdl.bench.<name>`` (or demo) entry point: the module's options, parsed, then its run."""
    p = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))
