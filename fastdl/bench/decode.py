"""LLM decode end to end at a realistic size: ``fastdl bench model --decoder tinyllama``.

The model: Hugging Face ``LlamaForCausalLM`` at the TinyLlama-1.1B shape (hidden 2048, MLP 5632, 22 layers, 32 heads,
4 KV heads, vocabulary 32000, untied ``lm_head``; random weights, fp32: ~4.4 GB), or any other shape through
``--llama-config KEY=VALUE ...`` (``LlamaConfig`` fields; e.g. ``hidden_size=4096 intermediate_size=11008
num_hidden_layers=32 num_attention_heads=32 num_key_value_heads=32`` for LLaMA-7B). Greedy ``generate()`` of a fixed
number of new tokens (``--new-tokens``, default 32) after a prompt of random tokens (``--prompt``, default 16), batch 1.

Each policy runs in its own subprocess (so that its peak resident memory is its own), which builds the fp32 model,
converts it in place (``fastdl.bench.model.convert_in_place``: the policies of ``fastdl bench model``, plus ``bf16``:
the model's weights cast to bfloat16), keeps no other copy, and then generates: once untimed (the converted layers make
their run-time path decisions at the prompt's and the decode step's rows there), then ``--reps`` times timed, with a
``StoppingCriteria`` taking a time stamp after every token, so that

  prefill ms        time to the first token (the prompt pass and ``generate()``'s set-up), median over the reps
  tok/s             decode phase only: (new tokens - 1) / (time of the last token - time of the first), median
  MB/token          bytes a decode step streams: the stored bytes of every parameter and buffer of the model (each
                    storage once: quantized / compressed weights, their scales and metadata, biases, norms; for
                    every ``lm_head`` as stored), the embedding table counted as the one row a token reads. Counted
                    from the tensors (``module_bytes``), not from ``memory_bytes()``, which also counts the weight
                    caches (derived copies, e.g. a dequantized weight a path keeps: shown apart as "cache MB"). The
                    KV cache read per step (at the mean context) is in the CSV (``kv_mb_per_token``), not in MB/token
  ceiling tok/s     measured DRAM read bandwidth (``memory.dram_read_bandwidth``, once, before the policies; or
                    ``--bandwidth GB/s``) / MB/token: the speed of a step that did nothing but stream its weights once
  % ceiling         tok/s / ceiling tok/s
  RSS conv MB       resident memory (VmRSS) after conversion, the fp32 original gone (gc + glibc ``malloc_trim``)
  RSS gen MB        resident memory after the generate() calls (gc + ``malloc_trim``: memory still held by objects)
  peak gen MB       peak resident memory (VmHWM) during the generate() calls (the peak is reset after conversion)
  cache MB          bytes in the fastdl layers' weight caches after generate() (kept derived copies)
  MB/token as run   MB/token with each fastdl layer counted by the path its run-time choice took at 1 row: a path on
                    a dense copy ("dequant*", "dense*") reads out x in x 4 bytes (fp32 activations), not its stored
                    bytes (``step_paths``; the paths per phase are printed and in the CSV: ``paths_decode``,
                    ``paths_prefill``). Above MB/token: the step streams a kept full-precision copy

MB = 1e6 bytes, GB/s = 1e9 bytes/s. ``x fp32`` compares with the fp32 row, measured in another process before or
after (not interleaved). ``--profile [POLICY]``: ``torch.profiler`` over one decode step of that policy (default
int8_weight_only): the ops by self CPU time, and by input shape, so the GEMV kernels and what runs around them show.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
import warnings

import torch

from .common import LiveTable, activity, mark_slower, over_time, say, stop_requested
from .memory import dram_read_bandwidth

TINYLLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
             "num_attention_heads": 32, "num_key_value_heads": 4}  # fmt: skip
POLICIES = ("fp32", "bf16", "int8_weight_only", "int8", "int4", "sparse24")  # the default rows
SUPPORTED = POLICIES + ("bf16_autocast", "fused", "int4_weight_only")
TORCH_POLICIES = ("fp32", "bf16", "bf16_autocast")
DEFAULT_NEW_TOKENS = 32
DEFAULT_REPS = 3
ROW_MARK = "FASTDL_DECODE_ROW "

COLUMNS = [("policy", "policy", 16), ("prefill_ms", "prefill ms", 10), ("ms", "ms/token", 9), ("per_s", "tok/s", 7),
           ("x_fp32", "x fp32", 6), ("mb_per_token", "MB/token", 8), ("ceiling_per_s", "ceiling tok/s", 13),
           ("pct_ceiling", "% ceiling", 9), ("rss_converted_mb", "RSS conv MB", 11),
           ("rss_generate_mb", "RSS gen MB", 10), ("peak_generate_mb", "peak gen MB", 11),
           ("cached_mb", "cache MB", 8), ("mb_per_token_as_run", "MB/token as run", 15)]  # fmt: skip


# ---------------------------------------------------------------------------------------------- memory
def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_mb() -> float | None:
    """Resident memory of this process now (VmRSS), MB; None where /proc is missing."""
    k = _status_kib("VmRSS")
    return None if k is None else k * 1024 / 1e6


def peak_rss_mb() -> float | None:
    """Peak resident memory (VmHWM) since the process started or since ``reset_peak_rss()``, MB."""
    k = _status_kib("VmHWM")
    return None if k is None else k * 1024 / 1e6


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``); False where that fails."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_freed_memory() -> None:
    """gc, then glibc's ``malloc_trim(0)``: memory freed by Python objects but kept by the allocator goes back to the
    system, so that RSS counts what is still held (no-op without glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# ---------------------------------------------------------------------------------------------- bytes
def _storage(t: torch.Tensor) -> tuple:
    """(key, bytes) of the storage behind ``t`` (a tensor subclass without one: its own bytes)."""
    try:
        st = t.untyped_storage()
        return ("storage", st.data_ptr(), str(t.device)), st.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return ("tensor", id(t)), t.numel() * t.element_size()


def module_bytes(model: torch.nn.Module) -> dict:
    """Bytes of the model's tensors, each storage counted once:

    ``stored``          every parameter and buffer (what the model holds by design)
    ``embedding``       of those, the embedding tables (``nn.Embedding``)
    ``per_token``       bytes a decode step reads: ``stored`` less the embedding tables plus one row of each
    ``lm_head``         the stored bytes of the module named ``lm_head`` (included in ``per_token``)
    ``cached``          tensors of the fastdl layers' weight caches (derived copies) not among ``stored``
    """
    seen: set = set()
    stored = emb = rows = lm_head = cached = 0
    for name, mod in model.named_modules():
        own = 0
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            key, n = _storage(t)
            if key not in seen:
                seen.add(key)
                own += n
        stored += own
        if isinstance(mod, torch.nn.Embedding):
            emb += own
            rows += mod.embedding_dim * mod.weight.element_size()
        if name.split(".")[-1] == "lm_head":
            lm_head += own
    for mod in model.modules():
        cache = getattr(mod, "_weight_cache", None)
        for t in cache.tensors() if hasattr(cache, "tensors") else ():
            key, n = _storage(t)
            if key not in seen:
                seen.add(key)
                cached += n
    return {"stored": stored, "embedding": emb, "per_token": stored - emb + rows, "lm_head": lm_head,
            "cached": cached}  # fmt: skip


def _own_bytes(mod: torch.nn.Module) -> int:
    return sum(_storage(t)[1] for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)))


