"""The trainer and its command line: smoke run, atomic checkpoints, the history file (resumed
between checkpoints), and the errors a user can fix. The exact resume after a kill: test_repro.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.lm import checkpoint
from minagi.lm.cli import main
from minagi.lm.config import ConfigError, load
from minagi.lm.data import DataError, load_corpus
from minagi.lm.run import build
from minagi.lm.trainer import train

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=32", "model.n_heads=2", "model.d_hidden=48", "model.n_pool=6", "model.n_slots=4",
        "model.max_rows=3", "data.context=32", "train.batch=4", "train.eval_chunks=4", "train.warmup=2"]
HISTORY_FIELDS = {"step", "train_loss", "heldout_bpc", "char_per_s", "rows_mean", "max_load_ratio", "dropped_frac",
                  "executed_ratio", "groups_mean", "mem_rss", "mem_peak", "time_s",
                  "sink_share", "load_ratio", "dead_slots", "load_entropy", "skipped_steps"}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """~120 KB of real text: a few standard-library modules."""
    import inspect
    import json as j
    import textwrap
    p = tmp_path_factory.mktemp("data") / "corpus.txt"
    p.write_text("".join(inspect.getsource(m) for m in (j.decoder, j.encoder, textwrap, inspect)))
    return p


def _history(run):
    return [json.loads(line) for line in (Path(run) / "history.jsonl").read_text().splitlines()]


def _cli(*args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "--quiet", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600)


def _signal_at(step, signals, *args):
    """The train command, sending itself `signals` (TERM, INT, KILL, comma-separated) after `step`."""
    return subprocess.run([sys.executable, str(ROOT / "tests" / "signal_at_step.py"), str(step), signals, "--quiet",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


def test_cpu_tiny_smoke_run_heldout_falls(tmp_path):
    cfg = load("cpu-tiny", ["train.steps=30", "train.eval_every=10", "train.checkpoint_every=10",
                            "train.eval_chunks=8"])
    last = train(cfg, tmp_path, progress=False)
    hist = _history(tmp_path)
    assert [r["step"] for r in hist] == [10, 20, 30] and last["step"] == 30
    assert hist[-1]["heldout_bpc"] < hist[0]["heldout_bpc"] < 8.5
    for rec in hist:
        assert HISTORY_FIELDS <= set(rec)
        assert rec["char_per_s"] > 0 and rec["mem_peak"] >= rec["mem_rss"] > 0
        assert 1 <= rec["rows_mean"] <= cfg.model.max_rows and rec["dropped_frac"] == 0
        assert rec["executed_ratio"] >= 1 and rec["groups_mean"] >= 1 and rec["max_load_ratio"] >= 1
    ckpt = checkpoint.load(tmp_path)
    assert ckpt["step"] == 30 and ckpt["config"]["profile"] == "cpu-tiny"
    assert ckpt["config"]["train"]["steps"] == 30 and set(ckpt["dispatch"]) == {"path", "extension", "software"}


def test_interrupted_checkpoint_write_keeps_the_last_good_one(tmp_path, monkeypatch):
    checkpoint.save({"model": {"w": torch.ones(3)}, "config": {}, "step": 1}, tmp_path / "checkpoint.pt")

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"model": {"w": torch.zeros(3)}, "config": {}, "step": 2}, tmp_path / "checkpoint.pt")
    monkeypatch.undo()
    ckpt = checkpoint.load(tmp_path)
    assert ckpt["step"] == 1 and torch.equal(ckpt["model"]["w"], torch.ones(3))


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load(tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("args,message", [
    (["--profile", "cpu-tinny"], "unknown profile 'cpu-tinny' (did you mean cpu-tiny"),
    (["--set", "model.top_kk=3"], "unknown key model.top_kk in --set (did you mean top_k"),
    (["--set", "model.top_k=three"], "model.top_k (from --set) must be an int, got 'three'"),
    (["--set", "model.top_k=99"], "model.top_k (99) must be in [1, model.n_slots = 16]"),
    (["--set", "modle.top_k=2"], "unknown section 'modle'"),
    (["--set", "top_k"], "--set takes section.key=value"),
    (["--data", "/nonexistent/corpus"], "--data /nonexistent/corpus: no such file or folder"),
    (["--resume", "--out", "/tmp/minagi-no-such-run"], "no checkpoint at /tmp/minagi-no-such-run/checkpoint.pt"),
])
def test_cli_errors_name_the_problem(args, message, capsys):
    assert main(["--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_a_cli_error_is_one_line_and_status_2_from_the_process():
    r = _cli("--profile", "cpu-tinny")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown profile 'cpu-tinny'" in r.stderr, r.stderr


def test_a_wrong_length_names_the_setting_and_the_flag(capsys):
    assert main(["--steps", "-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--steps -5:" in err and "give --steps 1 or more" in err
    with pytest.raises(ConfigError, match=r"^train.steps must be >= 1 .*--steps N sets it\), got 0$"):
        load("cpu-tiny", ["train.steps=0"])
    with pytest.raises(ConfigError, match=r"^train.batch must be >= 1 .*, got -2$"):
        load("cpu-tiny", ["train.batch=-2"])


def test_history_has_a_record_at_every_evaluation_and_resumes_between_checkpoints(tmp_path, text_file):
    sets = [*TINY, f"data.path={text_file}", "train.steps=8", "train.eval_every=2", "train.checkpoint_every=4"]
    train(load("cpu-tiny", sets), tmp_path / "whole", progress=False)
    whole = _history(tmp_path / "whole")
    assert [(r["step"], r["checkpoint"]) for r in whole] == [(2, False), (4, True), (6, False), (8, True)]
    assert all(HISTORY_FIELDS <= set(r) for r in whole)

    def crash(info):  # a crash after step 7: the checkpoint is step 4's, the history goes on to 6
        if info.step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(load("cpu-tiny", sets), tmp_path / "crashed", progress=False, callbacks=[crash])
    assert [r["step"] for r in _history(tmp_path / "crashed")] == [2, 4, 6]
    train(load("cpu-tiny", sets), tmp_path / "crashed", resume=True, progress=False)
    again = _history(tmp_path / "crashed")
    assert [r["step"] for r in again] == [2, 4, 6, 8]
    for x, y in zip(whole, again):
        assert (x["train_loss"], x["heldout_bpc"]) == (y["train_loss"], y["heldout_bpc"]), (x, y)


def test_corpus_smaller_than_a_chunk(tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("print('hello')\n" * 4)
    assert main(["--quiet", "--data", str(small), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "one chunk needs data.context + 1 = 129 bytes" in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no text files to read \\(an empty folder\\); give at least"):
        load_corpus(str(empty))


def test_split_is_by_file_and_stable(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i}\n" * 50)
    c1, c2 = load_corpus(str(tmp_path)), load_corpus(str(tmp_path))
    assert 0 < c1.n_heldout_files < 40 and torch.equal(c1.heldout, c2.heldout)
    assert c1.train.numel() + c1.heldout.numel() == sum(f.stat().st_size for f in tmp_path.iterdir())


def test_default_corpus_is_the_stdlib():
    c = load_corpus("")
    assert c.train.numel() > 1_000_000 and c.n_heldout_files > 10 and "standard library" in c.source


def test_profiles_load_and_say_what_they_are_for():
    for name in ("cpu-tiny", "cpu-small", "strix-small", "strix-large"):
        cfg = load(name)
        text = (ROOT / "minagi" / "lm" / "profiles" / f"{name}.toml").read_text()
        assert text.startswith("# ") and cfg.profile == name
    large = load("strix-large").model
    assert large.n_pool - large.n_slots < large.n_slots // 10  # nearly the whole pool on the card
    with pytest.raises(ConfigError):
        load("cpu-tiny", ["train.lr=-1"])


def test_pool_in_host_memory_trains(tmp_path, text_file):
    # model.pool_device keeps the pool where the profile says (host memory on a GPU machine);
    # here both are the CPU, so this checks the plumbing: build, a step, a checkpoint, a resume.
    cfg = load("cpu-tiny", [*TINY, "model.pool_device=cpu", "train.steps=3", "train.checkpoint_every=3",
                            f"data.path={text_file}"])
    train(cfg, tmp_path, progress=False)
    ckpt = checkpoint.load(tmp_path)
    assert ckpt["config"]["model"]["pool_device"] == "cpu" and ckpt["model"]["pool.w_in"].device.type == "cpu"


def test_pool_lr_scale_sets_the_pools_step_and_follows_the_schedule():
    cfg = load("cpu-tiny", [*TINY, "train.pool_lr_scale=2.5", "train.warmup=4"])
    model, opt, sched = build(cfg, torch.device("cpu"))
    pool_ids = {id(p) for p in model.pool.parameters()}
    lrs = {g["pool"]: g["lr"] for g in opt.param_groups}
    assert all((id(p) in pool_ids) == g["pool"] for g in opt.param_groups for p in g["params"])
    assert lrs[True] == pytest.approx(2.5 * lrs[False])
    opt.step()  # no gradients: nothing moves, but the scheduler's step comes after one, as in training
    sched.step()  # warmup: both move by the same factor, the ratio stays
    lrs = {g["pool"]: g["lr"] for g in opt.param_groups}
    assert lrs[False] == pytest.approx(cfg.train.lr * 2 / 4) and lrs[True] == pytest.approx(2.5 * lrs[False])
    with pytest.raises(ConfigError, match="train.pool_lr_scale must be > 0"):
        load("cpu-tiny", ["train.pool_lr_scale=0"])


@pytest.mark.slow
def test_compiled_training_follows_eager(tmp_path, text_file):
    # train.compile=true: torch.compile around training's forward and backward. The experts
    # compile whole; the model's per-row halting reads break its graph, which is allowed. The
    # losses follow eager's within float32 rounding of the reordered arithmetic.
    sets = TINY + [f"data.path={text_file}", "train.steps=4", "train.eval_every=4", "train.checkpoint_every=4"]
    eager = train(load("cpu-tiny", sets), tmp_path / "eager", progress=False)
    compiled = train(load("cpu-tiny", sets + ["train.compile=true"]), tmp_path / "compiled", progress=False)
    assert compiled["step"] == 4
    assert abs(compiled["heldout_bpc"] - eager["heldout_bpc"]) < 1e-3 * eager["heldout_bpc"]
    assert _history(tmp_path / "compiled")[-1]["train_loss"] == pytest.approx(
        _history(tmp_path / "eager")[-1]["train_loss"], rel=1e-3)


# --- What a run says while it runs: the time left, the held-out trend ------------------------

def test_the_time_left_comes_from_the_recent_steps():
    from minagi.lm.progress import Pace, duration

    assert [duration(s) for s in (0, 42.4, 185, 3725)] == ["0s", "42s", "3m05s", "1h02m"]
    pace = Pace(window=10)
    assert pace.left(100) is None  # no step seen yet
    for _ in range(50):
        pace.step(1.0)  # the run's first 50 steps: 1 s each
    assert pace.left(100) == pytest.approx(100.0)
    for _ in range(10):
        pace.step(0.25)  # then 4x faster (other work gone, rows that halt sooner): the window's pace
    assert pace.left(100) == pytest.approx(25.0)
    pace.evaluated(3.0)  # an evaluation (and its checkpoint) took 3 s: each one left counts it
    assert pace.left(100, evals_left=4) == pytest.approx(25.0 + 12.0)


def test_evaluations_left_counts_the_steps_that_evaluate():
    from minagi.lm.config import TrainConfig
    from minagi.lm.trainer import evaluates, evaluations_left

    for steps, every, ckpt in [(1500, 250, 500), (30, 10, 10), (31, 10, 4), (7, 3, 5), (12, 12, 5), (5, 100, 200)]:
        t = TrainConfig(steps=steps, eval_every=every, checkpoint_every=ckpt)
        for step in range(steps + 1):
            want = sum(evaluates(t, s, s == steps) for s in range(step + 1, steps + 1))
            assert evaluations_left(t, step) == want, (steps, every, ckpt, step)


def test_the_heldout_line_shows_its_trend(capsys):
    from minagi.lm.progress import Progress, trend

    assert trend(250, 2.39, None) == "step 250: held-out 2.390 bits per byte"
    assert trend(500, 2.31, (250, 2.39)) == "step 500: held-out 2.310 bits per byte (-0.080 since step 250)"
    assert trend(90, 2.0, (60, float("nan"))) == "step 90: held-out 2.000 bits per byte"  # a resume without a score
    bar = Progress(1000, 0)  # stderr is captured: plain lines
    bar.heldout(250, 2.39)
    bar.heldout(500, 2.40)
    assert capsys.readouterr().err.splitlines() == [
        "step 250: held-out 2.390 bits per byte", "step 500: held-out 2.400 bits per byte (+0.010 since step 250)"]
    resumed = Progress(1000, 500, last_heldout=(500, 2.40))
    resumed.heldout(750, 2.2)
    assert capsys.readouterr().err.strip().endswith("(-0.200 since step 500)")


def test_progress_lines_show_the_time_left(capsys):
    from minagi.lm.progress import Progress

    bar = Progress(40, 0, evals_left=lambda step: (40 - step) // 10)  # a line every 2 steps
    for step in range(1, 7):
        bar.update(step, 2.0, 1000.0, 1.5, seconds=0.5)
    bar.pace.evaluated(2.0)
    bar.update(7, 2.0, 1000.0, 1.5, seconds=0.5)
    bar.update(8, 2.0, 1000.0, 1.5, seconds=0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "step 2/40  loss 2.000  1,000 char/s  rows 1.50"  # too few steps for a pace
    assert lines[1] == "step 4/40  loss 2.000  1,000 char/s  rows 1.50  18s left"  # 36 steps x 0.5 s
    assert lines[-1] == "step 8/40  loss 2.000  1,000 char/s  rows 1.50  22s left"  # 16 s + 3 evaluations x 2 s


# --- A shared machine: threads that follow the free cores (minagi/lm/cores.py) -----------------

def test_other_work_is_read_from_the_cpus_busy_time_less_this_process():
    from minagi.lm import cores

    stat = ("cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 100 0 50 400 10 0 5 5 0 0\ncpu1 200 10 20 300 0 1 1 0 7 0\n"
            "cpu2 1000 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")
    assert cores.parse_stat(stat, {0, 1}, 0.01) == pytest.approx((160 + 232) * 0.01)  # idle, iowait, cpu2 not counted
    a, b = cores.Reading(10.0, 100.0, 5.0), cores.Reading(15.0, 109.0, 9.0)
    assert cores.others(a, b) == pytest.approx(1.0)  # 9 busy CPU-seconds in 5 s, 4 of them this process's
    assert cores.others(a, cores.Reading(15.0, 102.0, 9.0)) == 0.0  # ticks rounded: never below nothing
    assert [cores.taken(x) for x in (0.0, 0.5, 0.6, 0.8, 1.55, 1.6, 2.2)] == [0, 0, 1, 1, 1, 2, 2]


def test_auto_threads_follow_the_free_cores_and_say_so_once():
    from minagi.lm.cores import Policy

    p = Policy(cores=2, threads=2, pinned=False)
    assert p.interval(0.1, 14_000) == (None, None)  # quiet: the pace to compare with
    threads, line = p.interval(0.7, 3_400)  # a busy process beside it: the run collapsed
    assert threads == 1 and line == (
        "minagi: other work is using 0.7 of this machine's 2 cores, training at 3,400 char/s, down from 14,000: "
        "now 1 thread (train.threads = 0 follows the free cores; a pinned train.threads keeps its threads and its "
        "bits)")
    assert p.interval(1.0, 9_000) == (None, None)  # one thread beside it: nothing to change
    assert p.interval(0.0, 9_000) == (None, None)  # the core came free: once is not yet enough
    assert p.interval(0.0, 9_000) == (2, None)  # twice: taken back, silently
    assert p.interval(1.8, 2_000) == (1, None)  # two busy processes: one thread again, nothing said again
    assert p.interval(0.1, 9_000) == (None, None) and p.interval(1.0, 9_000) == (None, None)  # a calm interval alone
    threads, line = Policy(cores=8, threads=8, pinned=False).interval(2.7, None)  # at the start-up: no pace yet
    assert threads == 5 and line.startswith("minagi: other work is using 2.7 of this machine's 8 cores: now 5 threads")


def test_a_pinned_run_keeps_its_threads_and_only_says_it_slowed():
    from minagi.lm.cores import Policy

    p = Policy(cores=2, threads=2, pinned=True)
    assert p.interval(0.0, 14_000) == (None, None)
    assert p.interval(0.8, 13_000) == (None, None)  # other work, but no slowdown worth a word
    threads, line = p.interval(0.8, 3_000)
    assert threads is None and line == (
        "minagi: other work is using 0.8 of this machine's 2 cores, training at 3,000 char/s, down from 14,000: "
        "train.threads = 2 is pinned, so it stays (its runs are bit-reproducible); train.threads = 0 would follow "
        "the free cores")
    assert all(p.interval(x, 2_000) == (None, None) for x in (1.5, 0.0, 0.0, 0.9))  # never changed, said once
    one = Policy(cores=2, threads=1, pinned=True)
    assert one.interval(1.0, None) == (None, None)  # one pinned thread beside one busy process: no crowding


def test_the_watch_looks_at_the_machine_and_sets_the_threads():
    from minagi.lm import cores

    clock, readings, set_to, said = [0.0], [], [], []
    watch = cores.Watch(cores.Policy(2, 2, pinned=False), said.append, cores.Reading(0.0, 0.0, 0.0),
                        reader=lambda: readings.pop(0), clock=lambda: clock[0], set_threads=set_to.append)
    clock[0] = cores.INTERVAL_S - 0.1
    watch.step(1024, 0.1)  # before INTERVAL_S: no look
    assert (set_to, said) == ([], [])
    clock[0] = cores.INTERVAL_S
    readings.append(cores.Reading(cores.INTERVAL_S, 3.0, 0.2))  # others took 0.56 of a core: not one
    watch.step(1024, 0.1)
    assert (set_to, said) == ([], [])
    clock[0] = 2 * cores.INTERVAL_S
    readings.append(cores.Reading(clock[0], 3.0 + 6.5, 0.2 + 3.0))  # others: 3.5 CPU-seconds in 5 s
    watch.step(1024, 0.5)
    assert set_to == [1] and len(said) == 1  # the first look's pace (2,048 chars in 0.2 s) was the quiet one
    assert said[0].startswith("minagi: other work is using 0.7 of this machine's 2 cores, training at 2,048 "
                              "char/s, down from 10,240: now 1 thread")


def test_the_watch_is_off_off_the_cpu_under_torchrun_and_when_asked(monkeypatch):
    from minagi.lm import cores

    first = cores.Reading(0.0, 0.0, 0.0)
    monkeypatch.setenv("MINAGI_WATCH_CORES", "1")
    assert cores.start(None, "cpu", False, 0, print) is None  # no /proc/stat
    assert cores.start(first, "cuda", False, 0, print) is None
    assert cores.start(first, "cpu", True, 0, print) is None  # the other ranks are this run's own work
    monkeypatch.setenv("MINAGI_WATCH_CORES", "0")
    assert cores.start(first, "cpu", False, 0, print) is None


@pytest.mark.slow
def test_the_shared_bench_runs_each_kind_in_each_condition():
    # python -m minagi.bench shared: only that it runs and reports (its figures are docs/benchmarks.md's).
    from conftest import run_bench

    r = run_bench("shared", "--steps", 4, "--skip", 1, "--conditions", "quiet,busy1", "--runs", "new,one")
    assert r.returncode == 0, r.stderr
    table = r.stdout.split("\ncondition")[1].splitlines()
    assert table[0].split() == ["new", "char/s", "one", "char/s", "new/one"]
    assert [line.split()[0] for line in table[1:]] == ["quiet", "busy1"]
    assert r.stdout.count(" thread(s) at the end") == 4
