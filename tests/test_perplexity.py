"""Perplexity as llama.cpp computes it: chunking, BOS, which tokens are scored, the formula, batching."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.errors import UsageError
from ingot.runtime.perplexity import perplexity, tokenize_for_perplexity

GPL3 = Path("/usr/share/common-licenses/GPL-3")


class PredictNextEngine:
    """Logits that put `boost` on (fed token + 1) % V and 0 elsewhere; records every call."""

    def __init__(self, n_vocab=10, boost=2.0, max_ctx=64):
        self.n_vocab, self.boost, self.max_ctx, self.max_seqs = n_vocab, boost, max_ctx, 1
        self.calls, self.live = [], set()

    def new_sequence(self, params):
        self.live.add(len(self.calls))
        return len(self.calls)

    def logits(self, seq, tokens):
        self.calls.append(list(tokens))
        out = np.zeros((len(tokens), self.n_vocab), np.float32)
        out[np.arange(len(tokens)), (np.asarray(tokens) + 1) % self.n_vocab] = self.boost
        return out

    def release(self, seq):
        self.live.discard(seq)


def test_uniform_logits_give_the_vocabulary_size():
    class Uniform(PredictNextEngine):
        def logits(self, seq, tokens):
            return np.zeros((len(tokens), 7), np.float32)

    r = perplexity(Uniform(), [i % 7 for i in range(100)], n_ctx=16)
    assert r.ppl == pytest.approx(7.0) and r.stderr == 0.0
    assert r.n_chunks == 6 and r.n_scored == 6 * (16 - 8 - 1)


def test_chunks_bos_batches_and_scored_tokens_follow_llama_cpp():
    V, L = 10, 2.0
    engine = PredictNextEngine(V, L)
    tokens = [i % V for i in range(44)]  # each token predicts the next: all "right" ...
    tokens[13] = 7  # ... except around two changed tokens
    tokens[30] = 7
    r = perplexity(engine, tokens, n_ctx=8, n_batch=3, bos_id=9)
    assert r.n_chunks == 44 // 8 and r.n_tokens == 44
    assert [len(c) for c in engine.calls[:3]] == [3, 3, 2]  # batches of -b, one chunk
    firsts = [engine.calls[i][0] for i in range(0, len(engine.calls), 3)]
    assert firsts == [9] * 5  # every chunk starts with BOS
    assert not engine.live  # every chunk's sequence was released
    # Scored: positions 4..6 of each chunk predict tokens 5..7 of the chunk.
    right, wrong = math.log(math.exp(L) + V - 1) - L, math.log(math.exp(L) + V - 1)
    nll = []
    for c in range(5):
        for p in range(4, 7):
            i = 8 * c + p
            fed = 9 if p == 0 else tokens[i]
            nll.append(right if tokens[i + 1] == (fed + 1) % V else wrong)
    assert nll.count(wrong) == 4  # tokens 13 and 30 spoil predicting themselves and the next one
    assert r.n_scored == 15 and r.ppl == pytest.approx(math.exp(np.mean(nll)))
    assert r.stderr == pytest.approx(r.ppl * np.std(nll) / math.sqrt(15 - 1))
    assert r.running[-1] == pytest.approx(r.ppl) and len(r.running) == 5
    assert r.llama_cpp_lines().splitlines()[-1] == f"Final estimate: PPL = {r.ppl:.4f} +/- {r.stderr:.5f}"


def test_max_chunks_scores_only_the_first_chunks():
    engine = PredictNextEngine()
    r = perplexity(engine, list(range(10)) * 10, n_ctx=8, max_chunks=2)
    assert r.n_chunks == 2 and len(engine.calls) == 2


def test_too_little_text_is_a_usage_error():
    with pytest.raises(UsageError, match="needs at least 32 tokens; the text has 31"):
        perplexity(PredictNextEngine(), list(range(31)), n_ctx=16)
    with pytest.raises(UsageError, match="between 4 and the engine's 64"):
        perplexity(PredictNextEngine(), list(range(1000)), n_ctx=128)


@pytest.mark.skipif(not GPL3.is_file(), reason="needs /usr/share/common-licenses/GPL-3")
def test_real_model_perplexity_does_not_depend_on_the_batch_size(real_model, real_tokenizer):
    tokens = tokenize_for_perplexity(real_tokenizer, GPL3.read_text())
    engine = CpuEngine(real_model, max_seqs=1, max_ctx=128)
    whole = perplexity(engine, tokens, n_ctx=128, max_chunks=2)
    batched = perplexity(engine, tokens, n_ctx=128, n_batch=48, max_chunks=2)
    assert batched.ppl == pytest.approx(whole.ppl, rel=1e-5)
    assert 5 < whole.ppl < 60  # a small English model on English legal text


@pytest.mark.slow
@pytest.mark.skipif(not GPL3.is_file(), reason="needs /usr/share/common-licenses/GPL-3")
def test_gpl3_perplexity_is_comparable_to_llama_cpp(ingot, real_model_path):
    # llama.cpp's llama-perplexity (CPU build of its b11434 sources, -c 512) on this model and text tokenizes it
    # to 7639 tokens and reports PPL = 18.3914 +/- 0.86455. llama.cpp rounds activations to 8 bits before its
    # quantized dot products and keeps the KV cache in F16; the float32 reference lands slightly lower.
    code, out, err = ingot("perplexity", real_model_path, "-f", GPL3, "-c", "512", "--device", "cpu", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["n_tokens"] == 7639 and r["n_chunks"] == 14 and r["n_scored"] == 14 * 255
    assert r["ppl"] == pytest.approx(18.3914, rel=0.01)
    assert r["stderr"] == pytest.approx(0.86455, rel=0.02)
