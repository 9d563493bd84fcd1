"""Quantized expert weights (minagi/moe/quant.py, issue 52): the format and its errors, save / load /
.to, the qgrouped_mm op against its twin (every x86 path, in a subprocess per MINAGI_CPU_ISA level),
opcheck, and expert_mlp with QuantizedWeights against expert_mlp with the float weights they stand
for (every form, both layouts, int8 and int4, decode and prefill sizes; gradients of x and the
gates; torch.compile with no graph break)."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi import expert_mlp

from minagi.moe import ops, reference
from minagi.quant import QuantizedWeight, quantize

from cases import random_routing
from conftest import EXT, assert_close, requires_ext

FORMATS = {  # name: (bits, group_size)
    "int8": (8, None),
    "int8_g32": (8, 32),
    "int4_g32": (4, 32),
    "int4_g128": (4, 128),
}
FORMS = ["gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved", "swiglu_oai", "callable"]
GATED = ("swiglu", "swiglu_interleaved", "swiglu_oai", "callable")


def _act(form):
    if form == "callable":  # a model's own gate: gate * up from halves, through tanh
        return lambda h: torch.tanh(h[..., : h.shape[-1] // 2]) * h[..., h.shape[-1] // 2:]
    return form


# ---------------------------------------------------------------- the format

def test_int8_storage_is_output_major_with_one_scale_per_channel():
    w = torch.randn(3, 40, 24)
    qw = quantize(w, bits=8)
    assert qw.q.dtype == torch.int8 and tuple(qw.q.shape) == (3, 24, 40) and qw.q.is_contiguous()
    assert tuple(qw.scale.shape) == (3, 24) and qw.scale.dtype == torch.bfloat16
    assert qw.shape == w.shape and qw.dtype == torch.float32 and qw.device == w.device and qw.dim() == 3
    want = (qw.q.float() * qw.scale.float().unsqueeze(-1)).mT
    assert torch.equal(qw.dequantize(), want)  # exactly value * stored scale
    # The largest magnitude of each channel maps to -128 (-127 where the rounded scale grew).
    at_peak = w.abs().argmax(1).unsqueeze(-1)
    assert ((qw.q.gather(2, at_peak) == -128) | (qw.q.gather(2, at_peak) == -127)).all()
    q32 = quantize(w, bits=8, scale_dtype=torch.float32)
    assert (q32.q.gather(2, at_peak) == -128).all()
    assert qw.nbytes == 3 * 24 * 40 + 3 * 24 * 2


def test_int4_packing_order_is_llama_cpps():
    # One channel of 32 inputs with values -8..7 then 7..-8: byte j holds input j in its low
    # nibble and input j + 16 in its high nibble, each the value + 8.
    values = torch.tensor(list(range(-8, 8)) + list(range(7, -9, -1)), dtype=torch.float32)
    w = values.view(1, 32, 1) * 0.5
    qw = quantize(w, bits=4, group_size=32, scale_dtype=torch.float32)
    assert float(qw.scale) == 0.5  # -8 * 0.5 is the peak: scale = peak / -8 ... with the sign of -8's weight
    lo, hi = values[:16] + 8, values[16:] + 8
    assert torch.equal(qw.q.view(16), (lo + 16 * hi).to(torch.uint8))
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_takes_both_layouts_and_rounds_to_nearest(fmt, scale_dtype):
    bits, group = FORMATS[fmt]
    w = torch.randn(2, 256, 48)
    qw = quantize(w, bits, group, scale_dtype=scale_dtype)
    qm = quantize(w.mT.contiguous().mT, bits, group, scale_dtype=scale_dtype)  # an [S, out, in] weight's .mT view
    assert torch.equal(qw.q, qm.q) and torch.equal(qw.scale, qm.scale)
    g = group or 256
    step = qw.scale.float().abs().reshape(2, 48, -1).repeat_interleave(g, -1).mT  # [S, in, out]
    err = (qw.dequantize() - w).abs()
    # Half a step, or a whole one on the clipped side (the peak maps to -2^(bits-1), +2^(bits-1) - 1 is the top).
    assert (err <= step * 1.0001).all()
    assert (err <= step * 0.5001).float().mean() > 0.95


def test_quantize_keeps_the_float_dtype_and_handles_zeros():
    w = torch.zeros(1, 64, 4, dtype=torch.bfloat16)
    w[0, :, 1] = 1.0
    qw = quantize(w, bits=4, group_size=32)
    assert qw.dtype == torch.bfloat16 and qw.dequantize().dtype == torch.bfloat16
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.randn(2, 64, 8),), {"bits": 3}, "bits must be 8 or 4"),
    ((torch.randn(2, 64, 8),), {"bits": 4}, "int4 needs a group_size"),
    ((torch.randn(2, 64, 8),), {"bits": 4, "group_size": 48}, "multiple of 32"),
    ((torch.randn(2, 64, 8),), {"bits": 8, "group_size": 0}, "multiple of 32"),
    ((torch.randint(0, 5, (2, 64, 8)),), {"bits": 8}, "must be a floating-point tensor"),
    ((torch.randn(64, 8),), {"bits": 8}, r"must be \[S, in, out\]"),
    ((torch.randn(2, 64, 8),), {"bits": 8, "scale_dtype": torch.int8}, "scale_dtype must be"),
])
def test_quantize_names_the_problem(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(*args, **kwargs)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        quantize([[1.0]], bits=8)


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 128), (8, 32), (8, None)])
def test_inputs_that_groups_do_not_divide(bits, group):
    # 171 inputs (the default byte model's d_hidden): stored padded to whole groups with zeros, the
    # last group short (its scale from its own inputs only).
    w = torch.randn(2, 171, 8)
    w[:, 160:] *= 0.01  # the short last group of 32 is small: its scale must come from it alone
    qw = quantize(w, bits, group, scale_dtype=torch.float32)
    stored = 171 if group is None else -(-171 // group) * group
    assert qw.shape == w.shape and qw.in_features == 171
    assert tuple(qw.q.shape) == (2, 8, stored * bits // 8)
    assert tuple(qw.scale.shape) == ((2, 8) if group is None else (2, 8, -(-171 // group)))
    deq = qw.dequantize()
    assert deq.shape == w.shape
    g = group or 171
    step = qw.scale.abs().reshape(2, 8, -1).repeat_interleave(g, -1)[..., :171].mT
    assert ((deq - w).abs() <= step * 1.0001).all()
    if group == 32:
        assert (qw.scale[..., -1].abs() < 0.01 * 5 / 8).all()  # the short group's own peak / 8
    if bits == 4:  # the padding holds zeros (nibble 8)
        b = qw.q.view(2, 8, -1, 16).to(torch.int16)
        values = torch.stack([b & 15, b >> 4], dim=3).reshape(2, 8, stored) - 8
    else:
        values = qw.q.to(torch.int16)
    assert (values[..., 171:] == 0).all() and values[..., :171].abs().amax(-1).min() > 0
    with pytest.raises(ValueError, match="does not hold in_features=100"):
        QuantizedWeight(qw.q, qw.scale, bits, group, torch.float32, 100)


def test_the_class_checks_its_storage():
    qw = quantize(torch.randn(2, 64, 8), bits=4, group_size=32)
    with pytest.raises(ValueError, match="scale must be a contiguous"):
        QuantizedWeight(qw.q, qw.scale[:, :, :1].contiguous(), 4, 32, torch.float32)
    with pytest.raises(ValueError, match="int4 stores q"):
        QuantizedWeight(qw.q.view(torch.int8), qw.scale, 4, 32, torch.float32)
    with pytest.raises(ValueError, match="dtype .* must be a floating dtype"):
        QuantizedWeight(qw.q, qw.scale, 4, 32, torch.int32)


@pytest.mark.parametrize("fmt,n_in", [("int8", 64), ("int4_g32", 64), ("int4_g32", 40)])
def test_save_load_weights_only_and_to(fmt, n_in, tmp_path):
    bits, group = FORMATS[fmt]
    qw = quantize(torch.randn(3, n_in, 16), bits, group)
    path = tmp_path / "w.pt"
    torch.save({"w_in": qw, "other": torch.ones(2)}, path)
    back = torch.load(path, weights_only=True)["w_in"]
    assert isinstance(back, QuantizedWeight)
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    assert (back.bits, back.group_size, back.dtype, back.shape) == (qw.bits, qw.group_size, qw.dtype, qw.shape)
    assert torch.equal(back.dequantize(), qw.dequantize())
    buf = io.BytesIO()
    torch.save(qw, buf)
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True).q, qw.q)
    bf = qw.to(torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.q is qw.q and torch.equal(bf.dequantize(), qw.dequantize().bfloat16())
    moved = qw.to("cpu")
    assert moved.device.type == "cpu" and torch.equal(moved.dequantize(), qw.dequantize())
    assert qw.to(device="cpu", dtype=torch.float64).dtype == torch.float64
    with pytest.raises(ValueError, match="floating dtype"):
        qw.to(torch.int32)
    assert "int4" in repr(quantize(torch.randn(1, 32, 2), 4, 32)) and "per output channel" in repr(quantize(
        torch.randn(1, 32, 2), 8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible to torch")
def test_to_a_gpu_and_back():
    qw = quantize(torch.randn(3, 64, 16), 4, 32)
    g = qw.to("cuda")
    assert g.device.type == "cuda" and g.q.is_cuda and g.scale.is_cuda
    assert torch.equal(g.cpu().q, qw.q)


def test_no_weight_gradient():
    qw = quantize(torch.randn(4, 16, 8), bits=8)
    with pytest.raises(ValueError, match="takes no gradient"):
        qw.requires_grad_()
    assert qw.requires_grad_(False) is qw and not qw.requires_grad
    x, idx, gates = torch.randn(5, 16), random_routing(5, 4, 2), torch.rand(5, 2)
    w_out = torch.randn(4, 8, 16)
    bad = QuantizedWeight(qw.q, qw.scale.clone().requires_grad_(), 8, None, torch.float32)
    with pytest.raises(ValueError, match="w_in is a QuantizedWeight whose scale requires grad; quantized weights take "
                                         "no gradient"):
        expert_mlp(x, idx, gates, bad, w_out)


def test_expert_mlp_names_a_quantized_weight_of_another_dtype():
    qw = quantize(torch.randn(4, 16, 8), bits=8)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w_in is torch.float32 but x is torch.bfloat16"):
        expert_mlp(x, random_routing(5, 4, 2), torch.rand(5, 2), qw, torch.randn(4, 8, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="w_in must be a torch.Tensor or a QuantizedWeight"):
        expert_mlp(x, random_routing(5, 4, 2), torch.rand(5, 2), [1], torch.randn(4, 8, 16))


# ---------------------------------------------------------------- the op against its twin

def _plan(N, S, K, seed=0, cap=0):
    g = torch.Generator().manual_seed(seed)
    idx = random_routing(N, S, K, 1.0, generator=g)
    _, order, rows, row_pair, dest = reference.group_plan(idx, S, cap, False)
    return order, rows, row_pair.shape[0]


OP_CASES = [  # (rows per call N, slots S, top_k K, inputs, outputs)
    (1, 8, 3, 64, 48),  # decode: a row in each of 3 slots
    (4, 8, 2, 256, 40),  # up to 4 rows a slot
    (3, 2, 2, 96, 20),  # int8 per channel over 96 inputs (three blocks); two slots with 3 rows
    (200, 6, 2, 128, 72),  # prefill: tiles
    (50, 4, 1, 160, 33),  # an odd number of outputs
    (4, 6, 2, 171, 24),  # inputs groups do not divide: padded blocks, a short last group (decode)
    (40, 3, 2, 40, 24),  # ... and prefill
]


def _op_inputs(fmt, dtype, scale_dtype, case, seed=0):
    N, S, K, I, O = case
    bits, group = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    qw = quantize(torch.randn(S, I, O, generator=g), bits, group, scale_dtype=scale_dtype)
    order, rows, E = _plan(N, S, K, seed)
    a = torch.randn(E + 3, I, generator=g).to(dtype)  # 3 rows past the ranges: zeros
    return a, qw, order, rows


@requires_ext
@pytest.mark.parametrize("fmt,case", [pytest.param(f, c, id=f"{f}-N{c[0]}_S{c[1]}_K{c[2]}_I{c[3]}_O{c[4]}")
                                      for f in FORMATS for c in OP_CASES])
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16), (torch.float64, torch.float32),
                                               (torch.float16, torch.float16)])
def test_qgrouped_mm_matches_twin(compiled, fmt, case, dtype, scale_dtype):
    a, qw, order, rows = _op_inputs(fmt, dtype, scale_dtype, case)
    args = (a, qw.q, qw.scale, order, rows, qw.bits, qw.group)
    got = compiled.qgrouped_mm(*args)
    want = reference.qgrouped_mm(*args)
    assert got.dtype == dtype and got.shape == want.shape
    # The twin multiplies dequantized weights rounded to a's dtype, the kernel unrounded ones.
    assert_close(got.double(), want.double(), dtype, scale=4)
    if dtype == torch.float32:  # against the float64 oracle: float32 accumulation only
        exact = reference.qgrouped_mm(a.double(), qw.q, qw.scale, order, rows, qw.bits, qw.group)
        assert_close(got.double(), exact, torch.float32, scale=4)
    assert not got[-3:].any()


@requires_ext
def test_qgrouped_mm_gradient_goes_to_a(compiled):
    a, qw, order, rows = _op_inputs("int4_g32", torch.float64, torch.float32, (6, 4, 2, 64, 12))
    a.requires_grad_()
    torch.autograd.gradcheck(lambda t: compiled.qgrouped_mm(t, qw.q, qw.scale, order, rows, 4, 32), (a,))
    scale = qw.scale.clone().requires_grad_()
    y = compiled.qgrouped_mm(a, qw.q, scale, order, rows, 4, 32)
    with pytest.raises(RuntimeError, match="quantized weights take no gradient"):
        y.sum().backward()


@requires_ext
@pytest.mark.parametrize("fmt", ["int8", "int4_g32"])
def test_qgrouped_mm_opcheck(compiled, fmt):
    a, qw, order, rows = _op_inputs(fmt, torch.float64, torch.bfloat16, OP_CASES[1])
    a.requires_grad_()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minagi.qgrouped_mm, (a, qw.q, qw.scale, order, rows, qw.bits, qw.group),
                          test_utils=utils)


@requires_ext
def test_qgrouped_mm_names_bad_arguments(compiled):
    a, qw, order, rows = _op_inputs("int4_g32", torch.float32, torch.bfloat16, OP_CASES[1])
    q, s = qw.q, qw.scale
    for args, match in [
        ((a, q, s, order, rows, 3, 32), "bits must be 8 or 4"),
        ((a, q.view(torch.int8), s, order, rows, 4, 32), "int4 weights come as q of dtype uint8"),
        ((a[:, :128], q, s, order, rows, 4, 32), r"must hold a's 128 inputs"),
        ((a[:, :200], q, s, order, rows, 4, 32), r"must hold a's 200 inputs padded to whole groups \(224\)"),
        ((a, q, s, order, rows, 4, 48), "group_size must be 0"),
        ((a, q, s, order, rows, 4, 0), "int4 needs a group_size"),
        ((a, q, s[:, :, :4], order, rows, 4, 32), r"scale must be \[S, out\]"),
        ((a, q, s.to(torch.int32), order, rows, 4, 32), "scale must be float32, bfloat16 or float16"),
        ((a, q, s, order, rows * 100, 4, 32), "slot_rows sums to"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            compiled.qgrouped_mm(*args)


QDECODE_FORMS = [f for f in FORMS if f != "callable"]


@pytest.fixture
def qdecode(compiled):
    if not ops.has_fused("qdecode_experts", torch.device("cpu")):
        pytest.skip("this build has no qdecode_experts kernel")
    return compiled.qdecode_experts


def _qdecode_args(form, fmt, N, K, bias, dtype, seed=0, S=6, D=64, H=40):
    """qdecode_experts' arguments: quantized weights of S experts (D -> H), N characters."""
    bits, group = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    M = 2 * H if form in GATED else H
    qi = quantize((torch.randn(S, D, M, generator=g) / D ** 0.5).to(dtype), bits, group)
    qo = quantize((torch.randn(S, H, D, generator=g) / H ** 0.5).to(dtype), bits, group)
    idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(N)])
    idx[N // 2:, 0] = idx[0, 0]  # characters that share a slot: one range, read once
    x, gates = torch.randn(N, D, generator=g).to(dtype), torch.rand(N, K, generator=g).to(dtype)
    b_in, b_out = ((torch.randn(S, n, generator=g) / 4).to(dtype) if bias else None for n in (M, D))
    return [x, idx, gates, qi.q, qi.scale, bits, qi.group, qo.q, qo.scale, bits, qo.group, b_in, b_out, form,
            1.702, 7.0]


@requires_ext
@pytest.mark.parametrize("form", QDECODE_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qdecode_experts_matches_twin(qdecode, form, dtype):
    # Writing's one op with quantized weights (CPU only): 1 to 4 characters, every format, with and
    # without both biases, against its twin (the exact plan's pipeline with qgrouped_mm's twin).
    for i, (N, K) in enumerate(((1, 3), (2, 1), (4, 3), (4, 6))):
        for fmt in FORMATS:
            bias = (i + len(fmt)) % 2 == 0
            args = _qdecode_args(form, fmt, N, K, bias, dtype, seed=i)
            got = qdecode(*args)
            want = reference.qdecode_experts(*args)
            assert got.dtype == dtype and got.shape == args[0].shape
            assert_close(got.double(), want.double(), dtype, scale=4, msg=f"{fmt} N={N} K={K} bias={bias}")


@requires_ext
def test_qdecode_experts_with_short_groups(qdecode):
    # The byte model's widths (no multiple of 32): padded blocks and a short last group.
    for fmt in ("int4_g32", "int8_g32", "int4_g128"):
        args = _qdecode_args("swiglu", fmt, 3, 2, True, torch.bfloat16, D=72, H=171)
        assert_close(qdecode(*args), reference.qdecode_experts(*args), torch.bfloat16, scale=4, msg=fmt)


@requires_ext
def test_qdecode_experts_gradients_through_the_twin(qdecode):
    # Dispatch never asks qdecode_experts for a gradient; whoever does gets the twin's, for x, the
    # gates and the biases; the scales take none.
    args = _qdecode_args("swiglu", "int4_g32", 2, 2, True, torch.float64, S=3, D=32, H=8)
    leaves = {i: args[i].requires_grad_() for i in (0, 2, 11, 12)}

    def fn(*ts):
        call = list(args)
        for i, t in zip(leaves, ts):
            call[i] = t
        return qdecode(*call)

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))
    args[4] = args[4].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="quantized weights take no gradient"):
        qdecode(*args).sum().backward()


