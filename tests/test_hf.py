"""minagi.hf: minagi as a transformers experts backend, against transformers' own "eager" on tiny
randomly initialised models built from configs (nothing is downloaded)."""
import copy
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import minagi  # noqa: E402
import minagi.moe.dispatch  # noqa: E402
import minagi.hf  # noqa: E402
from conftest import requires_ext  # noqa: E402
from minagi.bench.hf import BASE, TINY, experts_of, grads, logits, rel, tiny_config, tiny_model, token_ids  # noqa: E402,E501
from transformers import AutoModelForCausalLM  # noqa: E402

CONFIGS = TINY
FUSED = {"mixtral": "swiglu", "qwen2_moe": "swiglu", "qwen3_moe": "swiglu", "olmoe": "swiglu",
         "deepseek_v3": "swiglu", "gpt_oss": "swiglu_oai", "nemotron_h": "relu2", "mixtral_gelu_new": None}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    minagi.hf.register()


_model, _experts, _logits, _ids, _rel, _grads = tiny_model, experts_of, logits, token_ids, rel, grads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_backend_takes_the_fused_form_where_one_matches(name):
    experts = _experts(_model(name))
    assert experts
    for e in experts:
        call = minagi.hf._call(e)
        assert not isinstance(call, str), call
        if FUSED[name]:
            assert call.activation == FUSED[name]
        else:
            assert callable(call.activation)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_eager_fp32(name):
    model, ids = _model(name), _ids()
    ref = _logits(model, "eager", ids)
    got = _logits(model, "minagi", ids)
    assert _rel(got, ref) <= 1e-5


@pytest.mark.parametrize("name", list(CONFIGS))
def test_bf16_error_at_most_twice_eager_own(name):
    model, ids = _model(name), _ids()
    ref = _logits(model, "eager", ids)
    bf = copy.deepcopy(model).to(torch.bfloat16)
    err_eager = (_logits(bf, "eager", ids) - ref).abs().max().item()
    err_minagi = (_logits(bf, "minagi", ids) - ref).abs().max().item()
    assert err_eager > 0
    assert err_minagi <= 2 * err_eager, (err_minagi, err_eager)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_of_every_parameter_match_eager(name):
    model, ids = _model(name), _ids()
    ref, got = _grads(model, "eager", ids), _grads(model, "minagi", ids)
    experts_grads = 0
    for n, g_ref in ref.items():
        g = got[n]
        assert (g is None) == (g_ref is None), n
        if g_ref is None:
            continue
        scale = g_ref.abs().max().item()
        assert (g - g_ref).abs().max().item() <= 1e-5 * scale + 1e-9, n
        experts_grads += ".experts." in n and scale > 0
    assert experts_grads >= 2  # the expert weights (and biases) got real gradients


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generate_identical_and_decode_takes_few_characters_path(name, monkeypatch):
    model, ids = _model(name), _ids(batch=1, seq=6)
    model.set_experts_implementation("eager")
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    # The tokens of each few-token call: the one compiled op, the unfused decode, or (the caller's
    # own activation on the CPU) the pipeline, whose exact plan multiplies only the routed slots.
    calls = []
    decode, fuses, grouped = minagi.moe.dispatch._decode, minagi.moe.dispatch._fuses_decode, minagi.moe.dispatch._grouped

    def fused(ops, x, *a):
        if fuses(ops, x, *a):
            calls.append(x.shape[0])
            return True
        return False

    monkeypatch.setattr(minagi.moe.dispatch, "_decode", lambda ops, x, *a: calls.append(x.shape[0]) or decode(ops, x, *a))
    monkeypatch.setattr(minagi.moe.dispatch, "_fuses_decode", fused)
    monkeypatch.setattr(minagi.moe.dispatch, "_grouped",
                        lambda ops, x, *a: calls.append(x.shape[0]) or grouped(ops, x, *a))
    model.set_experts_implementation("minagi")
    got = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, ref)
    n_experts = len(_experts(model))
    assert calls.count(1) == 15 * n_experts  # every one-token step after the prompt, every MoE layer


