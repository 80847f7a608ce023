"""The verdict of ``fastdl demo``: its results as stages (fastdl against every PyTorch option a user could pick, and
like with like: each fastdl row against PyTorch at the row's precision), the likely causes of a slower stage, the
closing lines, the table, and the accuracy bars. Pure functions of the results dict (tests feed them crafted results);
``fastdl.demo`` re-exports them."""

from __future__ import annotations

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
    "train": "fastdl FusedLinear",
    "finetune": "fastdl 2:4 masked fine-tune",
    "infer_fused": "fastdl FusedLinear bf16",
    "infer_int8": "fastdl Int8Linear W8A8",
    "infer_sparse24": "fastdl Sparse24Linear bf16",
}


ACC_MARGIN = 1.0  # accuracy points under PyTorch fp32 beyond which a PyTorch option is not one a user would pick


def _prov(v: dict) -> dict:
    """A training run's results as a provider row: accuracy, ms per step and (when recorded) the precision."""
    return {"acc": v["acc"], "ms": v["step_ms"], **({"dtype": v["dtype"]} if v.get("dtype") else {})}


def _precision(v: dict) -> str:
    return {"fp32": "fp32", "bf16": "bf16 autocast"}.get(v.get("dtype", ""), "")


def provider_label(key: str, name: str, v: dict) -> str:
    """The table's name of a provider row of stage ``key``."""
    if name == "fastdl":
        prec = _precision(v) if key in ("train", "finetune") else ""
        if key == "finetune":
            return f"{FASTDL_LABELS[key]} ({prec or 'bf16 autocast'})"
        return f"{FASTDL_LABELS[key]} {prec} (recipe)" if prec else FASTDL_LABELS[key]
    if name == "fastdl_dense":
        return f"fastdl FusedLinear dense step, {_precision(v)}".rstrip(", ")
    if name.startswith("fastdl_"):
        return f"fastdl FusedLinear {_precision(v)}"
    return PROVIDER_LABELS.get(name, name)


def stages(r: dict) -> list[dict]:
    """Per stage: fastdl's accuracy and time, each PyTorch option's, the best PyTorch option and the ratio (the
    headline: fastdl's row, the recipe's precision in training, against the fastest usable PyTorch option), and
    like with like: each fastdl row that has a precision against PyTorch at that precision (``same_precision``)."""
    out = []
    for title, key, unit in STAGES:
        if key == "train":
            prov = {k[len("dense_"):]: _prov(v) for k, v in r.items()
                    if k.startswith("dense_") and k != "dense_pytorch" and isinstance(v, dict) and "step_ms" in v}
            prov = dict(sorted(prov.items(), key=lambda kv: (kv[0] != "fastdl", not kv[0].startswith("fastdl"))))
        elif key == "finetune":
            prov = {"fastdl": _prov(r["sparse_fastdl"])}
            dense = r["dense_fastdl"]
            if dense.get("dtype") == r["sparse_fastdl"].get("dtype"):  # the dense step it should cost no more than
                prov["fastdl_dense"] = _prov(dense)
            for k in ("pytorch_fp32", "pytorch_bf16"):  # PyTorch has no 2:4 training: its dense step is the baseline
                if r.get(f"dense_{k}"):
                    prov[k] = _prov(r[f"dense_{k}"])
        elif key in r:
            prov = {k: v for k, v in r[key].items() if isinstance(v, dict)}
        else:
            continue
        # A PyTorch option counts only if a user would keep it: accuracy within ACC_MARGIN points of PyTorch fp32 on
        # the same stage (PyTorch's int8 quantizes activations per tensor; one outlier row can wreck the others).
        ref = (prov.get("pytorch_fp32") or prov["fastdl"])["acc"]
        unusable = [k for k, v in prov.items() if k.startswith("pytorch_") and v["acc"] is not None
                    and ref is not None and v["acc"] < ref - ACC_MARGIN]  # fmt: skip
        base = {k: v for k, v in prov.items() if k.startswith("pytorch_") and k not in unusable}
        best = min(base, key=lambda k: base[k]["ms"]) if base else None
        ratio = base[best]["ms"] / prov["fastdl"]["ms"] if best else None
        same = []  # like with like: a fastdl row against PyTorch at its own precision
        for k, v in prov.items():
            vs = f"pytorch_{v.get('dtype')}"
            if k != "fastdl_dense" and k.startswith("fastdl") and v.get("dtype") and vs in base:
                same.append({"row": k, "vs": vs, "ratio": base[vs]["ms"] / v["ms"],
                             "label": provider_label(key, k, v)})  # fmt: skip
        # slower_same_precision: the losses at the same precision that the headline does not already count
        out.append({"stage": title, "key": key, "unit": unit, "providers": prov, "best": best, "ratio": ratio,
                    "slower": ratio is not None and ratio < 1.0, "unusable": unusable, "same_precision": same,
                    "slower_same_precision": [f"{c['label']} {c['ratio']:.2f}x {PROVIDER_LABELS[c['vs']]}"
                                              for c in same if c["ratio"] < 1.0
                                              and not (c["row"] == "fastdl" and c["vs"] == best)]})  # fmt: skip
    return out


