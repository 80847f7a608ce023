"""The fastdl modules (FusedLinear, Int8Linear, Sparse24Linear) under unusual and bad inputs (issue 34): every input
they cannot compute raises the house exception type (TypeError for a dtype, ValueError for a shape, RuntimeError for
a device) naming the layer, the argument, what it accepts and what it got; empty shapes work; meta-device
construction works (then ``to_empty`` + ``load_state_dict``, or ``load_state_dict(assign=True)``, gives the source
layer's outputs exactly); a tampered checkpoint raises ``fastdl.CheckpointError`` naming the key and leaves the
layer as it was."""

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fastdl
from fastdl import runtime_choice, sparsity
from fastdl.nn import CheckpointError, FusedLinear, Int8Linear, Sparse24Linear
from fastdl.nn._base import decode_extra_state, encode_extra_state

K, N = 16, 12
FLOATS = "float32, bfloat16, float16, float64"
INT8_FLOATS = "float32, bfloat16, float16"
BAD_DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]

# name -> (factory(**factory_kwargs), the dtypes its forward accepts as a message fragment)
CASES = {
    "FusedLinear": (lambda **f: FusedLinear(K, N, activation="gelu", **f), FLOATS),
    "Int8Linear-dynamic": (lambda **f: Int8Linear(K, N, mode="dynamic", **f), INT8_FLOATS),
    "Int8Linear-weight_only": (lambda **f: Int8Linear(K, N, mode="weight_only", **f), INT8_FLOATS),
    "Int8Linear-dynamic-qat": (lambda **f: Int8Linear(K, N, mode="dynamic", trainable=True, **f), INT8_FLOATS),
    "Int8Linear-weight_only-qat-eval": (
        lambda **f: Int8Linear(K, N, mode="weight_only", trainable=True, **f).eval(), INT8_FLOATS),
    "Sparse24Linear-auto": (lambda **f: Sparse24Linear(K, N, mode="auto", **f), FLOATS),
    "Sparse24Linear-dense": (lambda **f: Sparse24Linear(K, N, mode="dense", **f), FLOATS),
    "Sparse24Linear-sparse": (lambda **f: Sparse24Linear(K, N, mode="sparse", **f), FLOATS),
    "Sparse24Linear-trainable": (lambda **f: Sparse24Linear(K, N, activation="silu", trainable=True, **f), FLOATS),
}


def layer(name: str) -> str:
    return re.escape(f"{name.split('-')[0]}(in_features={K}, out_features={N})")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ii]nitializing zero-element tensors.*")
        yield


# ------------------------------------------------------------------------------------------------ dtype of x
@pytest.mark.parametrize("case", CASES)
def test_non_float_input_raises_type_error(case):
    make, accepted = CASES[case]
    m = make()
    m(torch.randn(2, K))  # a valid call first: paths and caches exist for float32
    for dtype in BAD_DTYPES:
        x = torch.arange(2 * K).view(2, K).to(dtype)
        with pytest.raises(TypeError, match=rf"^{layer(case)}: x must be a floating tensor of dtype {accepted}, "
                                            rf"got dtype {re.escape(str(dtype))}$"):
            m(x)


@pytest.mark.parametrize("mode", ["auto", "dense", "sparse"])
def test_sparse24_integer_input_is_not_computed_in_integers(mode):
    """Issue 34 item 2: the dense path cast the weights to the input's integer dtype and returned zeros."""
    m = Sparse24Linear.from_linear(nn.Linear(8, 4), mode=mode)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        with pytest.raises(TypeError, match=r"Sparse24Linear\(in_features=8, out_features=4\): x must be a floating"):
            m(torch.arange(16).view(2, 8).to(dtype))
        assert m._choice_local.get((2, dtype)) is None  # no decision kept for it
    with torch.no_grad():
        with pytest.raises(TypeError, match="got dtype torch.int64"):
            m.prepare(torch.arange(16).view(2, 8))


