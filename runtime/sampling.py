"""Choosing the next token from logits, on the CPU. The GPU engine implements the same rules on the GPU.

The order is llama.cpp's default sampler chain: repetition penalty, then top-k, top-p and min-p (all on the
untempered distribution), then temperature, then one draw. Temperature 0 is greedy: the argmax after the
repetition penalty, ties going to the lowest token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ingot.runtime.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_k: int = 0  # 0 -> all tokens
    top_p: float = 1.0  # keep the smallest set of most likely tokens whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p * the most likely one
    repetition_penalty: float = 1.0
    repeat_last_n: int = 64  # the penalty covers the sequence's last n tokens, prompt included
    seed: int | None = None  # same seed, same prompt, same engine -> same output; None -> random

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition penalty must be > 0"),
            (self.repeat_last_n >= 0, "repeat_last_n must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise UsageError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def penalize_repeats(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """llama.cpp's repetition penalty: each distinct recent token's logit is divided by the penalty when
    positive, multiplied when negative (so it always becomes less likely for penalty > 1)."""
    if penalty == 1.0 or len(recent) == 0:
        return logits
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    x = out[ids]
    out[ids] = np.where(x > 0, x / penalty, x * penalty)
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def allowed_tokens(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool [n_vocab] from a bitmask row, np.uint32 [ceil(V/32)], bit t % 32 of word t // 32 for token t."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<u4").view(np.uint8), bitorder="little")
    return bits[:n_vocab].astype(bool)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent: Sequence[int],
    mask: np.ndarray | None = None,
) -> int:
    """logits [V] float32 -> token id. `recent` is the sequence so far (the penalty reads its tail); `mask`, a
    bitmask row of the tokens allowed (constrained decoding), takes the others out before every rule."""
    window = recent[-params.repeat_last_n :] if params.repeat_last_n else []
    logits = penalize_repeats(logits, window, params.repetition_penalty)
    if mask is not None:
        ok = allowed_tokens(mask, len(logits))
        if not ok.any():
            raise UsageError("the output constraint allows no token")
        logits = np.where(ok, logits, -np.inf)
    if params.greedy:
        return int(np.argmax(logits))

    ids = np.argsort(-logits, kind="stable")  # most likely first; ties: lower id first
    if mask is not None:
        ids = ids[: int(ok.sum())]  # the allowed tokens only, before top-k counts them
    if params.top_k:
        ids = ids[: params.top_k]
    x = logits[ids].astype(np.float64)
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(_softmax(x)), params.top_p)) + 1
        ids, x = ids[:keep], x[:keep]
    if params.min_p > 0.0:
        p = _softmax(x)
        keep = p >= params.min_p * p[0]
        ids, x = ids[keep], x[keep]
    p = _softmax(x / params.temperature)
    i = int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right"))
    return int(ids[min(i, len(ids) - 1)])
