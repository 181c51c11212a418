"""Routes about the server's models rather than generation: hot swap and what Ollama and Anthropic clients ask.

POST /api/reload   load the model from disk again (hot swap; SIGHUP does the same): {"model": name}
                   optional; answers {"model", "version"} once the new version serves new requests
GET  /api/ps       Ollama's running models: name, size, digest (the version), details, expires_at, size_vram
GET  /             "Ollama is running", as Ollama answers (clients probe it)
GET  /v1/models    in Anthropic's shape ({"data": [{"type": "model", "id", "display_name", "created_at"}],
                   "has_more", "first_id", "last_id"}) when the request has an anthropic-version header;
                   app.py sends other /v1/models requests to the OpenAI dialect
"""

from __future__ import annotations

from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ingot.runtime.server.request import ApiError, Fields
from ingot.runtime.server.server import Server

NEVER_EXPIRES = "0001-01-01T00:00:00Z"  # what Ollama shows for a model kept loaded (keep_alive < 0)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


async def reload(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request) if request.headers.get("content-length", "0") != "0" else {})
    name = body.get("model", str)
    if name is not None:
        server.check_model(name)
    version = await server.reload()
    return JSONResponse({"model": server.model_id, "version": version})


async def ps(server: Server, request: Request) -> Response:
    info, m = server.engine_info, server.model
    name = f"{server.model_id}:latest"
    vram = info.memory.get("engine_bytes", 0) if info.name == "cuda" else 0
    return JSONResponse(
        {
            "models": [
                {
                    "name": name,
                    "model": name,
                    "size": m.size,
                    "digest": server.version,
                    "details": {"format": "gguf", "family": m.config.arch, "families": [m.config.arch]},
                    "expires_at": NEVER_EXPIRES,
                    "size_vram": vram,
                }
            ]
        }
    )


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


def wants_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


async def anthropic_models(server: Server, request: Request) -> Response:
    if not server.ready:
        raise ApiError(503, "the model is still loading; retry when /health answers 200")
    model = {
        "type": "model",
        "id": server.model_id,
        "display_name": server.model_id,
        "created_at": _iso(server.created),
    }
    return JSONResponse({"data": [model], "has_more": False, "first_id": model["id"], "last_id": model["id"]})


ROUTES = [
    ("/api/reload", reload, ["POST"]),
    ("/api/ps", ps, ["GET"]),
]