def test_int8_rejects_float64_with_the_layer_name():
    m = Int8Linear(K, N)
    with pytest.raises(TypeError, match=rf"^{layer('Int8Linear')}: x must be .* got dtype torch.float64$"):
        m(torch.randn(3, K, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------ shape of x
@pytest.mark.parametrize("case", CASES)
def test_wrong_in_features_raises_value_error(case):
    make, _ = CASES[case]
    m = make()
    m(torch.randn(2, K))  # the bucket of 2 rows now has a path (Sparse24Linear-dense: its cached fast path)
    m(torch.randn(2, K))
    for shape in [(2, K + 4), (2, K - 4), (1, K + 1), (3, 5, 2 * K), (7,)]:
        with pytest.raises(ValueError, match=rf"^{layer(case)}: x.shape\[-1\] must equal in_features = {K}, got x "
                                             rf"of shape {re.escape(str(shape))}$"):
            m(torch.randn(shape))
    with pytest.raises(ValueError, match=rf"^{layer(case)}: x must have at least 1 dimension \[..., in_features = "
                                         rf"{K}\], got a 0-d tensor$"):
        m(torch.tensor(1.0))


def test_wrong_in_features_on_a_decided_aten_or_dequant_path():
    """A bucket decided for F.linear ("aten" / "dequant"): the wrong K reaches F.linear, whose error is replaced."""
    fused = FusedLinear(K, N, activation="relu")
    fused._choice_local[(2, torch.float32, False)] = "aten"
    q = Int8Linear(K, N)
    q._choice_local[(2, torch.float32)] = "dequant"
    for m in (fused, q):
        m(torch.randn(2, K))
        with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal in_features = 16, got x of shape \(2, 20\)"):
            m(torch.randn(2, K + 4))


@pytest.fixture
def measuring():
    """Run-time choice on, timings faked (every path equally fast: the default wins)."""
    prev_mode = runtime_choice.set_choice_mode("measure")
    def timer(calls, device, info):
        for call in calls.values():
            call()  # each path runs on the input, as with the real timer
        return dict.fromkeys(calls, 1.0)

    prev_timer = runtime_choice.set_timer(timer)
    runtime_choice.clear_decisions()
    yield
    runtime_choice.set_timer(prev_timer)
    runtime_choice.set_choice_mode(prev_mode)
    runtime_choice.clear_decisions()


@pytest.mark.parametrize("case", ["FusedLinear", "Int8Linear-dynamic", "Sparse24Linear-auto"])
def test_bad_input_leaves_no_decision(case, measuring):
    """The first call at a bucket is where a path is chosen: a bad input raises there, before any is kept."""
    m = CASES[case][0]()
    with torch.no_grad():
        for x in (torch.randn(2, K + 4), torch.arange(2 * K).view(2, K), torch.randn(2, K, device="meta")):
            with pytest.raises((TypeError, ValueError, RuntimeError), match=layer(case)):
                m(x)
        assert m._choice_local == {}
        assert m(torch.randn(2, K)).shape == (2, N)
        assert m._choice_local


def test_permuted_layers_reject_a_wider_input():
    """index_select with the input permutation gathers the first in_features columns of a wider x without error."""
    s = Sparse24Linear(K, N)
    s.register_buffer("input_permutation", torch.randperm(K))
    lin = nn.Linear(K, N)
    sparsity.prepare_pruned(lin, permuted=True)
    for m, name in ((s, layer("Sparse24Linear")), (lin, r"Linear\(in_features=16\) with an input permutation")):
        m(torch.randn(3, K))
        with pytest.raises(ValueError, match=rf"{name}: x.shape\[-1\] must equal in_features = 16, got x of shape "
                                             r"\(3, 20\)"):
            m(torch.randn(3, K + 4))


# ------------------------------------------------------------------------------------------------ device of x
@pytest.mark.parametrize("case", CASES)
def test_input_on_another_device_raises_runtime_error(case):
    make, _ = CASES[case]
    m = make()
    with pytest.raises(RuntimeError, match=rf"^{layer(case)}: x is on device meta, the layer's weights on cpu"):
        m(torch.randn(2, K, device="meta"))
    on_meta = make(device="meta")
    with pytest.raises(RuntimeError, match=rf"^{layer(case)}: x is on device cpu, the layer's weights on meta"):
        on_meta(torch.randn(2, K))
    out = on_meta(torch.randn(3, 5, K, device="meta"))  # shapes only: what a meta model computes
    assert out.is_meta and out.shape == (3, 5, N)


# ------------------------------------------------------------------------------------------------ empty shapes
def _expected(m, x, k, n):
    """float64 reference of an empty-shape call: zero-element output, or (K = 0) the activation of the bias."""
    bias = m.bias.detach().double() if m.bias is not None else torch.zeros(n, dtype=torch.float64)
    out = bias.expand(*x.shape[:-1], n) if k == 0 else torch.zeros(*x.shape[:-1], n, dtype=torch.float64)
    act = getattr(m, "activation", "none")
    return {"none": out, "gelu": F.gelu(out), "silu": F.silu(out)}[act]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m_rows,n,k", [(0, N, K), (3, 0, K), (3, N, 0), (0, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_empty_shapes(case, m_rows, n, k, dtype):
    make, accepted = CASES[case]
    if "float64" not in accepted and dtype == torch.float64:
        pytest.skip("Int8Linear takes float32/bfloat16/float16 inputs")
    cls = {"FusedLinear": FusedLinear, "Int8Linear": Int8Linear, "Sparse24Linear": Sparse24Linear}[case.split("-")[0]]
    kwargs = {"Int8Linear-dynamic": {"mode": "dynamic"}, "Int8Linear-weight_only": {"mode": "weight_only"},
              "Int8Linear-dynamic-qat": {"trainable": True},
              "Int8Linear-weight_only-qat-eval": {"mode": "weight_only", "trainable": True},
              "Sparse24Linear-auto": {}, "Sparse24Linear-dense": {"mode": "dense"},
              "Sparse24Linear-sparse": {"mode": "sparse"}, "Sparse24Linear-trainable": {"trainable": True},
              "FusedLinear": {"activation": "gelu"}}[case]
    m = cls(k, n, dtype=dtype, **kwargs)
    if case.endswith("eval"):
        m.eval()
    x = torch.randn(2, m_rows, k, dtype=dtype)
    out = m(x)
    assert out.shape == (2, m_rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), _expected(m, x, k, n), rtol=1e-6, atol=1e-6)
    if x.numel() and out.requires_grad:
        out.sum().backward()


def test_sparse24_empty_out_features_float64():
    """Issue 34 item 10: Sparse24Linear(8, 0, dtype=torch.float64)."""
    for mode in ("auto", "dense", "sparse"):
        m = Sparse24Linear(8, 0, dtype=torch.float64, mode=mode)
        assert m(torch.randn(3, 8, dtype=torch.float64)).shape == (3, 0)
        assert m.to_linear().weight.shape == (0, 8)


# ------------------------------------------------------------------------------------------------ meta device
def _meta_cases(dtype):
    """(name, source layer from an nn.Linear, the same layer built without data)"""
    yield ("FusedLinear", lambda lin: FusedLinear.from_linear(lin, "gelu"),
           lambda **f: FusedLinear(K, N, activation="gelu", dtype=dtype, **f))
    for mode in ("dynamic", "weight_only"):
        for tr in (False, True):
            yield (f"Int8Linear-{mode}-{tr}",
                   lambda lin, mode=mode, tr=tr: Int8Linear.from_linear(lin.float(), mode=mode, trainable=tr).eval(),
                   lambda mode=mode, tr=tr, **f: Int8Linear(K, N, mode=mode, trainable=tr, **f).eval())
    for mode in ("auto", "dense", "sparse"):
        yield (f"Sparse24Linear-{mode}", lambda lin, mode=mode: Sparse24Linear.from_linear(lin, mode=mode),
               lambda mode=mode, **f: Sparse24Linear(K, N, mode=mode, dtype=dtype, **f))
    yield ("Sparse24Linear-trainable", lambda lin: Sparse24Linear.from_linear(lin, trainable=True),
           lambda **f: Sparse24Linear(K, N, dtype=dtype, trainable=True, **f))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["device", "context", "from_linear", "assign"])
