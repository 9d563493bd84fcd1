"""Writing: sampling text one character at a time from a checkpoint, with per-row key/value
caches so each new character costs one pass of its rows (and its pooled MLP reads only its
top_k experts' weights per row)."""
from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass

import torch

from ..moe import quant
from . import checkpoint
from .config import Config
from .model import ByteModel

# Writing blocks a byte that would repeat a sequence of NO_REPEAT_NGRAM bytes already among the
# last NGRAM_WINDOW bytes (the prompt included): a sampled run of one byte ends by then, and a
# greedy loop over one line is broken each time it comes round. 0 turns the block off.
NO_REPEAT_NGRAM = 32
NGRAM_WINDOW = 1024


# --quantize's choices: (bits, group_size) of minagi.moe.quant (int4 in llama.cpp Q4_0's groups of 32).
QUANTIZE = {"int8": (8, None), "int4": (4, 32)}


def load_model(run_dir, device="cpu", quantize: str | None = None) -> tuple[ByteModel, Config]:
    """The model of a run folder (or checkpoint file), in eval mode, on `device`; with quantize
    ("int8" or "int4"), its pool's experts quantized (quantize_experts), the rest as trained."""
    ckpt = checkpoint.load(run_dir, map_location="cpu")
    cfg = Config.from_dict(ckpt["config"])
    model = ByteModel(cfg.model, cfg.data.context)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise checkpoint.CheckpointError(f"checkpoint in {run_dir} does not fit its own config: {exc}") from exc
    model = model.to(device).eval()
    if quantize is not None:
        print(quantize_experts(model, quantize), file=sys.stderr)
    return model, cfg


def quantize_experts(model: ByteModel, spec: str) -> str:
    """Replace the pool's expert weights (w_in, w_out) by minagi.moe.quant's QuantizedWeights,
    in place, for inference; returns a line saying what it did."""
    if spec not in QUANTIZE:
        raise ValueError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {spec!r}")
    bits, group = QUANTIZE[spec]
    pool, before, after = model.pool, 0, 0
    for name in ("w_in", "w_out"):
        w = getattr(pool, name)
        qw = quant.quantize(w.detach(), bits=bits, group_size=group)
        before, after = before + w.nbytes, after + qw.nbytes
        del pool._parameters[name]
        setattr(pool, name, qw)
    return (f"minagi: the pool's {pool.w_in.shape[0]} experts in {spec}: {before / 2**20:.2f} MiB -> "
            f"{after / 2**20:.2f} MiB (attention, n-gram tables and the router stay as trained)")


def banned_bytes(text: bytes, n: int, window: int = NGRAM_WINDOW) -> list[int]:
    """The bytes that would end an n-byte sequence already in the last `window` bytes of text
    (n = 0: none): each byte that followed an earlier copy of text's last n - 1 bytes."""
    if n < 2 or len(text) < n:
        return []
    recent = bytes(text[-window:])
    suffix, seen = recent[len(recent) - n + 1:], set()
    at = recent.find(suffix)
    while 0 <= at < len(recent) - n + 1:  # an earlier copy, with a byte after it
        seen.add(recent[at + n - 1])
        at = recent.find(suffix, at + 1)
    return sorted(seen)


def block(logits: torch.Tensor, banned: list[int]) -> torch.Tensor:
    """logits with the banned bytes ruled out (all of them banned: unchanged)."""
    if not banned or len(banned) == logits.numel():
        return logits
    logits = logits.clone()
    logits[banned] = float("-inf")
    return logits


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One byte from logits [256]: greedy at temperature 0, else nucleus sampling."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class WriteResult:
    text: bytes
    seconds: float
    chars: int

    @property
    def char_per_s(self) -> float:
        return self.chars / self.seconds if self.seconds else 0.0


def prepare_prompt(prompt: str, context: int, notice=None) -> bytes:
    data = prompt.encode("utf-8") or b"\n"  # an empty prompt starts from a newline
    if len(data) > context:
        if notice:
            notice(f"minagi: the prompt has {len(data)} bytes; keeping its last {context} (the model's context)")
        data = data[-context:]
    return data


@torch.no_grad()
def write(model: ByteModel, prompt: bytes, n_chars: int, *, temperature: float = 0.8, top_p: float = 0.95,
          seed: int = 0, no_repeat_ngram: int = NO_REPEAT_NGRAM, on_byte=None) -> WriteResult:
    """Continue `prompt` by n_chars bytes; on_byte(b) is called as each one is written.
    no_repeat_ngram: see NO_REPEAT_NGRAM (0 = off)."""
    check_settings(temperature, top_p, no_repeat_ngram)
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache()
    out = None
    for b in prompt:
        out = model.step(torch.tensor([[b]], device=device), cache)
    text, written = bytearray(prompt), bytearray()
    t0 = time.perf_counter()
    for _ in range(n_chars):
        logits = block(out.logits[0, -1].cpu(), banned_bytes(text, no_repeat_ngram))
        b = sample_next(logits, temperature, top_p, generator)
        text.append(b)
        written.append(b)
        if on_byte:
            on_byte(b)
        out = model.step(torch.tensor([[b]], device=device), cache)
    return WriteResult(bytes(written), time.perf_counter() - t0, n_chars)


def stream_to(stream):
    """An on_byte callback that writes UTF-8 text as it completes (partial sequences wait)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def on_byte(b: int) -> None:
        text = decoder.decode(bytes([b]))
        if text:
            stream.write(text)
            stream.flush()
    return on_byte


def check_settings(temperature: float, top_p: float, no_repeat_ngram: int) -> None:
    """A ValueError naming the command's flag for a setting that cannot be used."""
    if not temperature >= 0:
        raise ValueError(f"--temperature must be >= 0 (0 writes greedily: the likeliest byte each time), got {temperature}")
    if not (0 < top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if no_repeat_ngram < 0 or no_repeat_ngram == 1:
        raise ValueError(f"--no-repeat-ngram must be 0 (off) or >= 2, got {no_repeat_ngram}")


def run_write(run_dir, prompt: str, n_chars: int, temperature: float, top_p: float, seed: int, device="cpu",
              no_repeat_ngram: int = NO_REPEAT_NGRAM, quantize: str | None = None) -> WriteResult:
    if n_chars < 0:
        raise ValueError("--chars must be >= 0")
    check_settings(temperature, top_p, no_repeat_ngram)
    model, cfg = load_model(run_dir, device, quantize)
    data = prepare_prompt(prompt, cfg.data.context, notice=lambda m: print(m, file=sys.stderr))
    sys.stdout.write(data.decode("utf-8", errors="replace"))
    result = write(model, data, n_chars, temperature=temperature, top_p=top_p, seed=seed,
                   no_repeat_ngram=no_repeat_ngram, on_byte=stream_to(sys.stdout))
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"minagi: wrote {result.chars} chars in {result.seconds:.2f} s: {result.char_per_s:.1f} char/s",
          file=sys.stderr)
    return result
