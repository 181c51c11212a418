"""The Ollama dialect: /api/chat, /api/generate, /api/tags, /api/show, /api/version.

/api/chat renders its messages with the chat template; /api/generate renders its prompt (and `system`) as one
user turn unless `raw` is set, as Ollama does. Responses stream by default, as NDJSON: one object per text
delta with done false, then a final one with done true, done_reason ("stop" or "length"), and counts and
durations in nanoseconds (prompt_eval_* for the prefill, eval_* for the generated tokens). Sampling defaults
are Ollama's (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens); `options`
overrides them. Errors are {"error": message}.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from importlib.metadata import version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingot.runtime.model.templates import chat_template
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import Job
from ingot.runtime.server.request import ApiError, Fields, TextRequest, text_of
from ingot.runtime.server.server import Server

DONE_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def error_response(e: ApiError) -> Response:
    return JSONResponse({"error": e.message}, status_code=e.status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# --- requests ------------------------------------------------------------------------------------


def _options(body: Fields) -> dict:
    """TextRequest fields from `options` (Ollama's Modelfile parameters)."""
    o = body.fields("options") or Fields({}, "options")
    params = SamplingParams(
        temperature=o.get("temperature", float, default=0.8),
        top_k=o.at_least("top_k", 0, 40),
        top_p=o.get("top_p", float, default=0.9),
        min_p=o.get("min_p", float, default=0.0),
        repetition_penalty=o.get("repeat_penalty", float, default=1.1),
        repeat_last_n=o.at_least("repeat_last_n", 0, 64),
        seed=o.seed(),
    )
    num_predict = o.get("num_predict", int, default=-1)  # -1: no limit, -2: fill the context
    if num_predict < -2 or num_predict == 0:
        raise ApiError(400, "options.num_predict must be positive, -1 (no limit) or -2 (fill the context)")
    return {
        "model": body.get("model", str, required=True),
        "params": params,
        "stop": o.strings("stop"),
        "max_tokens": num_predict if num_predict > 0 else None,
        "stream": body.get("stream", bool, default=True),
    }


def parse_chat(body: Fields) -> TextRequest:
    turns = []
    for i, m in enumerate(body.get("messages", list, required=True)):
        m = Fields(m, f"messages[{i}]")
        if m.obj.get("images"):
            raise ApiError(400, f"{m.name('images')}: images are not supported")
        turns.append(
            {
                "role": m.get("role", str, required=True),
                "content": text_of(m.get("content", str, default=""), m.name("content")),
            }
        )
    if not turns:
        raise ApiError(400, "messages must not be empty")
    return TextRequest(messages=turns, **_options(body))


def parse_generate(body: Fields) -> TextRequest:
    prompt = body.get("prompt", str, default="")
    if body.get("template", str) or body.get("suffix", str) or body.get("images", list):
        raise ApiError(400, "template, suffix and images are not supported")
    if body.get("raw", bool, default=False):
        return TextRequest(prompt=prompt, **_options(body))
    system = body.get("system", str)
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return TextRequest(messages=turns, **_options(body))


# --- responses -----------------------------------------------------------------------------------


def _final(job: Job) -> dict:
    return {
        "done": True,
        "done_reason": DONE_REASONS[job.generation.ended_by],
        "total_duration": job.ended - job.submitted,
        "load_duration": 0,
        "prompt_eval_count": job.prompt_tokens,
        "prompt_eval_duration": job.first_token - job.started,
        "eval_count": job.completion_tokens,
        "eval_duration": job.ended - job.first_token,
    }


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


async def _stream(job: Job, head: dict, wrap) -> AsyncIterator[str]:
    async for chunk in job.chunks():
        if chunk.text:
            yield _line(head | {"created_at": _now()} | wrap(chunk.text) | {"done": False})
    yield _line(head | {"created_at": _now()} | wrap("") | _final(job))


def _stream_error(e: ApiError) -> str:
    return _line({"error": e.message})


async def _respond(server: Server, request: Request, req: TextRequest, wrap) -> Response:
    """wrap(text) -> the part of a response object that carries text (message or response)."""
    server.check_model(req.model)
    job = await server.start(req)
    head = {"model": req.model}
    if req.stream:
        return server.stream(job, _stream(job, head, wrap), _stream_error, media_type="application/x-ndjson")
    text = await server.collect(request, job)
    return JSONResponse(head | {"created_at": _now()} | wrap(text) | _final(job))


async def chat(server: Server, request: Request) -> Response:
    req = parse_chat(Fields(await server.read_json(request)))
    return await _respond(server, request, req, lambda text: {"message": {"role": "assistant", "content": text}})


async def generate(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    req = parse_generate(body)
    if not body.get("prompt", str):  # an empty prompt only loads the model (Ollama's "load" reply)
        server.check_model(req.model)
        return JSONResponse(
            {"model": req.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        )
    return await _respond(server, request, req, lambda text: {"response": text})


def _details(server: Server) -> dict:
    m = server.model
    n = m.n_params
    weights: Counter[str] = Counter()
    for t in m.tensors.values():
        weights[t.qtype] += t.raw.nbytes
    return {
        "parent_model": "",
        "format": "gguf",
        "family": m.config.arch,
        "families": [m.config.arch],
        "parameter_size": f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M",
        "quantization_level": weights.most_common(1)[0][0],
    }


async def tags(server: Server, request: Request) -> Response:
    m = server.model
    modified = datetime.fromtimestamp(m.path.stat().st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    name = f"{server.model_id}:latest"
    return JSONResponse(
        {
            "models": [
                {
                    "name": name,
                    "model": name,
                    "modified_at": modified,
                    "size": m.size,
                    "digest": "",
                    "details": _details(server),
                }
            ]
        }
    )


async def show(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    server.check_model(body.get("model", str) or body.get("name", str, required=True))
    m, c = server.model, server.model.config
    info = {
        "general.architecture": c.arch,
        "general.name": m.name,
        "general.parameter_count": m.n_params,
        f"{c.arch}.context_length": c.n_ctx_train,
        f"{c.arch}.embedding_length": c.dim,
        f"{c.arch}.block_count": c.n_layers,
        f"{c.arch}.attention.head_count": c.n_heads,
        f"{c.arch}.attention.head_count_kv": c.n_kv_heads,
        f"{c.arch}.feed_forward_length": c.ffn_dim,
    }
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": chat_template(m.vocab) or "",  # the GGUF's own, else its family's built-in one
            "details": _details(server),
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": _now(),
        }
    )


async def ollama_version(server: Server, request: Request) -> Response:
    return JSONResponse({"version": version("ingot-llm")})


ROUTES = [
    ("/api/chat", chat, ["POST"]),
    ("/api/generate", generate, ["POST"]),
    ("/api/tags", tags, ["GET"]),
    ("/api/show", show, ["POST"]),
    ("/api/version", ollama_version, ["GET"]),
]