def test_meta_construction_then_load(dtype, how):
    """Issue 34 item 11: build without data (device="meta", ``with torch.device("meta")``, from_linear of a meta
    nn.Linear), then ``to_empty`` + ``load_state_dict`` (or ``load_state_dict(assign=True)``): the source layer's
    outputs, bit for bit."""
    torch.manual_seed(0)
    lin = nn.Linear(K, N, dtype=dtype)
    x = torch.randn(5, K, dtype=dtype)
    for name, source, build in _meta_cases(dtype):
        src = source(lin)
        want = src(x)
        if how in ("device", "assign"):
            m = build(device="meta")
        elif how == "context":
            with torch.device("meta"):
                m = build()
        else:
            m = source(nn.Linear(K, N, dtype=dtype, device="meta"))
        tensors = dict(m.named_parameters()) | dict(m.named_buffers())
        assert tensors and all(t.is_meta for t in tensors.values()), (name, how)
        if how == "assign":
            m.load_state_dict(src.state_dict(), assign=True)
        else:
            m.to_empty(device="cpu")
            m.load_state_dict(src.state_dict())
        assert not any(t.is_meta for t in list(m.parameters()) + list(m.buffers())), (name, how)
        assert torch.equal(m(x), want), (name, how)


def test_meta_built_layers_load_a_plain_linear_checkpoint():
    torch.manual_seed(1)
    lin = nn.Linear(K, N)
    x = torch.randn(4, K)
    for src, m in [(Sparse24Linear.from_linear(lin), Sparse24Linear(K, N, device="meta")),
                   (Int8Linear.from_linear(lin, mode="weight_only"), Int8Linear(K, N, mode="weight_only",
                                                                               device="meta"))]:
        m.to_empty(device="cpu")
        m.load_state_dict(lin.state_dict())
        assert torch.equal(m(x), src(x))
    m = Sparse24Linear(K, N, device="meta")
    m.load_state_dict(lin.state_dict(), assign=True)  # compressed where the checkpoint is, not on meta
    assert not m.values.is_meta and torch.equal(m(x), Sparse24Linear.from_linear(lin)(x))


