"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models.

Requests become TextRequests (request.py); chunks come back as OpenAI's objects. Streams are server-sent
events, one `data: {chunk}` per text delta (a legacy completion: per delta of generated tokens, its text
possibly empty), the role in the first delta, an empty delta carrying
finish_reason ("stop": end of text or a stop string, "length": max_tokens or the context), a usage chunk with
empty choices when stream_options.include_usage is set, then `data: [DONE]`. Errors are
{"error": {message, type, param, code}}.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from pydantic import Field, Strict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingot.runtime.model.gguf import Vocab
from ingot.runtime.model.toolcalls import ToolCall, parse_calls
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import PING, Job
from ingot.runtime.server.request import (
    ApiError,
    Body,
    Bool,
    Int,
    Str,
    TextRequest,
    checked,
    joined_text,
    validate,
    with_tools,
)
from ingot.runtime.server.server import SSE_PING, Server
from ingot.runtime.structured import Constraint, json_schema

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def error_response(e: ApiError) -> Response:
    return JSONResponse(error_body(e), status_code=e.status)


def error_body(e: ApiError) -> dict:
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    code = e.code or ("invalid_api_key" if e.status == 401 else None)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


# --- requests ------------------------------------------------------------------------------------


class TextPart(Body):
    type: Literal["text"]
    text: Str


class FunctionCall(Body):
    name: Str
    arguments: Str  # JSON text


class ToolCallIn(Body):
    id: Str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[TextPart] | None = None
    name: Str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: Str | None = None


class FunctionDef(Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Str | None = None
    parameters: dict | None = None
    strict: Bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Body):
    name: Str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


