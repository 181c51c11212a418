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
SHUTDOWN_GRACE_S to finish; what is left then ends with a 503 in its API's shape (an error event in a
stream), then the engine core closes the engine and exits.
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

from ingot.runtime.errors import IngotError, ModelError, UsageError
from ingot.runtime.server import anthropic, ollama, openai, operations
from ingot.runtime.server.metrics import RequestCounter
from ingot.runtime.server.request import ApiError
from ingot.runtime.server.server import ANSWERED_BY, SHUTDOWN_GRACE_S, Options, Server, log

# --- the app ---------------------------------------------------------------------------------------

DIALECTS = [("/v1/messages", anthropic), ("/api/", ollama), ("/v1/", openai)]  # by path prefix, first match


def _dialect(path: str):
    return next((d for prefix, d in DIALECTS if path.startswith(prefix)), None)


def _api_route(server: Server, path: str, handler, methods: list[str], dialect) -> Route:
    async def endpoint(request: Request) -> Response:
        try:
            server.authorize(request)
            if not server.ready:
                raise ApiError(503, "the model is still loading; retry when /health answers 200")
            response = await handler(server, request)
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


def create_app(server: Server) -> Starlette:
    async def health(request: Request) -> Response:
        if server.failure is not None:
            return JSONResponse({"status": "error", "error": str(server.failure)}, status_code=503)
        if not server.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": server.model_id})

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # registered for 404 and 405 only
        dialect = _dialect(request.url.path)
        if dialect is None:
            return JSONResponse({"error": exc.detail}, status_code=exc.status_code)
        return dialect.error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    @asynccontextmanager
    async def lifespan(app: Starlette):
        loading = asyncio.create_task(server.start_engine())
        _on_sighup(server)
        yield
        loading.cancel()
        await server.stop()

    openai_models = next(handler for path, handler, _ in openai.ROUTES if path == "/v1/models")

    async def models(server: Server, request: Request) -> Response:
        """/v1/models: Anthropic's shape for Anthropic clients (anthropic-version header), else OpenAI's."""
        if operations.wants_anthropic(request):
            return await operations.anthropic_models(server, request)
        return await openai_models(server, request)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", server.metrics.endpoint, methods=["GET"]),
        Route("/", operations.root, methods=["GET"]),
        _api_route(server, "/v1/models", models, ["GET"], openai),
    ]
    routes += [_api_route(server, path, handler, methods, ollama) for path, handler, methods in operations.ROUTES]
    for dialect in (openai, anthropic, ollama):
        routes += [_api_route(server, path, handler, methods, dialect) for path, handler, methods in dialect.ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.add_middleware(RequestCounter, metrics=server.metrics)
    return app


def _on_sighup(server: Server) -> None:
    """SIGHUP reloads the model (hot swap), as POST /api/reload does; a failed reload is logged, the old
    version keeps serving."""

    async def reload() -> None:
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
    running SHUTDOWN_GRACE_S later end with a 503 in their API's shape, before uvicorn's own deadline (a little
    later) would cut them off mid-response."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.ingot = server

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signals it caught once it is done (the process would then die of SIGTERM,
        # exit -15); a clean drain is a normal exit, status 0.
        self._captured_signals.clear()
        self.ingot.drain(SHUTDOWN_GRACE_S)


def serve(spec: str, options: Options, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run the server until SIGINT/SIGTERM. If the model fails to load, the server stops and the error is
    raised (its exit code is the model's: 2, 3, 5 ...)."""
    server = Server(spec, options)
    sock = _listen(host, port)
    config = uvicorn.Config(
        create_app(server), lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 2, access_log=False
    )
    http = _Uvicorn(config, server)
    log.info(
        "serving %s on http://%s:%d (/health answers 200 once the model is loaded)", spec, host, sock.getsockname()[1]
    )

    def stop_on_failure(e: BaseException) -> None:
        log.error("loading the model failed: %s", e)
        http.should_exit = True

    server.on_failure = stop_on_failure
    http.run(sockets=[sock])
    failure = server.failure
    if failure is not None:
        raise failure if isinstance(failure, IngotError) else IngotError(f"{type(failure).__name__}: {failure}")
