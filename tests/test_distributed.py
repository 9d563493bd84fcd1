"""Data parallelism under torchrun (2 ranks, 4 for expert parallelism in two groups; gloo, one
thread each, a free port: --standalone rendezvous on port 0, train.dist_timeout on every
collective): ranks against one process with the global batch and with gradient accumulation, a
card smaller than the pool, an expert with no character on one rank, replicas checked, SIGTERM
and resume, a distributed checkpoint in one process, a rank that dies."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.lm import checkpoint, distributed
from minagi.lm.config import load
from minagi.lm.data import Batches
from minagi.moe.reference import GATED

from test_trainer import TINY, _cli, _history

ROOT = Path(__file__).resolve().parent.parent
# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")]

# Eight steps, checkpoints every four, one thread; the card smaller than the pool (6 experts, 4 on it).
ARGS = [*sum((["--set", s] for s in TINY if not s.startswith("train.batch")), []), "--steps", "8",
        "--set", "train.checkpoint_every=4", "--set", "train.eval_every=4", "--set", "train.threads=1"]


def torchrun(*args, script="train.py", env_extra=None, timeout=300, nproc=2):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def plain(*args):
    """python train.py ARGS in one process (no torchrun)."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def weights(run) -> dict:
    return checkpoint.load(run)["model"]


def assert_same_weights(a, b, rel=5e-3):
    """Equal up to float summation order (AdamW's first steps magnify the tiny differences of
    gradients near zero, so the bound is relative to each tensor's largest weight)."""
    wa, wb = weights(a), weights(b)
    for k in wa:
        if wa[k].is_floating_point():
            err = (wa[k] - wb[k]).abs().max().item()
            assert err <= rel * wa[k].abs().max().item() + 1e-7, f"{k}: off by {err}"


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("balance", ["load", "admission"])
def test_two_ranks_equal_one_process_with_the_global_batch_and_with_grad_accum(tmp_path, balance):
    b = ["--set", f"model.balance={balance}"]
    ranks, one, accum = tmp_path / "ranks", tmp_path / "one", tmp_path / "accum"
    proc = ok(torchrun("--quiet", *ARGS, *b, "--set", "train.batch=2", "--out", str(ranks)))
    ok(_cli(*ARGS, *b, "--set", "train.batch=4", "--out", str(one)))
    assert_same_weights(one, ranks)  # replicas bit-identical: checked at every checkpoint, or the run fails
    hist_r, hist_1 = _history(ranks), _history(one)
    assert [r["step"] for r in hist_r] == [4, 8]
    for r, o in zip(hist_r, hist_1):
        assert abs(r["train_loss"] - o["train_loss"]) < 1e-3 * abs(o["train_loss"])  # the global loss
    ckpt = torch.load(ranks / "checkpoint.pt")
    assert ckpt["world"] == 2 and len(ckpt["rng"]["ranks"]) == 2
    assert "done: step 8" in proc.stdout and proc.stdout.count("done:") == 1  # rank 0 speaks
    if balance == "admission":  # linear in the batch given the card: accumulation matches too
        ok(_cli(*ARGS, *b, "--set", "train.batch=2", "--set", "train.grad_accum=2", "--out", str(accum)))
        assert_same_weights(one, accum)
        assert [r["step"] for r in _history(accum)] == [4, 8]


def test_fixed_rows_leave_the_unused_halting_unit_out_of_ddp(tmp_path):
    # Without adaptive rows nothing uses the halting unit: DDP (no find_unused_parameters) would
    # stop at the second step waiting for its gradient.
    ok(torchrun("--quiet", *ARGS, "--set", "train.batch=2", "--set", "model.adaptive_rows=false", "--steps", "4",
                "--out", str(tmp_path)))
    assert [r["step"] for r in _history(tmp_path)] == [4]


