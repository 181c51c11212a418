"""The HTTP server: one Starlette app speaking three API dialects over one engine core process (server.py holds
the shared state, client.py talks to the core; this module only assembles routes and runs uvicorn).

    OpenAI      POST /v1/chat/completions, /v1/completions   GET /v1/models, /v1/models/{model}   (openai.py)
    Anthropic   POST /v1/messages, /v1/messages/count_tokens                                    (anthropic.py)
    Ollama      POST /api/chat, /api/generate, /api/show      GET /api/tags, /api/version       (ollama.py)
    Operations  GET /health (503 while the model loads, 200 once it serves), GET /metrics (metrics.py)
                POST /api/reload (hot swap; also SIGHUP), GET /api/ps, GET /, Anthropic's /v1/models (operations.py)

Every API route goes through the same steps here: the API key (if --api-key), readiness, the body (JSON, at
most MAX_BODY_BYTES), the dialect's parser into a TextRequest, tokenizing it as `ingot run` does (the chat
template via chat.chat_prompt, raw text via Tokenizer.encode), a Job sent to the engine core, and back through the
dialect's shaping. Any error becomes the dialect's error body with its status code.

A streamed response cancels its job whenever it ends (finished, client gone, shutdown); a non-streamed one
watches for the client's disconnect while it waits. Cancelling frees the sequence's KV cache before the
next decode step. On SIGINT/SIGTERM uvicorn stops accepting connections and in-flight requests get
INGOT_SHUTDOWN_GRACE seconds (settings.SHUTDOWN_GRACE, 5 by default) to finish; what is left then ends with a 503
in its API's shape (an error event in a stream), then the engine core closes the engine and exits.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from contextlib import asynccontextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ingot.runtime import settings
from ingot.runtime.errors import IngotError, ModelError, UsageError
from ingot.runtime.server import anthropic, ollama, openai, operations
from ingot.runtime.server.metrics import RequestCounter
from ingot.runtime.server.models import Models, model_specs
from ingot.runtime.server.request import ApiError
from ingot.runtime.server.server import ANSWERED_BY, Options, log

# --- the app ---------------------------------------------------------------------------------------

DIALECTS = [("/v1/messages", anthropic), ("/api/", ollama), ("/v1/", openai)]  # by path prefix, first match


def _dialect(path: str):
    return next((d for prefix, d in DIALECTS if path.startswith(prefix)), None)


def _api_route(models: Models, path: str, handler, methods: list[str], dialect) -> Route:
    """A dialect's route: handler(server, request) with the Server of the model the request names."""

    async def run(request: Request) -> Response:
        async with models.using(request) as server:
            return await handler(server, request)

    return _route(models, path, run, methods, dialect)


