"""Constrained decoding on the GPU: cuda/sample.cu's allowed-token bitmask against the numpy reference
(runtime/sampling.py's `sample` with the same mask), and the engine path (prefill/decode masks, the decode
graph replayed with different masks) against the CPU engine. Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from ingot.runtime.sampling import SamplingParams, allowed_tokens, sample
from ingot.runtime.structured import mask_of


def _params(gpu, B, masks, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    """The sampler's per-row arrays as the engine lays them out; masks: a list of bitmask rows or None."""
    V32 = next(m.size for m in masks if m is not None)
    f = lambda v, dt: gpu.put(np.broadcast_to(np.asarray(v, dt), (B,)).copy()).ptr  # noqa: E731
    rows = np.stack([m if m is not None else np.zeros(V32, np.uint32) for m in masks])
    return {
        "temperature": f(temperature, np.float32),
        "top_k": f(top_k, np.int32),
        "top_p": f(top_p, np.float32),
        "min_p": f(min_p, np.float32),
        "penalty": f(1.0, np.float32),
        "hist": gpu.put(np.zeros((B, 1), np.int32)).ptr,
        "hist_len": f(0, np.int32),
        "hist_cap": 1,
        "seed": f(seed, np.uint64),
        "counter": f(np.arange(B), np.int32),
        "masked": gpu.put(np.array([m is not None for m in masks], np.int32)).ptr,
        "mask": gpu.put(rows).ptr,
        "mask_words": V32,
    }


def _sample(gpu, logits, masks, **kw):
    B, V = logits.shape
    out = gpu.empty(4 * B)
    gpu.run(gpu.k.sample(gpu.put(logits).ptr, V, V, B, _params(gpu, B, masks, **kw), out.ptr))
    return gpu.get(out, np.int32, (B,))


@pytest.mark.parametrize("V", [1000, 49152, 262144])  # 262,144: Gemma 3's vocabulary (logits not in smem)
def test_greedy_mask_allowing_one_token_picks_it(gpu, rng, V):
    logits = rng.standard_normal((3, V)).astype(np.float32)
    worst = [int(np.argmin(r)) for r in logits]  # the least likely token: only the mask can make it win
    masks = [mask_of([worst[0]], V), None, mask_of([worst[2], V - 1], V)]
    got = _sample(gpu, logits, masks)
    ref = [sample(r, SamplingParams(), np.random.default_rng(0), [], m) for r, m in zip(logits, masks, strict=True)]
    assert list(got) == ref
    assert got[0] == worst[0] and got[1] == int(np.argmax(logits[1]))  # row 1 unmasked, in the same launch


@pytest.mark.parametrize("V", [5000, 262144])
def test_sampling_draws_only_allowed_tokens_through_every_filter(gpu, rng, V):
    B = 64
    base = (rng.standard_normal(V) * 3).astype(np.float32)
    logits = np.tile(base, (B, 1))
    allowed = rng.random(V) < 0.05
    allowed[int(np.argmax(base))] = False  # the favourite is masked: the filters must not see it
    m = mask_of(np.nonzero(allowed)[0], V)
    assert np.array_equal(allowed_tokens(m, V), allowed)
    seeds = np.arange(B, dtype=np.uint64)
    for kw in (
        {"temperature": 1.0},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 0.7, "top_p": 0.5},
        {"temperature": 1.0, "min_p": 0.3},
    ):
        got = _sample(gpu, logits, [m] * B, seed=seeds, **kw)
        assert all(allowed[t] for t in got), kw
        if "top_k" in kw:  # top-k counts allowed tokens only: the 5 best of them
            best = np.argsort(-np.where(allowed, base, -np.inf), kind="stable")[:5]
            assert set(got) <= set(best.tolist()) and len(set(got)) > 1


def test_engine_masks_match_the_cpu_engine(gpu):
    """Greedy prefill and decode steps with masks (and a graph replayed with other masks) pick what the CPU
    engine picks with the same masks, on a synthetic model."""
    import tempfile
    from pathlib import Path

    from ingot.runtime.engines.cpu import CpuEngine
    from ingot.runtime.engines.cuda import CudaEngine
    from ingot.runtime.model.gguf import load_model
    from ingot.runtime.model.synth import synthesize

    with tempfile.TemporaryDirectory() as d:
        model = load_model(synthesize("tiny-k", "Q8_0", Path(d) / "t.gguf", seed=3))  # head_dim 64: a GPU shape
        V = model.config.n_vocab
        rng = np.random.default_rng(11)
        cpu, cuda = CpuEngine(model, max_seqs=2), CudaEngine(model, max_seqs=2, max_ctx=256)
        try:
            seqs = [(e.new_sequence(SamplingParams()), e.new_sequence(SamplingParams())) for e in (cpu, cuda)]
            prompt = [int(t) for t in rng.integers(3, V, 12)]
            one = mask_of([7, 300], V)
            firsts = [e.prefill(s[0], prompt, one) for e, s in zip((cpu, cuda), seqs, strict=True)]
            assert firsts[0] == firsts[1] and firsts[0] in (7, 300)
            for e, s in zip((cpu, cuda), seqs, strict=True):
                e.prefill(s[1], prompt)
            # Random weights: an unforced argmax may differ between the engines within rounding, so exact
            # agreement is asked only of forced tokens; both engines are fed the GPU's tokens to stay in step.
            last = [firsts[1], firsts[1]]
            for step in range(6):
                allowed = rng.random(V) < 0.1
                masks = [mask_of(np.nonzero(allowed)[0], V), None if step % 2 else mask_of([step + 40], V)]
                ref = cpu.decode(list(seqs[0]), last, masks)
                got = cuda.decode(list(seqs[1]), last, masks)
                assert allowed[got[0]] and allowed[ref[0]], step
                if step % 2 == 0:
                    assert got[1] == ref[1] == step + 40
                last = got
        finally:
            cuda.close()