@pytest.mark.parametrize("case", ["empty", "card", "drift"])
def test_ddp_gradients_against_one_process(tmp_path, case):
    """tests/dist_worker.py: an expert with no character on one rank; a card smaller than the pool
    with the load term summed across ranks; a replica that drifted by one bit."""
    ok(torchrun(case, str(tmp_path), script="tests/dist_worker.py"))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if case == "drift":
        for r in res:
            first, as_shard, by_design, other_shard = r["errors"]
            assert first == as_shard and "on rank 1 differs from its replica's (attn.proj.weight)" in first
            assert by_design is None and other_shard == first
        return
    assert res[0]["max_err"] < 1e-5 and res[1]["max_err"] < 1e-5
    if case == "empty":  # rank 1 sent nothing to experts 2..5, rank 0 did
        assert all(load[2:] == [0, 0, 0, 0] for load in res[1]["loads"])
        assert all(sum(load[2:]) > 0 for load in res[0]["loads"])
    else:
        assert res[0]["card"] == res[1]["card"] and len(res[0]["card"]) == 3


@pytest.mark.parametrize("routing", ["uniform", "sink", "empty"])
def test_expert_parallel_dispatch_equals_one_process(tmp_path, routing):
    """minagi.moe.expert_parallel: 6 experts, 3 per rank, pairs sent to their expert's rank and back
    (float64): outputs and every gradient equal one process's expert_mlp over both ranks'
    characters; "empty": rank 1's experts get no pair at all."""
    ok(torchrun(f"ep-{routing}", str(tmp_path), script="tests/dist_worker.py"))
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["max_err"] < 1e-9 for r in (0, 1))


def test_expert_parallel_gradients_in_two_groups_equal_one_process(tmp_path):
    """4 ranks, E = 2: each expert shard's gradient averaged over the two ranks that hold it (and
    DDP's over all four) equals one process's gradient of the global batch's mean loss."""
    ok(torchrun("ep-grads", str(tmp_path), script="tests/dist_worker.py", nproc=4))
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["max_err"] < 1e-5 for r in range(4))


def test_expert_parallel_ranks_meet_in_every_row_when_their_characters_halt_apart(tmp_path):
    ok(torchrun("ep-rows", str(tmp_path), script="tests/dist_worker.py", timeout=120))
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["rows"] for r in res] == [r["oracle_rows"] for r in res] == [1.0, 4.0]  # rank 0 stops after row 1
    assert res[0]["max_err"] < 1e-5 and res[1]["max_err"] < 1e-5