def step_paths(model: torch.nn.Module, rows: int, act_dtype: torch.dtype = torch.float32) -> tuple[dict, int]:
    """What the fastdl layers run for an input of ``rows`` rows, as decided by their run-time choice
    (``known_path``; nothing is timed; "no decision": not run at that size, e.g. ``lm_head`` at the prompt, where
    ``generate()`` computes the last position's logits only): ``{path: number of layers}``, and the bytes those
    layers read per call if a path on a dense copy (a name with "dequant" or "dense": the kept dequantized /
    decompressed weight, out x in in ``act_dtype``, plus the bias) reads that copy and every other path the layer's
    stored tensors. A diagnosis: it follows the naming of fastdl's paths, not their code."""
    counts: dict[str, int] = {}
    read = 0
    for mod in model.modules():
        known = getattr(mod, "known_path", None)
        k, n = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
        if known is None or k is None or n is None:
            continue
        path = known(torch.empty((rows, k), dtype=act_dtype)) or "no decision"
        counts[path] = counts.get(path, 0) + 1
        if "dequant" in path or "dense" in path:
            bias = getattr(mod, "bias", None)
            read += n * k * torch.empty((), dtype=act_dtype).element_size()
            read += 0 if bias is None else bias.numel() * bias.element_size()
        else:
            read += _own_bytes(mod)
    return counts, read


