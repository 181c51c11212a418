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


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    terminalreporter.section("transformers oracle: measured")
    for r in RESULTS:
        terminalreporter.write_line(_row(r))
    if _write_results():
        terminalreporter.write_line(f"(also written to {os.environ['OUT']}/oracle-main.json)")


def pytest_sessionfinish(session):
    """Under pytest-xdist every worker measures its share and the controller none: each writes its own file."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _write_results()


def _write_results() -> bool:
    """RESULTS to $OUT/oracle-<xdist worker or main>.json (the device tool brings $OUT back)."""
    out = os.environ.get("OUT")
    if not (RESULTS and out and Path(out).is_dir()):
        return False
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(out) / f"oracle-{worker}.json").write_text(json.dumps(RESULTS, indent=1))
    return True
