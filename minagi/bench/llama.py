"""python -m minagi.bench llama: transformers with minagi's experts (bfloat16, int8, int4 g32)
side by side with llama.cpp (BF16, Q8_0, Q4_0) on the same model, greedy decode on the CPU.

The model: Qwen3-30B-A3B's layer (hidden 2,048, 32 heads of 128 with 4 KV heads, 128 experts of
width 768, top 8, normalized top-k weights), 4 layers deep, vocabulary 8,192, random weights in
bfloat16. It is saved with save_pretrained (a byte-level tokenizer beside it: the engines are fed
token ids, never text) and written to GGUF by llama.cpp's own convert_hf_to_gguf.py (--convert);
Q8_0 and Q4_0 are made from the BF16 file by llama.cpp's quantizer (llama_model_quantize).

Rows, per format (minagi's experts in int8 / int4 g32 against llama.cpp's Q8_0 / Q4_0; bf16
against BF16):
  tok/s     greedy decode: --new-tokens tokens after a --prompt-token prompt (the prompt's
            forward counted), the median of --rounds rounds, each round running both engines
            on both models (below) in a rotated order;
  experts   each engine's experts, ms per token: the same run's time less that of the same model
            with experts 8 wide, over the tokens (llama.cpp's binding reports no per-op time, so
            both sides are measured this one way);
  ratios    minagi over llama.cpp: tok/s (the whole model) and experts ms (lower is better for
            minagi); with --compiled also minagi's whole model under torch.compile (static cache).
minagi quantizes the experts only; llama.cpp's Q8_0 / Q4_0 files quantize attention too.

First, a check that both engines compute the same function: a small model of the same build
(2 layers, hidden 256, 16 experts, top 4) in float32 on both, greedy tokens and the prompt's last
logits compared.

Needs transformers and llama-cpp-python (pip builds llama.cpp from source, which takes a while;
docs/quant.md gives the commands) and the convert_hf_to_gguf.py of the same llama.cpp (in
llama-cpp-python's sdist, vendor/llama.cpp/). Where either is missing the bench
says so in one line and runs nothing. Nothing else should run beside it: the figures are times.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..lm.prog import ListHelpFormatter
from ..moe import _backend

# transformers Qwen3MoeConfig fields: Qwen3-30B-A3B's layer, 4 layers deep, vocabulary 8,192.
MODEL = dict(vocab_size=8192, hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
             norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
             tie_word_embeddings=False, max_position_embeddings=4096)
CHECK = {**MODEL, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 512, "moe_intermediate_size": 64, "num_experts": 16,
         "num_experts_per_tok": 4}
NARROW = 8  # the experts' width of the model whose time is taken off (llama.cpp's per-op time is not exposed)
# name: (minagi's experts as minagi.hf.quantize takes them (None: as stored), llama.cpp's type)
FORMATS = {"bf16": (None, "BF16"), "int8": ((8, None), "Q8_0"), "int4_g32": ((4, 32), "Q4_0")}
LLAMA_FTYPES = {"Q8_0": 7, "Q4_0": 2}  # llama_ftype: LLAMA_FTYPE_MOSTLY_*
MISSING = "bench llama: skipped, {what} (see python -m minagi.bench llama --help)"


def hf_model_dir(work: Path, fields: dict, dtype: torch.dtype, name: str) -> Path:
    """A transformers checkpoint of the config with random weights (seed 0) and a tokenizer, made
    once under work/name and reused."""
    out = work / name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import transformers

    print(f"  making {name} (random weights, {dtype}) ...", flush=True)
    tmp = work / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**fields), dtype=dtype)
    model.save_pretrained(tmp)
    _byte_tokenizer().save_pretrained(tmp)
    del model
    tmp.rename(out)
    return out


def _byte_tokenizer():
    """A byte-level BPE tokenizer (the 256 bytes and a few merges): llama.cpp's GGUF wants a
    vocabulary and merges, and the ids past it are padding. The engines are fed ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [(alphabet[i], alphabet[j]) for i in range(66, 76) for j in range(66, 76)]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


# Runs llama.cpp's convert_hf_to_gguf.py as it is, with one patch: its table of known tokenizers
# (by a hash of how they split a test text) does not know the byte tokenizer above, which it is
# told is Qwen2's (it only names the GGUF's pre-tokenizer; the engines are fed ids).
_CONVERT = """
import os, runpy, sys
path = sys.argv[1]
sys.argv = [path] + sys.argv[2:]
sys.path.insert(0, os.path.dirname(path))
sys.path.insert(1, os.path.join(os.path.dirname(path), "gguf-py"))
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
runpy.run_path(path, run_name="__main__")
"""


