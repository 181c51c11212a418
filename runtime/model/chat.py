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
import sys
import time
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

# Limits (README: Limits): a chat template comes with the model file, so rendering one is bounded in time and
# in the size of every string or list it builds (the sandbox already keeps it away from Python internals).
TEMPLATE_TIME_S = 1.0
TEMPLATE_OUTPUT_CHARS = 4 << 20
TEMPLATE_MAX_INT = 1 << 22  # largest number the template may pass to a call, a filter width or `*`/`**`


class _TemplateRaised(Exception):
    """raise_exception() called by the template: the conversation does not fit it (a usage error)."""


class _TemplateBudget(Exception):
    """The template ran past its time or size budget (a ModelError: the model file is at fault)."""


def _size(x) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple, dict)) else 0


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox plus size checks on `*`, `**` and `+` (intercepted, so `"x" * 10**10` is refused before it
    is built) and on the numbers passed to calls."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise _TemplateBudget(f"exponent {right} is too large")
        if operator == "*":
            n = right if isinstance(right, int) else left if isinstance(left, int) else 1
            if isinstance(n, int) and max(_size(left), _size(right)) * abs(n) > TEMPLATE_OUTPUT_CHARS:
                raise _TemplateBudget(f"a value of more than {TEMPLATE_OUTPUT_CHARS:,} items")
        if operator == "+" and _size(left) + _size(right) > TEMPLATE_OUTPUT_CHARS:
            raise _TemplateBudget(f"a value of more than {TEMPLATE_OUTPUT_CHARS:,} items")
        return super().call_binop(context, operator, left, right)

    def call(self, __context, __obj, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_INT:
                raise _TemplateBudget(f"a call with the number {a}")
        return super().call(__context, __obj, *args, **kwargs)


def _bounded_filter(f):
    def bounded(value, *args, **kwargs):
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_INT:
                raise _TemplateBudget(f"a filter with the number {a}")
        return f(value, *args, **kwargs)

    return bounded


def _budget_profiler(deadline: float):
    """A per-thread profile hook for the render: every call and return checks the clock, and every returned
    string or list its size, so a template that loops or grows a string forever stops within the budget."""
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        if event == "return" and _size(arg) > TEMPLATE_OUTPUT_CHARS:
            raise _TemplateBudget(f"a value of more than {TEMPLATE_OUTPUT_CHARS:,} items")
        count += 1
        if count & 63 == 0 and time.perf_counter() > deadline:
            raise _TemplateBudget(f"rendering took more than {TEMPLATE_TIME_S:g} s")

    return hook


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
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, "jinja2.ext.loopcontrols"]
    )
    for name in ("center", "indent", "wordwrap", "truncate", "format", "batch", "slice", "round"):
        env.filters[name] = _bounded_filter(env.filters[name])
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
    compiled = compile_template(template)
    previous = sys.getprofile()
    sys.setprofile(_budget_profiler(time.perf_counter() + TEMPLATE_TIME_S))
    try:
        text = compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
        )
        if len(text) > TEMPLATE_OUTPUT_CHARS:
            raise _TemplateBudget(f"a prompt of {len(text):,} characters")
        return text
    except _TemplateBudget as e:
        raise ModelError(
            f"the model's chat template exceeded its budget: {e}",
            hint=f"templates get {TEMPLATE_TIME_S:g} s and {TEMPLATE_OUTPUT_CHARS:,} characters",
        ) from None
    except (MemoryError, RecursionError, OverflowError) as e:
        raise ModelError(f"the model's chat template failed: {type(e).__name__}") from None
    except _TemplateRaised as e:
        raise UsageError(f"the chat template rejected the conversation: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"the model's chat template tried an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ModelError(f"the model's chat template failed: {e}") from None
    finally:
        sys.setprofile(previous)


def chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the templated conversation, ready for the assistant's reply; `tools` (OpenAI-style
    {"type": "function", "function": {...}} entries) go to the template, which renders them its own way.

    BOS is added when the model's add_bos flag asks for it, unless the template already wrote it (as most do
    via {{ bos_token }}): the same double-BOS rule as llama.cpp's server."""
    vocab = tokenizer.vocab
    template = chat_template(vocab)  # the GGUF's own, else a built-in one for its family (templates.py)
    if not template:
        raise ModelError("the model has no chat template (tokenizer.chat_template)", hint="run without --chat")

    def text_of(i):
        return vocab.tokens[i] if i is not None else ""

    bos = text_of(vocab.bos_id)
    text = render(
        template,
        messages,
        bos_token=bos,
        eos_token=text_of(vocab.eos_id),
        unk_token=text_of(vocab.unk_id),
        tools=tools or None,
    )
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if vocab.add_bos and vocab.bos_id is not None and ids[:1] != [vocab.bos_id]:
        ids = [vocab.bos_id] + ids
    return ids
