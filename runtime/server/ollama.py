"""The Ollama dialect: /api/chat, /api/generate, /api/tags, /api/show, /api/version.

/api/chat renders its messages with the chat template; /api/generate renders its prompt (and `system`) as one
user turn unless `raw` is set, as Ollama does. Responses stream by default, as NDJSON: one object per text
delta with done false, then a final one with done true, done_reason ("stop" or "length"), and counts and
durations in nanoseconds (prompt_eval_* for the prefill, eval_* for the generated tokens). Sampling defaults
are Ollama's (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens); `options`
overrides them. `format` ("json" or a JSON schema) constrains the output; `tools` (on a model whose template
renders them) come back as message.tool_calls, in one final object even when streaming. Errors are
{"error": message}, the message naming the offending field.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime, timezone
from importlib.metadata import version
from typing import Annotated, Any, Literal

from pydantic import Field, Strict
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from ingot.runtime.model.gguf import Vocab
from ingot.runtime.model.templates import chat_template
from ingot.runtime.model.toolcalls import parse_calls, tool_format
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import Job
from ingot.runtime.server.request import (
    ApiError,
    Body,
    Bool,
    Int,
    Str,
    TextRequest,
    checked,
    validate,
    with_tools,
)
from ingot.runtime.server.server import Server
from ingot.runtime.structured import Constraint, json_schema

DONE_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def error_response(e: ApiError) -> Response:
    return JSONResponse({"error": e.message}, status_code=e.status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# --- requests ------------------------------------------------------------------------------------


class Options(Body):
    """Ollama's Modelfile parameters this server uses (others, e.g. num_ctx, are ignored as Ollama's own
    server ignores what a runner does not use)."""

    temperature: Annotated[float, Strict(), Field(ge=0, le=2)] = 0.8
    top_k: Annotated[int, Strict(), Field(ge=0)] = 40
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 0.9
    min_p: Annotated[float, Strict(), Field(ge=0, le=1)] = 0.0
    repeat_penalty: Annotated[float, Strict(), Field(gt=0)] = 1.1
    repeat_last_n: Annotated[int, Strict(), Field(ge=0)] = 64
    seed: Annotated[int, Strict(), Field(ge=0)] | None = None
    num_predict: Int = -1  # -1: no limit, -2: fill the context
    stop: Str | list[Str] | None = None


class Function(Body):
    name: Str
    arguments: dict


class ToolCallIn(Body):
    function: Function


class Message(Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: Str = ""
    images: Annotated[list, Field(max_length=0)] | None = None  # images are not supported
    tool_calls: list[ToolCallIn] | None = None
    tool_name: Str | None = None


class FunctionDef(Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Str | None = None
    parameters: dict | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class Request(Body):
    model: Str
    format: Literal["json", ""] | dict | None = None
    options: Options = Options()
    stream: Bool = True


class ChatBody(Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: list[Tool] | None = None


class GenerateBody(Request):
    prompt: Str = ""
    system: Str | None = None
    raw: Bool = False
    template: Annotated[str, Strict(), Field(max_length=0)] | None = None  # not supported
    suffix: Annotated[str, Strict(), Field(max_length=0)] | None = None  # not supported
    images: Annotated[list, Field(max_length=0)] | None = None  # not supported


class ShowBody(Body):
    model: Str | None = None
    name: Str | None = None


def _fields(b: Request) -> dict:
    """TextRequest fields from `options` (Ollama's Modelfile parameters) and `format`."""
    o = b.options
    params = SamplingParams(
        temperature=float(o.temperature),
        top_k=o.top_k,
        top_p=float(o.top_p),
        min_p=float(o.min_p),
        repetition_penalty=float(o.repeat_penalty),
        repeat_last_n=o.repeat_last_n,
        seed=o.seed,
    )
    if o.num_predict < -2 or o.num_predict == 0:
        raise ApiError(
            400, "options.num_predict must be positive, -1 (no limit) or -2 (fill the context)", param="options"
        )
    constraint = None
    if b.format == "json":
        constraint = Constraint("json")
    elif isinstance(b.format, dict):
        constraint = checked(json_schema(b.format), "format")
    return {
        "model": b.model,
        "params": params,
        "stop": (o.stop,) if isinstance(o.stop, str) else tuple(o.stop or ()),
        "max_tokens": o.num_predict if o.num_predict > 0 else None,
        "stream": b.stream,
        "constraint": constraint,
    }


def _turn(m: Message) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        turn["tool_calls"] = [
            {"type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_name is not None:
        turn["name"] = m.tool_name
    return turn


def parse_chat(body: Any, vocab: Vocab | None = None) -> TextRequest:
    b = validate(ChatBody, body)
    req = TextRequest(messages=[_turn(m) for m in b.messages], **_fields(b))
    if not b.tools:
        return req
    if vocab is None:
        raise ApiError(400, "tools: no model to render them with", param="tools")
    return with_tools(req, vocab, [t.model_dump(exclude_none=True) for t in b.tools], "auto")


def parse_generate(body: Any) -> TextRequest:
    b = validate(GenerateBody, body)
    if b.raw:
        return TextRequest(prompt=b.prompt, **_fields(b))
    turns = ([{"role": "system", "content": b.system}] if b.system else []) + [{"role": "user", "content": b.prompt}]
    return TextRequest(messages=turns, **_fields(b))


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


# Characters JSON leaves raw that Python's str.splitlines() (httpx's iter_lines, which the official ollama client
# reads NDJSON with) takes for line ends: left raw, a generated U+2028 would cut a line in two for that client.
_LINE_BREAKERS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _line(obj: dict) -> str:
    """One NDJSON line. Those characters can only sit inside JSON strings, where their escapes mean the same."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKERS) + "\n"


async def _stream(job: Job, head: dict, wrap) -> AsyncIterator[str]:
    async for chunk in job.chunks():
        if chunk.text:
            yield _line(head | {"created_at": _now()} | wrap(chunk.text) | {"done": False})
    yield _line(head | {"created_at": _now()} | wrap("") | _final(job))


def _stream_error(e: ApiError) -> str:
    return _line({"error": e.message})


async def _respond(server: Server, request: HttpRequest, req: TextRequest, wrap) -> Response:
    """wrap(text) -> the part of a response object that carries text (message or response)."""
    server.check_model(req.model)
    job = await server.start(req)
    head = {"model": req.model}
    if req.stream:
        return server.stream(job, _stream(job, head, wrap), _stream_error, media_type="application/x-ndjson")
    text = await server.collect(request, job)
    return JSONResponse(head | {"created_at": _now()} | wrap(text) | _final(job))


def _message(text: str, tools: str | None) -> dict:
    """The reply message; with tools on, the calls parsed out of the text as message.tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools is not None and text:
        rest, calls = parse_calls(text, tools)
        if calls:
            message = {
                "role": "assistant",
                "content": rest,
                "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls],
            }
    return {"message": message}


async def chat(server: Server, request: HttpRequest) -> Response:
    req = parse_chat(await server.read_json(request), server.model.vocab)
    if req.tool_format is not None and req.stream:
        req = replace(req, stream=False)  # calls are parsed from the whole reply: sent as one final object
        response = await _respond(server, request, req, lambda text: _message(text, req.tool_format))
        return Response(bytes(response.body) + b"\n", media_type="application/x-ndjson")
    return await _respond(server, request, req, lambda text: _message(text, req.tool_format))


async def generate(server: Server, request: HttpRequest) -> Response:
    body = await server.read_json(request)
    req = parse_generate(body)
    if not body.get("prompt"):  # an empty prompt only loads the model (Ollama's "load" reply)
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


async def tags(server: Server, request: HttpRequest) -> Response:
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


async def show(server: Server, request: HttpRequest) -> Response:
    b = validate(ShowBody, await server.read_json(request))
    if not (b.model or b.name):
        raise ApiError(400, "model: field required", param="model")
    server.check_model(b.model or b.name or "")
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
            "capabilities": ["completion"] + (["tools"] if tool_format(chat_template(m.vocab)) else []),
            "modified_at": _now(),
        }
    )


async def ollama_version(server: Server, request: HttpRequest) -> Response:
    return JSONResponse({"version": version("ingot-llm")})


ROUTES = [
    ("/api/chat", chat, ["POST"]),
    ("/api/generate", generate, ["POST"]),
    ("/api/tags", tags, ["GET"]),
    ("/api/show", show, ["POST"]),
    ("/api/version", ollama_version, ["GET"]),
]
