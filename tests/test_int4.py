"""int4 weight-only linear (issue 29): the op on every CPU backend against a float64 reference built here from the
codes (independent of fastdl's dequantizer), opcheck and torch.compile, the packing and the quantizer (error bounds,
scale search vs RTN), the GPTQ / AWQ importers bit for bit against tensors packed here by the published rules, the
Int4Linear module (checkpoints, errors, memory) and fastdl.convert / save / save_pretrained round trips."""

import copy
import importlib
import io
import json
import os

import pytest
import torch
from _int4_refs import dequant_ref, groups_for, pack_ref, random_int4
from conftest import cpu_backends, rel_err
from torch import nn

import fastdl
from fastdl import runtime_choice as dispatch
from fastdl.nn import CheckpointError, Int4Linear
from fastdl.nn._base import decode_extra_state, encode_extra_state
from fastdl.ops.int4 import (
    dequantize_int4,
    import_awq,
    import_gptq,
    int4_a8_linear,
    int4_weight_only_linear,
    pack_int4,
    quantize_groups,
    quantize_int4,
    unpack_int4,
)

convert_mod = importlib.import_module("fastdl.convert")  # the module (fastdl.convert is the function)
BACKENDS = cpu_backends("int4_weight_only_linear")  # cpp once the extension registers its kernel, and torch
SHAPES = [(N, K, M) for N in (1, 7, 33) for K in (32, 96, 256) for M in (1, 3, 17)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}  # one rounding of the output


def linear_ref(x, W, bias):
    out = x.double().reshape(-1, x.shape[-1]) @ W.t()
    if bias is not None:
        out = out + bias.double()
    return out.reshape(*x.shape[:-1], W.shape[0])


# ---------------------------------------------------------------------------------------------------- the op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_matches_float64_reference_odd_shapes(backend, dtype):
    g = torch.Generator().manual_seed(1)
    for N, K, M in SHAPES:
        for G in groups_for(K):
            for zeros in (False, True):
                u, s, z = random_int4(N, K, G, zeros, seed=N * K + M)
                W = dequant_ref(u, s, z, G)
                x = torch.randn(M, K, generator=g).to(dtype)
                bias = torch.randn(N, generator=g) if M != 3 else None
                with fastdl.use_backend(backend):
                    out = int4_weight_only_linear(x, pack_ref(u), s, z, bias, G)
                assert out.dtype == dtype and out.shape == (M, N)
                err = rel_err(out, linear_ref(x, W, bias))
                assert err <= TOL[dtype], (backend, dtype, N, K, M, G, zeros, err)


def test_bf16_x_from_16_rows_over_several_weight_blocks():
    """bf16 x from 16 rows (on a CPU with AVX512_BF16 the C++ op then multiplies the weight rounded to bf16, in
    blocks of 1024 rows at K = 4096: N = 1100 takes a full block and a 76-row tail) matches the float64 reference
    within one bf16 rounding of the output plus the weight's, and the bf16-rounded weight's product more closely."""
    N, K, G = 1100, 4096, 128
    u, s, z = random_int4(N, K, G, True, seed=5)
    W = dequant_ref(u, s, z, G)
    Wb = W.float().bfloat16().double()
    g = torch.Generator().manual_seed(6)
    for lead in ((16,), (2, 9), (40,)):
        x = torch.randn(*lead, K, generator=g).bfloat16()
        bias = torch.randn(N, generator=g)
        out = int4_weight_only_linear(x, pack_ref(u), s, z, bias, G)
        assert out.dtype == torch.bfloat16 and out.shape == (*lead, N)
        assert rel_err(out, linear_ref(x, W, bias)) <= TOL[torch.bfloat16], lead
        assert rel_err(out, linear_ref(x, Wb, bias)) <= 5e-3, lead  # one output rounding (2^-9) and the sums'
        # every column block is where it belongs: the worst column is no worse than the output rounding allows
        col_err = ((out.double() - linear_ref(x, Wb, bias)).abs().amax(dim=tuple(range(len(lead))))
                   / linear_ref(x, Wb, bias).abs().amax())  # fmt: skip
        assert float(col_err.max()) <= 2e-2, lead


def test_bf16_x_few_rows_matches_the_fp32_product():
    """bf16 x at 3 to 7 rows with groups of 64 or 128 (on a CPU with AVX512_BF16 the C++ op runs the bf16 streaming
    kernel: x as given times the exact u - z, two blocks and two groups at a time, a tail group): the fp32 product of
    the same bf16 x rounded once, so within one bf16 rounding of the output of the float64 reference; zero points,
    odd N, a group count that is odd."""
    g = torch.Generator().manual_seed(8)
    for N, K, G, M in [(33, 384, 128, 3), (17, 192, 64, 5), (40, 1024, 128, 7), (9, 256, 64, 4)]:
        for zeros in (False, True):
            u, s, z = random_int4(N, K, G, zeros, seed=N + K + M)
            W = dequant_ref(u, s, z, G)
            x = torch.randn(M, K, generator=g).bfloat16()
            bias = torch.randn(N, generator=g)
            out = int4_weight_only_linear(x, pack_ref(u), s, z, bias, G)
            ref = linear_ref(x.double(), W, bias)
            assert out.dtype == torch.bfloat16 and out.shape == (M, N)
            worst = ((out.double() - ref).abs() / ref.abs().clamp_min(ref.abs().max() * 1e-3)).max()
            assert float(worst) <= 2**-8, (N, K, G, M, zeros, float(worst))


