"""python -m minagi.bench hf: transformers' experts backends against minagi's, on MoE blocks shaped
like the models people run (scaled to a small machine) and on whole models' generate(), eager and compiled.

Each block is the model's own transformers experts module (MixtralExperts, OlmoeExperts, ...)
with random weights and a random top-k routing; every backend runs the same module, switched
through config._experts_implementation. Interleaved rounds (each round runs every backend once,
in a rotated order, so a drift of the machine hits them alike); the median is kept. A backend
whose one call takes longer than --slow seconds runs one round only. batched_mm is skipped where
its per-pair weight gather would need more than --max-gb.

Peak memory (fwd+bwd at the largest training size): the peak of the bytes held by the tensors
created during one call (a dispatch mode counts every op's output storage until it is freed), or
the CUDA allocator's peak on a GPU. A kernel's internal scratch is not seen: minagi's CPU kernels
allocate nothing but their outputs (and copies of non-contiguous inputs, which this backend does
not pass), so what is missed is the other backends' (torch's grouped_mm), which can only make
minagi's ratio look worse than it is. Decode calls (well under a millisecond) are timed in
samples of back-to-back calls of about 20 ms each (forward calls only; the count per sample set
by a warm call, not the first, whose one-off costs would leave a sample of one or two calls).

The "floor" column is no backend but the least work any backend must do: each expert's GEMMs
at a perfectly even load (T*k/E rows each, one torch.bmm per GEMM over the experts, operands made
beforehand; no routing, gather, activation or sum): forward [E, T*k/E, H] x [E, H, 2I] and
[E, T*k/E, I] x [E, I, H]; with backward also both layers' input gradients and every expert's
weight gradients in the parameters' own layout, all into buffers made once (a backend hands
autograd fresh memory and pays for faulting it in; the floor does not). Routing only makes loads
uneven, so no backend does the same work much faster; `ceiling` is the fastest built-in
backend's time over it: the most any backend could gain there. (Until 2026-12-05 the floor ran
every pair through one expert's weights in one matmul: it read one expert's weights instead of
all E and wrote one weight gradient instead of E, and so undercounted the work several times
over where experts are many.) At the decode sizes (--decode) a call multiplies a few rows by the
routed experts' weights, so reading those bytes is the least work: there the floor reads every
weight and bias slice of each expert the routing names, once, as one torch.sum a slice, and
computes nothing else. (Until late on 2026-12-05 the floor shown at the decode sizes was the
training one, which reads all E experts, and it judged nothing there.) It is a floor of bytes,
not of kernels: torch's sum streams them no faster than a few-row GEMM can, and with dozens of
small slices its per-call overhead shows (minagi can run under it).

The design's figures (this CPU): fwd+bwd >= 2x the fastest built-in backend at every training
shape; fwd >= 1.5x; decode (1 and 4 tokens) >= 2x; peak memory no higher than grouped_mm's (within
1%: the small index tensors each backend keeps in its own way). The bench prints each ratio beside
its figure and the row's ceiling, and judges none: where a figure is beyond the ceiling, no backend
can reach it, and docs/benchmarks.md says so beside the measured ratio.

MINAGI_ALLOCATOR applies to the whole process, every backend alike: MINAGI_ALLOCATOR=keep
(minagi's cache of large blocks, minagi.lm.allocator.keep_freed_memory()) times them as a user who
turned it on runs them; the floor's kept buffers are unaffected.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..lm import allocator
from ..lm.prog import ListHelpFormatter
from ..moe import _backend
from . import as_json, print_ratios

# name: (config class, experts class module, experts class, config fields). Real models' ratios,
# scaled: Mixtral-8x7B at hidden 1024 (E8 k2, I/H 2 instead of 3.5); OLMoE-1B-7B (E64 k8) and
# Qwen3-30B-A3B (E128 k8) at hidden 512; DeepSeek-V3 (E256 k8) at hidden 512; GPT-OSS-20B (E32 k4,
# biases, [E, in, out] weights, its clamped interleaved gate) at hidden 512.
BLOCKS = {
    "mixtral": ("MixtralConfig", "mixtral", "MixtralExperts",
                dict(hidden_size=1024, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "olmoe", "OlmoeExperts",
              dict(hidden_size=512, intermediate_size=256, num_experts=64, num_experts_per_tok=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeExperts",
                  dict(hidden_size=512, moe_intermediate_size=192, num_experts=128, num_experts_per_tok=8)),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3", "DeepseekV3Experts",
                    dict(hidden_size=512, moe_intermediate_size=128, n_routed_experts=256, num_experts_per_tok=8)),
    "gpt_oss": ("GptOssConfig", "gpt_oss", "GptOssExperts",
                dict(hidden_size=512, intermediate_size=512, num_local_experts=32, num_experts_per_tok=4)),
}
BUILTIN = ("eager", "batched_mm", "grouped_mm")
FLOOR = "floor"  # each expert's GEMMs at an even load, one bmm each (see the module's docstring)


# Tiny whole models for the accuracy rows (and tests/test_hf.py): randomly initialised from
# configs, nothing downloaded. name: (config class, fields beyond BASE).
VOCAB = 96
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, initializer_range=0.1)
TINY = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=2, head_dim=8, intermediate_size=48,
                                         moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3)),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=2, intermediate_size=24, num_experts=8, num_experts_per_tok=4)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=24,
                                             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                             first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                                             q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, head_dim=8, intermediate_size=24, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"])),
    # Non-gated relu^2 experts. The pattern opens with a Mamba layer: transformers' cache for a
    # pattern that opens with "moe" fails in generate(), whatever the experts backend.
    "nemotron_h": ("NemotronHConfig", dict(head_dim=8, layers_block_type=["mamba", "moe", "attention", "moe"],
                                           moe_intermediate_size=24, moe_shared_expert_intermediate_size=24,
                                           n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                           intermediate_size=48, mamba_num_heads=4, mamba_head_dim=8,
                                           ssm_state_size=8, n_groups=1)),
    # The default gate with an act_fn no kernel fuses (gelu_new): the general path.
    "mixtral_gelu_new": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                               num_experts_per_tok=2, hidden_act="gelu_new")),
}


def tiny_config(name: str):
    import transformers

    cls, fields = TINY[name]
    return getattr(transformers, cls)(**BASE, **fields)


def tiny_model(name: str, dtype=torch.float32):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(name), dtype=dtype).eval()


def experts_of(model) -> list:
    """The model's experts modules (those @use_experts_implementation decorated)."""
    return [m for m in model.modules() if hasattr(m, "has_gate")]


