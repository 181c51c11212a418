"""Deliverable 6 (server) of issue #13: SIGTERM at any moment, mid-prefill included.

8 streaming clients each send a 4,000-token prompt to the CPU engine, which prefills them one after another
(~0.35 s each for the tiny model on a 2-core machine, 3.7 s for all eight); SIGTERM arrives once the first prompt is
prefilled (/metrics' prompt-token counter), the others still queued or prefilling, and the grace period is
INGOT_SHUTDOWN_GRACE = GRACE_S, far shorter than the work left. Every client must get a complete answer or a
well-formed error event in OpenAI's shape, some must get the error (the signal landed mid-work), the server must log
no traceback, and the process must exit 0 within the grace period + 1 s.

(With the default 5 s grace and a fixed 1 s wait before the signal this test passed only on a loaded machine: idle,
all eight prompts finished inside the grace and no client saw the shutdown.)"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from measure import load_factor
from server_fixtures import ServerProcess

from ingot.runtime import settings

CLIENTS, PROMPT_TOKENS = 8, 4000
GRACE_S = 0.5  # INGOT_SHUTDOWN_GRACE: ~1/5 of the prefill work left when the signal lands, on an idle CI machine

pytest.importorskip("uvicorn", reason="needs the serve extra")


def _client(url: str, model: str, results: list, i: int) -> None:
    body = {
        "model": model,
        "prompt": [t % 500 + 1 for t in range(i, i + PROMPT_TOKENS)],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            if r.status_code != 200:
                results[i] = ("status", r.status_code, json.loads(r.read()))
                return
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        results[i] = ("stream", 200, events)
    except httpx.HTTPError as e:  # a cut connection: exactly what must not happen
        results[i] = ("cut", None, repr(e))


def _prefilled(server: ServerProcess) -> float:
    return server.metrics().get("ingot_prompt_tokens_total", 0.0)


def test_sigterm_mid_prefill_answers_every_client_and_exits_0_in_time(synth_model, monkeypatch):
    model = synth_model("tiny", "Q8_0")
    monkeypatch.setenv(settings.SHUTDOWN_GRACE.name, str(GRACE_S))
    server = ServerProcess(model, "--device", "cpu", "--ctx", str(PROMPT_TOKENS + 64), "--max-seqs", "8")
    server.wait_ready()
    results: list = [None] * CLIENTS
    threads = [threading.Thread(target=_client, args=(server.url, model.stem, results, i)) for i in range(CLIENTS)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while (done := _prefilled(server)) < PROMPT_TOKENS and time.monotonic() < deadline:
            time.sleep(0.02)
        # the first prompt is prefilled and at least one other is not: the engine is mid-work
        assert PROMPT_TOKENS <= done < CLIENTS * PROMPT_TOKENS, done
        sent = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.wait_exit(timeout=60)
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
        output = server.output
    finally:
        server.stop()
    complete = errors = 0
    for kind, status, payload in results:
        assert kind != "cut", (payload, results)
        if kind == "status":  # refused before streaming: a 503 in OpenAI's error shape
            assert status == 503 and payload["error"]["message"]
            errors += 1
            continue
        last = json.loads(payload[-1]) if payload[-1] != "[DONE]" else None
        if last is None:
            assert json.loads(payload[-2])["choices"][0]["finish_reason"] in ("stop", "length")
            complete += 1
        else:
            assert (
                "shutting down" in last["error"]["message"]
                and last["error"]["code"] in (503, "503", None)
                or (last["error"]["type"])
            ), last
            errors += 1
    print(f"shutdown: {complete} complete, {errors} errors, exit {code} after {took:.2f} s (grace {GRACE_S})")
    assert complete + errors == CLIENTS and errors > 0  # SIGTERM really landed mid-work
    assert code == 0, output
    # grace + 1 s; on an overloaded machine (CI next to the whole suite) the exit itself takes longer
    assert took <= GRACE_S + 1.0 * load_factor(), output
    assert "Traceback" not in output and "CancelledError" not in output, output
