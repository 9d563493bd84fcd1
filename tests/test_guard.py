"""Training never loses good work: the divergence guard, nothing non-finite saved or loaded,
a checkpoint on SIGTERM / SIGINT that resumes exactly, an unwritable run folder found first."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.lm import checkpoint, step, trainer
from minagi.lm import run as run_
from minagi.lm.config import load
from minagi.lm.guard import Diverged, DivergenceGuard, nonfinite
from minagi.lm.model import ByteModel

from test_trainer import TINY, _cli, _history, _signal_at, text_file  # noqa: F401  (a fixture)

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _args(text_file, steps=20, every=5):
    return ["--data", str(text_file), "--steps", str(steps), *sum((["--set", s] for s in TINY), []),
            "--set", f"train.checkpoint_every={every}", "--set", f"train.eval_every={every}"]


@pytest.fixture
def nan_after(monkeypatch):
    """Training losses turn NaN from the given forward call on (a test double of the model)."""
    calls, plain = {"n": 0, "from": None}, ByteModel.forward

    def forward(self, idx, targets=None, admitted=None):
        out = plain(self, idx, targets, admitted)
        if targets is not None:
            calls["n"] += 1
            if calls["from"] is not None and calls["n"] >= calls["from"]:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(ByteModel, "forward", forward)

    def start(n):
        calls["from"] = n
    return start


def _state(run):
    st = {f"p.{k}": v.clone() for k, v in run.model.state_dict().items()}
    for i, s in run.opt.state_dict()["state"].items():
        st.update({f"o.{i}.{k}": torch.as_tensor(v).clone() for k, v in s.items()})
    return st


def test_a_skipped_step_changes_nothing(tmp_path, text_file, nan_after):
    # A card smaller than the pool: the pool's per-expert step counts must not move either.
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=10"])
    run, _, _, _, _ = run_.start(cfg, tmp_path, resume=False)
    guard = DivergenceGuard(cfg.train.max_bad_steps)
    step.train_step(run, guard)
    before = _state(run)
    nan_after(2)
    _, _, loss, _, skipped = step.train_step(run, guard)
    assert skipped and loss != loss and guard.consecutive == 1 and guard.skipped == 1
    after = _state(run)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert run.step == 2  # the run's step moves on (its batch is consumed)


def test_divergence_stops_with_status_3_and_keeps_the_good_checkpoint(tmp_path, text_file):
    # The command line, with the model's losses turned NaN from the 6th step (test double).
    script = ("import sys; from minagi.lm.model import ByteModel; plain = ByteModel.forward; n = [0]\n"
              "def fwd(self, idx, targets=None, admitted=None):\n"
              "    out = plain(self, idx, targets, admitted)\n"
              "    if targets is not None:\n"
              "        n[0] += 1\n"
              "        if n[0] >= 6: out.loss = out.loss * float('nan')\n"
              "    return out\n"
              "ByteModel.forward = fwd\n"
              "from minagi.lm.cli import main; sys.exit(main(sys.argv[1:]))\n")
    r = subprocess.run([sys.executable, "-c", script, "--quiet", *_args(text_file, steps=40),
                        "--set", "train.max_bad_steps=4", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 3, r.stderr
    assert "training diverged: 4 steps in a row up to step 9" in r.stderr
    assert f"{tmp_path / 'checkpoint.pt'} (step 5)" in r.stderr and "train.lr" in r.stderr
    assert "Traceback" not in r.stderr
    ckpt = checkpoint.load(tmp_path)
    assert ckpt["step"] == 5 and not nonfinite(ckpt["model"].items())
    assert [rec["step"] for rec in _history(tmp_path)] == [5]


def test_skipped_steps_are_counted_in_the_history(tmp_path, text_file, nan_after):
    nan_after(3)  # from the 3rd training forward: steps 3.. are skipped, then the guard stops the run
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=8", "train.checkpoint_every=4",
                            "train.max_bad_steps=5"])
    with pytest.raises(Diverged, match="5 steps in a row up to step 7"):
        trainer.train(cfg, tmp_path, progress=False)
    rec = _history(tmp_path)[-1]
    assert rec["step"] == 4 and rec["skipped_steps"] == 2 and rec["train_loss"] == rec["train_loss"]


def test_guard_off_runs_through(tmp_path, text_file, nan_after):
    nan_after(2)
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=4", "train.checkpoint_every=10",
                            "train.max_bad_steps=0"])
    with pytest.raises(Diverged, match="not finite .* it was not saved"):  # ...but nothing non-finite is saved
        trainer.train(cfg, tmp_path, progress=False)
    assert not (tmp_path / "checkpoint.pt").exists()


def test_nonfinite_state_is_never_saved(tmp_path, text_file):
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=2"])
    trainer.train(cfg, tmp_path, progress=False)
    good = (tmp_path / "checkpoint.pt").read_bytes()
    run, window, _, _, _ = run_.start(cfg, tmp_path, resume=True)
    with torch.no_grad():
        run.model.pool.w_in[0, 0, 0] = float("inf")
    with pytest.raises(Diverged, match=r"pool.w_in.*step 2"):
        trainer._save(run, window, {"step": 2})
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_nonfinite_finds_nan_and_inf_in_any_dtype():
    ts = {"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]), "c": torch.tensor([float("-inf")]).bfloat16(),
          "d": torch.arange(3), "e": torch.tensor([3e38, -3e38]), "f": torch.empty(0)}
    assert nonfinite(ts.items()) == ["b", "c"]


@pytest.mark.parametrize("cmd", ["write", "eval", "resume"])
def test_commands_refuse_a_checkpoint_with_nan_weights(tmp_path, text_file, cmd):
    cfg = load("cpu-tiny", [*TINY, f"data.path={text_file}", "train.steps=2"])
    trainer.train(cfg, tmp_path, progress=False)
    ckpt = checkpoint.load(tmp_path)
    ckpt["model"]["head.weight"][0, 0] = float("nan")
    checkpoint.save(ckpt, tmp_path / "checkpoint.pt")
    args = {"write": ["write", str(tmp_path), "--chars", "5"], "eval": ["eval", str(tmp_path), "--data", str(text_file)],
            "resume": ["--resume", "--out", str(tmp_path)]}[cmd]
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 2 and "holds non-finite weights" in r.stderr and "head.weight" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("sig,status", [("TERM", 143), ("INT", 130)])
def test_signal_checkpoints_the_current_step_and_resumes_exactly(tmp_path, text_file, sig, status):
    args = _args(text_file)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert _cli(*args, "--out", str(whole)).returncode == 0
    r = _signal_at(7, sig, *args, "--out", str(stopped))
    assert r.returncode == status, r.stderr
    lines = [line for line in r.stderr.splitlines() if "stopped by" in line]
    assert lines == [f"minagi: stopped by SIG{sig} at step 7; checkpoint written. Resume with: "
                     f"python train.py --resume --out {stopped}"]
    assert checkpoint.load(stopped)["step"] == 7 and [x["step"] for x in _history(stopped)] == [5, 7]
    r = _cli(*args, "--out", str(stopped), "--resume")
    assert r.returncode == 0, r.stderr
    a, b = _history(whole), [x for x in _history(stopped) if x["step"] != 7]
    assert [x["step"] for x in a] == [x["step"] for x in b] == [5, 10, 15, 20]
    for x, y in zip(a, b):  # the window cut at step 7 carries on: step 10's record is the same
        assert x["train_loss"] == y["train_loss"] and x["heldout_bpc"] == y["heldout_bpc"], (x, y)
        assert x["rows_hist"] == y["rows_hist"] and x["executed_ratio"] == y["executed_ratio"]
    wa, wb = checkpoint.load(whole), checkpoint.load(stopped)
    assert all(torch.equal(wa["model"][k], wb["model"][k]) for k in wa["model"])


def test_second_ctrl_c_stops_at_once(tmp_path, text_file):
    r = _signal_at(7, "INT,INT", *_args(text_file), "--out", str(tmp_path))
    assert r.returncode == 130 and "the last checkpoint is intact" in r.stderr, r.stderr
    assert checkpoint.load(tmp_path)["step"] == 5  # step 7's was never begun


def test_sigterm_from_outside(tmp_path, text_file):
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--quiet", *_args(text_file, steps=100000, every=3),
                             "--out", str(tmp_path)], stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        hist = tmp_path / "history.jsonl"
        for _ in range(600):
            if hist.exists() and hist.read_text().strip():
                break
            proc.wait(timeout=0.1) if proc.poll() is not None else __import__("time").sleep(0.1)
        proc.send_signal(15)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    step = checkpoint.load(tmp_path)["step"]
    assert f"stopped by SIGTERM at step {step};" in err and _history(tmp_path)[-1]["step"] == step


def test_unwritable_out_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = _cli("--out", str(blocker / "run"), "--steps", "3")
    assert r.returncode == 2 and "cannot write to the run folder" in r.stderr and "--out" in r.stderr, r.stderr
    assert "step" not in r.stderr.replace("--steps", "")  # nothing trained


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_out_fails_before_training(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = _cli("--out", str(ro / "run"), "--steps", "3")
    finally:
        ro.chmod(0o700)
    assert r.returncode == 2 and "cannot write to the run folder" in r.stderr
