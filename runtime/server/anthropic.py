"""The Anthropic dialect: /v1/messages and /v1/messages/count_tokens.

A Messages request (system prompt as a string or text blocks, user/assistant turns of text) becomes a chat
TextRequest. Streams are named server-sent events in the documented order: message_start,
content_block_start, ping, content_block_delta..., content_block_stop, message_delta (stop_reason end_turn,
max_tokens or stop_sequence, and which stop_sequence), message_stop. With `tools` (on a model whose template
renders them) the reply's tool calls become tool_use blocks (stop_reason "tool_use"); tool_result blocks in
the input become the template's tool turns; tool_choice any/tool constrains decoding to a call. Errors are
{"type": "error", "error": {"type", "message"}}, the message naming the offending field.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field, Strict
from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingot.runtime.model.gguf import Vocab
from ingot.runtime.model.toolcalls import ToolCall, parse_calls
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import PING, Job
from ingot.runtime.server.request import ApiError, Body, Bool, Str, TextRequest, joined_text, validate, with_tools
from ingot.runtime.server.server import Server

STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    503: "overloaded_error",
}


def error_response(e: ApiError) -> Response:
    return JSONResponse(error_body(e), status_code=e.status)


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


# --- requests ------------------------------------------------------------------------------------


class TextBlock(Body):
    type: Literal["text"]
    text: Str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: Str
    name: Str
    input: dict


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: Str
    content: Str | list[TextBlock] = ""
    is_error: Bool | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(Body):
    role: Literal["user", "assistant"]
    content: Str | list[Block]


class Tool(Body):
    name: Annotated[str, Strict(), Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Str | None = None
    input_schema: dict


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Str | None = None
    disable_parallel_tool_use: Bool | None = None


class Conversation(Body):
    model: Str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesBody(Conversation):
    max_tokens: Annotated[int, Strict(), Field(ge=1)]
    temperature: Annotated[float, Strict(), Field(ge=0, le=1)] = 1.0  # Anthropic's range is 0..1
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Strict(), Field(ge=0)] = 0
    stop_sequences: list[Str] | None = None
    stream: Bool = False


def _turns(m: Message) -> list[dict[str, Any]]:
    """Chat-template messages of one Anthropic message: tool_use blocks become the assistant turn's
    tool_calls, tool_result blocks become "tool" turns (HF's conventions), text blocks the content."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    uses = [b for b in m.content if isinstance(b, ToolUseBlock)]
    results = [b for b in m.content if isinstance(b, ToolResultBlock)]
    turns: list[dict[str, Any]] = [
        {"role": "tool", "tool_call_id": r.tool_use_id, "content": joined_text(r.content)} for r in results
    ]
    if texts or uses or not results:
        turn: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
        if uses:
            turn["tool_calls"] = [
                {"id": u.id, "type": "function", "function": {"name": u.name, "arguments": u.input}} for u in uses
            ]
        turns.append(turn)
    return turns


def _conversation(b: Conversation) -> list[dict[str, Any]]:
    """The system prompt (a string or text blocks) and the user/assistant turns, as chat-template messages."""
    turns = [] if b.system is None else [{"role": "system", "content": joined_text(b.system)}]
    for m in b.messages:
        turns += _turns(m)
    return turns


def _with_tools(req: TextRequest, b: Conversation, vocab: Vocab | None) -> TextRequest:
    choice = b.tool_choice.type if b.tool_choice else "auto"
    if not b.tools:
        if choice in ("any", "tool"):
            raise ApiError(400, "tool_choice: there are no tools to choose from", param="tool_choice")
        return req
    if vocab is None:
        raise ApiError(400, "tools: no model to render them with", param="tools")
    tools = [
        {"type": "function", "function": {"name": t.name, "description": t.description or "", "parameters": schema}}
        for t in b.tools
        for schema in [t.input_schema]
    ]
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice]
    return with_tools(req, vocab, tools, mode, b.tool_choice.name if b.tool_choice else None)


