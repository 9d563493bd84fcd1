"""The command line behind train.py:

    python train.py [--profile cpu-tiny] [--data PATH] [--data-binary] [--out DIR] [--steps N] [--set k=v]... [--resume]
    python train.py write DIR --prompt TEXT --chars N [--temperature T] [--top-p P] [--seed S] [--no-repeat-ngram N]
    python train.py eval DIR [--data PATH] [--data-binary]
    python train.py plot DIR
    python train.py routes DIR [--data PATH] [--data-binary] [--chunks N] [--json]
    python train.py prepare SRC OUT [--heldout-every N] [--force] [--data-binary]

Errors a user can fix (an unknown profile or key, a bad value, missing data, a corpus too small,
a missing checkpoint) end with one line saying what to do, and exit status 2.
"""
from __future__ import annotations

import argparse
import sys

from .allocator import AllocatorError
from .checkpoint import CheckpointError
from .config import DEFAULT_PROFILE, ConfigError, load, profile_names
from .data import DataError
from .distributed import DistributedError, launched, rank
from .guard import Diverged, Interrupted, release_early_signals
from .plot import PlotError
from .prog import PROG, HelpFormatter, ListHelpFormatter, bench_list

USER_ERRORS = (ConfigError, DataError, CheckpointError, PlotError, AllocatorError, DistributedError)


def train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG["train"], description="Train a minagi byte model.",
                                formatter_class=ListHelpFormatter, epilog=command_list(PROG["sub"]))
    p.add_argument("--profile", default=None, help=f"a packaged profile ({', '.join(profile_names())}) "
                   f"or a path to a .toml file (default {DEFAULT_PROFILE})")
    p.add_argument("--data", default=None, help="a text file, a folder of text files, or a prepared corpus folder (default: the Python standard library's source)")
    p.add_argument("--data-binary", action="store_true",
                   help="read files that are not text too (= --set data.binary=true)")
    p.add_argument("--out", default=None, help="run folder for checkpoint.pt and history.jsonl (default runs/PROFILE)")
    p.add_argument("--steps", type=int, default=None, help="length of the whole run, schedule included (= --set train.steps=N; default: the profile's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a profile value, e.g. --set model.top_k=4 (repeatable)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt with the settings saved there")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def command_list(prog: str, more: dict[str, str] | None = None) -> str:
    """The subcommands and the benchmarks, a line each, for train.py's and the minagi command's
    --help: from COMMANDS (each function's docstring), `more` (name: line), and prog.BENCHES."""
    bench = "python -m minagi.bench" if prog == "python train.py" else f"{prog} bench"
    lines = [f"commands ({prog} COMMAND --help: its options):"]
    lines += [f"  {name:<9} {fn.__doc__.splitlines()[0]}" for name, fn in {"train": run_train, **COMMANDS}.items()]
    lines += [f"  {name:<9} {line}" for name, line in (more or {}).items()]
    return "\n".join(lines) + "\n" + bench_list(f"{bench} NAME --help: its options")


def run_train(argv) -> int:
    """train a model (in a checkout: python train.py, no command)"""
    args = train_parser().parse_args(argv)
    overrides = list(args.overrides)
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: the run's length must be at least 1 optimizer step; "
                          "give --steps 1 or more")
    if args.steps is not None:
        overrides.append(f"train.steps={args.steps}")
    if args.data is not None:
        overrides.append(f"data.path={args.data}")
    if args.data_binary:
        overrides.append("data.binary=true")
    cfg = load(args.profile or DEFAULT_PROFILE, overrides)
    out = args.out or f"runs/{cfg.profile}"
    from .trainer import train

    # On --resume only a length the command names (--steps, or --set train.steps) moves the
    # run's end, and only the settings it names are reported as ignored where they differ from
    # the checkpoint's (a profile it names: all of that profile's).
    keys = {kv.split("=", 1)[0].strip() for kv in overrides}
    named = None if args.profile else keys
    steps = cfg.train.steps if args.resume and "train.steps" in keys else None
    try:
        record = train(cfg, out, resume=args.resume, progress=not args.quiet,
                       steps=steps, named=named)
    except Diverged as exc:
        print(f"minagi: {exc}", file=sys.stderr)
        return exc.exit_status
    except Interrupted as exc:
        if rank() == 0:
            again = ("the same torchrun command with --resume" if launched()
                     else f"{PROG['train']} --resume --out {out}")
            print(f"minagi: {exc} Resume with: {again}", file=sys.stderr)
        return exc.exit_status
    if record and rank() == 0:
        print(f"done: step {record['step']}, held-out {record['heldout_bpc']:.3f} bits per byte, "
              f"{record['char_per_s']:,.0f} char/s; checkpoint and history in {out}")
    return 0


def run_write(argv) -> int:
    """write text from a checkpoint"""
    from .writer import NGRAM_WINDOW, NO_REPEAT_NGRAM, QUANTIZE

    p = argparse.ArgumentParser(prog=f"{PROG['sub']} write", description="Write text from a checkpoint.",
                                formatter_class=HelpFormatter)
    p.add_argument("run", metavar="DIR", help="run folder (or checkpoint file)")
    p.add_argument("--prompt", default="", help="text to continue (default: start from a newline)")
    p.add_argument("--chars", type=int, default=400, help="characters (bytes) to write")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature, >= 0; 0 = greedy (the likeliest byte)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling: draw from the likeliest bytes "
                   "holding this much probability, in (0, 1]")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (the same seed writes the same text)")
    p.add_argument("--no-repeat-ngram", type=int, default=NO_REPEAT_NGRAM, metavar="N",
                   help=f"never repeat a sequence of N bytes already in the last {NGRAM_WINDOW} (no run of one "
                   "byte longer than N, no line looped forever); 0 = off")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N")
    p.add_argument("--quantize", default=None, choices=list(QUANTIZE),
                   help="run the pool's experts quantized (int8: per output channel; int4: groups of 32 inputs)")
    a = p.parse_args(argv)
    from .writer import run_write as write

    try:
        write(a.run, a.prompt, a.chars, a.temperature, a.top_p, a.seed, a.device, a.no_repeat_ngram, a.quantize)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return 0