def test_expert_parallel_training_equals_one_process_and_its_checkpoint_loads_in_one(tmp_path):
    # The whole pool on the card (expert parallelism's condition), 3 experts per rank; no n-gram
    # tables (zero-initialised, AdamW's first steps magnify their float noise), so the bound is tight.
    ep = ["--set", "model.n_slots=6", "--set", "model.ngram=1"]
    ranks, one = tmp_path / "ranks", tmp_path / "one"
    stopped = torchrun("6", "TERM", "--quiet", *ARGS, *ep, "--set", "train.batch=2", "--set", "train.expert_parallel=2",
                       "--out", str(ranks), script="tests/signal_at_step.py")
    assert "stopped by SIGTERM at step 6" in stopped.stderr, stopped.stderr[-2000:]
    # DCP: checkpoint.pt without the experts, beside the one shard folder it names.
    ckpt = torch.load(ranks / "checkpoint.pt")
    folders = sorted(d.name for d in ranks.glob("experts-*"))
    assert "pool.w_in" not in ckpt["model"] and folders == [ckpt["experts"]["folder"]]
    assert folders[0].startswith("experts-00000006-") and (ranks / folders[0] / ".metadata").exists()
    gated = load("cpu-tiny", []).model.expert_activation in GATED  # a gated w_in holds gate and up
    assert ckpt["experts"]["tensors"]["model/pool.w_in"][0] == [6, 32, 96 if gated else 48]
    whole = checkpoint.load(ranks)  # in one process: the whole pool, and its optimizer state
    assert whole["model"]["pool.w_in"].shape[0] == 6 and "experts" not in whole
    pool = [st for st in whole["optimizer"]["state"].values() if st["exp_avg"].dim() == 3]  # w_in, w_out
    assert len(pool) == 2 and all(st[k].shape[0] == 6 for st in pool for k in ("exp_avg", "exp_avg_sq", "step"))
    shutil.copytree(ranks, tmp_path / "copy")
    (tmp_path / "torn").mkdir()  # checkpoint.pt copied without its shard folder
    shutil.copy(ranks / "checkpoint.pt", tmp_path / "torn")
    torn = plain("write", str(tmp_path / "torn"), "--chars", "5")
    assert torn.returncode == 2 and "missing or incomplete" in torn.stderr and "experts-" in torn.stderr
    ok(torchrun("--quiet", *ARGS, *ep, "--set", "train.batch=2", "--set", "train.expert_parallel=2", "--out",
                str(ranks), "--resume"))  # at the same world size
    ok(_cli(*ARGS, *ep, "--set", "train.batch=4", "--out", str(one)))
    # 2e-5: pool.w_in's float noise, magnified by AdamW's first steps, read 3.0e-6 and (with the
    # CPU's own SwiGLU backward, bit for bit the same on either side) 9.1e-6 of 7.7e-6 at 1e-5;
    # a wrong expert or gradient is off by orders more.
    assert_same_weights(one, ranks, rel=2e-5)
    assert len(list(ranks.glob("experts-*"))) == 1  # the step-6 folder pruned after step 8's save
    w = ok(plain("write", str(ranks), "--prompt", "def ", "--chars", "10"))
    assert w.stdout.startswith("def ")
    (tmp_path / "t.txt").write_text("def f(x):\n    return x\n" * 4)
    e = ok(plain("eval", str(ranks), "--data", str(tmp_path / "t.txt")))
    assert float(e.stdout.split()[-1]) > 0
    again = ok(plain(*ARGS, "--set", "train.batch=2", "--out", str(tmp_path / "copy"), "--resume"))  # one process
    assert "saved by 2 rank(s), this run has 1" in again.stderr and "done: step 8" in again.stdout


def test_expert_parallel_in_two_groups_equals_one_process_and_reshards_on_resume(tmp_path):
    """4 ranks, E = 2: two expert-parallel groups, each shard held by a data-parallel pair (its
    gradient averaged over the pair, written once through Replicate), stopped by SIGTERM on rank 3
    and resumed: equal to one process. The stopped checkpoint also resumes on 2 ranks, with E = 2
    (one group: DCP reads each rank's rows) and with plain DDP (the pool read whole), alike."""
    ep = ["--set", "model.n_slots=6", "--set", "model.ngram=1"]
    four, one = tmp_path / "four", tmp_path / "one"
    e2 = ["--set", "train.expert_parallel=2"]
    stopped = torchrun("6", "TERM", "--quiet", *ARGS, *ep, "--set", "train.batch=1", *e2, "--out", str(four),
                       script="tests/signal_at_step.py", env_extra={"SIGNAL_RANK": "3"}, nproc=4)
    assert "stopped by SIGTERM at step 6" in stopped.stderr, stopped.stderr[-2000:]
    assert torch.load(four / "checkpoint.pt")["world"] == 4
    for name in ("ep2", "ddp"):
        shutil.copytree(four, tmp_path / name)
    ok(torchrun("--quiet", *ARGS, *ep, *e2, "--out", str(four), "--resume", nproc=4))
    ok(_cli(*ARGS, *ep, "--set", "train.batch=4", "--out", str(one)))
    # Summation order only: 1e-5 held for gelu experts; SwiGLU's product of two GEMM outputs left
    # 1.6e-5 of the largest weight after the 4-rank run's steps.
    assert_same_weights(one, four, rel=5e-5)
    for name, launch in (("ep2", e2), ("ddp", [])):  # the saved batch, 1 per rank: both go on from step 6 alike
        proc = ok(torchrun(*ARGS, *ep, *launch, "--out", str(tmp_path / name), "--resume"))
        assert "saved by 4 rank(s), this run has 2" in proc.stderr and "done: step 8" in proc.stdout
    assert_same_weights(tmp_path / "ep2", tmp_path / "ddp", rel=1e-5)


