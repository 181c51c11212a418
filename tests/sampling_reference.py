"""The exact next-token distribution a sampler must draw from, and a chi-square goodness-of-fit check against it.

Shared by the CPU sampler's tests (tests/test_sampling.py) and the GPU sampler's (tests/gpu/test_gpu_kernels.py).
Written from the rules, not from either implementation. The rules are llama.cpp's default sampler chain
(common/common.h: penalties -> top_k -> top_p -> min_p -> temperature -> dist), which runtime/sampling.py
documents as its order:
  1. repetition penalty on each distinct recent token (positive logit / penalty, negative * penalty);
  2. top-k: the k largest logits (ties cannot occur in the tests' logits);
  3. top-p: of those, the smallest most-likely-first prefix whose softmax (untempered, renormalized over the
     top-k survivors) sums to >= top_p;
  4. min-p: of those, the tokens whose probability is >= min_p times the top token's (a ratio, so the same for
     any renormalization);
  5. temperature: softmax(logit / T) over the survivors only.
So temperature never changes *which* tokens survive, only how the mass is spread over them. (Hugging Face's
generate() applies temperature first; Ingot follows llama.cpp, whose GGUF models it runs.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# chi2.ppf(0.999, df) for df = 1..30, computed from the regularized incomplete gamma function (they agree with
# published tables, e.g. 10.828 for df=1, 29.588 for df=10).
CHI2_999 = (
    10.828,
    13.816,
    16.266,
    18.467,
    20.515,
    22.458,
    24.322,
    26.124,
    27.877,
    29.588,
    31.264,
    32.909,
    34.528,
    36.123,
    37.697,
    39.252,
    40.790,
    42.312,
    43.820,
    45.315,
    46.797,
    48.268,
    49.728,
    51.179,
    52.620,
    54.052,
    55.476,
    56.892,
    58.301,
    59.703,
)
# Significance level 1e-3 per distribution checked: draws are seeded, so a test either always passes or always
# fails; alpha bounds the chance that a seed picked for a *correct* sampler lands in the rejection region (about
# 2% over the ~20 distributions a test file checks, decided once when the seed is chosen). Power: every sampler
# bug the tests target (a wrong survivor set, temperature applied before the filters or not at all) moves at least
# ~2% of the probability mass, which at 10,000 draws adds >= ~100 to the statistic (a token drawn that should be
# filtered out fails outright), far above the critical values of 10.8..30 for the few tokens involved.
ALPHA = 1e-3
MIN_EXPECTED = 5.0  # pool bins expecting fewer draws than this (the chi-square approximation needs ~5)


def filtered_distribution(
    logits: Sequence[float],
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    penalty: float = 1.0,
    recent: Sequence[int] = (),
) -> np.ndarray:
    """The probability of each token id under the rules above (float64, zeros for filtered-out tokens)."""
    assert temperature > 0, "temperature 0 is greedy: no distribution to test"
    x = penalized(logits, penalty, recent)
    alive = np.ones(len(x), dtype=bool)
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))  # most likely first
    if top_k:
        alive[:] = False
        alive[order[:top_k]] = True
    if top_p < 1.0:
        survivors = [i for i in order if alive[i]]
        p = np.exp(x[survivors] - x[survivors[0]])
        p /= p.sum()
        n = next(j + 1 for j, c in enumerate(np.cumsum(p)) if c >= top_p) if p.sum() >= top_p else len(p)
        alive[:] = False
        alive[survivors[:n]] = True
    if min_p > 0.0:
        top = x[alive].max()
        alive &= np.exp(x - top) >= min_p  # p_i / p_max, renormalization cancels
    q = np.where(alive, np.exp((x - x[alive].max()) / temperature), 0.0)
    return q / q.sum()


# The cases both sampler tests draw from. Two logit vectors with well-separated values:
FIVE = np.log([0.4, 0.3, 0.2, 0.06, 0.04])
TWELVE = np.log([0.22, 0.18, 0.14, 0.11, 0.09, 0.07, 0.06, 0.05, 0.04, 0.02, 0.015, 0.005]) + 3.0  # some > 0
# (logits, filters): each filter bites on its vector; the combined case has top-k, top-p and min-p each cut
FILTERS = [
    (FIVE, {}),
    (FIVE, dict(top_k=3)),
    (FIVE, dict(top_p=0.75)),  # untempered: {0, 1, 2}; at T=0.5 a tempered cut would keep {0, 1}
    (FIVE, dict(min_p=0.12)),  # keep p >= 0.048: {0, 1, 2, 3}
    (TWELVE, dict(top_p=0.5)),
    (TWELVE, dict(top_k=9, top_p=0.8, min_p=0.35)),  # top-k -> 9, top-p -> 6, min-p -> 5 tokens
    (TWELVE, dict(top_p=0.9, penalty=1.5, recent=[0, 11, 0])),  # a positive and a negative logit penalized
]
TEMPERATURES = (0.5, 1.0, 1.7)


def penalized(logits: Sequence[float], penalty: float = 1.0, recent: Sequence[int] = ()) -> np.ndarray:
    """Rule 1, in float64."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for t in set(int(r) for r in recent):
        x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
    return x


