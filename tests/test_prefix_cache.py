"""The prefix cache in the CPU engine and through the scheduler: a prompt whose leading pages were computed before
adopts them and gives the same tokens and logits as computing them; pages are shared, counted once, released to
0, and reclaimed when the engine needs them; INGOT_PREFIX_CACHE=0 turns it off; many concurrent requests with
a shared system prompt and a disconnect leave no sequence and no page held.

Exactness. A cached page's rows were computed by another prefill, whose chunk may have had a different number
of rows than the one that would compute them now; numpy's BLAS may then sum in another order (a 1-row chunk
takes gemv, not gemm). So the bitwise test splits the uncached run at the same place as the cached one (what
is compared is then only "adopted rows" vs "computed rows"); the one-shot comparison allows a tolerance."""

from __future__ import annotations

import json

import numpy as np
import pytest
from prometheus_client import generate_latest
from test_server_scheduler import Spy, _run

from ingot.runtime.engines.cpu import KV_PAGE, CpuEngine
from ingot.runtime.generate import GenerationRequest, generate
from ingot.runtime.model.gguf import load_model
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server.metrics import Metrics
from ingot.runtime.server.scheduler import Stats

SHAPES = ["tiny", "tiny-gemma3"]  # plain Llama; and Gemma 3's sliding-window local layers, q/k norms
# sampling that reads every part of the state: the seeded rng, and the penalty's window over the prompt
PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.3, seed=11)]
DECODE = 12


@pytest.fixture(scope="module", params=SHAPES)
def model(request, synth_model):
    return load_model(synth_model(request.param, "Q8_0"))


def _ids(model, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, model.config.n_vocab, size=n)]


def _continue(engine, seq: int, first: int) -> tuple[list[int], np.ndarray]:
    """DECODE tokens after `first`, then the logits of one more position (fed the last token)."""
    out = [first]
    for _ in range(DECODE):
        out += engine.decode([seq], [out[-1]])
    return out, engine.logits(seq, [out[-1]])[-1]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("system_pages, user_tokens", [(2, 5), (3, 1), (1, 40)])