def test_expert_parallel_settings_are_checked():
    r = plain("--quiet", "--set", "train.expert_parallel=2", "--steps", "2")  # cpu-tiny: 16 of 16 on the card
    assert r.returncode == 2 and "train.expert_parallel = 2 needs a multiple of 2 ranks under torchrun" in r.stderr
    r = plain("--quiet", "--profile", "cpu-small", "--set", "train.expert_parallel=2")
    assert r.returncode == 2 and "model.n_slots (32) must equal model.n_pool (48)" in r.stderr
    r = plain("--quiet", "--set", "train.expert_parallel=3")
    assert r.returncode == 2 and "must divide model.n_pool (16)" in r.stderr


def test_a_resumed_run_checks_the_commands_layout_against_the_saved_model(tmp_path):
    ok(plain("--quiet", *ARGS, "--set", "train.batch=2", "--steps", "2", "--out", str(tmp_path)))  # 4 of 6 on the card
    r = plain("--quiet", *ARGS, "--set", "train.expert_parallel=2", "--out", str(tmp_path), "--resume")
    assert r.returncode == 2 and "model.n_slots (4) must equal model.n_pool (6)" in r.stderr, r.stderr[-1500:]


def test_sigterm_on_one_rank_checkpoints_once_and_resume_is_exact(tmp_path):
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    ok(torchrun("--quiet", *ARGS, "--set", "train.batch=2", "--out", str(full)))
    proc = torchrun("6", "TERM", "--quiet", *ARGS, "--set", "train.batch=2", "--out", str(stopped),
                    script="tests/signal_at_step.py", env_extra={"SIGNAL_RANK": "1"})
    assert proc.returncode != 0 and "stopped by SIGTERM at step 6" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("Resume with: the same torchrun command with --resume") == 1
    assert torch.load(stopped / "checkpoint.pt")["step"] == 6
    ok(torchrun("--quiet", *ARGS, "--set", "train.batch=2", "--out", str(stopped), "--resume"))
    a, b = weights(full), weights(stopped)
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, b = _history(full), [r for r in _history(stopped) if r["step"] != 6]  # 6: the signal's own record
    assert [r["step"] for r in a] == [r["step"] for r in b] == [4, 8]
    for x, y in zip(a, b):  # the window cut at step 6 carries on
        assert x["train_loss"] == y["train_loss"] and x["heldout_bpc"] == y["heldout_bpc"], (x, y)


def test_a_distributed_checkpoint_writes_and_resumes_in_one_process(tmp_path):
    run = tmp_path / "run"
    stopped = torchrun("4", "TERM", "--quiet", *ARGS, "--set", "train.batch=2", "--out", str(run),
                       script="tests/signal_at_step.py")  # rank 0 this time
    assert "stopped by SIGTERM at step 4" in stopped.stderr, stopped.stderr[-2000:]
    w = ok(plain("write", str(run), "--prompt", "def ", "--chars", "20"))
    assert w.stdout.startswith("def ")
    proc = ok(plain(*ARGS, "--set", "train.batch=2", "--out", str(run), "--resume"))
    assert "saved by 2 rank(s), this run has 1" in proc.stderr and "done: step 8" in proc.stdout


def test_a_rank_that_dies_stops_the_run_without_a_hang(tmp_path):
    proc = torchrun("3", "KILL", "--quiet", *ARGS, "--set", "train.batch=2", "--set", "train.dist_timeout=60",
                    "--out", str(tmp_path / "r"), script="tests/signal_at_step.py", env_extra={"SIGNAL_RANK": "1"},
                    timeout=240)
    assert proc.returncode != 0
    assert "local_rank: 1" in proc.stderr and "Signal 9 (SIGKILL)" in proc.stderr, proc.stderr[-2000:]


