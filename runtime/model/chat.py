"""Chat templates: the model's `tokenizer.chat_template` (Jinja) rendered the way HF transformers'
`apply_chat_template(messages, add_generation_prompt=True)` renders it.

The environment is the one transformers builds: an ImmutableSandboxedEnvironment (a template from a
downloaded file must not reach Python internals) with trim_blocks and lstrip_blocks, the loopcontrols
extension, `{% generation %}` blocks accepted, a `tojson` filter that keeps non-ASCII text, and the globals
`raise_exception` and `strftime_now`. The context holds messages, add_generation_prompt, tools, documents and
the special-token strings (bos_token, eos_token, unk_token).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ingot.runtime.errors import ModelError, UsageError
from ingot.runtime.model.templates import chat_template
from ingot.runtime.model.tokenizer import Tokenizer


class _TemplateRaised(Exception):
    """raise_exception() called by the template: the conversation does not fit it (a usage error)."""


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"the model's chat template does not parse: {e.message} (line {e.lineno})") from None


def render(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    unk_token: str = "",
    tools=None,
    documents=None,
) -> str:
    """The prompt text for a conversation: messages are {"role": ..., "content": ...} dicts."""
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise UsageError("each chat message needs a role and content")
    try:
        return compile_template(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
        )
    except _TemplateRaised as e:
        raise UsageError(f"the chat template rejected the conversation: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"the model's chat template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ModelError(f"the model's chat template failed: {e}") from None


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of the templated conversation, ready for the assistant's reply.

    BOS is added when the model's add_bos flag asks for it, unless the template already wrote it (as most do
    via {{ bos_token }}): the same double-BOS rule as llama.cpp's server."""
    vocab = tokenizer.vocab
    template = chat_template(vocab)  # the GGUF's own, else a built-in one for its family (templates.py)
    if not template:
        raise ModelError("the model has no chat template (tokenizer.chat_template)", hint="run without --chat")

    def text_of(i):
        return vocab.tokens[i] if i is not None else ""

    bos = text_of(vocab.bos_id)
    text = render(template, messages, bos_token=bos, eos_token=text_of(vocab.eos_id), unk_token=text_of(vocab.unk_id))
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if vocab.add_bos and vocab.bos_id is not None and ids[:1] != [vocab.bos_id]:
        ids = [vocab.bos_id] + ids
    return ids
