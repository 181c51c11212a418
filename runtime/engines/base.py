"""The interface every engine implements: the CPU reference (engines/cpu.py) and the GPU engine (engines/cuda.py).

An engine holds a model and the KV state of up to `max_seqs` sequences of up to `max_ctx` tokens each. It
knows nothing about text: tokens in, sampled tokens (or logits) out. Sampling happens inside the engine,
from the SamplingParams the sequence was created with (see runtime/sampling.py for the rules).

KV capacity is counted in pages of `kv_page_size` tokens by every engine (the GPU engine's cache is paged;
the CPU engine keeps a whole-context cache per sequence and counts it in pages of the same size), so the
server's admission control treats both alike. Both keep a prefix cache over those pages (kvcache.py): a
prefill whose leading full pages were computed before adopts them instead of computing them again.

Prefill of several sequences at once (`prefill_many`): the server's step prefills the chunks of every sequence
it admits together, so that the weights are read once for all of them (the GPU engine runs them as one pass
of up to PREFILL_CHUNK tokens, attention per sequence). A chunk that is not its prompt's last (`PrefillChunk.last`
False) samples nothing, and the prefix cache may adopt all of its full pages: only a prompt's last token must
be computed (its logits sample the next token). `decode_and_prefill` is a step of both at once.

A step may also be launched and collected apart (`launch`, then `collect`), so that the server's step loop
plans and launches step n+1 while the GPU still computes step n, and reads step n's tokens afterwards (as vLLM's
async scheduling does): the host's work between two steps then hides behind the GPU's. Step n+1 cannot know the
tokens step n samples, so a decode token may be FROM_DEVICE, "the token this sequence's last step sampled": the
GPU engine copies it on the device from that step's output into the next step's input. At most two launched
steps are uncollected at once, and they are collected in launch order. `decode_and_prefill` is
`collect(launch(...))`.

Constrained decoding (runtime/structured.py) reaches an engine as token masks: a bitmask row, np.uint32
[ceil(V/32)] with bit t % 32 of word t // 32 set when token t may be sampled, for the token prefill samples
and for each sequence of a decode step (None: unconstrained). Masked tokens are out before every sampling
rule (the repetition penalty, top-k/top-p/min-p, the argmax), as llama.cpp applies its grammar sampler first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ingot.runtime.model.gguf import Config
from ingot.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens to append to one sequence in a prefill_many call."""

    seq: int
    tokens: Sequence[int]
    last: bool = True  # the prompt's last chunk: its last token's logits sample the sequence's next token
    mask: np.ndarray | None = None  # the allowed tokens of that sample (constrained decoding); last chunks only


FROM_DEVICE = -1  # a decode token: the one the sequence's last step sampled, which may not be on the host yet


class Engine(Protocol):
    name: str  # "cpu" or "cuda"
    config: Config
    max_seqs: int  # sequences that can be alive at once
    max_ctx: int  # tokens per sequence (KV capacity)
    kv_page_size: int  # tokens per KV page
    kv_pages_total: int  # pages the engine can hold at once, all sequences together

    def new_sequence(self, params: SamplingParams) -> int:
        """Allocate KV state; returns the sequence id."""

    def prefill(self, seq: int, tokens: Sequence[int], mask: np.ndarray | None = None) -> int:
        """Append tokens; return the next sampled token (one `mask` allows, when given)."""

    def prefill_many(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        """Append each chunk to its sequence (distinct sequences); return, per chunk, the next sampled token of a
        last chunk (None for the others). Every chunk is checked before any is computed: a bad one raises
        UsageError and none of them is appended."""

    def decode(
        self, seqs: Sequence[int], tokens: Sequence[int], masks: Sequence[np.ndarray | None] | None = None
    ) -> list[int]:
        """One step: feed tokens[i] to seqs[i]; return the next sampled token of each (masks[i] allows it)."""

    def decode_and_prefill(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None]]:
        """decode(seqs, tokens, masks) and prefill_many(chunks) (other sequences) in one call: the server's step.
        The GPU engine runs the prefill beside the decode step and waits once. The chunks are checked before
        any work, as in prefill_many."""

    def launch(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> Any:
        """decode_and_prefill queued, not waited for: returns the handle collect() takes. A decode token may be
        FROM_DEVICE (the module's docstring); a sequence with a repetition penalty needs its token on the host
        (its penalty window) and is refused one (UsageError). A row's mask is the caller's, computed from the
        tokens it knows: a caller whose masks depend on the last token collects that step first. Checked whole
        before any work, as decode_and_prefill."""

    def collect(self, launched: Any) -> tuple[list[int], list[int | None]]:
        """Wait for a launched step (the oldest uncollected one) and return what decode_and_prefill returns."""

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

    def warm(self) -> None:
        """Prepare now what the first steps would otherwise prepare on the way (a server calls it once loaded):
        the GPU engine captures its decode graph for every batch size; the CPU engine has nothing to do."""

    def close(self) -> None:
        """Free everything the engine holds (device memory, contexts). Safe to call twice."""


def pages_for(n_tokens: int, page_size: int) -> int:
    return (n_tokens + page_size - 1) // page_size