class JsonSchema(Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StreamOptions(Body):
    include_usage: Bool = False


class Common(Body):
    """The fields chat and text completions share."""

    model: Str
    temperature: Annotated[float, Strict(), Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Strict(), Field(ge=0)] | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=1)] = 1  # only n=1
    stop: Str | Annotated[list[Str], Field(max_length=16)] | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    logprobs: Literal[False] | None = None
    frequency_penalty: Annotated[float, Strict(), Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Strict(), Field(ge=-2, le=2)] | None = None

    def fields(self) -> dict:
        return {
            "model": self.model,
            "params": SamplingParams(temperature=float(self.temperature), top_p=float(self.top_p), seed=self.seed),
            "stop": (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            "stream": self.stream,
        }


class ChatBody(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Strict(), Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    response_format: ResponseFormat | None = None


class CompletionBody(Common):
    prompt: Str | Annotated[list[Str], Field(min_length=1, max_length=1)] | Annotated[list[Int], Field(min_length=1)]
    max_tokens: Annotated[int, Strict(), Field(ge=1)] = 16
    echo: Literal[False] = False


def _turn(m: Message) -> dict[str, Any]:
    """A chat-template message (HF's conventions: tool calls with their arguments as an object)."""
    turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": joined_text(m.content)}
    if m.tool_calls:
        turn["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _args(c.function)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _args(f: FunctionCall) -> Any:
    try:
        return json.loads(f.arguments)
    except ValueError:
        return f.arguments


def _constraint(f: ResponseFormat | None) -> Constraint | None:
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return Constraint("json")
    if f.json_schema is None or f.json_schema.schema_ is None:
        raise ApiError(400, "response_format.json_schema.schema is required", param="response_format.json_schema")
    return checked(json_schema(f.json_schema.schema_), "response_format.json_schema.schema")


def parse_chat(body: Any, vocab: Vocab | None = None) -> TextRequest:
    """The request; `vocab` (the served model's) decides whether its template can take `tools`."""
    b = validate(ChatBody, body)
    req = TextRequest(
        messages=[_turn(m) for m in b.messages],
        max_tokens=b.max_completion_tokens or b.max_tokens,
        constraint=_constraint(b.response_format),
        **b.fields(),
    )
    if not b.tools:
        if isinstance(b.tool_choice, NamedToolChoice) or b.tool_choice == "required":
            raise ApiError(400, "tool_choice: there are no tools to choose from", param="tool_choice")
        return req
    tools = [t.model_dump(exclude_none=True) for t in b.tools]
    if isinstance(b.tool_choice, NamedToolChoice):
        choice, name = "named", b.tool_choice.function.name
    else:
        choice, name = b.tool_choice or "auto", None
    if vocab is None:
        raise ApiError(400, "tools: no model to render them with", param="tools")
    return with_tools(req, vocab, tools, choice, name)


def parse_completion(body: Any) -> TextRequest:
    b = validate(CompletionBody, body)
    prompt = b.prompt[0] if isinstance(b.prompt, list) and isinstance(b.prompt[0], str) else b.prompt
    return TextRequest(prompt=prompt, max_tokens=b.max_tokens, **b.fields())


# --- responses -----------------------------------------------------------------------------------


def _usage(job: Job) -> dict:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def _event(obj) -> bytes:
    """One server-sent event, framed: msgspec's JSON is compact, UTF-8 (non-ASCII unescaped, as json.dumps with
    ensure_ascii=False) and has no raw line breaks, so it is one `data:` line."""
    return b"data: " + _json.encode(obj) + b"\n\n"


_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def _chat_choice(text: str | None, finish: str | None) -> dict:
    """choices[0] of a chat.completion.chunk; text None is the first chunk's role delta."""
    delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


def _tool_calls(calls: list[ToolCall]) -> list[dict]:
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
    ]


async def _stream(job: Job, head: dict, chat: bool, include_usage: bool, tools: str | None) -> AsyncIterator:
    """Chunks as they come; with tools on (a chat with a tool-call format), the text is held back and parsed
    at the end, then sent as one content delta or as tool_calls deltas (one per call, each whole)."""
    choice = _chat_choice if chat else _text_choice
    usage = {"usage": None} if include_usage else {}
    if chat:
        yield _event(head | {"choices": [choice(None, None)]} | usage)
    held = []
    async for chunk in job.chunks():
        if chunk is PING:
            yield SSE_PING
            continue
        # a legacy completion has an event for every generated token, even one with no text yet (a control
        # token, half a UTF-8 character): a client can then time its first token and count arrivals; a chat
        # delta has nothing to say without text
        if tools is None and (chunk.text or (not chat and chunk.token_ids and not chunk.finish_reason)):
            yield _event(head | {"choices": [choice(chunk.text, None)]} | usage)
        held.append(chunk.text)
        if chunk.finish_reason:
            finish = FINISH[chunk.finish_reason]
            if tools is not None:
                text, calls = parse_calls("".join(held), tools)
                if text:
                    yield _event(head | {"choices": [choice(text, None)]} | usage)
                for i, call in enumerate(_tool_calls(calls)):
                    delta = {"tool_calls": [{"index": i} | call]}
                    yield _event(head | {"choices": [{"index": 0, "delta": delta, "logprobs": None}]} | usage)
                finish = "tool_calls" if calls else finish
            yield _event(head | {"choices": [choice("", finish)]} | usage)
    if include_usage:
        yield _event(head | {"choices": [], "usage": _usage(job)})
    yield DONE


def _stream_error(e: ApiError) -> bytes:
    return _event(error_body(e))


async def _respond(server: Server, request: Request, req: TextRequest, include_usage: bool, chat: bool) -> Response:
    job = await server.start(req)
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model_id,
    }
    if req.stream:
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        return server.stream(job, _stream(job, head, chat, include_usage, req.tool_format), _stream_error)
    text = await server.collect(request, job)
    finish = FINISH[job.generation.ended_by]
    if chat:
        head["object"] = "chat.completion"
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if req.tool_format is not None:
            text, calls = parse_calls(text, req.tool_format)
            if calls:
                message |= {"content": text or None, "tool_calls": _tool_calls(calls)}
                finish = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return JSONResponse(head | {"choices": [choice], "usage": _usage(job)})


async def chat_completions(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    req = parse_chat(body, server.model.vocab)
    server.check_model(req.model)
    return await _respond(server, request, req, _include_usage(body), chat=True)


async def completions(server: Server, request: Request) -> Response:
    body = await server.read_json(request)
    req = parse_completion(body)
    server.check_model(req.model)
    return await _respond(server, request, req, _include_usage(body), chat=False)


def _include_usage(body: dict) -> bool:
    """stream_options.include_usage (validated by parse_*)."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _model_card(server: Server) -> dict:
    return {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "ingot"}


async def list_models(server: Server, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(server)]})


async def get_model(server: Server, request: Request) -> Response:
    server.check_model(request.path_params["model"])
    return JSONResponse(_model_card(server))


ROUTES = [
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/models", list_models, ["GET"]),
    ("/v1/models/{model:path}", get_model, ["GET"]),
]
