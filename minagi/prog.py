"""How the commands are called, for usage lines and hints in messages: train.py trains without
a subcommand; the minagi command (python -m minagi) names every one (minagi train, minagi
write, ...). cli.main sets it once per process; the modules below the command line (checkpoint,
routes) read it here, so that none of them imports the command line."""

PROG = {"train": "python train.py", "sub": "python train.py"}
