"""Where does a backend's time go on one of bench hf's MoE blocks? torch.profiler over CALLS calls
(after WARMUP unprofiled ones), each op's self CPU time, largest first, beside the even-load floor
of the same block and size (bench hf's `floor`: the GEMMs alone, no routing, gather, activation or
sum, nothing allocated).

    python tools/profile_experts.py [--block deepseek_v3] [--tokens 2048] [--backend minagi]
                                    [--forward] [--calls 5] [--top 20] [--scale 1]
    MINAGI_ALLOCATOR=keep python tools/profile_experts.py ...   (minagi's cache of large blocks)

Prints ms per call (unprofiled, median of the calls), the floor's, and the table: self ms per call,
calls per call, share of the profiled time. Nothing else may run beside it (2 cores: any busy
neighbour voids the figures).
"""
import argparse
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", default="deepseek_v3")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--backend", default="minagi", help="minagi, grouped_mm, eager or batched_mm")
    p.add_argument("--forward", action="store_true", help="forward only (default: forward+backward)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0, help="shrink the block's widths (bench hf's --quick: 0.125)")
    a = p.parse_args(argv)
    if a.calls < 1 or a.warmup < 0 or a.tokens < 1 or not 0 < a.scale <= 1:
        p.error("--calls and --tokens must be >= 1, --warmup >= 0, --scale in (0, 1]")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from minagi.lm import allocator

    from minagi import hf
    from minagi.bench import hf as bench

    allocator.ensure()
    hf.register()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.block not in bench.BLOCKS:
        p.error(f"--block {a.block!r}: choose from {', '.join(bench.BLOCKS)}")
    dtype, train = getattr(torch, a.dtype), not a.forward
    experts, cfg = bench._block(a.block, dtype, a.scale)
    args = bench._routing(a.tokens, experts.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, dtype)

    def timed(impl) -> float:
        for _ in range(a.warmup):
            bench._timed(experts, impl, args, train)
        return statistics.median(bench._timed(experts, impl, args, train) for _ in range(a.calls))

    floor_ms, ms = timed(bench.FLOOR), timed(a.backend)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(a.calls):
            experts.zero_grad(set_to_none=True)
            bench._call(experts, a.backend, *args, train)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    mode = "forward" if a.forward else "forward+backward"
    print(f"{a.block}, {a.tokens} tokens, {a.dtype}, {mode}, {torch.get_num_threads()} threads, "
          f"{allocator.describe()}: {a.backend} {ms:.1f} ms per call, floor {floor_ms:.1f} ms "
          f"({ms / floor_ms:.2f}x); profiled {total / 1e3 / a.calls:.1f} ms per call")
    print(f"{'op':<44} {'self ms/call':>12} {'calls/call':>10} {'share':>6}")
    for e in rows[:a.top]:
        print(f"{e.key[:44]:<44} {e.self_cpu_time_total / 1e3 / a.calls:>12.2f} {e.count / a.calls:>10.1f} "
              f"{e.self_cpu_time_total / total:>6.1%}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"({time.perf_counter() - t0:.0f} s)")
    raise SystemExit(rc)