def slow_reasons(key: str, cpu: dict, fastdl_ms: float, dtype: str | None = None, r: dict | None = None,
                 vs: str | None = None) -> list[str]:
    """Likely causes of a slower stage, from the CPU level, the stage, the fastdl row's precision (``dtype``, "fp32"
    or "bf16"; None: the stage's own), the PyTorch row it lost to (``vs``) and the size of the work (facts about this
    demo's model, not measurements of the cause)."""
    level = cpu.get("level", "")
    capped = " (capped)" if cpu.get("capped") else ""
    why = []
    bf16 = dtype == "bf16" if dtype else key in ("train", "finetune", "infer_fused", "infer_sparse24")
    if bf16 and key in ("train", "finetune", "infer_fused", "infer_sparse24") and level in ("scalar", "avx2", "avx512"):
        why.append(f"{level}{capped}: no AVX512-BF16, so bf16 products are widened to fp32 in software"
                   + (", while PyTorch's fp32 runs at full speed" if vs in (None, "pytorch_fp32") else ""))
    if key == "infer_int8" and level in ("scalar", "avx2"):
        why.append(f"{level}{capped}: no AVX512-VNNI, int8 dot products take 3 instructions (vpmaddubsw, vpmaddwd, "
                   "vpaddd) instead of 1")  # fmt: skip
    if key == "finetune":
        why.append("the 2:4 fine-tune step also masks each pruned weight's gradient (one in-place pass the dense "
                   "step does not make)")  # fmt: skip
        if ((r or {}).get("sparse_fastdl") or {}).get("remasked_every_step"):
            why.append("MaskedTraining re-masked the weights after every step (its safety net was triggered)")
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


def _extra_same(st: dict) -> list[dict]:
    """The same-precision comparisons of a stage that its headline (fastdl's row vs the best PyTorch option) does not
    already make."""
    return [c for c in st["same_precision"] if not (c["row"] == "fastdl" and c["vs"] == st["best"])]


def slower_comparisons(all_stages: list[dict]) -> list[str]:
    """Every comparison fastdl loses: a stage's headline, and a fastdl row against PyTorch at the same precision."""
    out = []
    for st in all_stages:
        if st["slower"]:
            out.append(f"{st['stage']} ({st['ratio']:.2f}x {PROVIDER_LABELS[st['best']]})")
        out += [f"{st['stage']}, same precision: {c}" for c in st["slower_same_precision"]]
    return out


def _noise(ratio: float) -> str:
    return " (within 5%: may be noise)" if ratio >= 0.95 else ""