def test_adopted_pages_give_exactly_the_computed_logits(model, params, system_pages, user_tokens):
    system = _ids(model, system_pages * KV_PAGE, seed=1)
    first_user, user = _ids(model, 9, seed=2), _ids(model, user_tokens, seed=3)

    cached = CpuEngine(model, max_seqs=2, max_ctx=256, prefix_cache=True)
    donor = cached.new_sequence(SamplingParams())
    cached.prefill(donor, system)  # registers the system prompt's pages
    cached.prefill(donor, first_user)
    seq = cached.new_sequence(params)
    got_first = cached.prefill(seq, system + user)
    assert cached.prefix_stats()["hit_tokens"] == len(system)  # all of it: the user tokens are computed
    assert cached.kv_pages_used() == system_pages + 1 + -(-user_tokens // KV_PAGE)  # shared pages count once
    got = _continue(cached, seq, got_first)

    plain = CpuEngine(model, max_seqs=1, max_ctx=256, prefix_cache=False)
    ref_seq = plain.new_sequence(params)
    plain.logits(ref_seq, system)  # the same chunks as the donor computed (and no sample drawn from the rng)
    want = _continue(plain, ref_seq, plain.prefill(ref_seq, user))
    assert plain.prefix_stats()["hit_tokens"] == 0

    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


def test_a_cached_prefix_gives_the_tokens_of_a_one_shot_prefill(model):
    """Against prefilling the whole prompt at once (other chunk sizes: see the module docstring)."""
    system = _ids(model, 3 * KV_PAGE + 7, seed=4)  # the partial page after 3 full ones is computed again
    prompts = [system + _ids(model, n, seed=10 + n) for n in (1, 6, 33)]
    prompts.append(system[: 3 * KV_PAGE] + [7])  # a 1-token chunk after the hit
    cached = CpuEngine(model, max_seqs=4, max_ctx=256, prefix_cache=True)
    plain = CpuEngine(model, max_seqs=1, max_ctx=256, prefix_cache=False)
    for i, prompt in enumerate(prompts):
        seq = cached.new_sequence(SamplingParams())
        got = _continue(cached, seq, cached.prefill(seq, prompt))
        ref = plain.new_sequence(SamplingParams())
        want = _continue(plain, ref, plain.prefill(ref, prompt))
        plain.release(ref)
        assert got[0] == want[0], f"prompt {i}"
        # float32 with a different summation order: measured max |diff| 0 for multi-row chunks and ~1e-6 of the
        # logits' scale for a 1-row chunk; 1e-4 of the scale still catches any wrong row (those are O(1) off)
        scale = float(np.max(np.abs(want[1])))
        assert float(np.max(np.abs(got[1] - want[1]))) <= 1e-4 * scale, f"prompt {i}"
    stats = cached.prefix_stats()
    assert stats["hit_tokens"] == 3 * 3 * KV_PAGE and stats["queried_tokens"] == sum(map(len, prompts))


def test_a_next_chat_turn_hits_the_pages_of_the_last_answer(tiny_model):
    """Decoded tokens fill pages too: a second turn (first prompt + the answer + more) adopts them."""
    cached = CpuEngine(tiny_model, max_seqs=2, max_ctx=256, prefix_cache=True)
    prompt = _ids(tiny_model, 20, seed=30)
    s = cached.new_sequence(SamplingParams())
    answer = [cached.prefill(s, prompt)]
    for _ in range(50):
        answer += cached.decode([s], [answer[-1]])
    cached.release(s)  # its cache held prompt + answer[:-1]: 70 tokens, 2 full pages
    second = prompt + answer + _ids(tiny_model, 9, seed=31)
    s = cached.new_sequence(SamplingParams())
    got = _continue(cached, s, cached.prefill(s, second))
    assert cached.prefix_stats()["hit_tokens"] == 2 * KV_PAGE
    plain = CpuEngine(tiny_model, max_seqs=1, max_ctx=256, prefix_cache=False)
    ref = plain.new_sequence(SamplingParams())
    want = _continue(plain, ref, plain.prefill(ref, second))
    assert got[0] == want[0]
    # decoded rows were computed one at a time (gemv), the reference's in one chunk: see the module docstring
    assert float(np.max(np.abs(got[1] - want[1]))) <= 1e-4 * float(np.max(np.abs(want[1])))


def test_shared_pages_are_counted_once_released_and_reclaimed(tiny_model):
    engine = CpuEngine(tiny_model, max_seqs=2, max_ctx=128, prefix_cache=True)  # 2 x 4 pages of 32
    prompt = _ids(tiny_model, 2 * KV_PAGE + 3, seed=5)
    a, b = engine.new_sequence(SamplingParams()), engine.new_sequence(SamplingParams())
    engine.prefill(a, prompt)
    engine.prefill(b, prompt)
    assert engine.kv_pages_used() == 2 + 1 + 1  # 2 shared full pages, a private last page each
    engine.release(a)
    assert engine.kv_pages_used() == 3
    engine.release(b)
    stats = engine.prefix_stats()
    assert engine.kv_pages_used() == 0 and stats["pages_evictable"] == 2 and stats["pages_cached"] == 2
    assert engine.memory_report()["kv_pages_free"] == engine.kv_pages_total  # evictable pages are free
    # two full-context sequences need every page: the cached ones are reclaimed and their rows dropped
    seqs = [engine.new_sequence(SamplingParams()) for _ in range(2)]
    for i, s in enumerate(seqs):
        engine.prefill(s, _ids(tiny_model, 128, seed=20 + i))
    stats = engine.prefix_stats()
    assert stats["pages_evicted"] == 2 and engine.kv_pages_used() == engine.kv_pages_total
    assert len(engine._page_rows) == stats["pages_cached"] <= engine.kv_pages_total
    for s in seqs:
        engine.release(s)
    assert engine.kv_pages_used() == 0


def test_the_setting_turns_it_off(tiny_model, monkeypatch):
    prompt = _ids(tiny_model, 100, seed=6)
    monkeypatch.setenv("INGOT_PREFIX_CACHE", "0")
    engine = CpuEngine(tiny_model, max_seqs=2, max_ctx=128)
    for _ in range(2):
        s = engine.new_sequence(SamplingParams())
        engine.prefill(s, prompt)
        engine.release(s)
    assert engine.prefix_stats() | {"pages_cached": 0} == {
        "enabled": False,
        "queried_tokens": 0,
        "hit_tokens": 0,
        "hit_rate": 0.0,
        "pages_cached": 0,
        "pages_evictable": 0,
        "pages_evicted": 0,
    }
    monkeypatch.setenv("INGOT_PREFIX_CACHE", "1")
    assert CpuEngine(tiny_model, max_seqs=1, max_ctx=64).prefix_stats()["enabled"]


SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up. " * 2


def test_concurrent_requests_with_a_shared_system_prompt_leave_nothing_held(tiny_model, tiny_tokenizer):
    """12 requests through the scheduler (4 at a time), one of them cancelled mid-stream: the others get the text
    of an engine without the cache, the shared pages were hit, and no sequence or page is left held."""
    prompts = [
        "the capital of France",
        "hello world",
        "one two three four",
        "what is the name of the city",
        "water",
        "the people of the country",
    ]
    requests = [
        GenerationRequest(tuple(tiny_tokenizer.encode(SYSTEM + prompts[i % len(prompts)])), SamplingParams(), 12)
        for i in range(12)
    ]
    shared = requests[0].prompt_tokens[: 2 * KV_PAGE]
    assert all(r.prompt_tokens[: 2 * KV_PAGE] == shared for r in requests)  # 2 full pages of system prompt
    spy = Spy(CpuEngine(tiny_model, max_seqs=4, prefix_cache=True))
    results, _ = _run(spy, tiny_tokenizer, requests, abort_after=(0, 1))  # the core's step loop; 0 aborted

    plain = CpuEngine(tiny_model, max_seqs=1, prefix_cache=False)
    alone = [
        "".join(c.text for c in generate(plain, tiny_tokenizer, r.prompt_tokens, r.params, r.max_tokens))
        for r in requests[1:]
    ]
    assert results[0] == "aborted"
    assert results[1:] == alone
    stats = spy.engine.prefix_stats()
    assert stats["hit_tokens"] >= 11 * 2 * KV_PAGE  # every request after the first adopted the system pages
    assert spy.live == 0 and spy.engine.kv_pages_used() == 0


def test_a_prompt_prefilled_in_chunks_adopts_every_cached_page(tiny_model, tiny_tokenizer):
    """A prompt again, prefilled in chunks of two pages (the scheduler's budget): every full page is adopted,
    those at the end of the chunks before the last included (a chunk that samples nothing need not compute its
    last token): 6 pages of a 200-token prompt hit, only the 8 tokens past them computed, the same text."""
    prompt = tuple(int(t) for t in np.random.default_rng(5).integers(2, tiny_model.config.n_vocab, size=200))
    requests = [GenerationRequest(prompt, SamplingParams(), 4)]
    spy = Spy(CpuEngine(tiny_model, max_seqs=1, prefix_cache=True))
    first, _ = _run(spy, tiny_tokenizer, requests, prefill_chunk=2 * KV_PAGE)
    assert spy.prefills == [64, 64, 64, 8]  # chunks end on page boundaries
    assert spy.engine.prefix_stats()["hit_tokens"] == 0
    again, _ = _run(spy, tiny_tokenizer, requests, prefill_chunk=2 * KV_PAGE)
    assert again == first
    assert spy.engine.prefix_stats()["hit_tokens"] == 6 * KV_PAGE  # 192: the old rule adopted 96 here


def test_metrics_export_the_hit_rate_and_saved_tokens():
    text = generate_latest(Metrics(lambda: Stats(prefix_queried_tokens=400, prefix_hit_tokens=300)).registry).decode()
    assert "ingot_prefix_cache_queried_tokens 400.0" in text
    assert "ingot_prefix_cache_saved_prefill_tokens 300.0" in text
    assert "ingot_prefix_cache_hit_rate 0.75" in text
    assert "ingot_prefix_cache_hit_rate 0.0" in generate_latest(Metrics(Stats).registry).decode()


def test_bench_times_a_prompt_with_a_shared_prefix(ingot, tiny_model_path):
    code, out, err = ingot(
        "bench",
        tiny_model_path,
        "-p",
        80,
        "--prefix",
        64,
        "-n",
        0,
        "-r",
        2,
        "--no-cold-start",
        "--device",
        "cpu",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert [r["test"] for r in report["results"]] == ["pp80", "pp80@prefix64"]
    assert report["prefix_cache"]["hit_tokens"] == 2 * 64  # each timed repetition; the warm-up computed it
    code, _, err = ingot("bench", tiny_model_path, "-p", 64, "--prefix", 64, "--device", "cpu")
    assert code == 2 and "--prefix 64 leaves no prompt tokens" in err
