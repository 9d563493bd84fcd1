"""The GPU kernels (csrc/cuda/*_kernels.cuh) run on the CPU under the project's emulator
(csrc/emu/emulator.h: every thread of a block a std::thread, __syncthreads a std::barrier), built
with the system's g++ by tests/emu/run_kernels.cpp, and checked against the CPU kernels (the
pure-torch twins where minagi._C is not loaded): bit-exact for indices, loads and plans, within
the dtype's tolerance for float outputs. Then once more under ThreadSanitizer on smaller sizes,
where any report fails. Skips, saying why, where no C++20 compiler is found."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from minagi.moe import ops

from conftest import EXT

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "emu" / "run_kernels.cpp"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-std=c++20", "-pthread", "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Werror"]
TSAN_FLAGS = ["-fsanitize=thread", "-O1", "-g"]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DTYPE_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
               torch.bfloat16: "bfloat16", torch.int64: "int64"}
HALVES = (torch.float16, torch.bfloat16)


class _Twins:
    """The twins where minagi._C is not loaded, evaluated in the kernels' op-math (float32 for
    float16 / bfloat16 inputs) and rounded to the dtype once, as the kernels round."""

    def __getattr__(self, name):
        fn = getattr(ops.REFERENCE, name)

        def call(*args):
            half = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype in HALVES), None)
            if half is None:
                return fn(*args)
            out = fn(*[a.float() if isinstance(a, torch.Tensor) and a.dtype == half else a for a in args])
            down = lambda t: t.to(half) if t.is_floating_point() else t  # noqa: E731
            return tuple(map(down, out)) if isinstance(out, tuple) else down(out)

        return call


# The oracle: the CPU kernels, or the twins where the extension is not loaded.
CPU = ops.compiled() if EXT else _Twins()


def _cxx20_skip_reason() -> str:
    """Why the emulator cannot be built here ('' when it can)."""
    if shutil.which(CXX) is None:
        return f"no C++ compiler: {CXX} not on PATH (set CXX)"
    probe = "#include <atomic>\n#include <barrier>\nint main() { int v = 0; std::atomic_ref<int>(v)++; " \
            "std::barrier<> b(1); b.arrive_and_wait(); return v - 1; }\n"
    try:
        run = subprocess.run([CXX, "-std=c++20", "-pthread", "-x", "c++", "-", "-o", os.devnull],
                             input=probe, text=True, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{CXX} did not run: {exc}"
    if run.returncode != 0:
        return f"{CXX} has no C++20 <barrier> / std::atomic_ref: {run.stderr.strip().splitlines()[:1]}"
    return ""


SKIP = _cxx20_skip_reason()
# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(SKIP), reason=f"GPU emulator: {SKIP}")]


@dataclasses.dataclass
class Case:
    name: str
    kernel: str
    params: dict
    inputs: dict
    want: dict            # output name -> expected tensor (its dtype and shape are the file's)
    exact: tuple = ()     # outputs that must match bit for bit
    tol: tuple | None = None  # (rtol, atol) for the other outputs; None = torch's for the dtype

    def write(self, root: Path) -> Path:
        d = root / self.name
        d.mkdir(parents=True)
        (d / "case.txt").write_text("".join(f"{k} {v}\n" for k, v in {"kernel": self.kernel, **self.params}.items()))
        for name, t in self.inputs.items():
            (d / f"{name}.bin").write_bytes(_bytes(t))
        return d

    def check(self, d: Path) -> list[str]:
        errors = []
        for name, want in self.want.items():
            path = d / f"got_{name}.bin"
            if not path.exists():
                errors.append(f"{self.name}: no output {name}")
                continue
            got = _tensor(path.read_bytes(), want.dtype).reshape(want.shape)
            try:
                if name in self.exact:
                    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
                elif self.tol is None:
                    torch.testing.assert_close(got, want, equal_nan=True)
                else:
                    torch.testing.assert_close(got, want, rtol=self.tol[0], atol=self.tol[1], equal_nan=True)
            except AssertionError as exc:
                errors.append(f"{self.name}: {name}: {exc}")
        return errors


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)


def _params(dtype=None, **sizes) -> dict:
    return ({"dtype": DTYPE_NAMES[dtype]} if dtype is not None else {}) | {k: int(v) for k, v in sizes.items()}


# ---- The cases. "full" runs plainly; "small" is the ThreadSanitizer run's subset.

def _dtypes(size: str, shapes: list, second=torch.bfloat16) -> list:
    """(dtype, shapes) pairs: every dtype with every shape, or (small) float32 with every shape
    and one half-width dtype with the first."""
    if size == "full":
        return [(dtype, shapes) for dtype in FLOATS]
    return [(torch.float32, shapes), (second, shapes[:1])]


def _routing_logits(kind: str, N: int, S: int, g: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # integers: many equal logits, across the threads of a block
        return (torch.randn(N, S, generator=g) * 2).round()
    x = torch.randn(N, S, generator=g)
    if kind == "nan" and N >= 4:
        x[0] = float("nan")                    # every logit NaN: slots 0..k-1, NaN gates
        x[1, ::2] = float("nan")               # NaN ranked as -inf
        x[2] = float("-inf")                   # all -inf: slots 0..k-1, NaN gates
        x[3, 1] = float("inf")
    return x


def routing_cases(size: str) -> list[Case]:
    g = torch.Generator().manual_seed(1)
    shapes = [  # (tag, N, S, k, logits, grid cap)
        ("ties_grid_stride", 6, 7, 3, "ties", 4),
        ("one", 1, 1, 1, "randn", None),
        ("nan_inf", 4, 9, 4, "nan", None),
        ("empty", 0, 5, 2, "randn", None),
        ("slot_limit", 1 if size == "small" else 2, 2048, 8, "ties", None),
    ]
    if size == "full":
        shapes += [
            ("ties_k8_grid_stride", 40, 64, 8, "ties", 16),
            # the shape that crashed on an H200 (70,000 x 512, top 8, many ties), shrunk, with
            # the grid shrunk in proportion so each block takes several rows as there
            ("ties_512_top8", 24, 512, 8, "ties", 5),
            ("all_slots", 5, 33, 33, "ties", None),
        ]
    cases = []
    for dtype, dtype_shapes in _dtypes(size, shapes):
        for tag, N, S, k, kind, cap in dtype_shapes:
            logits = _routing_logits(kind, N, S, g).to(dtype)
            idx, gates, load = CPU.routing(logits, k)
            params = _params(dtype, N=N, S=S, k=k) | ({"max_blocks": cap} if cap else {})
            cases.append(Case(f"routing_{tag}_{DTYPE_NAMES[dtype]}", "routing", params, {"logits": logits},
                              {"slot_idx": idx, "gates": gates, "load": load}, exact=("slot_idx", "load")))
    return cases


def routing_backward_cases(size: str) -> list[Case]:
    g = torch.Generator().manual_seed(2)
    shapes = [("one", 1, 1, 1, None), ("grid_stride", 300 if size == "full" else 70, 16, 4, 1), ("empty", 0, 4, 2, None)]
    cases = []
    for dtype, dtype_shapes in _dtypes(size, shapes):
        for tag, N, S, k, cap in dtype_shapes:
            idx, gates, _ = CPU.routing(torch.randn(N, S, generator=g).to(dtype), k)
            grad = torch.randn(N, k, generator=g).to(dtype)
            params = _params(dtype, N=N, S=S, k=k) | ({"max_blocks": cap} if cap else {})
            cases.append(Case(f"routing_backward_{tag}_{DTYPE_NAMES[dtype]}", "routing_backward", params,
                              {"grad_gates": grad, "gates": gates, "slot_idx": idx},
                              {"out": CPU.routing_backward(grad, gates, idx, S)}))
    return cases


def _slot_idx(kind: str, N: int, S: int, k: int, g: torch.Generator) -> torch.Tensor:
    idx = torch.rand(N, S, generator=g).topk(k, dim=1).indices
    if kind == "sink":  # every character takes slot 5 (the rest spread): one slot past 128 rows
        has5 = idx.eq(5).any(1)
        idx[:, 0] = torch.where(has5, idx[:, 0], torch.full_like(idx[:, 0], 5))
    return idx


PLAN_OUTPUTS = ("load", "slot_order", "slot_rows", "row_pair", "dest")


def group_plan_cases(size: str) -> list[Case]:
    g = torch.Generator().manual_seed(3)
    shapes = [  # (tag, N, S, k, kind)
        ("one", 1, 1, 1, "uniform"),
        ("small", 50, 10, 3, "uniform"),
        ("chunks_sink", 700 if size == "full" else 300, 37, 2, "sink"),
        ("slot_limit", 300 if size == "full" else 80, 2048, 4, "uniform"),
        ("empty", 0, 6, 2, "uniform"),
    ]
    caps = [(0, True), (0, False), (7, True), (3, False)] if size == "full" else [(0, True), (7, False)]
    cases = []
    for tag, N, S, k, kind in shapes:
        idx = _slot_idx(kind, N, S, k, g) if N else torch.empty(0, k, dtype=torch.long)
        # One plan at the slot limit under the sanitizer: its plan kernel is S^2 instrumented reads.
        for cap, bucketed in caps[:1] if size == "small" and S == 2048 else caps:
            want = dict(zip(PLAN_OUTPUTS, CPU.group_plan(idx, S, cap, bucketed)))
            cases.append(Case(f"group_plan_{tag}_cap{cap}_{'bucketed' if bucketed else 'exact'}", "group_plan",
                              _params(N=N, S=S, k=k, capacity=cap, bucketed=bucketed), {"slot_idx": idx}, want,
                              exact=PLAN_OUTPUTS))
    # Ids of experts held elsewhere, skipped (expert parallelism's sentinels): dropped pairs.
    idx = _slot_idx("uniform", 40, 8, 2, g)
    idx[::3, 1] = torch.tensor([8, -1, 100])[torch.arange(0, 40, 3) % 3]
    for cap, bucketed in caps[:2]:
        want = dict(zip(PLAN_OUTPUTS, CPU.group_plan(idx, 8, cap, bucketed, True)))
        cases.append(Case(f"group_plan_skip_invalid_cap{cap}_{'bucketed' if bucketed else 'exact'}", "group_plan",
                          _params(N=40, S=8, k=2, capacity=cap, bucketed=bucketed, skip_invalid=1), {"slot_idx": idx},
                          want, exact=PLAN_OUTPUTS))
    return cases


def _plans(size: str, g: torch.Generator):
    """(tag, N, D, k, row_pair, dest, grid cap): plans with dropped pairs, padding, and N = 0."""
    shapes = [("dropped_padded", 9, 5, 2, 4, 3, None), ("grid_stride", 64 if size == "full" else 24, 24, 2, 8, 0, 2),
              ("one", 1, 1, 1, 1, 0, None), ("empty", 0, 3, 2, 4, 0, None)]
    for tag, N, D, k, S, cap, grid in shapes:
        idx = _slot_idx("uniform", N, S, k, g) if N else torch.empty(0, k, dtype=torch.long)
        _, _, _, row_pair, dest = CPU.group_plan(idx, S, cap, True)
        yield tag, N, D, k, row_pair, dest, grid


def map_cases(size: str) -> list[Case]:
    """bucketed_gather, weighted_scatter and gate_grad on the same plans, with gates and without."""
    g = torch.Generator().manual_seed(4)
    cases = []
    plans = list(_plans(size, g))
    for dtype, dtype_plans in _dtypes(size, plans, second=torch.float16):
        for tag, N, D, k, row_pair, dest, grid in dtype_plans:
            E, cap = row_pair.shape[0], ({"max_blocks": grid} if grid else {})
            x = torch.randn(N, D, generator=g).to(dtype)
            gates = torch.rand(N, k, generator=g).to(dtype)
            rows = torch.randn(E, D, generator=g).to(dtype)
            suffix = f"{tag}_{DTYPE_NAMES[dtype]}"
            for gated in (True, False):
                params = _params(dtype, N=N, D=D, k=k, E=E, gates=gated) | cap
                extra = {"gates": gates} if gated else {}
                g_arg = gates if gated else None
                cases.append(Case(f"gather_{suffix}_{'gated' if gated else 'plain'}", "gather", params,
                                  {"x": x, "row_pair": row_pair, **extra},
                                  {"out": CPU.bucketed_gather(x, row_pair, dest, g_arg)}, exact=("out",)))
                cases.append(Case(f"scatter_{suffix}_{'gated' if gated else 'plain'}", "scatter", params,
                                  {"rows": rows, "dest": dest, **extra},
                                  {"out": CPU.weighted_scatter(rows, dest, row_pair, g_arg)}))
            cases.append(Case(f"gate_grad_{suffix}", "gate_grad", _params(dtype, N=N, D=D, k=k, E=E) | cap,
                              {"a": x, "rows": rows, "dest": dest}, {"out": CPU.gate_grad(x, rows, dest, row_pair)},
                              tol=_sum_tol(dtype, D)))
    # gate_grad's strided partial dots (D past the block) and its block-per-pair grid-stride loop
    for dtype in [torch.float32, torch.float64] if size == "full" else [torch.float32]:
        N, D, k = (40, 300, 2) if size == "full" else (12, 300, 2)
        idx = _slot_idx("uniform", N, 6, k, g)
        _, _, _, row_pair, dest = CPU.group_plan(idx, 6, 0, False)
        a, rows = torch.randn(N, D, generator=g).to(dtype), torch.randn(row_pair.shape[0], D, generator=g).to(dtype)
        cases.append(Case(f"gate_grad_wide_grid_stride_{DTYPE_NAMES[dtype]}", "gate_grad",
                          _params(dtype, N=N, D=D, k=k, E=row_pair.shape[0], max_blocks=3),
                          {"a": a, "rows": rows, "dest": dest}, {"out": CPU.gate_grad(a, rows, dest, row_pair)},
                          tol=_sum_tol(dtype, D)))
    return cases


def _sum_tol(dtype: torch.dtype, terms: int):
    """A sum of `terms` products in another order: the dtype's rounding, grown with the terms."""
    rtol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    return rtol, rtol * terms ** 0.5