def verdict(r: dict, cpu: dict) -> list[str]:
    """Closing lines: per stage, speed vs the fastest PyTorch option and accuracy, plainly, then each fastdl row
    against PyTorch at the same precision; the last line sums up and names every slower stage and comparison."""
    lines = []
    all_stages = stages(r)
    for st in all_stages:
        if st["best"] is None:
            continue
        fd = st["providers"]["fastdl"]
        best = PROVIDER_LABELS[st["best"]]
        for k in st["unusable"]:
            ref = st["providers"].get("pytorch_fp32", fd)["acc"]
            lines.append(f"  {st['stage']}: {PROVIDER_LABELS.get(k, k)} not counted: accuracy "
                         f"{st['providers'][k]['acc']:.2f}% vs PyTorch fp32 {ref:.2f}%")
        if st["slower"]:
            why = slow_reasons(st["key"], cpu, fd["ms"], fd.get("dtype"), r, st["best"])
            lines.append(f"  {st['stage']}: SLOWER than {best}: {st['ratio']:.2f}x{_noise(st['ratio'])} "
                         f"({fd['ms']:.3f} vs {st['providers'][st['best']]['ms']:.3f} ms/{st['unit']}); likely cause: "
                         + ("; ".join(why) or "unknown"))  # fmt: skip
        else:
            lines.append(f"  {st['stage']}: faster than the best PyTorch option ({best}): {st['ratio']:.2f}x")
        extra = _extra_same(st)
        if extra:
            parts = []
            for c in st["same_precision"]:
                mark = f" SLOWER{_noise(c['ratio'])}" if c["ratio"] < 1.0 else ""
                parts.append(f"{c['label']} {c['ratio']:.2f}x {PROVIDER_LABELS[c['vs']]}{mark}")
                if c["ratio"] < 1.0 and c in extra:
                    v = st["providers"][c["row"]]
                    why = slow_reasons(st["key"], cpu, v["ms"], v.get("dtype"), r, c["vs"])
                    parts[-1] += " (likely cause: " + ("; ".join(why) or "unknown") + ")"
            lines.append(f"  {st['stage']}, like with like (same precision): " + "; ".join(parts))
        if "fastdl_dense" in st["providers"]:
            cost = fd["ms"] / st["providers"]["fastdl_dense"]["ms"]
            lines.append(f"  {st['stage']}: the 2:4 step costs {cost:.2f}x the dense fastdl step at the same precision"
                         " (the two steps timed interleaved)")  # fmt: skip
    missed = check_bars(r)
    lines.append("  accuracy bars: " + ("all met" if not missed else "MISSED: " + "; ".join(missed)))
    slower = slower_comparisons(all_stages)
    where = f"{cpu.get('model', 'CPU')}, ISA {cpu.get('level', '?')}{' (capped)' if cpu.get('capped') else ''}"
    if slower:
        lines.append(f"verdict ({where}): fastdl is SLOWER than PyTorch in {len(slower)} comparison(s) over "
                     f"{len(all_stages)} stages: " + "; ".join(slower))  # fmt: skip
    else:
        lines.append(f"verdict ({where}): fastdl is at least as fast as the best PyTorch option in every stage"
                     + (", and as PyTorch at the same precision" if any(st["same_precision"] for st in all_stages)
                        else "")
                     + ("" if not missed else ", but accuracy bars are missed"))  # fmt: skip
    return lines


def format_table(r: dict) -> str:
    head = ("stage", "run", "acc %", "ms", "fastdl vs it")
    rows = []
    for st in stages(r):
        fd = st["providers"]["fastdl"]
        same = {c["row"]: c for c in st["same_precision"]}
        for k, v in st["providers"].items():
            label = provider_label(st["key"], k, v)
            if k == "fastdl":
                ratio = ""
            elif k == "fastdl_dense":
                ratio = f"(the 2:4 step is {fd['ms'] / v['ms']:.2f}x this)"
            elif k in same:  # another fastdl row: like with like
                c = same[k]
                ratio = f"(vs {PROVIDER_LABELS[c['vs']]}: {c['ratio']:.2f}x)" + ("  <<< SLOWER" * (c["ratio"] < 1))
            elif k.startswith("fastdl"):
                ratio = ""
            else:
                ratio = f"{v['ms'] / fd['ms']:.2f}x"
                if k in st["unusable"]:
                    ratio += f"  (accuracy > {ACC_MARGIN:g} point under PyTorch fp32: not counted)"
                elif v["ms"] / fd["ms"] < 1.0:
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
    if r["sparse_fastdl"].get("pattern_2_4") is False:
        missed.append("a pruned weight is not 2:4 after fine-tuning")
    if r["sparse_fastdl"].get("off_mask_nonzeros"):
        missed.append(f"{r['sparse_fastdl']['off_mask_nonzeros']} pruned weight(s) moved off zero during fine-tuning")
    return missed
