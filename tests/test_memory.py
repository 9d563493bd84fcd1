"""Long runs hold their memory: rows padded to _bucket sizes change no result, the soak
benchmark's arithmetic and command, the allocator switch, and the history's memory fields."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.lm import allocator
from minagi.bench import soak
from minagi.lm.config import ModelConfig
from minagi.moe.dispatch import expert_mlp
from minagi.lm.model import ByteModel
from minagi.moe.reference import bucket

from conftest import BENCH_TINY, EXT, assert_close, run_bench

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["rectangle", "grouped"] + (["compiled"] if EXT else [])


def _halting_model(path, balance, bucket_rows, dtype=torch.float64):
    """A small model whose characters halt at different rows, so most rows run a count of
    active characters that is not a bucket size."""
    cfg = ModelConfig(d_model=16, n_heads=2, max_rows=4, d_hidden=24, n_pool=8, n_slots=8, top_k=2,
                      dispatch=path, balance=balance, bucket_rows=bucket_rows)
    torch.manual_seed(0)
    model = ByteModel(cfg, context=20).to(dtype)
    with torch.no_grad():
        model.halt.bias.fill_(-0.5)
        model.halt.weight.normal_(std=0.5)
    return model


@pytest.mark.parametrize("balance", ["load", "admission"])
@pytest.mark.parametrize("path", PATHS)
def test_bucketed_rows_equal_exact_rows(path, balance):
    idx, tgt = torch.randint(0, 256, (3, 20)), torch.randint(0, 256, (3, 20))
    runs = {}
    for bucket_rows in (True, False):
        model = _halting_model(path, balance, bucket_rows)
        out = model(idx, tgt)
        out.loss.backward()
        runs[bucket_rows] = out, {n: p.grad for n, p in model.named_parameters()}
    (bo, bg), (eo, eg) = runs[True], runs[False]
    active = [st.routed_pairs // 2 for st in eo.dispatch]
    assert any(n > 4 and bucket(n) != n for n in active), f"no row needed padding: {active}"
    assert_close(bo.logits, eo.logits, msg="logits")
    assert_close(bo.loss, eo.loss, msg="loss")
    assert_close(bo.balance, eo.balance, msg="balance term")
    for name, g in eg.items():
        assert_close(bg[name], g, msg=f"grad of {name}")
    assert [st.as_dict() for st in bo.dispatch][0] == [st.as_dict() for st in eo.dispatch][0]
    for b, e in zip(bo.dispatch, eo.dispatch):  # padding is work, but nobody's load
        assert (b.routed_pairs, b.dropped_pairs, b.max_load_ratio) == (e.routed_pairs, e.dropped_pairs, e.max_load_ratio)
        assert b.executed_rows >= e.executed_rows


def test_padded_count():
    model = _halting_model("grouped", "none", True)
    assert [model.padded_count(n, 1024) for n in (1, 3, 4, 5, 9, 100, 129, 1000, 1024)] == \
        [1, 3, 4, 8, 16, 128, 256, 1024, 1024]
    assert model.padded_count(600, 620) == 620  # never past every character
    model.cfg.bucket_rows = False
    assert model.padded_count(9, 1024) == 9


@pytest.mark.parametrize("cf", [0.0, 1.0])
@pytest.mark.parametrize("path", PATHS)
def test_expert_mlp_padding_rows_count_nowhere(path, cf):
    torch.manual_seed(1)
    N, n, S, D, H, K = 13, 9, 4, 8, 12, 2
    x = torch.randn(N, D, dtype=torch.float64)
    x[n:] = 0
    slot = torch.stack([torch.randperm(S)[:K] for _ in range(N)])
    slot[:n, 0] = 1  # a sink: the cap drops real pairs
    gates = torch.rand(N, K, dtype=torch.float64)
    w_in, w_out = torch.randn(S, D, H, dtype=torch.float64), torch.randn(S, H, D, dtype=torch.float64)
    y_pad, st_pad = expert_mlp(x, slot, gates, w_in, w_out, path=path, capacity_factor=cf, return_stats=True, n_valid=n)
    y, st = expert_mlp(x[:n], slot[:n], gates[:n], w_in, w_out, path=path, capacity_factor=cf, return_stats=True)
    assert_close(y_pad[:n], y)
    assert (st_pad.routed_pairs, st_pad.dropped_pairs, st_pad.max_load_ratio) == (st.routed_pairs, st.dropped_pairs, st.max_load_ratio)
    assert (st.dropped_pairs > 0) == (cf > 0)
    with pytest.raises(ValueError, match="n_valid"):
        expert_mlp(x, slot, gates, w_in, w_out, path=path, n_valid=N + 1)


# --- the soak benchmark ---------------------------------------------------------------------

def _samples(n, rss_mb, cps):
    """Synthetic samples every 100 steps of 1,000 characters: rss_mb(i) and cps(i) per sample."""
    out, chars, train_s = [], 0, 0.0
    for i in range(n):
        if i:
            chars += 1000 * 100
            train_s += 1000 * 100 / cps(i)
        out.append({"step": 100 * i, "elapsed_s": train_s, "chars": chars, "train_s": train_s,
                    "rss": int(rss_mb(i) * 2 ** 20), "peak_rss": 0})
    return out


def test_soak_slope_counts_after_warm_up():
    # 400 MB of warm-up growth in the first 20% of samples, then 2 MB per 1,000 steps.
    s = _samples(50, lambda i: 200 + 40 * i if i < 10 else 600 + 0.2 * (i - 10), lambda i: 1e4)
    rep = soak.report(s)
    assert abs(rep["slope_mb_per_kstep"] - 2.0) < 1e-6
    assert abs(rep["peak_rss_mb"] - (600 + 0.2 * 39)) < 1e-3
    assert abs(rep["drift"]) < 1e-9 and abs(rep["char_per_s"] - 1e4) < 1e-6
    assert soak.slope_per_kstep([5, 5], [1, 2]) == 0.0 and soak.slope_per_kstep([1], [1]) == 0.0


def test_soak_drift_compares_last_fifth_with_first_fifth_after_warm_up():
    # 10,000 char/s until sample 60, then 9,000: the last fifth is 10% slower than the first.
    s = _samples(100, lambda i: 500, lambda i: 1e4 if i < 60 else 9e3)
    assert abs(soak.drift(s) - (-0.1)) < 1e-9
    # A slow warm-up (the first fifth) does not count.
    s = _samples(100, lambda i: 500, lambda i: 1e3 if i <= 20 else 1e4)
    assert abs(soak.drift(s)) < 1e-9


def test_soak_work_drift_sees_through_fewer_rows():
    # The model halts sooner: 4 rows a character, then 2, at twice the char/s. char/s drifts
    # +100%; character-rows per second, the work, does not move.
    s = _samples(100, lambda i: 500, lambda i: 1e4 if i < 60 else 2e4)
    rows = 0.0
    for i, smp in enumerate(s):
        if i:
            rows += 1000 * 100 * (4 if i < 60 else 2)
        smp["row_chars"] = rows
    rep = soak.report(s)
    assert abs(rep["drift"] - 1.0) < 1e-9 and abs(rep["work_drift"]) < 1e-9
    assert rep["rows_first"] == 4 and rep["rows_last"] == 2
    assert "per character-row +0.0%" in soak.summary(rep)


def test_soak_report_needs_samples():
    with pytest.raises(RuntimeError, match="at least 5"):
        soak.report(_samples(3, lambda i: 1, lambda i: 1))


def test_soak_command_writes_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    r = run_bench("soak", "--minutes", "0.25", "--every", "1", "--out", tmp_path,
                  overrides=(*BENCH_TINY, "model.ngram=1", "train.eval_every=5", "train.checkpoint_every=10"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "soak.json").read_text())
    assert res["samples"] >= 5 and res["peak_rss_mb"] > 0 and res["char_per_s"] > 0
    assert {"slope_mb_per_kstep", "drift", "series", "targets"} <= set(res)
    assert (tmp_path / "soak.png").stat().st_size > 0 and "peak resident" in r.stdout
    hist = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert {"mem_rss", "mem_peak"} <= set(hist[-1]) and "mem_allocated" not in hist[-1]  # CPU fields


# --- the allocator switch -------------------------------------------------------------------

def _train(env, tmp_path):
    env = {**os.environ, **env}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "--steps", "1", "--out", str(tmp_path),
                           "--set", "train.eval_chunks=2", "--set", "model.ngram=1"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_missing_allocator_is_one_line_and_the_run_goes_on(tmp_path):
    r = _train({"MINAGI_ALLOCATOR": "tcmalloc", "MINAGI_ALLOCATOR_LIB": str(tmp_path / "libnone.so")}, tmp_path)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "MINAGI_ALLOCATOR=tcmalloc:" in line]
    assert len(lines) == 1 and "not found" in lines[0] and "libtcmalloc-minimal4" in lines[0]
    assert "system allocator" in lines[0]


def test_unknown_allocator_is_an_error(tmp_path):
    r = _train({"MINAGI_ALLOCATOR": "mimalloc"}, tmp_path)
    assert r.returncode == 2 and "MINAGI_ALLOCATOR='mimalloc'" in r.stderr and "jemalloc" in r.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux") or allocator.find("jemalloc") is None,
                    reason="jemalloc is not installed (Debian: apt-get install libjemalloc2)")
def test_jemalloc_is_preloaded_and_named(tmp_path):
    r = _train({"MINAGI_ALLOCATOR": "jemalloc"}, tmp_path)
    assert r.returncode == 0, r.stderr
    assert "allocator jemalloc" in r.stderr  # the startup line, from the re-executed process


def test_keep_is_applied_and_named(tmp_path):
    r = _train({"MINAGI_ALLOCATOR": "keep"}, tmp_path)
    assert r.returncode == 0, r.stderr
    if EXT:
        assert "allocator system (glibc) with minagi's block cache (keep)" in r.stderr  # the startup line
    else:  # no extension, no block cache: one line, and the run goes on
        lines = [line for line in r.stderr.splitlines() if "MINAGI_ALLOCATOR=keep:" in line]
        assert len(lines) == 1 and "needs minagi's extension" in lines[0] and "system allocator" in lines[0]


# A 96 MiB tensor made, freed and made again: the page faults of the second one's fill, in 4 KiB
# pages (huge pages off for the process). glibc maps anything over 32 MiB afresh, and unmaps it
# when freed; the block cache hands the same block out again.
_REFAULTS = """
import ctypes, json, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import torch
from minagi.lm import allocator
if sys.argv[1] == "keep" and not (allocator.keep_freed_memory() and allocator.keeping()):
    sys.exit("keep_freed_memory() did not take effect")
