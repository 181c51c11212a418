"""Constrained decoding below the server: the serializable Constraint, token bytes from GGUF vocabularies,
llguidance matchers (mask, advance, done), the CPU sampler and engine honouring masks, and the tool-call
formats (detection from a template, the forced-call grammar, parsing calls back out of text)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.errors import UsageError
from ingot.runtime.model.chat import chat_prompt
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.templates import CHATML_TEMPLATE, HERMES_TEMPLATE, LLAMA31_TEMPLATE
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.model.toolcalls import ToolCall, call_grammar, parse_calls, tool_format
from ingot.runtime.sampling import SamplingParams, allowed_tokens, sample
from ingot.runtime.structured import Constraint, Grammars, check, end_token, grammar_tokens, json_schema, mask_of

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"enum": ["yes", "no"]}},
    "required": ["n", "s"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]},
    },
}


@pytest.fixture(scope="module")
def tiny(synth_model):
    model = load_model(synth_model("tiny", "Q8_0", "hermes"))
    return model, Tokenizer.from_model(model)


def test_constraint_is_a_serializable_spec():
    c = json_schema(SCHEMA)
    assert Constraint.from_json(c.to_json()) == c and pickle.loads(pickle.dumps(c)) == c
    assert json.loads(c.text) == SCHEMA
    with pytest.raises(UsageError):
        Constraint("xml")
    assert check(c) is None and check(Constraint("json")) is None
    assert check(Constraint("lark", "start: (")) and check(json_schema({"type": "frobnicate"}))


def test_grammar_tokens_spell_what_the_tokenizer_decodes(tiny, real_tokenizer):
    for tok in (tiny[1], real_tokenizer):
        tb = grammar_tokens(tok)
        ids = tok.encode('Hello, wörld {"a": 1}\n\ttabs', add_special=False)
        assert b"".join(tb[i] for i in ids).decode() == tok.decode(ids)
        assert tb[tok.vocab.bos_id] == b"\xff" + tok.vocab.tokens[tok.vocab.bos_id].encode()  # never text


def test_matcher_walks_a_schema_instance_and_then_allows_only_the_end(tiny):
    model, tok = tiny
    V = model.config.n_vocab
    g = Grammars(tok, V)
    m = g.matcher(json_schema(SCHEMA))
    text = '{"n":42,"s":"no"}'
    for t in tok.encode(text, add_special=False):
        mask = m.mask()
        assert mask.dtype == np.uint32 and mask.shape == ((V + 31) // 32,)
        assert allowed_tokens(mask, V)[t], tok.decode([t])
        m.advance(t)
    assert np.flatnonzero(allowed_tokens(m.mask(), V)).tolist() == [end_token(tok)] and m.done
    bad = g.matcher(json_schema(SCHEMA))
    assert not allowed_tokens(bad.mask(), V)[tok.encode("x", add_special=False)[0]]
    with pytest.raises(RuntimeError, match="not allowed"):
        bad.advance(tok.encode("x", add_special=False)[0])


def test_cpu_sampler_masks_before_every_rule():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(300).astype(np.float32)
    allowed = [int(np.argmin(logits)), 5]
    m = mask_of(allowed, 300)
    assert sample(logits, SamplingParams(), rng, [], m) in allowed
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.01)):
        best = max(allowed, key=lambda t: logits[t])  # top-k/top-p keep the best *allowed* token
        assert all(sample(logits, p, rng, [], m) == best for _ in range(10))
    assert all(sample(logits, SamplingParams(temperature=1.0), rng, [], m) in allowed for _ in range(50))
    with pytest.raises(UsageError):
        sample(logits, SamplingParams(), rng, [], np.zeros(10, np.uint32))


def test_cpu_engine_generates_a_schema_instance_from_random_weights(tiny):
    model, tok = tiny
    g = Grammars(tok, model.config.n_vocab)
    engine = CpuEngine(model, max_seqs=1)
    m = g.matcher(json_schema(SCHEMA))
    seq = engine.new_sequence(SamplingParams(temperature=1.0, seed=3))
    t = engine.prefill(seq, chat_prompt(tok, [{"role": "user", "content": "hi"}]), m.mask())
    out = []
    while t != end_token(tok):
        m.advance(t)
        out.append(t)
        t = engine.decode([seq], [t], [m.mask()])[0]
    value = json.loads(tok.decode(out))
    assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and value["s"] in ("yes", "no")


def test_tool_formats_from_templates():
    assert tool_format(HERMES_TEMPLATE) == "hermes" and tool_format(LLAMA31_TEMPLATE) == "llama3.1"
    assert tool_format(CHATML_TEMPLATE) is None and tool_format(None) is None
    assert tool_format("{{ messages }} <tool_call>") is None  # never renders tools


def test_tool_calls_parse_from_text():
    text = 'sure\n<tool_call>\n{"name": "f", "arguments": {"x": true}}\n</tool_call>\n'
    text += '<tool_call>{"name": "g", "arguments": "{}"}'  # unclosed at the end; arguments as a JSON string
    assert parse_calls(text, "hermes") == ("sure", [ToolCall("f", {"x": True}), ToolCall("g", {})])
    assert parse_calls("<tool_call>{broken</tool_call>", "hermes")[1] == []
    assert parse_calls('<|python_tag|>{"name": "f", "parameters": {"x": false}}', "llama3.1") == (
        "",
        [ToolCall("f", {"x": False})],
    )
    assert parse_calls("plain words", "llama3.1") == ("plain words", [])


@pytest.mark.parametrize("fmt", ["hermes", "llama3.1"])
def test_forced_call_grammar_admits_a_call_and_nothing_else(tiny, fmt):
    model, tok = tiny
    g = Grammars(tok, model.config.n_vocab)
    key = "arguments" if fmt == "hermes" else "parameters"
    call = json.dumps({"name": "f", key: {"x": True}}, separators=(",", ":"))
    text = f"<tool_call>\n{call}\n</tool_call>" if fmt == "hermes" else call
    m = g.matcher(Constraint("lark", call_grammar(fmt, [TOOL])))
    for t in tok.encode(text, add_special=False):
        assert allowed_tokens(m.mask(), model.config.n_vocab)[t]
        m.advance(t)
    assert m.done and parse_calls(text, fmt)[1] == [ToolCall("f", {"x": True})]
    m = g.matcher(Constraint("lark", call_grammar(fmt, [TOOL])))
    assert not allowed_tokens(m.mask(), model.config.n_vocab)[tok.encode("Hi", add_special=False)[0]]


def test_templates_render_tools_calls_and_results(tiny):
    _, tok = tiny
    conversation = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": True}}}]},
        {"role": "tool", "content": "done"},
    ]
    text = tok.decode(chat_prompt(tok, conversation, [TOOL]))
    assert '"name": "f"' in text and "<tools>" in text and "<tool_response>\ndone\n</tool_response>" in text
    assert '<tool_call>\n{"name": "f", "arguments": {"x": true}}\n</tool_call>' in text


def test_synth_writes_the_chosen_template(tmp_path):
    import subprocess
    import sys

    from ingot.runtime.model.synth import synthesize

    out = tmp_path / "l.gguf"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ingot",
            "model",
            "synth",
            "--shape",
            "tiny",
            "--quant",
            "Q8_0",
            "--template",
            "llama3.1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert load_model(out).vocab.chat_template == LLAMA31_TEMPLATE
    with pytest.raises(UsageError, match="unknown chat template"):
        synthesize("tiny", "Q8_0", tmp_path / "x.gguf", template="mistral")
