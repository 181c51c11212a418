"""The HTTP server: one Starlette app speaking three API dialects over one scheduler.

    OpenAI      POST /v1/chat/completions, /v1/completions   GET /v1/models, /v1/models/{model}   (openai.py)
    Anthropic   POST /v1/messages, /v1/messages/count_tokens                                    (anthropic.py)
    Ollama      POST /api/chat, /api/generate, /api/show      GET /api/tags, /api/version       (ollama.py)
    Operations  GET /health (503 while the model loads, 200 once it serves), GET /metrics (metrics.py)

Every API route goes through the same steps here: the API key (if --api-key), readiness, the body (JSON, at
most MAX_BODY_BYTES), the dialect's parser into a TextRequest, tokenizing it as `ingot run` does (the chat
template via chat.chat_prompt, raw text via Tokenizer.encode), a Job on the scheduler, and back through the
dialect's shaping. Any error becomes the dialect's error body with its status code.

A streamed response cancels its job whenever it ends (finished, client gone, shutdown); a non-streamed one
watches for the client's disconnect while it waits. Cancelling frees the sequence's KV cache before the
next decode step. On SIGINT/SIGTERM uvicorn stops accepting connections and in-flight requests get
SHUTDOWN_GRACE_S to finish; what is left then ends with a 503 in its API's shape (an error event in a
stream), then the engine thread stops and the engine closes.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import uvicorn
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ingot.toolchain.errors import IncompatibleError, IngotError, ModelError, UsageError

from ..engines import open_engine
from ..engines.base import Engine
from ..generate import GenerationRequest
from ..model import Model
from ..tokenizer import Tokenizer
from . import anthropic, ollama, openai
from .metrics import Metrics, RequestCounter
from .request import ApiError, TextRequest
from .scheduler import Job, Scheduler

MAX_BODY_BYTES = 1 << 20
SHUTDOWN_GRACE_S = 5.0
log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class Options:
    device: str = "auto"
    gpu: int | None = None          # None: the GPU with the most free memory
    max_seqs: int = 32              # sequences decoded together
    ctx: int | None = None          # tokens per sequence; None: the engine's default
    api_key: str | None = None


def pick_gpu(requested: int | None) -> int:
    """--gpu N, checked against the machine; without it the GPU with the most free memory (NVML)."""
    from ingot.toolchain.probe import probe

    gpus = probe().gpus
    if requested is not None:
        if gpus and not 0 <= requested < len(gpus):
            raise UsageError(f"--gpu {requested}: this machine has {len(gpus)} GPU(s)",
                             hint=f"use 0..{len(gpus) - 1}")
        return requested
    return max(gpus, key=lambda g: g.memory_free or 0).index if gpus else 0


def open_serving_engine(model: Model, options: Options) -> Engine:
    """open_engine's device rule (auto: the GPU engine when a GPU is present and the engine loads), with a
    choice of GPU and the server's batch width and context."""
    from ingot.toolchain.probe import probe

    kw = {"max_seqs": options.max_seqs, "max_ctx": options.ctx}
    if options.device == "cpu" or (options.device == "auto" and not probe().gpus):
        return open_engine(model, "cpu", **kw)
    try:
        return open_engine(model, "cuda", gpu=pick_gpu(options.gpu), **kw)
    except IncompatibleError:
        if options.device == "cuda":
            raise
        return open_engine(model, "cpu", **kw)


