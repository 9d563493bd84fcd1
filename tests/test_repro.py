"""Reproducibility (issue 34): the same run beside a load and runs stopped from outside by a real
signal at random moments end bit-identical to an undisturbed one (python -m minagi.bench repro,
short), as does a run killed (SIGKILL) and resumed; the comparison itself sees a one-bit change;
--resume --steps N trains a run on to N."""
import json
import subprocess
import sys

import pytest
import torch

from minagi.bench.repro import differences
from minagi.lm import checkpoint, distributed
from minagi.lm import run as run_
from minagi.lm.config import load
from minagi.lm.trainer import train

from conftest import run_bench
from test_trainer import ROOT, TINY, _cli, _history, _signal_at, text_file  # noqa: F401  (a fixture)

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

SETS = [*TINY, "train.checkpoint_every=4", "train.eval_every=4"]


def _args(text_file, steps):
    return ["--data", str(text_file), "--steps", str(steps), *sum((["--set", s] for s in SETS), [])]


def test_loaded_and_signalled_runs_end_bit_identical(tmp_path, text_file):  # noqa: F811
    overrides = (*TINY, f"data.path={text_file}")
    r = run_bench("repro", "--steps", 16, "--every", 4, "--signals", 4, "--loads", "busy", "--seed", 3,
                  "--out", tmp_path / "runs", "--json", tmp_path / "r.json", overrides=overrides)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert len(runs) == 5 and all(not x["differences"] and not x["error"] for x in runs), runs
    assert {x["moment"] for x in runs[1:]} == {"time", "start", "eval", "checkpoint"}
    assert {x["signal"] for x in runs[1:]} == {"SIGTERM", "SIGINT"}
    assert "5 of 5 runs identical" in r.stdout


def test_the_comparison_sees_one_changed_bit_and_one_changed_record(tmp_path, text_file):  # noqa: F811
    a, b = tmp_path / "a", tmp_path / "b"
    assert _cli(*_args(text_file, 8), "--out", str(a)).returncode == 0
    assert _cli(*_args(text_file, 8), "--out", str(b)).returncode == 0
    assert differences(a, b) == []
    ckpt = checkpoint.load(b)
    w = ckpt["model"]["head.weight"]
    w.view(torch.int32)[0, 0] ^= 1  # the last bit of one weight
    checkpoint.save(ckpt, b / checkpoint.CHECKPOINT)
    assert differences(a, b) == ["model.head.weight"]
    lines = (b / "history.jsonl").read_text().splitlines()
    rec = json.loads(lines[0])
    rec["heldout_bpc"] += 1e-12
    (b / "history.jsonl").write_text("\n".join([json.dumps(rec), *lines[1:]]) + "\n")
    assert differences(a, b) == ["model.head.weight", "history[4].heldout_bpc"]


def test_resume_with_more_steps_trains_on_and_replans_the_schedule(tmp_path, text_file):  # noqa: F811
    run = tmp_path / "run"
    assert _cli(*_args(text_file, 8), "--out", str(run)).returncode == 0
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *_args(text_file, 12), "--out", str(run), "--resume"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    assert ("minagi: resuming at step 8 and training to step 12 (planned: 8); the learning-rate schedule is "
            "re-planned over 12 steps") in r.stderr and "ignoring" not in r.stderr, r.stderr
    assert "other software" not in r.stderr  # the same build, torch and threads: nothing to say
    assert checkpoint.load(run)["step"] == 12 and checkpoint.load(run)["config"]["train"]["steps"] == 12
    assert [x["step"] for x in _history(run)] == [4, 8, 12]
    # Its length now: nothing more to train, nothing ignored.
    r = _cli(*_args(text_file, 12), "--out", str(run), "--resume")
    assert r.returncode == 0 and [x["step"] for x in _history(run)] == [4, 8, 12], r.stderr


