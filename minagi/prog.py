"""How the commands are called, for usage lines and hints in messages: train.py trains without
a subcommand; the minagi command (python -m minagi) names every one (minagi train, minagi
write, ...). cli.main sets it once per process; the modules below the command line (checkpoint,
routes) read it here, so that none of them imports the command line. And the --help formatters
of every command and benchmark."""
import argparse

PROG = {"train": "python train.py", "sub": "python train.py"}


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
