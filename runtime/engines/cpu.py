"""The CPU reference engine: runs model.forward in numpy, one KV cache per sequence, samples with sampling.py.

KV pages are booked in a PagePool like the GPU engine's (runtime/engines/kvcache.py), over page-sized chunks of
each sequence's arrays, so admission and the prefix cache behave alike on both: a registered page's rows are
copied out once, and a prefill that hits it copies them into the new sequence instead of computing them.

It is the oracle the GPU engine is tested against, so it favours clarity over speed; prefill still multiplies
whole chunks of tokens at once so float32 BLAS does the work (perplexity runs hundreds of 512-token chunks).
Weights are dequantized to float32 once and kept when the whole model fits the cache budget (4 GiB, or
INGOT_CPU_WEIGHT_CACHE_MIB); a bigger model (an 8B) is dequantized matrix by matrix on every use instead.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ingot.runtime import settings
from ingot.runtime.engines.base import FROM_DEVICE, PrefillChunk, pages_for
from ingot.runtime.engines.kvcache import PagePool, PrefixChain
from ingot.runtime.errors import IngotError, UsageError
from ingot.runtime.model.gguf import Model, expected_shapes
from ingot.runtime.model.reference import KVCache, forward, logits
from ingot.runtime.sampling import SamplingParams, sample

DEFAULT_MAX_CTX = 8192  # KV capacity per sequence unless asked otherwise (capped by the training context)
PREFILL_CHUNK = 512  # tokens per forward call: bounds the attention scores to chunk x context
KV_PAGE = 32  # tokens per KV page, as the GPU engine counts them (admission control)


def weight_cache_budget() -> int:
    """Bytes of float32 weights the CPU engine may keep dequantized."""
    return int(settings.CPU_WEIGHT_CACHE_MIB.get()) * 2**20


class DequantizedWeights:
    """float32 weights by tensor name, for model.forward: cached when the model fits `budget` bytes as float32,
    dequantized on each use otherwise. Embedding lookups dequantize only the rows asked for."""

    def __init__(self, model: Model, budget: int):
        self.tensors = model.tensors
        f32_bytes = sum(4 * math.prod(shape) for shape in expected_shapes(model.config).values())
        self.keep_all = f32_bytes <= budget
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        w = self._cache.get(name)
        if w is None:
            w = self.tensors[name].dequantize()
            if self.keep_all or w.ndim == 1:  # vectors (norms, biases) are tiny: always keep them
                self._cache[name] = w
        return w

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        cached = self._cache.get("token_embd.weight")
        return cached[tokens] if cached is not None else self.tensors["token_embd.weight"].dequantize_rows(tokens)

    @property
    def nbytes(self) -> int:
        """float32 bytes held in the cache now."""
        return sum(w.nbytes for w in self._cache.values())


@dataclass
class _Sequence:
    params: SamplingParams
    seed: int  # the request's seed, or a random one: each draw comes from (seed, position), see _sample
    cache: KVCache
    tokens: list[int]
    pages: list[int] = field(default_factory=list)  # page ids booked in the engine's PagePool
    chain: PrefixChain = field(default_factory=PrefixChain)
    last: int | None = None  # the token it sampled last (what a FROM_DEVICE decode token means)


class CpuEngine:
    name = "cpu"
    kv_page_size = KV_PAGE

    def __init__(
        self,
        model: Model,
        *,
        max_seqs: int = 4,
        max_ctx: int | None = None,
        weight_cache_bytes: int | None = None,
        prefix_cache: bool | None = None,
    ):
        self.model = model
        self.config = model.config
        self.max_seqs = max_seqs
        self.max_ctx = max_ctx or min(model.config.n_ctx_train, DEFAULT_MAX_CTX)
        c = self.config
        kv_bytes = 2 * c.n_layers * self.max_ctx * c.n_kv_heads * c.head_dim * 4  # a sequence's KVCache, fp32 k and v
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if kv_bytes > ram:  # (np.zeros maps it lazily, but the mapping itself fails past what the host can commit)
            raise UsageError(
                f"a {self.max_ctx:,}-token context needs {kv_bytes / 2**30:,.1f} GiB of KV cache a sequence on the "
                f"CPU, more than this machine's {ram / 2**30:,.1f} GiB",
                hint="ask for fewer tokens of context",
            )
        budget = weight_cache_budget() if weight_cache_bytes is None else weight_cache_bytes
        self.weights = DequantizedWeights(model, budget)
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.kv_pages_total = max_seqs * pages_for(self.max_ctx, KV_PAGE)
        use_cache = settings.PREFIX_CACHE.get() if prefix_cache is None else prefix_cache
        self.pages = PagePool(self.kv_pages_total, KV_PAGE, prefix_cache=use_cache, on_evict=self._drop_page)
        # registered page -> its (k, v) rows, each [n_layers, KV_PAGE, KV, hd]; at most kv_pages_total of them
        self._page_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # --- the Engine interface ---

    def new_sequence(self, params: SamplingParams) -> int:
        if len(self._seqs) >= self.max_seqs:
            raise IngotError(f"all {self.max_seqs} sequences are in use", hint="release one first")
        seq, self._next_id = self._next_id, self._next_id + 1
        seed = (params.seed if params.seed is not None else secrets.randbits(64)) % 2**64
        self._seqs[seq] = _Sequence(params, seed, KVCache.empty(self.config, self.max_ctx), [])
        return seq

    def prefill(self, seq: int, tokens: Sequence[int], mask: np.ndarray | None = None) -> int:
        token = self.prefill_many([PrefillChunk(seq, tokens, True, mask)])[0]
        assert token is not None  # a last chunk samples
        return token

    def prefill_many(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        """One sequence after the other (the reference needs no batching): the same results as the GPU engine's
        single pass."""
        states = self._check_step([], [], chunks)  # every chunk checked before any is computed
        out: list[int | None] = []
        for c, s in zip(chunks, states, strict=True):
            rest = c.tokens[self._adopt(s, c.tokens, sample=c.last) :]  # a last chunk computes its last token
            hidden = None
            for i in range(0, len(rest), PREFILL_CHUNK):
                hidden = self._forward(s, rest[i : i + PREFILL_CHUNK])
            if c.last:
                assert hidden is not None
                out.append(self._sample(s, logits(self.config, self.weights, hidden[-1:])[0], c.mask))
            else:
                out.append(None)
        return out

    def decode(
        self, seqs: Sequence[int], tokens: Sequence[int], masks: Sequence[np.ndarray | None] | None = None
    ) -> list[int]:
        if len(seqs) != len(tokens):
            raise UsageError(f"decode got {len(seqs)} sequences but {len(tokens)} tokens")
        batch = [self._admit(seq, [tok]) for seq, tok in zip(seqs, tokens, strict=False)]
        for s in batch:
            self.pages.grow(s.pages, s.cache.n + 1)
        hidden = forward(self.config, self.weights, [(s.cache, [tok]) for s, tok in zip(batch, tokens, strict=False)])
        for s, tok in zip(batch, tokens, strict=False):
            s.tokens.append(int(tok))
            self._register(s, [tok])
        rows = logits(self.config, self.weights, hidden)  # [B, V]
        masks = masks if masks is not None else [None] * len(batch)
        return [self._sample(s, row, m) for s, row, m in zip(batch, rows, masks, strict=True)]

    def decode_and_prefill(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None]]:
        return self.collect(self.launch(seqs, tokens, masks, chunks))

    def launch(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None]]:
        """The step, computed now (the reference has nothing to overlap): the handle is its result. A
        FROM_DEVICE token is the sequence's last sampled one."""
        fed = [self._get(q).last if t == FROM_DEVICE else t for q, t in zip(seqs, tokens, strict=False)]
        if None in fed:
            raise UsageError("a decode token is FROM_DEVICE for a sequence that has sampled none")
        tokens = [t for t in fed if t is not None]
        self._check_step(seqs, tokens, chunks)  # the whole step checked before any work
        return self.decode(seqs, tokens, masks) if seqs else [], self.prefill_many(chunks) if chunks else []

    def collect(self, launched: tuple[list[int], list[int | None]]) -> tuple[list[int], list[int | None]]:
        return launched

    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        s = self._admit(seq, tokens)
        return np.concatenate(
            [
                logits(self.config, self.weights, self._forward(s, tokens[i : i + PREFILL_CHUNK]))
                for i in range(0, len(tokens), PREFILL_CHUNK)
            ]
        )

    def release(self, seq: int) -> None:
        s = self._seqs.pop(seq, None)
        if s is not None:
            self.pages.release(s.pages)

    def seq_len(self, seq: int) -> int:
        return self._get(seq).cache.n

    def kv_pages_used(self) -> int:
        return self.pages.used

    def prefix_stats(self) -> dict:
        return self.pages.prefix_stats()

    def memory_report(self) -> dict:
        return {
            "device": "cpu",
            "weights_bytes": self.weights.nbytes,
            "engine_bytes": self.weights.nbytes,
            "kv_pages": self.kv_pages_total,
            "kv_pages_free": self.pages.free,
        }

    def warm(self) -> None:
        """Nothing to prepare: every step runs as it comes."""

    def close(self) -> None:
        for seq in list(self._seqs):
            self.release(seq)
        self._page_rows.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- helpers ---

    def _get(self, seq: int) -> _Sequence:
        s = self._seqs.get(seq)
        if s is None:
            raise UsageError(f"no live sequence {seq}")
        return s

    def _admit(self, seq: int, tokens: Sequence[int]) -> _Sequence:
        """The sequence, after checking the tokens are valid ids and fit its KV capacity (before any work)."""
        s = self._get(seq)
        if len(tokens) == 0:
            raise UsageError("no tokens to evaluate")
        if s.cache.n + len(tokens) > self.max_ctx:
            raise UsageError(
                f"{s.cache.n + len(tokens)} tokens do not fit the context of {self.max_ctx}",
                hint="shorten the prompt or ask for a larger context",
            )
        ids = np.asarray(tokens)
        if ids.min() < 0 or ids.max() >= self.config.n_vocab:
            raise UsageError(f"token id out of range 0..{self.config.n_vocab - 1}")
        return s

    def _check_step(
        self, seqs: Sequence[int], tokens: Sequence[int], chunks: Sequence[PrefillChunk]
    ) -> list[_Sequence]:
        """The chunks' sequences, after checking a whole step before any work, so that a refused step changed
        nothing: each sequence in one chunk or decoded (not both), every chunk and decode token admissible
        (_admit), and KV pages for all of it (counted as if nothing were adopted)."""
        if len({c.seq for c in chunks} | set(seqs)) != len(chunks) + len(seqs):
            raise UsageError("a step names a sequence twice (two chunks, or a chunk and a decode)")
        states = [self._admit(c.seq, c.tokens) for c in chunks]
        decoded = [self._admit(q, [t]) for q, t in zip(seqs, tokens, strict=False)]
        added = [(s, len(c.tokens)) for s, c in zip(states, chunks, strict=True)] + [(s, 1) for s in decoded]
        self.pages.require(sum(self.pages.needed(s.pages, s.cache.n + n) for s, n in added))
        return states

    def _forward(self, s: _Sequence, tokens: Sequence[int]) -> np.ndarray:
        self.pages.grow(s.pages, s.cache.n + len(tokens))
        hidden = forward(self.config, self.weights, [(s.cache, tokens)])
        s.tokens.extend(int(t) for t in tokens)
        self._register(s, tokens)
        return hidden

    # --- the prefix cache (kvcache.py keeps the books; these move the rows) ---

    def _adopt(self, s: _Sequence, tokens: Sequence[int], *, sample: bool) -> int:
        """Copy the rows of the cached pages that match the prompt's leading full pages into the sequence's
        cache; returns how many tokens that covers (the prefill computes the rest; see PagePool.adopt)."""
        first = len(s.pages)
        n = self.pages.adopt(s.pages, s.chain, tokens, sample=sample)
        for j in range(first, len(s.pages)):
            k, v = self._page_rows[s.pages[j]]
            s.cache.k[:, j * KV_PAGE : (j + 1) * KV_PAGE] = k
            s.cache.v[:, j * KV_PAGE : (j + 1) * KV_PAGE] = v
        s.cache.n += n
        s.tokens.extend(int(t) for t in tokens[:n])
        return n

    def _register(self, s: _Sequence, tokens: Sequence[int]) -> None:
        """Book tokens just written to the cache; keep a copy of each page they filled that is now cached."""
        for j, page in self.pages.append(s.pages, s.chain, tokens):
            rows = slice(j * KV_PAGE, (j + 1) * KV_PAGE)
            self._page_rows[page] = (s.cache.k[:, rows].copy(), s.cache.v[:, rows].copy())

    def _drop_page(self, page: int) -> None:
        del self._page_rows[page]

    def _sample(self, s: _Sequence, row: np.ndarray, mask: np.ndarray | None = None) -> int:
        """The token after s.tokens. Its random draw depends on the seed and the position only (counter-based, as
        the GPU sampler's seed + counter): a sequence prefilled in chunks, whose earlier chunks' samples are
        discarded by the scheduler, draws the same as one prefilled at once."""
        rng = np.random.default_rng((s.seed, len(s.tokens)))
        s.last = sample(row, s.params, rng, s.tokens, mask)
        return s.last
