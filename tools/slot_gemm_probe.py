"""How fast is grouped_mm at a given number of rows a slot? GFLOP/s of minagi's grouped_mm over
4,096 // --rows slots of --rows rows each, the weights [slots, K, M] as stored (--layout r, row
after row: how GPT-OSS-like experts come in, and every backward's input gradient) or as the .mT
view of [slots, M, K] (--layout t: the nn.Linear-style forward), from memory (each slot its own
weights) or cycling over --weights slots' worth (which then stay in cache), with the median of
--calls calls. On a CPU with AVX-512 the slots run on minagi's own kernels (csrc/cpu/f32_gemm.h,
bf16_gemm.h), so this isolates them from routing, gathers and activations: the training rows of
bench hf are made of such calls at 32-256 rows a slot.

    python tools/slot_gemm_probe.py [--rows 64] [--layout r] [--dtype bfloat16] [--km 512,1024]
                                    [--threads 2] [--weights 0] [--calls 30]

Prints one line: rows, layout, dtype, K, M, weights, threads, ms per call and GFLOP/s. To compare
two builds, run each in its own process, alternating (copy each build's _C*.so into minagi/).
Nothing else may run beside it.
"""
import argparse


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="rows a slot (4,096 // rows slots of them)")
    p.add_argument("--layout", default="r", choices=("r", "t"), help="r: [S, K, M] as stored; t: .mT of [S, M, K]")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--km", default="512,1024", help="K,M: the inner size and the output width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weights", type=int, default=0, help="distinct slots' weights cycled over (0: one a slot)")
    p.add_argument("--calls", type=int, default=30)
    a = p.parse_args(argv)
    try:
        K, M = (int(v) for v in a.km.split(","))
    except ValueError:
        p.error(f"--km takes two integers, K,M (got {a.km!r})")
    if not 1 <= a.rows <= 4096 or K < 1 or M < 1 or a.threads < 1 or a.weights < 0 or a.calls < 1:
        p.error("--rows must be in [1, 4096]; K, M, --threads and --calls >= 1; --weights >= 0")
    S = 4096 // a.rows
    if a.weights > S:
        p.error(f"--weights {a.weights} is more than the {S} slots of {a.rows} rows: give at most {S} (or 0)")

    import torch

    from bf16_gemm_probe import median_ms  # tools/ is sys.path[0] when run as a script

    from minagi import ops

    try:
        grouped_mm = ops.compiled().grouped_mm
    except RuntimeError as e:
        p.error(f"this probe times minagi's compiled grouped_mm: {e} (build it: pip install "
                "--no-build-isolation -e . from the project root)")
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    W = a.weights or S
    a_EK = torch.randn(S * a.rows, K, dtype=dtype)
    ids = torch.arange(S) % W
    rows = torch.full((S,), a.rows)
    b = torch.randn(W, K, M, dtype=dtype) if a.layout == "r" else torch.randn(W, M, K, dtype=dtype).mT

    def call():
        grouped_mm(a_EK, b, ids, rows)

    for _ in range(2):  # and median_ms's own: the allocator settles on the output's size
        call()
    ms = median_ms(call, a.calls)
    gflops = 2 * S * a.rows * K * M / ms / 1e6
    print(f"rows {a.rows} layout {a.layout} {a.dtype} K {K} M {M} weights {W} threads {a.threads}: "
          f"{ms:.2f} ms, {gflops:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
