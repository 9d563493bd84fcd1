"""The quality bench's twins (python -m minagi.bench quality) and the bits-per-byte labels."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.bench.quality import (DEFAULT_MODELS, MODELS, DenseGPT, dense_macs, dense_twin, minagi_macs, models,
                                  n_params, tables_twin, wide_twin)
from minagi.lm.config import load
from minagi.lm.model import ByteModel

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.d_hidden=48"]


@pytest.mark.parametrize("profile", ["cpu-tiny", "cpu-small", "strix-small", "strix-large"])
def test_pool_twin_has_the_same_active_width_and_cost(profile):
    cfg = load(profile, [])
    twin = dense_twin(cfg).model
    m = cfg.model
    assert (twin.n_pool, twin.n_slots, twin.top_k, twin.balance) == (1, 1, 1, "none")
    assert twin.d_hidden == m.top_k * m.d_hidden
    # Everything but the pool is the profile's: the same rows, inputs and attention.
    same = ("d_model", "n_heads", "max_rows", "adaptive_rows", "ngram", "ngram_buckets", "ponder_cost")
    assert all(getattr(twin, k) == getattr(m, k) for k in same)
    ratio = minagi_macs(twin, cfg.data.context) / minagi_macs(m, cfg.data.context)
    assert 0.95 <= ratio <= 1.05, ratio


def test_wide_twin_holds_the_whole_pool_in_one_mlp():
    cfg = load("cpu-tiny", [])
    m, wide = cfg.model, wide_twin(cfg).model
    assert (wide.n_pool, wide.n_slots, wide.top_k, wide.d_hidden) == (1, 1, 1, m.n_pool * m.d_hidden)
    pool, one = ByteModel(m, 16).pool, ByteModel(wide, 16).pool
    # The same expert parameters, all in one MLP that every character uses.
    assert one.w_in.numel() + one.w_out.numel() == pool.w_in.numel() + pool.w_out.numel()
    # Counted from the two models' own weights: each row's experts and router differ, and the
    # router once more (the pool affinity); attention, the halting unit and the head do not.
    experts = lambda c, p: c.top_k * (p.w_in[0].numel() + p.w_out[0].numel())  # noqa: E731
    per_row = experts(wide, one) - experts(m, pool) + one.router.numel() - pool.router.numel()
    extra = minagi_macs(wide, 128) - minagi_macs(m, 128)
    assert extra == m.max_rows * per_row + one.router.numel() - pool.router.numel()
    assert "minagi-wide" in MODELS and "minagi-wide" not in DEFAULT_MODELS


def test_tables_twin_spends_the_pools_parameters_on_the_ngram_tables(tmp_path):
    cfg = load("cpu-tiny", [])
    tw, twin = tables_twin(cfg).model, dense_twin(cfg).model
    assert tw.ngram_buckets > cfg.model.ngram_buckets and tw.d_hidden == twin.d_hidden and tw.n_pool == 1
    # The profile's parameters to within one bucket per table; the dense twin's multiply-adds.
    gap = n_params(cfg) - n_params(tables_twin(cfg))
    assert 0 <= gap < (tw.ngram - 1) * tw.d_model, gap
    assert minagi_macs(tw, cfg.data.context) == minagi_macs(twin, cfg.data.context)
    assert "minagi-tables" in models(cfg) and "minagi-tables" not in DEFAULT_MODELS
    bad = _bench("--models", "minagi,minagi-tables", "--set", "model.ngram=1", "--seconds", "1")
    assert bad.returncode != 0 and "has none (model.ngram = 1)" in bad.stderr, bad.stderr


def test_macs_are_counted_from_the_shapes():
    # Count a ByteModel's matmuls by hand against the formula: weights each character touches
    # per row (attention's qkv and proj, the router over the card, top_k experts' two matrices,
    # the halting unit), plus the pool affinity and the head once.
    cfg = load("cpu-tiny", [])
    m = cfg.model
    model = ByteModel(m, cfg.data.context)
    per_row = (model.attn.qkv.weight.numel() + model.attn.proj.weight.numel() + model.pool.router.numel()
               + m.top_k * (model.pool.w_in[0].numel() + model.pool.w_out[0].numel()) + model.halt.weight.numel())
    attention = m.d_model * (cfg.data.context + 1)
    once = model.pool.router.numel() + model.head.weight.numel()
    assert minagi_macs(m, cfg.data.context) == m.max_rows * (per_row + attention) + once
    gpt = DenseGPT()
    block = sum(p.numel() for n, p in gpt.blocks[0].named_parameters() if n.endswith("weight") and "ln" not in n)
    assert dense_macs(gpt) == 4 * (block + 128 * 65) + gpt.head.weight.numel()


def test_dense_ngram_twin_takes_the_profiles_inputs():
    cfg = load("cpu-tiny", [])
    table = models(cfg)
    assert tuple(table) == MODELS
    gpt = DenseGPT(ngram=cfg.model.ngram, ngram_buckets=cfg.model.ngram_buckets)
    assert len(gpt.ngram_embed) == cfg.model.ngram - 1
    assert all(e.weight.shape == (cfg.model.ngram_buckets, 128) and not e.weight.any() for e in gpt.ngram_embed)
    # Lookups cost no multiply-adds: the twin costs what the plain GPT costs.
    assert table["dense-ngram"][1] == table["dense"][1]
    # Zero tables: at first it computes exactly the plain GPT (same seed), and the inputs reach it.
    torch.manual_seed(0)
    plain = DenseGPT()
    torch.manual_seed(0)
    gpt = DenseGPT(ngram=3, ngram_buckets=97)
    x = torch.randint(0, 256, (2, 64))
    torch.testing.assert_close(gpt(x), plain(x))
    gpt(x).sum().backward()
    assert all(e.weight.grad.abs().sum() > 0 for e in gpt.ngram_embed)


def _bench(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "minagi.bench", "quality", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_bench_quality_models_seconds_and_data(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # a hash split by file: some fall on the held-out side
        (corpus / f"f{i}.txt").write_text(f"line {i}: the quick brown fox jumps over the lazy dog.\n" * 30)
    out = tmp_path / "q.json"
    r = _bench("--seconds", "3", "--models", "minagi-dense,dense-ngram,minagi", "--eval-bytes", "2000",
               "--data", str(corpus), "--json", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["dense-ngram", "minagi-dense", "minagi"]  # in the bench's order
    assert data["seconds"] == 3 and str(corpus) in data["data"]
    for v in data["results"].values():
        assert 0 < v["heldout_bits_per_byte"] < 9 and v["steps"] >= 1 and v["seconds"] >= 3
        assert v["macs_per_char"] > 0
    assert set(data["gaps"]) == {"dense-ngram", "minagi-dense"}
    assert "bits per byte" in r.stdout and "minagi ahead by" in r.stdout


def test_bench_quality_equal_steps(tmp_path):
    out = tmp_path / "q.json"
    r = _bench("--steps", "3", "--models", "minagi-wide,minagi", "--eval-bytes", "500", "--json", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["steps"] == 3 and data["seconds"] is None
    assert [v["steps"] for v in data["results"].values()] == [3, 3]
    assert set(data["gaps"]) == {"minagi-wide"} and "3 steps each" in r.stdout
    assert "design:" not in r.stdout.split("held-out bits per byte on")[1]  # targets are for equal wall-clock


def test_bench_quality_rejects_unknown_models():
    r = _bench("--models", "dense,gpt4")
    assert r.returncode != 0 and "unknown gpt4" in r.stderr and "minagi-dense" in r.stderr


def test_labels_say_bits_per_byte(tmp_path, capsys, monkeypatch):
    from minagi.lm.trainer import train

    cfg = load("cpu-tiny", ["train.steps=2", "train.eval_every=2", "train.eval_chunks=2", "train.checkpoint_every=2",
                            "model.d_model=32", "model.n_heads=2", "model.d_hidden=48", "data.context=32"])
    train(cfg, tmp_path / "run")
    assert "held-out" in (err := capsys.readouterr().err) and "bits per byte" in err
    (tmp_path / "t.txt").write_text("def f(x):\n    return x\n" * 5)
    r = subprocess.run([sys.executable, "-m", "minagi", "eval", str(tmp_path / "run"), "--data", str(tmp_path / "t.txt")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "bits per byte" in r.stderr and float(r.stdout.strip().splitlines()[-1]) > 0
    pytest.importorskip("matplotlib")
    from minagi.lm import plot

    import matplotlib.figure

    drawn = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig), save(fig, *a, **k)))
    assert plot.plot_history(tmp_path / "run").exists()
    labels = [t for ax in drawn[0].axes for t in (ax.get_title(), ax.get_ylabel()) if "bits per" in t]
    assert labels and all("bits per byte" in t for t in labels)  # the byte model's words, not "per character"


def test_docs_corpus_tool(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools/docs_corpus.py"), str(tmp_path / "docs")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    files = list((tmp_path / "docs").glob("*.txt"))
    assert len(files) > 100 and sum(f.stat().st_size for f in files) > 1_000_000
    assert "re - Support for regular expressions" in (tmp_path / "docs" / "re.txt").read_text()
    assert not any(" at 0x" in f.read_text() for f in files)


def test_runs_advance_on_their_own_clocks_in_alternating_blocks(monkeypatch):
    from minagi.bench import slices
    from minagi.bench.slices import Budget, Run, interleave

    now = [0.0]  # a fake clock (binary fractions: exact sums): steps of 1/64 s and 1/32 s; 1 s between slices
    monkeypatch.setattr(slices.time, "perf_counter", lambda: now[0])
    calls, factors = [], []

    def run(name, seconds, step_s):
        def step():
            calls.append(name)
            now[0] += step_s
            return 0.0
        r = Run(name, Budget(seconds), step, factors.append, 2, 0.1, lambda m: None)
        advance = r.advance
        r.advance = lambda s: (advance(s), now.__setitem__(0, now[0] + 1.0))  # another run's time passes
        return r

    a, b = run("a", 0.25, 1 / 64), run("b", 0.75, 1 / 32)
    interleave([a, b], 1 / 16, lambda m: None)
    # Each was charged only its own steps' time (the seconds between its slices count nowhere).
    assert (a.step, b.step) == (16, 24) and (a.elapsed, b.elapsed) == (0.25, 0.75)
    switches = sum(x != y for x, y in zip(calls, calls[1:]))
    assert switches >= 4  # alternating blocks (rotated each round), not one run then the other
    assert factors[:2] == [0.5, 1.0] and min(factors) >= 0.1 - 1e-9  # warmup, then cosine down to min_frac


def test_heldout_sample_spreads_over_the_whole_split():
    from minagi.bench.slices import heldout_sample

    held = torch.arange(100_000) % 251
    chunks = heldout_sample(held, 16384)
    assert sum(c.numel() for c in chunks) == 16384 and len(chunks) == 4
    starts = [int(c[0]) for c in chunks]  # values equal positions mod 251: find each start
    assert torch.equal(chunks[0], held[:4096]) and torch.equal(chunks[-1], held[-4096:])
    assert len(set(starts)) == 4
    assert heldout_sample(held[:1000], 16384)[0].numel() == 1000  # a short split is scored whole


def test_bench_quality_interleaved_seeds_and_own_budgets(tmp_path):
    out = tmp_path / "q.json"
    r = _bench("--seconds", "2", "--models", "minagi-dense@3,minagi", "--interleave", "1", "--seeds", "2",
               "--eval-bytes", "1000", "--json", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["minagi-dense@3", "minagi"] and data["interleave"] == 1 and data["seeds"] == 2
    for label, budget in (("minagi-dense@3", 3), ("minagi", 2)):
        v = data["results"][label]
        assert [run["seed"] for run in v["runs"]] == [0, 1] and v["seconds_budget"] == budget
        assert all(run["seconds"] >= budget for run in v["runs"])
        bpbs = [run["heldout_bits_per_byte"] for run in v["runs"]]
        assert v["half_range"] == pytest.approx((max(bpbs) - min(bpbs)) / 2)
    assert "interleaved in 1 s blocks" in r.stdout and "+-" in r.stdout and "seed 1" in r.stdout
    assert "design:" not in r.stdout.split("held-out bits per byte on")[1]  # not at equal time: not judged


def test_bench_quality_variants_are_minagi_models_with_more_settings(tmp_path):
    out = tmp_path / "q.json"
    # The profile's experts are SwiGLU (TINY: d_hidden 48); the variant's gelu experts at 72.
    r = _bench("--steps", "2", "--models", "minagi,gelu", "--variant",
               "gelu:model.expert_activation=gelu,model.d_hidden=72", "--eval-bytes", "500", "--json", str(out),
               *TINY)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert list(data["results"]) == ["minagi", "gelu"] and set(data["gaps"]) == {"gelu"}
    # Equal multiply-adds: swiglu's w_in is 2h wide, so its h = 48 costs what gelu's 72 does.
    assert data["results"]["gelu"]["macs_per_char"] == data["results"]["minagi"]["macs_per_char"]
    assert data["variants"] == {"gelu": ["model.expert_activation=gelu", "model.d_hidden=72"]}
    # Its settings are applied: another model, another score (the same seed and batches).
    assert data["results"]["gelu"]["heldout_bits_per_byte"] != data["results"]["minagi"]["heldout_bits_per_byte"]
    bad = _bench("--variant", "dense:model.top_k=1")
    assert bad.returncode != 0 and "NAME new" in bad.stderr
    bad = _bench("--models", "minagi@600,dense", "--seconds", "1")
    assert bad.returncode != 0 and "--reference 'minagi' is not among" in bad.stderr and "minagi@600" in bad.stderr