def _paths_text(counts: dict) -> str:
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------- model
def llama_config(overrides: dict | None = None) -> dict:
    return {**TINYLLAMA, **(overrides or {})}


def parse_overrides(items: list[str] | None) -> dict:
    """``["hidden_size=64", ...]`` -> ``{"hidden_size": 64, ...}`` (values as JSON where they parse, else text)."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--llama-config: expected KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build(config: dict, max_len: int = 2048) -> torch.nn.Module:
    """``LlamaForCausalLM`` with random weights (seed 0), fp32, eval mode, ``lm_head`` untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = {"tie_word_embeddings": False, **config}
    cfg["max_position_embeddings"] = max(int(cfg.get("max_position_embeddings", 0)), max_len)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def _quiet_transformers() -> None:
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()


def _clock_class():
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        """Takes a time stamp after every generated token (the first one: after the prompt pass); never stops."""

        def __init__(self, on_step=None):
            self.times: list[float] = []
            self.on_step = on_step

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            if self.on_step is not None:
                self.on_step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock


def generate(model, prompt: torch.Tensor, new_tokens: int, autocast: bool = False, on_step=None):
    """Greedy ``generate()`` of exactly ``new_tokens`` tokens; (tokens, start time, time stamp after each token)."""
    from transformers import StoppingCriteriaList

    clock = _clock_class()(on_step)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with torch.no_grad(), ctx, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             stopping_criteria=StoppingCriteriaList([clock]))  # fmt: skip
    return out[:, prompt.shape[1]:], t0, clock.times


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ---------------------------------------------------------------------------------------------- one policy
def run_policy(spec: dict, log=say) -> dict:
    """Build, convert, generate and measure one policy in this process (see the module docstring); the row."""
    from .policies import convert_in_place

    _quiet_transformers()
    policy, config = spec["policy"], llama_config(spec.get("config"))
    P, N, reps = int(spec["prompt"]), int(spec["new_tokens"]), int(spec.get("reps", DEFAULT_REPS))
    if N < 2:
        raise ValueError(f"decode benchmark: new_tokens must be >= 2 (the decode phase starts after the first token), "
                         f"got {N}")
    row: dict = {"policy": policy}
    t0 = time.perf_counter()
    model = build(config, max_len=P + N + 8)
    row["build_s"] = time.perf_counter() - t0
    row["rss_fp32_mb"] = rss_mb()
    t0 = time.perf_counter()
    with torch.no_grad():
        model, autocast = convert_in_place(policy, model, decoder=True)
    row["convert_s"] = time.perf_counter() - t0
    release_freed_memory()
    row["rss_converted_mb"] = rss_mb()
    row["peak_build_mb"] = peak_rss_mb()  # building the fp32 model and converting it
    sizes = module_bytes(model)
    row["stored_mb"] = sizes["stored"] / 1e6
    row["bytes_per_token"] = sizes["per_token"]
    row["mb_per_token"] = sizes["per_token"] / 1e6
    row["lm_head_mb"] = sizes["lm_head"] / 1e6
    act_bytes = 2 if policy == "bf16" else 4  # the dtype of the activations, hence of the KV cache
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * act_bytes
    row["kv_mb_per_token"] = kv * (P + N / 2) / 1e6
    row["peak_is_per_phase"] = reset_peak_rss()
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, config["vocab_size"], (1, P), generator=g)
    t0 = time.perf_counter()
    tokens, _, _ = generate(model, prompt, N, autocast)  # untimed: the layers' run-time path decisions happen here
    row["first_generate_s"] = time.perf_counter() - t0
    log(f"   {policy}: built in {row['build_s']:.1f} s, converted in {row['convert_s']:.1f} s, first generate() "
        f"(run-time choices) {row['first_generate_s']:.1f} s; timing {reps} x {N} tokens")
    prefill, per_token = [], []
    for _ in range(reps):
        toks, start, times = generate(model, prompt, N, autocast)
        if len(times) != N:
            raise RuntimeError(f"decode benchmark: generate() made {len(times)} tokens, expected {N}")
        prefill.append(times[0] - start)
        per_token.append((times[-1] - times[0]) / (N - 1))
    row["prefill_ms"] = _median(prefill) * 1e3
    row["ms"] = _median(per_token) * 1e3
    row["per_s"] = 1e3 / row["ms"]
    row["reps"] = reps
    row["reduced"] = False
    row["same_tokens_each_run"] = bool((toks == tokens).all())
    release_freed_memory()
    row["rss_generate_mb"] = rss_mb()
    row["peak_generate_mb"] = peak_rss_mb()
    row["cached_mb"] = module_bytes(model)["cached"] / 1e6
    act = torch.bfloat16 if policy in ("bf16", "bf16_autocast") else torch.float32
    fastdl_read = sum(_own_bytes(m) for m in model.modules() if hasattr(m, "known_path"))
    for phase, rows in (("decode", 1), ("prefill", P)):
        counts, read = step_paths(model, rows, act)
        row[f"paths_{phase}"] = _paths_text(counts)
        if phase == "decode":  # the stored bytes of the fastdl layers replaced by what their decode path reads
            row["mb_per_token_as_run"] = (sizes["per_token"] - fastdl_read + read) / 1e6
    if row["paths_decode"]:
        log(f"   {policy}: paths of the fastdl layers at the decode step (1 row): {row['paths_decode']}; at the "
            f"prompt ({P} rows): {row['paths_prefill']}")
    row["threads"] = torch.get_num_threads()
    if spec.get("profile"):
        profile_step(model, prompt, autocast, policy, log)
    return row


