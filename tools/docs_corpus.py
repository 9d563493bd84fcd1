"""A second corpus anyone can make offline: the plain-text documentation (pydoc) of the running
Python's standard-library modules, one file per module (~3.7 MB of English docstrings and
signatures on Python 3.11; no code bodies). The quality bench's figures in docs/quality.md use
it:

    python tools/docs_corpus.py /tmp/pydoc-corpus
    python -m minagi.bench quality --data /tmp/pydoc-corpus
"""
from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
import pydoc
import re
import sys
import sysconfig
import warnings
from pathlib import Path

# Modules whose import does something (opens a browser, prints, needs a display) or is a demo.
SKIP = {"antigravity", "this", "idlelib", "turtledemo", "tkinter", "turtle"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    warnings.simplefilter("ignore")
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(m.name for m in pkgutil.iter_modules([stdlib]) if not m.name.startswith("_") and m.name not in SKIP)
    total = 0
    for name in names:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        except Exception:  # a module this platform cannot import: its docs are left out
            continue
        text = re.sub(r"( at 0x|, handle )[0-9a-f]*", "", text)  # addresses differ from run to run
        (out / f"{name}.txt").write_text(text)
        total += len(text.encode())
    print(f"{out}: {len(names)} modules, {total:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
