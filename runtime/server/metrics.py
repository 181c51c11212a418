"""/metrics in the Prometheus text format (prometheus-client), one registry per server.

ingot_requests_total{endpoint,status}       HTTP requests, by route and status code
ingot_prompt_tokens_total                   prompt tokens prefilled
ingot_generated_tokens_total                tokens generated (rate() of it is the server's tokens/s)
ingot_sequences_total{reason}               sequences ended: eos, stop, length, cancelled, error
ingot_time_to_first_token_seconds           from the request's arrival to its first token (queueing included)
ingot_queue_wait_seconds                    from arrival to admission
ingot_decode_tokens_per_second              decoded tokens per second of the last step (a prefill in it counts)
ingot_decode_batch_size                     sequences per decode step (histogram)
ingot_queue_depth, ingot_running_sequences  requests waiting for admission, sequences being generated
ingot_kv_cache_pages_used, _free            KV-cache pages in use and free (cached pages no sequence holds are free)
ingot_prefix_cache_queried_tokens           prompt tokens looked up in the prefix cache, since start
ingot_prefix_cache_saved_prefill_tokens     of those, read from cached pages instead of prefilled, since start
ingot_prefix_cache_hit_rate                 saved / queried
process_cpu_seconds_total, process_*        the front-end process (prometheus-client's process collector, Linux):
                                            its CPU time per generated token is what loadgen reports
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ingot.runtime.server.protocol import Stats

disable_created_metrics()  # no *_created series: they double the output and nothing here reads them
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, stats: Callable[[], Stats]):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_cpu_seconds_total etc. of this (the front-end) process
        self.requests = Counter(
            "ingot_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("ingot_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("ingot_generated_tokens", "Tokens generated", registry=r)
        self.sequences = Counter("ingot_sequences", "Sequences ended, by reason", ["reason"], registry=r)
        self.ttft = Histogram(
            "ingot_time_to_first_token_seconds", "Request arrival to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "ingot_queue_wait_seconds", "Request arrival to admission", buckets=LATENCY_BUCKETS, registry=r
        )
        self.decode_rate = Gauge(
            "ingot_decode_tokens_per_second",
            "Decoded tokens per second of the last step (its prefill included in its time)",
            registry=r,
        )
        self.batch = Histogram(
            "ingot_decode_batch_size", "Sequences per decode step", buckets=BATCH_BUCKETS, registry=r
        )
        gauges: list[tuple[str, str, Callable[[Stats], float]]] = [
            ("ingot_queue_depth", "Requests waiting for admission", lambda s: s.waiting),
            ("ingot_running_sequences", "Sequences being generated", lambda s: s.running),
            ("ingot_kv_cache_pages_used", "KV-cache pages in use", lambda s: s.kv_pages_used),
            ("ingot_kv_cache_pages_free", "KV-cache pages free", lambda s: s.kv_pages_total - s.kv_pages_used),
            # the engine's running totals (it owns them), so gauges that only grow rather than counters
            (
                "ingot_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache",
                lambda s: s.prefix_queried_tokens,
            ),
            (
                "ingot_prefix_cache_saved_prefill_tokens",
                "Prompt tokens read from the prefix cache",
                lambda s: s.prefix_hit_tokens,
            ),
            ("ingot_prefix_cache_hit_rate", "Saved / queried prompt tokens of the prefix cache", _hit_rate),
        ]
        for name, doc, read in gauges:
            Gauge(name, doc, registry=r).set_function(functools.partial(_read_stats, read, stats))

    # --- the engine client's Observer -------------------------------------------------------------------

    def admitted(self, prompt_tokens: int, queued_s: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.queue_wait.observe(queued_s)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def step(self, batch: int, seconds: float) -> None:
        self.batch.observe(batch)
        self.decode_rate.set(batch / seconds if seconds > 0 else 0.0)

    def generated(self, n_tokens: int) -> None:
        self.generated_tokens.inc(n_tokens)

    def retired(self, reason: str) -> None:
        self.sequences.labels(reason).inc()

    # --- HTTP -------------------------------------------------------------------------------------

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def _read_stats(read: Callable[[Stats], float], stats: Callable[[], Stats]) -> float:
    return read(stats())


def _hit_rate(s: Stats) -> float:
    return s.prefix_hit_tokens / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0


class RequestCounter:
    """ASGI middleware counting each HTTP request by its route's path template and final status."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.requests = app, metrics.requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # if the app fails before it starts a response

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")  # set by the router once a route matched
            self.requests.labels(getattr(route, "path", "unmatched"), str(status)).inc()
