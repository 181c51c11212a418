"""Request parsing of the three API dialects, in-process: every sampling field a client sends must reach the
SamplingParams the scheduler runs (a dropped `temperature` silently turns sampling into greedy decoding, or the
reverse), defaults are each API's own, and bad values are 400s naming the field. The end-to-end check that the
parameters change the output is tests/test_server_protocol.py::test_sampling_parameters_change_the_output."""

from __future__ import annotations

import json

import httpx
import pytest

from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server import anthropic, ollama, openai
from ingot.runtime.server.request import ApiError, joined_text, validate

MSGS = [{"role": "user", "content": "hi"}]


def _chat(**kw):
    return openai.parse_chat({"model": "m", "messages": MSGS} | kw)


def _completion(**kw):
    return openai.parse_completion({"model": "m", "prompt": "hi"} | kw)


def _messages(**kw):
    return anthropic.parse_messages({"model": "m", "messages": MSGS, "max_tokens": 5} | kw)


def _ollama_chat(body=None, **options):
    return ollama.parse_chat({"model": "m", "messages": MSGS, "options": options} | (body or {}))


def _ollama_generate(body=None, **options):
    return ollama.parse_generate({"model": "m", "prompt": "hi", "options": options} | (body or {}))


# --- sampling parameters reach SamplingParams ------------------------------------------------------


@pytest.mark.parametrize("parse", [_chat, _completion], ids=["chat", "completions"])
def test_openai_passes_sampling_fields_through(parse):
    p = parse(temperature=0.35, top_p=0.6, seed=1234).params
    assert (p.temperature, p.top_p, p.seed) == (0.35, 0.6, 1234)
    assert parse(seed=0).params.seed == 0
    assert parse(temperature=0).params.greedy and parse(temperature=0.0).params.greedy
    assert parse(temperature=2).params.temperature == 2.0 and isinstance(parse(temperature=2).params.temperature, float)
    # OpenAI's defaults: temperature 1, top_p 1, no seed, no top-k/min-p/penalty (the API has none)
    assert parse().params == SamplingParams(temperature=1.0)


def test_anthropic_passes_sampling_fields_through():
    p = _messages(temperature=0.25, top_p=0.7, top_k=17).params
    assert (p.temperature, p.top_p, p.top_k) == (0.25, 0.7, 17)
    assert _messages(temperature=0).params.greedy
    assert _messages().params == SamplingParams(temperature=1.0)  # Anthropic's defaults


@pytest.mark.parametrize("parse", [_ollama_chat, _ollama_generate], ids=["chat", "generate"])
def test_ollama_passes_every_option_through(parse):
    p = parse(temperature=0.3, top_k=7, top_p=0.55, min_p=0.08, repeat_penalty=1.3, repeat_last_n=12, seed=99).params
    assert p == SamplingParams(
        temperature=0.3, top_k=7, top_p=0.55, min_p=0.08, repetition_penalty=1.3, repeat_last_n=12, seed=99
    )
    assert parse(temperature=0).params.greedy
    # Ollama's defaults (its Modelfile parameters' documented defaults)
    assert parse().params == SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, min_p=0.0, repetition_penalty=1.1, repeat_last_n=64
    )


def test_ollama_options_set_limits_stops_and_streaming():
    r = _ollama_chat(num_predict=12, stop=["x", "yz"])
    assert (r.max_tokens, r.stop, r.stream) == (12, ("x", "yz"), True)  # Ollama streams by default
    assert _ollama_chat(num_predict=-1).max_tokens is None and _ollama_chat(num_predict=-2).max_tokens is None
    assert _ollama_chat({"stream": False}).stream is False
    for bad in (0, -3):
        with pytest.raises(ApiError) as e:
            _ollama_chat(num_predict=bad)
        assert e.value.status == 400 and "num_predict" in e.value.message


def test_openai_limits_stops_and_streaming():
    r = _chat(max_tokens=9, stop="END", stream=True)
    assert (r.max_tokens, r.stop, r.stream, r.model) == (9, ("END",), True, "m")
    assert _chat(max_completion_tokens=4, max_tokens=9).max_tokens == 4  # the newer name wins
    assert _chat().max_tokens is None and _completion().max_tokens == 16  # completions default to 16
    assert _chat(stop=["a", "b"]).stop == ("a", "b")
    assert _chat(messages=[{"role": "developer", "content": "be brief"}] + MSGS).messages[0] == {
        "role": "system",
        "content": "be brief",
    }
    assert _completion(prompt=["one string"]).prompt == "one string"
    assert _completion(prompt=[5, 6, 7]).prompt == [5, 6, 7]