@requires_ext
def test_qdecode_experts_opcheck(qdecode):
    args = _qdecode_args("gelu", "int8", 3, 2, True, torch.float64)
    args[0].requires_grad_()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.minagi.qdecode_experts, tuple(args), test_utils=utils)


@requires_ext
def test_qdecode_experts_names_bad_arguments(qdecode):
    args = _qdecode_args("swiglu", "int4_g32", 2, 2, False, torch.float32)

    def bad(**changes):
        a = list(args)
        for i, v in changes.items():
            a[int(i[1:])] = v
        return a

    for a, match in [
        (bad(a5=3), "qdecode_experts: bits must be 8 or 4"),
        (bad(a3=args[3].view(torch.int8)), "int4 weights come as q_in of dtype uint8"),
        (bad(a0=args[0][:, :32]), r"q_in \[S, out, in / 2\] must hold x's 32 inputs"),
        (bad(a7=args[7][:, :, :4]), r"q_out \[S, out, in / 2\] must hold the activation's 40 inputs"),
        (bad(a8=args[8][:, :, :1]), r"scale_out must be \[S, out\]"),
        (bad(a7=args[7][:, :8], a8=args[8][:, :8]), r"q_out must hold \[S, D\] = \[6, 64\] output channels"),
        (bad(a2=args[2].double()), "gates .* must have the dtype of x"),
        (bad(a12=torch.randn(6, 9)), r"b_out must be \[6, 64\]"),
        (bad(a1=torch.tensor([[0, 6], [1, 2]])), r"slot_idx holds 6, outside \[0, S = 6\)"),
        (bad(a13="tanh"), "activation"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            qdecode(*a)


@requires_ext
def test_cpu_isa_names_a_level():
    assert torch.ops.minagi.cpu_isa() in ("portable", "avx2", "avx512")


def _run_isa(level: str, tests: list[str]):
    here = Path(__file__).parent
    env = {**os.environ, "MINAGI_CPU_ISA": level, "MINAGI_REQUIRE_EXT": "1"}
    probe = subprocess.run([sys.executable, "-c", "import minagi, torch; print(torch.ops.minagi.cpu_isa())"],
                           capture_output=True, text=True, env=env)
    assert probe.returncode == 0, probe.stderr[-2000:]
    got = probe.stdout.split()[-1]
    if got != level:  # the CPU lacks the level: the cap gives what it has
        pytest.skip(f"this CPU has no {level} (the kernels run at {got})")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *[f"{here / 'test_quant.py'}::{t}" for t in tests]], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-1500:]