def _weights(S: int, K: int, M: int, transposed: bool, dtype, g):
    """b [S, K, M] and the tensor that stores it: itself, or (transposed) a [S, M, K] it is the .mT view of."""
    store = torch.randn(*((S, M, K) if transposed else (S, K, M)), generator=g).to(dtype)
    return store, store.transpose(1, 2) if transposed else store


def _owned(slot_ids, slot_rows):
    """The listed slots that own rows (a slot with none adds nothing, and the twin's view of it fails)."""
    owns = slot_rows > 0
    return slot_ids[owns], slot_rows[owns]


# (mode, tag, S, K, M, slot_ids, slot_rows, extra tail rows, grid cap): the decode kernel (rows past
# kSmallRows per slot, M past one 256-column block), the tiled kernel (a slot past one 64-row tile,
# K not a multiple of the 16-deep step, M past one 64-column tile) and the native path's fix-up
# (slots 1 and 2 swapped, 0 and 3 in place: torch._grouped_mm's part is done on the host).
GEMM_SHAPES = [
    ("small", "row_major", 12, 96, 300, [7, 2, 11, 0, 5], [1, 4, 2, 3, 0], 0, None),
    ("small", "transposed", 12, 96, 300, [3, 9], [4, 1], 0, None),
    ("small", "many_rows_tail", 12, 40, 70, [4, 6], [6, 1], 2, 1),
    ("small", "no_rows_tail", 12, 16, 20, [4], [0], 2, None),
    ("tiled", "row_major", 5, 40, 100, [3, 0, 4, 1], [70, 0, 1, 64], 5, None),
    ("tiled", "transposed", 5, 40, 100, [3, 0, 4, 1], [70, 0, 1, 64], 5, 3),
    ("native", "row_major", 4, 24, 72, [0, 2, 1, 3], [5, 66, 0, 3], 2, None),
    ("native", "transposed", 4, 24, 72, [0, 2, 1, 3], [5, 66, 0, 3], 2, 2),
]