def gguf_file(work: Path, hf_dir: Path, convert: Path, kind: str) -> Path:
    """The GGUF of hf_dir in kind ("F32", "BF16", or a type llama_model_quantize makes from BF16),
    made once and reused."""
    out = work / f"{hf_dir.name}-{kind}.gguf"
    if out.exists():
        return out
    tmp = out.with_suffix(".tmp")
    if kind in ("F32", "BF16"):
        print(f"  converting {hf_dir.name} to {kind} with {convert.name} ...", flush=True)
        r = subprocess.run([sys.executable, "-c", _CONVERT, str(convert), str(hf_dir), "--outtype", kind.lower(),
                            "--outfile", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    else:
        import ctypes

        import llama_cpp

        src = gguf_file(work, hf_dir, convert, "BF16")
        print(f"  quantizing {src.name} to {kind} with llama_model_quantize ...", flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = LLAMA_FTYPES[kind], os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama_model_quantize to {kind} failed")
    tmp.rename(out)
    return out


class LlamaCpp:
    """One GGUF loaded by llama-cpp-python, decoding greedily from token ids."""

    def __init__(self, path: Path, threads: int, n_ctx: int, f32_cache: bool = False):
        from llama_cpp import GGML_TYPE_F32, Llama

        # f32_cache: the attention cache in float32 (its default is float16), for the float32 check.
        cache = dict(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32) if f32_cache else {}
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                         n_threads_batch=threads, seed=0, verbose=False, **cache)

    def _logits(self) -> torch.Tensor:
        """The last evaluated token's logits, read from llama.cpp's own buffer (the binding keeps
        them only with logits_all, which would compute every prompt token's)."""
        import llama_cpp
        import numpy as np

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).copy())

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(prompt)
        return self._logits()

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        out = []
        logits = self.last_logits(prompt)
        for i in range(new_tokens):
            out.append(int(logits.argmax()))
            if i + 1 < new_tokens:
                self.llm.eval([out[-1]])
                logits = self._logits()
        return out

    def close(self):
        self.llm.close()


class Minagi:
    """The transformers model with minagi's experts (quantized as the format says)."""

    def __init__(self, hf_dir: Path, dtype: torch.dtype, quant, compiled: bool = False):
        import transformers

        from ..moe import hf

        hf.register()
        transformers.utils.logging.disable_progress_bar()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
        self.model.set_experts_implementation("minagi")
        if quant is not None:
            hf.quantize(self.model, bits=quant[0], group_size=quant[1], verbose=False)
        self.compiled = compiled

    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.tensor([prompt])).logits[0, -1].float()

    def generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        from .hf import _generate_call

        out = _generate_call(self.model, torch.tensor([prompt]), new_tokens, self.compiled)
        return out[0, len(prompt):].tolist()

    def close(self):
        del self.model


def check_same_function(work: Path, convert: Path, threads: int, prompt: list[int], new_tokens: int = 17) -> dict:
    """Both engines on the small float32 model: greedy tokens and the prompt's last logits."""
    hf_dir = hf_model_dir(work, CHECK, torch.float32, "check-f32")
    ours = Minagi(hf_dir, torch.float32, None)
    theirs = LlamaCpp(gguf_file(work, hf_dir, convert, "F32"), threads, 256, f32_cache=True)
    a, b = ours.last_logits(prompt), theirs.last_logits(prompt)
    ta, tb = ours.generate(prompt, new_tokens), theirs.generate(prompt, new_tokens)
    ours.close(), theirs.close()
    return {"tokens": new_tokens, "same_tokens": sum(x == y for x, y in zip(ta, tb)),
            "logits_max_abs_diff": float((a - b).abs().max()), "logits_max_abs": float(a.abs().max())}


def _timed(engine, prompt, new_tokens) -> float:
    t0 = time.perf_counter()
    engine.generate(prompt, new_tokens)
    return time.perf_counter() - t0


def time_format(work, convert, fmt, threads, prompt, new_tokens, rounds, compiled) -> dict:
    """Seconds per run, the median of `rounds` (after one warm-up round), of both engines on the
    full model and on the 8-wide one: all four in each round, in a rotated order, so a change in
    the machine's pace falls on the full and the narrow runs alike (their difference is the
    experts' time). With compiled, minagi's full model under torch.compile after them."""
    quant, kind = FORMATS[fmt]
    engines = {}
    for width, fields in (("full", MODEL), ("narrow", {**MODEL, "moe_intermediate_size": NARROW})):
        hf_dir = hf_model_dir(work, fields, torch.bfloat16, f"qwen3-moe-{fields['moe_intermediate_size']}")
        engines["llama.cpp", width] = LlamaCpp(gguf_file(work, hf_dir, convert, kind), threads, 256)
        engines["minagi", width] = Minagi(hf_dir, torch.bfloat16, quant)
    order, times = list(engines), {key: [] for key in engines}
    for r in range(rounds + 1):
        for key in order[r % len(order):] + order[:r % len(order)]:
            t = _timed(engines[key], prompt, new_tokens)
            if r:  # round 0 warms up
                times[key].append(t)
    out = {width: {name: statistics.median(times[name, width]) for name in ("llama.cpp", "minagi")}
           for width in ("full", "narrow")}
    if compiled:
        ours = engines["minagi", "full"]
        ours.compiled = True
        _timed(ours, prompt, new_tokens)  # compiles
        out["full"]["minagi compiled"] = statistics.median(_timed(ours, prompt, new_tokens) for _ in range(rounds))
    for e in engines.values():
        e.close()
    from torch import _dynamo

    _dynamo.reset()
    return out


