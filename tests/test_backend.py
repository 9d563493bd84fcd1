"""Loading the extension: forced fallback, required extension, the one-line notice, doctor, bench."""
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from conftest import EXT, requires_ext

# Importing minagi with minagi._C hidden, as if the build had failed.
HIDE_EXT = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "minagi._C":
            raise ImportError("simulated: no minagi._C")
sys.meta_path.insert(0, Hide())
"""


def _py(code, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MINAGI_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


# The same decisions in this process (the fast tier); the tests after it import minagi afresh in
# a child process, as a user does.
@pytest.fixture
def fresh_state(monkeypatch):
    from minagi.moe import _backend

    for name in ("MINAGI_DISABLE_EXT", "MINAGI_REQUIRE_EXT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_backend, "_STATE", None)
    return _backend


def test_the_flags_decide_in_process(fresh_state, monkeypatch):
    _backend = fresh_state
    monkeypatch.setenv("MINAGI_DISABLE_EXT", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forced fallback is quiet
        assert _backend.state() == _backend.BackendState(False, "disabled by MINAGI_DISABLE_EXT=1")
    monkeypatch.setattr(_backend, "_STATE", None)
    monkeypatch.setenv("MINAGI_REQUIRE_EXT", "1")
    with pytest.raises(RuntimeError, match="contradict each other; unset one"):
        _backend.state()
    monkeypatch.setenv("MINAGI_DISABLE_EXT", "maybe")
    with pytest.raises(ValueError, match="MINAGI_DISABLE_EXT='maybe': use 1 or 0"):
        _backend.state()


def test_a_missing_extension_in_process(fresh_state, monkeypatch):
    _backend = fresh_state
    monkeypatch.setitem(sys.modules, "minagi._C", None)  # its import fails, as after a failed build
    with pytest.warns(_backend.ExtensionFallbackWarning, match="minagi._C did not load .*pure-torch ops"):
        assert not _backend.state().loaded
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the state is kept
        assert not _backend.state().loaded
    monkeypatch.setattr(_backend, "_STATE", None)
    monkeypatch.setenv("MINAGI_REQUIRE_EXT", "1")
    with pytest.raises(RuntimeError, match="MINAGI_REQUIRE_EXT=1 but minagi._C did not load"):
        _backend.state()


@pytest.mark.slow
def test_disable_forces_the_fallback_quietly():
    r = _py("import minagi; print(minagi.extension_loaded())", MINAGI_DISABLE_EXT="1")
    assert r.returncode == 0 and r.stdout.strip() == "False"
    assert "Warning" not in r.stderr


@pytest.mark.slow
def test_missing_extension_warns_once_and_falls_back():
    r = _py(HIDE_EXT + "import minagi, torch\nprint(minagi.extension_loaded())\n"
            "print(minagi.expert_mlp(torch.randn(3, 2), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1),"
            " torch.randn(1, 2, 4), torch.randn(1, 4, 2)).shape)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "torch.Size([3,", "2])"]
    notices = [line for line in r.stderr.splitlines() if "ExtensionFallbackWarning" in line]
    assert len(notices) == 1 and "simulated: no minagi._C" in notices[0] and "pure-torch" in notices[0]


@pytest.mark.slow
def test_require_makes_a_missing_extension_an_error():
    r = _py(HIDE_EXT + "import minagi", MINAGI_REQUIRE_EXT="1")
    assert r.returncode != 0 and "MINAGI_REQUIRE_EXT=1 but minagi._C did not load" in r.stderr


@pytest.mark.slow
def test_require_and_disable_contradict():
    r = _py("import minagi", MINAGI_REQUIRE_EXT="1", MINAGI_DISABLE_EXT="1")
    assert r.returncode != 0 and "contradict" in r.stderr


@pytest.mark.slow
def test_bad_flag_value_is_named():
    r = _py("import minagi", MINAGI_DISABLE_EXT="maybe")
    assert r.returncode != 0 and "MINAGI_DISABLE_EXT='maybe'" in r.stderr


@pytest.mark.slow
@requires_ext
def test_require_with_a_built_extension_loads():
    r = _py("import minagi; print(minagi.extension_loaded())", MINAGI_REQUIRE_EXT="1")
    assert r.returncode == 0 and r.stdout.strip() == "True"


@pytest.mark.slow
def test_doctor():
    r = subprocess.run([sys.executable, "-m", "minagi", "doctor"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "cpu build" in r.stdout
    if EXT:
        assert "minagi::grouped_mm" in r.stdout and "openmp=" in r.stdout and "openmp=no" not in r.stdout
        assert re.search(r"minagi::gather_mm_act +cpu \(fused", r.stdout)


def test_has_kernel_is_false_for_an_op_the_build_lacks():
    # A build from before an op was added: asked for it, the backend says no instead of raising.
    from minagi.moe import _backend

    assert not _backend.has_kernel("no_such_op", "cpu")
    assert _backend.has_kernel("grouped_mm", "cpu") == EXT


@pytest.mark.slow
def test_bench_dispatch_small(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "minagi.bench", "dispatch", "--N", "64", "--S", "8", "--K", "2",
                        "--D", "8", "--H", "16", "--sink-chars", "60", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    for routing in ("uniform", "sink"):
        rows = data["results"][routing]
        assert {"rectangle", "grouped", "loop", "dense"} <= set(rows)
        assert ("compiled" in rows) == EXT
        assert all(row["ms"] > 0 and row["executed_ratio"] >= 1.0 for row in rows.values())
    assert data["results"]["sink"]["rectangle"]["executed_ratio"] > 3
    assert "sink routing" in r.stdout


@pytest.mark.slow
def test_bench_rejects_unknown_benchmark():
    r = subprocess.run([sys.executable, "-m", "minagi.bench", "nope"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "invalid choice" in r.stderr


@pytest.mark.slow
def test_bench_train_small():
    r = subprocess.run([sys.executable, "-m", "minagi.bench", "train", "--reps", "1", "--steps", "1",
                        "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "data.context=32"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "sink" in r.stdout and "under sink routing" in r.stdout and "(design: >= " in r.stdout
