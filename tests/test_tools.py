"""The memory samplers: tools/mem_sampler.py from outside a process, MemSampler inside one, and
the Windows sampler's CSV columns; the tools behind docs/transformers.md's kernel figures."""
import csv
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minagi.memory import SAMPLE_FIELDS, MemSampler

ROOT = Path(__file__).resolve().parent.parent


def _rows(path):
    lines = Path(path).read_text().splitlines()
    assert lines[0].startswith("#") and "start:" in lines[0] and "stop:" in lines[0]  # the usage line
    return list(csv.DictReader(lines[1:]))


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


def test_sampler_stops_when_the_process_exits(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    out = tmp_path / "mem.csv"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "mem_sampler.py"), str(child.pid), "--out", str(out),
                        "--every", "0.2"], capture_output=True, text=True, timeout=60)
    child.wait()
    assert r.returncode == 0, r.stderr
    assert 1 <= len(_rows(out)) <= 30


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


def test_windows_sampler_writes_the_same_columns():
    ps1 = (ROOT / "tools" / "gpu_mem_sampler.ps1").read_text()
    header = next(line for line in ps1.splitlines() if line.startswith("$fields = "))
    assert tuple(header.split('"')[1].split(",")) == SAMPLE_FIELDS
    assert "GPU Process Memory" in ps1 and "Dedicated Usage" in ps1 and "Shared Usage" in ps1


def test_peak_flops_tool_measures_the_arithmetic_peak(tmp_path):
    # tools/peak_flops.cpp: the arithmetic bound docs/transformers.md holds the training rows to. Built
    # and run where there is a C++ compiler and a CPU with AVX-512 BF16.
    import shutil

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if shutil.which("g++") is None or " avx512_bf16" not in flags:
        pytest.skip("needs g++ and a CPU with AVX-512 BF16")
    exe = tmp_path / "peak_flops"
    build = subprocess.run(["g++", "-O3", "-funroll-all-loops", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp",
                            str(ROOT / "tools" / "peak_flops.cpp"), "-o", str(exe)], capture_output=True, text=True,
                           timeout=120)
    if build.returncode != 0 and "omp" in build.stderr:
        pytest.skip(f"no OpenMP for g++ here: {build.stderr.strip()[:200]}")
    assert build.returncode == 0, build.stderr
    r = subprocess.run([str(exe), "1", "3000000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("1 thread(s): float32 FMA ") for line in lines)
    f32, bf16 = (float(part.split()[-2]) for part in lines[-1].split(": ", 1)[1].split(", "))
    assert f32 > 1 and bf16 > 1  # GFLOP/s (one core of anything with AVX-512 runs tens)
    bad = subprocess.run([str(exe), "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_slot_gemm_probe_times_grouped_mm_and_names_bad_arguments():
    # tools/slot_gemm_probe.py: the per-slot GEMM figures of docs/log/2026-12-06-bench-at-350f8a6.md.
    # Without the extension (the fallback run) it says it has nothing to time.
    import re

    import minagi

    tool = [sys.executable, str(ROOT / "tools" / "slot_gemm_probe.py")]
    r = subprocess.run(tool + ["--rows", "64", "--km", "256,512", "--calls", "3", "--threads", "1", "--layout", "t",
                               "--weights", "3"], capture_output=True, text=True, timeout=120)
    if not minagi.extension_loaded():
        assert r.returncode == 2 and "compiled grouped_mm" in r.stderr and "pip install" in r.stderr, r.stderr
    else:
        assert r.returncode == 0, r.stderr
        m = re.fullmatch(r"rows 64 layout t bfloat16 K 256 M 512 weights 3 threads 1: ([\d.]+) ms, (\d+) GFLOP/s\n",
                         r.stdout)
        assert m, r.stdout
        ms, gflops = float(m[1]), int(m[2])
        # The work over the time, up to the printed figures' rounding (GFLOP/s as a whole number:
        # half a GFLOP/s is 7% of a slow CPU's bfloat16 rate).
        work = 2 * 4096 * 256 * 512
        assert abs(gflops * ms * 1e6 - work) <= 0.03 * work + 0.5 * ms * 1e6, (gflops, ms)
    for args, says in ((["--km", "5"], "--km takes two integers"), (["--rows", "1024", "--weights", "5"], "at most 4")):
        bad = subprocess.run(tool + args, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and says in bad.stderr, bad.stderr
