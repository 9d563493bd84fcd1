"""Routing health: the history's load telemetry against loads counted by hand, the routes
command, and bias balancing (moves toward the under-loaded experts, never changes the gates,
saved and resumed exactly)."""
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minagi.lm import checkpoint, history, trainer

from minagi.moe import dispatch
from minagi.lm.balance import BalanceInputs, BiasBalance
from minagi.lm.config import load
from minagi.moe.dispatch import DispatchStats, dispatch_stats
from minagi.lm.pool import PooledMLP, RowRoute

from conftest import assert_close
from test_trainer import TINY, _cli, _history, _signal_at, text_file  # noqa: F401  (a fixture)

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _forced(S, K, picks):
    """slot_idx [N, K] from a list of per-character slot tuples."""
    return torch.tensor(picks, dtype=torch.long).view(-1, K)


def test_telemetry_against_loads_counted_by_hand():
    S, K = 8, 2
    # First row: 100 characters, 94 pick slot 0 (a sink), slot 7 gets nothing.
    first = [(0, 1 + i % 6) for i in range(94)] + [(1 + i % 6, 2 + i % 5) for i in range(6)]
    st0 = dispatch_stats(_forced(S, K, first), S, 0, executed=200, groups=3)
    load = [0] * S
    for a, b in first:
        load[a] += 1
        load[b] += 1
    assert st0.slot_load == load and st0.sink_share == 0.94 and st0.dead_slots == 1
    assert abs(st0.max_load_ratio - 94 / (200 / 8)) < 1e-12
    p = [c / 200 for c in load if c]
    assert abs(st0.load_entropy - (-sum(q * math.log(q) for q in p) / math.log(8))) < 1e-12
    # A one-character call (a late row): 4x the fair share by itself, and must not count in
    # max_load_ratio; its slots (1, 2) leave slot 7 dead for the window.
    st1 = dispatch_stats(_forced(S, K, [(1, 2)]), S, 0, executed=2, groups=2)
    assert st1.max_load_ratio == 4.0
    w = history.Window()
    for _ in range(2):
        out = SimpleNamespace(rows_used=torch.ones(1, 100), dispatch=[st0, st1])
        w.add([out], 1.0, 1.0, 100, 0.1, 2)
    rec = w.record()
    assert rec["sink_share"] == 0.94 and abs(rec["load_ratio"] - 3.76) < 1e-12
    assert rec["max_load_ratio"] == st0.max_load_ratio and rec["dead_slots"] == 1
    assert abs(rec["load_entropy"] - st0.load_entropy) < 1e-12
    # Uniform top-2 over 64 slots: the fair share 2/64.
    uni = dispatch_stats(torch.arange(128).view(64, 2) % 64, 64, 0, 128, 1)
    assert uni.sink_share == 2 / 64 and uni.load_entropy == pytest.approx(1.0) and uni.dead_slots == 0


class _NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any read of a tensor's value by the host (item, float, int, bool, tolist)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor's value was read on the host")
        return func(*args, **(kwargs or {}))


def test_window_sums_on_the_device_and_reads_at_the_record(monkeypatch):
    S, K = 8, 2
    first = [(0, 1 + i % 6) for i in range(94)] + [(1 + i % 6, 2 + i % 5) for i in range(6)]
    idx = _forced(S, K, first)
    st = dispatch.dispatch_stats(idx, S, 60, executed=torch.tensor(210), groups=lambda: torch.tensor(3))
    w = history.Window()
    out = SimpleNamespace(rows_used=torch.tensor([[1.0, 2.0, 2.0, 3.0]]), dispatch=[st])
    with monkeypatch.context() as m, _NoHostReads():
        m.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("tolist on the step's path"))
        w.add([out], 1.0, 1.0, 100, 0.1, 3)
        w.add([out], 1.0, 1.0, 100, 0.1, 3)
    rec = w.record()
    assert rec["rows_hist"] == [0.25, 0.5, 0.25] and rec["rows_mean"] == 2.0
    assert rec["executed_ratio"] == 210 / 200 and rec["groups_mean"] == 3.0
    assert rec["dropped_frac"] == (94 - 60) / 200 and rec["sink_share"] == 0.94
    assert rec["load_entropy"] == pytest.approx(st.load_entropy, abs=1e-12) and rec["dead_slots"] == 1
    saved = history.Window(**w.state())  # a stopped run's window: plain numbers
    assert saved.record() == rec


def test_rectangle_rows_follow_the_cap():
    st = DispatchStats(routed_pairs=20, dropped_pairs=0, executed_rows=20, groups=2, max_load_ratio=2.0,
                       top_k=2, capacity=0, slot_load=[10, 6, 4, 0])
    assert st.rectangle_rows == 40 and st.n_chars == 10
    st.capacity = 5
    assert st.rectangle_rows == 20


