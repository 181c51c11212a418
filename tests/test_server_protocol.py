"""The three API dialects of `ingot serve`, against a real server process on the tiny synthetic model: response
and stream shapes, greedy output equal to runtime.generate's, stop strings, errors in each dialect's shape,
/metrics and /health. The official openai and anthropic clients drive their APIs; Ollama's goes over httpx."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from server_fixtures import ReferenceRunner, ServerProcess, sse_events

QUESTION = [{"role": "user", "content": "what is the capital of France"}]
GREEDY_OLLAMA = {"temperature": 0, "repeat_penalty": 1}  # Ollama's defaults sample, with a penalty


@pytest.fixture(scope="module")
def model_path(synth_model):
    return synth_model("tiny", "Q8_0")


@pytest.fixture(scope="module")
def server(model_path):
    s = ServerProcess(model_path, "--device", "cpu").wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref(model_path):
    return ReferenceRunner(model_path)


@pytest.fixture(scope="module")
def model_id(model_path):
    return model_path.stem


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


FINISH_OPENAI = {"eos": "stop", "stop": "stop", "length": "length"}


# --- OpenAI ----------------------------------------------------------------------------------------


def test_health_and_models(server, oai, model_id):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "model": model_id}
    assert [m.id for m in oai.models.list().data] == [model_id]
    assert oai.models.retrieve(model_id).owned_by == "ingot"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_openai_chat_equals_generate(oai, ref, model_id):
    want = ref(QUESTION, max_tokens=12)
    r = oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == FINISH_OPENAI[want.finish_reason]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.prompt_tokens, want.completion_tokens)
    # max_completion_tokens is the newer name of max_tokens
    r = oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_completion_tokens=12)
    assert r.choices[0].message.content == want.text


def test_openai_chat_stream_format(server, oai, ref, model_id):
    want = ref(QUESTION, max_tokens=10)
    body = {
        "model": model_id,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *deltas, last, usage = chunks
    assert all(c["choices"][0]["finish_reason"] is None and c["usage"] is None for c in deltas)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in deltas) == want.text
    assert last["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": FINISH_OPENAI[want.finish_reason],
    }
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": want.prompt_tokens,
        "completion_tokens": want.completion_tokens,
        "total_tokens": want.prompt_tokens + want.completion_tokens,
    }
    # the official client reads the same stream
    stream = oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=10, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_openai_completions(oai, ref, model_id):
    want = ref(prompt="the capital of France is", max_tokens=9)
    r = oai.completions.create(model=model_id, prompt="the capital of France is", temperature=0, max_tokens=9)
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == FINISH_OPENAI[want.finish_reason]
    stream = oai.completions.create(
        model=model_id, prompt="the capital of France is", temperature=0, max_tokens=9, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want.text
    ids = ref.prompt_tokens(prompt="the capital of France is")  # a prompt of token ids
    r = oai.completions.create(model=model_id, prompt=ids, temperature=0, max_tokens=9)
    assert r.choices[0].text == want.text


def test_stop_strings_in_each_dialect(server, oai, claude, ref, model_id):
    full = ref(QUESTION, max_tokens=24)
    words = full.text.split()
    assert len(words) >= 4, f"the tiny model's answer is too short to cut: {full.text!r}"
    stop = " " + words[2]
    cut = full.text[: full.text.find(stop)]
    assert ref(QUESTION, max_tokens=24, stop=(stop,)).text == cut  # the reference agrees on the cut

    r = oai.chat.completions.create(
        model=model_id, messages=QUESTION, temperature=0, max_tokens=24, stop=[stop, "\x00"]
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
    m = claude.messages.create(
        model=model_id, messages=QUESTION, max_tokens=24, stop_sequences=["\x00", stop], extra_body={"temperature": 0}
    )
    assert (m.content[0].text, m.stop_reason, m.stop_sequence) == (cut, "stop_sequence", stop)
    o = httpx.post(
        f"{server.url}/api/chat",
        json={
            "model": model_id,
            "messages": QUESTION,
            "stream": False,
            "options": GREEDY_OLLAMA | {"stop": [stop], "num_predict": 24},
        },
    )
    assert (o.json()["message"]["content"], o.json()["done_reason"]) == (cut, "stop")


def test_sampling_is_seeded(oai, model_id):
    def sample(seed):
        return (
            oai.chat.completions.create(
                model=model_id, messages=QUESTION, temperature=1.5, top_p=1, seed=seed, max_tokens=12
            )
            .choices[0]
            .message.content
        )

    assert sample(11) == sample(11)
    assert len({sample(s) for s in (11, 12, 13, 14)}) > 1


def test_sampling_parameters_change_the_output(server, oai, ref, model_id):
    """temperature, top_p and top_k must reach the sampler: at temperature 1.5 seeded samples leave the greedy
    answer, and a top_p/top_k that keeps only the likeliest token brings it back. Seeds make this deterministic;
    the tiny random model's next-token distributions are wide (its top token has well under half the mass at
    T=1.5), so 12 tokens of 4 seeds all equal to the greedy answer would mean the temperature was dropped."""
    greedy = ref(QUESTION, max_tokens=12).text

    def openai_chat(seed, **kw):
        return (
            oai.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=12, seed=seed, **kw)
            .choices[0]
            .message.content
        )

    def ollama_chat(seed, **options):
        r = httpx.post(
            f"{server.url}/api/chat",
            json={
                "model": model_id,
                "messages": QUESTION,
                "stream": False,
                "options": {"num_predict": 12, "seed": seed, "repeat_penalty": 1} | options,
            },
        )
        return r.json()["message"]["content"]

    for chat in (openai_chat, ollama_chat):
        hot = [chat(seed, temperature=1.5) for seed in (1, 2, 3, 4)]
        assert any(text != greedy for text in hot), (chat.__name__, hot)
        assert all(chat(seed, temperature=0) == greedy for seed in (1, 2))
    assert openai_chat(1, temperature=1.5, top_p=1e-6) == greedy  # top_p keeps just the top token
    assert ollama_chat(1, temperature=1.5, top_k=1, top_p=1) == greedy
    assert ollama_chat(1, temperature=1.5, top_k=0, top_p=1, min_p=1.0) == greedy


# --- Anthropic -------------------------------------------------------------------------------------

SYSTEM_BLOCKS = [{"type": "text", "text": "answer in one word"}]
WITH_SYSTEM = [{"role": "system", "content": "answer in one word"}] + QUESTION


def test_anthropic_messages_equal_generate(claude, ref, model_id):
    want = ref(WITH_SYSTEM, max_tokens=8)
    content = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    m = claude.messages.create(
        model=model_id, system=SYSTEM_BLOCKS, messages=content, max_tokens=8, extra_body={"temperature": 0}
    )
    assert m.type == "message" and m.role == "assistant" and m.model == model_id
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.text
    assert m.stop_reason == {"eos": "end_turn", "length": "max_tokens"}[want.finish_reason]
    assert (m.usage.input_tokens, m.usage.output_tokens) == (want.prompt_tokens, want.completion_tokens)
    with claude.messages.stream(
        model=model_id, system="answer in one word", messages=QUESTION, max_tokens=8, extra_body={"temperature": 0}
    ) as stream:
        assert "".join(stream.text_stream) == want.text
        assert stream.get_final_message().usage.output_tokens == want.completion_tokens


def test_anthropic_stream_event_order(server, ref, model_id):
    want = ref(QUESTION, max_tokens=6)
    body = {"model": model_id, "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body) as r:
        events = sse_events(r)
    names = [name for name, _ in events]
    n_deltas = names.count("content_block_delta")
    assert names == (
        ["message_start", "content_block_start", "ping"]
        + ["content_block_delta"] * n_deltas
        + ["content_block_stop", "message_delta", "message_stop"]
    )
    data = [json.loads(d) for _, d in events]
    assert all(d["type"] == name for d, name in zip(data, names, strict=False))
    assert data[0]["message"]["usage"]["input_tokens"] == want.prompt_tokens
    assert "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta") == want.text
    delta = data[-2]
    assert delta["delta"] == {
        "stop_reason": {"eos": "end_turn", "length": "max_tokens"}[want.finish_reason],
        "stop_sequence": None,
    }
    assert delta["usage"]["output_tokens"] == want.completion_tokens


def test_anthropic_count_tokens(claude, ref, model_id):
    n = claude.messages.count_tokens(model=model_id, system="answer in one word", messages=QUESTION).input_tokens
    assert n == len(ref.prompt_tokens(WITH_SYSTEM))


# --- Ollama ----------------------------------------------------------------------------------------


def test_ollama_chat_stream(server, ref, model_id):
    want = ref(QUESTION, max_tokens=7)
    body = {"model": model_id, "messages": QUESTION, "options": GREEDY_OLLAMA | {"num_predict": 7}}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body) as r:  # streams by default
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    *parts, final = lines
    assert all(p["done"] is False and p["message"]["role"] == "assistant" for p in parts)
    assert "".join(p["message"]["content"] for p in parts) == want.text
    assert final["done"] is True and final["done_reason"] == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert (final["prompt_eval_count"], final["eval_count"]) == (want.prompt_tokens, want.completion_tokens)
    for key in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int) and final[key] > 0
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]


def test_ollama_generate(server, ref, model_id):
    url = f"{server.url}/api/generate"
    templated = ref(QUESTION, max_tokens=7)
    r = httpx.post(
        url,
        json={
            "model": f"{model_id}:latest",
            "prompt": QUESTION[0]["content"],
            "stream": False,
            "options": GREEDY_OLLAMA | {"num_predict": 7},
        },
    ).json()
    assert r["response"] == templated.text and r["done"] is True and r["eval_count"] == templated.completion_tokens
    raw = ref(prompt="the capital of France is", max_tokens=7)
    r = httpx.post(
        url,
        json={
            "model": model_id,
            "prompt": "the capital of France is",
            "raw": True,
            "stream": False,
            "options": GREEDY_OLLAMA | {"num_predict": 7},
        },
    ).json()
    assert r["response"] == raw.text
    assert httpx.post(url, json={"model": model_id}).json()["done_reason"] == "load"  # empty prompt: load only


def test_ollama_tags_show_version(server, model_id):
    tags = httpx.get(f"{server.url}/api/tags").json()["models"]
    assert [t["name"] for t in tags] == [f"{model_id}:latest"]
    assert tags[0]["details"]["format"] == "gguf" and tags[0]["details"]["quantization_level"] == "Q8_0"
    show = httpx.post(f"{server.url}/api/show", json={"model": model_id}).json()
    assert show["model_info"]["general.architecture"] == "llama" and "<|im_start|>" in show["template"]
    assert httpx.post(f"{server.url}/api/show", json={"model": "other"}).status_code == 404
    assert httpx.get(f"{server.url}/api/version").json()["version"]


# --- errors, in each dialect's shape ------------------------------------------------------------------


def openai_shape(body):
    return set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}


def anthropic_shape(body):
    return body["type"] == "error" and set(body["error"]) == {"type", "message"}


def ollama_shape(body):
    return set(body) == {"error"} and isinstance(body["error"], str)


DIALECTS = {
    "openai": ("/v1/chat/completions", openai_shape, lambda m: {"model": m, "messages": QUESTION}),
    "anthropic": ("/v1/messages", anthropic_shape, lambda m: {"model": m, "messages": QUESTION, "max_tokens": 4}),
    "ollama": ("/api/chat", ollama_shape, lambda m: {"model": m, "messages": QUESTION, "stream": False}),
}
LONG = " ".join(["the model"] * 300)  # ~600 tokens: more than the tiny model's 256


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize(
    "case, status, says",
    [
        ("malformed json", 400, "not valid JSON"),
        ("unknown model", 404, "not found"),
        ("wrong type", 400, "messages: input should be a valid list"),
        ("missing field", 400, "model: field required"),
        ("oversized body", 413, "limit"),
        ("prompt too long", 400, "longer than the context"),
        ("max_tokens past the context", 400, "context"),
        ("wrong method", 405, "Method Not Allowed"),
    ],
)
def test_errors(server, model_id, dialect, case, status, says):
    path, shape, valid = DIALECTS[dialect]
    body = valid(model_id)
    budget = {"openai": "max_tokens", "anthropic": "max_tokens", "ollama": "options"}[dialect]
    kwargs = {"json": body}
    if case == "malformed json":
        kwargs = {"content": b'{"model": ', "headers": {"content-type": "application/json"}}
    elif case == "unknown model":
        body["model"] = "gpt-9"
    elif case == "wrong type":
        body["messages"] = "hello"
    elif case == "missing field":
        del body["model"]
    elif case == "oversized body":
        body["messages"] = [{"role": "user", "content": "x" * (2 << 20)}]
    elif case == "prompt too long":
        body["messages"] = [{"role": "user", "content": LONG}]
    elif case == "max_tokens past the context":
        body[budget] = {"num_predict": 100000} if dialect == "ollama" else 100000
    method = "GET" if case == "wrong method" else "POST"
    r = httpx.request(method, f"{server.url}{path}", timeout=30, **({} if method == "GET" else kwargs))
    assert r.status_code == status, r.text
    assert shape(r.json()), r.json()
    assert says in r.text


def test_dialect_specific_errors(server, model_id):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": model_id, "messages": QUESTION, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model_id, "messages": QUESTION})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens: field required")
    r = httpx.post(f"{server.url}/v1/messages", json={"model": model_id, "messages": QUESTION, "max_tokens": "4"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model_id, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type"
    assert "should be 'text'" in r.json()["error"]["message"]  # only text parts
    for path, shape in [
        ("/v1/nothing", openai_shape),
        ("/v1/messages/nothing", anthropic_shape),
        ("/api/nothing", ollama_shape),
    ]:
        r = httpx.post(f"{server.url}{path}", json={})
        assert r.status_code == 404 and shape(r.json())


# --- operations -------------------------------------------------------------------------------------


def test_metrics(server, oai, model_id):
    before = server.metrics()
    oai.chat.completions.create(model=model_id, messages=QUESTION, temperature=0, max_tokens=3)
    httpx.post(f"{server.url}/v1/chat/completions", json={"model": "nope", "messages": QUESTION})
    m = server.metrics()

    def grew(name):
        return m.get(name, 0) - before.get(name, 0)

    assert grew('ingot_requests_total{endpoint="/v1/chat/completions",status="200"}') == 1
    assert grew('ingot_requests_total{endpoint="/v1/chat/completions",status="404"}') == 1
    assert grew("ingot_prompt_tokens_total") > 0 and grew("ingot_generated_tokens_total") > 0
    assert grew("ingot_time_to_first_token_seconds_count") == 1
    assert m["ingot_running_sequences"] == 0 and m["ingot_queue_depth"] == 0
    assert m["ingot_kv_cache_pages_used"] == 0 and m["ingot_kv_cache_pages_free"] > 0
    assert "ingot_decode_tokens_per_second" in m
