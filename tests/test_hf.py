"""fastdl.hf: transformers' ``from_pretrained`` quantizes while loading (FastdlConfig) and reloads fastdl checkpoints
(quant_method "fastdl"), on small Llama-, BERT- and GPT-2-style models built from configs (random weights, no
download). Reloads run in one fresh process started in the repository root, with ``import fastdl`` only."""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import fastdl  # noqa: E402
from fastdl.hf import GUARD, FastdlConfig  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("fused", "int8", "int8_weight_only", "sparse24", "int4", "int4_weight_only")
IDS = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))


def _llama_config(**kw):
    from transformers import LlamaConfig

    args = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaConfig(**{**args, **kw})


def _to_2_4(model):
    """Zero the two smallest of every 4 input weights of each Linear (a model already 2:4, as sparse24 needs)."""
    with torch.no_grad():
        for m in model.modules():
            if type(m) is torch.nn.Linear:
                w = m.weight.view(-1, 4)
                drop = w.abs().argsort(dim=1)[:, :2]
                w.scatter_(1, drop, 0.0)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Full-precision checkpoints (save_pretrained), each model quantized on load and saved again, and one fresh
    process that reloads them all (first without fastdl, then with ``import fastdl``)."""
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        BertConfig,
        BertModel,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaForCausalLM,
    )

    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    LlamaForCausalLM(_llama_config()).save_pretrained(out / "llama")
    _to_2_4(LlamaForCausalLM(_llama_config())).save_pretrained(out / "llama24")
    BertModel(BertConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32)).save_pretrained(out / "bert")
    GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32)).save_pretrained(
        out / "gpt2")
    cases = {f"llama-{p}": ("llama24" if p == "sparse24" else "llama", p, "AutoModelForCausalLM") for p in POLICIES}
    cases["bert-int8_weight_only"] = ("bert", "int8_weight_only", "AutoModel")
    cases["gpt2-int8"] = ("gpt2", "int8", "AutoModelForCausalLM")
    before = {}
    for name, (src, policy, auto) in cases.items():
        cls = AutoModelForCausalLM if auto == "AutoModelForCausalLM" else AutoModel
        kw = {"group_size": 32} if policy.startswith("int4") else {}  # hidden 64: groups of 32
        model = cls.from_pretrained(out / src, quantization_config=FastdlConfig(policy=policy, **kw))
        with torch.no_grad():
            res = model(IDS)
        logits = res.logits if hasattr(res, "logits") else res.last_hidden_state
        model.save_pretrained(out / name)
        before[name] = {"logits": logits, "kinds": sorted({type(m).__name__ for m in model.modules()}),
                        "report": list(fastdl.report(model)), "auto": auto}  # fmt: skip
    torch.save(IDS, out / "ids.pt")
    spec = {n: v["auto"] for n, v in before.items()}
    res = subprocess.run([sys.executable, "-c", _RELOADER, str(out), json.dumps(spec)], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, before, torch.load(out / "after.pt")


_RELOADER = r"""
import json, os, sys, torch, transformers
out, spec = sys.argv[1], json.loads(sys.argv[2])
ids = torch.load(os.path.join(out, "ids.pt"))
after = {}
for name, auto in spec.items():  # transformers alone first: what a user who forgot fastdl gets
    try:
        getattr(transformers, auto).from_pretrained(os.path.join(out, name))
        after[name] = {"plain": "loaded"}
    except Exception as exc:
        after[name] = {"plain": f"{type(exc).__name__}: {exc}"}
assert "fastdl" not in sys.modules
import fastdl
for name, auto in spec.items():
    model = getattr(transformers, auto).from_pretrained(os.path.join(out, name))
    with torch.no_grad():
        res = model(ids)
    after[name].update(logits=res.logits if hasattr(res, "logits") else res.last_hidden_state,
                       kinds=sorted({type(m).__name__ for m in model.modules()}), training=model.training,
                       report=[dict(r) for r in fastdl.report(model)])
