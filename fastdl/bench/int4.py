"""``fastdl bench int4``: int4 weight-only and W4A8 linear layers against PyTorch, weights cold as in a model's decode.

A language model's decode streams every layer's weights from DRAM once per token, so a single layer timed in a loop
(its weights staying in the last-level cache) overstates its speed. Here every provider rotates over enough
independent copies of its weights that together they exceed ``--llc-multiple`` (3) times the last-level cache, and
calls the next copy each time: every call reads its weights from DRAM (the activations x stay the same). The
providers are interleaved in rounds (each round calls every provider once, in an order rotated from round to round)
and the medians are reported. The memory's read bandwidth is measured once (``dram_read_bandwidth``: ``torch.sum``
of a buffer far larger than the cache) and every row says which share of it the call reaches.

Providers (inference forward, no bias; the fastdl int4 rows in float32 and in bfloat16 x unless ``--x-dtype`` names
one; the bfloat16 ones end in ``_bf16``):
  fp32              eager ``F.linear`` in float32 (x repl: every ratio refers to it)
  bf16              eager ``F.linear`` in bfloat16 (bf16 x and weight)
  aten_int4_g*      ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (what torchao's ``Int4CPULayout`` calls) on the same
                    int4 codes and scales, groups of 32 / 128 (each fastdl int4 row is compared with ATen at its own
                    group size), at its best activation dtype: float32 and bfloat16 are both tried on each shape
                    and the faster is timed (column x: which); a dtype more than 3x slower at a smaller M of the
                    same K x N is not tried again
  fastdl_int8_wo    ``fastdl.ops.int8_weight_only_linear``, int8 weights with a float32 scale per output channel (x in
                    the first of the fastdl dtypes: float32 by default)
  fastdl_int4_g*    ``fastdl.ops.int4_weight_only_linear``, groups of 32 / 128 (float activations)
  fastdl_w4a8_g*    ``fastdl.ops.int4_a8_linear``: the same weights, x quantized to int8 per row and group inside

Weights are ``quantize_int4(w, g, "rtn")`` of one Gaussian ``w``; ATen's op gets the same codes (``w = (q - 8) *
scale``: its scales_and_zeros ``[K / g, N, 2]`` hold the scale and a zero of 0, in the activation dtype). A provider's
copies are capped at ``--max-mb`` (1024) MB in all (at least 2 copies): column ``x LLC`` gives the copies' bytes over
the last-level cache, and a row whose copies did not exceed the cache says so (``not cold``).

Columns: copies (weight copies rotated), ms (median; ``*``: a slow call timed 1-2 times), GB/s (weight + scale bytes
read per call / time), % DRAM (of the measured read bandwidth), x repl (eager fp32 time / time), x int8 (fastdl int8
weight-only time / time), x aten (ATen int4 at the row's group size: its time / time), bar (int4 rows: issue 29's
bars; at M = 1: >= 1.7x (g128) / 1.5x (g32) int8 weight-only, >= 6x eager fp32, >= 3x ATen int4, >= 80 % of the
DRAM bandwidth; at larger M: never slower than the faster of int8 weight-only and eager ``F.linear`` in the row's
activation dtype). Like with like: every int4 row slower than eager ``F.linear`` in its own activation dtype (a
float32 row against float32, a bfloat16 row against bfloat16: the precision a user keeps) or than ATen's int4 op at
its group size (at that op's faster dtype: its float32 path is ~30x slower) is marked ``<<< SLOWER``; the fastest
configuration of each shows in the bfloat16 rows on CPUs where bfloat16 is the fast dtype (AVX512_BF16) and in the
float32 rows elsewhere.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from .. import ops
from ..ops.int4 import unpack_int4
from .common import (
    CallPredictor,
    LiveTable,
    activity,
    dram_read_bandwidth,
    env_columns,
    interleaved,
    llc_bytes,
    mark_slower,
    module_main,
    over_time,
    print_header,
    say,
)

DEFAULT_M = (1, 4, 16, 128, 512)
DEFAULT_KN = ((4096, 4096), (4096, 11008), (11008, 4096))
QUICK_M = (1, 16, 128)
QUICK_KN = ((4096, 4096), (4096, 11008))
QUICK_ARGS = ["--quick"]
ALL_ARGS = ["--quick", "--budget", "0.25"]
GROUPS = (32, 128)
ATEN_GROUP = 128  # issue 29's bars were set against ATen at groups of 128
# A dtype of ATen's op this many times slower than the other at a smaller M is not tried again at larger M (its
# float32 path dequantizes per row: 33 ms at M = 1, 3.7 s at M = 128 on 4096 x 4096, Zen 3).
ATEN_GIVE_UP = 3.0
# issue 29's bars at M = 1: minimum ratio vs fastdl int8 weight-only per group size, vs eager fp32, vs ATen; % DRAM
BAR_X_INT8 = {128: 1.7, 32: 1.5}
BAR_X_FP32 = 6.0
BAR_X_ATEN = 3.0
BAR_PCT_DRAM = 80.0
MAX_COPIES = 4096
_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
X_DTYPES = {"float32": (torch.float32,), "bfloat16": (torch.bfloat16,), "both": (torch.float32, torch.bfloat16)}
_SUFFIX = {torch.float32: "", torch.bfloat16: "_bf16"}  # fastdl int4 row names by activation dtype


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu (the only device this benchmark runs on)")
    p.add_argument("--m", type=int, nargs="+", default=None,
                   help="rows of x (default " + " ".join(map(str, DEFAULT_M)) + "; --quick: "
                        + " ".join(map(str, QUICK_M)) + ")")  # fmt: skip
    p.add_argument("--kn", type=int, nargs=2, action="append", default=None, metavar=("K", "N"),
                   help="in/out features (repeatable; default " + ", ".join(f"{k}x{n}" for k, n in DEFAULT_KN)
                        + "; --quick: " + ", ".join(f"{k}x{n}" for k, n in QUICK_KN) + ")")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes (M 1 16 128 on 4096x4096 and 4096x11008), a shorter budget (0.1 s of rounds per "
                        "provider), calls predicted over 1 s skipped")  # fmt: skip
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timed rounds per provider and shape (default 1.0; 0.1 with --quick)")
    p.add_argument("--min-rounds", type=int, default=5, help="timed rounds at least (default 5)")
    p.add_argument("--max-call-s", type=float, default=None,
                   help="skip a provider predicted (from a smaller M) to take longer than this per call (default 3; "
                        "1 with --quick)")  # fmt: skip
    p.add_argument("--x-dtype", choices=("float32", "bfloat16", "both"), default="both",
                   help="activation dtype of the fastdl int4 rows (default both: float32 rows and _bf16 rows)")
    p.add_argument("--llc-multiple", type=float, default=3.0,
                   help="a provider's weight copies together exceed this many times the last-level cache (default 3)")
    p.add_argument("--llc-mb", type=float, default=None,
                   help="the last-level cache in MiB (default: read from sysfs, 32 when unknown)")
    p.add_argument("--max-mb", type=float, default=1024.0,
                   help="cap on the weight copies of one provider, in MB (default 1024; at least 2 copies)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="DRAM read bandwidth in GB/s instead of measuring it")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


# ---------------------------------------------------------------------------------------------------- rotation
def copies_for(nbytes: int, llc: int, multiple: float = 3.0, cap_bytes: float = 1 << 30) -> int:
    """How many copies of a weight of ``nbytes`` to rotate over: enough that together they exceed ``multiple`` x the
    last-level cache ``llc``, but no more than fit in ``cap_bytes``, and never fewer than 2."""
    want = math.floor(multiple * llc / max(nbytes, 1)) + 1
    fit = int(cap_bytes // max(nbytes, 1))
    return max(2, min(want, fit, MAX_COPIES))


class Rotation:
    """A callable that calls ``fn(*copies[i])`` with the next copy each time (round robin). Rotations over the same
    copies share ``pos`` (a one-element list), so that one does not read a copy another has just read."""

    def __init__(self, fn, copies: list[tuple], pos: list[int] | None = None):
        self.fn, self.copies, self.pos = fn, copies, [0] if pos is None else pos

    def __call__(self):
        i = self.pos[0]
        self.pos[0] = (i + 1) % len(self.copies)
        return self.fn(*self.copies[i])


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _clones(ts: tuple, n: int) -> list[tuple]:
    """``n`` independent copies of the tensors ``ts`` (the first is ``ts`` itself)."""
    return [ts] + [tuple(None if t is None else t.clone() for t in ts) for _ in range(n - 1)]


def _aten_available() -> str | None:
    for name in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"):
        if not hasattr(torch.ops.aten, name):
            return f"torch {torch.__version__} has no aten.{name}"
    return None


class Weights:
    """Every provider's weight copies for one K x N: name -> (rotation args list, bytes per call, activation dtype)."""

    def __init__(self, K: int, N: int, args, llc: int, notes: set[str]):
        cap = args.max_mb * 1e6
        torch.manual_seed(0)
        w = torch.randn(N, K) / K**0.5
        self.providers: dict[str, dict] = {}
        # dtype -> x, set per M (set_x) and read by the providers at call time; they hold this dict, not self (no
        # reference cycle: the copies are freed as soon as the benchmark drops this object)
        self.x = xs = {}

        def add(name, fn, ts, xdtype):
            per = _nbytes(*ts)
            n = copies_for(per, llc, args.llc_multiple, cap)
            self.providers[name] = {"rot": Rotation(fn, _clones(ts, n)), "bytes": per, "copies": n, "x": xdtype}

        xds = X_DTYPES[args.x_dtype]
        xd = xds[0]
        add("fp32", lambda wt: F.linear(xs[torch.float32], wt), (w,), torch.float32)
        add("bf16", lambda wt: F.linear(xs[torch.bfloat16], wt), (w.to(torch.bfloat16),), torch.bfloat16)
        w_q, w_s = ops.quantize_per_channel(w)
        add("fastdl_int8_wo", lambda q, s: ops.int8_weight_only_linear(xs[xd], q, s, None, None), (w_q, w_s), xd)
        self.aten: dict[int, dict[str, Rotation]] = {}  # group size -> activation dtype name -> calls
        why = _aten_available()
        for g in GROUPS:
            qw, sc, zp = ops.quantize_int4(w, g, "rtn")
            for dt in xds:
                sfx = _SUFFIX[dt]
                add(f"fastdl_int4_g{g}{sfx}",
                    lambda q, s, z, g=g, dt=dt: ops.int4_weight_only_linear(xs[dt], q, s, z, None, g), (qw, sc, zp), dt)
                add(f"fastdl_w4a8_g{g}{sfx}",
                    lambda q, s, z, g=g, dt=dt: ops.int4_a8_linear(xs[dt], q, s, z, None, g), (qw, sc, zp), dt)
            if why is None:
                try:
                    self._add_aten(qw, sc, zp, K, N, g, llc, args, cap)
                except Exception as exc:  # an ATen build without the CPU kernel: the row is skipped, said why
                    why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            notes.add(f"aten_int4 skipped: {why}")

    def _add_aten(self, qw, sc, zp, K, N, g, llc, args, cap):
        u = unpack_int4(qw, K).to(torch.int32).contiguous()
        if zp is not None:  # asymmetric: w = (u - z) * s = (u - 8) * s + (8 - z) * s
            zero = (8.0 - zp.float()) * sc.float()
        else:
            zero = torch.zeros(N, K // g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 8)
        sz = {dt: torch.stack([sc.float().t(), zero.t()], dim=2).to(dt).contiguous()
              for dt in (torch.float32, torch.bfloat16)}  # fmt: skip
        per = _nbytes(packed, sz[torch.bfloat16])
        # copies sized by the larger (fp32) scales: the activation dtype is chosen later (a probe), and either must keep
        # the copies within the cap
        n = copies_for(_nbytes(packed, sz[torch.float32]), llc, args.llc_multiple, cap)
        copies = _clones((packed, sz[torch.float32], sz[torch.bfloat16]), n)
        mm, xs = torch.ops.aten._weight_int4pack_mm_for_cpu, self.x
        pos = [0]  # one rotation for both dtypes (the packed codes are shared)
        fns = self.aten[g] = {}
        for i, dt in ((2, torch.bfloat16), (1, torch.float32)):  # bf16 first: the cheaper probe on most CPUs
            fns[_NAMES[dt]] = Rotation(lambda *c, dt=dt, i=i: mm(xs[dt], c[0], g, c[i]), copies, pos)
        name = f"aten_int4_g{g}"
        self.providers[name] = {"rot": None, "bytes": per, "copies": n, "x": None,
                                "bytes_by_dtype": {dt: _nbytes(packed, sz[dt]) for dt in sz}}  # fmt: skip

    def set_x(self, M: int, K: int) -> None:
        x = torch.randn(M, K)
        self.x.clear()
        self.x.update({torch.float32: x, torch.bfloat16: x.to(torch.bfloat16)})


# ---------------------------------------------------------------------------------------------------- ATen dtype
def _probe(fn) -> float:
    """Seconds of one call (a cold copy: the rotation moves on); the better of two when the first is short."""
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    if t < 0.1:
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def pick_aten_dtype(fns: dict[str, object], M: int, history: dict, predictor: CallPredictor, work: float,
                    max_call_s: float) -> tuple[str | None, str]:
    """The faster activation dtype of ATen's int4 op at this M (its name, and a note saying how it was chosen).
    ``history``: dtype -> (M, slowdown vs the other dtype) seen at smaller M of the same K x N; a dtype that was more
    than ``ATEN_GIVE_UP`` times slower there, or is predicted over ``max_call_s``, is not tried."""
    times, skipped = {}, []
    for dt, fn in fns.items():
        seen = history.get(dt)
        if seen is not None and seen[1] > ATEN_GIVE_UP and len(fns) > 1:
            skipped.append(f"{dt} not tried ({seen[1]:.1f}x slower at M={seen[0]})")
            continue
        ok, pred = predictor.allowed(("aten", dt), work)
        if not ok:
            skipped.append(f"{dt} not tried (predicted {pred:.1f} s a call)")
            predictor.record(("aten", dt), work, pred)
            continue
        times[dt] = _probe(fn)
        predictor.record(("aten", dt), work, times[dt])
    if not times:
        return None, "; ".join(skipped)
    best = min(times, key=times.get)
    for dt, t in times.items():
        if dt != best:
            history[dt] = (M, t / times[best])
            skipped.append(f"{dt} {t / times[best]:.1f}x slower")
    return best, f"{best}" + (f" ({'; '.join(skipped)})" if skipped else "")


# ---------------------------------------------------------------------------------------------------- judging
def _bar(row: dict, times: dict, M: int) -> None:
    """issue 29's bars for an int4 row: row["bar"] "met" / "MISSED", row["bar_missed"] the reasons."""
    t = times[row["provider"]]
    missed = []
    if M == 1:
        g = row["group_size"]
        checks = [("x_int8", BAR_X_INT8.get(g), "fastdl int8 weight-only"), ("x_replaced", BAR_X_FP32, "eager fp32"),
                  ("x_aten", BAR_X_ATEN, "ATen int4")]  # fmt: skip
        for key, bar, label in checks:
            if bar is not None and row.get(key) is not None and row[key] < bar:
                missed.append(f"{row[key]:.2f}x {label} < {bar}x")
        if row["pct_dram"] < BAR_PCT_DRAM:
            missed.append(f"{row['pct_dram']:.0f} % of DRAM bandwidth < {BAR_PCT_DRAM:.0f} %")
    else:
        eager = row["x_dtype"]  # the eager F.linear row of the row's activation dtype has its short name
        peers = {k: times[k] for k in ("fastdl_int8_wo", eager) if k in times}
        if peers:
            best = min(peers, key=peers.get)
            if t > peers[best]:
                missed.append(f"{peers[best] / t:.2f}x {best} (the faster of int8 weight-only and eager "
                              f"{row['x_dtype']})")  # fmt: skip
    row["bar"] = "MISSED" if missed else "met"
    row["bar_missed"] = "; ".join(missed)


def _judge(row: dict, times: dict) -> None:
    """Like with like: the row against eager F.linear in its own activation dtype and against ATen's int4 op."""
    t = times[row["provider"]]
    torch_t = {k: times[k] for k in (row["x_dtype"], _aten_for(row["group_size"])) if k in times}
    if not torch_t:
        return
    best = min(torch_t, key=torch_t.get)
    row["best_pytorch"] = best
    row["x_best"] = torch_t[best] / t
    labels = {"fp32": "eager fp32 F.linear", "bf16": "eager bf16 F.linear"}
    mark_slower(row, {labels.get(k, f"ATen int4 g{row['group_size']}"): v / t for k, v in torch_t.items()})


def _aten_for(group: int | None) -> str:
    """ATen's int4 row a fastdl row is compared with: the same group size (groups of 128 for the int8 rows)."""
    return f"aten_int4_g{group or ATEN_GROUP}"


COLUMNS = [("M", "M", 4), ("K", "K", 5), ("N", "N", 5), ("provider", "provider", 16), ("x_dtype", "x", 4),
           ("copies", "copies", 6), ("x_llc", "x LLC", 5), ("ms", "ms", 8), ("gbps", "GB/s", 5),
           ("pct_dram", "% DRAM", 6), ("x_replaced", "x repl", 6), ("x_int8", "x int8", 6), ("x_aten", "x aten", 6),
           ("bar", "bar", 6), ("note", "note", 4)]  # fmt: skip


def _short(dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def _shapes(args) -> list[tuple[int, int, list[int]]]:
    ms = args.m or list(QUICK_M if args.quick else DEFAULT_M)
    kns = args.kn or list(QUICK_KN if args.quick else DEFAULT_KN)
    return [(k, n, ms) for k, n in kns]


def run(args) -> list[dict]:
    if not str(args.device).startswith("cpu"):
        say(f"== fastdl bench int4: CPU only (ATen's int4 op, the last-level cache and the DRAM bandwidth are the "
            f"CPU's); --device {args.device} skipped")  # fmt: skip
        return []
    budget = args.budget if args.budget is not None else (0.1 if args.quick else 1.0)
    max_call_s = args.max_call_s if args.max_call_s is not None else (1.0 if args.quick else 3.0)
    print_header("int4", "cpu")
    env = env_columns("cpu")
    notes: set[str] = set()
    llc = int(args.llc_mb * (1 << 20)) if args.llc_mb else llc_bytes()
    if not llc:
        llc = 32 << 20
        notes.add("the last-level cache size is unknown here (no sysfs): 32 MiB assumed (--llc-mb)")
    if args.bandwidth:
        dram, how = float(args.bandwidth), "given (--bandwidth)"
    else:
        activity("measuring the DRAM read bandwidth")
        dram, how = dram_read_bandwidth(), f"torch.sum of a buffer >> the cache, {torch.get_num_threads()} threads"
    say(f"   DRAM read bandwidth {dram:.1f} GB/s ({how}); last-level cache {llc / (1 << 20):.3g} MiB; weights cold: "
        f"each provider rotates over copies > {args.llc_multiple:g}x the cache (at most {args.max_mb:.4g} MB, at "
        f"least 2 copies); x {args.x_dtype} for the fastdl int4 rows")  # fmt: skip
    table = LiveTable(COLUMNS)
    predictor = CallPredictor(max_call_s)
    shapes = _shapes(args)
    n_total = sum(len(ms) for _, _, ms in shapes)
    done = 0
    try:
        with torch.no_grad():
            for K, N, ms in shapes:
                if over_time(f"{n_total - done} of {n_total} shapes"):
                    break
                activity(f"int4 weights K={K} N={N}")
                t0 = time.perf_counter()
                weights = Weights(K, N, args, llc, notes)
                say(f"   K={K} N={N}: weight copies made in {time.perf_counter() - t0:.1f} s")
                history: dict = {}
                for M in ms:
                    if over_time(f"{n_total - done} of {n_total} shapes"):
                        break
                    done += 1
                    activity(f"int4 M={M} K={K} N={N}")
                    try:
                        table_rows = _measure(M, K, N, weights, args, budget, max_call_s, predictor, history, dram,
                                              llc, env, notes)  # fmt: skip
                    except Exception as exc:  # one shape that fails does not lose the others' rows
                        say(f"!! M={M} K={K} N={N} FAILED: {type(exc).__name__}: {exc}")
                        continue
                    for row in table_rows:
                        table.add(row)
                del weights
    except KeyboardInterrupt:
        say("  interrupted: the rows above are complete")
    for note in sorted(notes):
        say(f"note: {note}")
    missed = [r for r in table.rows if r.get("bar") == "MISSED"]
    if missed:
        say(f"!! issue 29 bars MISSED in {len(missed)} of {sum(1 for r in table.rows if 'bar' in r)} int4 rows:")
        for r in missed:
            say(f"!!   {r['provider']} M={r['M']} K={r['K']} N={r['N']}: {r['bar_missed']}")
    elif any("bar" in r for r in table.rows):
        say("issue 29 bars met in every int4 row")
    return table.finish("fastdl int4", "PyTorch", args.csv)


def _measure(M, K, N, weights: Weights, args, budget, max_call_s, predictor, history, dram, llc, env, notes):
    weights.set_x(M, K)
    work = float(M) * K * N
    calls, meta = {}, {}
    for name, p in weights.providers.items():
        if name.startswith("aten"):
            g = int(name.rsplit("_g", 1)[1])
            dt, how = pick_aten_dtype(weights.aten[g], M, history.setdefault(g, {}), predictor, work, max_call_s)
            if dt is None:
                notes.add(f"{name} M={M} K={K} N={N}: not timed ({how})")
                continue
            calls[name] = weights.aten[g][dt]
            meta[name] = {"x": getattr(torch, dt), "note": f"x {how}"}
            continue
        ok, pred = predictor.allowed(name, work)
        if not ok:
            say(f"  {name} skipped at M={M} K={K} N={N}: predicted {pred:.1f} s a call (> {max_call_s:g} s)")
            predictor.record(name, work, pred)
            continue
        try:
            p["rot"]()  # a provider that cannot run here is reported, not fatal
        except Exception as exc:
            say(f"  {name} failed at M={M} K={K} N={N}: {type(exc).__name__}: {exc}")
            continue
        calls[name] = p["rot"]
        meta[name] = {"x": p["x"], "note": ""}
    times = interleaved(calls, "cpu", budget_s=budget * len(calls), min_reps=args.min_rounds, block=1)
    rows = []
    for name, t in times.items():
        predictor.record(name, work, t)
        p = weights.providers[name]
        nbytes = p.get("bytes_by_dtype", {}).get(meta[name]["x"], p["bytes"])
        rotated = nbytes * p["copies"]
        gbps = nbytes / t / 1e9
        note = meta[name]["note"]
        if rotated <= llc:
            note = "not cold: copies <= LLC" + (f"; {note}" if note else "")
        group = int(name.rsplit("_g", 1)[1].split("_")[0]) if "_g" in name else None
        row = {
            "op": "int4", "device": "cpu", "M": M, "K": K, "N": N, "provider": name, "x_dtype": _short(meta[name]["x"]),
            "group_size": group, "copies": p["copies"], "rotated_mb": rotated / 1e6, "llc_mb": llc / (1 << 20),
            "x_llc": rotated / llc, "cold": rotated > llc, "bytes_per_call": nbytes,
            "ms": t * 1e3, "reps": t.reps, "reduced": t.reduced, "gbps": gbps, "dram_gbps": dram,
            "pct_dram": 100 * gbps / dram,
            "x_replaced": times["fp32"] / t if "fp32" in times else None,
            "x_int8": times["fastdl_int8_wo"] / t if "fastdl_int8_wo" in times else None,
            "x_aten": times[_aten_for(group)] / t if _aten_for(group) in times else None,
            "note": note, **env,
        }  # fmt: skip
        if name.startswith(("fastdl_int4", "fastdl_w4a8")):
            _judge(row, times)
            _bar(row, times, M)
        rows.append(row)
    return rows


def main(argv=None):
    return module_main("python -m fastdl.bench.int4", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
