"""Converted models save, load and convert back like any other: state dicts of tensors only (safetensors,
weights_only), fastdl.save / fastdl.load into an unconverted skeleton, Hugging Face save_pretrained /
fastdl.load_pretrained in a fresh process (bit-identical outputs, file size as fastdl.report states), one checkpoint
error type, and the one layer-matching rule shared by convert, quant and sparsity."""

import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TESTS_DIR
from torch import nn

import fastdl
from fastdl import quant, sparsity
from fastdl._layers import find_layers
from fastdl.nn import CheckpointError, FusedActivation, FusedLinear, Int8Linear, Sparse24Linear, decode_extra_state
from fastdl.nn._base import encode_extra_state

ROOT = os.path.dirname(TESTS_DIR)
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_safetensors = pytest.mark.skipif(not HAS_SAFETENSORS, reason="needs safetensors (pip install safetensors)")
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="needs transformers (requirements/dev.txt; pip install transformers)"
)
POLICIES = ("fused", "int8", "int8_weight_only", "sparse24", "auto")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 64), nn.GELU(), nn.Sequential(nn.Linear(64, 40), nn.ReLU()), nn.Linear(40, 8))


def _convert(model, policy, x):
    if policy == "sparse24":
        sparsity.prune(model)
    kwargs = {"example_inputs": (x,)} if policy == "auto" else {}
    return fastdl.convert(model, policy, **kwargs)


def _pruned():
    m = nn.Sequential(nn.Linear(40, 24))
    sparsity.prune(m, permute=True)
    return m


KINDS = {
    "fused": lambda: FusedLinear.from_linear(nn.Linear(40, 24), "relu"),
    "int8": lambda: Int8Linear.from_linear(nn.Linear(40, 24)),
    "int8_weight_only": lambda: Int8Linear.from_linear(nn.Linear(40, 24), mode="weight_only"),
    "int8_qat": lambda: Int8Linear.from_linear(nn.Linear(40, 24), trainable=True),
    "sparse24": lambda: Sparse24Linear.from_linear(nn.Linear(40, 24), dtype=torch.bfloat16),
    "pruned": _pruned,
}


# ------------------------------------------------------------------------------------------ state dicts of tensors
@pytest.mark.parametrize("kind", list(KINDS))
def test_state_dict_holds_only_tensors_and_loads_weights_only(kind, tmp_path):
    m = KINDS[kind]()
    sd = m.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in sd.values()), {k: type(v) for k, v in sd.items()}
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    if HAS_SAFETENSORS:
        from safetensors.torch import load_file, save_file

        save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "m.safetensors")
        loaded = load_file(tmp_path / "m.safetensors")
    fresh = KINDS[kind]()
    fresh.load_state_dict(loaded)
    x = torch.randn(3, 40)
    if kind == "sparse24":
        x = x.bfloat16()
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), m.eval()(x))


def test_extra_state_records_and_older_dict_records():
    rec = decode_extra_state(Int8Linear(8, 4).state_dict()["_extra_state"])
    assert rec["format"] == "fastdl.Int8Linear" and rec["version"] == 3 and rec["mode"] == "dynamic"
    rec = decode_extra_state(Sparse24Linear(8, 4).state_dict()["_extra_state"])
    assert rec == {"format": "fastdl.sparse24", "version": 2, "in_features": 8, "out_features": 4,
                   "meta_layout": rec["meta_layout"]}  # fmt: skip
    m = Sparse24Linear(8, 4)
    sd = m.state_dict()
    sd["_extra_state"] = {"format": "fastdl.sparse24", "version": 1, "in_features": 8, "out_features": 4}  # v1
    fresh = Sparse24Linear(8, 4)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.values, m.values)
    lin = nn.Linear(8, 4)
    v2 = {k: v for k, v in Int8Linear.from_linear(lin, mode="weight_only").state_dict().items()}
    v2["_extra_state"] = {**decode_extra_state(v2["_extra_state"]), "version": 2}  # fastdl's v2: a dict
    fresh = Int8Linear(8, 4, mode="weight_only")
    fresh.load_state_dict(v2)
    assert torch.equal(fresh.qweight, v2["weight"])


