"""How the commands are called, for usage lines and hints in messages: train.py trains without
a subcommand; the minagi command (python -m minagi) names every one (minagi train, minagi
write, ...). cli.main sets it once per process; the modules below the command line (checkpoint,
routes) read it here, so that none of them imports the command line. And the --help formatters
of every command and benchmark."""
import argparse

PROG = {"train": "python train.py", "sub": "python train.py"}

# Every benchmark (python -m minagi.bench NAME): its module in minagi.bench, the function there,
# and what it measures in one line. The bench runner, its --help and the commands' --help
# (minagi.lm.cli.command_list) all read this table.
BENCHES = {
    "dispatch": ("dispatch", "main", "forward+backward time of expert_mlp per dispatch path, uniform and sink routings"),
    "quality": ("quality", "main", "does the pool pay? the profile against dense models at equal wall-clock"),
    "train": ("speed", "main_train", "training char/s, grouped against rectangle dispatch"),
    "write": ("speed", "main_write", "writing char/s of a checkpoint, grouped against rectangle dispatch"),
    "soak": ("soak", "main", "a long training run watched for memory growth and slowdown"),
    "data": ("data", "main", "training on a prepared corpus of any size: resident memory"),
    "ddp": ("ddp", "main", "data (and expert) parallelism on one machine"),
    "repro": ("repro", "main", "bit-reproducible training beside other work, exact resume after a signal"),
    "shared": ("shared", "main", "training char/s beside busy processes: threads following the free cores, every core, 1"),
    "hf": ("hf", "main", "transformers' experts backends against minagi's"),
    "quant": ("quant", "main", "quantized experts (int8, int4) against bfloat16 at decode: time, bytes read per second"),
    "llama": ("llama", "main", "transformers + minagi's experts beside llama.cpp (BF16, Q8_0, Q4_0): decode tok/s"),
}


def bench_list(how: str = "NAME --help: its options") -> str:
    """The benchmarks, a line each."""
    return f"benchmarks ({how}):\n" + "\n".join(f"  {name:<9} {line}" for name, (_, _, line) in BENCHES.items())


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each option's default: appended as "(default: X)" unless the help line already
    says its default, or there is none to say (no value, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not shows_default(action):
            return text
        return super()._get_help_string(action)


class ListHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter keeping the description and the epilog as written: for lists, a line each."""


def shows_default(action) -> bool:
    """Whether --help has a default to show for this option: not for none, an empty one, or a
    switch that is off."""
    d = action.default
    return bool(action.option_strings) and not (d is None or d is False or d == argparse.SUPPRESS
                                                or (isinstance(d, (str, list)) and not d))
