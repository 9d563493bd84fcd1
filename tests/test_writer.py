"""Writing, evaluation and plots."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.moe import ops
from minagi.lm.cli import main
from minagi.lm.config import load
from minagi.lm.evaluate import bits_per_byte
from minagi.lm.model import ByteModel
from minagi.lm.trainer import train
from minagi.lm.writer import NO_REPEAT_NGRAM, banned_bytes, load_model, prepare_prompt, write

from conftest import assert_close
from test_model import small

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny trained run (a few steps is enough: these tests are about mechanics)."""
    d = tmp_path_factory.mktemp("run")
    cfg = load("cpu-tiny", ["train.steps=6", "train.eval_chunks=2", "train.checkpoint_every=6",
                            "model.d_model=32", "model.n_heads=2", "model.d_hidden=48", "data.context=48"])
    train(cfg, d, progress=False)
    return d


def _halting_model(seed=0, **kw):
    torch.manual_seed(seed)
    model = ByteModel(small(max_rows=4, **kw), context=24).double().eval()
    with torch.no_grad():  # spread halting over rows, so caches must handle halted characters
        model.halt.bias.fill_(0.0)
        model.halt.weight.normal_(std=2.0)
        for table in model.ngram_embed:  # n-gram tables start at zero: give them a say
            table.weight.normal_()
    return model


@pytest.mark.parametrize("adaptive,ngram", [(True, 1), (False, 1), (True, 3)])
def test_incremental_equals_full_forward(adaptive, ngram):
    model = _halting_model(adaptive_rows=adaptive, ngram=ngram, ngram_buckets=61)
    idx = torch.randint(0, 256, (1, 24))
    full = model.score(idx)
    cache = model.new_cache()
    rows = []
    for t in range(24):
        out = model.step(idx[:, t:t + 1], cache)
        rows.append(float(out.rows_used))
        assert_close(torch.log_softmax(out.logits[0, 0].double(), -1), full[0, t].double(), torch.float32,
                     msg=f"position {t}")
    if adaptive:
        assert min(rows) < max(rows)  # characters really halted at different rows


def test_writing_reads_only_top_k_experts_per_row(monkeypatch):
    model = _halting_model(n_pool=8, n_slots=8, top_k=2)
    touched = []
    table = ops.best(torch.device("cpu"))
    real, real_act = table.grouped_mm, table.grouped_mm_act

    def spy(a, b, slot_ids, slot_rows):
        touched.append(slot_ids.numel())
        return real(a, b, slot_ids, slot_rows)

    def spy_act(a, b, bias, slot_ids, slot_rows, *form):  # the first GEMM, with the activation
        touched.append(slot_ids.numel())
        return real_act(a, b, bias, slot_ids, slot_rows, *form)

    monkeypatch.setattr(table, "grouped_mm", spy)
    monkeypatch.setattr(table, "grouped_mm_act", spy_act)
    monkeypatch.setattr(ops, "best", lambda device: table)
    monkeypatch.setattr(ops, "compiled", lambda: table)
    monkeypatch.setattr(ops, "REFERENCE", table)
    cache = model.new_cache()
    out = model.step(torch.tensor([[65]]), cache)
    assert touched and all(n == 2 for n in touched)          # two GEMMs per row, each over top_k slots
    assert len(touched) == 2 * int(out.rows_used.sum())


def test_writing_is_deterministic_under_a_seed(run_dir):
    model, cfg = load_model(run_dir)
    a = write(model, b"def ", 40, seed=3)
    b = write(model, b"def ", 40, seed=3)
    c = write(model, b"def ", 40, seed=4)
    assert a.text == b.text and len(a.text) == 40 and a.text != c.text


LINE = b"print(x)\n"  # no byte twice: each one says where the line goes on


class LoopModel(torch.nn.Module):
    """A toy model whose likeliest next byte always continues LINE: greedy writing loops over it."""

    def __init__(self):
        super().__init__()
        self.rest = torch.nn.Parameter(torch.randn(256, generator=torch.Generator().manual_seed(0)))

    def new_cache(self):
        return None

    def step(self, idx, cache):
        last = int(idx[0, -1])
        logits = self.rest.detach().clone()
        logits[LINE[(LINE.index(last) + 1) % len(LINE)] if last in LINE else LINE[0]] = 10.0
        return type("Out", (), {"logits": logits.view(1, 1, 256)})


