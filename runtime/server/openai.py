"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models.

Requests become TextRequests (request.py); chunks come back as OpenAI's objects. Streams are server-sent
events, one `data: {chunk}` per text delta, the role in the first delta, an empty delta carrying
finish_reason ("stop": end of text or a stop string, "length": max_tokens or the context), a usage chunk with
empty choices when stream_options.include_usage is set, then `data: [DONE]`. Errors are
{"error": {message, type, param, code}}.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator

from sse_starlette import ServerSentEvent
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.client import Job
from ingot.runtime.server.request import ApiError, Fields, TextRequest, text_of
from ingot.runtime.server.server import Server

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def error_response(e: ApiError) -> Response:
    return JSONResponse(error_body(e), status_code=e.status)


def error_body(e: ApiError) -> dict:
    kind = "server_error" if e.status >= 500 else "invalid_request_error"
    code = e.code or ("invalid_api_key" if e.status == 401 else None)
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": code}}


# --- requests ------------------------------------------------------------------------------------


def _common(body: Fields) -> dict:
    """The fields chat and text completions share."""
    if body.get("n", int, default=1) != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.get("logprobs", bool, int, default=False):
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    params = SamplingParams(
        temperature=body.get("temperature", float, default=1.0),
        top_p=body.get("top_p", float, default=1.0),
        seed=body.seed(),
    )
    return {
        "model": body.get("model", str, required=True),
        "params": params,
        "stop": body.strings("stop"),
        "stream": body.get("stream", bool, default=False),
    }


def parse_chat(body: Fields) -> TextRequest:
    messages = body.get("messages", list, required=True)
    if not messages:
        raise ApiError(400, "messages must not be empty", param="messages")
    turns = []
    for i, m in enumerate(messages):
        m = Fields(m, f"messages[{i}]")
        role = m.get("role", str, required=True)
        content = m.obj.get("content")
        turns.append(
            {
                "role": "system" if role == "developer" else role,
                "content": "" if content is None else text_of(content, m.name("content")),
            }
        )
    max_tokens = body.at_least("max_completion_tokens", 1) or body.at_least("max_tokens", 1)
    return TextRequest(messages=turns, max_tokens=max_tokens, **_common(body))


def parse_completion(body: Fields) -> TextRequest:
    prompt = body.get("prompt", str, list, required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        elif not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(
                400, "prompt must be a string, one string in an array, or an array of token ids", param="prompt"
            )
    if body.get("echo", bool, default=False):
        raise ApiError(400, "echo is not supported", param="echo")
    return TextRequest(prompt=prompt, max_tokens=body.at_least("max_tokens", 1, default=16), **_common(body))


# --- responses -----------------------------------------------------------------------------------


def _usage(job: Job) -> dict:
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def _event(obj) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def _chat_choice(text: str | None, finish: str | None) -> dict:
    """choices[0] of a chat.completion.chunk; text None is the first chunk's role delta."""
    delta = {"role": "assistant", "content": ""} if text is None else ({"content": text} if text else {})
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


def _text_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}


async def _stream(job: Job, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[ServerSentEvent]:
    choice = _chat_choice if chat else _text_choice
    usage = {"usage": None} if include_usage else {}
    if chat:
        yield _event(head | {"choices": [choice(None, None)]} | usage)
    async for chunk in job.chunks():
        if chunk.text:
            yield _event(head | {"choices": [choice(chunk.text, None)]} | usage)
        if chunk.finish_reason:
            yield _event(head | {"choices": [choice("", FINISH[chunk.finish_reason])]} | usage)
    if include_usage:
        yield _event(head | {"choices": [], "usage": _usage(job)})
    yield ServerSentEvent(data="[DONE]")


def _stream_error(e: ApiError) -> ServerSentEvent:
    return _event(error_body(e))


async def _respond(server: Server, request: Request, req: TextRequest, body: Fields, chat: bool) -> Response:
    job = await server.start(req)
    head = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.model_id,
    }
    if req.stream:
        options = body.fields("stream_options")
        include_usage = bool(options and options.get("include_usage", bool, default=False))
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        return server.stream(job, _stream(job, head, chat, include_usage), _stream_error)
    text = await server.collect(request, job)
    finish = FINISH[job.generation.ended_by]
    if chat:
        head["object"] = "chat.completion"
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return JSONResponse(head | {"choices": [choice], "usage": _usage(job)})


async def chat_completions(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    req = parse_chat(body)
    server.check_model(req.model)
    return await _respond(server, request, req, body, chat=True)


async def completions(server: Server, request: Request) -> Response:
    body = Fields(await server.read_json(request))
    req = parse_completion(body)
    server.check_model(req.model)
    return await _respond(server, request, req, body, chat=False)


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
