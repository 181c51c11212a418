"""The Anthropic dialect: /v1/messages and /v1/messages/count_tokens.

A Messages request (system prompt as a string or text blocks, user/assistant turns of text) becomes a chat
TextRequest. Streams are named server-sent events in the documented order: message_start,
content_block_start, ping, content_block_delta..., content_block_stop, message_delta (stop_reason end_turn,
max_tokens or stop_sequence, and which stop_sequence), message_stop. Errors are
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import Job
from ingot.runtime.server.request import ApiError, Fields, TextRequest, text_of
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


def _conversation(body: Fields) -> list[dict[str, str]]:
    """The system prompt (a string or text blocks) and the user/assistant turns, as chat-template messages."""
    turns = []
    system = body.obj.get("system")
    if system is not None:
        turns.append({"role": "system", "content": text_of(system, "system")})
    messages = body.get("messages", list, required=True)
    if not messages:
        raise ApiError(400, "messages: at least one message is required", param="messages")
    for i, m in enumerate(messages):
        m = Fields(m, f"messages[{i}]")
        role = m.get("role", str, required=True)
        if role not in ("user", "assistant"):
            raise ApiError(400, f"{m.name('role')}: expected 'user' or 'assistant', got {role!r}")
        turns.append({"role": role, "content": text_of(m.get("content", str, list, required=True), m.name("content"))})
    return turns


def parse_messages(body: Fields) -> TextRequest:
    params = SamplingParams(
        temperature=body.get("temperature", float, default=1.0),
        top_p=body.get("top_p", float, default=1.0),
        top_k=body.at_least("top_k", 0, default=0),
    )
    stops = body.get("stop_sequences", list, default=[])
    if not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop_sequences must be an array of strings")
    return TextRequest(
        model=body.get("model", str, required=True),
        messages=_conversation(body),
        params=params,
        max_tokens=body.at_least("max_tokens", 1, required=True),
        stop=tuple(stops),
        stream=body.get("stream", bool, default=False),
    )


# --- responses -----------------------------------------------------------------------------------


def _event(name: str, obj: dict) -> ServerSentEvent:
    return ServerSentEvent(event=name, data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


async def _stream(job: Job, message: dict) -> AsyncIterator[ServerSentEvent]:
    yield _event("message_start", {"type": "message_start", "message": message})
    yield _event(
        "content_block_start",
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    )
    yield _event("ping", {"type": "ping"})
    async for chunk in job.chunks():
        if chunk.text:
            yield _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": chunk.text}},
            )
        if chunk.finish_reason:
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASONS[chunk.finish_reason], "stop_sequence": job.stop_sequence},
                    "usage": {"output_tokens": job.completion_tokens},
                },
            )
    yield _event("message_stop", {"type": "message_stop"})


def _stream_error(e: ApiError) -> ServerSentEvent:
    return _event("error", error_body(e))


async def messages(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    req = parse_messages(body)
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
        return server.stream(job, _stream(job, message), _stream_error)
    text = await server.collect(request, job)
    return JSONResponse(
        message
        | {
            "content": [{"type": "text", "text": text}],
            "stop_reason": STOP_REASONS[job.generation.ended_by],
            "stop_sequence": job.stop_sequence,
            "usage": {"input_tokens": job.prompt_tokens, "output_tokens": job.completion_tokens},
        }
    )


async def count_tokens(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    server.check_model(body.get("model", str, required=True))
    tokens = await server.prompt_tokens(TextRequest(model=server.model_id, messages=_conversation(body)))
    return JSONResponse({"input_tokens": len(tokens)})


ROUTES = [("/v1/messages", messages, ["POST"]), ("/v1/messages/count_tokens", count_tokens, ["POST"])]
