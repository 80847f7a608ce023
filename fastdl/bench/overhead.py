"""``fastdl bench overhead``: the cost of a module call at a tiny shape, where Python and the dispatcher decide, not the
kernel. fastdl's modules vs ``nn.Sequential(nn.Linear, activation)`` at M = 1, K = N = 64 (fp32), in one process,
calls interleaved:

  no grad      ``FusedLinear(activation=act)``, ``Int8Linear(activation=act)`` (W8A8 and weight-only),
               ``Sparse24Linear(activation=act)``, each vs nn.Linear + act on the same weight
  grad         forward + backward (``y.backward(g)``, gradients for the parameters and x): ``FusedLinear``,
               ``Int8Linear(trainable=True)`` (quantization-aware training), ``Sparse24Linear(trainable=True)``

Columns: us (median microseconds per call), x time (time / nn.Linear's time: the bar is <= 1.3 without grad and
<= 1.5 with grad), x nn.Linear (nn.Linear's time / time: < 1 is slower, marked ``<<< SLOWER``).
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from ..ops.fused_linear import ACTIVATIONS, activation_module
from .common import LiveTable, activity, env_columns, interleaved, mark_slower, over_time, print_header, say, write_csv

BARS = {"no_grad": 1.3, "grad": 1.5}
QUICK_ARGS = ["--budget", "0.3"]


def _act_module(act: str) -> nn.Module:
    return activation_module(act) or nn.Identity()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--m", type=int, default=1, help="rows of x (default 1)")
    p.add_argument("--k", type=int, default=64, help="in features (default 64)")
    p.add_argument("--n", type=int, default=64, help="out features (default 64)")
    p.add_argument("--activation", default="gelu", choices=ACTIVATIONS)
    p.add_argument("--budget", type=float, default=1.0, help="seconds of interleaved timed calls per case")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


def _cases(K: int, N: int, act: str):
    """(module name, grad?, fastdl module, nn.Linear-based baseline module) with the same weights."""
    from ..nn.fused_linear import FusedLinear
    from ..ops import sparse24 as sp

    torch.manual_seed(0)
    lin = nn.Linear(K, N)
    out = []

    def baseline(linear):
        return nn.Sequential(copy.deepcopy(linear), _act_module(act))

    out.append(("FusedLinear", False, FusedLinear.from_linear(copy.deepcopy(lin), activation=act), baseline(lin)))
    out.append(("FusedLinear", True, FusedLinear.from_linear(copy.deepcopy(lin), activation=act), baseline(lin)))
    try:
        from ..nn.int8 import Int8Linear

        for mode in ("dynamic", "weight_only"):
            q = Int8Linear.from_linear(copy.deepcopy(lin), mode=mode, activation=act).eval()
            out.append((f"Int8Linear[{mode}]", False, q, baseline(lin)))
        qat = Int8Linear.from_linear(copy.deepcopy(lin), mode="dynamic", trainable=True, activation=act).train()
        out.append(("Int8Linear[dynamic, QAT]", True, qat, baseline(lin)))
    except Exception as exc:  # reported, the other modules still run
        say(f"  Int8Linear unavailable: {type(exc).__name__}: {exc}")
    if K % 4 == 0:
        try:
            from ..nn.sparse24 import Sparse24Linear

            lin24 = copy.deepcopy(lin)
            with torch.no_grad():
                values, meta = sp.compress_2_4(lin24.weight)
                lin24.weight.copy_(sp.decompress_2_4(values, meta))
            s = Sparse24Linear.from_linear(copy.deepcopy(lin24), activation=act)
            out.append(("Sparse24Linear", False, s, baseline(lin24)))
            st = Sparse24Linear.from_linear(copy.deepcopy(lin24), activation=act, trainable=True)
            out.append(("Sparse24Linear", True, st, baseline(lin24)))
        except Exception as exc:
            say(f"  Sparse24Linear unavailable: {type(exc).__name__}: {exc}")
    return out


def _call(mod: nn.Module, x: torch.Tensor, grad: bool, g: torch.Tensor):
    if not grad:

        def fwd():
            with torch.no_grad():
                return mod(x)

        return fwd
    params = [p for p in mod.parameters() if p.requires_grad]

    def step():
        for p in params:
            p.grad = None
        x.grad = None
        mod(x).backward(g)

    return step


COLUMNS = [("module", "module", 24), ("grad", "grad", 7), ("provider", "provider", 8), ("us", "us", 7),
           ("x_time", "x time", 6), ("bar", "bar", 6), ("x_linear", "x nn.Linear", 11)]  # fmt: skip


def run(args) -> list[dict]:
    print_header("overhead")
    env = env_columns("cpu")
    M, K, N, act = args.m, args.k, args.n, args.activation
    say(f"   module call at M={M}, K={K}, N={N}, fp32, activation {act}; baseline nn.Sequential(nn.Linear, "
        f"{type(_act_module(act)).__name__}); bars: time <= {BARS['no_grad']}x without grad, "
        f"<= {BARS['grad']}x with grad")
    table = LiveTable(COLUMNS)
    missed = []
    try:
        for name, grad, mod, base in _cases(K, N, act):
            if over_time("the remaining overhead cases"):
                break
            key = "grad" if grad else "no_grad"
            activity(f"overhead {name} {key}")
            x = torch.randn(M, K, requires_grad=grad)
            g = torch.randn(M, N)
            if not grad:
                mod.eval()
                base.eval()
            try:
                t = interleaved({"pytorch": _call(base, x, grad, g), "fastdl": _call(mod, x, grad, g)},
                                budget_s=args.budget, min_reps=200, max_reps=200000)
            except Exception as exc:
                say(f"  {name} ({key}) failed: {type(exc).__name__}: {exc}")
                continue
            for prov in ("pytorch", "fastdl"):
                row = {"op": "overhead", "module": name, "grad": key, "M": M, "K": K, "N": N, "activation": act,
                       "provider": prov, "us": t[prov] * 1e6, "ms": t[prov] * 1e3, "x_time": t[prov] / t["pytorch"],
                       "bar": BARS[key] if prov == "fastdl" else None, "x_linear": t["pytorch"] / t[prov], **env}
                if prov == "fastdl":
                    mark_slower(row, {f"nn.Linear + {act}": row["x_linear"]})
                    row["bar_met"] = row["x_time"] <= BARS[key]
                    if not row["bar_met"]:
                        missed.append(f"{name} ({key}): {row['x_time']:.2f}x the time of nn.Linear > {BARS[key]}x")
                table.add(row)
    except KeyboardInterrupt:
        say("  interrupted: the rows above are complete")
    table.close("fastdl modules", "nn.Linear")
    if missed:
        say("!! call-overhead bar MISSED: " + "; ".join(missed))
    elif table.rows:
        n = sum(1 for r in table.rows if r["provider"] == "fastdl")
        say(f"call-overhead bars met (time <= 1.3x nn.Linear without grad, <= 1.5x with grad) in the {n} cases "
            "measured.")
    if args.csv:
        write_csv(table.rows, args.csv)
    return table.rows


def main(argv=None):
    from .common import module_main  # here: the import list above stays one line

    return module_main("python -m fastdl.bench.overhead", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