def grouped_gemm_cases(size: str) -> list[Case]:
    """grouped_mm's kernels: the ranges' offsets, then the decode, tiled or native path's kernel,
    reading b in both layouts, with rows past the ranges (zeros) and grid-stride loops."""
    g = torch.Generator().manual_seed(5)
    shapes = GEMM_SHAPES if size == "full" else [s for s in GEMM_SHAPES if s[1] != "row_major"]
    cases = []
    for dtype, dtype_shapes in _dtypes(size, shapes):
        for mode, tag, S, K, M, ids, nrows, tail, grid in dtype_shapes:
            if size == "small":
                K = min(K, 24)
            store, b = _weights(S, K, M, tag == "transposed", dtype, g)
            slot_ids, slot_rows = torch.tensor(ids), torch.tensor(nrows)
            E = int(slot_rows.sum()) + tail
            a = torch.randn(E, K, generator=g).to(dtype)
            s0, s1, s2 = b.stride()
            params = _params(dtype, A=len(ids), E=E, K=K, M=M, S=S, b_s0=s0, b_s1=s1, b_s2=s2)
            params |= {"mode": mode} | ({"max_blocks": grid} if grid else {})
            ends = torch.cumsum(slot_rows, 0)
            want = {"out": CPU.grouped_mm(a, b, *_owned(slot_ids, slot_rows)), "row_end": ends,
                    "offs32": ends.int()}
            cases.append(Case(f"grouped_mm_{mode}_{tag}_{DTYPE_NAMES[dtype]}", "grouped_mm", params,
                              {"a": a, "b": store, "slot_ids": slot_ids, "slot_rows": slot_rows}, want,
                              exact=("row_end", "offs32"), tol=_sum_tol(dtype, K)))
    return cases


