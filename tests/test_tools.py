"""The memory samplers: tools/mem_sampler.py from outside a process, MemSampler inside one."""
import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minagi.lm.memory import SAMPLE_FIELDS, MemSampler

ROOT = Path(__file__).resolve().parent.parent


def _rows(path):
    lines = Path(path).read_text().splitlines()
    assert lines[0].startswith("#") and "start:" in lines[0] and "stop:" in lines[0]  # the usage line
    return list(csv.DictReader(lines[1:]))


@pytest.mark.slow  # a child process each: outside the core's fast tier
def test_sampler_watches_another_process(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(64 << 20); time.sleep(30)"])
    try:
        time.sleep(0.5)
        out = tmp_path / "mem.csv"
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "mem_sampler.py"), str(child.pid), "--out", str(out),
                            "--every", "0.2", "--count", "3"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        child.kill()
        child.wait()
    rows = _rows(out)
    assert len(rows) == 3 and tuple(rows[0]) == SAMPLE_FIELDS
    assert all(int(row["pid"]) == child.pid for row in rows)
    assert min(int(row["rss_bytes"]) for row in rows) > 64 << 20  # the child's 64 MiB is resident
    assert float(rows[2]["elapsed_s"]) >= float(rows[0]["elapsed_s"])
    assert rows[0]["device_allocated_bytes"] == ""  # not visible from outside


@pytest.mark.slow  # a child process each: outside the core's fast tier
def test_sampler_stops_when_the_process_exits(tmp_path):
    # The child lives until told to go (its stdin closed), after the sampler's first row: a fixed
    # sleep could end before a sampler slowed by a busy machine has even started.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    out = tmp_path / "mem.csv"
    sampler = subprocess.Popen([sys.executable, str(ROOT / "tools" / "mem_sampler.py"), str(child.pid), "--out",
                                str(out), "--every", "0.2"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out.exists() and len(out.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
            assert sampler.poll() is None, sampler.stderr.read()
            time.sleep(0.1)
        child.stdin.close()
        child.wait(timeout=30)
        assert sampler.wait(timeout=30) == 0, sampler.stderr.read()
    finally:
        child.kill()
        sampler.kill()
    assert len(_rows(out)) >= 1


@pytest.mark.slow  # a child process each: outside the core's fast tier
def test_sampler_rejects_a_missing_process(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "mem_sampler.py"), "999999999", "--out",
                        str(tmp_path / "m.csv")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no process with PID 999999999" in r.stderr


def test_in_process_sampler(tmp_path):
    out = tmp_path / "self.csv"
    sampler = MemSampler(out, every=0.05).start()
    time.sleep(0.3)
    sampler.stop()
    rows = _rows(out)
    assert len(rows) >= 2 and all(int(row["rss_bytes"]) > 0 for row in rows)
    with pytest.raises(ValueError, match="every must be > 0"):
        MemSampler(out, every=0)
