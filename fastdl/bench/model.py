"""``fastdl bench model``: whole models, random weights, nothing downloaded. Each policy of running them against the
original fp32 model, in one process, calls of the policy and of the fp32 original interleaved:

  encoder   BERT-style (hidden 384, 6 layers, MLP 1536, 12 heads; the shape of all-MiniLM-L6-v2): latency of one batch
            at batch 1, 8, 32 and sequence 16-128; error: cosine and max |error| of the last hidden state vs fp32
  decoder   LLaMA-style (hidden 2048, 4 layers, vocabulary 32000; ``--quick``: hidden 1024, 2 layers): greedy decode
            of 32 tokens (``--quick``: 16) at batch 1 (KV cache), tokens/s; error: max |logit error| and cosine of the
            logits on the same token sequence (teacher forced), and the fraction of greedy tokens equal to fp32's
            (random weights give near-uniform logits, so greedy tokens flip at tiny errors: the logit error is the
            meaningful number)
  tinyllama (opt-in: ``--decoder tinyllama``; minutes) the TinyLlama-1.1B shape (22 layers, 4 KV heads), each policy
            in its own process: decode tokens/s, prefill ms, bytes streamed per token, the ceiling the measured DRAM
            bandwidth allows and the % of it reached, resident memory; ``--profile``: one decode step profiled
            (``fastdl.bench.decode``)

The models are ``transformers``' ``BertModel`` and ``LlamaForCausalLM`` when ``transformers`` is installed (their
Linear layers are plain ``nn.Linear``, activations are functions, so "fused" fuses no activation there), else a small
built-in transformer of the same shapes (``--builtin`` forces it).

Policies:
  fp32               the original model (the reference of every ratio and error)
  bf16_autocast      the original under ``torch.autocast("cpu", torch.bfloat16)``
  compile            ``torch.compile`` of the original (fp32); encoder only unless ``--compile-decoder``, and not in
                     ``--quick``
  fused              ``fastdl.convert(model, "fused")``
  int8               ``fastdl.convert(model, "int8")`` (W8A8 dynamic)
  int8_weight_only   ``fastdl.convert(model, "int8_weight_only")``
  sparse24           ``fastdl.sparsity.prune`` (every Linear but the LM head) then ``fastdl.sparsity.sparsify``; pruned
                     without fine-tuning, so its error is the pruning's, not the kernel's
  auto               ``fastdl.convert(model, "auto", workload=[...])``: encoder: one batch of every batch size and
                     sequence length measured (other token ids); decoder: the prompt and one decode step

Columns: ms (median; ``*``: a slow call timed 1-2 times), x fp32 (fp32 time / time, from the interleaved pair: > 1 is
faster), x best (vs the fastest PyTorch policy at that shape: fp32, bf16_autocast or compile). A fastdl policy slower
than fp32 or than the best PyTorch policy is marked ``<<< SLOWER`` and listed again at the end. CSV + PNG (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .common import (
    CallPredictor,
    LiveTable,
    activity,
    env_columns,
    interleaved,
    mark_slower,
    module_main,
    over_time,
    print_header,
    pyplot,
    say,
    set_deadline,
    time_left,
    write_csv,
)
from .decode import POLICIES as DECODE_POLICIES
from .decode import SUPPORTED as DECODE_SUPPORTED
from .decode import run_tinyllama
from .policies import convert_in_place

# Measured in this order (a time box cuts the last ones): the PyTorch policies first (every fastdl row is judged
# against the best of them), then "auto", the policy that must never lose to the original.
POLICIES = ("fp32", "bf16_autocast", "compile", "auto", "fused", "int8", "int8_weight_only", "sparse24")
TORCH_POLICIES = ("fp32", "bf16_autocast", "compile")
QUICK_ARGS = ["--quick"]
# bench all: hidden 2048, 2 layers (~0.9 GB fp32); the PyTorch alternatives skipped where predicted over 1 s a call
# (bf16 autocast on an AVX2 CPU: 1.8 s at batch 8 x 128, 7.4 s at 32 x 128 on a Zen 2, where with the defaults the
# encoder's baselines used 108 s of the 185 s box and the fastdl policies were not reached)
ALL_ARGS = ["--layers", "2", "--max-call", "1.0", "--budget", "1.0"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=None, choices=["encoder", "decoder"],
                   help="default: encoder decoder; with --decoder tinyllama: decoder")
    p.add_argument("--policies", nargs="+", default=None, choices=POLICIES + ("bf16", "int4", "int4_weight_only"),
                   help="default: " + " ".join(POLICIES) + "; with --decoder tinyllama: " + " ".join(DECODE_POLICIES)
                   + " (bf16: the weights cast to bfloat16; TinyLlama decoder only)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="encoder batch sizes (default 1 8 32)")
    p.add_argument("--seq", type=int, nargs="+", default=None,
                   help="encoder sequence lengths (default 16 128; --quick: 32)")
    p.add_argument("--hidden", type=int, default=None, help="decoder hidden size (default 2048; --quick: 1024)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; --quick: 2)")
    p.add_argument("--tokens", "--new-tokens", dest="tokens", type=int, default=None,
                   help="decoder: greedy tokens (default 32; --quick: 16)")
    p.add_argument("--prompt", type=int, default=16, help="decoder: prompt length (default 16)")
    p.add_argument("--builtin", action="store_true", help="use the built-in transformer even with transformers")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile policy")
    p.add_argument("--compile-decoder", action="store_true",
                   help="also torch.compile the decoder (off by default: generate() grows the KV cache every token, "
                        "and compiling its shapes took ~2 minutes here)")  # fmt: skip
    p.add_argument("--budget", type=float, default=None, help="seconds of timed pairs per measurement")
    p.add_argument("--max-call", type=float, default=None,
                   help="encoder: skip a PyTorch alternative (bf16 autocast, compile) at a batch predicted (from a "
                        "smaller batch) to take longer than this many seconds a call (default 10; --quick: 2)")
    p.add_argument("--quick", action="store_true",
                   help="main-job size: encoder at sequence 32, a 2-layer hidden-1024 decoder generating 16 tokens, no "
                        "torch.compile")
    p.add_argument("--decoder", default="small", choices=["small", "tinyllama"],
                   help="small: the LLaMA-style decoder above (default); tinyllama: the TinyLlama-1.1B shape decode "
                        "benchmark instead (transformers needed; ~4.4 GB fp32 per policy process; minutes)")
    p.add_argument("--llama-config", nargs="+", default=None, metavar="KEY=VALUE",
                   help="tinyllama: LlamaConfig fields replacing the TinyLlama shape's (e.g. num_hidden_layers=4)")
    p.add_argument("--reps", type=int, default=None, help="tinyllama: timed generate() runs per policy (default 3)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="tinyllama: DRAM read bandwidth in GB/s for the ceiling (default: measured)")
    p.add_argument("--profile", nargs="?", const="int8_weight_only", default=None, choices=DECODE_SUPPORTED,
                   help="tinyllama: profile one decode step of this policy (default int8_weight_only)")
    p.add_argument("--in-process", action="store_true",
                   help="tinyllama: run the policies in this process, one after the other (peak memory is then "
                        "not per policy)")
    p.add_argument("--out", default=None, help="folder for model.csv and model.png (default: none; --csv also works)")
    p.add_argument("--csv", default=None, help="write rows to this CSV file")


# ---------------------------------------------------------------------------------------------- built-in models
class _Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mask=None, cache=None, causal=False):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.h, D // self.h).transpose(1, 2) for f in (self.q, self.k, self.v))
        if cache is not None:
            if cache:
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            cache[:] = [k, v]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and T > 1)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class _EncoderLayer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.attn = _Attention(d, heads)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x, mask):
        x = self.ln1(x + self.attn(x, mask))
        return self.ln2(x + self.mlp(x))


class BuiltinEncoder(nn.Module):
    """BERT-style encoder (post-norm, GELU MLP in an nn.Sequential, so "fused" fuses its activation)."""

    def __init__(self, vocab=30522, d=384, layers=6, heads=12, ff=1536, max_len=512):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(_EncoderLayer(d, heads, ff) for _ in range(layers))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        x = self.ln(self.emb(input_ids) + self.pos(torch.arange(T, device=input_ids.device)))
        mask = attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, mask)
        return x


class _DecoderLayer(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.attn = _Attention(d, heads)
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.gate, self.up, self.down = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False), nn.Linear(ff, d,
                                                                                                            bias=False)

    def forward(self, x, cache):
        x = x + self.attn(self.n1(x), cache=cache, causal=True)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class BuiltinDecoder(nn.Module):
    """LLaMA-style decoder (pre-RMSNorm, SwiGLU MLP, learned positions instead of RoPE), with a KV cache."""

    def __init__(self, vocab=32000, d=2048, layers=4, heads=16, ff=5632, max_len=512):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(_DecoderLayer(d, heads, ff) for _ in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, input_ids, caches=None, start=0):
        T = input_ids.shape[1]
        x = self.emb(input_ids) + self.pos(torch.arange(start, start + T, device=input_ids.device))
        for i, layer in enumerate(self.layers):
            x = layer(x, None if caches is None else caches[i])
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------------------------------------- model adapters
def _use_hf(args) -> bool:
    if args.builtin:
        return False
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_encoder(hf: bool) -> nn.Module:
    torch.manual_seed(0)
    if hf:
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                         intermediate_size=1536)  # fmt: skip
        return BertModel(cfg, add_pooling_layer=False).eval()
    return BuiltinEncoder().eval()


def encoder_forward(model, hf: bool, ids, mask):
    if hf:
        return model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model(ids, mask)


def build_decoder(hf: bool, hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    ff = {1024: 2816, 2048: 5632}.get(hidden, hidden * 11 // 4)
    heads = max(1, hidden // 128)
    if hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512)
        return LlamaForCausalLM(cfg).eval()
    return BuiltinDecoder(d=hidden, layers=layers, heads=heads, ff=ff).eval()


def greedy(model, hf: bool, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """The ``tokens`` greedy tokens after ``prompt`` (KV cache)."""
    if hf:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
        return out[:, prompt.shape[1]:]
    caches = [[] for _ in model.layers]
    logits = model(prompt, caches, 0)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    out = [nxt]
    for i in range(tokens - 1):
        logits = model(nxt, caches, prompt.shape[1] + i)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
    return torch.cat(out, 1)


def decoder_logits(model, hf: bool, ids: torch.Tensor) -> torch.Tensor:
    if hf:
        return model(input_ids=ids).logits
    return model(ids)


# ---------------------------------------------------------------------------------------------- policies
def apply_policy(policy: str, original: nn.Module, example_inputs=None, decoder: bool = False):
    """(model, autocast?) for ``policy``, built from a copy of ``original`` (fp32 and bf16_autocast use it as is);
    ``example_inputs``: the workload of "auto" (a list of examples)."""
    if policy in ("fp32", "bf16_autocast"):
        return original, policy == "bf16_autocast"
    return convert_in_place(policy, copy.deepcopy(original), example_inputs, decoder)


def _ctx(autocast: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(1), b.double().flatten(1), dim=1).mean().item()


def _policy_list(args, decoder: bool = False) -> list[str]:
    skip_compile = args.no_compile or args.quick or (decoder and not args.compile_decoder)
    out = [p for p in args.policies or POLICIES if p in POLICIES and not (p == "compile" and skip_compile)]
    if "fp32" not in out:
        out.insert(0, "fp32")
    return out


# ---------------------------------------------------------------------------------------------- measurement
ENC_COLUMNS = [("policy", "policy", 16), ("batch", "batch", 5), ("seq", "seq", 4), ("ms", "ms", 9),
               ("per_s", "seq/s", 7), ("x_fp32", "x fp32", 6), ("x_best", "x best", 6), ("cosine", "cosine", 8),
               ("max_err", "max |err|", 9)]  # fmt: skip
DEC_COLUMNS = [("policy", "policy", 16), ("ms", "ms/token", 9), ("per_s", "tok/s", 7), ("x_fp32", "x fp32", 6),
               ("x_best", "x best", 6), ("cosine", "logit cos", 9), ("max_err", "max |logit err|", 15),
               ("token_match", "tokens = fp32", 13)]  # fmt: skip


def _judge(row: dict, best_torch: tuple[str, float]) -> tuple[str, float]:
    """Fill ``row["x_best"]`` against the best PyTorch policy so far at this shape, ``(name, x fp32)``; a PyTorch row
    may become that best (returned), a fastdl row is marked when it is slower than the fp32 original or that best."""
    x = row["x_fp32"]
    if row["policy"] in TORCH_POLICIES:
        if x > best_torch[1]:
            best_torch = (row["policy"], x)
        row["x_best"] = x / best_torch[1]
        return best_torch
    row["x_best"] = x / best_torch[1]
    checks = {"fp32 original": x}
    if best_torch[0] != "fp32":
        checks[f"best PyTorch ({best_torch[0]})"] = row["x_best"]
    mark_slower(row, checks)
    return best_torch


def run_encoder(args, hf: bool, env: dict, budget: float) -> list[dict]:
    batches = args.batch or [1, 8, 32]
    seqs = args.seq or ([32] if args.quick else [16, 128])
    activity("building the encoder")
    original = build_encoder(hf)
    n_params = sum(p.numel() for p in original.parameters())
    say(f"-- encoder: {'transformers BertModel' if hf else 'built-in encoder'}, hidden 384, 6 layers, MLP 1536, "
        f"{n_params / 1e6:.1f} M parameters; batch {batches}, sequence {seqs}")
    g = torch.Generator().manual_seed(1)
    # "auto" gets a workload of the shapes the model is run with (every batch size and sequence length timed below,
    # on other token ids): convert picks per layer the policy best over all of them, never slower at any
    example = []
    for b in batches:
        for s in seqs:
            ex_ids = torch.randint(1000, 30000, (b, s), generator=g)
            ex_mask = torch.ones_like(ex_ids)
            example.append({"input_ids": ex_ids, "attention_mask": ex_mask} if hf else (ex_ids, ex_mask))
    shapes = []
    for b in batches:
        for s in seqs:
            ids = torch.randint(1000, 30000, (b, s), generator=g)
            mask = torch.ones_like(ids)
            mask[b // 2:, s - s // 4:] = 0  # some padding in half of the batch, as in real batches
            with torch.no_grad():
                ref = encoder_forward(original, hf, ids, mask).float()
            shapes.append((b, s, ids, mask, ref))

    def call(m, ac, ids, mask):
        def f():
            with torch.no_grad(), _ctx(ac):
                return encoder_forward(m, hf, ids, mask)

        return f

    table = LiveTable(ENC_COLUMNS, title="   encoder latency per batch (policy by policy; each timed against fp32)")
    best_torch: dict[tuple, tuple[str, float]] = {}
    predictor = CallPredictor(args.max_call or (2.0 if args.quick else 10.0))
    for policy in _policy_list(args):
        if over_time(f"encoder policy {policy} and later"):
            break
        activity(f"encoder: building policy {policy}")
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                m, ac = apply_policy(policy, original, example)
        except Exception as exc:  # reported, the other policies still run
            say(f"   {policy}: conversion FAILED: {type(exc).__name__}: {exc}")
            continue
        if time.perf_counter() - t0 > 1.0:
            say(f"   {policy}: built in {time.perf_counter() - t0:.1f} s")
        for b, s, ids, mask, ref in shapes:
            if over_time(f"encoder policy {policy} from batch {b} seq {s} on, and later policies"):
                break
            activity(f"encoder {policy} batch {b} seq {s}")
            ok, pred = predictor.allowed(policy, b * s)
            if not ok and policy in TORCH_POLICIES and policy != "fp32":  # only a PyTorch alternative is skipped
                say(f"   {policy} not timed at batch {b} seq {s}: predicted {pred:.1f} s a call from a smaller batch "
                    f"(> {predictor.max_call_s:g} s; a slow path)")  # fmt: skip
                continue
            try:
                with torch.no_grad(), _ctx(ac):
                    out = encoder_forward(m, hf, ids, mask).float()
                fp32_call = call(original, False, ids, mask)
                fns = {"fp32": fp32_call} if policy == "fp32" else {"fp32": fp32_call, policy: call(m, ac, ids, mask)}
                t = interleaved(fns, budget_s=budget, min_reps=2 if args.quick else 3)
            except Exception as exc:
                say(f"   {policy} batch {b} seq {s}: FAILED: {type(exc).__name__}: {exc}")
                continue
            tp = t[policy]
            predictor.record(policy, b * s, tp)
            x = t["fp32"] / tp
            valid = mask.bool()
            row = {"op": "model", "model": "encoder", "impl": "transformers" if hf else "builtin", "policy": policy,
                   "batch": b, "seq": s, "ms": tp * 1e3, "reps": tp.reps, "reduced": tp.reduced, "per_s": b / tp,
                   "x_fp32": x, "x_best": None,
                   "cosine": _cos(out * valid[..., None], ref * valid[..., None]),
                   "max_err": (out - ref)[valid].abs().max().item(), **env}  # fmt: skip
            # every pair times fp32: x is relative to it
            best_torch[(b, s)] = _judge(row, best_torch.get((b, s), ("fp32", 1.0)))
            table.add(row)
        if m is not original:
            del m
    table.close("fastdl policies (encoder)", "the PyTorch policies")
    return table.rows


def run_decoder(args, hf: bool, env: dict, budget: float) -> list[dict]:
    hidden = args.hidden or (1024 if args.quick else 2048)
    layers = args.layers or (2 if args.quick else 4)
    activity("building the decoder")
    original = build_decoder(hf, hidden, layers)
    n_params = sum(p.numel() for p in original.parameters())
    T, P = args.tokens or (16 if args.quick else 32), args.prompt
    say(f"-- decoder: {'transformers LlamaForCausalLM' if hf else 'built-in decoder'}, hidden {hidden}, {layers} "
        f"layers, vocabulary 32000, {n_params / 1e6:.0f} M parameters ({n_params * 4 / 2**20:.0f} MiB fp32); "
        f"greedy decode of {T} tokens after a {P}-token prompt, batch 1")
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(100, 32000, (1, P), generator=g)
    with torch.no_grad():
        ref_tokens = greedy(original, hf, prompt, T)
        seq = torch.cat([prompt, ref_tokens], 1)
        ref_logits = decoder_logits(original, hf, seq).float()
    # "auto" is timed on the prompt (M = P) and one decode step (M = 1), the two shapes decoding runs
    example = [(prompt,), (prompt[:, :1],)]

    def call(m, ac):
        def f():
            with torch.no_grad(), _ctx(ac):
                return greedy(m, hf, prompt, T)

        return f

    fp32_call = call(original, False)
    table = LiveTable(DEC_COLUMNS, title="   decoder: greedy decoding, batch 1")
    best_torch = ("fp32", 1.0)  # every pair times fp32: x is relative to it
    if "compile" in (args.policies or POLICIES) and "compile" not in _policy_list(args, decoder=True):
        say("   compile: not measured for the decoder" + (" (--quick / --no-compile)" if args.quick or args.no_compile
            else " (--compile-decoder to include it: recompiling for each KV-cache length takes minutes)"))
    for policy in _policy_list(args, decoder=True):
        if over_time(f"decoder policy {policy} and later"):
            break
        activity(f"decoder: building policy {policy}")
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                m, ac = apply_policy(policy, original, example, decoder=True)
            dt = time.perf_counter() - t0
            if dt > 1.0:
                say(f"   {policy}: built in {dt:.1f} s")
            activity(f"decoder {policy}: decoding")
            with torch.no_grad(), _ctx(ac):
                toks = greedy(m, hf, prompt, T)
                logits = decoder_logits(m, hf, seq).float()
            fns = {"fp32": fp32_call} if policy == "fp32" else {"fp32": fp32_call, policy: call(m, ac)}
            t = interleaved(fns, budget_s=budget, min_reps=2 if args.quick else 3)
        except Exception as exc:
            say(f"   decoder {policy}: FAILED: {type(exc).__name__}: {exc}")
            continue
        tp = t[policy]
        x = t["fp32"] / tp
        row = {"op": "model", "model": "decoder", "impl": "transformers" if hf else "builtin", "policy": policy,
               "hidden": hidden, "layers": layers, "batch": 1, "tokens": T, "ms": tp * 1e3 / T, "reps": tp.reps,
               "reduced": tp.reduced, "per_s": T / tp, "x_fp32": x, "x_best": None,
               "cosine": _cos(logits[0], ref_logits[0]), "max_err": (logits - ref_logits).abs().max().item(),
               "token_match": (toks == ref_tokens).float().mean().item(), **env}  # fmt: skip
        best_torch = _judge(row, best_torch)
        table.add(row)
        if m is not original:
            del m
    table.close("fastdl policies (decoder)", "the PyTorch policies")
    return table.rows


def plot(rows: list[dict], path: str) -> str | None:
    """Bars of x fp32 per policy: encoder (one group per batch/sequence) and decoder."""
    plt = pyplot()
    if plt is None:
        return None
    kinds = [k for k in ("encoder", "decoder", "tinyllama") if any(r["model"] == k for r in rows)]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(7 * len(kinds), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rs = [r for r in rows if r["model"] == kind]
        pols = list(dict.fromkeys(r["policy"] for r in rs))
        groups = list(dict.fromkeys((r["batch"], r.get("seq")) for r in rs))
        width = 0.8 / max(1, len(groups))
        for gi, grp in enumerate(groups):
            vals = [next((r["x_fp32"] for r in rs if r["policy"] == p and (r["batch"], r.get("seq")) == grp), 0) or 0
                    for p in pols]  # fmt: skip (no fp32 row in the run: no ratio, a zero bar)
            label = f"batch {grp[0]}" + (f", seq {grp[1]}" if grp[1] else "")
            ax.bar([i + gi * width for i in range(len(pols))], vals, width, label=label)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(pols))], pols, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("speed vs the fp32 original (x)")
        ctx = rows[0]
        ax.set_title(f"{kind} ({ctx['isa_level']}{' capped' if ctx['isa_capped'] else ''})")
        ax.legend(fontsize=7)
    fig.suptitle(rows[0]["cpu_model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> list[dict]:
    t_start = time.monotonic()
    hf = _use_hf(args)
    print_header("model")
    env = env_columns("cpu")
    budget = args.budget if args.budget is not None else (0.5 if args.quick else 1.5)
    if not hf and not args.builtin:
        say("   transformers is not installed: the built-in transformer of the same shapes runs instead")
    rows: list[dict] = []
    models = args.models or (["decoder"] if args.decoder == "tinyllama" else ["encoder", "decoder"])
    if "bf16" in (args.policies or ()) and args.decoder != "tinyllama":
        say("   bf16: a policy of the TinyLlama decoder only (--decoder tinyllama): skipped here")
    if args.decoder == "tinyllama" and not hf:
        say("   --decoder tinyllama needs transformers (pip install transformers): the decoder is skipped")
        models = [m for m in models if m != "decoder"]
    try:
        if "encoder" in models:
            left = time_left()
            both = "decoder" in models
            if left is not None and both:  # a time box: the encoder gets 60% of it, the decoder the rest
                set_deadline(0.6 * left)
            try:
                rows += run_encoder(args, hf, env, budget)
            finally:
                if left is not None and both:
                    set_deadline(max(0.0, left - (time.monotonic() - t_start)))
        if "decoder" in models and not over_time("the decoder"):
            if args.decoder == "tinyllama":
                rows += run_tinyllama(args, env)
            else:
                rows += run_decoder(args, hf, env, budget)
    except KeyboardInterrupt:
        say("  interrupted: the rows above are complete")
    csv_path = args.csv or (os.path.join(args.out, "model.csv") if args.out else None)
    if csv_path:
        write_csv(rows, csv_path)
        png = plot(rows, os.path.splitext(csv_path)[0] + ".png")
        if png:
            say(f"plot: {png}")
    return rows


def main(argv=None):
    return module_main("python -m fastdl.bench.model", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
