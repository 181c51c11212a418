"""The interface every engine implements: the CPU reference (engines/cpu.py) and the GPU engine (engines/cuda.py).

An engine holds a model and the KV state of up to `max_seqs` sequences of up to `max_ctx` tokens each. It
knows nothing about text: tokens in, sampled tokens (or logits) out. Sampling happens inside the engine,
from the SamplingParams the sequence was created with (see runtime/sampling.py for the rules).

KV capacity is counted in pages of `kv_page_size` tokens by every engine (the GPU engine's cache is paged;
the CPU engine keeps a whole-context cache per sequence and counts it in pages of the same size), so the
server's admission control treats both alike. Both keep a prefix cache over those pages (kvcache.py): a
prefill whose leading full pages were computed before adopts them instead of computing them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ingot.runtime.model.gguf import Config
from ingot.runtime.sampling import SamplingParams


class Engine(Protocol):
    name: str  # "cpu" or "cuda"
    config: Config
    max_seqs: int  # sequences that can be alive at once
    max_ctx: int  # tokens per sequence (KV capacity)
    kv_page_size: int  # tokens per KV page
    kv_pages_total: int  # pages the engine can hold at once, all sequences together

    def new_sequence(self, params: SamplingParams) -> int:
        """Allocate KV state; returns the sequence id."""

    def prefill(self, seq: int, tokens: Sequence[int]) -> int:
        """Append tokens; return the next sampled token."""

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> list[int]:
        """One step: feed tokens[i] to seqs[i]; return the next sampled token of each."""

    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Append tokens; return float32 logits [len(tokens), n_vocab], one row per position."""

    def release(self, seq: int) -> None:
        """Free the sequence's KV state."""

    def seq_len(self, seq: int) -> int:
        """Tokens in the sequence so far."""

    def kv_pages_used(self) -> int:
        """KV pages held by live sequences now (a shared page once; cached pages no sequence holds are free)."""

    def prefix_stats(self) -> dict[str, Any]:
        """The prefix cache: {"enabled", "queried_tokens", "hit_tokens", "hit_rate", "pages_cached",
        "pages_evictable", "pages_evicted"} (kvcache.PagePool.prefix_stats)."""

    def memory_report(self) -> dict[str, Any]:
        """Where the engine's memory is: {"device", "weights_bytes", "engine_bytes", "kv_pages", ...}; the GPU
        engine adds the device's "free" and "total" bytes and its "compute_capability" (90 for 9.0)."""

    def close(self) -> None:
        """Free everything the engine holds (device memory, contexts). Safe to call twice."""


def pages_for(n_tokens: int, page_size: int) -> int:
    return (n_tokens + page_size - 1) // page_size
