"""Writing: sampling text one character at a time from a checkpoint, with per-row key/value
caches so each new character costs one pass of its rows (and its pooled MLP reads only its
top_k experts' weights per row)."""
from __future__ import annotations

import codecs
import sys
import time
from dataclasses import dataclass

import torch

from . import checkpoint
from .config import Config
from .model import ByteModel


def load_model(run_dir, device="cpu") -> tuple[ByteModel, Config]:
    """The model of a run folder (or checkpoint file), in eval mode, on `device`."""
    ckpt = checkpoint.load(run_dir, map_location="cpu")
    cfg = Config.from_dict(ckpt["config"])
    model = ByteModel(cfg.model, cfg.data.context)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as exc:
        raise checkpoint.CheckpointError(f"checkpoint in {run_dir} does not fit its own config: {exc}") from exc
    return model.to(device).eval(), cfg


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator) -> int:
    """One byte from logits [256]: greedy at temperature 0, else nucleus sampling."""
    if temperature <= 0:
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
          seed: int = 0, on_byte=None) -> WriteResult:
    """Continue `prompt` by n_chars bytes; on_byte(b) is called as each one is written."""
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache()
    out = None
    for b in prompt:
        out = model.step(torch.tensor([[b]], device=device), cache)
    written = bytearray()
    t0 = time.perf_counter()
    for _ in range(n_chars):
        b = sample_next(out.logits[0, -1].cpu(), temperature, top_p, generator)
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


def run_write(run_dir, prompt: str, n_chars: int, temperature: float, top_p: float, seed: int, device="cpu") -> WriteResult:
    if n_chars < 0:
        raise ValueError("--chars must be >= 0")
    if not (0 < top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    model, cfg = load_model(run_dir, device)
    data = prepare_prompt(prompt, cfg.data.context, notice=lambda m: print(m, file=sys.stderr))
    sys.stdout.write(data.decode("utf-8", errors="replace"))
    result = write(model, data, n_chars, temperature=temperature, top_p=top_p, seed=seed, on_byte=stream_to(sys.stdout))
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"minagi: wrote {result.chars} chars in {result.seconds:.2f} s: {result.char_per_s:.1f} char/s",
          file=sys.stderr)
    return result
