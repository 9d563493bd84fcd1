import contextlib
import os

# cuBLAS refuses deterministic mode without a fixed workspace; set before any GPU work.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Auto threads (train.threads = 0) follow the free cores, so a test's two runs compared bit for bit
# could train on other threads where the machine is shared (CI, other work): the watch is off in
# the tests' runs and their subprocesses; tests/test_trainer.py tests its logic with injected figures.
os.environ.setdefault("MINAGI_WATCH_CORES", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import minagi
from minagi.moe import ops

EXT = minagi.extension_loaded()
requires_ext = pytest.mark.skipif(
    not EXT, reason="compiled ops not loaded (MINAGI_DISABLE_EXT=1 or minagi._C not built)")

# atol + rtol * |ref| per dtype: what the dtype's rounding allows for these sizes.
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (4e-3, 4e-3),
}


def assert_close(actual, expected, dtype=None, scale=1.0, msg=""):
    """|actual - expected| <= scale * (atol + rtol * |expected|), elementwise; None counts as zeros."""
    if actual is None and expected is None:
        return
    if actual is None:
        actual = torch.zeros_like(expected)
    if expected is None:
        expected = torch.zeros_like(actual)
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    atol, rtol = TOL[dtype or expected.dtype]
    a, e = actual.double(), expected.double()
    bound = scale * (atol + rtol * e.abs())
    err = (a - e).abs()
    bad = ~(err <= bound) & ~(a.isnan() & e.isnan())
    assert not bad.any(), (f"{msg}: {int(bad.sum())} of {a.numel()} elements off; worst error "
                           f"{float(err[bad].max())} where the bound is {float(bound[bad].min())}")


def _gpu_skip_reason() -> str:
    """Why the GPU cases cannot run here ('' when they can)."""
    if not torch.cuda.is_available():
        return "no CUDA or ROCm GPU visible to torch"
    if not EXT:
        return "compiled ops not loaded"
    if not ops.supports(torch.device("cuda")):
        return "minagi._C has no GPU kernels (built against a CPU torch, or with MINAGI_CPU_ONLY=1)"
    return ""


GPU_SKIP = _gpu_skip_reason()
requires_gpu = pytest.mark.skipif(bool(GPU_SKIP), reason=f"GPU case: {GPU_SKIP}")
# The compiled-against-twin tests run on every device; GPU cases skip visibly without a GPU.
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=requires_gpu)]


@contextlib.contextmanager
def tile_bytes(name: str, value: int):
    """A fused CPU kernel's tile size for the block (0: no tile fits, the kernel's unfused path)."""
    before = torch.ops.minagi.tile_bytes(name, value)
    try:
        yield
    finally:
        torch.ops.minagi.tile_bytes(name, before)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture(scope="session")
def compiled():
    if not EXT:
        pytest.skip("compiled ops not loaded (MINAGI_DISABLE_EXT=1 or minagi._C not built)")
    return ops.compiled()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_report_header(config):
    return (f"minagi: extension {'loaded' if EXT else 'NOT loaded'}; torch {torch.__version__}; "
            f"{torch.get_num_threads()} threads; MINAGI_DISABLE_EXT={os.environ.get('MINAGI_DISABLE_EXT', '')}; "
            f"GPU cases: {'run' if not GPU_SKIP else 'skipped (' + GPU_SKIP + ')'}")


# A model small enough for benchmark command tests to run in seconds.
BENCH_TINY = ("model.d_model=32", "model.n_heads=2", "model.d_hidden=48", "model.n_pool=6", "model.n_slots=6",
              "data.context=32", "train.batch=4", "train.eval_chunks=2")


def run_bench(name, *args, overrides=BENCH_TINY, timeout=600):
    """python -m minagi.bench NAME ARGS --set OVERRIDE ... in a fresh process."""
    import subprocess
    import sys
    from pathlib import Path

    cmd = [sys.executable, "-m", "minagi.bench", name, *map(str, args)]
    for kv in overrides:
        cmd += ["--set", kv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          cwd=Path(__file__).resolve().parent.parent)
