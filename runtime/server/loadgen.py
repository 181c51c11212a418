"""A load generator for `ingot serve`: N concurrent streaming clients, aggregate throughput and latency as JSON.

    python -m ingot.runtime.server.loadgen --url http://127.0.0.1:8080 --clients 16 --prompt-tokens 128 \\
        --max-tokens 128

Each client sends --requests streamed /v1/completions one after another. A prompt is --prompt-tokens token
ids (random ids in [100, 500): ordinary tokens of any vocabulary, so the prompt length is exact; drawn afresh
for every run, so no prompt is in the server's prefix cache from an earlier run, unless the same --seed is
given again), greedy unless --temperature is given. With --procs the processes start their clients together,
once every one of them is connected. The report:
    generated_tok_s      all generated tokens / wall time from the first request to the last end
    ttft_ms p50/p95      request sent -> first text received (queueing and prefill included)
    decode_tok_s p50     per stream: (tokens - 1) / (end - first token)
    server               from an ingot server's /metrics before and after the run (null from other servers):
                         its decode steps, their mean batch, wall ms per decode step, tokens, prefix savings,
                         and the front-end process's CPU µs per generated token
Generation can end early at an end-of-text token; the token counts are the server's (usage), not assumed.

Two more modes (--mode) measure what the engine core's design promises:
    interference  one client streams; once it is going, a --long-prompt-tokens prompt (default 4,000) arrives
                  as a second request. Reports the stream's usual gap between tokens (p50 before the long
                  prompt) and its longest gap while the long prompt was prefilled; delay_ms is their
                  difference (chunked prefill keeps it to about one chunk's prefill time). The server needs a
                  context that holds the long prompt (--ctx).
    hotswap       --clients stream in a loop for --duration seconds; halfway, --swap-from is copied over
                  --swap-to (atomically: a new file) and POST /api/reload swaps the model. Reports failed and
                  incomplete responses (both must be 0) and how many responses each version
                  (x-ingot-model-version) answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 660  # --procs: how long the processes wait for each other (each waits up to 600 s for /health)


@dataclass
class Sample:
    sent: float  # time.monotonic(): CLOCK_MONOTONIC, one clock for every process of a --procs run
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None
    pid: int = field(default_factory=os.getpid)  # the client process that sent it


async def _one(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int, temperature: float
) -> Sample:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    s = Sample(time.monotonic())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return s
            async for line in r.aiter_lines():
                # Only the first token's event, the usage and errors are parsed: at 64 streams the loadgen
                # reads ~30,000 events a second, and json.loads of each would make it the bottleneck.
                if not line.startswith("data: {"):
                    continue
                if s.first is None and _TOKEN_EVENT in line:
                    s.first = time.monotonic()  # every generated token has an event, with text or not
                elif _USAGE_EVENT in line or _ERROR_EVENT in line:
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        s.error = chunk["error"].get("message", "error")
                    elif chunk.get("usage"):
                        s.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.monotonic()
    return s


# What the server's compact JSON (openai.py) puts in an event: a token's choice, the usage, an error.
_TOKEN_EVENT = '"choices":[{'
_USAGE_EVENT = '"usage":{'
_ERROR_EVENT = '{"error":'


async def _wait_ready(client: httpx.AsyncClient, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get(f"{url}/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"loadgen: {url}/health did not answer 200 within {timeout:.0f} s")
        await asyncio.sleep(0.5)


async def _clients(
    url: str,
    clients: int,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    temperature: float,
    api_key: str | None,
    seed: int,
    start: Any = None,
) -> tuple[str, list[Sample]]:
    """`clients` streaming clients in this process, each sending `requests` one after another. start: a
    multiprocessing Barrier the processes of a --procs run wait at before their first request."""
    async with _client(clients, api_key) as client:
        await _wait_ready(client, url, 600)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)
        if start is not None:
            await asyncio.to_thread(start.wait)

        async def worker() -> list[Sample]:
            out = []
            for _ in range(requests):
                prompt = [rng.randrange(100, 500) for _ in range(prompt_tokens)]
                out.append(await _one(client, url, model, prompt, max_tokens, temperature))
            return out

        samples = [s for batch in await asyncio.gather(*[worker() for _ in range(clients)]) for s in batch]
    return model, samples


def _clients_in_process(args: tuple) -> tuple[str, list[Sample]]:
    return asyncio.run(_clients(*args))


async def run(
    url: str,
    clients: int,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    temperature: float,
    api_key: str | None,
    seed: int | None = None,
    procs: int = 1,
) -> dict:
    """The load report. With procs > 1 the clients are split across that many processes (spawned), whose
    samples are merged: one asyncio process parses ~10-15k SSE events a second (httpx, measured on one CPU
    core), less than a GPU server delivers at 64 streams, so one process would measure itself. The processes
    wait at a barrier until all are connected, so every share runs at once, each in its own process (without it
    a process that came up first could run one share after another at a fraction of the concurrency).
    seed None: fresh prompts (a repeated run would otherwise be served from the prefix cache)."""
    procs = max(1, min(procs, clients))
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    async with _client(1, api_key) as client:  # the first reading of /metrics needs the server up
        await _wait_ready(client, url, 600)
        before = await _scrape(client, url)
    if procs == 1:
        model, samples = await _clients(url, clients, requests, prompt_tokens, max_tokens, temperature, api_key, seed)
    else:
        shares = [clients // procs + (i < clients % procs) for i in range(procs)]
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        with ctx.Manager() as manager, ProcessPoolExecutor(procs, mp_context=ctx) as pool:
            start = manager.Barrier(procs, timeout=START_TIMEOUT_S)
            jobs = [
                (url, n, requests, prompt_tokens, max_tokens, temperature, api_key, seed + i, start)
                for i, n in enumerate(shares)
            ]
            try:
                parts = await asyncio.gather(*[loop.run_in_executor(pool, _clients_in_process, j) for j in jobs])
            except threading.BrokenBarrierError:
                raise SystemExit(
                    f"loadgen: the {procs} client processes did not all connect within {START_TIMEOUT_S} s"
                ) from None
        model, samples = parts[0][0], [s for _, part in parts for s in part]
    async with _client(1, api_key) as client:
        after = await _scrape(client, url)
    out = report(url, model, clients, samples, prompt_tokens, max_tokens) | {"procs": procs}
    return out | {"server": _server_figures(before, after, out["wall_s"])}


# The /metrics series (metrics.py) whose change over a run says where the server's time went.
_SERIES = (
    "ingot_decode_batch_size_count",
    "ingot_decode_batch_size_sum",
    "ingot_generated_tokens_total",
    "ingot_prompt_tokens_total",
    "ingot_prefix_cache_saved_prefill_tokens",
    "process_cpu_seconds_total",
)


async def _scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """The _SERIES of an ingot server's /metrics, or None when it has none (another server, a proxy)."""
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    except ValueError:
        return None
    return {k: samples[k] for k in _SERIES if k in samples} if _SERIES[0] in samples else None


