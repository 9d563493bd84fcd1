"""python -m minagi.plot DIR (or python train.py plot DIR): the history file drawn into
DIR/history.png: held-out and train bits per character, char/s, memory, max load ratio.
matplotlib is an optional extra: pip install matplotlib (or -e ".[plot]")."""
from __future__ import annotations

import json
import sys
from pathlib import Path


class PlotError(RuntimeError):
    pass


def plot_history(run_dir) -> Path:
    run_dir = Path(run_dir)
    hist_path = run_dir / "history.jsonl"
    if not hist_path.exists():
        raise PlotError(f"no history at {hist_path}: train into {run_dir} first")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotError("plotting needs matplotlib, an optional extra: pip install matplotlib") from exc
    recs = [json.loads(line) for line in hist_path.read_text().splitlines() if line.strip()]
    if not recs:
        raise PlotError(f"{hist_path} has no records yet")
    step = [r["step"] for r in recs]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(step, [r["heldout_bpc"] for r in recs], "o-", label="held-out")
    ax.plot(step, [r.get("train_bpc", r["train_loss"] / 0.6931471805599453) for r in recs], "s--", label="train")
    ax.set(title="bits per character", xlabel="step")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(step, [r["char_per_s"] for r in recs], "o-")
    ax.set(title="training char/s", xlabel="step")
    ax = axes[1, 0]
    for key in ("mem_rss", "mem_allocated", "mem_reserved", "mem_peak"):  # CPU: rss, peak; GPUs: the rest
        if all(key in r for r in recs):
            ax.plot(step, [r[key] / 2 ** 30 for r in recs], "o-", label=key[4:])
    ax.set(title="memory (GiB)", xlabel="step")
    ax.legend()
    ax = axes[1, 1]
    ax.plot(step, [r["max_load_ratio"] for r in recs], "o-", label="max load / fair share")
    ax.plot(step, [r["executed_ratio"] for r in recs], "s--", label="executed / routed rows")
    ax.set(title="routing", xlabel="step")
    ax.legend()
    fig.suptitle(str(run_dir))
    out = run_dir / "history.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m minagi.plot DIR", file=sys.stderr)
        return 2
    try:
        print(plot_history(argv[0]))
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
