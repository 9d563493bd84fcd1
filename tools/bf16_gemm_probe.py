"""Where does bf16 lose to the floor? One thread, per-expert GEMMs at bench-hf-like shapes, three ways:
one torch.bmm over the experts (the floor's call), ATen's mm once per expert (what minagi's CPU kernels
make: in bfloat16 each goes to oneDNN), with each expert's rows uneven (as routing makes them), and
MKL's cblas_gemm_bf16bf16f32 (exported by torch's x86 libtorch_cpu) once per expert into a float32
tile, then copied to bfloat16, and minagi's grouped_mm over the same uneven rows (its own kernels
where the CPU has them: in bfloat16 with AVX512-BF16, csrc/cpu/bf16_gemm.h; in float32 with
AVX-512, csrc/cpu/f32_gemm.h), with the weights as stored and as the .mT view of [experts, M, K]
(how nn.Linear-style experts come in). float32's bmm, mm and grouped_mm beside them.

    python tools/bf16_gemm_probe.py

Nothing else may run beside it.
"""
import ctypes
import os
import time

import torch

SHAPES = ((128, 64, 512, 384), (256, 32, 512, 256), (64, 128, 512, 512))  # experts, rows each, K, M


def median_ms(fn, n: int = 5) -> float:
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[n // 2] * 1e3


def mkl_bf16():
    """MKL's bf16 GEMM with float32 output, or None where this torch does not export it."""
    try:
        f = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")).cblas_gemm_bf16bf16f32
    except (OSError, AttributeError):
        return None
    i, fl, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    f.argtypes = [i, i, i, i, i, i, fl, p, i, p, i, fl, p, i]
    return f


def main() -> None:
    torch.set_num_threads(1)
    mkl = mkl_bf16()
    try:
        import minagi.ops  # noqa: F401  (registers torch.ops.minagi)
        ops = torch.ops.minagi if hasattr(torch.ops.minagi, "grouped_mm") else None
    except (ImportError, RuntimeError):
        ops = None
    for S, rows, K, M in SHAPES:
        line = [f"{S} experts x {rows} rows, [{K}, {M}]:"]
        for dt in (torch.float32, torch.bfloat16):
            a, b = torch.randn(S, rows, K).to(dt), torch.randn(S, K, M).to(dt)
            out = torch.empty(S, rows, M, dtype=dt)
            uneven = [torch.randn(rows + i % 7 - 3, K).to(dt) for i in range(S)]
            outs = [torch.empty(u.shape[0], M, dtype=dt) for u in uneven]
            bmm = median_ms(lambda: torch.bmm(a, b, out=out))
            mm = median_ms(lambda: [torch.mm(a[i], b[i], out=out[i]) for i in range(S)])
            mm_uneven = median_ms(lambda: [torch.mm(uneven[i], b[i], out=outs[i]) for i in range(S)])
            line.append(f"{str(dt)[6:]} bmm {bmm:.1f} ms, mm per expert {mm:.1f}, uneven rows {mm_uneven:.1f};")
            if ops is not None:
                a_cat, rows_s = torch.cat(uneven), torch.tensor([u.shape[0] for u in uneven])
                ids, b_t = torch.arange(S), b.mT.contiguous().mT  # the same values, each expert [M, K]
                mine = median_ms(lambda: ops.grouped_mm(a_cat, b, ids, rows_s))
                mine_t = median_ms(lambda: ops.grouped_mm(a_cat, b_t, ids, rows_s))
                line.append(f"minagi grouped_mm, uneven rows {mine:.1f} (weights .mT {mine_t:.1f});")
            if dt == torch.bfloat16 and mkl is not None:
                acc = torch.empty(rows, M)

                def per_expert():
                    for i in range(S):
                        mkl(101, 111, 111, rows, M, K, 1.0, a[i].data_ptr(), K, b[i].data_ptr(), M, 0.0,
                            acc.data_ptr(), M)  # row-major, no transposes
                        out[i].copy_(acc)

                line.append(f"MKL bf16->f32 per expert {median_ms(per_expert):.1f}")
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