def token_ids(batch: int = 2, seq: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, impl: str, ids) -> torch.Tensor:
    model.set_experts_implementation(impl)
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def grads(model, impl: str, ids) -> dict:
    """Every parameter's gradient of the language-model loss (None where it gets none)."""
    model.set_experts_implementation(impl)
    model.zero_grad(set_to_none=True)
    model.train()
    model(ids, labels=ids, use_cache=False).loss.backward()
    model.eval()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def rel(a, b) -> float:
    """max |a - b| over max |b|."""
    return ((a - b).abs().max() / b.abs().max()).item()


def accuracy(name: str) -> dict:
    """minagi against eager on one tiny model: fp32 logits' relative error, bf16 error as a
    multiple of eager's own (both against eager's fp32 logits), the worst parameter gradient's
    relative error."""
    import copy

    model, ids = tiny_model(name), token_ids()
    ref = logits(model, "eager", ids)
    bf = copy.deepcopy(model).to(torch.bfloat16)
    err_eager = (logits(bf, "eager", ids) - ref).abs().max().item()
    err_minagi = (logits(bf, "minagi", ids) - ref).abs().max().item()
    g_ref, g = grads(model, "eager", ids), grads(model, "minagi", ids)
    worst = max(rel(g[n], r) for n, r in g_ref.items() if r is not None and r.abs().max() > 0)
    return {"model": name, "logits_rel": rel(logits(model, "minagi", ids), ref),
            "bf16_vs_eager": err_minagi / err_eager, "grad_worst_rel": worst}