def rows(results: dict, new_tokens: int) -> list[dict]:
    """Per format: tok/s of each engine (and minagi compiled), experts ms per token, ratios."""
    table = []
    for fmt, t in results.items():
        full, narrow = t["full"], t["narrow"]
        row = {"format": fmt, "llama.cpp type": FORMATS[fmt][1]}
        for name in full:
            row[f"{name} tok/s"] = new_tokens / full[name]
        for name in ("llama.cpp", "minagi"):
            row[f"{name} experts ms/token"] = 1e3 * (full[name] - narrow[name]) / new_tokens
        row["tok/s minagi / llama.cpp"] = full["llama.cpp"] / full["minagi"]
        if "minagi compiled" in full:
            row["tok/s minagi compiled / llama.cpp"] = full["llama.cpp"] / full["minagi compiled"]
        row["experts ms minagi / llama.cpp"] = row["minagi experts ms/token"] / row["llama.cpp experts ms/token"]
        table.append(row)
    return table


def _convert_script(given: str | None) -> Path | None:
    for c in (given, os.environ.get("MINAGI_LLAMA_CONVERT")):
        if c:
            return Path(c).expanduser()
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minagi.bench llama", description=__doc__,
                                formatter_class=ListHelpFormatter)
    p.add_argument("--convert", help="llama.cpp's convert_hf_to_gguf.py (the one of the llama.cpp that "
                                     "llama-cpp-python was built from); default: $MINAGI_LLAMA_CONVERT")
    p.add_argument("--work", default=str(Path.home() / ".cache" / "minagi" / "bench-llama"),
                   help="where the models are made once and kept (about 12 GB)")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"a subset of {', '.join(FORMATS)}")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median kept), after one warm-up")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens a run")
    p.add_argument("--prompt-tokens", type=int, default=32, help="the prompt's tokens")
    p.add_argument("--threads", type=int, default=None, help="threads of both engines (default: torch's)")
    p.add_argument("--compiled", action="store_true", help="also minagi's whole model under torch.compile")
    p.add_argument("--no-check", action="store_true", help="skip the float32 check of the same function")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    a = p.parse_args(argv)
    formats = [f.strip() for f in a.formats.split(",") if f.strip()]
    if bad := [f for f in formats if f not in FORMATS]:
        p.error(f"unknown format(s) {', '.join(bad)}; choose from {', '.join(FORMATS)}")
    try:
        import llama_cpp
        import transformers
    except ImportError as e:
        print(MISSING.format(what=f"{e.name} is not installed (docs/quant.md: side by side with llama.cpp)"))
        return 0
    convert = _convert_script(a.convert)
    if convert is None or not convert.is_file():
        print(MISSING.format(what=f"llama.cpp's convert_hf_to_gguf.py not found ({convert or 'give --convert'})"))
        return 0
    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    work = Path(a.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    prompt = torch.randint(0, MODEL["vocab_size"], (a.prompt_tokens,), generator=torch.Generator().manual_seed(2))
    prompt = prompt.tolist()
    print(f"minagi.bench llama: torch {torch.__version__}, transformers {transformers.__version__}, llama-cpp-python "
          f"{llama_cpp.__version__}, {threads} threads, extension "
          f"{'loaded' if _backend.loaded() else 'not loaded'}; {a.new_tokens} greedy tokens after {a.prompt_tokens}, "
          f"median of {a.rounds} rounds", flush=True)
    report = {"torch": torch.__version__, "transformers": transformers.__version__,
              "llama_cpp_python": llama_cpp.__version__, "threads": threads, "new_tokens": a.new_tokens}
    if not a.no_check:
        c = check_same_function(work, convert, threads, prompt)
        report["check"] = c
        print(f"float32 check (small model): {c['same_tokens']} of {c['tokens']} greedy tokens the same; the "
              f"prompt's last logits within {c['logits_max_abs_diff']:.1e} (largest {c['logits_max_abs']:.2f})",
              flush=True)
    results = {}
    for fmt in formats:
        results[fmt] = time_format(work, convert, fmt, threads, prompt, a.new_tokens, a.rounds, a.compiled)
        (row,) = rows({fmt: results[fmt]}, a.new_tokens)
        print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)
    report["seconds"], report["rows"] = results, rows(results, a.new_tokens)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
