"""The server's shared state: `Server` (the model once loaded, the engine core's client, the metrics, the limits) and
what every route does with a request before and after its dialect (API key, body, prompt tokens, jobs,
streaming). The dialects (openai.py, anthropic.py, ollama.py) build on this module; app.py assembles them.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ingot.runtime.errors import UsageError
from ingot.runtime.generate import GenerationRequest
from ingot.runtime.limits import bounded_json_loads
from ingot.runtime.model.chat import chat_prompt
from ingot.runtime.model.gguf import Model
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.resolve import open_model
from ingot.runtime.server.client import EngineClient, Job
from ingot.runtime.server.core import Options
from ingot.runtime.server.metrics import Metrics
from ingot.runtime.server.protocol import Ready, Stats
from ingot.runtime.server.request import ApiError, TextRequest

MAX_BODY_BYTES = 1 << 20
SHUTDOWN_GRACE_S = 5
log = logging.getLogger("uvicorn.error")
__all__ = ["Options", "Server"]


class Server:
    """What the routes share: the model (for its tokenizer and metadata) once loaded, the engine core's client,
    the metrics and the limits."""

    def __init__(self, spec: str, options: Options):
        self.spec, self.options = spec, options
        self.model_id = Path(spec).stem  # `smollm2`, or the file name without .gguf/.ingot
        self.created = int(time.time())
        self._loaded: tuple[Model, Tokenizer] | None = None  # set by load()
        self.metrics = Metrics(self._stats)
        self.client = EngineClient(spec, options, self.metrics)
        self.failure: BaseException | None = None  # what loading raised
        self.ready = False
        self.on_failure: Callable[[BaseException], None] = lambda e: None

    def _stats(self) -> Stats:
        return self.client.stats

    def load(self) -> None:
        """The front end's copy of the model (tokenizer, chat template, /api/show), in a worker thread."""
        opened = open_model(self.spec, pubkeys=self.options.pubkeys)
        self._loaded = (opened.model, Tokenizer.from_model(opened.model))

    async def start_engine(self) -> None:
        """Load the model here and in the engine core process, while the socket already answers /health."""
        t0 = time.perf_counter()
        try:
            await run_in_threadpool(self.load)
            info = await self.client.start()
        except BaseException as e:  # reported by `ingot serve` as its exit status
            self.failure = e
            self.on_failure(e)
            return
        self.ready = True
        log.info(
            "model %s loaded in %.1f s: %s engine in process %s, %d sequences of %d tokens",
            self.model_id,
            time.perf_counter() - t0,
            info.name,
            self.client.process.pid if self.client.process else "?",
            info.max_seqs,
            info.max_ctx,
        )

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def _parts(self) -> tuple[Model, Tokenizer]:
        if self._loaded is None:  # routes check `ready` first, so this is a bug, not a client error
            raise RuntimeError("the model is used before it was loaded")
        return self._loaded

    @property
    def model(self) -> Model:
        return self._parts()[0]

    @property
    def tokenizer(self) -> Tokenizer:
        return self._parts()[1]

    @property
    def engine_info(self) -> Ready:
        if self.client.info is None:
            raise RuntimeError("the engine is used before it was loaded")
        return self.client.info

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

    async def prompt_tokens(self, req: TextRequest) -> list[int]:
        """The prompt's token ids, built exactly as `ingot run` builds them (with and without --chat)."""
        if req.messages is not None:
            return await run_in_threadpool(chat_prompt, self.tokenizer, req.messages)
        if isinstance(req.prompt, str):
            return await run_in_threadpool(self.tokenizer.encode, req.prompt)
        ids = list(req.prompt or [])
        n_vocab = self.tokenizer.n_vocab
        if not all(0 <= t < n_vocab for t in ids):
            raise ApiError(400, f"prompt token ids must be in 0..{n_vocab - 1}", param="prompt")
        return ids

    async def start(self, req: TextRequest) -> Job:
        tokens = await self.prompt_tokens(req)
        max_ctx = self.engine_info.max_ctx
        if req.max_tokens is not None and req.max_tokens > max_ctx:
            raise ApiError(
                400, f"max_tokens {req.max_tokens} is more than the context of {max_ctx} tokens", param="max_tokens"
            )
        request = GenerationRequest(
            tuple(tokens), req.params, req.max_tokens or max(1, max_ctx - len(tokens)), req.stop
        )
        request.check(max_ctx)  # UsageError (-> 400) for a prompt longer than the context
        job = Job(self.tokenizer, request)
        await self.client.submit(job)
        return job

    async def collect(self, request: Request, job: Job) -> str:
        """The whole text of a non-streamed request; the job is cancelled if the client disconnects first."""

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.client.cancel(job)

        watcher = asyncio.create_task(watch())
        try:
            return "".join([chunk.text async for chunk in job.chunks()])
        finally:
            watcher.cancel()

    def stream(
        self, job: Job, events: AsyncIterator, error_event: Callable[[ApiError], Any], *, media_type: str | None = None
    ) -> Response:
        """A streamed response: server-sent events, or NDJSON lines when media_type says so. An error after the
        first byte becomes the dialect's error event; whatever ends the response cancels the job."""

        async def guarded() -> AsyncIterator:
            try:
                async for event in events:
                    yield event
            except ApiError as e:
                yield error_event(e)

        response: Response
        if media_type is None:
            response = EventSourceResponse(guarded(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S + 2)
        else:
            response = StreamingResponse(guarded(), media_type=media_type)
        return _CancelAtEnd(response, lambda: self.client.cancel(job))


class _CancelAtEnd(Response):
    """An ASGI response that runs `cancel` once the wrapped response is over, however it ended. A Response by
    type only (what the routes return): all of ASGI is delegated to the wrapped response."""

    def __init__(self, response: Response, cancel: Callable[[], None]):
        self.response, self.cancel = response, cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.cancel()