torch.save(after, os.path.join(out, "after.pt"))
"""


def test_import_fastdl_does_not_import_transformers():
    code = "import sys, fastdl; print('transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stdout + res.stderr


def test_registered_with_transformers():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZATION_CONFIG_MAPPING["fastdl"] is FastdlConfig
    assert AUTO_QUANTIZER_MAPPING["fastdl"].__name__ == "FastdlHfQuantizer"


@pytest.mark.parametrize("name", ["llama-fused", "llama-int8", "llama-int8_weight_only", "llama-sparse24",
                                  "llama-int4", "llama-int4_weight_only", "bert-int8_weight_only", "gpt2-int8"])
def test_quantize_on_load_save_reload_bit_identical_in_a_fresh_process(name, saved):
    out, before, after = saved
    cfg = json.loads((out / name / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fastdl" and qc["format"] == "fastdl.recipe" and qc["version"] == 1
    assert "model.safetensors" in os.listdir(out / name)
    assert after[name]["kinds"] == before[name]["kinds"]
    assert torch.equal(after[name]["logits"], before[name]["logits"])  # bit-identical
    assert after[name]["training"] is False
    kinds = before[name]["kinds"]
    if {"Int8Linear", "Sparse24Linear", "Int4Linear"} & set(kinds):  # transformers alone must stop, naming the fix
        assert cfg["transformers_weights"] == GUARD
        assert after[name]["plain"].startswith("ValueError") and "import fastdl" in after[name]["plain"]
    else:  # float nn.Linear weights: transformers alone loads them (it skips the unknown method)
        assert "transformers_weights" not in cfg and after[name]["plain"] == "loaded"
    converted = [r for r in after[name]["report"] if r["kernel"] != "original"]
    assert converted and all(r["note"] == "loaded" for r in converted)


def test_converted_layers_and_full_precision_defaults(saved):
    _, before, _ = saved
    rows = {r["layer"]: r for r in before["llama-int8_weight_only"]["report"]}
    assert rows["model.layers.0.mlp.down_proj"]["kernel"] == "int8_weight_only"
    assert rows["model.layers.0.mlp.down_proj"]["bytes_after"] < 0.3 * rows["model.layers.0.mlp.down_proj"][
        "bytes_before"]
    assert rows["lm_head"]["kernel"] == "original" and "modules_to_not_convert" in rows["lm_head"]["note"]
    assert rows["model.embed_tokens"]["kernel"] == "original"
    assert any("norm" in r["layer"] for r in before["llama-int8_weight_only"]["report"])
    # GPT-2's Conv1D layers are converted; its lm_head is tied to the embeddings and kept
    gpt2 = {r["layer"]: r for r in before["gpt2-int8"]["report"]}
    assert gpt2["transformer.h.0.attn.c_attn"]["kernel"] == "int8" and gpt2["lm_head"]["kernel"] == "original"
    assert "Int8Linear" in before["bert-int8_weight_only"]["kinds"]


def test_quantized_logits_close_to_full_precision(saved):
    from transformers import AutoModelForCausalLM

    out, before, _ = saved
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out / "llama")(IDS).logits
        ref24 = AutoModelForCausalLM.from_pretrained(out / "llama24")(IDS).logits
    for policy, tol in (("fused", 1e-5), ("int8_weight_only", 0.02), ("int8", 0.05), ("sparse24", 1e-5),
                        ("int4_weight_only", 0.2), ("int4", 0.2)):
        r = ref24 if policy == "sparse24" else ref
        err = (before[f"llama-{policy}"]["logits"].double() - r.double()).norm() / r.double().norm()
        assert err < tol, (policy, float(err))


def test_modules_to_not_convert(saved):
    from transformers import AutoModelForCausalLM

    out, _, _ = saved
    model = AutoModelForCausalLM.from_pretrained(out / "llama", quantization_config=FastdlConfig(
        policy="int8", modules_to_not_convert=["up_proj", "model.layers.0", "lm_head"]))  # suffix, prefix (as bnb)
    rows = {r["layer"]: r for r in fastdl.report(model)}
    assert rows["model.layers.1.mlp.up_proj"]["kernel"] == "original"
    assert rows["model.layers.0.self_attn.q_proj"]["kernel"] == "original"
    assert rows["model.layers.1.self_attn.q_proj"]["kernel"] == "int8"
    assert "modules_to_not_convert" in rows["model.layers.1.mlp.up_proj"]["note"]
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear


def test_generate_compile_and_dequantize(saved):
    from transformers import AutoModelForCausalLM

    out, _, _ = saved
    model = AutoModelForCausalLM.from_pretrained(out / "llama-int8_weight_only")
    gen = model.generate(IDS, max_new_tokens=4, do_sample=False)
    assert gen.shape == (2, 11) and torch.equal(gen[:, :7], IDS)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(IDS).logits, model(IDS).logits, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        q = model(IDS).logits
    plain = model.dequantize()
    assert not any(type(m).__name__ in ("Int8Linear", "FusedLinear") for m in plain.modules())
    assert getattr(plain.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, q, rtol=1e-3, atol=1e-3)


def test_load_pretrained_is_an_alias(saved):
    from transformers import LlamaForCausalLM

    out, before, _ = saved
    model = fastdl.load_pretrained(LlamaForCausalLM, out / "llama-int8")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before["llama-int8"]["logits"])


def test_int8_act7_on_load_save_and_reload(saved, tmp_path):
    """FastdlConfig(policy="int8_act7"): Int8Linear layers with 7-bit activations, reported as such, and
    save_pretrained + load_pretrained keep the setting (the recipe carries it), logits bit for bit."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from fastdl.nn import Int8Linear

    out, _, _ = saved
    model = AutoModelForCausalLM.from_pretrained(out / "llama", quantization_config=FastdlConfig(policy="int8_act7"))
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.act_bits == 7 and m.mode == "dynamic" for m in layers)
    rows = {r["layer"]: r for r in fastdl.report(model)}
    assert rows["model.layers.0.mlp.down_proj"]["kernel"] == "int8_act7"
    model.save_pretrained(tmp_path / "act7")
    back = fastdl.load_pretrained(LlamaForCausalLM, tmp_path / "act7")
    assert all(m.act_bits == 7 for m in back.modules() if isinstance(m, Int8Linear))
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, model(IDS).logits)


