"""Generation, independent of the engine: prompt tokens in, a stream of text chunks out.

The engine samples tokens (runtime/engines/base.py); this module turns them into text:
  - incremental detokenization that never emits half a UTF-8 character (a character split over byte tokens
    is held until its last byte arrives),
  - stop strings, never echoed, also when split across tokens (text that could still become a stop string
    is held back until it cannot),
  - finishing on an end-of-generation token ("eos": EOS, <|im_end|>, <|eot_id|>, ...), a stop string
    ("stop"), or max_tokens / a full context ("length").

`Generation` does this for one sequence, token by token, so a server can drive many sequences through one
engine.decode call; `generate` drives a single request from prefill to the end.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ingot.runtime.engines.base import Engine
from ingot.runtime.errors import UsageError
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.sampling import SamplingParams

__all__ = ["Chunk", "Generation", "GenerationRequest", "SamplingParams", "generate"]


@dataclass(frozen=True)
class GenerationRequest:
    prompt_tokens: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 256
    stop: tuple[str, ...] = ()

    def check(self, max_ctx: int) -> None:
        """UsageError, before any work, for a request that cannot run."""
        if not self.prompt_tokens:
            raise UsageError("the prompt is empty")
        if len(self.prompt_tokens) > max_ctx:
            raise UsageError(
                f"the prompt is {len(self.prompt_tokens)} tokens, longer than the context of {max_ctx}",
                hint="shorten the prompt",
            )
        if self.max_tokens < 1:
            raise UsageError("max tokens must be at least 1")


@dataclass(frozen=True)
class Chunk:
    text: str  # new text since the previous chunk (may be empty while text is held back)
    token_ids: tuple[int, ...]  # the generated token(s) this chunk accounts for; none for the final EOS
    finish_reason: str | None = None  # on the last chunk: "eos", "stop" or "length"


class IncrementalDecoder:
    """Decodes a growing token list into text deltas: each token's bytes (Tokenizer.token_bytes) through an
    incremental UTF-8 decoder, which holds the first bytes of a character split over byte tokens until its last
    one arrives (and gives U+FFFD for bytes that can never form one, as decode() does). What decode() of the
    whole list would say, at a dictionary lookup per token instead of two decodes of a window; a generated text
    never starts a decode, so a SentencePiece decoder's stripping of a text's first space never applies (the
    first generated word keeps its leading space)."""

    def __init__(self, tokenizer: Tokenizer):
        self._spelled = tokenizer.token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self._spelled[token] if 0 <= token < len(self._spelled) else b"")

    def flush(self) -> str:
        """Whatever is still held (at the end of generation): an unfinished character as U+FFFD."""
        return self._utf8.decode(b"", final=True)


class StopStrings:
    """Cuts the text at the first stop string and holds back any tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found)."""
        if not self.stops:  # most requests: nothing to hold back
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generation:
    """The output side of one sequence: feed it each sampled token, get a Chunk back."""

    def __init__(self, tokenizer: Tokenizer, request: GenerationRequest):
        self.request = request
        self.eog_ids = tokenizer.eog_ids
        self.decoder = IncrementalDecoder(tokenizer)
        self.stops = StopStrings(request.stop)
        self.n_generated = 0
        self.finish_reason: str | None = None

    @property
    def ended_by(self) -> str:
        """The finish reason ("eos", "stop" or "length") of a generation that has ended."""
        if self.finish_reason is None:
            raise RuntimeError("the generation has not ended yet")
        return self.finish_reason

    def accept(self, token: int, *, context_full: bool = False) -> Chunk:
        """context_full: the sequence cannot take another token, so this one is the last."""
        if token in self.eog_ids:
            return self._finish("eos", (), "")
        self.n_generated += 1
        text, stopped = self.stops.push(self.decoder.push(token))
        if stopped:
            return self._finish("stop", (token,), text, flush=False)
        if self.n_generated >= self.request.max_tokens or context_full:
            return self._finish("length", (token,), text)
        return Chunk(text, (token,))

    def _finish(self, reason: str, tokens: tuple[int, ...], text: str, flush: bool = True) -> Chunk:
        if flush:
            tail, stopped = self.stops.push(self.decoder.flush())
            text += tail if stopped else tail + self.stops.flush()
            reason = "stop" if stopped else reason
        self.finish_reason = reason
        return Chunk(text, tokens, reason)


def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt_tokens: Sequence[int],
    params: SamplingParams | None = None,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
) -> Iterator[Chunk]:
    """Run one request to its end, yielding a Chunk per generated token; the last has a finish_reason."""
    request = GenerationRequest(
        tuple(int(t) for t in prompt_tokens), params or SamplingParams(), max_tokens, tuple(stop)
    )
    request.check(engine.max_ctx)
    generation = Generation(tokenizer, request)
    seq = engine.new_sequence(request.params)
    try:
        token = engine.prefill(seq, request.prompt_tokens)
        while True:
            chunk = generation.accept(token, context_full=engine.seq_len(seq) >= engine.max_ctx)
            yield chunk
            if chunk.finish_reason:
                return
            token = engine.decode([seq], [token])[0]
    finally:
        engine.release(seq)