def _block(name: str, dtype: torch.dtype, scale: float = 1.0):
    """The model's experts module, random weights, in dtype; scale shrinks the widths (for --quick)."""
    import importlib

    import transformers

    cfg_name, mod, cls, fields = BLOCKS[name]
    fields = {k: max(8, int(v * scale)) if k.endswith("size") else v for k, v in fields.items()}
    cfg = getattr(transformers, cfg_name)(**fields, num_attention_heads=8, num_key_value_heads=8)
    experts = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), cls)(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            fan_in = p.shape[-1] if p.dim() == 3 and not experts.is_transposed else p.shape[-2] if p.dim() == 3 else 1
            p.copy_(torch.randn(p.shape, generator=g) * (fan_in ** -0.5 if p.dim() == 3 else 0.02))
    return experts.to(dtype), cfg


def _routing(T: int, E: int, k: int, H: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    top_w, top_i = logits.topk(k, dim=-1)
    return x, top_i, top_w.softmax(-1)  # fp32 routing weights, as the models pass them


def _batched_mm_bytes(experts, T: int, k: int) -> int:
    """batched_mm gathers every pair's weights: T * k copies of one expert's, forward and backward."""
    per_expert = sum(p[0].numel() * p.element_size() for p in experts.parameters() if p.dim() == 3)
    return 3 * T * k * per_expert


def _floor_operands(experts, x, k: int) -> dict:
    """Every expert's weights as [E, H, 2I] and [E, I, H] views of the parameters, and each
    expert's even share of the T*k pairs as inputs and output gradients of both layers (made once
    per size, cached on the module)."""
    cache = experts.__dict__.setdefault("_floor", {})
    if x.shape[0] not in cache:
        w_in, w_out = experts.gate_up_proj.detach(), experts.down_proj.detach()
        if not experts.is_transposed:  # stored [E, out, in]: the GEMMs read them through .mT
            w_in, w_out = w_in.mT, w_out.mT
        E = w_in.shape[0]
        rows = -(-x.shape[0] * k // E)
        g = torch.Generator().manual_seed(3)
        rand = lambda n: torch.randn(E, rows, n, generator=g).to(x.dtype).to(x.device)  # noqa: E731
        cache[x.shape[0]] = {"w_in": w_in, "w_out": w_out, "x": rand(w_in.shape[1]), "a": rand(w_out.shape[1]),
                             "dy": rand(w_out.shape[2]), "dh": rand(w_in.shape[2]),
                             "transposed": experts.is_transposed}
    return cache[x.shape[0]]


def _floor(experts, x, idx, train: bool):
    """The floor's GEMMs: forward, and with train both input gradients and both weight
    gradients (in the parameters' layout: [E, in, out] when is_transposed, else [E, out, in]),
    each into a buffer it keeps, so no page of fresh memory is faulted in."""
    o = _floor_operands(experts, x, idx.shape[1])
    pairs = [(o["x"], o["w_in"]), (o["a"], o["w_out"])]
    if train:
        pairs += [(o["dy"], o["w_out"].mT), (o["dh"], o["w_in"].mT)]
        pairs += ([(o["a"].mT, o["dy"]), (o["x"].mT, o["dh"])] if o["transposed"] else
                  [(o["dy"].mT, o["a"]), (o["dh"].mT, o["x"])])
    outs = o.setdefault("out" if train else "out_fwd", [None] * len(pairs))
    with torch.no_grad():
        for i, (a, b) in enumerate(pairs):
            if outs[i] is None:
                outs[i] = torch.bmm(a, b)
            else:
                torch.bmm(a, b, out=outs[i])
    return tuple(outs)


def _decode_floor(experts, idx):
    """Decode's floor: every routed expert's weights (and biases) read once, as one reduction per
    slice, nothing else. A call of 1-4 tokens multiplies a few rows by those weights, so reading
    their bytes is all but the whole of its work. The slices are found once per routing tensor, so
    the timed calls do nothing but the sums."""
    cache = experts.__dict__.setdefault("_floor", {})
    if cache.get("decode_idx") is not idx:
        E = experts.num_experts
        params = [p.detach() for p in experts.parameters() if p.dim() >= 2 and p.shape[0] == E]
        cache["decode_idx"] = idx
        cache["decode"] = [p[e] for e in sorted(set(idx.flatten().tolist())) if 0 <= e < E for p in params]
    with torch.no_grad():
        return [s.sum() for s in cache["decode"]]


def _call(experts, impl, x, idx, w, train: bool, decode: bool = False):
    if impl == FLOOR:
        return _decode_floor(experts, idx) if decode else _floor(experts, x, idx, train)
    experts.config._experts_implementation = impl
    if not train:
        with torch.no_grad():
            return experts(x, idx, w)
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = experts(xs, idx, ws)
    y.backward(torch.ones_like(y))
    return y


def _timed(experts, impl, args, train, calls: int = 1, decode: bool = False) -> float:
    """ms per call, over `calls` calls in a row (one sample)."""
    experts.zero_grad(set_to_none=True)
    sync = torch.cuda.synchronize if args[0].is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        _call(experts, impl, *args, train, decode)
    sync()
    return (time.perf_counter() - t0) * 1e3 / calls


class PeakLive(TorchDispatchMode):
    """The peak bytes of live tensor storages created while it is active."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = set()

    def _count(self, t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.seen or st.nbytes() == 0:
            return
        self.seen.add(key)
        self.live += st.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(st, self._free, key, st.nbytes())

    def _free(self, key, n):
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, tuple) or len(func._schema.returns) != 1 else (out,)
        for t, ret in zip(outs, func._schema.returns):
            if ret.alias_info is None:  # a view or an in-place result holds no new memory
                for one in t if isinstance(t, (list, tuple)) else (t,):  # a Tensor[] return: each
                    self._count(one)
        return out


def _peak_bytes(experts, impl, args, train: bool = True) -> int:
    experts.zero_grad(set_to_none=True)
    if args[0].is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _call(experts, impl, *args, train)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    mode = PeakLive()
    with mode:
        _call(experts, impl, *args, train)
    return mode.peak


# A sample of a fast call repeats it until the sample takes about this long (decode calls take
# well under a millisecond: one perf_counter reading each would be mostly noise).
SAMPLE_MS = 20.0


def bench_block(name, dtype, T, train, backends, rounds, slow_s, max_gb, device, scale=1.0, decode=False):
    """ms per call (median over interleaved rounds) per backend for one block, size and mode."""
    experts, cfg = _block(name, dtype, scale)
    experts.to(device)
    E, k = experts.num_experts, cfg.num_experts_per_tok
    x, idx, w = (t.to(device) for t in _routing(T, E, k, cfg.hidden_size, dtype))
    args = (x, idx, w)
    times, skipped = {}, {}
    for impl in backends:
        if impl == "batched_mm" and _batched_mm_bytes(experts, T, k) > max_gb * 2**30:
            skipped[impl] = f"needs ~{_batched_mm_bytes(experts, T, k) / 2**30:.0f} GB"
    live = [b for b in backends if b not in skipped]
    calls = {}
    for impl in live:  # warm-up; a slow backend's warm-up is its one round
        t = _timed(experts, impl, args, train, 1, decode)
        times[impl] = [t] if t > slow_s * 1e3 else []
        if decode and not times[impl]:  # sized by a warm call: a first call's one-off costs would
            t = _timed(experts, impl, args, train, 1, decode)  # shrink the sample to a call or two
        calls[impl] = 1 if train else max(1, math.ceil(SAMPLE_MS / max(t, 1e-3)))
    for r in range(rounds):
        order = live[r % len(live):] + live[:r % len(live)]
        for impl in order:
            if len(times[impl]) == 1 and times[impl][0] > slow_s * 1e3:
                continue
            times[impl].append(_timed(experts, impl, args, train, calls[impl], decode))
    ms = {impl: statistics.median(v) for impl, v in times.items()}
    return {"block": name, "dtype": str(dtype).replace("torch.", ""), "tokens": T, "mode": "fwd+bwd" if train else
            "fwd", "decode": decode, "ms": ms, "rounds": {i: len(v) for i, v in times.items()},
            "calls_per_sample": calls, "skipped": skipped,
            "shape": {"E": E, "k": k, "H": cfg.hidden_size,
                      "I": experts.down_proj.shape[-1 if not experts.is_transposed else -2]}}


def peak_memory(name, dtype, T, backends, max_gb, device, scale=1.0):
    experts, cfg = _block(name, dtype, scale)
    experts.to(device)
    args = tuple(t.to(device) for t in _routing(T, experts.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                                  dtype))
    out = {}
    for impl in backends:
        if impl == "batched_mm" and _batched_mm_bytes(experts, T, cfg.num_experts_per_tok) > max_gb * 2**30:
            continue
        out[impl] = _peak_bytes(experts, impl, args)
    return out


# The whole models of the generate() rows: (what it is, transformers config fields, dtype).
GENERATE = {
    "tiny": ("tiny Qwen3-MoE-like model (4 layers, hidden 256, E32 k4)",
             dict(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=128,
                  num_experts=32, num_experts_per_tok=4), torch.float32),
    # Qwen3-30B-A3B's layer at full size (its vocabulary, attention, 128 experts of width 768,
    # top 8), 4 layers deep instead of 48, random weights.
    "qwen3-30b-a3b": ("Qwen3-30B-A3B-shaped model (4 layers, hidden 2048, E128 k8, width 768, bf16)",
                      dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                           num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False), torch.bfloat16),
}


def _generate_model(name: str, device):
    import transformers

    _, fields, dtype = GENERATE[name]
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**fields)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _generate_call(model, ids, new_tokens: int, compiled: bool):
    """One greedy generate(): eager with the default cache, or compiled with a static cache (the
    forward whole where it can: a backend that breaks the graph runs in pieces, as a user's would, and
    the bench says so; on a CPU transformers compiles only where the CompileConfig says so)."""
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if compiled:
        from transformers.generation.configuration_utils import CompileConfig

        config = CompileConfig(fullgraph=False, dynamic=False)
        config._compile_all_devices = True
        kw.update(cache_implementation="static", compile_config=config)
    return model.generate(ids, **kw)


def bench_generate(backends, rounds, new_tokens=32, device="cpu", name="tiny", modes=("eager",)) -> dict:
    """Tokens/s of one whole model's greedy generate() per backend and mode ("eager", "compiled"):
    {mode: {backend: tokens/s}}, the median of `rounds` after a warm-up call. Eager rounds
    interleave the backends. Compiled ones run each backend's calls together after a fresh
    torch.compile: one backend's compiled forward, swapped for another's and back, could be
    recompiled rather than reused, and the recompiling timed."""
    model = _generate_model(name, device)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(2)).to(device)
    out = {}
    for mode in modes:
        times = {b: [] for b in backends}
        if mode == "compiled":
            for impl in backends:
                times[impl] = _compiled_times(model, ids, impl, new_tokens, rounds)
        else:
            for r in range(rounds + 1):
                for impl in backends[r % len(backends):] + backends[:r % len(backends)]:
                    model.set_experts_implementation(impl)
                    t0 = time.perf_counter()
                    _generate_call(model, ids, new_tokens, False)
                    if r:  # round 0 warms up
                        times[impl].append(time.perf_counter() - t0)
        out[mode] = {impl: new_tokens / statistics.median(v) for impl, v in times.items()}
    return out


def _compiled_times(model, ids, impl: str, new_tokens: int, rounds: int) -> list[float]:
    """One backend's compiled generate() calls: a warm-up that compiles, then `rounds` timed."""
    from torch import _dynamo

    _dynamo.reset()
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    model.set_experts_implementation(impl)
    breaks = _graph_breaks()
    _generate_call(model, ids, new_tokens, True)
    if _graph_breaks() > breaks:
        print(f"  note: {impl}'s compiled forward broke its graph {_graph_breaks() - breaks} times", flush=True)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        _generate_call(model, ids, new_tokens, True)
        times.append(time.perf_counter() - t0)
    return times


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def ratios(results, peaks) -> list[tuple[str, float, str]]:
    """minagi against the fastest built-in backend per row, with the design's figure and the
    ceiling (that backend's time over the floor: the most any backend could gain there)."""
    out = []
    for r in results:
        builtin = {b: t for b, t in r["ms"].items() if b in BUILTIN}
        if "minagi" not in r["ms"] or not builtin:
            continue
        best = min(builtin, key=builtin.get)
        decode = r.get("decode", False)
        need = 2.0 if r["mode"] == "fwd+bwd" or decode else 1.5
        floor = r["ms"].get(FLOOR)
        ceiling = f", ceiling {builtin[best] / floor:.2f}x" if floor else ""
        what = f"{r['block']} {r['dtype']} T={r['tokens']} {'decode' if decode else r['mode']} vs {best}{ceiling}"
        out.append((what, builtin[best] / r["ms"]["minagi"], f">= {need}x"))
    for (block, dtype), p in peaks.items():
        if "minagi" in p and "grouped_mm" in p:
            out.append((f"{block} {dtype} peak memory minagi/grouped_mm", p["minagi"] / p["grouped_mm"], "<= 1.01x"))
    return out


def _print_row(r):
    ms = r["ms"]
    builtin = {b: t for b, t in ms.items() if b in BUILTIN}
    best = min(builtin, key=builtin.get) if builtin else None
    cells = "  ".join(f"{b} {ms[b]:9.2f}" if b in ms else f"{b} {'skip':>9}" for b in (*BUILTIN, "minagi"))
    ratio = f"  x{builtin[best] / ms['minagi']:.2f} vs {best}" if best and "minagi" in ms else ""
    if FLOOR in ms:
        cells += f"  {FLOOR} {ms[FLOOR]:9.2f}"
        ratio += f"  ceiling x{builtin[best] / ms[FLOOR]:.2f}" if best else ""
    print(f"{r['block']:<12}{r['dtype']:<9}{r['mode']:<8}T={r['tokens']:<5} {cells}{ratio}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench hf", description=__doc__,
                                formatter_class=ListHelpFormatter)
    p.add_argument("--blocks", default=",".join(BLOCKS), help=f"comma-separated subset of {', '.join(BLOCKS)}")
    p.add_argument("--tokens", default="512,2048", help="training sizes (forward and forward+backward)")
    p.add_argument("--decode", default="1,4", help="decode sizes (forward, no gradient)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes to time")
    p.add_argument("--backends", default=",".join((*BUILTIN, "minagi", FLOOR)),
                   help=f"comma-separated; {FLOOR} is no backend: each expert's GEMMs at an even load, nothing else")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (median kept)")
    p.add_argument("--slow", type=float, default=4.0, help="a backend slower than this (s) runs one round")
    p.add_argument("--max-gb", type=float, default=6.0, help="skip batched_mm where it would need more")
    p.add_argument("--no-generate", action="store_true", help="skip the whole-model generate() rows")
    p.add_argument("--generate", default=",".join(GENERATE),
                   help=f"whole models for the generate() rows, a subset of {', '.join(GENERATE)} (--quick: tiny)")
    p.add_argument("--generate-modes", default="eager,compiled",
                   help="eager (default cache) and/or compiled (static cache, the forward compiled whole)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per generate() (--quick: 8)")
    p.add_argument("--quick", action="store_true", help="widths / 8 and small sizes: a smoke run")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--accuracy", action="store_true",
                   help="instead: minagi against eager on the tiny whole models of tests/test_hf.py")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    a = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        p.error('needs transformers: pip install --no-build-isolation -e ".[hf]"')
    from ..moe import hf

    hf.register()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.accuracy:
        rows = [accuracy(name) for name in TINY]
        print(f"{'model':<18}{'fp32 logits rel':>16}{'bf16 err / eager':>18}{'worst grad rel':>16}")
        for r in rows:
            print(f"{r['model']:<18}{r['logits_rel']:>16.1e}{r['bf16_vs_eager']:>18.2f}{r['grad_worst_rel']:>16.1e}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"transformers": transformers.__version__, "accuracy": rows}, f, indent=2)
        return 0
    scale = 0.125 if a.quick else 1.0
    blocks = [b.strip() for b in a.blocks.split(",") if b.strip()]
    unknown = [b for b in blocks if b not in BLOCKS]
    if unknown:
        p.error(f"unknown block(s) {', '.join(unknown)}; choose from {', '.join(BLOCKS)}")
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    real = [b for b in backends if b != FLOOR]  # the floor has no peak-memory or generate() row
    tokens = [int(t) for t in a.tokens.split(",") if t]
    decode = [int(t) for t in a.decode.split(",") if t]
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",") if d]
    gen_models = ["tiny"] if a.quick else [g.strip() for g in a.generate.split(",") if g.strip()]
    modes = [m.strip() for m in a.generate_modes.split(",") if m.strip()]
    if bad := [g for g in gen_models if g not in GENERATE] + [m for m in modes if m not in ("eager", "compiled")]:
        p.error(f"unknown generate model or mode {', '.join(bad)}; models: {', '.join(GENERATE)}; "
                "modes: eager, compiled")
    ext = "loaded" if _backend.loaded() else f"not loaded ({_backend.state().reason})"
    print(f"minagi.bench hf: torch {torch.__version__}, transformers {transformers.__version__}, {a.device}, "
          f"{torch.get_num_threads()} threads, extension {ext}, allocator {allocator.describe()}; ms per call, "
          f"median of {a.rounds} interleaved rounds", flush=True)
    results, peaks = [], {}
    for name in blocks:
        for dtype in dtypes:
            for T, train, dec in [(t, m, False) for t in tokens for m in (False, True)] + [(t, False, True)
                                                                                         for t in decode]:
                r = bench_block(name, dtype, T, train, backends, a.rounds, a.slow, a.max_gb, a.device, scale, dec)
                results.append(r)
                _print_row(r)
            if tokens:
                dt = str(dtype).replace("torch.", "")
                peaks[(name, dt)] = peak_memory(name, dtype, max(tokens), real, a.max_gb, a.device, scale)
                print(f"{name:<12}{dt:<9}peak MiB fwd+bwd T={max(tokens)}: " + "  ".join(
                    f"{b} {v / 2**20:.1f}" for b, v in peaks[(name, dt)].items()), flush=True)
    gen = {} if a.no_generate else {
        name: bench_generate(real, a.rounds, 8 if a.quick else a.new_tokens, a.device, name, modes)
        for name in gen_models}
    for name, by_mode in gen.items():
        print(f"generate() tokens/s, {GENERATE[name][0]}, {8 if a.quick else a.new_tokens} new tokens:")
        for mode, rates in by_mode.items():
            print(f"  {mode:<9}" + "  ".join(f"{b} {v:.1f}" for b, v in rates.items()), flush=True)
    rows = ratios(results, peaks)
    print_ratios(rows, "minagi's ratios:", 72)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "transformers": transformers.__version__, "device": a.device,
                       "threads": torch.get_num_threads(), "extension": _backend.loaded(),
                       "allocator": allocator.describe(), "results": results,
                       "peak_bytes": {f"{b} {d}": v for (b, d), v in peaks.items()}, "generate_tokens_per_s": gen,
                       "ratios": as_json(rows)}, f, indent=2)
    return 0
