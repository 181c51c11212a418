"""A load generator for `ingot serve`: N concurrent streaming clients, aggregate throughput and latency as JSON.

    python -m ingot.runtime.server.loadgen --url http://127.0.0.1:8080 --clients 16 --prompt-tokens 128 \\
        --max-tokens 128

Each client sends --requests streamed /v1/completions one after another. A prompt is --prompt-tokens token
ids (seeded random ids in [100, 500): ordinary tokens of any vocabulary, so the prompt length is exact and
no prompt is cached), greedy unless --temperature is given. The report:
    generated_tok_s      all generated tokens / wall time from the first request to the last end
    ttft_ms p50/p95      request sent -> first text received (queueing and prefill included)
    decode_tok_s p50     per stream: (tokens - 1) / (end - first token)
Generation can end early at an end-of-text token; the token counts are the server's (usage), not assumed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np


@dataclass
class Sample:
    sent: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    error: str | None = None


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
    s = Sample(time.perf_counter())
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = chunk["error"].get("message", "error")
                elif chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                elif s.first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    s.first = time.perf_counter()
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.perf_counter()
    return s


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


async def run(
    url: str,
    clients: int,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    temperature: float,
    api_key: str | None,
    seed: int,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as client:
        await _wait_ready(client, url, 600)
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        rng = random.Random(seed)

        async def worker() -> list[Sample]:
            out = []
            for _ in range(requests):
                prompt = [rng.randrange(100, 500) for _ in range(prompt_tokens)]
                out.append(await _one(client, url, model, prompt, max_tokens, temperature))
            return out

        start = time.perf_counter()
        samples = [s for batch in await asyncio.gather(*[worker() for _ in range(clients)]) for s in batch]
        wall = time.perf_counter() - start

    ok = [s for s in samples if s.error is None]
    # a stream of control tokens only has no first text
    timed = [(s, s.first, s.end) for s in ok if s.first is not None and s.end is not None]
    ttft = np.array([first - s.sent for s, first, _ in timed]) * 1000
    decode = np.array([(s.tokens - 1) / (end - first) for s, first, end in timed if s.tokens > 1 and end > first])
    generated = sum(s.tokens for s in ok)
    return {
        "url": url,
        "model": model,
        "clients": clients,
        "requests": len(samples),
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


def _pct(values: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if len(values) else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ingot.runtime.server.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    report = asyncio.run(
        run(a.url.rstrip("/"), a.clients, a.requests, a.prompt_tokens, a.max_tokens, a.temperature, a.api_key, a.seed)
    )
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    if report["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