def wgrad_cases(size: str) -> list[Case]:
    """grouped_mm_wgrad's kernel: each listed slot's a^T grad over its rows (a slot with no rows
    gets zeros, slots not listed keep theirs), K and M past one tile, the slots' grid-stride loop."""
    g = torch.Generator().manual_seed(6)
    S, K, M = 5, 70 if size == "full" else 20, 65
    shapes = [("three", [3, 0, 4], [70, 0, 9], 2, None), ("grid_stride", [1, 2], [17, 3], 0, 1)]
    cases = []
    for dtype, dtype_shapes in _dtypes(size, shapes):
        for tag, ids, nrows, tail, grid in dtype_shapes:
            slot_ids, slot_rows = torch.tensor(ids), torch.tensor(nrows)
            E = int(slot_rows.sum()) + tail
            a, grad = torch.randn(E, K, generator=g).to(dtype), torch.randn(E, M, generator=g).to(dtype)
            params = _params(dtype, A=len(ids), E=E, K=K, M=M, S=S) | ({"max_blocks": grid} if grid else {})
            want = CPU.grouped_mm_wgrad(a, grad, *_owned(slot_ids, slot_rows), S)
            cases.append(Case(f"wgrad_{tag}_{DTYPE_NAMES[dtype]}", "wgrad", params,
                              {"a": a, "grad": grad, "slot_ids": slot_ids, "slot_rows": slot_rows}, {"out": want},
                              tol=_sum_tol(dtype, max(nrows))))
    return cases


