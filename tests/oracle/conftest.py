"""The oracle tests' report: every measured number (logit errors per prefill length, greedy agreement,
perplexities) is recorded through the `oracle_record` fixture, printed as a table at the end of the run (no -s
needed) and written to $OUT/oracle-<xdist worker or main>.json when $OUT is set (the device machine's output
folder)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

RESULTS: list[dict] = []


@pytest.fixture
def oracle_record(request):
    """oracle_record(**numbers): keep one row of measurements, tagged with the test's id."""

    def record(**numbers):
        RESULTS.append({"test": request.node.name} | numbers)

    return record


def _row(r: dict) -> str:
    def fmt(v):
        if not isinstance(v, float):
            return v
        return f"{v:.3e}" if 0 < abs(v) < 1e-2 else f"{v:.4f}"

    return "  ".join(f"{k}={fmt(v)}" for k, v in r.items() if k != "test")


def pytest_sessionfinish(session):
    """Every process that measured writes its own file: under pytest-xdist each worker its share (the controller
    measures nothing), without it the one process (oracle-main.json)."""
    path = _results_path()
    if RESULTS and path is not None:
        path.write_text(json.dumps(RESULTS, indent=1))


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("transformers oracle: measured")
    for r in RESULTS:
        terminalreporter.write_line(_row(r))
    path = _results_path()
    if path is not None:  # written by pytest_sessionfinish, which runs before this summary
        terminalreporter.write_line(f"(also written to {path})")


def _results_path() -> Path | None:
    """$OUT/oracle-<xdist worker or main>.json when $OUT is a folder (the device tool brings $OUT back)."""
    out = os.environ.get("OUT")
    if not (out and Path(out).is_dir()):
        return None
    return Path(out) / f"oracle-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.json"