def parse_messages(body: Any, vocab: Vocab | None = None) -> TextRequest:
    b = validate(MessagesBody, body)
    req = TextRequest(
        model=b.model,
        messages=_conversation(b),
        params=SamplingParams(temperature=float(b.temperature), top_p=float(b.top_p), top_k=b.top_k),
        max_tokens=b.max_tokens,
        stop=tuple(b.stop_sequences or ()),
        stream=b.stream,
    )
    return _with_tools(req, b, vocab)


# --- responses -----------------------------------------------------------------------------------


def _event(name: str, obj: dict) -> ServerSentEvent:
    return ServerSentEvent(event=name, data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")), sep="\n")


def _blocks(text: str, tools: str | None) -> tuple[list[dict], bool]:
    """The content blocks of a reply (text, then tool_use blocks when tools are on) and whether it calls one."""
    calls: list[ToolCall] = []
    if tools is not None:
        text, calls = parse_calls(text, tools)
    blocks: list[dict] = [{"type": "text", "text": text}] if text or not calls else []
    blocks += [
        {"type": "tool_use", "id": f"toolu_{secrets.token_hex(12)}", "name": c.name, "input": c.arguments}
        for c in calls
    ]
    return blocks, bool(calls)


async def _stream(job: Job, message: dict, tools: str | None) -> AsyncIterator[ServerSentEvent]:
    """Text streams as text_delta events; with tools on the reply is held back and sent at the end as its
    blocks (a tool_use block's input as one input_json_delta)."""
    yield _event("message_start", {"type": "message_start", "message": message})
    if tools is None:
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
    yield _event("ping", {"type": "ping"})
    held = []
    async for chunk in job.chunks():
        if chunk is PING:  # what Anthropic's API sends to keep a stream alive
            yield _event("ping", {"type": "ping"})
            continue
        held.append(chunk.text)
        if chunk.text and tools is None:
            yield _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": chunk.text}},
            )
        if chunk.finish_reason:
            stop_reason = STOP_REASONS[chunk.finish_reason]
            if tools is None:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            else:
                blocks, called = _blocks("".join(held), tools)
                for i, block in enumerate(blocks):
                    for event in _block_events(i, block):
                        yield event
                stop_reason = "tool_use" if called else stop_reason
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": job.stop_sequence},
                    "usage": {"output_tokens": job.completion_tokens},
                },
            )
    yield _event("message_stop", {"type": "message_stop"})


def _block_events(index: int, block: dict) -> list[ServerSentEvent]:
    if block["type"] == "text":
        start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    else:
        start = block | {"input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    return [
        _event("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
        _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
        _event("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def _stream_error(e: ApiError) -> ServerSentEvent:
    return _event("error", error_body(e))


async def messages(server: Server, request: Request) -> Response:
    req = parse_messages(await server.read_json(request), server.model.vocab)
    server.check_model(req.model)
    job = await server.start(req)
    message: dict[str, Any] = {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": server.model_id,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0},
    }
    if req.stream:
        return server.stream(job, _stream(job, message, req.tool_format), _stream_error)
    blocks, called = _blocks(await server.collect(request, job), req.tool_format)
    return JSONResponse(
        message
        | {
            "content": blocks,
            "stop_reason": "tool_use" if called else STOP_REASONS[job.generation.ended_by],
            "stop_sequence": job.stop_sequence,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": job.completion_tokens},
        }
    )


async def count_tokens(server: Server, request: Request) -> Response:
    b = validate(Conversation, await server.read_json(request))
    server.check_model(b.model)
    req = _with_tools(TextRequest(model=server.model_id, messages=_conversation(b)), b, server.model.vocab)
    tokens = await server.prompt_tokens(req)
    return JSONResponse({"input_tokens": len(tokens)})


ROUTES = [("/v1/messages", messages, ["POST"]), ("/v1/messages/count_tokens", count_tokens, ["POST"])]
