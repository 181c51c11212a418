"""The server's shared state: `Server` (the model once loaded, the engine core's client, the metrics, the limits) and
what every route does with a request before and after its dialect (API key, body, prompt tokens, jobs,
streaming). The dialects (openai.py, anthropic.py, ollama.py) build on this module; app.py assembles them.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sse_starlette import ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ingot.runtime.errors import IngotError, UsageError
from ingot.runtime.generate import GenerationRequest
from ingot.runtime.limits import bounded_json_loads
from ingot.runtime.model.chat import chat_prompt
from ingot.runtime.model.gguf import Model
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.resolve import open_model
from ingot.runtime.server.client import EngineClient, Job
from ingot.runtime.server.core import Options, model_version
from ingot.runtime.server.metrics import Metrics
from ingot.runtime.server.protocol import Ready, Stats
from ingot.runtime.server.request import ApiError, TextRequest

MAX_BODY_BYTES = 1 << 20
log = logging.getLogger("uvicorn.error")
__all__ = ["Options", "Server"]


@dataclass(frozen=True)
class Loaded:
    """One version of the model: the front end's copy (tokenizer, template, metadata) and its engine core."""

    model: Model
    tokenizer: Tokenizer
    client: EngineClient
    version: str  # core.model_version: a bundle's root digest, or a GGUF file's identity


# The version that answered the request being handled (set by Server.start, read by app.py for the
# x-ingot-model-version header): a request's task sees its own value.
ANSWERED_BY: contextvars.ContextVar[str] = contextvars.ContextVar("answered_by")