@pytest.mark.parametrize("cls, fmt", [(Int8Linear, "fastdl.Int8Linear"), (Sparse24Linear, "fastdl.sparse24")])
def test_one_checkpoint_error_with_one_wording(cls, fmt):
    model = nn.Sequential(cls(16, 8))
    sd = model.state_dict()
    newer = dict(sd, **{"0._extra_state": encode_extra_state({**decode_extra_state(sd["0._extra_state"]),
                                                               "version": 99})})  # fmt: skip
    with pytest.raises(CheckpointError, match=rf"^{fmt} checkpoint '0\.': format version 99 is newer than"):
        nn.Sequential(cls(16, 8)).load_state_dict(newer)
    other = dict(sd, **{"0._extra_state": encode_extra_state({"format": "something.else", "version": 1})})
    with pytest.raises(CheckpointError, match=rf"^{fmt} checkpoint '0\.': _extra_state is not a {fmt} record"):
        nn.Sequential(cls(16, 8)).load_state_dict(other)
    shape = r"(size mismatch|records in_features = 16, this layer has 20)"
    with pytest.raises(CheckpointError, match=rf"^{fmt} checkpoint '0\.': .*{shape}"):
        nn.Sequential(cls(20, 8)).load_state_dict(sd)
    assert issubclass(CheckpointError, RuntimeError) and issubclass(CheckpointError, ValueError)
    assert fastdl.CheckpointError is CheckpointError


# ------------------------------------------------------------------------------------------ fastdl.save / load
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
@pytest.mark.parametrize("policy", POLICIES)
def test_save_load_into_unconverted_skeleton(policy, suffix, tmp_path):
    if suffix == ".safetensors" and not HAS_SAFETENSORS:
        pytest.skip("needs safetensors")
    x = torch.randn(5, 24)
    model = _convert(_mlp(), policy, x).eval()
    with torch.no_grad():
        ref = model(x)
    path = tmp_path / f"model{suffix}"
    fastdl.save(model, path)
    if suffix == ".pt":
        assert set(torch.load(path, weights_only=True)) == {"fastdl_recipe", "state_dict"}
    skeleton = _mlp(seed=1)  # other weights: everything must come from the file
    loaded = fastdl.load(skeleton, path).eval()
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    with torch.no_grad():
        assert torch.equal(loaded(x), ref)


