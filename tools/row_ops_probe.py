"""The CPU kernels' row passes beside the GEMMs around them, at bench hf's Qwen3-like shapes (2,048
tokens, 128 experts, top 8, H 512, I 192; random routing), in float32 and bfloat16, one thread:
scatter_mm_backward with and without its weight gradient, the two GEMMs it fuses timed alone
(grad_y's rows times the weights, and the weight gradient), and the gather, scatter and gate
gradient ops. Where a fused op costs more than its GEMMs alone, the difference is its row loops.

    MINAGI_ALLOCATOR=keep python tools/row_ops_probe.py [--threads 1] [--tokens 2048]

--tokens 256 keeps every operand in the cache: the row loops' own speed, not memory's.

Prints ms per call (median of 5, after a warm-up call). Nothing else may run beside it.
"""
import argparse

import torch
from bf16_gemm_probe import median_ms  # tools/ is sys.path[0] when run as a script

S, K, I, D = 128, 8, 192, 512  # experts, top-k, expert width, hidden


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    import minagi.ops  # noqa: F401  (registers torch.ops.minagi)

    ops = torch.ops.minagi
    if not hasattr(ops, "scatter_mm_backward"):
        raise SystemExit("row_ops_probe: minagi's extension is not loaded (python -m minagi doctor says why)")
    torch.set_num_threads(args.threads)
    N = args.tokens
    g = torch.Generator().manual_seed(0)
    slot_idx = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(N)])
    _, order, rows, row_pair, dest = ops.group_plan(slot_idx, S, 0, False)
    P = row_pair.shape[0]
    print(f"{N} tokens, {S} experts, top {K}, I {I}, D {D}: {P} rows, {args.threads} thread(s); ms per call")
    for dt in (torch.float32, torch.bfloat16):
        rand = lambda *shape: torch.randn(*shape, generator=g).to(dt)  # noqa: E731
        gy, a, w, tile, x = rand(N, D), rand(P, I), rand(S, D, I), rand(P, D), rand(N, D)
        gates = torch.rand(N, K, generator=g).to(dt)
        b = w.mT  # [S, I, D]: the down projection as transformers stores it ([E, out, in]), read through .mT
        t = {
            "scatter_mm_backward": median_ms(lambda: ops.scatter_mm_backward(gy, a, b, gates, order, rows, row_pair,
                                                                            dest, 2)),
            "  without grad_b": median_ms(lambda: ops.scatter_mm_backward(gy, a, b, gates, order, rows, row_pair,
                                                                         dest, 0)),
            "grad_a's GEMM alone": median_ms(lambda: ops.grouped_mm(tile, w, order, rows)),
            "grad_b's GEMM alone": median_ms(lambda: ops.grouped_mm_wgrad(tile, a, order, rows, S)),
            "weighted_scatter": median_ms(lambda: ops.weighted_scatter(tile, dest, row_pair, gates)),
            "bucketed_gather": median_ms(lambda: ops.bucketed_gather(x, row_pair, dest, None)),
            "  gated": median_ms(lambda: ops.bucketed_gather(x, row_pair, dest, gates)),
            "gate_grad": median_ms(lambda: ops.gate_grad(x, tile, dest, row_pair)),
        }
        print(f"{str(dt)[6:]}: " + ", ".join(f"{k.strip()} {v:.2f}" for k, v in t.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
