"""What does each expert form's activation cost inside the CPU's fused first layer? One thread,
grouped_mm_act over E rows in S slots with a tiny inner size (so the GEMM is nearly free), minus
grouped_mm's time on the same operands: ns per activation output, per form and dtype, forward,
and the backward (expert_act_backward) alone.

    MINAGI_ALLOCATOR=keep python tools/activation_probe.py [--rows 8192] [--width 1024]

Needs the compiled extension. Nothing else may run beside it.
"""
import argparse

from bf16_gemm_probe import median_ms  # tools/ is sys.path[0] when run as a script


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--width", type=int, default=1024, help="h's width (a gated form's output is half of it)")
    p.add_argument("--slots", type=int, default=32)
    a = p.parse_args(argv)
    if a.rows % a.slots or a.width % 2:
        p.error("--rows must be a multiple of --slots and --width even")

    import torch

    from minagi import _backend, allocator

    allocator.ensure()
    if not _backend.has_kernel("grouped_mm_act", "cpu"):
        p.error("the compiled extension is not loaded (pip install --no-build-isolation -e .)")
    ops = torch.ops.minagi
    torch.set_num_threads(1)
    ids, rows = torch.arange(a.slots), torch.full((a.slots,), a.rows // a.slots)
    for dt in (torch.float32, torch.bfloat16):
        x, b = torch.randn(a.rows, 8).to(dt), torch.randn(a.slots, 8, a.width).to(dt)
        base = median_ms(lambda: ops.grouped_mm(x, b, ids, rows))
        for act in ("gelu", "swiglu", "swiglu_interleaved", "swiglu_oai"):
            out_w = a.width // 2 if act.startswith("swiglu") else a.width
            fwd = median_ms(lambda: ops.grouped_mm_act(x, b, None, ids, rows, act, 1.702, 7.0)) - base
            h = ops.grouped_mm_act(x, b, None, ids, rows, act, 1.702, 7.0)[0]
            grad = torch.randn(a.rows, out_w).to(dt)
            bwd = median_ms(lambda: ops.expert_act_backward(grad, h, ids, rows, act, 1.702, 7.0, a.slots, False))
            n = a.rows * out_w
            print(f"{str(dt)[6:]:9s} {act:19s} forward {fwd * 1e6 / n:5.2f} ns an output, "
                  f"backward {bwd * 1e6 / n:5.2f} ns", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