# ------------------------------------------------------------------------------------------ bad input
def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'int9'; known policies: fused, int8, .*int4_weight_only"):
        FastdlConfig(policy="int9")
    with pytest.raises(ValueError, match="group_size"):
        FastdlConfig(policy="int8_weight_only", group_size=32)
    with pytest.raises(ValueError, match=r"policy='int4'\): group_size must be 'auto' \(128\), 32, 64 or 128, got 16"):
        FastdlConfig(policy="int4", group_size=16)
    with pytest.raises(ValueError, match="group_size"):
        FastdlConfig(policy="int4_weight_only", group_size=None)


def test_int4_on_load_is_the_conversion_of_the_loaded_model(saved):
    """Quantizing while loading gives the layers fastdl.convert gives the full-precision model (the same quantizer,
    bit for bit); lm_head is kept (transformers' default), and in_features that is not a multiple of the group raises
    naming the layers."""
    from transformers import AutoModelForCausalLM

    out, before, _ = saved
    from fastdl.nn import Int4Linear

    full = AutoModelForCausalLM.from_pretrained(out / "llama")
    for name, m in list(full.named_modules()):
        if type(m) is torch.nn.Linear and name != "lm_head":
            parent, _, child = name.rpartition(".")
            setattr(full.get_submodule(parent), child, Int4Linear.from_linear(m, group_size=32))
    with torch.no_grad():
        assert torch.equal(full(IDS).logits, before["llama-int4_weight_only"]["logits"])
    rows = {r["layer"]: r for r in before["llama-int4"]["report"]}
    assert rows["model.layers.0.mlp.down_proj"]["kernel"] == "int4" and rows["lm_head"]["kernel"] == "original"
    with pytest.raises(ValueError, match=r"FastdlConfig\(policy='int4_weight_only'\): 12 layer\(s\) cannot be "
                                         r"converted, in_features must be a multiple of 128: "
                                         r"model.layers.0.self_attn.q_proj \(in_features=64\)"):  # fmt: skip
        AutoModelForCausalLM.from_pretrained(out / "llama", quantization_config=FastdlConfig(policy="int4_weight_only"))


