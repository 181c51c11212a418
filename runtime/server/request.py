"""The one request type every API dialect translates into, and the checks that turn bad input into API errors.

An OpenAI, Anthropic or Ollama body (openai.py, anthropic.py, ollama.py) is validated against that dialect's
pydantic models (types, ranges, roles; unknown fields are ignored, as the real APIs ignore fields they do not
use) and becomes a TextRequest: a conversation for the model's chat template or a raw prompt, sampling
parameters, a token budget, stop strings, the tools the template shows the model and the constraint its output
must meet. app.py runs it through the scheduler; the dialect shapes the chunks that come back. Errors are
ApiError(status, message, param): each dialect renders them in its own error body; a validation error names
the first offending field as `param` ("messages[0].role") and in its message.

Why pydantic (not msgspec): its error locations map straight onto `param`, it is already installed with the
official clients the tests drive, and it validates the Python objects that the bounded JSON reader
(runtime/limits.py) produced; msgspec's speed buys nothing on bodies of at most 1 MiB next to a generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Strict, ValidationError

from ingot.runtime.model.gguf import Vocab
from ingot.runtime.model.templates import chat_template
from ingot.runtime.model.toolcalls import call_grammar, tool_format
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.structured import Constraint, check


class ApiError(Exception):
    """An HTTP error: 400 bad request, 401 no or wrong API key, 404 unknown model or path, 413 body too large,
    500 generation failed, 503 loading or shutting down."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class TextRequest:
    model: str
    messages: list[dict[str, Any]] | None = None  # {"role", "content", ...} messages, for the chat template
    prompt: str | list[int] | None = None  # raw text (encoded as `ingot run -p` does) or token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: until the context is full
    stop: tuple[str, ...] = ()
    stream: bool = False
    tools: list[dict] | None = None  # OpenAI-style function tools, rendered by the chat template
    tool_format: str | None = None  # the template's tool-call format (model/toolcalls.py), when tools are on
    constraint: Constraint | None = None  # what the output must be (structured output, a forced tool call)


# --- validation ------------------------------------------------------------------------------------------

# JSON types without coercion: "5" is not a number, true is not an integer (JSON true is a bool), 1.5 is
# not an integer; an integer is a number.
Str = Annotated[str, Strict()]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]


class Body(BaseModel):
    """A request body or a part of one: strict JSON types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True, frozen=True)


M = TypeVar("M", bound=BaseModel)


def _param(loc: tuple) -> str:
    """pydantic's error location as a field path: ("messages", 0, "role") -> "messages[0].role". Union members
    add their type to the location ("str", "list[str]", "NamedToolChoice"), and a tagged union its tag before
    the member's field ("text", "tool_use"); those are dropped."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        tag_before_field = part in _TAGS and i + 1 < len(loc) and isinstance(loc[i + 1], str)
        if "[" in part or part in _PRIMITIVES or part[:1].isupper() or tag_before_field:
            continue
        out += f".{part}" if out else part
    return out


_PRIMITIVES = {"str", "int", "float", "bool", "dict", "list", "none"}
_TAGS = {"text", "tool_use", "tool_result"}  # the discriminator values of Anthropic's content blocks


def validate(model: type[M], body: Any) -> M:
    """The body as `model`, or a 400 naming the offending field (`param` and the message's start)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        # A union's members each add an error; the one that got deepest into the value says most.
        errors = e.errors(include_url=False)
        err = max(errors, key=lambda x: len(_param(tuple(x["loc"]))))
        param = _param(tuple(err["loc"]))
        message = err["msg"][0].lower() + err["msg"][1:]
        raise ApiError(400, f"{param or 'the request body'}: {message}", param=param or None) from None


def joined_text(content: Any) -> str:
    """Message content as text: a string, or text parts ({"type": "text", "text": ...} as OpenAI and Anthropic
    write them, validated) joined by newlines, as vLLM joins them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


# --- structured output and tools ---------------------------------------------------------------------------


def checked(constraint: Constraint, param: str) -> Constraint:
    """The constraint, or a 400 naming `param` when the grammar engine cannot compile it (a schema keyword
    it does not support, a malformed schema)."""
    error = check(constraint)
    if error:
        raise ApiError(400, f"{param}: the grammar engine cannot use it: {error.splitlines()[0][:300]}", param=param)
    return constraint


def with_tools(req: TextRequest, vocab: Vocab, tools: list[dict], choice: str, name: str | None = None) -> TextRequest:
    """The request with `tools` (OpenAI-style function entries) shown to the model through its chat template.
    choice: "none" (tools not shown, text only), "auto" (the model may call one: calls in its output are
    parsed), "required" (decoding is constrained to one call of any tool) or "named" (to a call of `name`).
    A template that renders no tools is a 400 naming `tools`: never a silent ignore."""
    if choice == "none" or not tools:
        return req
    fmt = tool_format(chat_template(vocab))
    if fmt is None:
        raise ApiError(
            400,
            "tools: this model's chat template does not render tools, so it cannot call them"
            " (send the request without tools, or serve a model whose template supports tool calling)",
            param="tools",
        )
    constraint = req.constraint
    if choice in ("required", "named"):
        chosen = [t for t in tools if choice == "required" or t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"tool_choice: no tool is named {name!r}", param="tool_choice")
        if constraint is not None:
            raise ApiError(
                400, "tool_choice: a forced tool call cannot also have a response format", param="tool_choice"
            )
        special = {t for t, kind in zip(vocab.tokens, vocab.types, strict=False) if kind in (3, 4)}
        constraint = checked(Constraint("lark", call_grammar(fmt, chosen, special)), "tools")
    return replace(req, tools=tools, tool_format=fmt, constraint=constraint)