@pytest.mark.parametrize("backend", BACKENDS)
def test_op_noncontiguous_leading_dims_empty_and_bias_dtypes(backend):
    N, K, G = 33, 256, 64
    u, s, z = random_int4(N, K, G, True, seed=3)
    q, W = pack_ref(u), dequant_ref(u, s, z, G)
    base = torch.randn(2, K, 7)
    x = base.transpose(1, 2)  # [2, 7, K], not contiguous
    assert not x.is_contiguous()
    with fastdl.use_backend(backend):
        out = int4_weight_only_linear(x, q, s, z, torch.randn(N).bfloat16(), G)
        assert out.shape == (2, 7, N)
        b = torch.randn(N)
        assert rel_err(int4_weight_only_linear(x, q, s, z, b.bfloat16(), G), linear_ref(x, W, b.bfloat16())) <= 1e-5
        sliced = torch.randn(5, 2 * K)[:, ::2]  # strided last dim
        assert rel_err(int4_weight_only_linear(sliced, q, s, None, None, G), linear_ref(sliced, dequant_ref(
            u, s, None, G), None)) <= 1e-5
        empty = int4_weight_only_linear(torch.randn(0, K), q, s, z, None, G)
        assert empty.shape == (0, N)
        one_d = int4_weight_only_linear(torch.randn(K), q, s, z, None, G)
        assert one_d.shape == (N,)


def test_float64_x_runs_the_reference_in_float64():
    N, K, G = 7, 96, 32
    u, s, z = random_int4(N, K, G, False)
    x = torch.randn(3, K, dtype=torch.float64)
    out = int4_weight_only_linear(x, pack_ref(u), s, None, None, G)  # auto: cpp (if any) passes float64 over
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, linear_ref(x, dequant_ref(u, s, None, G), None), rtol=1e-12, atol=1e-12)


def test_gradients_of_x_and_bias_gradcheck_and_none_for_the_weight():
    N, K, G = 7, 64, 32
    u, s, z = random_int4(N, K, G, True)
    q = pack_ref(u)
    x = torch.randn(3, K, dtype=torch.float64, requires_grad=True)
    b = torch.randn(N, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b: int4_weight_only_linear(x, q, s, z, b, G), (x, b), fast_mode=True)
    xf = torch.randn(2, 5, K, requires_grad=True)
    bf = torch.randn(N, requires_grad=True)
    out = int4_weight_only_linear(xf, q, s, z, bf, G)
    gout = torch.randn_like(out)
    out.backward(gout)
    W = dequant_ref(u, s, z, G)
    torch.testing.assert_close(xf.grad.double(), (gout.double().reshape(-1, N) @ W).reshape(2, 5, K),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(bf.grad.double(), gout.double().sum((0, 1)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    N, K, G = 18, 64, 32
    op = torch.ops.fastdl.int4_weight_only_linear.default
    u, s, z = random_int4(N, K, G, True)
    q = pack_ref(u)
    xg, bg = torch.randn(5, K, requires_grad=True), torch.randn(N, requires_grad=True)
    with fastdl.use_backend(backend):
        torch.library.opcheck(op, (xg, q, s, z, bg, G))
        torch.library.opcheck(op, (torch.randn(2, 3, K).bfloat16(), q, s, None, None, G))


def test_compile_fullgraph_op_and_module():
    N, K, G = 24, 64, 32
    u, s, z = random_int4(N, K, G, True)
    q = pack_ref(u)

    def f(x, b):
        return int4_weight_only_linear(x, q, s, z, b, G) * 2

    x, b = torch.randn(6, K), torch.randn(N)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x, b), f(x, b))
    torch.manual_seed(0)
    model = nn.Sequential(Int4Linear.from_linear(nn.Linear(64, 96), group_size=32), nn.ReLU(),
                          Int4Linear.from_linear(nn.Linear(96, 16), group_size=32)).eval()  # fmt: skip
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True, backend="aot_eager")(x), model(x))


