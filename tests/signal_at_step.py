"""The train command, with signals sent to itself after a chosen step (a callback, the trainer's
only seam for tests): `python tests/signal_at_step.py STEP SIGNALS [train arguments...]`, SIGNALS
a comma-separated list such as TERM, INT,INT or KILL (SIGKILL: a crash with no cleanup). Under
torchrun, only the rank named by SIGNAL_RANK (default 0) sends them."""
import os
import signal
import sys

from minagi.lm import trainer
from minagi.lm.cli import main


def sender(at: int, names: list[str]):
    def callback(info) -> None:
        if info.step == at and os.environ.get("RANK", "0") == os.environ.get("SIGNAL_RANK", "0"):
            for name in names:
                os.kill(os.getpid(), getattr(signal, f"SIG{name}"))
    return callback


if __name__ == "__main__":
    at, names, argv = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3:]
    plain = trainer.train
    trainer.train = lambda *a, **k: plain(*a, callbacks=[sender(at, names)], **k)
    sys.exit(main(argv))
