"""The interface every engine implements: the CPU reference (engines/cpu.py) and the GPU engine (engines/cuda.py).

An engine holds a model and the KV state of up to `max_seqs` sequences of up to `max_ctx` tokens each. It
knows nothing about text: tokens in, sampled tokens (or logits) out. Sampling happens inside the engine,
from the SamplingParams the sequence was created with (see runtime/sampling.py for the rules).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from ..model import Config
from ..sampling import SamplingParams


class Engine(Protocol):
    config: Config
    max_seqs: int                # sequences that can be alive at once
    max_ctx: int                 # tokens per sequence (KV capacity)

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
