"""Training beside other work on a CPU: how many cores other processes take, and the watch that
keeps a run from collapsing when they do.

A run's OpenMP threads split each kernel's work evenly and wait for one another at its end. When
another process takes one of the cores, the thread that shares it loses whole time slices
(milliseconds) while the others wait at the barrier (spinning, by OpenMP's default), so every
kernel takes as long as its slowest thread, and two threads beside one busy process train well
below one thread's pace (docs/training.md, "Threads and shared machines"; the figures in
docs/benchmarks.md, `minagi bench shared`).

others(): the cores' worth of CPU time that other processes used between two readings of
/proc/stat (the busy time of the CPUs this process may run on), less this process's own CPU time.
Policy: what to do after each interval (pure logic, tested with injected figures). Watch: the
readings and the run's pace, over the start-up and then every INTERVAL_S seconds of a CPU run,
applied to torch's threads.

With train.threads = 0 (auto) the run follows the free cores: fewer threads at once when other
work takes a core, more again (after RAISE_AFTER calm intervals) when it leaves. A pinned
train.threads is never changed (a thread count is part of what makes a run's bits,
docs/reliability.md); the run only says that it slowed. Either way it says so once, in one line.
MINAGI_WATCH_CORES=0 turns the watch off (auto is then every core, as before it existed).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

INTERVAL_S = 5.0  # seconds between two looks at the machine
START_S = 0.2  # the start-up (corpus, model) is looked at over this long at least
BUSY = 0.6  # a core counts as taken by other work from this share of it on
SLOW = 0.8  # a pinned run says it slowed below this share of its last quiet pace
RAISE_AFTER = 2  # calm intervals before an auto run takes a freed core back
ENV = "MINAGI_WATCH_CORES"
STAT = "/proc/stat"


def cpus() -> set[int]:
    """The CPUs this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class Reading:
    wall: float  # seconds (time.monotonic)
    busy: float  # CPU-seconds the allowed CPUs spent not idle, since boot
    own: float  # CPU-seconds of this process (all its threads)


def parse_stat(text: str, allowed: set[int], tick: float) -> float:
    """The allowed CPUs' busy seconds in /proc/stat's text: user, nice, system, irq, softirq and
    steal (guest time is inside user), not idle or iowait."""
    busy = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in allowed:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in rest.split()[:8])
        busy += user + nice + system + irq + softirq + steal
    return busy * tick


def read(allowed: set[int] | None = None) -> Reading | None:
    """The machine now, or None where there is no /proc/stat (not Linux)."""
    try:
        with open(STAT) as f:
            text = f.read()
    except OSError:
        return None
    t = os.times()
    return Reading(time.monotonic(), parse_stat(text, allowed or cpus(), 1 / os.sysconf("SC_CLK_TCK")),
                   t.user + t.system)


def others(a: Reading, b: Reading) -> float:
    """The cores' worth of CPU time that other processes used from reading a to reading b."""
    wall = b.wall - a.wall
    return max(0.0, (b.busy - a.busy) - (b.own - a.own)) / wall if wall > 0 else 0.0


def taken(others_cores: float) -> int:
    """Whole cores taken by other work: one from BUSY of one on (0.7 -> 1, 1.5 -> 1, 1.6 -> 2)."""
    return int(others_cores + 1 - BUSY)


class Policy:
    """What a run does after each interval of the watch. cores: the CPUs it may use; threads:
    torch's threads now; pinned: train.threads was set (never changed, only said)."""

    def __init__(self, cores: int, threads: int, pinned: bool):
        self.cores, self.threads, self.pinned = cores, threads, pinned
        self.quiet_cps: float | None = None  # the pace of the last interval with no other work, at its threads
        self.said, self.calm = False, 0

    def interval(self, others_cores: float, cps: float | None) -> tuple[int | None, str | None]:
        """After an interval in which other processes took others_cores and the run trained at cps
        char/s (None: no step in it, the start-up): the threads to set (None: no change) and the
        line to say (None: nothing)."""
        busy = taken(others_cores)
        if busy == 0 and cps and (self.pinned or self.threads == self.cores):
            self.quiet_cps = cps
        want = max(1, self.cores - busy)  # the free cores
        if self.pinned:  # never changed; said once when its threads outnumber the free cores and it slowed
            slowed = self.quiet_cps is None or cps is None or cps < SLOW * self.quiet_cps
            if self.threads > want and slowed and not self.said:
                return None, self._line(others_cores, cps, f"train.threads = {self.threads} is pinned, so it "
                                        "stays (its runs are bit-reproducible); train.threads = 0 would follow "
                                        "the free cores")
            return None, None
        if want == self.threads:
            self.calm = 0
            return None, None
        if want > self.threads:  # a core came free: taken back only when it stays free
            self.calm += 1
            if self.calm < RAISE_AFTER:
                return None, None
        self.calm, self.threads = 0, want
        if want < self.cores and not self.said:
            return want, self._line(others_cores, cps, f"now {want} thread{'s' if want > 1 else ''} "
                                    "(train.threads = 0 follows the free cores; a pinned train.threads keeps "
                                    "its threads and its bits)")
        return want, None

    def _line(self, others_cores: float, cps: float | None, then: str) -> str:
        self.said = True
        pace = (f", training at {cps:,.0f} char/s, down from {self.quiet_cps:,.0f}"
                if cps and self.quiet_cps and cps < self.quiet_cps else "")
        return (f"minagi: other work is using {others_cores:.1f} of this machine's {self.cores} cores{pace}: "
                f"{then}")


class Watch:
    """Looks at the machine every INTERVAL_S seconds (after a step; start() looks at the start-up
    first) and applies the policy: torch's threads set, the line said. reader, clock,
    set_threads: injected by tests."""

    def __init__(self, policy: Policy, say, first: Reading, reader=read, clock=time.monotonic, set_threads=None):
        import torch

        self.policy, self.say, self.reader, self.clock = policy, say, reader, clock
        self.set_threads = set_threads or torch.set_num_threads
        self.last, self.chars, self.seconds = first, 0, 0.0

    def look(self, now: Reading) -> None:
        cps = self.chars / self.seconds if self.seconds > 0 else None
        threads, line = self.policy.interval(others(self.last, now), cps)
        if threads is not None:
            self.set_threads(threads)
        if line:
            self.say(line)
        self.last, self.chars, self.seconds = now, 0, 0.0

    def step(self, chars: int, seconds: float) -> None:
        """After each training step: its characters and seconds."""
        self.chars += chars
        self.seconds += seconds
        if self.clock() - self.last.wall >= INTERVAL_S and (now := self.reader()) is not None:
            self.look(now)


def start(first: Reading | None, device_type: str, distributed: bool, setting: int, say) -> Watch | None:
    """The watch of a run, given the reading taken before its start-up, or None: not on the CPU,
    under torchrun (the other ranks are this run's own work), with MINAGI_WATCH_CORES=0, or
    without /proc/stat. It looks at the start-up now (waiting out START_S where the start-up was
    shorter), so a run beside other work takes the free cores' threads before its first step."""
    if first is None or device_type != "cpu" or distributed or os.environ.get(ENV, "1") == "0":
        return None
    import torch

    watch = Watch(Policy(len(cpus()), torch.get_num_threads(), pinned=setting != 0), say, first)
    time.sleep(max(0.0, START_S - (time.monotonic() - first.wall)))
    now = read()
    if now is not None:
        watch.look(now)
    return watch
