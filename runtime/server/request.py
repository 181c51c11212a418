"""The one request type every API dialect translates into, and the checks that turn bad input into API errors.

An OpenAI, Anthropic or Ollama body (openai.py, anthropic.py, ollama.py) becomes a TextRequest: a
conversation for the model's chat template or a raw prompt, sampling parameters, a token budget and stop
strings. app.py runs it through the scheduler; the dialect shapes the chunks that come back. Errors are
ApiError(status, message, param): each dialect renders them in its own error body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, overload

from ingot.runtime.sampling import SamplingParams


class ApiError(Exception):
    """An HTTP error: 400 bad request, 401 no or wrong API key, 404 unknown model or path, 413 body too large,
    500 generation failed, 503 loading or shutting down."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class TextRequest:
    model: str
    messages: list[dict[str, str]] | None = None  # {"role", "content"} text messages, for the chat template
    prompt: str | list[int] | None = None  # raw text (encoded as `ingot run -p` does) or token ids
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: until the context is full
    stop: tuple[str, ...] = ()
    stream: bool = False


_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
}


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # JSON true is not a number
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


class Fields:
    """Typed access to a JSON object: a missing required field or a value of the wrong type is a 400 naming
    the field (`param` in OpenAI's error body)."""

    def __init__(self, obj: Any, where: str = ""):
        if not isinstance(obj, dict):
            raise ApiError(400, f"{where or 'the request body'} must be a JSON object", param=where or None)
        self.obj, self.where = obj, where

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, *kinds: type, default: Any = None, required: bool = False) -> Any:
        value = self.obj.get(key)
        if value is None:
            if required:
                raise ApiError(400, f"{self.name(key)} is required", param=self.name(key))
            return default
        if not any(_is(value, k) for k in kinds):
            wanted = " or ".join(_TYPE_NAMES[k] for k in kinds)
            raise ApiError(400, f"{self.name(key)} must be {wanted}", param=self.name(key))
        return float(value) if kinds == (float,) else value

    @overload
    def at_least(self, key: str, low: int, default: int, required: bool = False) -> int: ...

    @overload
    def at_least(self, key: str, low: int, default: None = None, required: bool = False) -> int | None: ...

    def at_least(self, key: str, low: int, default: int | None = None, required: bool = False) -> int | None:
        value = self.get(key, int, default=default, required=required)
        if value is not None and value < low:
            raise ApiError(400, f"{self.name(key)} must be at least {low}", param=self.name(key))
        return value

    def fields(self, key: str, required: bool = False) -> Fields | None:
        value = self.get(key, dict, required=required)
        return None if value is None else Fields(value, self.name(key))

    def strings(self, key: str) -> tuple[str, ...]:
        """A string or an array of strings (stop sequences)."""
        value = self.get(key, str, list, default=[])
        items = [value] if isinstance(value, str) else value
        if not all(isinstance(s, str) for s in items):
            raise ApiError(400, f"{self.name(key)} must be a string or an array of strings", param=self.name(key))
        return tuple(items)

    def seed(self, key: str = "seed") -> int | None:
        return self.at_least(key, 0)


def text_of(content: Any, where: str) -> str:
    """Message content as text: a string, or an array of text parts ({"type": "text", "text": ...}, as both
    OpenAI and Anthropic write them) joined by newlines, as vLLM joins them. Other part types (images, tool
    calls) are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or an array of text parts", param=where)
    texts = []
    for i, part in enumerate(content):
        part = Fields(part, f"{where}[{i}]")
        kind = part.get("type", str, required=True)
        if kind != "text":
            raise ApiError(400, f"{part.name('type')} {kind!r} is not supported; only text is", param=part.name("type"))
        texts.append(part.get("text", str, required=True))
    return "\n".join(texts)