def top_p_margin(logits: Sequence[float], top_p: float, top_k: int = 0) -> float:
    """How far top_p is from the nearest cumulative sum of the (top-k) sorted softmax: the tests pick top_p well
    away from one, so float32 rounding on the GPU cannot move a token across the cut."""
    x = np.sort(np.asarray(logits, dtype=np.float64))[::-1]
    if top_k:
        x = x[:top_k]
    p = np.exp(x - x[0])
    return float(np.abs(np.cumsum(p / p.sum()) - top_p).min())


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, str]:
    """Pearson's statistic of observed counts against expected probabilities, its degrees of freedom, and a
    description. Bins expecting < MIN_EXPECTED draws are pooled into one bin (merged into the smallest kept bin
    if the pool itself is too small). A draw of a token with probability 0 is reported as an infinite statistic."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    n = counts.sum()
    impossible = counts[probs == 0].sum()
    if impossible:
        bad = np.nonzero((probs == 0) & (counts > 0))[0]
        return float("inf"), 0, f"{int(impossible)} draws of filtered-out tokens {bad[:10].tolist()}"
    exp = probs * n
    big = exp >= MIN_EXPECTED
    obs_bins, exp_bins = list(counts[big]), list(exp[big])
    if (~big & (probs > 0)).any():
        rest_o, rest_e = counts[~big].sum(), exp[~big].sum()
        if rest_e >= MIN_EXPECTED or not exp_bins:
            obs_bins.append(rest_o)
            exp_bins.append(rest_e)
        else:
            j = int(np.argmin(exp_bins))
            obs_bins[j] += rest_o
            exp_bins[j] += rest_e
    o, e = np.asarray(obs_bins), np.asarray(exp_bins)
    stat = float(((o - e) ** 2 / e).sum())
    worst = np.argsort(-((o - e) ** 2 / e))[:3]
    return (
        stat,
        len(o) - 1,
        "largest contributions (observed, expected): " + ", ".join(f"({o[i]:.0f}, {e[i]:.1f})" for i in worst),
    )


def assert_draws_match(counts: np.ndarray, probs: np.ndarray, label: str) -> None:
    """Fail (naming the case) when the counts reject the distribution at level ALPHA."""
    stat, df, detail = chi_square(counts, probs)
    if df == 0:  # one possible token: every draw must be it
        assert np.isfinite(stat), f"{label}: {detail}"
        return
    assert df <= len(CHI2_999), f"{label}: {df} degrees of freedom, past the table"
    crit = CHI2_999[df - 1]
    assert stat < crit, (
        f"{label}: chi-square {stat:.1f} >= {crit} (df {df}, alpha {ALPHA}) over {int(np.sum(counts))} draws; {detail}"
    )