def test_history_has_the_telemetry_and_warns_once_on_a_sink(tmp_path, text_file, monkeypatch, capsys):
    # A test double: a sink (the trainer sums the first row's share on the device).
    monkeypatch.setattr(dispatch, "sink_share_of", lambda load, n: torch.tensor(0.9, dtype=torch.float64))
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=6", "train.checkpoint_every=2"])
    trainer.train(cfg, tmp_path, progress=True)
    hist = _history(tmp_path)
    assert len(hist) == 3 and all(r["sink_share"] == 0.9 for r in hist)
    for r in hist:
        assert {"load_ratio", "dead_slots", "load_entropy", "max_load_ratio"} <= set(r)
        assert 0 <= r["load_entropy"] <= 1 and 0 <= r["dead_slots"] <= cfg.model.n_slots
    assert capsys.readouterr().err.count("(a sink)") == 1


def test_bias_moves_toward_the_under_loaded_experts():
    term, P = BiasBalance(), 6
    admitted = torch.tensor([0, 2, 3, 5])  # a card of 4 slots from a pool of 6
    aff = torch.full((10, P), 1 / P)
    term(BalanceInputs(aff, admitted, P, 4, [RowRoute(torch.zeros(10, 4), torch.tensor([12, 4, 2, 2]), 10)]))
    term(BalanceInputs(aff, admitted, P, 4, [RowRoute(torch.zeros(3, 4), torch.tensor([2, 2, 1, 1]), 3)]))
    bias = torch.zeros(P)
    term.update(bias, 0.01)
    # loads 14, 6, 3, 3 (mean 6.5): slot 0's expert down, the others up; experts 1 and 4 sat out.
    assert torch.equal(bias, torch.tensor([-0.01, 0.0, 0.01, 0.01, 0.0, 0.01]))
    term.update(bias, 0.01)  # nothing pending: no change
    assert bias[0] == -0.01
    term(BalanceInputs(aff, admitted, P, 4, [RowRoute(torch.zeros(3, 4), torch.tensor([6, 0, 0, 0]), 3)]))
    term.update(bias, 0.01, apply=False)  # a skipped step forgets its loads
    assert bias[0] == -0.01 and term.pending_P is None


def test_bias_picks_the_slots_but_never_changes_the_gates():
    torch.manual_seed(0)
    mlp = PooledMLP(8, 16, 6, 2, path="grouped")
    x = torch.randn(20, 8, requires_grad=True)
    logits = x @ mlp.router.t()
    slot, gates = mlp.route(x, mlp.router, 20, torch.zeros(6))
    slot0, gates0 = mlp.route(x, mlp.router, 20, None)
    assert torch.equal(slot, slot0) and torch.allclose(gates, gates0)
    bias = torch.tensor([0.0, 0.0, 0.0, 100.0, 0.0, 0.0])  # expert 3 is picked by everyone...
    slot, gates = mlp.route(x, mlp.router, 20, bias)
    assert (slot == 3).any(1).all()
    assert_close(gates, torch.softmax(logits.gather(1, slot), -1))  # ...weighted by its unbiased logit
    gates.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bias_trains_saves_and_resumes_exactly(tmp_path, text_file):
    args = ["--data", str(text_file), "--steps", "12", *sum((["--set", s] for s in TINY), []),
            "--set", "model.balance=bias", "--set", "model.bias_rate=0.01",
            "--set", "train.checkpoint_every=5", "--set", "train.eval_every=5"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert _cli(*args, "--out", str(whole)).returncode == 0
    assert _signal_at(7, "TERM", *args, "--out", str(stopped)).returncode == 143
    assert _cli(*args, "--out", str(stopped), "--resume").returncode == 0
    a, b = checkpoint.load(whole)["model"], checkpoint.load(stopped)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    bias = a["pool.route_bias"]
    # TINY: a card of 4 slots from a pool of 6; every step moves each admitted expert by +-rate.
    assert bias.abs().max() > 0 and torch.allclose(bias * 100, (bias * 100).round(), atol=1e-4)


def test_routes_command_text_and_json(tmp_path, text_file):
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=2"])
    trainer.train(cfg, tmp_path, progress=False)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "routes", str(tmp_path), "--chunks", "3"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "busiest" in lines[1] and lines[-1].startswith("summary: at the first row expert")
    assert lines[2].split()[:2] == ["0", f"{3 * 32:,}"]  # row 0: every character of 3 chunks of 32
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "routes", str(tmp_path), "--chunks", "3", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    m = json.loads(r.stdout)
    assert m["rows"][0]["active"] == 96 and m["n_slots"] == 4 and sum(m["rows"][0]["slot_load"]) == 96 * 2
    routed = sum(r["routed_pairs"] for r in m["rows"])
    assert m["rectangle_rows"] >= routed and m["grouped_rows"] >= routed  # padding, if any, on top
    bad = subprocess.run([sys.executable, str(ROOT / "train.py"), "routes", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "no checkpoint at" in bad.stderr