def test_sparse24_needs_2_4_weights_and_shapes(saved, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out, _, _ = saved
    with pytest.raises(ValueError, match=r"could not convert 14 layer\(s\).*model.layers.0.self_attn.q_proj: its "
                                         r"weight is not 2:4"):  # fmt: skip
        AutoModelForCausalLM.from_pretrained(out / "llama", quantization_config=FastdlConfig(policy="sparse24"))
    LlamaForCausalLM(_llama_config(intermediate_size=30)).save_pretrained(tmp_path / "odd")
    with pytest.raises(ValueError, match=r"2 layer\(s\) cannot be converted.*down_proj \(in_features=30\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "odd", quantization_config=FastdlConfig(policy="sparse24"))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_newer_format_version_and_tampered_checkpoints(saved, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out, _, _ = saved
    d = _copy(out / "llama-int8_weight_only", tmp_path / "newer")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["version"] = 99
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fastdl.CheckpointError, match="format version 99 is newer than this fastdl's"):
        AutoModelForCausalLM.from_pretrained(d)
    d = _copy(out / "llama-int8_weight_only", tmp_path / "shape")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight_scale"] = sd["model.layers.1.mlp.up_proj.weight_scale"][:5].clone()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(fastdl.CheckpointError, match=r"layer 'model.layers.1.mlp.up_proj'.*weight_scale"):
        AutoModelForCausalLM.from_pretrained(d)
    del sd["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(fastdl.CheckpointError, match=r"layer 'model.layers.1.mlp.up_proj'"):
        AutoModelForCausalLM.from_pretrained(d)


# ------------------------------------------------------------------------------------------ memory (opt-in)
_PEAK = r"""
try:  # a forked child starts with its parent's peak RSS (Linux keeps it across exec): reset it
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
import resource, sys, torch, transformers
import fastdl
from fastdl.hf import FastdlConfig
kw = {"quantization_config": FastdlConfig(policy=sys.argv[2])} if sys.argv[2] != "none" else {}
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32, **kw)
loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.no_grad():  # a full-precision model's weights stay in the mmapped file until first read: use it once
    model(torch.zeros(1, 4, dtype=torch.long))
print(loaded, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


_WRITE_BIG = r"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
model.to_empty(device="cpu")
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.02)
model.save_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()))
"""


@pytest.mark.skipif(os.environ.get("FASTDL_HF_RSS") != "1", reason="opt-in (FASTDL_HF_RSS=1): writes a 3 GB "
                    "checkpoint and loads it twice")  # fmt: skip
def test_peak_rss_quantize_on_load_vs_full_precision(tmp_path):
    """Peak RSS (ru_maxrss) of from_pretrained with FastdlConfig('int8_weight_only') vs a full-precision load of
    the same fp32 checkpoint, each in its own process: a Llama of 778 M parameters (hidden 1536, 24 layers). The
    full-precision model's weights are mmapped from the file and become resident when first read, so the bar is on
    the peak after one forward pass (the peak right after from_pretrained is printed too)."""
    res = subprocess.run([sys.executable, "-c", _WRITE_BIG, str(tmp_path / "big")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    n = int(res.stdout.split()[-1])
    peaks = {}
    for policy in ("none", "int8_weight_only"):
        res = subprocess.run([sys.executable, "-c", _PEAK, str(tmp_path / "big"), policy], cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=1200)
        assert res.returncode == 0, res.stderr[-3000:]
        peaks[policy] = [int(v) / 2**20 for v in res.stdout.split()[-2:]]  # GiB: after loading, after a forward
    fp, q = peaks["none"], peaks["int8_weight_only"]
    print(f"params {n / 1e6:.0f} M, peak RSS (GiB) after from_pretrained / after one forward: full precision "
          f"{fp[0]:.2f} / {fp[1]:.2f}, int8_weight_only {q[0]:.2f} / {q[1]:.2f}, ratio {q[1] / fp[1]:.2f}")
    assert n >= 500e6 and q[1] <= 0.6 * fp[1]


# ------------------------------------------------------------------------------------ no `import fastdl` at all
# An installed wheel puts fastdl-kernels-hf.pth and the top-level module _fastdl_hf_autoload (a copy of
# fastdl/_hf_autoload.py) into site-packages (setup.py: BuildPy). These tests build the same pair in a temporary
# directory and make it a site directory (site.addsitedir processes its .pth files exactly as at start-up).
_PTH = "fastdl-kernels-hf.pth"


def _site_dir(path, module=True):
    path.mkdir(parents=True, exist_ok=True)
    with open(os.path.join(ROOT, "fastdl", _PTH), encoding="utf-8") as f:
        (path / _PTH).write_text(f.read())
    if module is True:
        with open(os.path.join(ROOT, "fastdl", "_hf_autoload.py"), encoding="utf-8") as f:
            module = f.read()
    if module:
        (path / "_fastdl_hf_autoload.py").write_text(module)
    return str(path)


def _python(code, *args, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT, **(env or {})}, timeout=300)  # fmt: skip


def test_pth_file_is_one_import_line_guarded():
    from fastdl import _hf_autoload

    with open(os.path.join(ROOT, "fastdl", _PTH), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ") and "except Exception" in lines[0]
    assert _hf_autoload.WATCHED == fastdl.hf._REGISTRY  # the module fastdl.hf registers after


_AUTOLOAD = r"""
import site, sys
site.addsitedir(sys.argv[1])                  # what the installed .pth file does at start-up
import torch, transformers
assert "fastdl" not in sys.modules
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2])   # no fastdl-specific call
with torch.no_grad():
    logits = model(torch.load(sys.argv[3])).logits
torch.save({"logits": logits, "kinds": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()}),
            "fastdl.hf": "fastdl.hf" in sys.modules}, sys.argv[4])
"""


def test_from_pretrained_without_import_fastdl_through_the_pth_file(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "fp")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp",
                                                 quantization_config=FastdlConfig(policy="int8_weight_only"))
    with torch.no_grad():
        logits = model(IDS).logits
    model.save_pretrained(tmp_path / "q")
    torch.save(IDS, tmp_path / "ids.pt")
    res = _python(_AUTOLOAD, _site_dir(tmp_path / "site"), tmp_path / "q", tmp_path / "ids.pt", tmp_path / "out.pt")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    after = torch.load(tmp_path / "out.pt")
    assert after["fastdl.hf"]
    assert "fastdl.nn.int8.Int8Linear" in after["kinds"], after["kinds"]
    assert torch.equal(after["logits"], logits)  # bit-identical


_STARTUP = r"""
import site, sys
site.addsitedir(sys.argv[1])
print(",".join(type(f).__name__ for f in sys.meta_path))
print(",".join(m for m in ("torch", "fastdl", "transformers", "importlib.util") if m in sys.modules))
"""


def test_pth_start_up_imports_nothing_heavy(tmp_path):
    res = _python(_STARTUP, _site_dir(tmp_path / "site"))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    finders, loaded = res.stdout.splitlines()
    assert finders.split(",")[0] == "FastdlHfAutoload"
    assert "torch" not in loaded and "fastdl" not in loaded.split(",") and "transformers" not in loaded


@pytest.mark.parametrize("value,installed", [("1", False), ("yes", False), ("0", True), ("", True)])
def test_pth_opt_out_env_var(tmp_path, value, installed):
    res = _python(_STARTUP, _site_dir(tmp_path / "site"), env={"FASTDL_NO_HF_AUTOLOAD": value})
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert ("FastdlHfAutoload" in res.stdout.splitlines()[0]) is installed


@pytest.mark.parametrize("module", [None, "raise RuntimeError('broken')\n", "def broken(:\n"],
                         ids=["missing", "raises", "syntax-error"])
def test_pth_line_never_breaks_start_up(tmp_path, module):
    """A .pth line that raises prints a traceback at every start of every Python in the environment: the line
    swallows any error of the module it imports (missing, raising, unparsable)."""
    res = _python(_STARTUP, _site_dir(tmp_path / "site", module=module or ""))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "FastdlHfAutoload" not in res.stdout


def test_broken_fastdl_only_warns_when_transformers_loads(tmp_path):
    """fastdl installed but not importable: transformers' import goes on, with a warning that names fastdl."""
    fake = tmp_path / "fake"
    (fake / "fastdl").mkdir(parents=True)
    (fake / "fastdl" / "__init__.py").write_text("raise ImportError('fastdl is broken here')\n")
    code = ("import site, sys, warnings; site.addsitedir(sys.argv[1]); warnings.simplefilter('always')\n"
            "import transformers.quantizers.auto as a; print('fastdl' in a.AUTO_QUANTIZER_MAPPING)")
    res = _python(code, _site_dir(tmp_path / "site"), env={"PYTHONPATH": str(fake)}, cwd=tmp_path)  # not ROOT
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "False"
    assert "could not import fastdl.hf" in res.stderr and "fastdl is broken here" in res.stderr
