"""Routes about the server's models rather than generation: hot swap, and what Ollama and Anthropic clients ask.

    POST /api/reload   load a model from disk again (hot swap; SIGHUP reloads every loaded model): body
                       {"model": name}, optional with one model; answers {"model", "version"} once the new version
                       serves new requests
    GET  /api/ps       Ollama's running models: name, size, digest (the version), details, expires_at, size_vram
    GET  /             "Ollama is running", as Ollama answers (clients probe it)
    GET  /v1/models    Anthropic's shape ({"data": [{"type": "model", "id", "display_name", "created_at"}],
                       "has_more", "first_id", "last_id"}) when the request has an anthropic-version header; else
                       OpenAI's (the dialect's own route with one model, every model's id with several)
    GET  /api/tags     with several models: every model, loaded or not (with one: the Ollama dialect's route)
Handlers take the Models (models.py), not one Server.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ingot.runtime.server.models import Models
from ingot.runtime.server.request import ApiError, Body, Str, validate

NEVER_EXPIRES = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept loaded (keep_alive < 0)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


class ReloadBody(Body):
    model: Str | None = None


async def reload(models: Models, request: Request) -> Response:
    server = models.servers[0]
    has_body = int(request.headers.get("content-length") or 0) > 0
    name = validate(ReloadBody, await server.read_json(request) if has_body else {}).model
    if name is None and models.single is None:
        raise ApiError(400, "this server serves several models: name the one to reload in the model field")
    single = models.single
    server = single if single is not None and name is None else await models.acquire(name or "")
    version = await server.reload()
    return JSONResponse({"model": server.model_id, "version": version})


async def ps(models: Models, request: Request) -> Response:
    now_wall, now = time.time(), time.monotonic()
    out = []
    for slot in models.slots.values():
        server = slot.server
        if not server.ready:
            continue
        info, m = server.engine_info, server.model
        keep = slot.keep_alive if models.single is None else -1
        expires = NEVER_EXPIRES if keep < 0 else _iso(now_wall + max(0.0, slot.last_used + keep - now))
        name = f"{server.model_id}:latest"
        out.append(
            {
                "name": name,
                "model": name,
                "size": m.size,
                "digest": server.version,
                "details": {"format": "gguf", "family": m.config.arch, "families": [m.config.arch]},
                "expires_at": expires,
                "size_vram": info.memory.get("engine_bytes", 0) if info.name == "cuda" else 0,
            }
        )
    return JSONResponse({"models": out})


async def tags(models: Models, request: Request) -> Response:
    """Every model (several-model server), loaded or not: what the file says without opening it."""
    out = []
    for name, slot in models.slots.items():
        path = Path(slot.server.spec)
        st = path.stat() if path.is_file() else None
        out.append(
            {
                "name": f"{name}:latest",
                "model": f"{name}:latest",
                "modified_at": _iso(st.st_mtime if st else slot.server.created),
                "size": st.st_size if st else 0,
                "digest": slot.server.version if slot.server.ready else "",
                "details": {"format": "gguf"},
            }
        )
    return JSONResponse({"models": out})


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


def wants_anthropic(request: Request) -> bool:
    return "anthropic-version" in request.headers


def anthropic_models(models: Models) -> Response:
    data = [
        {"type": "model", "id": s.model_id, "display_name": s.model_id, "created_at": _iso(s.created)}
        for s in models.servers
    ]
    return JSONResponse({"data": data, "has_more": False, "first_id": data[0]["id"], "last_id": data[-1]["id"]})


def openai_models(models: Models) -> Response:
    data = [{"id": s.model_id, "object": "model", "created": s.created, "owned_by": "ingot"} for s in models.servers]
    return JSONResponse({"object": "list", "data": data})