def run_eval(argv) -> int:
    """bits per byte of a checkpoint on your text"""
    p = argparse.ArgumentParser(prog=f"{PROG['sub']} eval", description="Bits per byte of a checkpoint on your text (the last line of the output).",
                                formatter_class=HelpFormatter)
    p.add_argument("run", metavar="DIR", help="run folder (or checkpoint file)")
    p.add_argument("--data", default=None, help="a text file or a folder of them: every byte is scored "
                   "(default: the run's own held-out split)")
    p.add_argument("--data-binary", action="store_true", help="score files that are not text too")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N")
    p.add_argument("--quantize", default=None, choices=["int8", "int4"],
                   help="score the pool's experts quantized too, beside the float model (the last line is theirs)")
    a = p.parse_args(argv)
    from .evaluate import bits_per_byte, scored_bytes
    from .writer import load_model, quantize_experts

    model, cfg = load_model(a.run, a.device)
    data, what, note = scored_bytes(cfg, a.data, a.data_binary)
    if note:
        print(note, file=sys.stderr)
    print(f"scoring {data.numel():,} bytes of {what} in windows of {cfg.data.context}; bits per byte:", file=sys.stderr)
    bpb = bits_per_byte(model, data, cfg.data.context)
    if a.quantize is None:
        print(f"{bpb:.4f}")
        return 0
    try:
        print(quantize_experts(model, a.quantize), file=sys.stderr)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    q = bits_per_byte(model, data, cfg.data.context)
    print(f"float {bpb:.4f}, {a.quantize} {q:.4f} ({q - bpb:+.4f}); {a.quantize}'s:", file=sys.stderr)
    print(f"{q:.4f}")
    return 0


def run_prepare(argv) -> int:
    """prepare a corpus once, read from disk by training"""
    p = argparse.ArgumentParser(prog=f"{PROG['sub']} prepare", description=(
        "Prepare a corpus once: OUT/train.bin and OUT/heldout.bin (raw bytes, split as training would "
        "split SRC) and OUT/corpus.json. Training, eval and routes then memory-map it (--data OUT)."),
        formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="a text file or a folder of text files")
    p.add_argument("out", metavar="OUT", help="an empty (or new) folder")
    p.add_argument("--heldout-every", type=int, default=20, help="hold out every Nth file (default 20, as data.heldout_every)")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.add_argument("--data-binary", action="store_true", help="read files that are not text too")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    a = p.parse_args(argv)
    from .data import prepare

    if a.heldout_every < 2:
        raise ConfigError("--heldout-every must be >= 2")
    bar = ByteProgress(not a.quiet)
    meta = prepare(a.src, a.out, a.heldout_every, a.force, progress=bar, binary=a.data_binary)
    bar.close()
    if meta["skipped"]:
        print(meta["skipped"], file=sys.stderr)
    print(f"prepared {a.out}: {meta['train_bytes']:,} train bytes, {meta['heldout_bytes']:,} held-out bytes "
          f"({meta['files']} files, split {meta['split']}); train on it with --data {a.out}")
    return 0


class ByteProgress:
    """prepare's progress in bytes: tqdm on a terminal, else a line every ~5%."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.next = enabled, None, 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if sys.stderr.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True)
            self.bar.update(done - self.bar.n)
        elif done >= self.next or done == total:
            print(f"prepare: {done:,} of {total:,} bytes ({done / total:.0%})", file=sys.stderr, flush=True)
            self.next = done + total / 20

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_plot(argv) -> int:
    """draw a run's history into DIR/history.png"""
    from .plot import plot_history

    p = argparse.ArgumentParser(prog=f"{PROG['sub']} plot", description="Draw DIR/history.jsonl into DIR/history.png.",
                                formatter_class=HelpFormatter)
    p.add_argument("run", metavar="DIR", help="run folder")
    print(plot_history(p.parse_args(argv).run))
    return 0


def run_routes(argv) -> int:
    """how a checkpoint routes, row by row"""
    from .routes import main as routes

    try:
        return routes(argv)
    except ValueError as exc:
        if isinstance(exc, USER_ERRORS):
            raise
        raise ConfigError(str(exc)) from exc


COMMANDS = {"write": run_write, "eval": run_eval, "plot": run_plot, "routes": run_routes, "prepare": run_prepare}


def main(argv=None, prog: str = "python train.py", train_prog: str | None = None) -> int:
    """train.py's entry (and the minagi command's, through minagi.__main__): a subcommand of
    COMMANDS, else training."""
    argv = sys.argv[1:] if argv is None else list(argv)
    PROG.update(train=train_prog or prog, sub=prog)
    try:
        if not argv or argv[0] not in COMMANDS:
            from . import allocator

            allocator.ensure()  # MINAGI_ALLOCATOR: may re-execute this command with the library preloaded
        if argv and argv[0] in COMMANDS:
            release_early_signals()
            return COMMANDS[argv[0]](argv[1:])
        return run_train(argv)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is intact; continue with --resume", file=sys.stderr)
        return 130