def _server_figures(before: dict | None, after: dict | None, wall: float) -> dict | None:
    """What the server counted during the run: its decode steps (engine calls with a decode in them; the
    prefill admitted with a decode rides in its step, a prefill-only step is not counted) and their mean batch,
    the run's wall time per decode step, the tokens, and the front-end process's CPU time per generated token.
    Where HTTP falls short of the engine, these say whether the steps were fewer and fuller than they could be
    or the front end was busy."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SERIES}
    steps, generated = d["ingot_decode_batch_size_count"], d["ingot_generated_tokens_total"]
    cpu = d["process_cpu_seconds_total"] if "process_cpu_seconds_total" in after else None
    return {
        "decode_steps": int(steps),
        "mean_batch": round(d["ingot_decode_batch_size_sum"] / steps, 2) if steps else None,
        "wall_ms_per_decode_step": round(1000 * wall / steps, 3) if steps else None,
        "generated_tokens": int(generated),
        "prompt_tokens": int(d["ingot_prompt_tokens_total"]),
        "prefix_saved_tokens": int(d["ingot_prefix_cache_saved_prefill_tokens"]),
        "front_end_cpu_us_per_token": round(1e6 * cpu / generated, 1) if cpu is not None and generated else None,
    }


def report(url: str, model: str, clients: int, samples: list[Sample], prompt_tokens: int, max_tokens: int) -> dict:
    """generated_tok_s: every generated token / the time from the first request sent to the last one ended."""
    ok = [s for s in samples if s.error is None]
    ends = [s.end for s in samples if s.end is not None]
    wall = max(ends) - min(s.sent for s in samples) if ends else 0.0
    timed = [(s, s.first, s.end) for s in ok if s.first is not None and s.end is not None]
    ttft = np.array([first - s.sent for s, first, _ in timed]) * 1000
    decode = np.array([(s.tokens - 1) / (end - first) for s, first, end in timed if s.tokens > 1 and end > first])
    generated = sum(s.tokens for s in ok)
    return {
        "url": url,
        "model": model,
        "clients": clients,
        "requests": len(samples),
        "client_processes": len({s.pid for s in samples}),
        "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:5],
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "generated_tokens": generated,
        "wall_s": round(wall, 3),
        "generated_tok_s": round(generated / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": {"p50": _pct(ttft, 50), "p95": _pct(ttft, 95), "max": _pct(ttft, 100)},
        "decode_tok_s_per_stream": {"p50": _pct(decode, 50), "p5": _pct(decode, 5)},
    }


def _client(clients: int, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)
    return httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits)


async def interference(
    url: str, long_prompt_tokens: int, stream_tokens: int, api_key: str | None, seed: int | None
) -> dict:
    """One stream's longest gap between tokens while a long prompt is prefilled, against its usual gap."""
    rng = random.Random(seed)
    async with _client(2, api_key) as client:
        await _wait_ready(client, url, 600)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        arrivals: list[float] = []
        done = asyncio.Event()

        async def stream() -> None:
            # long enough to outlast the long prompt (a raw "the" rarely meets EOS early)
            body = {"model": model, "prompt": "the", "max_tokens": stream_tokens, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body | {"temperature": 0.0}) as r:
                if r.status_code != 200:
                    raise SystemExit(f"loadgen: the stream failed: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if _TOKEN_EVENT in line:  # one event per token, with text or not (a control token)
                        arrivals.append(time.monotonic())
                    if done.is_set():
                        return

        streaming = asyncio.create_task(stream())
        while len(arrivals) < 64 and not streaming.done():  # its usual pace, before the long prompt
            await asyncio.sleep(0.01)
        long_prompt = [rng.randrange(100, 500) for _ in range(long_prompt_tokens)]
        sent = time.monotonic()
        r = await client.post(
            f"{url}/v1/completions", json={"model": model, "prompt": long_prompt, "max_tokens": 1, "temperature": 0}
        )
        answered = time.monotonic()
        await asyncio.sleep(0.2)  # a few tokens after it, so the gap that spans its end is closed
        done.set()
        await streaming
    if r.status_code != 200:
        raise SystemExit(f"loadgen: the long prompt failed: HTTP {r.status_code}: {r.text[:200]}")
    if not arrivals or arrivals[-1] < answered:  # (stream tokens: {len(arrivals)})
        raise SystemExit("loadgen: the stream ended before the long prompt was answered (EOS?); nothing to measure")
    t = np.array(arrivals)
    gaps = np.diff(t) * 1000
    before = gaps[t[1:] < sent]
    during = gaps[(t[1:] > sent) & (t[:-1] < answered)]  # gaps that overlap the long prompt's time
    usual = float(np.percentile(before, 50)) if len(before) else 0.0
    worst = float(during.max()) if len(during) else 0.0
    return {
        "url": url,
        "model": model,
        "long_prompt_tokens": long_prompt_tokens,
        "long_prompt_s": round(answered - sent, 3),
        "gap_ms_before_p50": round(usual, 2),
        "gap_ms_during_max": round(worst, 2),
        "delay_ms": round(worst - usual, 2),
        "stream_tokens": len(arrivals),
    }


async def hot_swap(
    url: str, clients: int, duration: float, swap_from: Path, swap_to: Path, max_tokens: int, api_key: str | None
) -> dict:
    """Clients stream in a loop while the model file is replaced and reloaded halfway through."""
    async with _client(clients, api_key) as client:
        await _wait_ready(client, url, 600)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        stop = asyncio.Event()
        runs: list[tuple[str | None, bool, str | None]] = []  # (version, complete, error)

        async def one() -> None:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
            version, finished, complete, error = None, False, False, None
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body | {"temperature": 0}) as r:
                    version = r.headers.get("x-ingot-model-version")
                    if r.status_code != 200:
                        error = f"HTTP {r.status_code}"
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            error = error or chunk.get("error", {}).get("message")
                            finished |= any(c.get("finish_reason") for c in chunk.get("choices", []))
                        elif line == "data: [DONE]":
                            complete = finished
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
            runs.append((version, complete and error is None, error))

        async def worker() -> None:
            while not stop.is_set():
                await one()

        workers = [asyncio.create_task(worker()) for _ in range(clients)]
        await asyncio.sleep(duration / 2)
        tmp = swap_to.with_name(swap_to.name + ".new")
        await asyncio.to_thread(shutil.copyfile, swap_from, tmp)
        os.replace(tmp, swap_to)
        t0 = time.perf_counter()
        reload = await client.post(f"{url}/api/reload", json={"model": model})
        reload_s = time.perf_counter() - t0
        await asyncio.sleep(duration / 2)
        stop.set()
        await asyncio.gather(*workers)
    versions: dict[str, int] = {}
    for version, _, _ in runs:
        versions[str(version)] = versions.get(str(version), 0) + 1
    return {
        "url": url,
        "clients": clients,
        "requests": len(runs),
        "failed": sum(1 for _, _, e in runs if e is not None),
        "incomplete": sum(1 for _, ok, e in runs if not ok and e is None),
        "errors": sorted({e for _, _, e in runs if e})[:5],
        "reload_status": reload.status_code,
        "reload_s": round(reload_s, 3),
        "versions": versions,
    }


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ingot.runtime.server.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument(
        "--procs", type=int, default=1, help="load: processes the clients are split across (one parses ~10k events/s)"
    )
    p.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128, help="per request (interference: the stream's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, help="prompts from this seed (default: fresh ones every run)")
    p.add_argument("--mode", choices=["load", "interference", "hotswap"], default="load")
    p.add_argument("--long-prompt-tokens", type=int, default=4000, help="interference: the long prompt's length")
    p.add_argument("--duration", type=float, default=20.0, help="hotswap: seconds of load, the swap halfway")
    p.add_argument("--swap-from", type=Path, help="hotswap: the new model file")
    p.add_argument("--swap-to", type=Path, help="hotswap: the file the server serves (replaced)")
    a = p.parse_args(argv)
    url = a.url.rstrip("/")
    if a.mode == "interference":
        report = asyncio.run(interference(url, a.long_prompt_tokens, a.max_tokens, a.api_key, a.seed))
    elif a.mode == "hotswap":
        if a.swap_from is None or a.swap_to is None:
            p.error("--mode hotswap needs --swap-from and --swap-to")
        report = asyncio.run(hot_swap(url, a.clients, a.duration, a.swap_from, a.swap_to, a.max_tokens, a.api_key))
    else:
        report = asyncio.run(
            run(url, a.clients, a.requests, a.prompt_tokens, a.max_tokens, a.temperature, a.api_key, a.seed, a.procs)
        )
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    if report.get("failed") or report.get("incomplete"):
        sys.exit(1)


if __name__ == "__main__":
    main()
