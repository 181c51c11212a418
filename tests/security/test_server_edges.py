"""Issue #13, server edges: a deeply nested JSON body is a 400 in each API's shape on every endpoint (it was
a 500 with a traceback), and nothing is logged as a traceback."""

from __future__ import annotations

import httpx
import pytest
from server_fixtures import ServerProcess

pytest.importorskip("uvicorn", reason="needs the serve extra")

ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/api/chat",
    "/api/generate",
    "/api/show",
]


@pytest.fixture(scope="module")
def server(synth_model):
    s = ServerProcess(synth_model("tiny", "Q8_0"), "--device", "cpu").wait_ready()
    yield s
    s.stop()


@pytest.mark.parametrize("depth", [100, 100_000])
def test_deeply_nested_json_is_a_400_everywhere(server, depth):
    body = b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
    for path in ENDPOINTS:
        r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (path, r.status_code, r.text)
        err = r.json()
        assert "error" in err, (path, err)
    assert "Traceback" not in server.output
