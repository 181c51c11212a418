"""Structured output and tool calling end to end, through the official openai, anthropic and ollama clients
against a live `ingot serve` on random-weight synthetic models (CPU). A random model writes noise, so every
parse below holds only because decoding was constrained: JSON that validates against the requested schema, a
tool call the client library's own types parse, with arguments that validate against the tool's schema."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import ollama
import openai
import pytest
from server_fixtures import ServerProcess

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "what is the weather in Paris"}]
# Sampled at temperature 1 (the random model's noise is the test's adversary). Every schema bounds its
# instances (maxLength, maximum, maxItems), so the longest fits MAX_TOKENS even at one token per byte with
# every character a 6-byte \uXXXX escape, and finish_reason is never "length".
MAX_TOKENS = 400


@pytest.fixture(scope="module", params=["hermes", "llama3.1"])
def tool_server(request, synth_model):
    s = ServerProcess(synth_model("tiny-4k", "Q8_0", request.param), "--device", "cpu").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(synth_model):
    s = ServerProcess(synth_model("tiny-4k", "Q8_0"), "--device", "cpu").wait_ready()
    yield s
    s.stop()


def _oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _model(server) -> str:
    return server.args[4].rsplit("/", 1)[-1].removesuffix(".gguf")


# --- structured output -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_openai_json_schema_output_validates(plain_server, seed):
    r = _oai(plain_server).chat.completions.create(
        model=_model(plain_server),
        messages=ASK,
        max_tokens=MAX_TOKENS,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_openai_json_object_and_streamed_schema(plain_server):
    client = _oai(plain_server)
    r = client.chat.completions.create(  # any object: unbounded, so seeded (this draw closes within MAX_TOKENS)
        model=_model(plain_server), messages=ASK, max_tokens=MAX_TOKENS, seed=4, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = client.chat.completions.create(
        model=_model(plain_server),
        messages=ASK,
        max_tokens=MAX_TOKENS,
        seed=5,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_ollama_format_schema_and_json(plain_server):
    client = ollama.Client(host=plain_server.url)
    r = client.chat(
        model=_model(plain_server), messages=ASK, format=PERSON, options={"num_predict": MAX_TOKENS, "seed": 2}
    )
    jsonschema.validate(json.loads(r.message.content), PERSON)
    # "json" is any object, unbounded: the seed fixes the draw (this one closes its object within MAX_TOKENS)
    options = {"num_predict": MAX_TOKENS, "seed": 6}
    r = client.generate(model=_model(plain_server), prompt="hello", format="json", options=options)
    assert isinstance(json.loads(r.response), dict)


def test_a_schema_the_grammar_engine_refuses_is_a_400(plain_server):
    with pytest.raises(openai.BadRequestError) as e:
        _oai(plain_server).chat.completions.create(
            model=_model(plain_server),
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
        )
    assert e.value.body["param"] == "response_format.json_schema.schema"


# --- tool calls ------------------------------------------------------------------------------------------------


def test_openai_required_tool_call_parses(tool_server):
    r = _oai(tool_server).chat.completions.create(
        model=_model(tool_server), messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=MAX_TOKENS
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    schema = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(call.function.arguments), schema["function"]["parameters"])


def test_openai_named_tool_call_streams_and_round_trips(tool_server):
    client, model = _oai(tool_server), _model(tool_server)
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=named, max_tokens=MAX_TOKENS, stream=True
    )
    chunks = [c for c in stream if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the call and its result go back in: the template renders both, and tool_choice "none" means text
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump(exclude={"index"})]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 24 C"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_anthropic_tool_use_block_matches_the_schema(tool_server):
    client = anthropic.Anthropic(base_url=tool_server.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}
    r = client.messages.create(
        model=_model(tool_server),
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert r.stop_reason == "tool_use"
    block = next(b for b in r.content if b.type == "tool_use")
    assert block.name == "get_weather"
    jsonschema.validate(block.input, tool["input_schema"])
    # a tool_result turn is accepted and rendered
    follow = ASK + [
        {"role": "assistant", "content": [block.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "sunny"}]},
    ]
    r = client.messages.create(model=_model(tool_server), max_tokens=4, messages=follow, tools=[tool])
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with client.messages.stream(
        model=_model(tool_server), max_tokens=MAX_TOKENS, messages=ASK, tools=[tool], tool_choice={"type": "any"}
    ) as stream:
        final = stream.get_final_message()
    block = next(b for b in final.content if b.type == "tool_use")
    jsonschema.validate(block.input, tool["input_schema"])


def test_ollama_tools(tool_server):
    # Ollama has no tool_choice: the model may answer in text; only a forced call is sure to parse, so this
    # checks that tools are accepted and the reply is well formed, and that its calls (if any) parse.
    client = ollama.Client(host=tool_server.url)
    r = client.chat(model=_model(tool_server), messages=ASK, tools=[WEATHER], options={"num_predict": 8})
    assert r.message.role == "assistant"
    for call in r.message.tool_calls or []:
        assert call.function.name == "get_weather"
    assert "tools" in client.show(_model(tool_server)).capabilities


# --- refusals ----------------------------------------------------------------------------------------------


def test_tools_on_a_template_without_tool_support_are_a_400(plain_server):
    with pytest.raises(openai.BadRequestError) as e:
        _oai(plain_server).chat.completions.create(model=_model(plain_server), messages=ASK, tools=[WEATHER])
    assert e.value.body["param"] == "tools" and "tool" in e.value.body["message"]
    client = anthropic.Anthropic(base_url=plain_server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e2:
        client.messages.create(
            model=_model(plain_server),
            max_tokens=4,
            messages=ASK,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    assert "tools" in e2.value.body["error"]["message"]
    with pytest.raises(ollama.ResponseError) as e3:
        ollama.Client(host=plain_server.url).chat(model=_model(plain_server), messages=ASK, tools=[WEATHER])
    assert e3.value.status_code == 400 and "tools" in e3.value.error


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_openai_400s_name_the_param(plain_server, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        _oai(plain_server).chat.completions.create(
            **({"model": _model(plain_server), "messages": ASK} | body)  # type: ignore[arg-type]
        )
    assert e.value.status_code == 400 and e.value.body["param"] == param


def test_anthropic_and_ollama_400s_name_the_param(plain_server):
    client = anthropic.Anthropic(base_url=plain_server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=_model(plain_server), max_tokens=4, messages=ASK, extra_body={"temperature": 5})
    assert e.value.body["type"] == "error" and e.value.body["error"]["message"].startswith("temperature")
    with pytest.raises(ollama.ResponseError) as e2:
        ollama.Client(host=plain_server.url).chat(
            model=_model(plain_server), messages=ASK, options={"top_p": 0}, stream=False
        )
    assert e2.value.status_code == 400 and e2.value.error.startswith("options.top_p")