class Server:
    """What the routes share: the model version serving now (and any older one still finishing its requests
    after a reload), the metrics and the limits.

    Hot swap: reload() opens the model from disk again in a new engine core; once it is ready, new requests go
    to it, while requests already running finish on the old core, which then stops. Every response carries the
    version that answered it (header x-ingot-model-version)."""

    def __init__(self, spec: str, options: Options, metrics: Metrics | None = None):
        self.spec, self.options = spec, options
        self.model_id = Path(spec).stem  # `smollm2`, or the file name without .gguf/.ingot
        self.created = int(time.time())
        self.metrics = metrics or Metrics(self.stats)
        self.failure: BaseException | None = None  # what the first load raised
        self.on_failure: Callable[[BaseException], None] = lambda e: None
        self._current: Loaded | None = None
        self._clients: set[EngineClient] = set()  # every core still running: the current one, retiring ones
        self._reloading = asyncio.Lock()
        self._draining = False

    def stats(self) -> Stats:
        return self._current.client.stats if self._current is not None else Stats()

    @property
    def in_flight(self) -> int:
        """Requests not finished yet, on every version still running."""
        return sum(client.in_flight for client in self._clients)

    def load(self) -> tuple[Model, Tokenizer, str]:
        """The front end's copy of the model (tokenizer, chat template, /api/show), in a worker thread."""
        opened = open_model(self.spec, pubkeys=self.options.pubkeys)
        tokenizer = Tokenizer.from_model(opened.model)
        tokenizer.token_bytes  # noqa: B018 - built here, off the event loop, not at the first request's first token
        return opened.model, tokenizer, model_version(opened)

    async def _load_version(self) -> Loaded:
        """The model as it is on disk now, here and in a new engine core. Both open the file; if it was replaced
        in between (their versions differ), once more."""
        for _ in range(2):
            model, tokenizer, version = await run_in_threadpool(self.load)
            client = EngineClient(self.spec, self.options, self.metrics)
            self._clients.add(client)
            try:
                info = await client.start()
            except BaseException:
                self._clients.discard(client)
                await client.stop()
                raise
            if info.version == version:
                return Loaded(model, tokenizer, client, version)
            self._clients.discard(client)
            await client.stop()
        raise IngotError(f"{self.spec} kept changing while it was loaded", hint="reload once the new file is in place")

    async def start_engine(self) -> None:
        """The first load, while the socket already answers /health (503 until it is done)."""
        t0 = time.perf_counter()
        try:
            self._current = current = await self._load_version()
        except BaseException as e:  # reported by `ingot serve` as its exit status
            self.failure = e
            self.on_failure(e)
            return
        info = self.engine_info
        log.info(
            "model %s (%s) loaded in %.1f s: %s engine in process %s, %d sequences of %d tokens",
            self.model_id,
            current.version[:23],
            time.perf_counter() - t0,
            info.name,
            current.client.process.pid if current.client.process else "?",
            info.max_seqs,
            info.max_ctx,
        )

    async def reload(self) -> str:
        """Hot swap (POST /api/reload, SIGHUP): load the model from disk again; new requests go to the new
        version once it is ready; the old one finishes what it runs, then stops. Returns the new version. A
        failed reload leaves the old version serving (and raises)."""
        async with self._reloading:
            if self._draining:
                raise ApiError(503, "the server is shutting down")
            new = await self._load_version()
            old, self._current = self._current, new
            log.info("model %s reloaded: version %s", self.model_id, new.version[:23])
            if old is not None and old.client is not new.client:
                asyncio.create_task(self._retire(old.client))
            return new.version

    async def _retire(self, client: EngineClient) -> None:
        await client.retire()
        self._clients.discard(client)

    def drain(self, seconds: float) -> None:
        """SIGINT/SIGTERM (from a signal handler: flags only)."""
        self._draining = True
        for client in list(self._clients):
            client.drain(seconds)

    async def stop(self) -> None:
        for client in list(self._clients):
            await client.stop()
        self._clients.clear()

    async def unload(self) -> None:
        """Stop its engine cores; the next start_engine loads it again (several models: keep_alive, eviction)."""
        current, self._current = self._current, None
        if current is not None:
            log.info("model %s unloaded", self.model_id)
        await self.stop()

    @property
    def ready(self) -> bool:
        return self._current is not None

    @property
    def loaded(self) -> bool:
        return self._current is not None

    def _live(self) -> Loaded:
        if self._current is None:  # routes check `ready` first, so this is a bug, not a client error
            raise RuntimeError("the model is used before it was loaded")
        return self._current

    @property
    def model(self) -> Model:
        return self._live().model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._live().tokenizer

    @property
    def version(self) -> str:
        return self._live().version

    @property
    def client(self) -> EngineClient:
        return self._live().client

    @property
    def engine_info(self) -> Ready:
        info = self._live().client.info
        if info is None:
            raise RuntimeError("the engine is used before it was loaded")
        return info

    # --- per request ------------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        bearer = request.headers.get("authorization", "")
        given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)")

    def check_model(self, name: str) -> None:
        if name not in (self.model_id, f"{self.model_id}:latest"):
            raise ApiError(
                404,
                f"model {name!r} not found; this server serves {self.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {int(declared)} bytes, more than the limit of {MAX_BODY_BYTES}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than the limit of {MAX_BODY_BYTES} bytes")
        try:  # bounded nesting: a deeply nested body is a 400, not a RecursionError (500)
            return bounded_json_loads(bytes(body), what="the request body", max_size=MAX_BODY_BYTES, error=UsageError)
        except UsageError as e:
            raise ApiError(400, e.message.replace("not valid UTF-8 JSON", "not valid JSON")) from None

    async def prompt_tokens(self, req: TextRequest, tokenizer: Tokenizer | None = None) -> list[int]:
        """The prompt's token ids, built exactly as `ingot run` builds them (with and without --chat)."""
        tokenizer = tokenizer or self.tokenizer
        if req.messages is not None:
            return await run_in_threadpool(chat_prompt, tokenizer, req.messages, req.tools)
        if isinstance(req.prompt, str):
            return await run_in_threadpool(tokenizer.encode, req.prompt)
        ids = list(req.prompt or [])
        n_vocab = tokenizer.n_vocab
        if not all(0 <= t < n_vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{n_vocab - 1}", param="prompt")
        return ids

    async def start(self, req: TextRequest) -> Job:
        """Tokenize and submit to the version serving now (again if a reload swapped it meanwhile)."""
        while True:
            current = self._live()
            tokens = await self.prompt_tokens(req, current.tokenizer)
            if current is self._current:
                break
        max_ctx = self.engine_info.max_ctx
        if req.max_tokens is not None and req.max_tokens > max_ctx:
            raise ApiError(
                400, f"max_tokens {req.max_tokens} is more than the context of {max_ctx} tokens", param="max_tokens"
            )
        request = GenerationRequest(
            tuple(tokens), req.params, req.max_tokens or max(1, max_ctx - len(tokens)), req.stop
        )
        request.check(max_ctx)  # UsageError (-> 400) for a prompt longer than the context
        constraint = req.constraint.to_json().encode() if req.constraint is not None else None
        job = Job(current.tokenizer, request, constraint)
        await current.client.submit(job)
        ANSWERED_BY.set(current.version)
        return job

    async def collect(self, request: Request, job: Job) -> str:
        """The whole text of a non-streamed request; the job is cancelled if the client disconnects first."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()

        watcher = asyncio.create_task(watch())
        try:
            return "".join([chunk.text async for chunk in job.chunks()])
        finally:
            watcher.cancel()

    def stream(
        self, job: Job, events: AsyncIterator, error_event: Callable[[ApiError], Any], *, media_type: str | None = None
    ) -> Response:
        """A streamed response: server-sent events, or NDJSON lines when media_type says so. An error after the
        first byte becomes the dialect's error event; whatever ends the response cancels the job.

        Events are framed here into bytes (frame()) and sent by Starlette's StreamingResponse, one ASGI send
        per event: sse-starlette's EventSourceResponse costs a timeout scope and a ping task per event and
        stream, which at 64 streams of a fast GPU is a large share of the front end's time per token. A
        client that goes away is still noticed while nothing is sent (StreamingResponse listens for it)."""

        async def guarded() -> AsyncIterator[bytes]:
            try:
                async for event in events:
                    yield frame(event)
            except ApiError as e:
                yield frame(error_event(e))

        response: Response
        if media_type is None:
            job.ping = True  # keep-alives while it waits (client.PING); NDJSON has no line a client would skip
            response = StreamingResponse(guarded(), media_type="text/event-stream", headers=SSE_HEADERS)
        else:
            response = StreamingResponse(guarded(), media_type=media_type)
        return _CancelAtEnd(response, lambda: job.cancel())


# What sse-starlette sent with every event stream: no caching, and no buffering by a proxy (nginx) in between.
# (Its keep-alive comment is client.PING's, sent by the dialects.)
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
SSE_PING = b": ping\n\n"  # an SSE comment line: every client skips it


def frame(event: bytes | str | ServerSentEvent) -> bytes:
    """An event's bytes on the wire: bytes as they are (already framed, e.g. openai.py's), text as UTF-8, a
    ServerSentEvent in the SSE format (anthropic.py's, with LF line ends)."""
    if isinstance(event, bytes):
        return event
    return event.encode()  # str.encode (UTF-8) or ServerSentEvent.encode


class _CancelAtEnd(Response):
    """An ASGI response that runs `cancel` once the wrapped response is over, however it ended. A Response by
    type only (what the routes return): all of ASGI is delegated to the wrapped response."""

    def __init__(self, response: Response, cancel: Callable[[], None]):
        self.response, self.cancel = response, cancel

    @property
    def headers(self) -> MutableHeaders:
        return self.response.headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.cancel()
