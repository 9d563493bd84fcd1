"""How fast minagi's grouped_mm streams a slot's weights when each slot has a few rows: the
products of writing (decode), where the weights' bytes are the whole cost. 8 slots of [1,024 x
4,096] weights (64 MiB in bfloat16, 128 in float32: past a 32 MiB L3), 1 to 4 rows each, in both
layouts: "row" is a [K, M] weight read in place, "col" the .mT view of an nn.Linear-style [M, K]
one (how Mixtral's and most transformers experts come in).

    THP_MEM_ALLOC_ENABLE=1 python tools/few_rows_probe.py [--threads N] [--rounds 7] [--slots 8]

--slots 1 (8 MiB in bfloat16, 16 in float32) keeps the weights in the L3 cache between calls: the
kernels' own speed, as in a benchmark that calls one block again and again, not memory's.

Prints GB/s of weights read per call (median over interleaved rounds of 5 calls each), and beside
them torch.sum's over the same weights, a slot at a time: how fast a plain pass reads those bytes.
THP_MEM_ALLOC_ENABLE=1 puts torch's tensors on 2 MiB pages: on this VM, 4 KiB pages made fresh
processes run bimodally. Nothing else may run beside it. Compare builds by running it from each.
"""
import argparse
import statistics
import time

import torch

K, M = 1024, 4096


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None, help="torch's default where not given")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--slots", type=int, default=8, help="slots of [1,024 x 4,096] weights, each read per call")
    args = p.parse_args(argv)
    import minagi.ops  # noqa: F401  (registers torch.ops.minagi)

    if not hasattr(torch.ops.minagi, "grouped_mm"):
        raise SystemExit("few_rows_probe: minagi's extension is not loaded (python -m minagi doctor says why)")
    if args.threads:
        torch.set_num_threads(args.threads)
    S = args.slots
    g = torch.Generator().manual_seed(0)
    cases = []
    for dt in (torch.bfloat16, torch.float32):
        layouts = {"row": torch.randn(S, K, M, generator=g).to(dt), "col": torch.randn(S, M, K, generator=g).to(dt).mT}
        for rows in (1, 2, 3, 4):
            a = torch.randn(S * rows, K, generator=g).to(dt)
            ids, slot_rows = torch.arange(S), torch.full((S,), rows)
            for name, w in layouts.items():
                call = lambda a=a, w=w, r=slot_rows: torch.ops.minagi.grouped_mm(a, w, ids, r)  # noqa: E731
                cases.append((f"{str(dt)[6:]:<9}{name:<4}{rows} rows", w.numel() * w.element_size(), call))
        w = layouts["row"]  # the same bytes read by torch's sum, a slot at a time: the speed of a plain read
        cases.append((f"{str(dt)[6:]:<9}torch.sum", w.numel() * w.element_size(), lambda w=w: [s.sum() for s in w]))
    rates = {name: [] for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, nbytes, call in cases:
            call()
            t = time.perf_counter()
            for _ in range(5):
                call()
            rates[name].append(nbytes * 5 / (time.perf_counter() - t) / 1e9)
    print(f"{S} slots of [{K} x {M}], {torch.get_num_threads()} thread(s): GB/s of weights read, median of "
          f"{args.rounds} rounds")
    for name, _, _ in cases:
        print(f"{name}  {statistics.median(rates[name]):6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