def profile_step(model, prompt: torch.Tensor, autocast: bool, policy: str, log=say, rows: int = 20) -> None:
    """``torch.profiler`` over the second decode step of a ``generate()`` (the first is its warm-up): the ops by self
    CPU time, then by input shape (the GEMVs of each layer shape apart), and the share of the step spent in the ops
    named like a matrix product (``mm``, ``linear``, ``gemv``: self times, so nothing is counted twice)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=1, warmup=1, active=1, repeat=1)) as prof:  # fmt: skip
        _, _, times = generate(model, prompt, 4, autocast, on_step=prof.step)
    step_ms = (times[2] - times[1]) * 1e3 if len(times) > 2 else float("nan")
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    gemm_us = sum(e.self_cpu_time_total for e in events
                  if any(k in e.key.lower() for k in ("mm", "linear", "gemv")))  # fmt: skip
    log(f"-- profile of one decode step, policy {policy} (context {prompt.shape[1] + 2} tokens): step {step_ms:.1f} ms "
        f"unprofiled; self CPU of all ops {total_us / 1e3:.1f} ms, of the matrix-product ops (mm/linear/gemv in the "
        f"name) {gemm_us / 1e3:.1f} ms ({100 * gemm_us / max(total_us, 1e-9):.0f} %)")
    log(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))
    log("   by input shape:")
    log(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                            max_name_column_width=50, max_shapes_column_width=60))


# ---------------------------------------------------------------------------------------------- all policies
def _child(spec: dict) -> dict:
    """Run one policy in a subprocess; its printed lines are passed on, its row comes back as JSON."""
    import fastdl

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastdl.__file__)))  # this fastdl, not another install
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "fastdl.bench.decode", "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    row = None
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(ROW_MARK):
            row = json.loads(line[len(ROW_MARK):])
        else:
            print(line, end="", flush=True)
    rc = proc.wait()
    if rc != 0 or row is None:
        why = f"exited with {rc}" + (" (killed by a signal: out of memory?)" if rc < 0 else "")
        raise RuntimeError(f"the subprocess of policy {spec['policy']} {why}")
    return row


def run_tinyllama(args, env: dict) -> list[dict]:
    """The rows of ``fastdl bench model --decoder tinyllama`` (one per policy; see the module docstring)."""
    overrides = parse_overrides(getattr(args, "llama_config", None))
    config = llama_config(overrides)
    policies = [p for p in (args.policies or POLICIES)]
    for p in [p for p in policies if p not in SUPPORTED]:
        say(f"   {p}: not a policy of the TinyLlama decoder (one of {', '.join(SUPPORTED)}): skipped")
        policies.remove(p)
    profile = getattr(args, "profile", None)
    if profile and profile not in policies:
        policies.append(profile)
    P = args.prompt
    N = args.tokens or DEFAULT_NEW_TOKENS
    reps = getattr(args, "reps", None) or DEFAULT_REPS
    if N < 2:
        raise ValueError(f"fastdl bench model --decoder tinyllama: --new-tokens must be >= 2, got {N}")
    h, L = config["hidden_size"], config["num_hidden_layers"]
    ff, V = config["intermediate_size"], config["vocab_size"]
    hk = config["num_key_value_heads"] * (config.get("head_dim") or h // config["num_attention_heads"])
    n_params = V * h * 2 + L * (2 * h * h + 2 * h * hk + 3 * h * ff + 2 * h) + h
    name = "TinyLlama-1.1B shape" if not overrides else f"LLaMA shape {overrides}"
    say(f"-- decoder: transformers LlamaForCausalLM, {name}: hidden {h}, MLP {ff}, {L} layers, "
        f"{config['num_attention_heads']} heads, {config['num_key_value_heads']} KV heads, vocabulary {V}, "
        f"{n_params / 1e6:.1f} M parameters ({n_params * 4 / 1e6:.0f} MB fp32); random weights; greedy generate() of "
        f"{N} tokens after a {P}-token prompt, batch 1, {reps} timed runs per policy, each policy in "
        f"{'this process' if args.in_process else 'its own process'}")
    if args.bandwidth:
        bw = float(args.bandwidth)
        say(f"   DRAM read bandwidth: {bw:.1f} GB/s (given)")
    else:
        activity("measuring the DRAM read bandwidth")
        bw = dram_read_bandwidth()
        say(f"   DRAM read bandwidth: {bw:.1f} GB/s (measured: torch.sum of a buffer > 8x the last-level cache, "
            f"{torch.get_num_threads()} threads; the ceiling of every row)")
    table = LiveTable(COLUMNS, title="   decoder: greedy decoding (decode phase), batch 1")
    fp32_rate = None
    for policy in policies:
        if over_time(f"decoder policy {policy} and later") or stop_requested():
            break
        activity(f"TinyLlama decoder: policy {policy}" + ("" if args.in_process else " (subprocess)"))
        spec = {"policy": policy, "config": overrides, "prompt": P, "new_tokens": N, "reps": reps,
                "profile": policy == profile}  # fmt: skip
        try:
            r = run_policy(spec) if args.in_process else _child(spec)
        except Exception as exc:  # reported, the other policies still run
            say(f"   decoder {policy}: FAILED: {type(exc).__name__}: {exc}")
            continue
        row = {"op": "model", "model": "tinyllama", "impl": "transformers", "hidden": h, "layers": L, "batch": 1,
               "prompt": P, "tokens": N, **r}  # fmt: skip
        row["dram_gbps"] = bw
        row["ceiling_per_s"] = bw * 1e9 / row["bytes_per_token"]
        row["pct_ceiling"] = 100.0 * row["per_s"] / row["ceiling_per_s"]
        row["effective_gbps"] = row["per_s"] * row["bytes_per_token"] / 1e9
        if policy == "fp32":
            fp32_rate = row["per_s"]
        row["x_fp32"] = row["per_s"] / fp32_rate if fp32_rate else None
        if policy not in TORCH_POLICIES and row["x_fp32"] is not None:
            mark_slower(row, {"fp32 eager": row["x_fp32"]})
        row.update(env)
        table.add(row)
    table.close("fastdl policies (TinyLlama decode)", "fp32 eager")
    over = [r for r in table.rows if r["pct_ceiling"] > 100]
    if over:
        say("   note: a row above 100 % of the ceiling: the bandwidth was measured lower than the step saw it (a busy "
            "machine while measuring), or part of the weights stayed in the cache (a model that fits it)")
    return table.rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastdl.bench.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--child", required=True, help="JSON spec of one policy (used by fastdl bench model)")
    args = p.parse_args(argv)
    row = run_policy(json.loads(args.child))
    print(ROW_MARK + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
