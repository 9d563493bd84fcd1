"""python -m minagi.lm.plot DIR (or python train.py plot DIR): the history file drawn into
DIR/history.png: held-out and train bits per byte, char/s, memory, load ratios, and the
routing's health (first-row sink share and load entropy, dead slots).
matplotlib is an optional extra: python -m pip install "minagi[plot]" (a checkout: -e ".[plot]")."""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


class PlotError(RuntimeError):
    pass


def install_hint() -> str:
    """The command that installs the plot extra into the running Python (its own pip, a venv's)."""
    return f'{shlex.quote(sys.executable)} -m pip install "minagi[plot]"'


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
        raise PlotError(f"plotting needs matplotlib, an optional extra; install it into this Python with: "
                        f"{install_hint()}") from exc
    recs = [json.loads(line) for line in hist_path.read_text().splitlines() if line.strip()]
    if not recs:
        raise PlotError(f"{hist_path} has no records yet")
    step = [r["step"] for r in recs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), constrained_layout=True)
    ax = axes[0, 0]
    ax.plot(step, [r["heldout_bpc"] for r in recs], "o-", label="held-out")
    ax.plot(step, [r.get("train_bpc", r["train_loss"] / 0.6931471805599453) for r in recs], "s--", label="train")
    ax.set(title="bits per byte (heldout_bpc, train_bpc)", xlabel="step")
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
    for key, style, label in (("load_ratio", "o-", "first row: busiest / fair share"),
                              ("max_load_ratio", "^:", "max busiest / fair (calls >= n_slots chars)"),
                              ("executed_ratio", "s--", "executed / routed rows")):
        if all(key in r for r in recs):
            ax.plot(step, [r[key] for r in recs], style, label=label)
    ax.set(title="load", xlabel="step")
    ax.legend()
    ax = axes[0, 2]
    if all("sink_share" in r for r in recs):  # histories from before these fields have none
        ax.plot(step, [r["sink_share"] for r in recs], "o-", label="sink share (first row)")
        ax.plot(step, [r["load_entropy"] for r in recs], "s--", label="load entropy / log(slots)")
        ax.set(ylim=(0, 1.05))
        ax.legend()
        axes[1, 2].plot(step, [r["dead_slots"] for r in recs], "o-")
    ax.set(title="routing health", xlabel="step")
    axes[1, 2].set(title="dead slots (no pair in the window)", xlabel="step")
    fig.suptitle(str(run_dir))
    out = run_dir / "history.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m minagi.lm.plot DIR", file=sys.stderr)
        return 2
    try:
        print(plot_history(argv[0]))
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