def test_expert_parallel_sentinels_add_nothing_and_get_no_gradient():
    e = _experts(_model("mixtral"))[0]
    E = e.num_experts
    x = torch.randn(5, 32, requires_grad=True)
    idx = torch.tensor([[0, E], [1, 2], [E + 3, 3], [E, E], [2, 0]])
    w = torch.rand(5, 2, requires_grad=True)
    e._is_expert_parallel = True
    y = minagi.hf.experts_forward(e, x, idx, w)
    keep = idx < E
    y_ref = minagi.hf.experts_forward(e, x, idx.clamp(max=E - 1), w * keep)  # the sentinels' pairs at gate 0
    torch.testing.assert_close(y, y_ref)
    assert y[3].abs().max() == 0
    from transformers.integrations.moe import grouped_mm_experts_forward  # an oracle of transformers' own

    torch.testing.assert_close(y, grouped_mm_experts_forward(e, x, idx, w))
    y.sum().backward()
    assert torch.all(w.grad[~keep] == 0) and torch.all(w.grad[keep] != 0)


def test_fallback_warns_once_naming_model_and_flag_and_matches_grouped_mm():
    model, ids = _model("qwen3_moe"), _ids()
    for e in _experts(model):  # down_proj in another dtype than gate_up_proj: not one expert_mlp call
        e.down_proj.data = e.down_proj.data.bfloat16()
    ref = _logits(model, "grouped_mm", ids)
    minagi.hf._warned.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = _logits(model, "minagi", ids)
        _logits(model, "minagi", ids)
    ours = [str(w.message) for w in seen if "minagi experts backend" in str(w.message)]
    assert len(ours) == 1, ours
    assert "qwen3_moe" in ours[0] and "down_proj" in ours[0] and "grouped_mm" in ours[0]
    assert torch.equal(got, ref)


def test_unknown_decorator_flag_falls_back(monkeypatch):
    e = _experts(_model("mixtral"))[0]
    monkeypatch.setattr(minagi.hf, "_decorator_flags", lambda: ("is_transposed", "has_fp4_scales"))
    e.has_fp4_scales = True
    assert minagi.hf._call(e).startswith("has_fp4_scales:")


def test_register_twice_and_the_name_is_valid():
    minagi.hf.register()
    minagi.hf.register()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert ALL_EXPERTS_FUNCTIONS["minagi"] is minagi.hf.experts_forward
    model = _model("mixtral")
    model.set_experts_implementation("minagi")
    assert model.config._experts_implementation == "minagi"


def test_model_without_decorated_experts_keeps_transformers_behaviour():
    cfg = transformers.LlamaConfig(**BASE, num_hidden_layers=1, intermediate_size=48)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        model.set_experts_implementation("minagi")  # transformers' own rule: nothing to switch
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.slow
def test_import_without_transformers_and_register_says_what_to_install():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import minagi.hf\n"
            "try:\n    minagi.hf.register()\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and ".[hf]" in out.stdout