def test_the_first_resumed_step_takes_the_replanned_rate(tmp_path, text_file):  # noqa: F811
    # The 8-step plan ends at its floor; step 9 of the 12-step plan is above it.
    run = tmp_path / "run"
    cfg = load("cpu-tiny", [*SETS, "train.steps=8", f"data.path={text_file}"])
    train(cfg, run, progress=False)
    started = run_.start(cfg, run, resume=True, steps=12)
    try:
        resumed = started[0]
        want = [base * run_.lr_factor(8, resumed.cfg) for base in resumed.sched.base_lrs]
        assert [g["lr"] for g in resumed.opt.param_groups] == want
        assert want[0] > cfg.train.lr * cfg.train.min_lr_frac * 1.01
    finally:
        distributed.stop(started[0].dist)


def test_resume_refuses_to_go_back(tmp_path, text_file):  # noqa: F811
    run = tmp_path / "run"
    assert _cli(*_args(text_file, 8), "--out", str(run)).returncode == 0
    r = _cli(*_args(text_file, 4), "--out", str(run), "--resume")
    assert r.returncode == 2 and "--steps 4 is below the checkpoint's step 8" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_resume_after_a_kill_naming_the_saved_steps_stays_exact(tmp_path, text_file):  # noqa: F811
    # SIGKILL (a crash, no cleanup) after step 6: the last checkpoint and record are step 4's. The
    # resumed run (--steps as saved) ends with every checkpoint entry and history record of an
    # uninterrupted one, bit for bit.
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    r = _cli(*_args(text_file, 12), "--out", str(whole))
    assert r.returncode == 0, r.stderr
    assert _signal_at(6, "KILL", *_args(text_file, 12), "--out", str(parts)).returncode == -9
    assert [x["step"] for x in _history(parts)] == [4]
    r = _cli(*_args(text_file, 12), "--out", str(parts), "--resume")
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in _history(whole)] == [x["step"] for x in _history(parts)] == [4, 8, 12]
    assert differences(whole, parts) == []


def test_resume_on_other_software_says_it_will_not_be_bit_exact(tmp_path, text_file):  # noqa: F811
    # A rebuilt extension (or another torch, or other threads) computes other bits: the resumed run
    # is right but not bit-identical with an uninterrupted one, and the resume says so.
    run = tmp_path / "run"
    assert _cli(*_args(text_file, 8), "--out", str(run)).returncode == 0
    ckpt = checkpoint.load(run)
    saved = ckpt["dispatch"]["software"]
    now = run_.software()
    assert (saved["build"], saved["torch"]) == (now["build"], now["torch"])  # written by this build
    ckpt["dispatch"]["software"] = {**saved, "build": "extension 0123456789abcdef"}
    checkpoint.save(ckpt, run / checkpoint.CHECKPOINT)
    r = _cli(*_args(text_file, 12), "--out", str(run), "--resume")  # --quiet: warnings still show
    assert r.returncode == 0, r.stderr
    assert "the checkpoint was written by other software (build extension 0123456789abcdef -> " in r.stderr
    assert "not bit for bit" in r.stderr


def test_resume_reports_only_the_settings_the_command_names(tmp_path, text_file):  # noqa: F811
    # The run was made with --set train.eval_every=4; a plain --resume names nothing, so the
    # profile's own eval_every is not "ignored". A setting it names and cannot change is.
    run = tmp_path / "run"
    assert _cli(*_args(text_file, 8), "--out", str(run)).returncode == 0
    r = _cli("--data", str(text_file), "--out", str(run), "--resume")
    assert r.returncode == 0 and "ignoring" not in r.stderr, r.stderr
    r = _cli("--data", str(text_file), "--out", str(run), "--resume", "--set", "model.top_k=1")
    assert r.returncode == 0, r.stderr
    assert "ignoring model.top_k=1 (saved: 2)" in r.stderr and "eval_every" not in r.stderr, r.stderr
    r = _cli("--data", str(text_file), "--out", str(run), "--resume", "--profile", "cpu-tiny")
    assert r.returncode == 0 and "train.eval_every=250 (saved: 4)" in r.stderr, r.stderr  # a named profile: all of it