def test_anthropic_system_prompt_and_stop_sequences():
    r = _messages(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], stop_sequences=["\n\n"])
    assert r.messages == [{"role": "system", "content": "a\nb"}] + MSGS and r.stop == ("\n\n",) and r.max_tokens == 5
    assert _messages(system="plain").messages[0] == {"role": "system", "content": "plain"}


# --- bad values are 400s that name the field --------------------------------------------------------


@pytest.mark.parametrize(
    "parse, body, param",
    [
        (_chat, {"temperature": "hot"}, "temperature"),
        (_chat, {"temperature": True}, "temperature"),  # JSON true is not a number
        (_chat, {"top_p": [1]}, "top_p"),
        (_chat, {"seed": -1}, "seed"),
        (_chat, {"seed": 1.5}, "seed"),
        (_chat, {"n": 2}, "n"),
        (_chat, {"max_tokens": 0}, "max_tokens"),
        (_chat, {"stop": [1]}, "stop[0]"),  # the deepest offending item
        (_chat, {"messages": []}, "messages"),
        (_chat, {"messages": [{"content": "x"}]}, "messages[0].role"),
        (_completion, {"prompt": [1, "a"]}, "prompt[1]"),
        (_completion, {"prompt": [True]}, "prompt[0]"),
        (_completion, {"echo": True}, "echo"),
        (_messages, {"top_k": -1}, "top_k"),
        (_messages, {"max_tokens": None}, "max_tokens"),
    ],
)
def test_bad_fields_name_the_param(parse, body, param):
    with pytest.raises(ApiError) as e:
        parse(**body)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize(
    "parse, kw, param",
    [
        (_chat, {"temperature": -0.5}, "temperature"),
        (_chat, {"temperature": 5}, "temperature"),  # OpenAI's range is 0..2
        (_chat, {"top_p": 0}, "top_p"),
        (_completion, {"top_p": 1.01}, "top_p"),
        (_messages, {"top_p": 1.5}, "top_p"),
        (_messages, {"temperature": 1.5}, "temperature"),  # Anthropic's range is 0..1
        (_ollama_chat, {"min_p": 2.0}, "options.min_p"),
        (_ollama_chat, {"temperature": 3}, "options.temperature"),
        (_ollama_generate, {"top_p": 0}, "options.top_p"),
    ],
)
def test_out_of_range_sampling_values_are_refused(parse, kw, param):
    with pytest.raises(ApiError) as e:
        parse(**kw)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize(
    "parse, messages, param",
    [
        (_chat, [{"role": "wizard", "content": "x"}], "messages[0].role"),
        (_chat, [{"role": "user", "content": 5}], "messages[0].content"),
        (_chat, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].type"),
        (_messages, [{"role": "system", "content": "x"}], "messages[0].role"),
        (_messages, [{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages[0].content[0]"),
        (_ollama_chat, [{"role": "robot", "content": "x"}], "messages[0].role"),
        (_ollama_chat, [{"role": "user", "content": "x", "images": ["aGk="]}], "messages[0].images"),
    ],
)
def test_unknown_roles_and_parts_are_refused(parse, messages, param):
    with pytest.raises(ApiError) as e:
        parse(**{"messages": messages}) if parse is not _ollama_chat else parse({"messages": messages})
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


def test_validation_errors_and_text_parts():
    with pytest.raises(ApiError, match="request body must be a JSON object"):
        validate(openai.ChatBody, "text")
    with pytest.raises(ApiError) as e:
        validate(openai.ChatBody, {"messages": MSGS})
    assert (e.value.status, e.value.param) == (400, "model") and e.value.message.startswith("model: field required")
    with pytest.raises(ApiError) as e:
        validate(openai.ChatBody, {"model": "m", "messages": MSGS, "stream": "yes"})
    assert e.value.param == "stream"  # strict JSON types: a string is not a boolean
    assert joined_text("plain") == "plain" and joined_text(None) == ""
    parts = [openai.TextPart(type="text", text="a"), openai.TextPart(type="text", text="b")]
    assert joined_text(parts) == "a\nb"


def test_an_ndjson_line_stays_one_line_for_the_ollama_client():
    """Generated text with U+2028, U+2029 or U+0085 (which JSON leaves raw and httpx's iter_lines, the ollama
    client's reader, splits on) still arrives as one line with the same text."""
    text = "a\u2028b\u2029c\x85d\u00e9\u4e2d\n"
    line = ollama._line({"message": {"content": text}})
    lines = list(httpx.Response(200, content=line.encode()).iter_lines())
    assert len(lines) == 1 and json.loads(lines[0])["message"]["content"] == text
