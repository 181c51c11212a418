"""`ingot serve` with its engine in a separate process, on the tiny synthetic model: many concurrent streams with
clients that go away leave no sequence and no KV page behind; a core that dies fails its in-flight requests with
503 and the next request starts a new one; a hot swap under load (the file replaced, POST /api/reload) drops
nothing and every response comes from exactly one version; SIGHUP reloads too; /api/ps, GET / and the
Anthropic-shaped /v1/models answer as their clients expect."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import zmq
from server_fixtures import ServerProcess, sse_events

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server import core, protocol
from ingot.runtime.server.protocol import Add, Shutdown, Step
from ingot.runtime.server.scheduler import Scheduler

QUESTION = [{"role": "user", "content": "what is the capital of France"}]
VERSION = "x-ingot-model-version"


@pytest.fixture(scope="module")
def model_path(synth_model, tmp_path_factory):
    """A private copy (the hot-swap test replaces it)."""
    path = tmp_path_factory.mktemp("core") / "tiny.gguf"
    shutil.copy(synth_model("tiny", "Q8_0"), path)
    return path


def _stream(url: str, body: dict, read_events: int | None = None) -> tuple[str | None, list, int]:
    """(the version header, the SSE events read, the status); read_events: hang up after that many."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            r.read()
            return r.headers.get(VERSION), [r.text], r.status_code
        if read_events is None:
            return r.headers.get(VERSION), sse_events(r), 200
        events = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) >= read_events:
                    break
        return r.headers.get(VERSION), events, 200


def test_concurrent_streams_and_disconnects_leave_nothing(model_path):
    """32 concurrent streams, every other one hung up on after two events: the rest complete, and at the end the
    core holds 0 sequences and 0 KV pages (the gauges of /metrics, which the core's steps feed)."""
    server = ServerProcess(model_path, "--device", "cpu", "--max-seqs", "32").wait_ready()
    try:
        body = {"model": model_path.stem, "messages": QUESTION, "max_tokens": 40, "temperature": 0, "stream": True}
        with ThreadPoolExecutor(32) as pool:
            runs = list(pool.map(lambda i: _stream(server.url, body, 2 if i % 2 else None), range(32)))
        assert all(status == 200 for _, _, status in runs)
        whole = [events for i, (_, events, _) in enumerate(runs) if i % 2 == 0]
        assert all(events[-1][1] == "[DONE]" for events in whole)
        assert server.wait_metric("ingot_running_sequences", lambda v: v == 0) == 0
        assert server.wait_metric("ingot_kv_cache_pages_used", lambda v: v == 0) == 0
        assert server.metrics()['ingot_sequences_total{reason="cancelled"}'] >= 1  # hung up before their end
    finally:
        server.stop()


