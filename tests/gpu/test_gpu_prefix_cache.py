"""The prefix cache on the GPU engine: adopted pages (shared through the block tables) give bitwise the tokens and
logits of computing them, and a shared 1,000-token system prompt is prefilled once: the hit rate and the
prefill time saved are printed (run with -s to see them; the lead quotes the H200 numbers).

    . tests/gpu/device_env.sh && python3 -m pytest tests/gpu/test_gpu_prefix_cache.py -q -s

Models: the small random ones of tiny_models.py, SmolLM2-135M's shape with random weights (speed does not depend
on the weights), and every GGUF named in INGOT_TEST_MODELS.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_models import VARIANTS, write_model

from ingot.runtime import settings
from ingot.runtime.engines.cuda import PAGE, CudaEngine
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.synth import synthesize
from ingot.runtime.sampling import SamplingParams

DECODE = 16


def _ids(model, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, model.config.n_vocab, size=n)]


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory) -> Path:
    return synthesize("smollm2-135m", "Q4_0", tmp_path_factory.mktemp("m") / "smollm2-shape.gguf", seed=0)


def _model_path(request, tmp_path_factory) -> Path:
    kind, what = request.param
    if kind == "tiny":
        return write_model(tmp_path_factory.mktemp("m") / f"{what}.gguf", what)
    return request.getfixturevalue("smollm2_shape") if kind == "smollm2" else Path(what)


# what the timing runs on: real shapes only
TIMED = [pytest.param(("smollm2", ""), id="smollm2-shape")] + [
    pytest.param(("file", p), id=Path(p).stem) for p in filter(None, (settings.TEST_MODELS.get() or "").split(":"))
]
MODELS = [pytest.param(("tiny", v), id=v) for v in VARIANTS] + TIMED


def _engine(request, tmp_path_factory):
    eng = CudaEngine(load_model(_model_path(request, tmp_path_factory)), max_seqs=4, max_ctx=2048)
    yield eng
    eng.close()


@pytest.fixture(scope="module", params=MODELS)
def engine(request, tmp_path_factory):
    yield from _engine(request, tmp_path_factory)


def _generate(eng: CudaEngine, seq: int, first: int) -> tuple[list[int], np.ndarray]:
    out = [first]
    for _ in range(DECODE):
        out += eng.decode([seq], [out[-1]])
    return out, eng.logits(seq, [out[-1]])[-1]


@pytest.mark.parametrize("system_pages, user_tokens", [(2, 5), (16, 1), (40, 77)])
def test_adopted_pages_give_exactly_the_computed_tokens_and_logits(engine, system_pages, user_tokens):
    """The cached run against the same engine with the cache off, prefilling in the same two pieces (so every
    launch has the same shape: prefill does not split K, so its results do not depend on the run)."""
    model = engine.model
    system = _ids(model, system_pages * PAGE, seed=system_pages)
    user = _ids(model, user_tokens, seed=1000 + user_tokens)
    params = SamplingParams(temperature=0.8, top_k=50, repetition_penalty=1.2, seed=5)
    hits0 = engine.prefix_stats()["hit_tokens"]
    try:
        engine.pages.prefix_cache = True
        donor = engine.new_sequence(SamplingParams())
        engine.prefill(donor, system)
        seq = engine.new_sequence(params)
        first = engine.prefill(seq, system + user)
        assert engine.prefix_stats()["hit_tokens"] - hits0 == len(system)
        shared = engine._seqs[seq].pages[:system_pages]
        assert shared == engine._seqs[donor].pages[:system_pages]  # the same page ids in both block tables
        got = _generate(engine, seq, first)
        engine.release(donor)
        engine.release(seq)

        engine.pages.prefix_cache = False  # the same engine, computing everything
        ref = engine.new_sequence(params)
        engine.prefill(ref, system)  # GPU sampling is counter-based: this draw does not shift later ones
        want = _generate(engine, ref, engine.prefill(ref, user))
        engine.release(ref)
    finally:
        engine.pages.prefix_cache = True
    assert got[0] == want[0]
    diff = float(np.max(np.abs(got[1] - want[1])))
    assert np.array_equal(got[1], want[1]), f"max |diff| {diff:.3g}"
    assert engine.kv_pages_used() == 0


def test_a_cached_prefix_gives_the_greedy_tokens_of_a_one_shot_prefill(engine):
    model = engine.model
    system = _ids(model, 300, seed=7)
    outs = []
    for cache in (False, True, True):  # computed; computed and registered; adopted
        engine.pages.prefix_cache = cache
        s = engine.new_sequence(SamplingParams())
        outs.append(_generate(engine, s, engine.prefill(s, system + _ids(model, 20, seed=8))))
        engine.release(s)
    engine.pages.prefix_cache = True
    assert outs[1][0] == outs[0][0]
    # a chunk that starts at the cached prefix's end has another shape: fp16 tile sums may round differently
    # (the GPU-vs-CPU tests allow 1e-2; a wrong row would be off by O(1))
    for out in outs[1:]:
        rel = float(np.linalg.norm(out[1] - outs[0][1]) / np.linalg.norm(outs[0][1]))
        assert rel < 1e-3, rel
    assert outs[2][0] == outs[0][0]


SYSTEM_TOKENS = 1000
QUESTION_TOKENS = 24
REQUESTS = 8


def _prefill_ms(engine: CudaEngine, prompt: list[int]) -> float:
    s = engine.new_sequence(SamplingParams())
    t0 = time.perf_counter()
    engine.prefill(s, prompt)  # returns once the sampled token is on the host
    dt = time.perf_counter() - t0
    engine.release(s)
    return 1000 * dt


@pytest.fixture(scope="module", params=TIMED)
def timed_engine(request, tmp_path_factory):
    yield from _engine(request, tmp_path_factory)


def test_shared_system_prompt_hit_rate_and_saved_prefill_time(timed_engine):
    """REQUESTS prompts of one 1,000-token system prompt and different 24-token questions, prefilled one after
    another: with the cache off every one computes 1,024 tokens; with it on the first does, and the others
    adopt the system prompt's 31 full pages and compute 32 tokens."""
    engine, model = timed_engine, timed_engine.model
    system = _ids(model, SYSTEM_TOKENS, seed=1)
    prompts = [system + _ids(model, QUESTION_TOKENS, seed=100 + i) for i in range(REQUESTS)]
    hit_per_request = (SYSTEM_TOKENS // PAGE) * PAGE  # the page the question starts in is computed
    engine.pages.prefix_cache = False
    for shape in (_ids(model, len(prompts[0]), seed=9), _ids(model, len(prompts[0]) - hit_per_request, seed=9)):
        _prefill_ms(engine, shape)  # build the launch plans of both chunk shapes outside the timing
    try:
        cold = [_prefill_ms(engine, p) for p in prompts]
        engine.pages.prefix_cache = True
        before = engine.prefix_stats()
        warm = [_prefill_ms(engine, p) for p in prompts]
        after = engine.prefix_stats()
    finally:
        engine.pages.prefix_cache = True
    hits = after["hit_tokens"] - before["hit_tokens"]
    queried = after["queried_tokens"] - before["queried_tokens"]
    assert hits == (REQUESTS - 1) * hit_per_request and queried == REQUESTS * len(prompts[0])
    cold_ms = statistics.median(cold)
    warm_ms = statistics.median(warm[1:])  # the first computes the system prompt
    print(
        f"\nprefix cache on {engine.dev.info.name}, {model.name}: {REQUESTS} requests of a {SYSTEM_TOKENS}-token "
        f"system prompt + {QUESTION_TOKENS}-token question: hit rate {hits / queried:.1%} ({hits} of {queried} "
        f"prompt tokens); prefill {cold_ms:.2f} ms uncached -> {warm_ms:.2f} ms cached (median), saved "
        f"{cold_ms - warm_ms:.2f} ms per request ({1 - warm_ms / cold_ms:.0%}), "
        f"{sum(cold) - sum(warm):.1f} ms over all {REQUESTS}"
    )
    assert warm_ms < cold_ms  # 32 tokens computed instead of 1,024
    assert engine.kv_pages_used() == 0
