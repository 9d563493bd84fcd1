"""python train.py routes DIR [--data PATH] [--chunks N] [--json]: how a checkpoint routes.

The seed found its sink by measuring a checkpoint by hand (1,960 of 2,081 characters on one
expert at a typical row); this is that measurement. The checkpoint's model runs a batch of
held-out chunks (the run's own corpus unless --data), and for every row this prints: the active
characters, the busiest slot (and the pool expert on it) with its share of the characters, its
load over the fair share, the slots that got nothing, the load's entropy (1 = uniform), the rows
the rectangle dispatch would multiply against those the grouped path multiplies, and the groups.
The last line sums it up; --json prints all of it as one JSON document instead.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .data import fixed_chunks, run_corpus


def measure(run_dir, data: str | None = None, chunks: int = 16, device: str = "cpu", binary: bool = False) -> dict:
    from .writer import load_model

    if chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {chunks}")
    model, cfg = load_model(run_dir, device)
    model.cfg.bucket_rows = False  # the grouped rows then count the same characters as the rectangle's
    cfg.data.binary = cfg.data.binary or binary
    corpus = run_corpus(cfg.data, data)
    x, _ = fixed_chunks(corpus.heldout, cfg.data.context, chunks, cfg.train.seed + 1)
    with torch.no_grad():
        out = model(x.to(device))
    admitted = model.pool.last_admitted.cpu().tolist()
    rows = []
    for r, st in enumerate(out.dispatch):
        busiest = max(range(len(st.slot_load)), key=st.slot_load.__getitem__)
        rows.append({
            "row": r, "active": st.n_chars, "busiest_slot": busiest, "busiest_expert": admitted[busiest],
            "sink_share": st.sink_share, "load_ratio": st.max_load_ratio, "dead_slots": st.dead_slots,
            "load_entropy": st.load_entropy, "rectangle_rows": st.rectangle_rows, "grouped_rows": st.executed_rows,
            "routed_pairs": st.routed_pairs, "groups": st.groups, "slot_load": st.slot_load,
        })
    rect, grouped = sum(r["rectangle_rows"] for r in rows), sum(r["grouped_rows"] for r in rows)
    return {
        "run": str(run_dir), "source": corpus.source, "chunks": chunks, "context": cfg.data.context,
        "n_slots": cfg.model.n_slots, "top_k": cfg.model.top_k, "balance": cfg.model.balance,
        "fair_share": cfg.model.top_k / cfg.model.n_slots, "rows": rows,
        "rectangle_rows": rect, "grouped_rows": grouped,
        "dead_slots_all_rows": sum(1 for c in map(sum, zip(*(r["slot_load"] for r in rows))) if c == 0) if rows else 0,
    }


def format_text(m: dict) -> str:
    head = (f"{m['run']}: {m['chunks']} held-out chunks of {m['context']} bytes ({m['source']}); "
            f"{m['n_slots']} slots, top_k {m['top_k']}, balance {m['balance']}; fair share {m['fair_share']:.3f}")
    cols = f"{'row':>3} {'active':>7} {'busiest':>8} {'expert':>6} {'share':>6} {'load/fair':>9} {'dead':>5} " \
           f"{'entropy':>7} {'rectangle':>10} {'grouped':>8} {'groups':>6}"
    lines = [head, cols]
    for r in m["rows"]:
        lines.append(f"{r['row']:>3} {r['active']:>7,} {r['busiest_slot']:>8} {r['busiest_expert']:>6} "
                     f"{r['sink_share']:>6.3f} {r['load_ratio']:>9.2f} {r['dead_slots']:>5} {r['load_entropy']:>7.3f} "
                     f"{r['rectangle_rows']:>10,} {r['grouped_rows']:>8,} {r['groups']:>6}")
    first = m["rows"][0]
    ratio = m["rectangle_rows"] / m["grouped_rows"] if m["grouped_rows"] else 0.0
    lines.append(f"summary: at the first row expert {first['busiest_expert']} takes {first['sink_share']:.1%} of the "
                 f"characters (fair share {m['fair_share']:.1%}, {first['load_ratio']:.2f}x), "
                 f"{first['dead_slots']} slots get none ({m['dead_slots_all_rows']} over every row); "
                 f"the rectangle would multiply {m['rectangle_rows']:,} rows, grouped {m['grouped_rows']:,} "
                 f"({ratio:.2f}x fewer)")
    return "\n".join(lines)


def main(argv) -> int:
    from .prog import PROG, HelpFormatter

    p = argparse.ArgumentParser(prog=f"{PROG['sub']} routes", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("run", metavar="DIR", help="run folder (or checkpoint file)")
    p.add_argument("--data", default=None, help="held-out text from this corpus (default: the run's own)")
    p.add_argument("--data-binary", action="store_true", help="read files that are not text too")
    p.add_argument("--chunks", type=int, default=16, help="held-out chunks in the batch (default 16)")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda or cuda:N")
    a = p.parse_args(argv)
    m = measure(a.run, a.data, a.chunks, a.device, a.data_binary)
    print(json.dumps(m) if a.json else format_text(m))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
