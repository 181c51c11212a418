"""Tool calls in a model's own format: which format a chat template uses, the grammar a forced call follows,
and the calls parsed back out of generated text.

Two formats, recognised from the template text (the template renders the tool list; these are what it asks
the model to answer with):
  - "hermes" (Qwen 2.5, Hermes, and templates that say `<tool_call>`): each call is
    `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, after optional text.
  - "llama3.1" (Llama 3.1/3.2's JSON tool calling: the template asks for `{"name": ..., "parameters": ...}`):
    the whole reply is one JSON object {"name": NAME, "parameters": {...}}, optionally after <|python_tag|>.
A template that never mentions `tools` cannot show the model a tool list: tools are refused for it.

A call is a ToolCall(name, arguments dict); the API dialects give it an id and their own shape.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3.1")
_TOOLS_VAR = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_format(template: str | None) -> str | None:
    """The tool-call format a chat template uses, or None when it renders no tools (or none we know)."""
    if not template or not _TOOLS_VAR.search(template):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3.1"
    return None


def _args_key(fmt: str) -> str:
    return "arguments" if fmt == "hermes" else "parameters"


def call_schema(fmt: str, tools: list[dict]) -> dict:
    """The JSON schema of one call to any of `tools` (OpenAI-style function entries) in format `fmt`."""
    key = _args_key(fmt)
    options = []
    for tool in tools:
        f = tool["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _literal(text: str, special: set[str]) -> str:
    """A Lark terminal for `text`: the special token itself when the vocabulary has one by that name."""
    return text if text in special else json.dumps(text)


def call_grammar(fmt: str, tools: list[dict], special: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """A Lark grammar (llguidance's: %json embeds a JSON schema) for exactly one call to one of `tools`."""
    schema = json.dumps(call_schema(fmt, tools), separators=(",", ":"))
    if fmt == "hermes":
        return (
            f'start: {_literal("<tool_call>", special)} "\\n" call "\\n" {_literal("</tool_call>", special)}\n'
            f"call: %json {schema}\n"
        )
    return f"start: call\ncall: %json {schema}\n"


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(obj: Any, fmt: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(_args_key(fmt), obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def parse_calls(text: str, fmt: str) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls) of a generated reply; text that only looks like a call but does
    not parse stays text."""
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for m in _HERMES.finditer(text, start):
            try:
                call = _call(json.loads(m.group(1)), fmt)
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip(), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        call = _call(json.loads(body), fmt)
    except ValueError:
        return text, []
    return ("", [call]) if call else (text, [])
