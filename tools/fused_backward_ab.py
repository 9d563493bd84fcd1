"""Does the fused second-layer backward (minagi::scatter_mm_backward) pay? minagi's forward+backward on
bench hf's blocks with it (minagi.dispatch.FUSED_TILE_BYTES 1 MiB, the default) and without (0: the
unfused ops), beside the even-load floor; interleaved rounds in one process, the median kept; and
each one's peak memory (bench hf's count).

    [MINAGI_ALLOCATOR=keep] python tools/fused_backward_ab.py BLOCKS TOKENS ROUNDS
    e.g. MINAGI_ALLOCATOR=keep python tools/fused_backward_ab.py deepseek_v3,qwen3_moe 2048 4

Nothing else may run beside it.
"""
import statistics
import sys

import torch

from minagi import allocator, dispatch, hf
from minagi.bench import hf as bench

allocator.ensure()
hf.register()
torch.set_num_threads(2)
blocks, T, rounds = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
print(allocator.describe(), flush=True)
for name in blocks:
    experts, cfg = bench._block(name, torch.float32)
    args = bench._routing(T, experts.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, torch.float32)
    res = {"fused": [], "unfused": [], "floor": []}
    for r in range(rounds + 1):
        order = ["fused", "unfused", "floor"] if r % 2 == 0 else ["floor", "unfused", "fused"]
        for mode in order:
            if mode == "floor":
                ms = bench._timed(experts, bench.FLOOR, args, True)
            else:
                dispatch.FUSED_TILE_BYTES = (1 << 20) if mode == "fused" else 0
                ms = bench._timed(experts, "minagi", args, True)
            if r:
                res[mode].append(ms)
    med = {k: statistics.median(v) for k, v in res.items()}
    peaks = {}
    for mode in ("fused", "unfused"):
        dispatch.FUSED_TILE_BYTES = (1 << 20) if mode == "fused" else 0
        peaks[mode] = bench._peak_bytes(experts, "minagi", args) / 2**20
    print(f"{name} T={T} fwd+bwd ms: fused {med['fused']:.1f}  unfused {med['unfused']:.1f}  floor {med['floor']:.1f}"
          f"  | fused/floor {med['fused'] / med['floor']:.2f}  unfused/floor {med['unfused'] / med['floor']:.2f}"
          f"  fused/unfused {med['fused'] / med['unfused']:.3f}  | peak MiB fused {peaks['fused']:.0f}"
          f" unfused {peaks['unfused']:.0f}", flush=True)