# ------------------------------------------------------------------------------------------------ checkpoints
def _nested(depth: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"[" * depth + b"]" * depth), dtype=torch.uint8).clone()


def _nested_list(depth: int) -> list:
    out = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return out


def _int8_sd(**kw):
    return Int8Linear(K, N, **kw).state_dict()


def _s24_sd(k=K):
    return Sparse24Linear(k, N).state_dict()


def _with(sd, **changes):
    sd = dict(sd)
    sd.update(changes)
    return sd


def _bad_meta(sd, k=K):
    meta = sd["meta"].clone()
    meta[1, 0] = 0x07  # three positions kept in a group
    return _with(sd, meta=meta)


def _high_nibble(sd):
    meta = sd["meta"].clone()
    meta[0, -1] |= 0x30  # K = 12: the last byte's high nibble is no group
    return _with(sd, meta=meta)


TAMPERED = {
    "int8 meta weight": (lambda: Int8Linear(K, N), lambda: _with(_int8_sd(), weight=torch.empty(N, K, dtype=torch.int8,
                                                                                                device="meta")),
                         r"weight is a meta tensor \(shape only, no data\)"),
    "int8 meta float weight": (lambda: Int8Linear(K, N), lambda: {"weight": torch.empty(N, K, device="meta"),
                                                                  "bias": torch.zeros(N)},
                               "weight is a meta tensor"),
    "int8 qat meta weight": (lambda: Int8Linear(K, N, trainable=True),
                             lambda: _with(_int8_sd(trainable=True), weight=torch.empty(N, K, device="meta")),
                             "weight is a meta tensor"),
    "int8 meta scale": (lambda: Int8Linear(K, N), lambda: _with(_int8_sd(), weight_scale=torch.empty(N, device="meta")),
                        "weight_scale is a meta tensor"),
    "int8 nan scale": (lambda: Int8Linear(K, N),
                       lambda: _with(_int8_sd(), weight_scale=_int8_sd()["weight_scale"].index_fill(0, torch.tensor(
                           [3]), math.nan)),
                       r"weight_scale must be finite; 1 of 12 output channels are not \(first: channel 3 = nan\)"),
    "int8 inf scale": (lambda: Int8Linear(K, N, mode="weight_only"),
                       lambda: _with(_int8_sd(mode="weight_only"), weight_scale=torch.full((N,), math.inf)),
                       "weight_scale must be finite; 12 of 12"),
    "int8 int bias": (lambda: Int8Linear(K, N), lambda: _with(_int8_sd(), bias=torch.arange(N)),
                      r"bias must be a floating tensor \(float32, bfloat16, float16, float64\), got dtype torch.int64"),
    "int8 deep extra state": (lambda: Int8Linear(K, N), lambda: _with(_int8_sd(), _extra_state=_nested(100_000)),
                              "_extra_state is not a fastdl.Int8Linear record"),
    "s24 int dense weight": (lambda: Sparse24Linear(K, N), lambda: {"weight": torch.randint(-3, 3, (N, K)),
                                                                    "bias": torch.zeros(N)},
                             r"weight must be a floating tensor .*got dtype torch.int64"),
    "s24 meta dense weight": (lambda: Sparse24Linear(K, N), lambda: {"weight": torch.empty(N, K, device="meta"),
                                                                     "bias": torch.zeros(N)},
                              "weight is a meta tensor"),
    "s24 int values": (lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), values=_s24_sd()["values"].long()),
                       r"values must be a floating tensor .*got dtype torch.int64"),
    "s24 meta values": (lambda: Sparse24Linear(K, N),
                        lambda: _with(_s24_sd(), values=torch.empty(N, K // 2, device="meta")),
                        "values is a meta tensor"),
    "s24 values shape": (lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), values=torch.zeros(N, K)),
                         r"size mismatch for values: the checkpoint has shape \(12, 16\), this layer \(12, 8\)"),
    "s24 float meta": (lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), meta=_s24_sd()["meta"].float()),
                       "meta must be torch.uint8, got dtype torch.float32"),
    "s24 invalid meta": (lambda: Sparse24Linear(K, N), lambda: _bad_meta(_s24_sd()),
                         "meta is not a 2:4 mask: every 4-bit group must have exactly 2 bits set"),
    "s24 unused nibble": (lambda: Sparse24Linear(12, N), lambda: _high_nibble(_s24_sd(12)),
                          "meta is not a 2:4 mask"),
    "s24 int bias": (lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), bias=torch.arange(N)),
                     "bias must be a floating tensor"),
    "s24 deep extra state": (lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), _extra_state=_nested(100_000)),
                             "_extra_state is not a fastdl.sparse24 record"),
    "s24 nested dict record": (lambda: Sparse24Linear(K, N),
                               lambda: _with(_s24_sd(), _extra_state={"format": "other", "x": _nested_list(5000)}),
                               r"_extra_state is not a fastdl.sparse24 record: \{'format': 'other', "
                               r"'x': \[\[\[\[...\]\]\]\]\}"),
    "int8 nested version": (lambda: Int8Linear(K, N),
                            lambda: _with(_int8_sd(), _extra_state={"format": "fastdl.Int8Linear",
                                                                    "version": _nested_list(5000)}),
                            "_extra_state has no valid format version"),
    "s24 permutation out of range": (
        lambda: Sparse24Linear(K, N),
        lambda: _with(_s24_sd(), input_permutation=torch.cat([torch.arange(K - 1), torch.tensor([K + 5])])),
        r"input_permutation must be a permutation of 0..15 \(each input feature once\), got values in 0..21: 1 out "
        r"of range, 0 repeated"),
    "s24 permutation repeats": (
        lambda: Sparse24Linear(K, N),
        lambda: _with(_s24_sd(), input_permutation=torch.zeros(K, dtype=torch.int64)),
        "input_permutation must be a permutation of 0..15 .* got values in 0..0: 0 out of range, 15 repeated"),
    "s24 negative permutation": (
        lambda: Sparse24Linear(K, N),
        lambda: _with(_s24_sd(), input_permutation=torch.arange(K) - 1),
        r"input_permutation .* got values in -1..14: 1 out of range, 0 repeated"),
    "s24 float permutation": (
        lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), input_permutation=torch.arange(K).float()),
        "input_permutation must be an int64 tensor, got dtype torch.float32"),
    "s24 permutation length": (
        lambda: Sparse24Linear(K, N), lambda: _with(_s24_sd(), input_permutation=torch.arange(K + 4)),
        r"size mismatch for input_permutation: the checkpoint has shape \(20,\), this layer \(16,\)"),
}


