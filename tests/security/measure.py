"""Run the CLI on a hostile input in a fresh process and measure it (peak RSS of the child, wall time)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

MAX_RSS_MB = 300
MAX_SECONDS = 5.0


@dataclass
class Result:
    code: int
    out: str
    err: str
    seconds: float  # wall time
    rss_mb: float
    cpu_s: float = 0.0  # user + system CPU time of the child

    def within_budget(self) -> bool:
        """Peak RSS under MAX_RSS_MB, CPU time under MAX_SECONDS, and wall time under MAX_SECONDS scaled by
        how overloaded the machine is (CI runs these next to the rest of the suite on a few cores)."""
        return self.rss_mb < MAX_RSS_MB and self.cpu_s < MAX_SECONDS and self.seconds < MAX_SECONDS * load_factor()


def run_measured(*args, env: dict | None = None, timeout: float = 60) -> Result:
    """`ingot ARGS` in a fresh process; its peak RSS (ru_maxrss of the child) and wall time."""
    code = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "dt = time.perf_counter() - t\n"
        "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "sys.stdout.write(repr((p.returncode, p.stdout, p.stderr, dt, u.ru_maxrss / 1024, u.ru_utime + u.ru_stime)))\n"
    )
    full = {**os.environ, **(env or {})}
    p = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "ingot", *map(str, args)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )
    rc, out, err, dt, rss, cpu = eval(p.stdout)  # noqa: S307 (our own repr)
    return Result(rc, out, err, dt, rss, cpu)


def load_factor() -> float:
    """1 on an idle machine; the run-queue length per CPU when it is overloaded."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    return lines[0]