def _route(models: Models, path: str, run, methods: list[str], dialect) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            models.servers[0].authorize(request)  # one key for the whole server
            response = await run(request)
            version = ANSWERED_BY.get(None)  # set by Server.start in this request's task
            if version is not None:
                response.headers["x-ingot-model-version"] = version
            return response
        except ApiError as e:
            return dialect.error_response(e)
        except (UsageError, ModelError) as e:  # a prompt that cannot run, a conversation the template refuses
            return dialect.error_response(ApiError(400, str(e)))
        except IngotError as e:
            return dialect.error_response(ApiError(500, str(e)))
        except Exception as e:  # a bug: logged with its traceback, answered in the API's shape
            log.exception("%s %s failed", request.method, request.url.path)
            return dialect.error_response(ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    return Route(path, endpoint, methods=methods)


def create_app(models: Models) -> Starlette:
    single = models.single

    async def health(request: Request) -> Response:
        if single is None:
            return JSONResponse({"status": "ok", "models": [s.model_id for s in models.servers if s.ready]})
        if single.failure is not None:
            return JSONResponse({"status": "error", "error": str(single.failure)}, status_code=503)
        if not single.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": single.model_id})

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # registered for 404 and 405 only
        dialect = _dialect(request.url.path)
        if dialect is None:
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
        return dialect.error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(models.start())
        _on_sighup(models)
        yield
        loading.cancel()
        await models.stop()

    openai_list = next(handler for path, handler, _ in openai.ROUTES if path == "/v1/models")
    ollama_tags = next(handler for path, handler, _ in ollama.ROUTES if path == "/api/tags")

    async def model_list(request: Request) -> Response:
        """/v1/models: Anthropic's shape for Anthropic clients (anthropic-version header), else OpenAI's."""
        if operations.wants_anthropic(request):
            return operations.anthropic_models(models)
        if single is None:
            return operations.openai_models(models)
        return await openai_list(await models.route(request), request)

    async def tags(request: Request) -> Response:
        if single is None:
            return await operations.tags(models, request)
        return await ollama_tags(await models.route(request), request)

    async def ps(request: Request) -> Response:
        return await operations.ps(models, request)

    async def reload(request: Request) -> Response:
        return await operations.reload(models, request)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", models.metrics.endpoint, methods=["GET"]),
        Route("/", operations.root, methods=["GET"]),
        _route(models, "/v1/models", model_list, ["GET"], openai),
        _route(models, "/api/tags", tags, ["GET"], ollama),
        _route(models, "/api/ps", ps, ["GET"], ollama),
        _route(models, "/api/reload", reload, ["POST"], ollama),
    ]
    for dialect in (openai, anthropic, ollama):
        routes += [_api_route(models, path, handler, methods, dialect) for path, handler, methods in dialect.ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.add_middleware(RequestCounter, metrics=models.metrics)
    return app


def _on_sighup(models: Models) -> None:
    """SIGHUP reloads every loaded model (hot swap), as POST /api/reload does; a failed reload is logged, the
    old version keeps serving."""

    async def reload() -> None:
        for server in models.servers:
            if server.ready:
                try:
                    await server.reload()
                except Exception as e:
                    log.error("reloading %s failed: %s", server.spec, e)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, lambda: asyncio.create_task(reload()))
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (tests' TestClient)
        pass


def _listen(host: str, port: int) -> socket.socket:
    """Bind before starting, so a busy port is a one-line usage error rather than a uvicorn log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port}: {e.strerror}", hint="pick another --port or --host"
        ) from None
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which also starts the engine client's drain when SIGINT/SIGTERM arrives: requests still
    running `grace` seconds later end with a 503 in their API's shape, before uvicorn's own deadline (a little
    later) would cut them off mid-response."""

    def __init__(self, config: uvicorn.Config, models: Models, grace: float):
        super().__init__(config)
        self.ingot = models
        self.grace = grace

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it is done (the process would then die of SIGTERM,
        # exit -15); a clean drain is a normal exit, status 0.
        self._captured_signals.clear()
        self.ingot.drain(self.grace)


def serve(specs: list[str], options: Options, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run the server until SIGINT/SIGTERM. With one model, if it fails to load, the server stops and the error
    is raised (its exit code is the model's: 2, 3, 5 ...); with several, models load on their first request."""
    grace = settings.SHUTDOWN_GRACE.get()
    models = Models(model_specs(tuple(specs)), options)
    sock = _listen(host, port)
    config = uvicorn.Config(create_app(models), lifespan="on", timeout_graceful_shutdown=grace + 2, access_log=False)
    http = _Uvicorn(config, models, grace)
    log.info(
        "serving %s on http://%s:%d (/health answers 200 once the model is loaded)",
        ", ".join(s.spec for s in models.servers),
        host,
        sock.getsockname()[1],
    )
    single = models.single
    if single is not None:

        def stop_on_failure(e: BaseException) -> None:
            log.error("loading the model failed: %s", e)
            http.should_exit = True

        single.on_failure = stop_on_failure
    http.run(sockets=[sock])
    failure = single.failure if single is not None else None
    if failure is not None:
        raise failure if isinstance(failure, IngotError) else IngotError(f"{type(failure).__name__}: {failure}")