@pytest.mark.parametrize("case", TAMPERED)
def test_tampered_checkpoint_raises_checkpoint_error(case):
    make, state, message = TAMPERED[case]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), make())  # the error names the layer's key prefix, "1."
    x = torch.randn(3, model[1].in_features)
    before = model(x)
    sd = {f"1.{k}": v for k, v in state().items()}
    fmt = re.escape(model[1].FORMAT)
    with pytest.raises(CheckpointError, match=rf"^{fmt} checkpoint '1\.': {message}"):
        model.load_state_dict(sd)
    assert torch.equal(model(x), before)  # nothing was copied
    assert isinstance(fastdl.CheckpointError("x"), RuntimeError)


def test_valid_permutation_still_loads():
    src = Sparse24Linear(K, N)
    src.register_buffer("input_permutation", torch.randperm(K))
    dst = Sparse24Linear(K, N)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(3, K)
    assert torch.equal(dst(x), src(x))


def test_decode_extra_state_nesting():
    assert decode_extra_state(_nested(10_000)) is None
    assert decode_extra_state(torch.tensor(list(b"[1, 2"), dtype=torch.uint8)) is None
    record = {"format": "f", "version": 1, "deep": [[[["ok"]]]], "text": "]]]] [[[["}
    assert decode_extra_state(encode_extra_state(record)) == record