def _core_pid(server: ServerProcess) -> int:
    """The engine core: the server's child process started by multiprocessing's spawn (Linux /proc)."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    cores = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return cores[0]


def test_a_crashed_core_fails_its_requests_and_is_restarted(model_path):
    server = ServerProcess(model_path, "--device", "cpu", "--ctx", "4096").wait_ready()
    try:  # a request that runs for seconds (4,000 tokens, no early EOS on a raw prompt): in flight when it dies
        body = {"model": model_path.stem, "prompt": "the", "max_tokens": 4000, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            server.wait_metric("ingot_running_sequences", lambda v: v == 1)
            pid = _core_pid(server)
            os.kill(pid, signal.SIGKILL)
            r = running.result()
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
        try:
            ok = httpx.post(f"{server.url}/v1/completions", json=body | {"max_tokens": 4}, timeout=60)
        except httpx.TimeoutException:
            raise AssertionError(f"no answer after the restart:\n{server.output}") from None
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        assert _core_pid(server) != pid
    finally:
        server.stop()


def _replace(path, source) -> None:
    """A new version of the model file, put in place atomically (a new inode: a new version)."""
    tmp = path.with_suffix(".new")
    shutil.copy(source, tmp)
    os.replace(tmp, path)


def test_hot_swap_under_load_drops_nothing(model_path, synth_model):
    """16 streaming clients loop while the file is replaced and POST /api/reload swaps it: zero failed requests,
    every response complete, each from exactly one version (its header), and both versions answered."""
    server = ServerProcess(model_path, "--device", "cpu", "--max-seqs", "16").wait_ready()
    stop = threading.Event()
    body = {"model": model_path.stem, "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": True}

    def client() -> list:
        results = []
        while not stop.is_set():
            results.append(_stream(server.url, body))
        return results

    try:
        first = httpx.get(f"{server.url}/api/ps").json()["models"][0]["digest"]
        with ThreadPoolExecutor(16) as pool:
            clients = [pool.submit(client) for _ in range(16)]
            time.sleep(2)
            _replace(model_path, synth_model("tiny", "Q4_0"))
            r = httpx.post(f"{server.url}/api/reload", json={"model": model_path.stem}, timeout=120)
            assert r.status_code == 200, r.text
            second = r.json()["version"]
            time.sleep(2)
            stop.set()
            runs = [run for c in clients for run in c.result()]
        assert second != first and httpx.get(f"{server.url}/api/ps").json()["models"][0]["digest"] == second
        assert all(status == 200 for _, _, status in runs), [e for _, e, s in runs if s != 200][:3]
        assert all(events[-1][1] == "[DONE]" for _, events, _ in runs)  # every response complete
        versions = [v for v, _, _ in runs]
        assert set(versions) == {first, second}, set(versions)
        assert versions.count(second) >= 16  # the new version took over
    finally:
        server.stop()


def test_sighup_reloads(model_path, synth_model):
    server = ServerProcess(model_path, "--device", "cpu").wait_ready()
    try:
        before = httpx.get(f"{server.url}/api/ps").json()["models"][0]["digest"]
        _replace(model_path, synth_model("tiny", "Q8_0"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if httpx.get(f"{server.url}/api/ps").json()["models"][0]["digest"] != before:
                break
            time.sleep(0.1)
        after = httpx.get(f"{server.url}/api/ps").json()["models"][0]["digest"]
        assert after != before
        r = httpx.post(f"{server.url}/api/chat", json={"model": model_path.stem, "messages": QUESTION, "stream": False})
        assert r.status_code == 200 and r.headers[VERSION] == after
    finally:
        server.stop()


def test_operations_routes(model_path):
    server = ServerProcess(model_path, "--device", "cpu").wait_ready()
    try:
        root = httpx.get(f"{server.url}/")
        assert (root.status_code, root.text) == (200, "Ollama is running")
        ps = httpx.get(f"{server.url}/api/ps").json()["models"]
        assert [m["name"] for m in ps] == [f"{model_path.stem}:latest"] and ps[0]["size"] > 0
        claude = httpx.get(f"{server.url}/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
        assert claude["data"][0] == claude["data"][0] | {"type": "model", "id": model_path.stem}
        assert (claude["has_more"], claude["first_id"]) == (False, model_path.stem)
        assert httpx.get(f"{server.url}/v1/models").json()["object"] == "list"  # OpenAI's shape otherwise
        missing = httpx.post(f"{server.url}/api/reload", json={"model": "nope"})
        assert missing.status_code == 404 and "nope" in missing.json()["error"]
    finally:
        server.stop()


def test_several_models_load_on_demand_and_unload_after_keep_alive(synth_model, tmp_path):
    """A folder of two models: neither is loaded until asked for; each answers under its own name; keep_alive 0
    unloads a model once its request is over, a negative one keeps it; the lists name both."""
    for name, qtype in (("alpha", "Q8_0"), ("beta", "Q4_0")):
        shutil.copy(synth_model("tiny", qtype), tmp_path / f"{name}.gguf")
    server = ServerProcess(tmp_path, "--device", "cpu").wait_ready()
    try:
        url = server.url
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "models": []}
        assert httpx.get(f"{url}/api/ps").json() == {"models": []}
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == ["alpha", "beta"]
        assert [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]] == ["alpha:latest", "beta:latest"]
        claude = httpx.get(f"{url}/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
        assert [m["id"] for m in claude["data"]] == ["alpha", "beta"]

        def chat(model, keep_alive):
            body = {"model": model, "messages": QUESTION, "stream": False, "keep_alive": keep_alive}
            try:
                r = httpx.post(f"{url}/api/chat", json=body | {"options": {"num_predict": 4}}, timeout=120)
            except httpx.TimeoutException:
                raise AssertionError(f"{model} did not answer:\n{server.output}") from None
            assert r.status_code == 200, r.text
            return r

        chat("alpha", -1)
        chat("beta:latest", 0)
        deadline = time.monotonic() + 30  # the reaper looks every second
        while time.monotonic() < deadline:
            loaded = [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]
            if loaded == ["alpha:latest"]:
                break
            time.sleep(0.2)
        assert loaded == ["alpha:latest"]
        ps = httpx.get(f"{url}/api/ps").json()["models"][0]
        assert ps["expires_at"].startswith("2318")  # kept loaded (keep_alive < 0)
        chat("beta", "5m")  # loaded again on demand
        missing = httpx.post(f"{url}/api/chat", json={"model": "gamma", "messages": QUESTION})
        assert missing.status_code == 404 and "alpha" in missing.json()["error"]
        nameless = httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION})
        assert nameless.status_code == 400
    finally:
        server.stop()


def test_the_core_loop_keeps_message_order_through_its_threads(tiny_model, tmp_path):
    """core._loop with its _Wire (a receiving and a sending thread) on real sockets: every Add is served, each
    request's tokens arrive in order and end once, Shutdown answers with the end of what was left, and a
    message that does not decode ends the loop with an error (the front end then restarts the core)."""
    ctx = zmq.Context()
    to_core, from_core = f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out"
    front_out, front_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in, core_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    core_in.bind(to_core)
    front_out.connect(to_core)
    front_in.bind(from_core)
    core_out.connect(from_core)
    try:
        for case in ("served", "garbage"):
            wire = core._Wire(core_in, core_out)
            scheduler = Scheduler(CpuEngine(tiny_model, max_seqs=4, max_ctx=128), 16)
            errors: list[BaseException] = []

            def run(scheduler=scheduler, wire=wire, errors=errors) -> None:
                try:
                    core._loop(scheduler, wire, os.getppid())
                except BaseException as e:
                    errors.append(e)
                finally:
                    wire.close()

            loop = threading.Thread(target=run)
            loop.start()
            if case == "garbage":
                front_out.send(b"\xc1 not msgpack")
                loop.join(30)
                assert not loop.is_alive() and errors
                continue
            for rid in range(1, 7):  # more than max_seqs: some wait for a slot
                front_out.send(protocol.encode(Add(rid, [100 + rid] * 20, SamplingParams(seed=rid), 5, [])))
            tokens: dict[int, list[int]] = {}
            ended: list[int] = []
            while len(ended) < 6:
                assert front_in.poll(30_000)
                step = protocol.decode_from_core(front_in.recv())
                assert isinstance(step, Step)
                for out in step.outputs:
                    assert out.id not in ended
                    tokens.setdefault(out.id, []).extend(out.tokens)
                    if out.finish:
                        assert out.finish == "length"
                        ended.append(out.id)
            assert sorted(ended) == list(range(1, 7)) and all(len(t) == 5 for t in tokens.values())
            front_out.send(protocol.encode(Add(7, [100] * 20, SamplingParams(), 1000, [])))
            front_out.send(protocol.encode(Shutdown()))
            loop.join(30)
            assert not loop.is_alive() and not errors
            last = None
            while front_in.poll(1000):
                last = protocol.decode_from_core(front_in.recv())
            assert isinstance(last, Step)  # end_all's: request 7 ended with a 503, nothing after it
            assert [(o.id, o.finish, o.status) for o in last.outputs] == [(7, "error", 503)]
    finally:
        for sock in (front_out, front_in, core_in, core_out):
            sock.close(0)
        ctx.term()