def test_a_checkpoint_rank_0_cannot_write_stops_every_rank_with_the_reason(tmp_path):
    (tmp_path / "checkpoint.pt.tmp").mkdir()  # rank 0's write fails; the others must not wait for it
    proc = torchrun("--quiet", *ARGS, "--set", "train.batch=2", "--set", "train.dist_timeout=60", "--out", str(tmp_path),
                    timeout=120)
    assert proc.returncode != 0 and "IsADirectoryError" in proc.stderr
    assert "rank 0 could not write the checkpoint at step 4" in proc.stderr, proc.stderr[-2000:]


def test_rank_streams_are_the_one_process_batch_split():
    data = torch.arange(1000, dtype=torch.uint8)
    one = Batches(data, 8, 6, seed=3).next_step()
    parts = [Batches(data, 8, 3, seed=3, rank=r, world=2).next_step() for r in (0, 1)]
    assert torch.equal(torch.cat([parts[0][0][0], parts[1][0][0]]), one[0][0])
    micro = Batches(data, 8, 3, seed=3, accum=2).next_step()
    assert torch.equal(torch.cat([micro[0][0], micro[1][0]]), one[0][0])


@pytest.mark.parametrize("cores,local_world,want", [(8, 2, 4), (8, 3, 2), (2, 2, 1), (1, 2, 1), (6, 1, 6)])
def test_threads_split_the_cores_among_local_ranks(monkeypatch, cores, local_world, want):
    # The cores this process may run on (its affinity, not the machine's count), shared among the
    # ranks on this machine, at least one each; a set train.threads is kept as it is.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(100, 100 + cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    d = distributed.Dist(rank=1, world=2 * local_world, local_rank=1, local_world=local_world, active=True)
    assert distributed.threads(0, d) == want
    assert distributed.threads(3, d) == 3


def test_torchrun_without_torch_distributed_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(distributed.DistributedError, match="has no torch.distributed, which torchrun needs"):
        distributed.start("cpu", 10)
    monkeypatch.delenv("WORLD_SIZE")
    assert distributed.start("cpu", 10) is distributed.SINGLE  # plain python train.py: no process group


def test_the_ddp_benchmark_writes_its_figures(tmp_path):
    from conftest import run_bench

    r = run_bench("ddp", "--steps", "3", "--rounds", "1", "--expert-parallel", "2", "--out", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "bench_ddp.json").read_text())
    assert res["char_per_s_one"] > 0 and res["char_per_s_ranks"] > 0 and res["global_batch"] == 8  # 4 x 2 ranks
    # every parameter's float32 gradient (the load balance term keeps no buffer in the state)
    w = weights(tmp_path / "one-0")
    assert res["allreduce_bytes_per_step"] == 4 * sum(t.numel() for t in w.values())
    # Expert parallelism over both ranks: the experts leave the all-reduce, their rows travel.
    experts = 4 * (w["pool.w_in"].numel() + w["pool.w_out"].numel())
    assert res["ep_allreduce_bytes_per_step"] == res["allreduce_bytes_per_step"] - experts
    assert res["char_per_s_ep"] > 0 and res["a2a_bytes_per_step"] > 0 and "expert_parallel 2:" in r.stdout


def test_resume_with_more_steps_under_torchrun(tmp_path):
    # 8 steps on 2 ranks, then --steps 12: the ranks train on to 12, and rank 0 says it once.
    run = tmp_path / "run"
    ok(torchrun("--quiet", *ARGS, "--set", "train.batch=2", "--out", str(run)))
    more = [a if a != "8" else "12" for a in ARGS]
    proc = ok(torchrun(*more, "--set", "train.batch=2", "--out", str(run), "--resume"))
    assert proc.stderr.count("resuming at step 8 and training to step 12 (planned: 8)") == 1, proc.stderr[-2000:]
    assert torch.load(run / "checkpoint.pt")["step"] == 12
    assert [r["step"] for r in _history(run)] == [4, 8, 12]