# ------------------------------------------------------------------------------------------------ dtype arguments
def test_dtype_arguments_must_be_floating():
    lin = nn.Linear(8, 4)
    for bad in (torch.int8, torch.int64, torch.bool, torch.complex64):
        for build, where in ((lambda d: FusedLinear(8, 4, dtype=d), "FusedLinear"),
                             (lambda d: Int8Linear(8, 4, dtype=d), "Int8Linear"),
                             (lambda d: Sparse24Linear(8, 4, dtype=d), "Sparse24Linear"),
                             (lambda d: Sparse24Linear.from_linear(lin, dtype=d), r"Sparse24Linear.from_linear")):
            with pytest.raises(TypeError, match=rf"^{where}: dtype must be one of {FLOATS} \(or None\), got "
                                                rf"{re.escape(repr(bad))}$"):
                build(bad)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    sparsity.prune(model)
    with pytest.raises(TypeError, match=rf"^fastdl.sparsity.sparsify: dtype must be one of {FLOATS} \(or None\), "
                                        r"got torch.int8$"):
        sparsity.sparsify(model, dtype=torch.int8)
    assert type(model[0]) is nn.Linear  # nothing replaced
    sparsity.sparsify(model, dtype=torch.bfloat16)
    assert isinstance(model[0], Sparse24Linear) and model[0].values.dtype == torch.bfloat16


def test_from_linear_rejects_integer_weights():
    lin = nn.Linear(8, 4)
    lin.weight = nn.Parameter(torch.ones(4, 8, dtype=torch.int32), requires_grad=False)
    with pytest.raises(TypeError, match=r"Sparse24Linear.from_linear: the weight must be a floating tensor .* got "
                                        r"dtype torch.int32"):
        Sparse24Linear.from_linear(lin)