ACTS = ("gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved", "swiglu_oai")


def activation_cases(size: str) -> list[Case]:
    """The expert forms' kernels: bias + activation in place over h, the backward, the bias's
    gradient; each form, with a slot owning no rows and grid-stride loops (grid capped)."""
    g = torch.Generator().manual_seed(9)
    S, M, alpha, limit = 4, 10, 1.702, 1.5  # a small limit: swiglu_oai's clamps bite
    ids, nrows = torch.tensor([2, 0, 3]), torch.tensor([5, 0, 9])
    E = int(nrows.sum())
    cases = []
    forms = ACTS if size == "full" else ("gelu", "swiglu_oai")
    for dtype, _ in _dtypes(size, [None]):
        for i, act in enumerate(forms):
            W = M // 2 if "swiglu" in act else M
            h = (torch.randn(E, M, generator=g) * 2).to(dtype)
            bias = torch.randn(S, M, generator=g).to(dtype)
            grad = torch.randn(E, W, generator=g).to(dtype)
            h_b, out = CPU.grouped_mm_act(torch.eye(E, dtype=dtype), h.unsqueeze(0).expand(S, E, M).contiguous(),
                                          bias, ids, nrows, act, alpha, limit)
            gh, gb = CPU.expert_act_backward(grad, h_b, ids, nrows, act, alpha, limit, S, True)
            tol = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.float16: (2e-3, 2e-3),
                   torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
            params = _params(dtype, E=E, M=M, A=3, S=S, act=ACTS.index(act), alpha_milli=round(alpha * 1000),
                             limit_milli=round(limit * 1000), max_blocks=2 if i % 2 else 65535)
            cases.append(Case(f"activation_{act}_{DTYPE_NAMES[dtype]}", "activation", params,
                              {"h": h, "bias": bias, "grad": grad, "slot_ids": ids, "slot_rows": nrows},
                              {"h": h_b, "out": out, "grad_h": gh, "grad_bias": gb}, exact=("h",), tol=tol))
    return cases


