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
    seconds: float
    rss_mb: float


def run_measured(*args, env: dict | None = None, timeout: float = 60) -> Result:
    """`ingot ARGS` in a fresh process; its peak RSS (ru_maxrss of the child) and wall time."""
    code = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "sys.stdout.write(repr((p.returncode, p.stdout, p.stderr, dt, rss)))\n"
    )
    full = {**os.environ, **(env or {})}
    p = subprocess.run(
        [sys.executable, "-c", code, sys.executable, "-m", "ingot", *map(str, args)],
        capture_output=True,
        text=True,
        env=full,
        timeout=timeout,
    )
    rc, out, err, dt, rss = eval(p.stdout)  # noqa: S307 (our own repr)
    return Result(rc, out, err, dt, rss)


def one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    return lines[0]
