"""`ingot serve --device cuda` under load, against the acceptance figures of the engine-core split (issue 12):

    aggregate HTTP tok/s at 64 clients (128-token prompts, 128 generated) >= 90% of the engine-level batched
        figure (runtime.bench's tg128@b64, measured in this same session before the server starts)
        and >= 2 x llama-batched-bench's 12,028 tok/s
    TTFT p95 at 64 clients <= 150 ms
    one streaming client's longest gap between tokens grows by <= 50 ms while a 4,000-token prompt arrives
    the prefix cache's hit rate and saved prefill time for a shared 1,000-token system prompt (reported)
    a hot swap under load (16 streaming clients, the file replaced and POST /api/reload): zero failed or
        incomplete responses, each from exactly one version, and both versions answered

Three throughput figures tell where the time goes: the engine's batched decode alone (bench_tg), the same HTTP
workload run through the core's Scheduler in this process (decode plus every request's prefill and the step
loop's bookkeeping, no HTTP and no IPC), and the HTTP aggregate. HTTP / scheduler is the front end's and the
IPC's share of the loss; scheduler / engine is the prefills' and the step loop's.

The load generator runs in LOADGEN_PROCS processes: one asyncio process parses ~10-15k server-sent events a
second, less than the server delivers at 64 streams, and would measure itself.

The model is the real SmolLM2 when present (INGOT_TEST_MODEL or the model cache), else a synthetic GGUF of the
same shape (speed does not depend on the weights' values; it generates mostly control tokens, which have no
text but still one event each on /v1/completions, so TTFT and gaps are measured the same way). Every test
records its numbers; the module prints one summary block at the end (pytest -s shows it). Run on the device:
    . tests/gpu/device_env.sh && python3 -m pytest tests/gpu/test_gpu_serve_load.py -q -s
(the wheels of uvloop and httptools should be among the carried .whl/: uvicorn uses them when installed.)
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import ServerProcess

from ingot.runtime import settings
from ingot.runtime.gpu.constants import PAGE
from ingot.runtime.model.synth import synthesize
from ingot.runtime.server import loadgen

LLAMA_BATCHED_BENCH = 12_028  # tok/s, llama-batched-bench on the same H200 and model (issue 12)
CLIENTS, REQUESTS, PROMPT, GENERATED = 64, 4, 128, 128
LOADGEN_PROCS = 4  # 16 clients each: well under what one loadgen process parses
SYSTEM_PROMPT, QUESTION, PREFIX_REQUESTS = 1000, 24, 8

# Its figures are timings of the whole GPU and host: beside other xdist workers' GPU tests they measure those too
# (the README's `bash ci/test.sh` runs tests/gpu at -n auto; at -n 14 on the H200 the 64-client test failed there
# and passed alone), so under xdist with more than one worker the module skips and says how to run it.
pytestmark = pytest.mark.skipif(
    int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1,
    reason="timing acceptance: run it alone, python -m pytest tests/gpu/test_gpu_serve_load.py -s (-n 0)",
)


@pytest.fixture(scope="module")
def summary():
    """The figures of every test, printed as one block when the module is done."""
    figures: dict = {}
    yield figures
    print("\n==== ingot serve on the GPU (issue 12) ====")
    print(json.dumps(figures, indent=2))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    real = settings.TEST_MODEL.get()
    cached = Path(settings.CACHE_DIR.get() or Path.home() / ".cache" / "ingot") / "models"
    for p in [*([Path(real)] if real else []), *sorted(cached.glob("SmolLM2-135M-Instruct*.gguf"))]:
        if p.is_file():
            return p
    return synthesize("smollm2-135m", "Q4_0", tmp_path_factory.mktemp("models") / "smol-synth.gguf", seed=0)


@pytest.fixture(scope="module")
def engine_figures(model, summary) -> tuple[float, float]:
    """(engine, scheduler) tok/s: batched decode at 64 sequences as `ingot bench --batch 64` measures it, and the
    load test's workload (64 clients x REQUESTS requests, prefills included) through the core's Scheduler."""
    from ingot.runtime.bench import bench_tg
    from ingot.runtime.engines import open_engine
    from ingot.runtime.model.gguf import load_model
    from ingot.runtime.model.tokenizer import Tokenizer

    m = load_model(model)
    engine = open_engine(m, "cuda", max_seqs=CLIENTS, max_ctx=1024)
    try:
        tg = bench_tg(engine, GENERATED, reps=3, batch=CLIENTS).tok_s_mean
        engine.warm()  # every decode width's graph, as the server's core captures them at start
        _scheduler_workload(engine, Tokenizer.from_model(m), 1)  # warm-up: prefill plans
        scheduled = _scheduler_workload(engine, Tokenizer.from_model(m), REQUESTS)
    finally:
        engine.close()
    summary["engine_tg128_b64_tok_s"] = round(tg)
    summary["scheduler_same_workload_tok_s"] = round(scheduled)
    return tg, scheduled


def _scheduler_workload(engine, tokenizer, requests: int) -> float:
    """The HTTP load test's workload in process: CLIENTS closed-loop clients, each sending `requests` requests
    of PROMPT random token ids and GENERATED new tokens one after another; generated tok/s over the whole run."""
    from ingot.runtime.sampling import SamplingParams
    from ingot.runtime.server.protocol import Add
    from ingot.runtime.server.scheduler import Scheduler

    rng = random.Random(1)
    eog = sorted(t for t in tokenizer.eog_ids if t is not None)
    scheduler = Scheduler(engine, settings.PREFILL_CHUNK.get(), tokenizer)
    left = {c: requests for c in range(CLIENTS)}  # requests each client still has to send
    owner: dict[int, int] = {}
    ids = iter(range(1, 1 << 30))

    def send(client: int) -> None:
        rid = next(ids)
        owner[rid], left[client] = client, left[client] - 1
        prompt = [rng.randrange(100, 500) for _ in range(PROMPT)]
        scheduler.add(Add(rid, prompt, SamplingParams(temperature=0.0), GENERATED, eog))

    generated = 0
    t0 = time.perf_counter()
    for c in range(CLIENTS):
        send(c)
    while scheduler.has_work():
        for out in scheduler.step().outputs:
            generated += len(out.tokens)
            if out.finish is not None and left[owner[out.id]]:
                send(owner[out.id])
    return generated / (time.perf_counter() - t0)


@pytest.fixture(scope="module")
def server(model, engine_figures):  # after the engine figures: the GPU is the server's alone from here
    s = ServerProcess(model, "--device", "cuda", "--max-seqs", str(CLIENTS), "--ctx", "8192").wait_ready(600)
    yield s
    s.stop()


def _load(url: str, requests: int) -> dict:
    # fresh prompts each call (seed None): the measured run must not find the warm-up's prompts in the prefix cache
    return asyncio.run(
        loadgen.run(url, CLIENTS, requests, PROMPT, GENERATED, 0.0, None, seed=None, procs=LOADGEN_PROCS)
    )


def test_http_aggregate_and_ttft_at_64_clients(server, engine_figures, summary):
    engine, scheduled = engine_figures
    _load(server.url, 1)  # warm-up: the prefill plans (the decode graphs are captured at start: Engine.warm)
    report = _load(server.url, REQUESTS)
    http = report["generated_tok_s"]
    summary |= {
        "http_aggregate_tok_s": round(http),
        "http_over_engine": round(http / engine, 3),
        "http_over_scheduler": round(http / scheduled, 3),
        "scheduler_over_engine": round(scheduled / engine, 3),
        "ttft_ms_p50": report["ttft_ms"]["p50"],
        "ttft_ms_p95": report["ttft_ms"]["p95"],
        "decode_tok_s_per_stream_p50": report["decode_tok_s_per_stream"]["p50"],
        "load_failed": report["failed"],
    }
    print(json.dumps(report, indent=2))
    assert report["failed"] == 0, report["errors"]
    assert report["ttft_ms"]["p95"] is not None, "no stream had a first token event"
    assert http / engine >= 0.90
    assert http >= 2 * LLAMA_BATCHED_BENCH
    assert report["ttft_ms"]["p95"] <= 150


def test_a_long_prompt_barely_delays_a_running_stream(server, summary):
    try:
        report = asyncio.run(loadgen.interference(server.url, 4000, 2048, None, seed=2))
    except SystemExit as e:  # the loadgen's one-line reason (an HTTP error's status and body)
        summary["interference_error"] = str(e)
        raise AssertionError(f"{e}\nserver log tail:\n{server.output[-3000:]}") from None
    summary |= {
        "interference_delay_ms": report["delay_ms"],
        "interference_gap_ms_before_p50": report["gap_ms_before_p50"],
        "interference_long_prompt_s": report["long_prompt_s"],
    }
    print(json.dumps(report, indent=2))
    assert report["delay_ms"] <= 50


def test_prefix_cache_for_a_shared_system_prompt(server, summary):
    """PREFIX_REQUESTS requests of one 1,000-token system prompt and a different 24-token question, one after
    another: the first prefills all of it, the others adopt the cached pages. Reported: the cache's hit rate
    over these requests (from /metrics, before and after) and the first token's time cold and warm."""
    rng = random.Random(3)
    system = [rng.randrange(100, 500) for _ in range(SYSTEM_PROMPT)]
    before = _prefix_counters(server.url)
    ttft = []
    with httpx.Client(timeout=120) as client:
        model_id = client.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        for _ in range(PREFIX_REQUESTS):
            prompt = system + [rng.randrange(100, 500) for _ in range(QUESTION)]
            t0 = time.perf_counter()
            body = {"model": model_id, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            r = client.post(f"{server.url}/v1/completions", json=body)
            ttft.append((time.perf_counter() - t0) * 1000)  # one token: the response time is the first token's
            assert r.status_code == 200, r.text
    after = _prefix_counters(server.url)
    queried = after[0] - before[0]
    hit = after[1] - before[1]
    summary |= {
        "prefix_hit_rate": round(hit / queried, 3) if queried else None,
        "prefix_saved_tokens": hit,
        "prefix_queried_tokens": queried,
        "prefix_ttft_ms_cold": round(ttft[0], 2),
        "prefix_ttft_ms_warm_median": round(statistics.median(ttft[1:]), 2),
    }
    # every request after the first adopts the system prompt's full KV pages: at least 1,000 tokens less one
    # page each (the tail page is partly the question's, so not shared); it fails if nothing is cached
    assert hit >= (PREFIX_REQUESTS - 1) * (SYSTEM_PROMPT - PAGE)


def _prefix_counters(url: str) -> tuple[float, float]:
    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            values[sample.name] = sample.value
    return values["ingot_prefix_cache_queried_tokens"], values["ingot_prefix_cache_saved_prefill_tokens"]


def test_hot_swap_under_load(model, tmp_path, summary):
    served = tmp_path / "served.gguf"
    shutil.copy(model, served)
    other = synthesize("smollm2-135m", "Q4_0", tmp_path / "other.gguf", seed=3)
    s = ServerProcess(served, "--device", "cuda", "--max-seqs", "16").wait_ready(600)
    try:
        report = asyncio.run(loadgen.hot_swap(s.url, 16, 20.0, other, served, 64, None))
    finally:
        s.stop()
    summary |= {"hotswap_failed": report["failed"], "hotswap_incomplete": report["incomplete"]}
    print(json.dumps(report, indent=2))
    assert report["reload_status"] == 200
    assert report["failed"] == 0 and report["incomplete"] == 0, report["errors"]
    assert len(report["versions"]) == 2 and "None" not in report["versions"]
