"""Perplexity, computed exactly as llama.cpp's `llama-perplexity` computes it (tools/perplexity/perplexity.cpp,
`perplexity()`), so numbers compare across tools:

  - the whole text is tokenized once, with BOS in front only if the model's add_bos flag says so, and
    control-token text is not parsed (common_tokenize(ctx, text, add_special=true, parse_special=false));
  - it is cut into n_chunk = n_tokens // n_ctx chunks of n_ctx tokens (the tail is dropped; at least 2 chunks'
    worth of tokens are required); each chunk runs from an empty cache, its first token replaced by BOS when
    add_bos;
  - only the second half of each chunk is scored: with first = n_ctx // 2, the logits at positions
    first .. n_ctx-2 predict tokens first+1 .. n_ctx-1, so n_ctx - first - 1 tokens per chunk;
  - nll = max_logit + log(sum(exp(logit - max_logit))) - logit[token], summed in float64; after each chunk the
    running PPL exp(mean nll) is reported ("[1]x,[2]y,..."), and at the end PPL +/- its standard error
    ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from ingot.runtime.engines.base import Engine
from ingot.runtime.errors import UsageError
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    stderr: float
    n_tokens: int  # tokens in the whole text
    n_ctx: int
    n_chunks: int
    n_scored: int  # tokens whose prediction was scored
    running: tuple[float, ...]  # PPL after each chunk

    def as_dict(self) -> dict:
        return asdict(self)

    def llama_cpp_lines(self) -> str:
        """The two lines llama-perplexity prints: the running values, then the final estimate."""
        return (
            "".join(f"[{i + 1}]{p:.4f}," for i, p in enumerate(self.running))
            + f"\nFinal estimate: PPL = {self.ppl:.4f} +/- {self.stderr:.5f}"
        )


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits [n, V] float32, targets [n] -> negative log-likelihood [n] float64 (llama.cpp's log_softmax)."""
    m = logits.max(axis=1, keepdims=True)
    sum_exp = np.exp(logits - m).sum(axis=1, dtype=np.float64)
    picked = np.take_along_axis(logits, targets[:, None], axis=1)[:, 0]
    return m[:, 0].astype(np.float64) + np.log(sum_exp) - picked.astype(np.float64)


def tokenize_for_perplexity(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=True, parse_special=False)


def perplexity(
    engine: Engine,
    tokens: list[int],
    *,
    n_ctx: int = 512,
    n_batch: int | None = None,
    max_chunks: int | None = None,
    bos_id: int | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """tokens: the tokenized text; n_batch: tokens per engine call (llama.cpp's -b; the result does not depend
    on it); max_chunks: score only the first chunks (llama.cpp's --chunks); bos_id: put BOS in front of each
    chunk (when the model's add_bos is set). on_chunk(done, total, running_ppl) is called after each chunk."""
    if n_ctx < 4 or n_ctx > engine.max_ctx:
        raise UsageError(f"context {n_ctx} must be between 4 and the engine's {engine.max_ctx}")
    if len(tokens) < 2 * n_ctx:
        raise UsageError(
            f"perplexity with a context of {n_ctx} needs at least {2 * n_ctx} tokens; the text has {len(tokens)}",
            hint="use a longer text or a smaller -c",
        )
    if (n_batch is not None and n_batch < 1) or (max_chunks is not None and max_chunks < 1):
        raise UsageError("batch size and chunk count must be at least 1")
    n_batch = min(n_batch or n_ctx, n_ctx)
    n_chunks = len(tokens) // n_ctx if max_chunks is None else min(max_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            chunk[0] = bos_id
        seq = engine.new_sequence(SamplingParams())
        try:
            logits = np.concatenate([engine.logits(seq, chunk[b : b + n_batch]) for b in range(0, n_ctx, n_batch)])
        finally:
            engine.release(seq)
        # Targets come from the original token list: only the chunk's first token was swapped for BOS.
        targets = np.asarray(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx], dtype=np.int64)
        v = token_nll(logits[first : n_ctx - 1], targets)
        nll += float(v.sum())
        nll2 += float(np.square(v).sum())
        count += len(v)
        running.append(math.exp(nll / count))
        if on_chunk:
            on_chunk(i + 1, n_chunks, running[-1])
    mean, mean2 = nll / count, nll2 / count
    ppl = math.exp(mean)
    var = mean2 - mean * mean
    stderr = ppl * math.sqrt(var / (count - 1)) if var > 0 else 0.0
    return PerplexityResult(ppl, stderr, len(tokens), n_ctx, n_chunks, count, tuple(running))