# ------------------------------------------------------------------------------------------------ residual
@pytest.mark.parametrize("mode", ["auto", "dense", "sparse"])
def test_sparse24_residual_as_fused_linear(mode):
    """Sparse24Linear's residual follows fused_linear's rules on every path: shape [..., N], output in x's dtype."""
    torch.manual_seed(0)
    m = Sparse24Linear(K, N, mode=mode, activation="gelu")
    x = torch.randn(3, K)
    r = torch.randn(3, N, dtype=torch.float64)
    out = m(x, r)
    assert out.dtype == torch.float32
    ref = F.gelu(F.linear(x.double(), m.dense_weight().double(), m.bias.double())) + r
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for bad in (torch.randn(N), torch.randn(1, N), torch.randn(3, N + 1)):
        with pytest.raises(ValueError, match=rf"^{layer('Sparse24Linear')}: residual must be a floating tensor of "
                                             rf"shape \[3, 12\] \(the output's\), got torch.float32 "
                                             rf"{re.escape(str(list(bad.shape)))}$"):
            m(x, bad)
    with pytest.raises(ValueError, match="residual must be a floating tensor"):
        m(x, torch.ones(3, N, dtype=torch.int64))
    fused = FusedLinear(K, N, activation="gelu")
    with pytest.raises(ValueError, match="residual must have shape"):
        fused(x, torch.randn(N))


# ------------------------------------------------------------------------------------------------ torch.compile
def test_bad_input_under_torch_compile():
    """Compiled, the layers raise the same errors (with fullgraph=True torch wraps them, message kept); an integer x
    ran Sparse24Linear's dense path in integers under torch.compile too."""
    torch._dynamo.reset()
    m = Sparse24Linear(K, N, mode="dense")
    compiled = torch.compile(m, backend="eager")
    with torch.no_grad():
        x = torch.randn(3, K)
        torch.testing.assert_close(compiled(x), m(x))
        with pytest.raises(TypeError, match=rf"^{layer('Sparse24Linear')}: x must be a floating tensor"):
            compiled(torch.arange(3 * K).view(3, K))
        with pytest.raises(ValueError, match=rf"^{layer('Sparse24Linear')}: x.shape\[-1\] must equal"):
            compiled(torch.randn(3, K + 4))
        full = torch.compile(FusedLinear(K, N), backend="eager", fullgraph=True)
        # torch >= 2.14 reports the layer's error, 2.11 the op's (the fake kernel's check, traced first): either names
        # x and what it must be
        with pytest.raises(RuntimeError, match=rf"({layer('FusedLinear')}|fused_linear): x must be a floating tensor"):
            full(torch.arange(3 * K).view(3, K))
    torch._dynamo.reset()


def test_ops_on_the_meta_device_run_their_fake_kernels():
    """Shape-only calls (meta-device models): every op returns the fake kernel's shapes and reads no data (before,
    the 2:4 ops ran their references there: torch.nonzero / .item() on meta tensors failed)."""
    from fastdl import ops

    w = torch.empty(8, 16, device="meta")
    values, meta = ops.compress_2_4(w)
    assert values.shape == (8, 8) and meta.shape == (8, 2) and meta.dtype == torch.uint8 and values.is_meta
    assert ops.decompress_2_4(values, meta).shape == (8, 16)
    assert ops.mask_2_4(w).shape == (8, 16)
    x = torch.empty(3, 5, 16, device="meta")
    assert ops.sparse24_linear(x, values, meta).shape == (3, 5, 8)
    assert ops.fused_linear(x, torch.empty(7, 16, device="meta"), None, "gelu").shape == (3, 5, 7)
    with pytest.raises(ValueError, match="in_features|K|shape"):  # the argument checks still run
        ops.fused_linear(x, torch.empty(7, 15, device="meta"))