def test_autocast_runs_in_the_autocast_dtype():
    N, K, G = 8, 64, 64
    u, s, _ = random_int4(N, K, G, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert int4_weight_only_linear(torch.randn(3, K), pack_ref(u), s, None, None, G).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_one_type_naming_the_argument(backend):
    N, K, G = 8, 64, 32
    u, s, z = random_int4(N, K, G, True)
    q, x = pack_ref(u), torch.randn(2, K)
    cases = [
        (TypeError, "x must be float32", (x.int(), q, s, z, None, G)),
        (ValueError, "at least 1 dimension", (torch.tensor(1.0), q, s, z, None, G)),
        (ValueError, "group_size must be one of 32, 64, 128, got 16", (x, q, s.repeat(1, 2), None, None, 16)),
        (ValueError, "K = x.shape\\[-1\\] = 96 must be a multiple of group_size = 64",
         (torch.randn(2, 96), q, s, None, None, 64)),
        (TypeError, "qweight must be uint8", (x, q.to(torch.int8), s, z, None, G)),
        (ValueError, "qweight must have shape \\[N, K / 2\\]", (x, q[:, :16], s, z, None, G)),
        (TypeError, "scales must be float16", (x, q, s.float(), z, None, G)),
        (ValueError, "scales must have shape \\[N, K / group_size\\] = \\[8, 2\\]", (x, q, s[:, :1], z, None, G)),
        (TypeError, "zeros must be uint8", (x, q, s, z.int(), None, G)),
        (ValueError, "zeros must have shape", (x, q, s, z[:4], None, G)),
        (TypeError, "bias must be a floating tensor", (x, q, s, z, torch.ones(N, dtype=torch.int32), G)),
        (ValueError, "bias must have shape \\[N\\] = \\[8\\]", (x, q, s, z, torch.ones(N + 1), G)),
    ]
    with fastdl.use_backend(backend):
        for exc, words, args in cases:
            with pytest.raises(exc, match=words) as info:
                int4_weight_only_linear(*args)
            assert "int4_weight_only_linear" in str(info.value)


def test_missing_cpp_kernel_falls_back_in_auto_and_is_named_when_requested():
    ok, why = fastdl.backends.available("cpp", "int4_weight_only_linear", "cpu")
    if ok:
        pytest.skip("this build registers the C++ int4 kernel")
    N, K, G = 4, 32, 32
    u, s, _ = random_int4(N, K, G, False)
    assert fastdl.backends.select("int4_weight_only_linear", "cpu") == "torch"
    int4_weight_only_linear(torch.randn(1, K), pack_ref(u), s, None, None, G)  # auto: the reference
    with fastdl.use_backend("cpp"), pytest.raises(fastdl.BackendUnavailableError, match="int4_weight_only_linear"):
        int4_weight_only_linear(torch.randn(1, K), pack_ref(u), s, None, None, G)


def check_cpp_level() -> str:
    """Run in a process capped by FASTDL_CPU_ISA (test below): the C++ int4 kernels of that level against float64 -
    the streaming kernel (small M, every row count of its register tile), the tile kernel (every remainder of its
    row and weight-row tiles, x in two chunks at K = 4096, M = 67) and fgemm with the weight dequantized while packed
    (M > 64 on AVX2) - with and without zeros, negative scales, fp32 / bf16 / fp16 x, long K; N leaves a remainder of
    weight rows after the streaming kernel's blocks of several rows. Returns the family."""
    g = torch.Generator().manual_seed(7)
    with fastdl.use_backend("cpp"):
        for N, K, M in [(1, 32, 1), (7, 96, 2), (34, 256, 3), (41, 384, 4), (9, 128, 5), (11, 64, 6), (13, 96, 7),
                        (65, 512, 17), (24, 2048, 64), (70, 4096, 67), (130, 4096, 1)]:
            for G in groups_for(K):
                for zeros in (False, True):
                    u, s, z = random_int4(N, K, G, zeros, seed=N + K + M + G)
                    W = dequant_ref(u, s, z, G)
                    for dtype in (torch.float32, torch.bfloat16, torch.float16):
                        x = torch.randn(M, K, generator=g).to(dtype)
                        bias = torch.randn(N, generator=g) if zeros else None
                        out = int4_weight_only_linear(x, pack_ref(u), s, z, bias, G)
                        err = rel_err(out, linear_ref(x, W, bias))
                        assert err <= TOL[dtype], (dtype, N, K, M, G, zeros, err)
    return fastdl.info(print_result=False)["cpu"]["kernels"]["int4"]


@pytest.mark.parametrize("isa", ["avx512", "native"])
def test_cpp_pb_route_matches_float64(isa):
    """FASTDL_CPU_PB_ROWS=1: every float call of an AVX-512 family above the streaming rows takes fused_linear's fp32 pb
    kernel with the int4 weight dequantized per chunk of panels while packed (the route large M takes on Intel:
    held_pb_min_rows), against float64 on check_cpp_level's shapes; other families ignore the variable."""
    from conftest import run_at_isa

    if not fastdl.backends.available("cpp", "int4_weight_only_linear", "cpu")[0]:
        pytest.skip("no C++ int4 kernel in this build")
    out = run_at_isa(isa, "import os; os.environ['FASTDL_CPU_PB_ROWS'] = '1'; import test_int4; "
                          "print(test_int4.check_cpp_level())")
    assert out.strip().splitlines()[-1] in ("scalar", "avx2", "avx512_vnni"), out


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "native"])
def test_cpp_kernels_of_every_isa_level_match_float64(isa):
    from conftest import native_cpu_kernels, run_at_isa

    if not fastdl.backends.available("cpp", "int4_weight_only_linear", "cpu")[0]:
        pytest.skip("no C++ int4 kernel in this build")
    out = run_at_isa(isa, "import test_int4; print(test_int4.check_cpp_level())")
    family = out.strip().splitlines()[-1]
    native = native_cpu_kernels()["int4"]
    want = {"scalar": "scalar", "avx2": "avx2" if native != "scalar" else "scalar",
            "avx512": native if native in ("avx512_vnni", "scalar") else "avx2"}.get(isa, native)
    assert family == want, (isa, family, native)


