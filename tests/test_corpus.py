"""Corpora of any size: prepare (both split rules, streamed, never half-written), the prepared
folder read through memory maps with batches identical to the raw path's, the errors, max_in_memory."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi.lm import checkpoint
from minagi.lm.data import BINS, META, DataError, load_corpus, open_prepared, prepare

from conftest import run_bench
from test_trainer import TINY, _cli, _history, _signal_at  # noqa: F401

# The whole file is in the slow tier: the fast one (pytest -m "not slow") is the core's (README).
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """40 small files: the hash split holds some of them out."""
    d = tmp_path_factory.mktemp("raw")
    import inspect
    import json as j
    import textwrap
    text = "".join(inspect.getsource(m) for m in (j.decoder, j.encoder, textwrap))
    for i in range(40):
        (d / f"f{i:02d}.py").write_text(text[i * 1500:(i + 1) * 1500 + 3000])
    return d


def test_prepare_a_folder_splits_by_file_as_training_does(folder, tmp_path):
    meta = prepare(str(folder), tmp_path / "p")
    raw, prep = load_corpus(str(folder)), open_prepared(tmp_path / "p")
    assert meta["split"] == "by-file" and 0 < meta["heldout_files"] < 40
    assert torch.equal(raw.train, prep.train.read()) and torch.equal(raw.heldout, prep.heldout.read())
    assert sorted(os.listdir(tmp_path / "p")) == sorted([META, *BINS])  # no temporary file left
    assert meta["train_bytes"] + meta["heldout_bytes"] == sum(f.stat().st_size for f in folder.iterdir())
    assert len(meta["digest"]) == 64 and meta["version"] == 1


def test_prepare_a_single_file_holds_out_its_tail(folder, tmp_path):
    one = folder / "f03.py"
    meta = prepare(str(one), tmp_path / "p")
    raw = load_corpus(str(one))
    prep = load_corpus(str(tmp_path / "p"))  # a prepared folder is recognised by its corpus.json
    assert meta["split"] == "tail" and meta["heldout_bytes"] == one.stat().st_size // 20
    assert torch.equal(raw.train, prep.train.read()) and torch.equal(raw.heldout, prep.heldout.read())
    assert "prepared from" in prep.source


def test_prepared_batches_losses_and_resume_equal_the_raw_path(folder, tmp_path):
    prepare(str(folder), tmp_path / "p")
    args = ["--steps", "12", *sum((["--set", s] for s in TINY), []), "--set", "train.checkpoint_every=4",
            "--set", "train.eval_every=4"]
    raw, prep, stopped = tmp_path / "raw", tmp_path / "prep", tmp_path / "stopped"
    assert _cli("--data", str(folder), *args, "--out", str(raw)).returncode == 0
    assert _cli("--data", str(tmp_path / "p"), *args, "--out", str(prep)).returncode == 0
    assert _signal_at(6, "TERM", "--data", str(tmp_path / "p"), *args, "--out", str(stopped)).returncode == 143
    assert _cli("--data", str(tmp_path / "p"), *args, "--out", str(stopped), "--resume").returncode == 0
    a, b = _history(raw), _history(prep)
    c = [x for x in _history(stopped) if x["step"] != 6]
    assert [x["train_loss"] for x in a] == [x["train_loss"] for x in b] == [x["train_loss"] for x in c]
    assert [x["heldout_bpc"] for x in a] == [x["heldout_bpc"] for x in b] == [x["heldout_bpc"] for x in c]
    wa, wc = checkpoint.load(raw)["model"], checkpoint.load(stopped)["model"]
    assert all(torch.equal(wa[k], wc[k]) for k in wa)


def test_eval_and_routes_take_a_prepared_folder(folder, tmp_path):
    prepare(str(folder), tmp_path / "p")
    args = ["--steps", "2", *sum((["--set", s] for s in TINY), [])]
    assert _cli("--data", str(tmp_path / "p"), *args, "--out", str(tmp_path / "run")).returncode == 0
    for cmd in (["eval", str(tmp_path / "run"), "--data", str(tmp_path / "p")],
                ["routes", str(tmp_path / "run"), "--chunks", "2"]):
        r = subprocess.run([sys.executable, str(ROOT / "train.py"), *cmd], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
    held = open_prepared(tmp_path / "p").heldout.numel()
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "eval", str(tmp_path / "run"), "--data",
                        str(tmp_path / "p")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert f"scoring {held:,} bytes" in r.stderr and float(r.stdout.strip().splitlines()[-1]) > 0


def test_interrupted_prepare_never_looks_complete(folder, tmp_path):
    # SIGKILL after the first block: no corpus.json, so nothing takes the folder for a corpus.
    script = ("import os, signal, sys; from minagi.lm import data; data.BLOCK = 1000\n"
              "def kill(done, total):\n"
              "    if done > 5000: os.kill(os.getpid(), signal.SIGKILL)\n"
              "data.prepare(sys.argv[1], sys.argv[2], progress=kill)\n")
    r = subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "p")], timeout=120)
    assert r.returncode == -signal.SIGKILL
    assert not (tmp_path / "p" / META).exists() and any((tmp_path / "p").iterdir())
    with pytest.raises(DataError, match="no corpus.json|not empty"):
        prepare(str(folder), tmp_path / "p")  # not empty: --force
    with pytest.raises(DataError, match="no such file or folder|not a prepared corpus"):
        open_prepared(tmp_path / "p")
    prepare(str(folder), tmp_path / "p", force=True)
    assert open_prepared(tmp_path / "p").train.numel() > 0


def test_mapped_chunks_equal_in_memory_chunks_and_a_shrunk_file_is_named(folder, tmp_path):
    from minagi.lm.data import take

    prepare(str(folder), tmp_path / "p")
    raw, prep = load_corpus(str(folder)), open_prepared(tmp_path / "p")
    starts = torch.tensor([0, 5, raw.train.numel() - 65, 1234])
    assert torch.equal(take(prep.train, starts, 65), take(raw.train, starts, 65))
    assert take(prep.train, starts[:0], 65).shape == (0, 65)
    with open(tmp_path / "p" / "train.bin", "r+b") as f:  # shrunk under a running process
        f.truncate(100)
    with pytest.raises(DataError, match="train.bin is shorter than it was"):
        take(prep.train, starts, 65)


def test_bad_prepared_folders_are_named(folder, tmp_path):
    p = tmp_path / "p"
    prepare(str(folder), p)
    good = (p / META).read_text()
    with open(p / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="train.bin holds 100 bytes but corpus.json says .*truncated"):
        open_prepared(p)
    prepare(str(folder), p, force=True)
    (p / META).write_text(good.replace('"version": 1', '"version": 7'))
    with pytest.raises(DataError, match="format version 7; this minagi reads version 1"):
        open_prepared(p)
    (p / META).write_text("{not json")
    with pytest.raises(DataError, match="cannot be read"):
        open_prepared(p)
    (p / META).unlink()
    with pytest.raises(DataError, match="not a prepared corpus"):
        open_prepared(p)
    with pytest.raises(DataError, match="is not empty.*--force"):
        prepare(str(folder), p)


def test_prepare_command_and_its_errors(folder, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "train.py"), "prepare", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT, timeout=300)
    r = run(folder, tmp_path / "p")
    assert r.returncode == 0 and "prepared" in r.stdout and "bytes (100%)" in r.stderr, r.stderr
    r = run(folder, tmp_path / "p")
    assert r.returncode == 2 and "not empty" in r.stderr and "Traceback" not in r.stderr
    (folder.parent / "broken").mkdir(exist_ok=True)
    (folder.parent / "broken" / "a.txt").write_text("x" * 500)
    link = folder.parent / "broken" / "gone.txt"
    if not link.is_symlink():
        link.symlink_to(folder.parent / "nowhere.txt")
    r = run(folder.parent / "broken", tmp_path / "q")
    assert r.returncode == 2 and "gone.txt: cannot be read" in r.stderr


def test_a_corpus_past_max_in_memory_says_how_to_prepare(folder, tmp_path):
    with pytest.raises(DataError, match=r"more than data.max_in_memory = 1,000; .*python train.py prepare"):
        load_corpus(str(folder), max_in_memory=1000)
    r = _cli("--data", str(folder), "--set", "data.max_in_memory=1000", "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and f"python train.py prepare {folder} {folder}.prepared" in r.stderr


def test_a_prepared_corpus_smaller_than_a_chunk(tmp_path):
    (tmp_path / "small.txt").write_text("print('hello')\n" * 4)
    prepare(str(tmp_path / "small.txt"), tmp_path / "p")
    r = _cli("--data", str(tmp_path / "p"), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and "one chunk needs data.context + 1 = 129 bytes" in r.stderr


def test_bench_data_small(tmp_path):
    r = run_bench("data", "--gb", "0.01", "--steps", "8", "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "bench_data.json").read_text())
    assert res["corpus_bytes"] >= 0.01 * 2**30 * 0.99 and res["prepare"]["mb_per_s"] > 0
    assert set(res["runs"]) == {"default corpus", "prepared corpus", "default corpus prepared"}
    assert all(run["char_per_s"] > 0 and run["startup_s"] > 0 for run in res["runs"].values())


# --- what a folder is read as, and files that are not text ----------------------------------

@pytest.fixture
def mixed(tmp_path):
    """Text files beside what a folder also holds: bytecode, hidden files and folders, binaries."""
    d = tmp_path / "mixed"
    (d / "pkg" / "__pycache__").mkdir(parents=True)
    (d / ".git").mkdir()
    (d / "a.py").write_text("def a():\n    return 1\n" * 200)
    (d / "pkg" / "b.txt").write_text("naïve café — text\n" * 200)
    cut = "x" * 4095 + "é" + "y" * 100  # a character cut by the text probe's end is still text
    (d / "pkg" / "cut.txt").write_text(cut)
    (d / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\x00\x01" * 300)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / ".env").write_text("SECRET=1\n")
    (d / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 50)
    (d / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1") * 50)
    return d


def test_a_folder_is_read_as_its_text_files(mixed):
    from minagi.lm.data import folder_files

    files, skipped = folder_files(mixed)
    assert [f.relative_to(mixed).as_posix() for f in files] == ["a.py", "pkg/b.txt", "pkg/cut.txt"]
    assert skipped.files == {"hidden": 2, "in __pycache__": 1, "not text": 2}
    assert skipped.bytes == 600 + 21 + 9 + 500 + 250
    note = skipped.note(str(mixed))
    assert note.count("\n") == 0 and "skipped 5 files (1,380 bytes)" in note and "--data-binary" in note
    c = load_corpus(str(mixed))
    assert c.train.numel() + c.heldout.numel() == sum(f.stat().st_size for f in files)
    assert c.skipped.total == 5
    files, skipped = folder_files(mixed, binary=True)  # binaries read; hidden and bytecode still not
    assert len(files) == 5 and skipped.files == {"hidden": 2, "in __pycache__": 1}


def test_a_binary_file_is_refused_unless_allowed(mixed, tmp_path):
    with pytest.raises(DataError, match=r"blob.bin is not text \(a NUL byte at offset 8 .*--data-binary"):
        load_corpus(str(mixed / "blob.bin"))
    with pytest.raises(DataError, match=r"latin1.txt is not text \(not UTF-8 at offset 3 "):
        load_corpus(str(mixed / "latin1.txt"))
    assert load_corpus(str(mixed / "blob.bin"), binary=True).train.numel() > 0
    from minagi.lm.config import load
    assert load("cpu-tiny", ["data.binary=true"]).data.binary
    r = _cli("--data", str(mixed / "blob.bin"), "--out", str(tmp_path / "r"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--data-binary" in r.stderr, r.stderr
    with pytest.raises(DataError, match=r"no text files to read \(skipped 1 files \(600 bytes\): 1 not text"):
        load_corpus(str(mixed / "pkg" / "__pycache__"))  # a folder of nothing but what is skipped says so


def test_an_empty_corpus_says_how_big_it_must_be(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match=r"empty \(0 bytes\); give at least 2,709 bytes of text in all"):
        load_corpus(str(tmp_path / "empty.txt"))
    with pytest.raises(DataError, match=r"give at least 1,353 bytes .*data.context \+ 1 = 33 bytes"):
        load_corpus(str(tmp_path / "empty.txt"), heldout_every=40, context=32)
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match=r"no text files to read \(an empty folder\); give at least 2,709 bytes"):
        load_corpus(str(tmp_path / "none"))


def test_a_run_says_what_its_folder_skipped(mixed, tmp_path, capsys):
    from minagi.lm.config import load
    from minagi.lm.trainer import train

    cfg = load("cpu-tiny", [*TINY, f"data.path={mixed}", "train.steps=1"])
    train(cfg, tmp_path / "run", progress=False)
    err = capsys.readouterr().err
    assert f"minagi: {mixed}: skipped 5 files (1,380 bytes): 2 hidden" in err
