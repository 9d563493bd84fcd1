import os

import pytest
import torch

import minagi
from minagi import ops

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
            f"{torch.get_num_threads()} threads; MINAGI_DISABLE_EXT={os.environ.get('MINAGI_DISABLE_EXT', '')}")