first = torch.empty(24 << 20)
first.fill_(1.0)
del first
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
second = torch.empty(24 << 20).fill_(2.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
idle_with_one = allocator.keep_stats()["idle_bytes"]  # the one freed block is in use again
assert bool((second == 2.0).all())
third = torch.empty(50 << 20)  # 200 MiB: no idle block of its size, a new one
del second, third
stats = allocator.keep_stats()
installed = allocator.keep_freed_memory(0)  # hand the idle blocks back (installs nothing by itself)
print(json.dumps({"faults": faults, "idle_with_one": idle_with_one, **stats, "installed": installed,
                  "idle_after_release": allocator.keep_stats()["idle_bytes"]}))
"""
# What would steer the allocator of the child from outside.
_ALLOCATOR_ENV = ("LD_PRELOAD", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE", "MINAGI_ALLOCATOR")


@pytest.mark.skipif(not EXT or not sys.platform.startswith("linux"), reason="the block cache (extension, Linux)")
def test_keep_hands_a_freed_block_out_again_and_releases_on_request():
    env = {k: v for k, v in os.environ.items() if k not in _ALLOCATOR_ENV and not k.startswith("MALLOC_")}
    res = {}
    for mode in ("default", "keep"):
        r = subprocess.run([sys.executable, "-c", _REFAULTS, mode], capture_output=True, text=True, timeout=120,
                           env={**env, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr
        res[mode] = json.loads(r.stdout.splitlines()[-1])
    default, keep = res["default"], res["keep"]
    assert default["faults"] >= 0.9 * (96 << 20) / 4096, res  # plain glibc: every page afresh
    assert keep["faults"] * 20 < default["faults"], res  # the same block, already faulted in
    assert keep["reused"] >= 1 and keep["mapped"] >= 2, res  # the 200 MiB one was not served from 96
    assert keep["idle_with_one"] == 0 and keep["idle_bytes"] >= (96 + 200) << 20, res
    assert keep["idle_after_release"] == 0 and keep["installed"], res
    assert default["mapped"] == 0 and not default["installed"], res  # a cap of 0 installed nothing


def test_keep_freed_memory_refuses_a_negative_cap():
    with pytest.raises(ValueError, match="max_idle_bytes must be >= 0"):
        allocator.keep_freed_memory(-1)


def test_doctor_names_the_allocator():
    r = subprocess.run([sys.executable, "-m", "minagi", "doctor"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "allocator" in r.stdout and "system" in r.stdout