@requires_ext
@pytest.mark.slow
@pytest.mark.parametrize("level", ["portable", "avx2", "avx512"])
def test_every_isa_path_matches_the_twin(level):
    # The level is read once per process: each runs in its own, with MINAGI_CPU_ISA set.
    _run_isa(level, ["test_qgrouped_mm_matches_twin", "test_qdecode_experts_matches_twin",
                     "test_qdecode_experts_with_short_groups",
                     "test_expert_mlp_equals_the_dequantized_weights"])


@requires_ext
@pytest.mark.slow
def test_an_unknown_isa_level_is_refused():
    env = {**os.environ, "MINAGI_CPU_ISA": "sse9", "MINAGI_REQUIRE_EXT": "1"}
    r = subprocess.run([sys.executable, "-c", "import minagi, torch; torch.ops.minagi.cpu_isa()"],
                       capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "MINAGI_CPU_ISA='sse9' is not a level: use portable, avx2 or avx512" in r.stderr


# ---------------------------------------------------------------- expert_mlp

def _problem(form, layout, fmt, N, bias, dtype=torch.float32, S=8, K=3, seed=0, dims=None):
    """x, slot_idx, gates (leaves), the quantized weights and the float weights they stand for
    (in the layout: [S, in, out] contiguous, or the .mT view of [S, out, in]). dims: (D, H)."""
    bits, group = FORMATS[fmt]
    D = H = 128 if group == 128 else 64
    D, H = dims or (D, H)
    g = torch.Generator().manual_seed(seed + N)
    h_in = 2 * H if form in GATED else H
    w_in = torch.randn(S, D, h_in, generator=g) / D ** 0.5 * 2
    w_out = torch.randn(S, H, D, generator=g) / H ** 0.5
    if layout == "mT":
        w_in, w_out = w_in.mT.contiguous().mT, w_out.mT.contiguous().mT
    qs = [quantize(w.to(dtype), bits, group) for w in (w_in, w_out)]
    floats = [q.dequantize() if layout == "mT" else q.dequantize().contiguous() for q in qs]
    x = torch.randn(N, D, generator=g).to(dtype).requires_grad_()
    idx = random_routing(N, S, K, 1.0, generator=g)
    gates = torch.rand(N, K, generator=g).to(dtype).requires_grad_()
    biases = [(torch.randn(S, n, generator=g) * 0.1).to(dtype) if bias else None for n in (h_in, D)]
    return x, idx, gates, qs, floats, biases


def _check(form, layout, fmt, N, bias=False, path="auto", grad=True, dtype=torch.float32, dims=None, **kw):
    x, idx, gates, qs, floats, (b_in, b_out) = _problem(form, layout, fmt, N, bias, dtype, dims=dims)
    call = dict(activation=_act(form), b_in=b_in, b_out=b_out, path=path, **kw)
    with torch.set_grad_enabled(grad):
        y = expert_mlp(x, idx, gates, *qs, **call)
        want = expert_mlp(x, idx, gates, *floats, **call)
    assert_close(y, want, dtype, scale=4, msg=f"{form} {layout} {fmt} N={N} forward")
    if grad:
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
        got = torch.autograd.grad(y, (x, gates), gy)
        exp = torch.autograd.grad(want, (x, gates), gy)
        for name, a, b in zip(("x", "gates"), got, exp):
            assert_close(a, b, dtype, scale=8, msg=f"{form} {layout} {fmt} N={N} grad of {name}")


# The fast tier: each form once, the formats, layouts and sizes spread over them.
FAST = [(form, ("contig", "mT")[i % 2], list(FORMATS)[i % 4], (1, 4, 64, 600)[i % 4]) for i, form in enumerate(FORMS)]


@pytest.mark.parametrize("form,layout,fmt,N", FAST)
def test_expert_mlp_equals_the_dequantized_weights(form, layout, fmt, N):
    _check(form, layout, fmt, N, bias=form in ("swiglu_oai", "relu2"))


@pytest.mark.slow
@pytest.mark.parametrize("N", [1, 4, 64, 600])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("layout", ["contig", "mT"])
@pytest.mark.parametrize("form", FORMS)
def test_expert_mlp_every_form_layout_format_and_size(form, layout, fmt, N):
    _check(form, layout, fmt, N, bias=N % 2 == 0)


@pytest.mark.parametrize("N", [1, 4, 64])
@pytest.mark.parametrize("fmt", ["int8_g32", "int4_g32", "int4_g128"])
def test_expert_mlp_with_short_groups(fmt, N):
    # The default byte model's widths: d_model 72, d_hidden 171 (neither a multiple of 32 or 128).
    _check("swiglu", "mT", fmt, N, bias=True, dims=(72, 171))
    _check("gelu", "contig", fmt, N, dims=(72, 171), grad=False)


@pytest.mark.parametrize("N", [1, 4, 64])
def test_expert_mlp_without_a_gradient(N):
    # Inference: the decode sizes and the first layer take other routes without a gradient.
    _check("swiglu", "mT", "int4_g32", N, bias=True, grad=False)
    _check("gelu", "contig", "int8", N, grad=False)


@pytest.mark.parametrize("path", ["rectangle", "grouped"] + (["compiled"] if EXT else []))
def test_expert_mlp_every_path(path):
    _check("swiglu", "mT", "int4_g32", 40, bias=True, path=path)


@pytest.mark.parametrize("kw", [dict(capacity_factor=0.5), dict(out_of_range_slots="skip")])
def test_expert_mlp_capacity_and_skipped_ids(kw):
    x, idx, gates, qs, floats, _ = _problem("swiglu", "mT", "int8", 50, False)
    if "out_of_range_slots" in kw:
        idx = idx.clone()
        idx[::3, 0] = 8 + 2  # experts held elsewhere
    y = expert_mlp(x, idx, gates, *qs, activation="swiglu", **kw)
    want = expert_mlp(x, idx, gates, *floats, activation="swiglu", **kw)
    assert_close(y, want, scale=4)
    for a, b in zip(torch.autograd.grad(y.sum(), (x, gates)), torch.autograd.grad(want.sum(), (x, gates))):
        assert_close(a, b, scale=8)


@requires_ext
def test_a_decode_call_with_quantized_weights_is_one_op(monkeypatch):
    # Writing's calls (a few characters, no gradient, both weights quantized): one qdecode_experts.
    if not ops.has_fused("qdecode_experts", torch.device("cpu")):
        pytest.skip("this build has no qdecode_experts kernel")
    import minagi.moe.dispatch as dispatch

    calls, real = [], dispatch._fused_decode
    monkeypatch.setattr(dispatch, "_fused_decode", lambda *a: calls.append(a[5]) or real(*a))
    x, idx, gates, qs, floats, (b_in, b_out) = _problem("swiglu", "mT", "int4_g32", 2, True)
    kw = dict(activation="swiglu", b_in=b_in, b_out=b_out)
    with torch.no_grad():
        y = expert_mlp(x, idx, gates, *qs, **kw)
        assert len(calls) == 1 and calls.pop() is qs[1]
        assert_close(y, expert_mlp(x, idx, gates, *floats, path="rectangle", **kw), scale=4)
        expert_mlp(x, idx, gates, qs[0], floats[1], **kw)  # one weight float: the pipeline
    assert not calls


def test_expert_mlp_mixes_a_quantized_and_a_float_weight():
    x, idx, gates, qs, floats, _ = _problem("silu", "contig", "int4_g32", 30, False)
    for w_in, w_out in ((qs[0], floats[1]), (floats[0], qs[1])):
        y = expert_mlp(x, idx, gates, w_in, w_out, activation="silu")
        assert_close(y, expert_mlp(x, idx, gates, *floats, activation="silu"), scale=4)


@pytest.mark.parametrize("N", [1, 4, 64])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_expert_mlp_bfloat16(N, fmt):
    # Against float64 with the weights the kernels multiply (value x scale, exact): no further off
    # than the bfloat16 path of the float weights (rounded to bfloat16) is.
    x, idx, gates, qs, floats, _ = _problem("swiglu", "mT", fmt, N, False, dtype=torch.bfloat16)
    with torch.no_grad():
        y = expert_mlp(x, idx, gates, *qs, activation="swiglu").double()
        y_float = expert_mlp(x, idx, gates, *floats, activation="swiglu").double()
        want = expert_mlp(x.double(), idx, gates.double(), *[q.to(torch.float64).dequantize() for q in qs],
                          activation="swiglu")
    assert_close(y, want, torch.bfloat16, scale=4)
    assert (y - want).abs().max() <= 2 * (y_float - want).abs().max()


@requires_ext
@pytest.mark.slow
@pytest.mark.parametrize("form,fmt,N", [("swiglu", "int4_g32", 3), ("gelu", "int8", 40), ("callable", "int4_g128", 17)])
def test_compiles_whole_and_equals_eager(form, fmt, N):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, idx, gates, qs, _, (b_in, b_out) = _problem(form, "mT", fmt, N, True)

    def fn(x, idx, gates, w_in, w_out, b_in, b_out):
        return expert_mlp(x, idx, gates, w_in, w_out, activation=_act(form), b_in=b_in, b_out=b_out)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    y = compiled(x, idx, gates, *qs, b_in, b_out)  # fullgraph: a graph break raises
    assert sum(counters["graph_break"].values()) == 0
    want = fn(x, idx, gates, *qs, b_in, b_out)
    assert_close(y, want, scale=4)
    for a, b in zip(torch.autograd.grad(y.sum(), (x, gates)), torch.autograd.grad(want.sum(), (x, gates))):
        assert_close(a, b, scale=8)
    x2, idx2, gates2, _, _, _ = _problem(form, "mT", fmt, N + 5, True)  # another N: the same graph
    assert_close(compiled(x2, idx2, gates2, *qs, b_in, b_out), fn(x2, idx2, gates2, *qs, b_in, b_out), scale=4)


def test_the_twin_is_dequantize_then_grouped_mm():
    a, qw, order, rows = _op_inputs("int4_g128", torch.float32, torch.bfloat16, OP_CASES[3])
    want = reference.grouped_mm(a, qw.dequantize(), order, rows)
    assert torch.equal(reference.qgrouped_mm(a, qw.q, qw.scale, order, rows, 4, 128), want)
    assert ops.REFERENCE.qgrouped_mm is reference.qgrouped_mm


def test_the_bench_runs_and_reports_every_format(tmp_path):
    import json

    from minagi.bench import quant as bench

    out = tmp_path / "q.json"
    assert bench.main(["--quick", "--decode", "1", "--prefill", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["format"], r["mode"]) for r in rows} == {(f, m) for f in bench.FORMATS for m in ("decode", "prefill")}
    for r in rows:
        assert r["ms"] > 0 and r["mb"] > 0 and r["of_read"] > 0 and r["x_bf16"] > 0


def test_bench_llama_says_in_one_line_what_it_misses(tmp_path, capsys):
    # llama-cpp-python, or llama.cpp's convert_hf_to_gguf.py: either missing, one line and nothing run.
    from minagi.bench import llama as bench

    assert bench.main(["--convert", str(tmp_path / "convert_hf_to_gguf.py"), "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("bench llama: skipped, ") and not any(tmp_path.iterdir())


def _llama_convert():
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    path = os.environ.get("MINAGI_LLAMA_CONVERT")
    return Path(path) if path and Path(path).is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(_llama_convert() is None, reason="needs llama-cpp-python and $MINAGI_LLAMA_CONVERT "
                                                     "(llama.cpp's convert_hf_to_gguf.py)")
def test_bench_llama_engines_compute_the_same_function(tmp_path):
    # The small float32 model through llama.cpp's converter and engine, and through transformers
    # with minagi's experts: the same greedy tokens, the same logits to float32 rounding.
    from minagi.bench import llama as bench

    prompt = torch.randint(0, 8192, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    c = bench.check_same_function(tmp_path, _llama_convert(), 2, prompt)
    assert c["same_tokens"] == c["tokens"] == 17
    assert c["logits_max_abs_diff"] < 1e-5 * max(1.0, c["logits_max_abs"])


@requires_ext
def test_without_the_kernel_the_twin_runs_on_the_devices_grouped_mm(monkeypatch):
    # A device without a qgrouped_mm kernel (GPUs today): the twin dequantizes the listed slots
    # and runs the device's compiled grouped_mm; expert_mlp gives the same, gradients included.
    from minagi.moe import dispatch

    a, qw, order, rows = _op_inputs("int4_g32", torch.float32, torch.bfloat16, OP_CASES[3])
    got = reference.qgrouped_mm(a, qw.q, qw.scale, order, rows, 4, 32, ops=ops.compiled())
    assert_close(got, reference.qgrouped_mm(a, qw.q, qw.scale, order, rows, 4, 32))
    x, idx, gates, qs, floats, (b_in, b_out) = _problem("swiglu_oai", "mT", "int4_g32", 40, True)
    call = dict(activation="swiglu_oai", b_in=b_in, b_out=b_out)
    want = expert_mlp(x, idx, gates, *qs, **call)
    real = dispatch._ops.has_fused
    monkeypatch.setattr(dispatch._ops, "has_fused", lambda name, device: name != "qgrouped_mm" and real(name, device))
    y = expert_mlp(x, idx, gates, *qs, **call)
    assert_close(y, want, scale=4)
    for g1, g2 in zip(torch.autograd.grad(y.sum(), (x, gates)), torch.autograd.grad(want.sum(), (x, gates))):
        assert_close(g1, g2, scale=8)


@requires_ext
@pytest.mark.parametrize("fmt", ["int8", "int4_g32", "int4_g128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("outlier", [False, True])
def test_half_precision_rows_within_their_rounding_of_the_exact_product(compiled, fmt, dtype, outlier):
    # bfloat16 and float16 rows may go through int16 (a power-of-two scale a row): against the
    # float64 product of the same rows and weights, the error stays within the output dtype's
    # rounding, with a feature 1,000 times the others too (its row's small values rounded).
    a, qw, order, rows = _op_inputs(fmt, torch.float32, torch.bfloat16, (4, 8, 2, 256, 40))
    if outlier:
        a[:, 7] *= 1000
    a = a.to(dtype)
    got = compiled.qgrouped_mm(a, qw.q, qw.scale, order, rows, qw.bits, qw.group).double()
    exact = reference.qgrouped_mm(a.double(), qw.q, qw.scale, order, rows, qw.bits, qw.group)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)  # one unit in the last place of the result
    bound = ulp * exact.abs() + 1e-4 * exact.abs().max()
    assert ((got - exact).abs() <= bound).all(), float(((got - exact).abs() - bound).max())
    a[0, 3] = float("nan")  # a row with a NaN: the float32 loops, NaN in that row's outputs as the oracle's
    got = compiled.qgrouped_mm(a, qw.q, qw.scale, order, rows, qw.bits, qw.group)
    assert torch.equal(got.isnan(), reference.qgrouped_mm(a, qw.q, qw.scale, order, rows, qw.bits, qw.group).isnan())