# ------------------------------------------------------------------------------------------ W4A8: int4_a8_linear
def quant_groups_ref(x: torch.Tensor, G: int):
    """The activations' contract element by element in float64 where it is exact: per row and group, amax; q =
    round_half_even(clamp(fp32(x * fp32(127 / amax)))); s = fp32(amax / 127); non-finite groups: q 0, s NaN."""
    M, K = x.shape
    q = torch.zeros(M, K, dtype=torch.int8)
    s = torch.zeros(M, K // G)
    for m in range(M):
        for g in range(K // G):
            xg = x[m, g * G:(g + 1) * G].float()
            if not torch.isfinite(xg).all():
                s[m, g] = float("nan")
                continue
            amax = xg.abs().max()
            if amax == 0:
                continue
            inv = torch.tensor(127.0) / amax  # fp32 IEEE division
            q[m, g * G:(g + 1) * G] = (xg * inv).clamp(-127, 127).round().to(torch.int8)
            s[m, g] = amax / torch.tensor(127.0)
    return q, s


def a8_ref(x, u, s, z, G, bias):
    """float64: sum_g s_x s_w sum_k q_x (u - z), the integer part exact."""
    K = x.shape[-1]
    q, sx = quant_groups_ref(x.reshape(-1, K).float(), G)
    W = dequant_ref(u, s, z, G)
    xq = (q.double().reshape(-1, K // G, G) * sx.double()[..., None]).reshape(-1, K)
    return linear_ref(xq.reshape(*x.shape[:-1], K), W, bias)


def test_quantize_groups_is_the_contract_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 3, 256)
    x[1, :64] = 0.0
    x[2, 70] = float("nan")
    x[3, 200] = float("inf")
    x[4, 5] = 127.0 / 254.0 * x[4, :32].abs().max()  # a value that lands on a rounding tie region
    for G in (32, 64, 128):
        q, s = quantize_groups(x, G)
        qr, sr = quant_groups_ref(x, G)
        assert torch.equal(q, qr), G
        assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s.nan_to_num(), sr.nan_to_num()), G


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a8_op_matches_float64_reference(backend, dtype):
    g = torch.Generator().manual_seed(2)
    for N, K, M in SHAPES + [(40, 512, 64), (17, 128, 130)]:
        for G in groups_for(K):
            for zeros in (False, True):
                u, s, z = random_int4(N, K, G, zeros, seed=N * K + M + 1)
                x = torch.randn(M, K, generator=g).to(dtype)
                bias = torch.randn(N, generator=g) if M != 3 else None
                with fastdl.use_backend(backend):
                    out = int4_a8_linear(x, pack_ref(u), s, z, bias, G)
                assert out.dtype == dtype and out.shape == (M, N)
                err = rel_err(out, a8_ref(x, u, s, z, G, bias))
                assert err <= TOL[dtype], (backend, dtype, N, K, M, G, zeros, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a8_nan_rows_empty_and_errors(backend):
    N, K, G = 9, 128, 32
    u, s, z = random_int4(N, K, G, False)
    x = torch.randn(3, K)
    x[1, 40] = float("nan")
    with fastdl.use_backend(backend):
        out = int4_a8_linear(x, pack_ref(u), s, None, None, G)
        assert out[1].isnan().all() and not out[[0, 2]].isnan().any()
        assert int4_a8_linear(torch.randn(0, K), pack_ref(u), s, None, None, G).shape == (0, N)
        with pytest.raises(ValueError, match="int4_a8_linear.*multiple of group_size"):
            int4_a8_linear(torch.randn(2, 96), pack_ref(u)[:, :48], s, None, None, 64)
        with pytest.raises(TypeError, match="int4_a8_linear.*x must be"):
            int4_a8_linear(torch.randn(2, K).to(torch.int32), pack_ref(u), s, None, None, G)


def test_a8_extra_error_is_small_next_to_int4_weight_error():
    """On Gaussian data the activations' rounding adds ~0.2 % to the output error: W4A8 vs the exact fp32 layer is
    within 2 % of weight-only int4's own error (about 10 % at group 128)."""
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(1024, 256)
    x = torch.randn(16, 1024, generator=g)
    ref = lin(x).detach().double()
    wo, dyn = (Int4Linear.from_linear(lin, group_size=128, mode=m) for m in ("weight_only", "dynamic"))
    e_wo, e_dyn = rel_err(wo(x), ref), rel_err(dyn(x), ref)
    extra = rel_err(dyn(x), wo(x).double())
    assert e_wo > 0.05 and extra < 0.01 and e_dyn < e_wo * 1.02, (e_wo, e_dyn, extra)


def check_cpp_a8_level() -> str:
    """In a process capped by FASTDL_CPU_ISA: the W4A8 kernels of that level against float64 (quantization of x and
    the integer kernels, the dot-product form and the GEMM, every row count of their tiles, weight blocks, zeros,
    negative scales)."""
    g = torch.Generator().manual_seed(9)
    with fastdl.use_backend("cpp"):
        # M >= 16 takes the AVX-512 family's GEMM: panels of 32 weight rows (N tails 1 and 4), K chunks of 512, row
        # blocks of 128 and tiles of 6 rows (135 = 128 + 6 + 1), K not a multiple of 64
        for N, K, M in [(1, 32, 1), (7, 96, 2), (34, 256, 3), (41, 384, 4), (19, 128, 5), (65, 512, 17), (24, 2048, 9),
                        (33, 96, 16), (100, 1024, 135)]:  # fmt: skip
            for G in groups_for(K):
                for zeros in (False, True):
                    u, s, z = random_int4(N, K, G, zeros, seed=N + K + M + G + 1)
                    x = torch.randn(M, K, generator=g)
                    bias = torch.randn(N, generator=g) if zeros else None
                    err = rel_err(int4_a8_linear(x, pack_ref(u), s, z, bias, G), a8_ref(x, u, s, z, G, bias))
                    assert err <= 1e-5, (N, K, M, G, zeros, err)
    return fastdl.info(print_result=False)["cpu"]["kernels"]["int4"]


@pytest.mark.parametrize("isa", ["scalar", "avx2", "native"])
def test_cpp_a8_kernels_of_every_isa_level_match_float64(isa):
    from conftest import run_at_isa

    if not fastdl.backends.available("cpp", "int4_a8_linear", "cpu")[0]:
        pytest.skip("no C++ int4 kernel in this build")
    run_at_isa(isa, "import test_int4; print(test_int4.check_cpp_a8_level())")


def test_dynamic_mode_module_round_trip_and_convert():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(4, 256)
    ref = model(x)
    fastdl.convert(model, "int4")
    assert all(m.mode == "dynamic" for m in (model[0], model[2]))
    out = model(x)
    assert rel_err(out, ref) < 0.2
    sd = model[0].state_dict()
    fresh = Int4Linear(256, 64, group_size=128)
    assert fresh.mode == "weight_only"
    fresh.load_state_dict(sd)
    assert fresh.mode == "dynamic" and torch.equal(fresh(x), model[0](x))
    assert "mode='dynamic'" in repr(fresh)


# ------------------------------------------------------------------------------------------------ the layout
def test_pack_unpack_round_trip_and_nibble_order():
    u, s, z = random_int4(5, 96, 32, True)
    q = pack_int4(u)
    assert q.dtype == torch.uint8 and q.shape == (5, 48) and q.is_contiguous()
    assert torch.equal(q, pack_ref(u))
    assert torch.equal(unpack_int4(q, 96), u)
    assert int(q[2, 16 + 3]) == int(u[2, 32 + 3]) | (int(u[2, 48 + 3]) << 4)  # block 1, byte 3
    assert torch.equal(dequantize_int4(q, s, z, 32).double(), dequant_ref(u, s, z, 32))  # exact in fp32
    assert torch.equal(dequantize_int4(q, s, None, 32).double(), dequant_ref(u, s, None, 32))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 32), 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(torch.zeros((1, 48), dtype=torch.uint8))
    with pytest.raises(ValueError, match="K = 64"):
        unpack_int4(q, 64)


# --------------------------------------------------------------------------------------------- the quantizer
def _group_sq_err(w, q, s, z, G):
    return (dequantize_int4(q, s, z, G) - w).square().reshape(w.shape[0], -1, G).sum(-1)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("G", [32, 128])
def test_quantizer_rtn_bound_and_search_never_worse_per_group(G, symmetric):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1)
    w[0, :G] = 0.0  # a zero group
    q, s, z = quantize_int4(w, G, "rtn", symmetric)
    assert q.shape == (48, 128) and s.dtype == torch.float16 and s.shape == (48, 256 // G)
    assert (z is None) == symmetric and (z is None or (z.dtype == torch.uint8 and int(z.max()) <= 15))
    deq = dequantize_int4(q, s, z, G)
    step = s.float().abs().repeat_interleave(G, dim=1)
    assert bool(((deq - w).abs() <= 0.5 * step * 1.002 + 1e-12).all())  # RTN: every weight within half a step
    assert float(s[0, 0]) == 0.0 and bool((deq[0, :G] == 0).all())
    q2, s2, z2 = quantize_int4(w, G, "search", symmetric)
    assert bool((_group_sq_err(w, q2, s2, z2, G) <= _group_sq_err(w, q, s, z, G) * (1 + 1e-6)).all())
    assert float(s2[0, 0]) == 0.0


@pytest.mark.parametrize("G", [32, 128])
def test_search_lowers_mse_vs_rtn_by_10_percent_on_outliers(G):
    """Issue 29's bar: the scale search lowers the weight MSE vs plain RTN by >= 10 % on Gaussian weights with 1 %
    outliers (x10); measured here on [64, 1024] (0.75 at G = 32, 0.70 at G = 128 on [1024, 4096])."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 1024, generator=g)
    ratios = []
    for outliers in (False, True):
        v = w.clone()
        if outliers:
            v[torch.rand(v.shape, generator=g) < 0.01] *= 10
        mse = {m: (dequantize_int4(*quantize_int4(v, G, m), G) - v).square().mean().item() for m in ("rtn", "search")}
        ratios.append(mse["search"] / mse["rtn"])
    assert ratios[0] <= 0.8 and ratios[1] <= 0.9, ratios


def test_asymmetric_beats_symmetric_on_one_signed_weights():
    torch.manual_seed(0)
    w = torch.rand(16, 128)  # all positive: zero points use the whole code range
    e_sym = (dequantize_int4(*quantize_int4(w, 32), 32) - w).square().mean()
    e_asym = (dequantize_int4(*quantize_int4(w, 32, symmetric=False), 32) - w).square().mean()
    assert e_asym < 0.5 * e_sym


def test_quantizer_rejects_bad_input_naming_the_argument():
    w = torch.randn(4, 64)
    for bad in (float("nan"), float("inf")):
        v = w.clone()
        v[1, 5] = bad
        with pytest.raises(ValueError, match=r"w must be finite.*\(1, 5\)"):
            quantize_int4(v, 32)
    with pytest.raises(ValueError, match="float16"):
        quantize_int4(w * 1e6, 32)
    with pytest.raises(ValueError, match="multiple of group_size = 128"):
        quantize_int4(w, 128)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(w, 16)
    with pytest.raises(TypeError, match="floating"):
        quantize_int4(w.int(), 32)
    with pytest.raises(ValueError, match="method"):
        quantize_int4(w, 32, "gptq")
    q, s, z = quantize_int4(torch.empty(8, 64, device="meta"), 32, symmetric=False)
    assert q.is_meta and q.shape == (8, 32) and s.shape == (8, 2) and z.shape == (8, 2)


# --------------------------------------------------------------------------------------------------- importers
def _int32(v: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns (0 .. 2^32 - 1) as int32 (two's complement), as the checkpoints store them."""
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def gptq_pack(u_kn, z_gn, v1=True):
    """AutoGPTQ's packing (QuantLinear.pack): qweight [K/8, N], input 8 r + j in bits 4 j of row r; qzeros
    [K/G, N/8], output 8 c + j in bits 4 j of column c, storing z - 1 ('v1')."""
    K, N = u_kn.shape
    qweight = torch.zeros(K // 8, N, dtype=torch.int64)
    for j in range(8):
        qweight |= u_kn[j::8].to(torch.int64) << (4 * j)
    zs = z_gn.to(torch.int64) - (1 if v1 else 0)
    qzeros = torch.zeros(zs.shape[0], N // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= (zs[:, j::8] & 0xFFFFFFFF) << (4 * j)
    return _int32(qweight), _int32(qzeros & 0xFFFFFFFF)


def awq_pack(u_kn, z_gn):
    """AutoAWQ's GEMM packing (WQLinear_GEMM.from_linear): column c of [*, N/8], bits 4 i hold output
    8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def pack(t):
        out = torch.zeros(t.shape[0], t.shape[1] // 8, dtype=torch.int64)
        for i in range(8):
            out |= t[:, order[i]::8].to(torch.int64) << (4 * i)
        return _int32(out)

    return pack(u_kn), pack(z_gn)


def weight_from_source(u_kn, s_gn, z_gn, g_of_k):
    """W[n, k] = (u[k, n] - z[g(k), n]) * float32(s[g(k), n]) in fp32 (the exact value, as float64 holds it)."""
    return ((u_kn.double() - z_gn[g_of_k].double()) * s_gn[g_of_k].float().double()).t()


@pytest.mark.parametrize("src_group", [32, 128, 256, -1])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_import_bit_for_bit(src_group, act_order, sym):
    K, N = 512, 48
    G = K if src_group == -1 else src_group
    g = torch.Generator().manual_seed(G + 2 * act_order + sym)
    u = torch.randint(0, 16, (K, N), generator=g)
    z = torch.full((K // G, N), 8) if sym else torch.randint(1, 16, (K // G, N), generator=g)  # v1: z >= 1
    s = (torch.rand(K // G, N, generator=g) * 0.05 + 1e-3).half()
    g_idx = torch.arange(K) // G
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    qweight, qzeros = gptq_pack(u, z)
    layer = Int4Linear.from_gptq(qweight, qzeros, s, g_idx.to(torch.int32), bias=torch.randn(N))
    W = weight_from_source(u, s, z, g_idx)
    assert torch.equal(layer.to_linear().weight.double(), W)  # bit for bit
    assert (layer.zeros is None) == sym and layer.group_size == min(G, 128)
    assert (layer.input_permutation is not None) == (act_order and G < K)  # one group: nothing to permute
    x = torch.randn(3, K)
    assert rel_err(layer(x), linear_ref(x, W, layer.bias)) <= 1e-5
    q2, s2, z2, G2, perm = import_gptq(qweight, qzeros, s, None if not act_order else g_idx.int())
    assert G2 == layer.group_size and q2.dtype == torch.uint8 and s2.dtype == torch.float16


def test_gptq_v2_zero_points_and_damaged_v1():
    K, N, G = 64, 16, 32
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // G, N), generator=g)
    z[0, 0] = 0
    s = (torch.rand(K // G, N, generator=g) + 0.1).half()
    qweight, qzeros = gptq_pack(u, z, v1=False)
    layer = Int4Linear.from_gptq(qweight, qzeros, s, format="gptq_v2")  # quantize_config's name of "v2"
    assert torch.equal(layer.to_linear().weight.double(), weight_from_source(u, s, z, torch.arange(K) // G))
    with pytest.raises(ValueError, match="z = 16"):  # stored 15 in v1: the overflow of z = 0
        import_gptq(qweight, _int32(torch.full_like(qzeros, 0xF, dtype=torch.int64)), s)
    with pytest.raises(TypeError, match="qweight must be int32"):
        import_gptq(qweight.float(), qzeros, s)
    with pytest.raises(ValueError, match="scales must have shape"):
        import_gptq(qweight, qzeros, s[:1])
    with pytest.raises(ValueError, match="g_idx must give each"):
        import_gptq(qweight, qzeros, s, torch.zeros(K, dtype=torch.int32))
    with pytest.raises(ValueError, match="format"):
        import_gptq(qweight, qzeros, s, format="v3")


@pytest.mark.parametrize("G", [32, 128])
def test_awq_import_bit_for_bit(G):
    K, N = 256, 40
    g = torch.Generator().manual_seed(G)
    u = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(0, 16, (K // G, N), generator=g)
    s = (torch.rand(K // G, N, generator=g) * 0.05 + 1e-3).half()
    qweight, qzeros = awq_pack(u, z)
    assert qweight.shape == (K, N // 8) and qzeros.shape == (K // G, N // 8)
    layer = Int4Linear.from_awq(qweight, qzeros, s)
    W = weight_from_source(u, s, z, torch.arange(K) // G)
    assert torch.equal(layer.to_linear().weight.double(), W) and layer.group_size == G and layer.bias is None
    x = torch.randn(2, 5, K)
    assert rel_err(layer(x), linear_ref(x, W, None)) <= 1e-5
    # the interleave matters: packing in plain order gives another weight
    plain = torch.zeros(K, N // 8, dtype=torch.int64)
    for i in range(8):
        plain |= u[:, i::8].to(torch.int64) << (4 * i)
    assert not torch.equal(import_awq(_int32(plain), qzeros, s)[0], layer.qweight)


# ------------------------------------------------------------------------------------------------------ module
def _lin(K=96, N=40, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(K, N, bias=bias)


def test_module_from_linear_forward_to_linear_and_memory():
    lin = _lin(256, 40)
    m = Int4Linear.from_linear(lin, group_size=64).eval()
    x = torch.randn(9, 256)
    q, s, z = quantize_int4(lin.weight.detach(), 64)
    assert torch.equal(m.qweight, q) and torch.equal(m.scales, s) and m.zeros is None
    assert torch.equal(m(x), int4_weight_only_linear(x, q, s, None, lin.bias.detach(), 64))
    W = dequantize_int4(q, s, None, 64)
    assert torch.equal(m.to_linear().weight, W)
    assert 0.05 < m.quantization_error < 0.12  # Gaussian-like weights, 4 bits
    assert rel_err(m(x), lin(x)) < 0.15
    held = 40 * 128 + 40 * 4 * 2 + 40 * 4
    assert m.memory_bytes() == held
    for M in (1, 4, 33, 300):  # no dense copy at any M
        m(torch.randn(M, 256))
    assert m.memory_bytes() == held and held < 0.16 * lin.weight.numel() * 4
    assert "group_size=64" in repr(m)
    assert m(x.bfloat16()).dtype == torch.bfloat16 and m.half().scales.dtype == torch.float16
    m2 = copy.deepcopy(m).to(torch.bfloat16)
    assert m2.scales.dtype == torch.float16 and m2.bias.dtype == torch.bfloat16
    xg = torch.randn(3, 256, requires_grad=True)
    m.float()(xg).sum().backward()
    assert xg.grad is not None and m.bias.grad is not None


def test_module_constructor_and_input_errors_name_the_layer():
    with pytest.raises(ValueError, match="group_size must be one of"):
        Int4Linear(64, 8, group_size=48)
    with pytest.raises(ValueError, match="in_features = 40 must be a multiple of group_size = 32"):
        Int4Linear(40, 8, group_size=32)
    with pytest.raises(TypeError, match="nn.Linear"):
        Int4Linear.from_linear(nn.Conv1d(3, 3, 1))
    bad = _lin(64, 8)
    with torch.no_grad():
        bad.weight[2, 3] = float("nan")
    with pytest.raises(ValueError, match="linear.weight: .*finite"):
        Int4Linear.from_linear(bad, group_size=32)
    m = Int4Linear(64, 8, group_size=32)
    name = r"^Int4Linear\(in_features=64, out_features=8\): "
    with pytest.raises(ValueError, match=name + "x.shape\\[-1\\] must equal in_features = 64"):
        m(torch.randn(2, 32))
    with pytest.raises(TypeError, match=name + "x must be a floating tensor"):
        m(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match=name + "x must have at least 1 dimension"):
        m(torch.tensor(1.0))


def test_state_dict_round_trip_torch_load_weights_only_and_safetensors(tmp_path):
    lin = _lin(128, 24)
    m = Int4Linear.from_linear(lin, group_size=32, symmetric=False).eval()
    sd = m.state_dict()
    assert set(sd) == {"qweight", "scales", "zeros", "bias", "_extra_state"}
    rec = decode_extra_state(sd["_extra_state"])
    assert rec["format"] == "fastdl.Int4Linear" and rec["version"] == 1 and rec["group_size"] == 32
    assert rec["symmetric"] is False and rec["permuted"] is False
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    fresh = Int4Linear(128, 24, group_size=128)  # the checkpoint's group size and zero points are taken
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    x = torch.randn(4, 128)
    assert fresh.group_size == 32 and fresh.zeros is not None and torch.equal(fresh(x), m(x))
    from safetensors.torch import load_file, save_file

    save_file(sd, tmp_path / "l.safetensors")
    again = Int4Linear(128, 24)
    again.load_state_dict(load_file(tmp_path / "l.safetensors"))
    assert torch.equal(again(x), m(x))
    from_float = Int4Linear(128, 24, group_size=32, symmetric=False)
    from_float.load_state_dict(lin.state_dict())  # a plain nn.Linear checkpoint: quantized on load
    assert torch.equal(from_float(x), m(x))


def test_permuted_layer_state_dict_and_to_linear():
    K, N, G = 128, 16, 32
    g = torch.Generator().manual_seed(5)
    u = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(1, 16, (K // G, N), generator=g)
    s = (torch.rand(K // G, N, generator=g) + 0.01).half()
    g_idx = (torch.arange(K) // G)[torch.randperm(K, generator=g)]
    layer = Int4Linear.from_gptq(*gptq_pack(u, z), s, g_idx)
    sd = layer.state_dict()
    assert sd["input_permutation"].dtype == torch.int64 and decode_extra_state(sd["_extra_state"])["permuted"]
    fresh = Int4Linear(K, N, bias=False)
    fresh.load_state_dict(sd)
    x = torch.randn(3, K)
    assert torch.equal(fresh(x), layer(x))
    assert rel_err(layer.to_linear()(x), layer(x)) <= 1e-6


def _tamper(sd, key, value):
    out = dict(sd)
    if value is None:
        del out[key]
    else:
        out[key] = value
    return out


def test_tampered_checkpoints_raise_checkpoint_error_naming_the_key():
    lin = _lin(64, 8)
    m = Int4Linear.from_linear(lin, group_size=32, symmetric=False)
    sd = m.state_dict()
    rec = decode_extra_state(sd["_extra_state"])
    z_bad = sd["zeros"].clone()
    z_bad[0, 0] = 16
    s_nan = sd["scales"].clone()
    s_nan[1, 1] = float("nan")
    cases = [
        ("qweight", _tamper(sd, "qweight", sd["qweight"].to(torch.int8))),
        ("qweight", _tamper(sd, "qweight", sd["qweight"][:, :16])),
        ("scales", _tamper(sd, "scales", sd["scales"].float())),
        ("scales", _tamper(sd, "scales", sd["scales"][:, :1].repeat(1, 3))),
        ("scales must be finite", _tamper(sd, "scales", s_nan)),
        ("zeros", _tamper(sd, "zeros", z_bad)),
        ("zeros", _tamper(sd, "zeros", sd["zeros"].int())),
        ("symmetric", _tamper(sd, "zeros", None)),
        ("input_permutation", _tamper(sd, "input_permutation", torch.zeros(64, dtype=torch.int64))),
        ("bias", _tamper(sd, "bias", torch.ones(8, dtype=torch.int32))),
        ("newer", _tamper(sd, "_extra_state", encode_extra_state({**rec, "version": 2}))),
        ("not a fastdl.Int4Linear record", _tamper(sd, "_extra_state", encode_extra_state({"format": "x"}))),
        ("in_features", _tamper(sd, "_extra_state", encode_extra_state({**rec, "in_features": 32}))),
        ("group_size", _tamper(sd, "_extra_state", encode_extra_state({**rec, "group_size": 64}))),
        ("weight", _tamper(_tamper(sd, "qweight", None), "weight", torch.full((8, 64), float("nan")))),
    ]
    for words, bad in cases:
        fresh = Int4Linear(64, 8, group_size=32)
        before = fresh.qweight.clone()
        with pytest.raises(CheckpointError, match=words):
            fresh.load_state_dict(bad)
        assert torch.equal(fresh.qweight, before)  # nothing was copied
    with pytest.raises(RuntimeError, match="scales"):  # a missing key: load_state_dict's own error
        Int4Linear(64, 8, group_size=32).load_state_dict(_tamper(sd, "scales", None))


# ------------------------------------------------------------------------------------------- convert and files
class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.odd, self.down = nn.Linear(64, 96), nn.Linear(96, 40), nn.Linear(40, 16)

    def forward(self, x):
        return self.down(torch.relu(self.odd(torch.relu(self.up(x)))))


def test_convert_int4_report_and_save_load(tmp_path):
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(5, 64)
    ref = model(x)
    fastdl.convert(model, "int4_weight_only")
    assert isinstance(model.up, Int4Linear) and model.up.group_size == 64 and model.odd.group_size == 32
    assert type(model.down) is nn.Linear  # in_features = 40: not a multiple of 32
    rows = {r["layer"]: r for r in fastdl.report(model)}
    assert rows["up"]["kernel"] == "int4_weight_only" and 0 < rows["up"]["error"] < 0.15
    assert "does not apply" in rows["down"]["note"] and "rel err" in str(fastdl.report(model))
    assert rows["up"]["bytes_after"] < 0.2 * rows["up"]["bytes_before"]
    with torch.no_grad():
        out = model(x)
    assert rel_err(out, ref) < 0.2
    for suffix in (".safetensors", ".pt"):
        fastdl.save(model, tmp_path / f"m{suffix}")
        again = fastdl.load(_MLP(), tmp_path / f"m{suffix}")
        assert isinstance(again.odd, Int4Linear) and again.odd.recipe() == model.odd.recipe()
        with torch.no_grad():
            assert torch.equal(again(x), out)


def test_auto_picks_int4_only_when_asked():
    torch.manual_seed(0)
    x = torch.randn(4, 64)
    convert_mod._DECISIONS.clear()
    dispatch.clear_decisions()
    dispatch.set_timer(lambda calls, device, info: {n: (1.0 if n.startswith("original") else
                                                       0.1 if n.startswith("int4") else 0.5) for n in calls})
    try:
        default = fastdl.convert(nn.Sequential(nn.Linear(64, 64)), "auto", example_inputs=(x,))
        assert not isinstance(default[0], Int4Linear)  # not a default candidate
        strict = fastdl.convert(nn.Sequential(nn.Linear(64, 64)), "auto", example_inputs=(x,),
                                candidates=("int8_weight_only", "int4_weight_only"))  # fmt: skip
        assert not isinstance(strict[0], Int4Linear)  # its error is above the default max_error (0.02)
        assert "max_error" in fastdl.report(strict)[0]["candidates"]["int4_weight_only"]["rejected"]
        opted = fastdl.convert(nn.Sequential(nn.Linear(64, 64)), "auto", example_inputs=(x,), max_error=0.3,
                               candidates=("int8_weight_only", "int4_weight_only"))  # fmt: skip
        assert isinstance(opted[0], Int4Linear) and fastdl.report(opted)[0]["kernel"] == "int4_weight_only"
    finally:
        dispatch.set_timer(None)
        dispatch.clear_decisions()
        convert_mod._DECISIONS.clear()


def test_hf_save_pretrained_load_pretrained_round_trip(tmp_path):
    """A tiny Llama (random weights) converted to int4, one layer replaced by an act-order asymmetric GPTQ import
    (zero points and an input permutation), save_pretrained, then fastdl.load_pretrained: the same logits bit for
    bit, and the guard that stops transformers alone."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    fastdl.convert(model, "int4_weight_only")
    K, N, G = 128, 64, 32  # down_proj: in 128, out 64
    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 16, (K, N), generator=g)
    z = torch.randint(1, 16, (K // G, N), generator=g)
    s = (torch.rand(K // G, N, generator=g) * 0.02 + 1e-3).half()
    g_idx = (torch.arange(K) // G)[torch.randperm(K, generator=g)]
    model.model.layers[0].mlp.down_proj = Int4Linear.from_gptq(*gptq_pack(u, z), s, g_idx)
    ids = torch.randint(0, 96, (2, 7), generator=g)
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path / "m")
    cfg_json = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg_json["quantization_config"]["layers"]["model.layers.0.mlp.down_proj"]["type"] == "Int4Linear"
    assert "transformers_weights" in cfg_json  # transformers alone must stop, not load codes into float layers
    loaded = fastdl.load_pretrained(transformers.LlamaForCausalLM, os.fspath(tmp_path / "m"), dtype=torch.float32)
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.input_permutation is not None and down.zeros is not None
    assert isinstance(loaded.lm_head, Int4Linear) and not loaded.training
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    plain = fastdl.hf.dequantize(loaded)
    assert not any(isinstance(m, Int4Linear) for m in plain.modules())
    with torch.no_grad():
        assert rel_err(plain(ids).logits, ref) < 1e-5