def test_post_expert_norm_module_matches_eager_forward_and_backward():
    from transformers.models.muse_spark import modeling_muse_spark as ms

    cfg = ms.MuseSparkTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, moe_hidden_size=32, moe_intermediate_size=16, num_local_experts=4,
                                 num_experts_per_tok=2, hidden_act="silu")
    torch.manual_seed(0)
    e = ms.MuseSparkExperts(cfg)
    assert e.has_post_expert_norm
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(7, 32)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(7)])
    w = torch.rand(7, 2)

    def run(impl):
        cfg._experts_implementation = impl
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        e.zero_grad(set_to_none=True)
        y = e(xs, idx, ws)
        (y * torch.linspace(-1, 1, 32)).sum().backward()
        return [y, xs.grad, ws.grad] + [p.grad for p in e.parameters()]

    assert callable(minagi.hf._call(e).post)
    for got, ref in zip(run("minagi"), run("eager")):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_bench_hf_quick_run_writes_every_backend_and_the_ratios(tmp_path):
    from minagi.bench import hf as bench

    out = tmp_path / "hf.json"
    assert bench.main(["--quick", "--rounds", "1", "--tokens", "32", "--decode", "1", "--dtypes", "float32",
                       "--blocks", "mixtral,gpt_oss", "--no-generate", "--json", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * 3  # fwd, fwd+bwd at 32 tokens, decode at 1, per block
    for r in data["results"]:
        assert set(r["ms"]) == {"eager", "batched_mm", "grouped_mm", "minagi", "floor"}
        assert all(v > 0 for v in r["ms"].values())
    assert {t["what"].split()[0] for t in data["ratios"]} == {"mixtral", "gpt_oss"}
    assert set(data["peak_bytes"]["mixtral float32"]) == {"eager", "batched_mm", "grouped_mm", "minagi"}


@pytest.mark.slow
@requires_ext
def test_bench_hf_generate_times_eager_and_compiled_and_refuses_an_unknown_model():
    from minagi.bench import hf as bench

    got = bench.bench_generate(["grouped_mm", "minagi"], 1, 4, "cpu", "tiny", ("eager", "compiled"))
    assert set(got) == {"eager", "compiled"} and all(v > 0 for m in got.values() for v in m.values())
    assert set(got["compiled"]) == {"grouped_mm", "minagi"}
    with pytest.raises(SystemExit):
        bench.main(["--generate", "nope", "--tokens", "", "--decode", ""])


def test_bench_hf_floor_is_each_experts_gemms_at_an_even_load_and_ratios_keep_the_design_figure():
    from minagi.bench import hf as bench

    for name in ("mixtral", "gpt_oss"):  # weights stored [E, out, in], and [E, in, out] (is_transposed)
        experts, cfg = bench._block(name, torch.float32, scale=0.125)
        E, H = experts.num_experts, cfg.hidden_size
        I = experts.down_proj.shape[-1 if not experts.is_transposed else -2]
        x, idx, _ = bench._routing(16, E, 2, H, torch.float32)
        R = -(-32 // E)  # 32 pairs, an even share per expert
        fwd, train = bench._floor(experts, x, idx, False), bench._floor(experts, x, idx, True)
        # Two forward GEMMs per expert, then both input gradients and both weight gradients.
        assert [tuple(t.shape) for t in fwd] == [(E, R, 2 * I), (E, R, H)]
        w_grads = [tuple(p.shape) for p in (experts.down_proj, experts.gate_up_proj)]
        assert [tuple(t.shape) for t in train] == [(E, R, 2 * I), (E, R, H), (E, R, I), (E, R, H), *w_grads]
        o = bench._floor_operands(experts, x, 2)
        for e in range(E):  # expert e's rows through expert e's own weights
            w_in = experts.gate_up_proj[e] if experts.is_transposed else experts.gate_up_proj[e].T
            torch.testing.assert_close(fwd[0][e], o["x"][e] @ w_in)
            dw = o["x"][e].T @ o["dh"][e]
            torch.testing.assert_close(train[5][e], dw if experts.is_transposed else dw.T)
    row = lambda grouped, minagi, floor: {"block": "b", "dtype": "float32", "tokens": 512, "mode": "fwd+bwd",  # noqa: E731
                                          "ms": {"grouped_mm": grouped, "minagi": minagi, "floor": floor}}
    # Every row against the design's own figure, whatever the ceiling: the bench substitutes none.
    (what, value, asked), = bench.ratios([row(100.0, 60.0, 40.0)], {})
    assert (value, asked) == (100.0 / 60.0, ">= 2.0x") and what.endswith("vs grouped_mm, ceiling 2.50x")
    (what, value, asked), = bench.ratios([row(100.0, 95.0, 90.0)], {})  # 2x is beyond the ceiling: still 2x
    assert (value, asked) == (100.0 / 95.0, ">= 2.0x") and "ceiling 1.11x" in what
    (what, value, asked), = bench.ratios([{**row(1.0, 0.52, 0.5), "decode": True}], {})
    assert asked == ">= 2.0x" and what.endswith("decode vs grouped_mm, ceiling 2.00x")
    (what, value, asked), = bench.ratios([{**row(100.0, 60.0, 40.0), "mode": "fwd"}], {})
    assert asked == ">= 1.5x"
    (what, value, asked), = bench.ratios([], {("b", "float32"): {"minagi": 110, "grouped_mm": 100}})
    assert (value, asked) == (1.1, "<= 1.01x") and "peak memory" in what


def test_bench_hf_decode_floor_reads_each_routed_experts_weights_once():
    from minagi.bench import hf as bench

    for name in ("mixtral", "gpt_oss"):  # gpt_oss: biases too
        experts, cfg = bench._block(name, torch.float32, scale=0.125)
        idx = torch.tensor([[3, 1], [1, 5]])  # 3 distinct experts, one of them twice
        sums = bench._decode_floor(experts, idx)
        params = [p for p in experts.parameters() if p.dim() >= 2 and p.shape[0] == experts.num_experts]
        assert len(params) == (4 if name == "gpt_oss" else 2)
        want = [p[e].sum() for e in (1, 3, 5) for p in params]
        assert len(sums) == len(want)
        for got, ref in zip(sums, want):
            torch.testing.assert_close(got, ref)
        # The bench times it in place of the even-load GEMMs at the decode sizes.
        x = torch.randn(2, cfg.hidden_size)
        assert len(bench._call(experts, bench.FLOOR, x, idx, None, False, True)) == len(want)
        assert len(bench._call(experts, bench.FLOOR, x, idx, None, False)) == 2


def test_bench_hf_sizes_a_decode_sample_by_a_warm_call(monkeypatch):
    # A backend's first call pays one-off costs (tens of ms); sized by it, a decode sample of a
    # 1 ms call would be one or two calls, each after another backend has run: mostly cold.
    from minagi.bench import hf as bench

    seen = {}

    def fake_timed(experts, impl, args, train, calls=1, decode=False):
        seen.setdefault(impl, []).append(calls)
        return 50.0 if len(seen[impl]) == 1 else 1.0  # the first call slow, the rest 1 ms

    monkeypatch.setattr(bench, "_timed", fake_timed)
    r = bench.bench_block("mixtral", torch.float32, 1, False, ["grouped_mm", "minagi"], 2, 60.0, 1.0, "cpu",
                          scale=0.125, decode=True)
    want = int(bench.SAMPLE_MS)  # 20 calls of 1 ms
    assert r["calls_per_sample"] == {"grouped_mm": want, "minagi": want}
    assert seen["minagi"] == [1, 1, want, want] and r["ms"]["minagi"] == 1.0
    seen.clear()  # training calls are timed one at a time, after one warm-up
    r = bench.bench_block("mixtral", torch.float32, 8, True, ["minagi"], 2, 60.0, 1.0, "cpu", scale=0.125)
    assert seen["minagi"] == [1, 1, 1] and r["calls_per_sample"] == {"minagi": 1}


@pytest.mark.slow
def test_profile_tool_shows_where_a_backends_time_goes_beside_the_floor():
    from pathlib import Path

    tool = Path(__file__).resolve().parent.parent / "tools" / "profile_experts.py"
    r = subprocess.run([sys.executable, str(tool), "--block", "olmoe", "--tokens", "32", "--scale", "0.125",
                        "--calls", "1", "--warmup", "0", "--top", "60"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    head, columns, *rows = r.stdout.splitlines()
    assert "forward+backward" in head and "minagi" in head and "floor" in head and "x)" in head
    assert columns.split()[0] == "op"
    ops = [row.split()[0] for row in rows if row[:1] != "("]
    own = "minagi::grouped_mm" if minagi.extension_loaded() else "aten::bmm"  # the kernels, or the twins' bmm
    assert any(op.startswith(own) for op in ops), ops
    bad = subprocess.run([sys.executable, str(tool), "--block", "nope", "--scale", "0.125"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "choose from" in bad.stderr


@pytest.mark.slow
@requires_ext
@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "mixtral_gelu_new"])
def test_static_cache_generate_compiled_whole_equals_eager(name):
    # transformers compiles the forward of a static-cache generate() (on a CPU only where the
    # CompileConfig says so): the experts make no graph break (fullgraph), and the tokens are eager's.
    # (GPT-OSS's sliding-window cache guards on its length in transformers' own code: a recompile
    # per token, whatever the experts.)
    from torch._dynamo.utils import counters
    from transformers.generation.configuration_utils import CompileConfig

    model, ids = _model(name), _ids(batch=1, seq=6)
    model.set_experts_implementation("eager")
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static")
    model.set_experts_implementation("minagi")
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    got = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static",
                         compile_config=config)
    assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]


def _dequantized_copy(model):
    """The model with each quantized experts weight replaced by the float weight it stands for, in
    the module's own layout: the oracle a quantized model's tokens are held to."""
    from minagi.moe.quant import QuantizedWeight

    deq = copy.deepcopy(model)
    for m in deq.modules():
        for n, w in list(vars(m).items()):
            if isinstance(w, QuantizedWeight):
                f = w.dequantize()  # [E, in, out]
                delattr(m, n)
                m.register_parameter(n, torch.nn.Parameter(f if m.is_transposed else f.mT.contiguous()))
    return deq


def _model_32_wide(name):
    """The tiny model with its experts 32 wide (int4's smallest group) in and out."""
    cls, fields = TINY[name]
    wide = {k: 32 if k in ("intermediate_size", "moe_intermediate_size") else v for k, v in fields.items()}
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**BASE, "hidden_size": 32}, **wide)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "nemotron_h"])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantize_converts_every_experts_module_and_generates_the_dequantized_models_tokens(name, bits, group, capsys):
    from minagi.moe.quant import QuantizedWeight

    model, ids = _model_32_wide(name), _ids(batch=1, seq=6)
    experts = _experts(model)
    before = sum(p.nbytes for m in experts for n, p in m.named_parameters(recurse=False) if not n.endswith("bias"))
    report = minagi.hf.quantize(model, bits=bits, group_size=group)
    assert str(report) in capsys.readouterr().out
    assert report.modules == len(experts) and report.weights == 2 * len(experts) and not report.skipped
    assert report.bytes_before == before and report.bytes_after < before / (3 if bits == 8 else 6)
    assert all(isinstance(getattr(m, n), QuantizedWeight) for m in experts
               for n in (("gate_up_proj" if m.has_gate else "up_proj"), "down_proj"))
    assert model.config._experts_implementation == "minagi"
    deq = _dequantized_copy(model)
    # transformers' own loop over the float weights
    torch.testing.assert_close(_logits(model, "minagi", ids), _logits(deq, "eager", ids), rtol=1e-4, atol=1e-4)
    got = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, deq.generate(ids, max_new_tokens=12, do_sample=False))
    again = minagi.hf.quantize(model, bits=bits, group_size=group, verbose=False)  # already done: nothing
    assert (again.modules, again.weights) == (0, 0)


@pytest.mark.slow
@requires_ext  # the pure-torch twins read plans on the host: compiling needs the extension's ops
def test_a_quantized_model_generates_under_compile_with_a_static_cache():
    from transformers.generation.configuration_utils import CompileConfig

    model, ids = _model_32_wide("qwen3_moe"), _ids(batch=1, seq=6)
    minagi.hf.quantize(model, bits=4, group_size=32, verbose=False)
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True
    torch._dynamo.reset()
    got = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                         compile_config=config)
    assert torch.equal(got, ref)
