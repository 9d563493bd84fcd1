"""Does MINAGI_ALLOCATOR=keep (minagi's cache of large blocks) hold resident memory flat over many
training steps of a transformers MoE block, and what does it save a step? Each allocator runs in
a fresh process: STEPS fwd+bwd calls of one block (bench hf's blocks) through one backend, a new
random routing every step (so the loads, and minagi's buffer sizes, change every step), the
gradients set to None every step as zero_grad() does. Resident memory (VmRSS) is read every 10
steps.

    python tools/keep_memory_soak.py [--block deepseek_v3] [--tokens 2048] [--steps 200]
                                     [--backend minagi] [--allocators system,keep]

Per allocator: ms per step (median of the steps after the first 10), resident memory at step 10
and at the end, its slope after step 10 (MB per 100 steps, least squares) and its peak.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def child(a) -> dict:
    import torch

    from minagi import allocator, hf
    from minagi.bench import hf as bench
    from minagi.bench import soak
    from minagi.memory import peak_resident_bytes, resident_bytes

    allocator.ensure()
    hf.register()
    torch.set_num_threads(a.threads)
    experts, cfg = bench._block(a.block, torch.float32)
    E, k = experts.num_experts, cfg.num_experts_per_tok
    times, rss = [], []
    for step in range(a.steps):
        args = bench._routing(a.tokens, E, k, cfg.hidden_size, torch.float32, seed=step)
        experts.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        bench._call(experts, a.backend, *args, True)
        times.append((time.perf_counter() - t0) * 1e3)
        if step % 10 == 0 or step == a.steps - 1:
            rss.append((step, resident_bytes() / 1e6))
    xs, ys = [s for s, _ in rss if s >= 10], [m for s, m in rss if s >= 10]
    return {"allocator": allocator.describe(), "ms_per_step": statistics.median(times[10:]),
            "rss_mb_step10": ys[0], "rss_mb_end": ys[-1], "slope_mb_per_100_steps": soak.slope_per_kstep(xs, ys) / 10,
            "peak_rss_mb": peak_resident_bytes() / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block", default="deepseek_v3")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--backend", default="minagi")
    p.add_argument("--allocators", default="system,keep")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.steps < 30:
        p.error("--steps: at least 30 (the first 10 are warm-up)")
    if a.child:
        print(json.dumps(child(a)))
        return
    print(f"{a.block}, {a.tokens} tokens, fwd+bwd through {a.backend}, {a.steps} steps, {a.threads} threads")
    for name in a.allocators.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc as it comes
        r = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], capture_output=True, text=True,
                           env={**env, "MINAGI_ALLOCATOR": name})
        if r.returncode or not r.stdout.strip():
            sys.exit(f"{name}: {r.stderr.strip() or 'no result'}")
        res = json.loads(r.stdout.splitlines()[-1])
        print(f"{res['allocator']:<40} {res['ms_per_step']:8.1f} ms/step   resident {res['rss_mb_step10']:,.0f} -> "
              f"{res['rss_mb_end']:,.0f} MB (slope {res['slope_mb_per_100_steps']:+.1f} MB / 100 steps, "
              f"peak {res['peak_rss_mb']:,.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