FAMILIES = {
    "routing": routing_cases,
    "routing_backward": routing_backward_cases,
    "group_plan": group_plan_cases,
    "gather_scatter_gate_grad": map_cases,
    "grouped_gemm": grouped_gemm_cases,
    "wgrad": wgrad_cases,
    "activation": activation_cases,
}


# ---- Building and running the program.

def _build(out: Path, extra: list[str]) -> Path:
    exe = out / "run_kernels"
    cmd = [CXX, *FLAGS, *extra, "-I", str(ROOT / "csrc"), "-o", str(exe), str(SOURCE)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"building the emulator test failed:\n{' '.join(cmd)}\n{run.stderr[-6000:]}"
    return exe


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("emu"), ["-O2"])


@pytest.fixture(scope="module")
def tsan_program(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("emu_tsan"), TSAN_FLAGS)


def _tsan_env() -> dict:
    # exitcode: a report fails the run even where the output is right; second_deadlock_stack for
    # a readable report should a barrier ever hang.
    return {**os.environ, "TSAN_OPTIONS": "halt_on_error=0:exitcode=66:second_deadlock_stack=1"}


def _run(exe: Path, cases: list[Case], root: Path, tsan: bool = False) -> tuple[subprocess.CompletedProcess, list]:
    dirs = [c.write(root) for c in cases]
    # setarch -R: ThreadSanitizer's fixed memory layout refuses the randomised mappings of kernels
    # with more ASLR entropy ("FATAL: ThreadSanitizer: unexpected memory mapping").
    prefix = ["setarch", os.uname().machine, "-R"] if tsan and shutil.which("setarch") else []
    proc = subprocess.run([*prefix, str(exe), *map(str, dirs)], capture_output=True, text=True, timeout=600,
                          env=_tsan_env() if tsan else None)
    return proc, dirs


def _check(cases, dirs, proc) -> None:
    assert proc.returncode == 0, f"run_kernels exited with {proc.returncode}:\n{proc.stderr[-8000:]}"
    errors = [e for c, d in zip(cases, dirs) for e in c.check(d)]
    assert not errors, f"{len(errors)} mismatches against the CPU kernels:\n" + "\n".join(errors[:20])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_kernels_match_the_cpu_kernels_under_the_emulator(program, tmp_path, family):
    cases = FAMILIES[family]("full")
    proc, dirs = _run(program, cases, tmp_path)
    _check(cases, dirs, proc)


def test_gpu_kernels_are_race_free_under_thread_sanitizer(tsan_program, tmp_path):
    cases = [c for make in FAMILIES.values() for c in make("small")]
    start = time.monotonic()
    proc, dirs = _run(tsan_program, cases, tmp_path, tsan=True)
    assert "ThreadSanitizer" not in proc.stderr, (
        f"ThreadSanitizer reported (after {time.monotonic() - start:.0f} s):\n{proc.stderr[-12000:]}")
    _check(cases, dirs, proc)


@pytest.mark.parametrize("probe", ["missing_barrier", "plain_global_count"])
def test_thread_sanitizer_sees_a_race_in_the_emulator(tsan_program, tmp_path, probe):
    # The race-free result above means something only if ThreadSanitizer sees the emulator's
    # threads race: a block that reads shared memory another thread wrote with no barrier between,
    # and blocks that bump one global count without an atomic.
    case = Case(f"probe_{probe}", "race_probe", {"probe": probe}, {}, {})
    proc, _ = _run(tsan_program, [case], tmp_path, tsan=True)
    assert "WARNING: ThreadSanitizer: data race" in proc.stderr, (
        f"no race reported for {probe} (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