class Server:
    """What the routes share: the model once loaded, the scheduler, the metrics and the limits."""

    def __init__(self, spec: str, options: Options):
        self.spec, self.options = spec, options
        self.model_id = Path(spec).stem            # `smollm2`, or the file name without .gguf/.ingot
        self.created = int(time.time())
        self.model: Model | None = None
        self.tokenizer: Tokenizer | None = None
        self.engine: Engine | None = None
        self.metrics = Metrics(lambda: self.scheduler.stats)
        self.scheduler = Scheduler(self.metrics)
        self.on_failure: Callable[[BaseException], None] = lambda e: None

    def load(self) -> Engine:
        """On the engine thread, while the socket already answers."""
        from ..resolve import open_model

        t0 = time.perf_counter()
        model = open_model(self.spec)
        self.tokenizer = Tokenizer.from_model(model)
        self.model = model
        self.engine = open_serving_engine(model, self.options)
        log.info("model %s loaded in %.1f s: %s, %d sequences of %d tokens", self.model_id,
                 time.perf_counter() - t0, type(self.engine).__name__, self.engine.max_seqs, self.engine.max_ctx)
        return self.engine

    @property
    def ready(self) -> bool:
        return self.scheduler.ready.is_set()

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
            raise ApiError(404, f"model {name!r} not found; this server serves {self.model_id!r}", param="model",
                           code="model_not_found")

    async def read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is {int(declared)} bytes, more than the limit of {MAX_BODY_BYTES}")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is more than the limit of {MAX_BODY_BYTES} bytes")
        try:
            return json.loads(body)
        except ValueError as e:          # JSONDecodeError, UnicodeDecodeError
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    async def prompt_tokens(self, req: TextRequest) -> list[int]:
        """The prompt's token ids, built exactly as `ingot run` builds them (with and without --chat)."""
        from ..chat import chat_prompt

        if req.messages is not None:
            return await run_in_threadpool(chat_prompt, self.tokenizer, req.messages)
        if isinstance(req.prompt, str):
            return await run_in_threadpool(self.tokenizer.encode, req.prompt)
        n_vocab = self.tokenizer.n_vocab
        if not all(0 <= t < n_vocab for t in req.prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{n_vocab - 1}", param="prompt")
        return list(req.prompt)

    async def start(self, req: TextRequest) -> Job:
        tokens = await self.prompt_tokens(req)
        max_ctx = self.engine.max_ctx
        if req.max_tokens is not None and req.max_tokens > max_ctx:
            raise ApiError(400, f"max_tokens {req.max_tokens} is more than the context of {max_ctx} tokens",
                           param="max_tokens")
        request = GenerationRequest(tuple(tokens), req.params, req.max_tokens or max(1, max_ctx - len(tokens)),
                                    req.stop)
        request.check(max_ctx)                         # UsageError (-> 400) for a prompt longer than the context
        job = Job(self.tokenizer, request, asyncio.get_running_loop())
        self.scheduler.submit(job)
        return job

    async def collect(self, request: Request, job: Job) -> str:
        """The whole text of a non-streamed request; the job is cancelled if the client disconnects first."""
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self.scheduler.cancel(job)

        watcher = asyncio.create_task(watch())
        try:
            return "".join([chunk.text async for chunk in job.chunks()])
        finally:
            watcher.cancel()

    def stream(self, job: Job, events: AsyncIterator, error_event: Callable[[ApiError], Any], *,
               media_type: str | None = None) -> Response:
        """A streamed response: server-sent events, or NDJSON lines when media_type says so. An error after the
        first byte becomes the dialect's error event; whatever ends the response cancels the job."""
        async def guarded() -> AsyncIterator:
            try:
                async for event in events:
                    yield event
            except ApiError as e:
                yield error_event(e)

        if media_type is None:
            response = EventSourceResponse(guarded(), sep="\n", shutdown_grace_period=SHUTDOWN_GRACE_S + 2)
        else:
            response = StreamingResponse(guarded(), media_type=media_type)
        return _CancelAtEnd(response, lambda: self.scheduler.cancel(job))


class _CancelAtEnd:
    """An ASGI response that runs `cancel` once the wrapped response is over, however it ended."""

    def __init__(self, response: Response, cancel: Callable[[], None]):
        self.response, self.cancel = response, cancel

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.cancel()


# --- the app ---------------------------------------------------------------------------------------

DIALECTS = [("/v1/messages", anthropic), ("/api/", ollama), ("/v1/", openai)]   # by path prefix, first match


def _dialect(path: str):
    return next((d for prefix, d in DIALECTS if path.startswith(prefix)), None)


def _api_route(server: Server, path: str, handler, methods: list[str], dialect) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            server.authorize(request)
            if not server.ready:
                raise ApiError(503, "the model is still loading; retry when /health answers 200")
            return await handler(server, request)
        except ApiError as e:
            return dialect.error_response(e)
        except (UsageError, ModelError) as e:          # a prompt that cannot run, a conversation the template refuses
            return dialect.error_response(ApiError(400, str(e)))
        except IngotError as e:
            return dialect.error_response(ApiError(500, str(e)))
        except Exception as e:                         # a bug: logged with its traceback, answered in the API's shape
            log.exception("%s %s failed", request.method, request.url.path)
            return dialect.error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    return Route(path, endpoint, methods=methods)


def create_app(server: Server) -> Starlette:
    async def health(request: Request) -> Response:
        if server.scheduler.failure is not None:
            return JSONResponse({"status": "error", "error": str(server.scheduler.failure)}, status_code=503)
        if not server.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": server.model_id})

    async def not_found(request: Request, exc: HTTPException) -> Response:
        dialect = _dialect(request.url.path)
        if dialect is None:
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
        return dialect.error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        server.scheduler.start(server.load, server.on_failure)
        yield
        await run_in_threadpool(server.scheduler.stop)

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", server.metrics.endpoint, methods=["GET"])]
    for dialect in (openai, anthropic, ollama):
        routes += [_api_route(server, path, handler, methods, dialect) for path, handler, methods in dialect.ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.add_middleware(RequestCounter, metrics=server.metrics)
    return app


def _listen(host: str, port: int) -> socket.socket:
    """Bind before starting, so a busy port is a one-line usage error rather than a uvicorn log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}",
                         hint="pick another --port or --host") from None
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which also starts the scheduler's drain when SIGINT/SIGTERM arrives: requests still
    running SHUTDOWN_GRACE_S later end with a 503 in their API's shape, before uvicorn's own deadline (a little
    later) would cut them off mid-response."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.scheduler.drain(SHUTDOWN_GRACE_S)


def serve(spec: str, options: Options, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run the server until SIGINT/SIGTERM. If the model fails to load, the server stops and the error is
    raised (its exit code is the model's: 2, 3, 5 ...)."""
    server = Server(spec, options)
    sock = _listen(host, port)
    config = uvicorn.Config(create_app(server), lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 2,
                            access_log=False)
    http = _Uvicorn(config, server.scheduler)
    log.info("serving %s on http://%s:%d (/health answers 200 once the model is loaded)", spec, host,
             sock.getsockname()[1])

    def stop_on_failure(e: BaseException) -> None:
        log.error("%s: %s", "loading the model failed" if server.engine is None else "the engine thread failed", e)
        http.should_exit = True

    server.on_failure = stop_on_failure
    http.run(sockets=[sock])
    failure = server.scheduler.failure
    if failure is not None:
        raise failure if isinstance(failure, IngotError) else IngotError(f"{type(failure).__name__}: {failure}")
