"""Does a fused CPU op pay? minagi on bench hf's blocks with it and without, beside the even-load
floor; interleaved rounds in one process, the median kept; and each one's peak memory (bench hf's
count). Two switches:

- backward: minagi::scatter_mm_backward, the second layer's backward (tile_bytes("fused"), 1 MiB,
  the default, against 0: the unfused ops), timed forward+backward;
- forward: minagi::gather_mm_act, inference's first layer in tiles (tile_bytes("gather"), 2 MiB,
  the default, against 0: bucketed_gather and grouped_mm_act), timed forward without gradients.

    [MINAGI_ALLOCATOR=keep] python tools/fused_ab.py backward|forward BLOCKS TOKENS ROUNDS
    e.g. MINAGI_ALLOCATOR=keep python tools/fused_ab.py backward deepseek_v3,qwen3_moe 2048 4

Nothing else may run beside it.
"""
import statistics
import sys

import torch

from minagi import allocator, hf
from minagi.bench import hf as bench

# Each fused CPU kernel's tile size (torch.ops.minagi.tile_bytes); 0 sends it down its unfused path.
SWITCHES = {"backward": ("fused", True), "forward": ("gather", False)}


def main(switch: str, blocks: list[str], T: int, rounds: int) -> None:
    knob, train = SWITCHES[switch]
    on = torch.ops.minagi.tile_bytes(knob)
    call = "fwd+bwd" if train else "fwd"
    for name in blocks:
        experts, cfg = bench._block(name, torch.float32)
        args = bench._routing(T, experts.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, torch.float32)
        res = {"fused": [], "unfused": [], "floor": []}
        for r in range(rounds + 1):  # round 0 warms up
            order = ["fused", "unfused", "floor"] if r % 2 == 0 else ["floor", "unfused", "fused"]
            for mode in order:
                torch.ops.minagi.tile_bytes(knob, on if mode == "fused" else 0)
                ms = bench._timed(experts, bench.FLOOR if mode == "floor" else "minagi", args, train)
                if r:
                    res[mode].append(ms)
        med = {k: statistics.median(v) for k, v in res.items()}
        peaks = {}
        for mode in ("fused", "unfused"):
            torch.ops.minagi.tile_bytes(knob, on if mode == "fused" else 0)
            peaks[mode] = bench._peak_bytes(experts, "minagi", args, train) / 2**20
        torch.ops.minagi.tile_bytes(knob, on)
        print(f"{name} T={T} {call} ms: fused {med['fused']:.1f}  unfused {med['unfused']:.1f}  floor "
              f"{med['floor']:.1f}  | fused/floor {med['fused'] / med['floor']:.2f}  unfused/floor "
              f"{med['unfused'] / med['floor']:.2f}  fused/unfused {med['fused'] / med['unfused']:.3f}  | peak MiB "
              f"fused {peaks['fused']:.0f} unfused {peaks['unfused']:.0f}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] not in SWITCHES:
        sys.exit(__doc__)
    allocator.ensure()
    hf.register()
    torch.set_num_threads(2)
    print(allocator.describe(), flush=True)
    main(sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4]))