def _unique_ngrams(text: bytes, n: int) -> bool:
    grams = [text[i:i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) == len(grams)


def test_banned_bytes_are_those_that_would_repeat_an_ngram():
    assert banned_bytes(b"abcab", 3) == [ord("c")]
    assert banned_bytes(b"abxab_ab", 3) == [ord("_"), ord("x")]
    assert banned_bytes(b"aaaa", 4) == [ord("a")] and banned_bytes(b"aaa", 4) == []
    assert banned_bytes(b"abcab", 0) == []
    assert banned_bytes(b"abc" + b"." * 20 + b"ab", 3, window=10) == []  # the earlier copy is out of the window


def test_the_ngram_block_breaks_a_greedy_loop_and_zero_turns_it_off():
    model, prompt = LoopModel(), b"\n"
    looped = write(model, prompt, 120, temperature=0, no_repeat_ngram=0).text
    assert looped == (LINE * 20)[:120]  # off: plain greedy, the line forever
    for n in (8, NO_REPEAT_NGRAM):
        text = write(model, prompt, 120, temperature=0, no_repeat_ngram=n).text
        assert text != looped and text.startswith(LINE)  # the first copy is written as before
        assert _unique_ngrams(prompt + text, n)
    assert write(model, prompt, 120, temperature=0).text == write(model, prompt, 120, temperature=0,
                                                                  no_repeat_ngram=NO_REPEAT_NGRAM).text
    sampled = write(model, prompt, 200, temperature=1.0, top_p=0.9, seed=1, no_repeat_ngram=8).text
    assert _unique_ngrams(prompt + sampled, 8)


def test_the_ngram_block_ends_a_run_of_one_byte():
    model = LoopModel()
    with torch.no_grad():
        model.rest.zero_()
    model.step = lambda idx, cache: type("Out", (), {"logits": torch.eye(256)[32].view(1, 1, 256)})
    assert write(model, b" ", 50, temperature=0, no_repeat_ngram=0).text == b" " * 50
    text = write(model, b" ", 50, temperature=0, no_repeat_ngram=6).text
    assert b" " * 7 not in b" " + text and b" " * 6 in b" " + text


@pytest.mark.parametrize("kw,flag", [({"temperature": -1.0}, "--temperature must be >= 0"),
                                     ({"temperature": float("nan")}, "--temperature must be >= 0"),
                                     ({"no_repeat_ngram": 1}, "--no-repeat-ngram must be 0 \\(off\\) or >= 2"),
                                     ({"top_p": 0.0}, "--top-p must be in")])
def test_settings_that_cannot_be_used_are_refused(kw, flag):
    with pytest.raises(ValueError, match=flag):
        write(LoopModel(), b"\n", 5, **kw)


def test_write_command_refuses_a_negative_temperature(run_dir, capsys):
    assert main(["write", str(run_dir), "--temperature", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("error: --temperature must be >= 0 (0 writes greedily: the likeliest "
                                            "byte each time), got -1.0")


def test_prompts_are_cut_from_the_left_and_empty_starts_from_newline():
    notes = []
    assert prepare_prompt("", 8) == b"\n"
    assert prepare_prompt("abcdefghij", 8, notice=notes.append) == b"cdefghij" and "last 8" in notes[0]


def test_write_command(run_dir, capsys):
    assert main(["write", str(run_dir), "--prompt", "import ", "--chars", "30", "--seed", "1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("import ") and "char/s" in err.splitlines()[-1], err


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["write"], ["eval", "--data", "README.md"]])
def test_missing_or_corrupt_checkpoint(tmp_path, cmd):
    args = [sys.executable, str(ROOT / "train.py"), cmd[0], str(tmp_path), *cmd[1:]]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "no checkpoint at" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    r = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "cannot be read" in r.stderr and "Traceback" not in r.stderr


def test_eval_matches_a_direct_computation():
    model = _halting_model()
    data = torch.randint(0, 256, (70,))
    got = bits_per_byte(model, data, context=24, batch=3)
    # Direct: byte i predicted from up to 24 bytes before it (a newline before the first byte),
    # with the same half-context windows: recompute each byte's window by hand.
    seq = torch.cat([torch.tensor([10]), data])
    total = 0.0
    for i in range(70):
        start = 0 if i < 24 else ((i - 24) // 12 + 1) * 12
        window = seq[start:i + 1]
        logp = model.score(window.unsqueeze(0))[0, -1]
        total -= float(logp[seq[i + 1]])
    assert math.isclose(got, total / 70 / math.log(2), rel_tol=1e-5)


@pytest.mark.slow
def test_eval_command(run_dir, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("def f(x):\n    return x\n" * 10)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "eval", str(run_dir), "--data", str(f)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert 0 < float(r.stdout.strip().splitlines()[-1]) < 16
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "eval", str(run_dir), "--data", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no such file or folder" in r.stderr


@pytest.mark.slow
def test_plot_writes_a_png(run_dir):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: the plot is an optional extra")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "plot", str(run_dir)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (run_dir / "history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_get_it(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails
    assert main(["plot", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f'{sys.executable} -m pip install "minagi[plot]"' in err, err


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A run of two steps on a small text file: its held-out split is quick to score."""
    d = tmp_path_factory.mktemp("text_run")
    (d / "corpus.txt").write_text("def f(x):\n    return x * 2\n" * 400)
    cfg = load("cpu-tiny", ["train.steps=2", "train.eval_chunks=2", "model.d_model=32", "model.n_heads=2",
                            "model.d_hidden=48", "data.context=32", f"data.path={d / 'corpus.txt'}"])
    train(cfg, d / "run", progress=False)
    return d / "run"


def test_eval_without_data_scores_the_runs_own_held_out_split(text_run, capsys):
    from minagi.lm.data import run_corpus
    from minagi.lm.evaluate import scored_bytes

    model, cfg = load_model(text_run)
    data, what, note = scored_bytes(cfg)
    held = run_corpus(cfg.data).heldout
    assert torch.equal(data, held.long()) and what.startswith("the run's held-out split of") and note is None
    assert main(["eval", str(text_run)]) == 0
    out = capsys.readouterr()
    assert f"scoring {held.numel():,} bytes of the run's held-out split" in out.err
    assert float(out.out.strip()) == pytest.approx(bits_per_byte(model, data, cfg.data.context), abs=1e-4)


def test_eval_reads_a_folders_text_files_and_says_what_it_skipped(text_run, tmp_path, capsys):
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\x00" * 100)
    (tmp_path / "m.py").write_text("x = 1\n" * 20)
    assert main(["eval", str(text_run), "--data", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 files (100 bytes): 1 in __pycache__" in err and "scoring 120 bytes" in err
    assert main(["eval", str(text_run), "--data", str(tmp_path / "__pycache__" / "m.cpython-311.pyc")]) == 2
    assert "is not text (a NUL byte at offset 0" in capsys.readouterr().err


def test_a_file_that_is_not_a_checkpoint_is_one_line(text_run, tmp_path, capsys):
    import argparse

    torch.save(argparse.Namespace(steps=1), tmp_path / "other.pt")  # unpickling it is refused
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    for path, why in ((tmp_path / "other.pt", "holds Python objects beyond tensors"),
                      (tmp_path / "notes.txt", "not a file torch.save wrote")):
        assert main(["write", str(path), "--chars", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err and "give the folder of a minagi run" in err, err


@pytest.mark.slow
def test_bench_write_command(run_dir):
    r = subprocess.run([sys.executable, "-m", "minagi.bench", "write", str(run_dir), "--chars", "5", "--reps", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "writing: char/s" in r.stdout and "under sink routing" in r.stdout


def test_quantized_experts_write_and_score_as_the_dequantized_pool():
    # --quantize: the pool's experts as minagi.moe.quant weights; the model then computes what the
    # same model with those weights dequantized computes (the oracle), and writes the same bytes.
    # A card smaller than the pool takes its experts out of the quantized pool (index_select).
    from minagi.lm.writer import quantize_experts

    data = torch.tensor(list(b"def f(x):\n    return x + 1\n" * 8))
    # d_hidden 40: int4's groups of 32 do not divide it (a short last group).
    for spec, n_slots, d_hidden in (("int8", 6, 64), ("int4", 4, 64), ("int4", 4, 40)):
        torch.manual_seed(0)
        q = ByteModel(small(d_model=32, d_hidden=d_hidden, n_slots=n_slots), context=24).eval()
        deq = ByteModel(small(d_model=32, d_hidden=d_hidden, n_slots=n_slots), context=24).eval()
        deq.load_state_dict(q.state_dict())
        assert f"experts in {spec}" in quantize_experts(q, spec)
        with torch.no_grad():
            deq.pool.w_in.copy_(q.pool.w_in.dequantize())
            deq.pool.w_out.copy_(q.pool.w_out.dequantize())
        assert abs(bits_per_byte(q, data, 24) - bits_per_byte(deq, data, 24)) < 1e-4
        assert write(q, b"def ", 40, temperature=0.0).text == write(deq, b"def ", 40, temperature=0.0).text


def test_eval_quantize_reports_the_float_figure_beside(run_dir, capsys):
    assert main(["eval", str(run_dir), "--data", str(ROOT / "README.md"), "--quantize", "int8"]) == 0
    out, err = capsys.readouterr()
    assert "float " in err and ", int8 " in err and float(out.strip().splitlines()[-1]) > 0
