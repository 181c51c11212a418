"""The CPU sampler: greedy, top-k/top-p/min-p, temperature, repetition penalty, seeds."""

import numpy as np
import pytest

from ingot.runtime.errors import UsageError
from ingot.runtime.sampling import SamplingParams, penalize_repeats, sample


def _draws(logits, params, n=4000, seed=0, recent=()):
    rng = np.random.default_rng(seed)
    return np.bincount(
        [sample(np.asarray(logits, np.float32), params, rng, list(recent)) for _ in range(n)], minlength=len(logits)
    )


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    rng = np.random.default_rng(0)
    assert sample(np.array([0.1, 3.0, -1.0, 3.0], np.float32), SamplingParams(), rng, []) == 1
    assert sample(np.array([5.0, 5.0, 5.0], np.float32), SamplingParams(), rng, []) == 0


def test_temperature_one_samples_the_softmax():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    counts = _draws(logits, SamplingParams(temperature=1.0, seed=1), n=20000)
    np.testing.assert_allclose(counts / counts.sum(), [0.5, 0.3, 0.15, 0.05], atol=0.015)


def test_temperature_sharpens_and_flattens():
    logits = np.log([0.6, 0.4])
    cold = _draws(logits, SamplingParams(temperature=0.25))
    hot = _draws(logits, SamplingParams(temperature=4.0))
    # p ~ softmax(log p / T): 0.6^4 / (0.6^4 + 0.4^4) = 0.835; 0.6^.25 / (0.6^.25 + 0.4^.25) = 0.525
    assert cold[0] / cold.sum() == pytest.approx(0.835, abs=0.03)
    assert hot[0] / hot.sum() == pytest.approx(0.525, abs=0.03)


def test_top_k_top_p_min_p_cut_the_tail():
    logits = np.log([0.4, 0.3, 0.2, 0.06, 0.04])
    assert set(np.nonzero(_draws(logits, SamplingParams(temperature=1.0, top_k=2)))[0]) == {0, 1}
    # top-p 0.75: 0.4 + 0.3 < 0.75, so 0.2 is needed too; 0.06 and 0.04 are cut
    assert set(np.nonzero(_draws(logits, SamplingParams(temperature=1.0, top_p=0.75)))[0]) == {0, 1, 2}
    # min-p 0.45: keep p >= 0.18
    assert set(np.nonzero(_draws(logits, SamplingParams(temperature=1.0, min_p=0.45)))[0]) == {0, 1, 2}
    assert set(np.nonzero(_draws(logits, SamplingParams(temperature=1.0, top_p=0.01)))[0]) == {0}


def test_repetition_penalty_follows_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = penalize_repeats(logits, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(out, [1.0, -4.0, 1.0, 0.5])  # positive / penalty, negative * penalty, once
    rng = np.random.default_rng(0)
    greedy = SamplingParams(repetition_penalty=2.5, repeat_last_n=2)
    assert sample(logits, greedy, rng, [0]) == 2  # 2.0 / 2.5 = 0.8 < 1.0
    assert sample(logits, greedy, rng, [0, 3, 3]) == 0  # token 0 is outside the last 2


def test_same_seed_same_draws_different_seed_different_draws():
    logits = np.zeros(1000, np.float32)
    params = SamplingParams(temperature=1.0)
    rng1, rng2, rng3 = (np.random.default_rng(s) for s in (42, 42, 43))
    seq1 = [sample(logits, params, rng1, []) for _ in range(20)]
    seq2 = [sample(logits, params, rng2, []) for _ in range(20)]
    seq3 = [sample(logits, params, rng3, []) for _ in range(20)]
    assert seq1 == seq2 and seq1 != seq3


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(min_p=2),
        dict(top_k=-1),
        dict(repetition_penalty=0),
        dict(repeat_last_n=-1),
    ],
)
def test_bad_parameters_are_usage_errors(kw):
    with pytest.raises(UsageError):
        SamplingParams(**kw)