def test_save_load_pruned_permuted_fused_root_and_tied(tmp_path):
    x = torch.randn(6, 24)
    model = fastdl.convert(_mlp(), "fused")
    sparsity.prune(model, permute=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sparsity.MaskedTraining(model, opt):
        model(x).square().mean().backward()
        opt.step()
    assert isinstance(model[1], FusedActivation) and model[1].activation == "gelu"
    path = tmp_path / "pruned.pt"
    fastdl.save(model, path)
    loaded = fastdl.load(_mlp(seed=3), path)
    assert sparsity.is_pruned(loaded[0]) and isinstance(loaded[1], FusedActivation)
    assert loaded[0].input_permutation is not None or model[0].input_permutation is None
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    for name, mask in sparsity.masks(loaded).items():
        assert torch.equal(mask, sparsity.masks(model)[name])

    root = Int8Linear.from_linear(nn.Linear(24, 8), mode="weight_only")  # the model itself is a converted layer
    fastdl.save(root, tmp_path / "root.pt")
    again = fastdl.load(nn.Linear(24, 8), tmp_path / "root.pt")
    assert isinstance(again, Int8Linear) and torch.equal(again(x), root(x))

    if HAS_SAFETENSORS:  # tied weights: stored once, restored as one tensor
        tied = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        tied[1].weight = tied[0].weight
        fastdl.convert(tied, "fused")
        fastdl.save(tied, tmp_path / "tied.safetensors")
        fresh = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        fresh[1].weight = fresh[0].weight
        fresh = fastdl.load(fresh, tmp_path / "tied.safetensors")
        assert fresh[0].weight is fresh[1].weight and torch.equal(fresh[0].weight, tied[0].weight)


def test_load_errors_name_the_problem(tmp_path):
    model = fastdl.convert(_mlp(), "int8")
    fastdl.save(model, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match="layer '2.0'.*does not have"):
        fastdl.load(nn.Sequential(nn.Linear(24, 64)), tmp_path / "m.pt")
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        fastdl.load("model", tmp_path / "m.pt")


# ------------------------------------------------------------------------------------------ damaged files (issue 34)
def _saved(tmp_path, suffix):
    model = fastdl.convert(_mlp(), "int8")
    path = tmp_path / f"good{suffix}"
    fastdl.save(model, path)
    return path.read_bytes()


def _damage(data: bytes, how: str) -> bytes:
    if how == "empty":
        return b""
    if how == "random":
        return bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist())
    if how == "truncated-half":
        return data[: len(data) // 2]
    if how == "truncated-8":
        return data[:8]
    if how == "truncated-1":
        return data[:-1]
    if how == "header-bytes":  # bytes of the safetensors JSON header (or the zip's first entry) overwritten
        return data[:8] + b"\xff" * 24 + data[32:]
    if how == "header-length":  # safetensors: the header length field says 2**62
        return (2**62).to_bytes(8, "little") + data[8:]
    raise ValueError(how)


DAMAGE = ["empty", "random", "truncated-half", "truncated-8", "truncated-1", "header-bytes", "header-length"]


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("suffix", [pytest.param(".safetensors", marks=needs_safetensors), ".pt"])
def test_load_of_a_damaged_file_is_a_checkpoint_error_naming_it(suffix, how, tmp_path):
    path = tmp_path / f"damaged{suffix}"
    path.write_bytes(_damage(_saved(tmp_path, suffix), how))
    with pytest.raises(CheckpointError, match=f"checkpoint '{path}'.*not a readable") as info:
        fastdl.load(_mlp(), path)
    assert info.value.__cause__ is not None  # the reader's own error, chained


def test_load_of_a_missing_file_stays_file_not_found(tmp_path):
    for suffix in (".pt", ".safetensors") if HAS_SAFETENSORS else (".pt",):
        with pytest.raises(FileNotFoundError):
            fastdl.load(_mlp(), tmp_path / f"missing{suffix}")
    with pytest.raises(FileNotFoundError):
        fastdl.load(_mlp(), tmp_path)  # a directory without weights


def _recipe_of(model) -> dict:
    return json.loads(json.dumps(fastdl.serialization.recipe(model)))


def _bad_recipes(rec: dict) -> list:
    layer = next(iter(rec["layers"]))
    return [
        ("not a fastdl conversion recipe", {"format": "other"}),
        ("version must be an int from 1", {**rec, "version": 0}),
        ("version must be an int from 1", {**rec, "version": "1"}),
        ("format version 99 is newer", {**rec, "version": 99}),
        ("must map to a dict with a 'type'", {**rec, "layers": {layer: 5}}),
        ("must map to a dict with a 'type'", {**rec, "layers": {layer: {"kind": "Int8Linear"}}}),
        (r"cannot be built \(TypeError", {**rec, "layers": {layer: {"type": "Int8Linear", "nope": 1}}}),
        (r"cannot be built \(ValueError", {**rec, "layers": {layer: {"type": "Int8Linear", "mode": "nope"}}}),
        ("dtype must name a torch dtype", {**rec, "layers": {layer: {"type": "Sparse24Linear", "dtype": "nope"}}}),
        (r"cannot be built \(KeyError", {**rec, "layers": {layer: {"type": "Sparse24Linear"}}}),
        ("unknown layer type 'Nope'", {**rec, "layers": {layer: {"type": "Nope"}}}),
        ("'root' must be a class name", {**rec, "root": 3}),
    ]


@needs_safetensors
def test_bad_safetensors_metadata_is_a_checkpoint_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = fastdl.convert(_mlp(), "int8")
    good = tmp_path / "good.safetensors"
    fastdl.save(model, good)
    sd = load_file(good)
    rec = _recipe_of(model)
    cases = [
        ("fastdl.recipe metadata is not valid JSON", {"fastdl.recipe": "{nope"}),
        ("fastdl.aliases metadata is not valid JSON", {"fastdl.aliases": "[1,"}),
        ("fastdl.aliases metadata must map names to names", {"fastdl.aliases": "[1]"}),
        ("an alias of 'nope', which is not a tensor", {"fastdl.aliases": json.dumps({"x": "nope"})}),
    ] + [(m, {"fastdl.recipe": json.dumps(r)}) for m, r in _bad_recipes(rec)]
    path = tmp_path / "bad.safetensors"
    for match, meta in cases:
        save_file(sd, path, metadata={"format": "pt", **meta})
        with pytest.raises(CheckpointError, match=f"checkpoint '{path}.*{match}"):
            fastdl.load(_mlp(), path)


def test_bad_torch_checkpoints_are_checkpoint_errors(tmp_path):
    model = fastdl.convert(_mlp(), "int8")
    good = tmp_path / "good.pt"
    fastdl.save(model, good)
    obj = torch.load(good, weights_only=True)
    cases = [(m, {**obj, "fastdl_recipe": r}) for m, r in _bad_recipes(obj["fastdl_recipe"])] + [
        ("holds a list, not a state dict", [torch.ones(1)]),
        ("entry '0.weight' holds a int, not a tensor", {"0.weight": 3}),
        ("holds a str, not a state dict", {"fastdl_recipe": obj["fastdl_recipe"], "state_dict": "x"}),
        ("weights do not fit this Sequential .*size mismatch", {**_mlp().state_dict(), "0.weight": torch.ones(3, 3)}),
    ]
    path = tmp_path / "bad.pt"
    for match, o in cases:
        torch.save(o, path)
        with pytest.raises(CheckpointError, match=f"checkpoint '{path}.*{match}"):
            fastdl.load(_mlp(), path)
    with pytest.raises(CheckpointError, match="not a fastdl conversion recipe"):  # the public helper too
        fastdl.serialization.apply_recipe(_mlp(), {"format": "other"})


def test_damaged_hf_directory_files_are_checkpoint_errors(tmp_path):
    model = _mlp()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{not json")
    with pytest.raises(CheckpointError, match="config.json.*not a readable config.json"):
        fastdl.load(_mlp(), tmp_path)
    (tmp_path / "config.json").write_text("{}")
    fastdl.load(_mlp(), tmp_path)  # fine
    (tmp_path / "pytorch_model.bin.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(CheckpointError, match="index.json.*'weight_map' must map"):
        fastdl.load(_mlp(), tmp_path)


# ------------------------------------------------------------------------------------------ one layer-matching rule
class _MyLinear(nn.Linear):  # a subclass may change forward: fastdl leaves it alone
    def forward(self, x):
        return super().forward(x) * 2


def _nested():
    torch.manual_seed(0)
    shared = nn.Linear(16, 16)
    return nn.ModuleDict({
        "attn": nn.MultiheadAttention(16, 2, batch_first=True),  # out_proj is an nn.Linear subclass it reads directly
        "body": nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Sequential(shared, _MyLinear(16, 16), shared)),
        "head": nn.Linear(16, 4),
    })


def test_one_matching_rule_for_convert_quant_and_sparsity():
    names = [s.name for s in find_layers(_nested())]
    assert names == ["body.0", "body.2.0", "body.2.2", "head"]  # exact nn.Linear, nested, in module order
    for convert in (lambda m: fastdl.convert(m, "fused"), quant.quantize_model,
                    lambda m: sparsity.sparsify(m, include_2_4=True) if sparsity.prune(m) else m):  # fmt: skip
        model = convert(_nested())
        assert type(model["attn"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
        assert type(model["body"][2][1]) is _MyLinear
        assert type(model["head"]) is not nn.Linear and type(model["body"][0]) is not nn.Linear
        assert model["body"][2][0] is model["body"][2][2]  # a layer registered twice: one shared replacement
    report = sparsity.prune(_nested(), filter_fn=lambda name, m: name != "head")
    assert sorted(report.pruned) == ["body.0", "body.2.0"]
    assert report.skipped == {"body.2.2": "already pruned", "head": "excluded by filter_fn"}  # 2.2 is 2.0


def test_is_2_4_is_the_one_pattern_check():
    w = torch.tensor([[1.0, 0, 2, 0, 0, 0, 0, 3], [0, 0, 0, 0, 1, 1, 0, 0]])
    assert sparsity.is_2_4(w) and not sparsity.is_2_4(torch.ones(2, 8)) and not sparsity.is_2_4(torch.ones(2, 6))
    assert sparsity.is_2_4(torch.zeros(0, 8))
    model = _mlp()
    sparsity.prune(model)
    assert all(sparsity.is_2_4(m.weight) for m in model.modules() if sparsity.is_pruned(m))
    assert [r["pattern_2_4"] for r in sparsity.sparsity_report(model)] == [True, True, True]


def test_convert_rejects_what_is_not_a_module():
    with pytest.raises(TypeError, match=r"fastdl.convert: model must be a torch.nn.Module, got str"):
        fastdl.convert("model.pt", "fused")
    with pytest.raises(TypeError, match="got dict"):
        fastdl.convert({"w": torch.ones(2)}, "int8")
    with pytest.raises(ValueError, match="unknown policy 3"):
        fastdl.convert(_mlp(), 3)


# ------------------------------------------------------------------------------------------ Hugging Face
_LOADER = r"""
import json, logging, os, sys, torch
import transformers
from transformers import LlamaForCausalLM
out_dir = sys.argv[1]
ids = torch.load(os.path.join(out_dir, "ids.pt"))
logs = []
class Grab(logging.Handler):
    def emit(self, record):
        logs.append(record.getMessage())
transformers.utils.logging.get_logger("transformers").addHandler(Grab())
results = {}
for policy in sys.argv[2:]:  # first without fastdl: what a user gets who does not know it
    logs.clear()
    try:
        plain = LlamaForCausalLM.from_pretrained(os.path.join(out_dir, policy)).eval()
    except Exception as exc:
        results[policy] = {"plain_error": f"{type(exc).__name__}: {exc}"}
        continue
    with torch.no_grad():
        results[policy] = {"plain": plain(ids).logits, "plain_log": "\n".join(logs)}
assert "fastdl" not in sys.modules
import fastdl
for policy in sys.argv[2:]:
    model = fastdl.load_pretrained(LlamaForCausalLM, os.path.join(out_dir, policy), dtype=torch.float32)
    skeleton = LlamaForCausalLM(model.config)
    again = fastdl.load(skeleton, os.path.join(out_dir, policy + ".safetensors")).eval()
    with torch.no_grad():
        results[policy].update(hf=model(ids).logits, save=again(ids).logits, training=model.training,
                               kinds=sorted({type(m).__name__ for m in model.modules()}))
torch.save(results, os.path.join(out_dir, "results.pt"))
"""


@pytest.fixture(scope="module")
def hf_round_trip(tmp_path_factory):
    """Every policy: a tiny Llama (random weights, no download) converted, saved with save_pretrained and
    fastdl.save; then one fresh process loads them all (first with transformers alone, then with fastdl)."""
    if not HAS_TRANSFORMERS or not HAS_SAFETENSORS:
        pytest.skip("needs transformers and safetensors (requirements/dev.txt)")
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("hf")
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.save(ids, out / "ids.pt")
    before = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        if policy == "sparse24":
            sparsity.prune(model)
        kwargs = {"example_inputs": {"input_ids": ids}} if policy == "auto" else {}
        fastdl.convert(model, policy, **kwargs)
        with torch.no_grad():
            logits = model(ids).logits
        model.save_pretrained(out / policy)
        fastdl.save(model, out / f"{policy}.safetensors")
        layer_keys = {r["layer"] for r in fastdl.report(model) if "bytes_after" in r}
        other = sum(v.numel() * v.element_size() for k, v in model.state_dict().items()
                    if k.rpartition(".")[0] not in layer_keys)  # fmt: skip
        before[policy] = {
            "logits": logits,
            "layer_bytes": sum(r["bytes_after"] for r in fastdl.report(model) if "bytes_after" in r),
            "other_bytes": other,
            "kinds": sorted({type(m).__name__ for m in model.modules()}),
        }
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _LOADER, str(out), *POLICIES], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return out, before, torch.load(out / "results.pt")


@needs_transformers
@pytest.mark.parametrize("policy", POLICIES)
def test_hf_save_pretrained_load_pretrained_bit_identical_in_a_fresh_process(policy, hf_round_trip):
    out, before, after = hf_round_trip
    files = os.listdir(out / policy)
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files)
    qc = json.loads((out / policy / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "fastdl.recipe" and qc["load_with"] == "fastdl.load_pretrained(ModelClass, path)"
    # quant_method "fastdl" always (fastdl.hf's quantizer rebuilds the layers); int8 / 2:4 checkpoints also carry
    # config.json's `transformers_weights` guard, so that transformers alone (fastdl not imported) stops instead of
    # loading int8 codes into float layers; "fused" (float weights only) has no guard
    float_only = not {"Int8Linear", "Sparse24Linear"} & set(before[policy]["kinds"])
    assert qc["quant_method"] == "fastdl"
    cfg = json.loads((out / policy / "config.json").read_text())
    assert ("transformers_weights" in cfg) is not float_only
    assert after[policy]["kinds"] == before[policy]["kinds"]
    assert torch.equal(after[policy]["hf"], before[policy]["logits"])  # bit-identical
    assert torch.equal(after[policy]["save"], before[policy]["logits"])
    assert after[policy]["training"] is False
    # the file holds what fastdl.report states for the layers, plus the other weights (embeddings, norms)
    expected = before[policy]["layer_bytes"] + before[policy]["other_bytes"]
    size = os.path.getsize(out / policy / "model.safetensors")
    assert abs(size - expected) <= 0.05 * expected, (size, expected)
    size = os.path.getsize(out / f"{policy}.safetensors")
    assert abs(size - expected) <= 0.05 * expected, (size, expected)


@needs_transformers
def test_hf_from_pretrained_without_fastdl(hf_round_trip):
    """transformers alone: the fused model (float weights, nn.Linear keys) loads and computes the same function
    (transformers logs that it skips the fastdl method); the int8 and 2:4 models, whose layers it cannot rebuild,
    make it stop instead of loading those layers with random weights (see fastdl.serialization)."""
    _, before, after = hf_round_trip
    torch.testing.assert_close(after["fused"]["plain"], before["fused"]["logits"], rtol=1e-4, atol=1e-4)
    assert "got fastdl" in after["fused"]["plain_log"], after["fused"]["plain_log"][:500]
    for policy in ("int8", "int8_weight_only", "sparse24"):
        assert "plain" not in after[policy], f"{policy}: transformers alone loaded it"
        assert "ValueError" in after[policy]["plain_error"] and "quant_method" in after[policy]["plain_error"]
