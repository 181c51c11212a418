"""Continuous batching with chunked prefill: the step loop that owns the engine, inside the engine core process.

Each `step()`, one engine step (engine.launch, read back by engine.collect; see "Steps overlap" below):
    a decode of every sequence whose prompt is in (their last tokens)
    and prompt tokens, at most `prefill_chunk` of them (INGOT_PREFILL_CHUNK), for the sequences still being
        prefilled, oldest first, admitting waiting requests in arrival order while a sequence slot (max_seqs)
        and their KV pages are free; a prompt longer than what is left of the budget is prefilled in chunks
        (ending on KV page boundaries where the budget allows: the next chunk's prefill can then adopt
        prefix-cached pages) over several steps (the engine appends at the sequence's position, so
        consecutive chunks are one prompt; only a prompt's last chunk samples). The step's chunks of several
        prompts are one prefill pass over the weights, run on the GPU beside the decode, with one wait.
    -> a protocol.Step: each sequence's new token ids, which ones ended (eos, length) or failed, the stats.
So a 4,000-token prompt costs every running stream at most one chunk's prefill time per token, never the
whole prompt's. The loop knows no text: stop strings are the front end's, which Aborts a sequence whose text
matched one. Nothing here blocks or does I/O; core.py feeds it messages and sends its steps.

Steps overlap (INGOT_ASYNC_STEPS, default on): step() plans and launches step n+1, then reads step n's tokens
(engine.launch / engine.collect), so the host's work between two steps hides behind the GPU's. The books are
one step behind: a sequence whose token step n samples is fed FROM_DEVICE in step n+1 (the engine copies it on
the device), and if that token ends it (end of generation), step n+1's token for it is dropped. A sequence that
step n's token ends by length is left out of step n+1. What needs the last token on the host (a grammar's mask,
the repetition penalty's window) makes step() read step n first.

KV admission reserves a request's worst case, pages for min(prompt + max_tokens, context) tokens, so a
running sequence can always grow to its end. The GPU engine has a page pool (runtime/engines/kvcache.py); the CPU
engine keeps a whole-context cache per sequence, which is counted here in pages of the same size.

Structured output (runtime/structured.py): `Add.constraint` (a Constraint's JSON) is kept on the sequence; the
grammar tokenizer (`Grammars`) is built once, at the first constrained request, and each constrained sequence
gets a `Matcher` when its prompt's last chunk is prefilled. That prefill and every decode step that holds a
constrained sequence pass token masks to the engine (`mask=`/`masks=`; a step with no constrained sequence
computes none), and each accepted token advances its sequence's matcher. A complete grammar allows only EOS,
which ends the sequence as usual.

Both engines draw by (seed, position), so a seeded request's text is the same however its prompt was split and
whichever prompts it was prefilled with.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ingot.runtime import settings
from ingot.runtime.engines.base import FROM_DEVICE, Engine, PrefillChunk, pages_for
from ingot.runtime.errors import UsageError
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.server.protocol import Add, Output, Stats, Step
from ingot.runtime.structured import Constraint, Grammars, Matcher

SHUTDOWN_STATUS, SHUTDOWN_MESSAGE = 503, "the server is shutting down"
Masks = list[np.ndarray | None] | None  # a decode batch's allowed-token masks, a row each (None: unconstrained)


@dataclass
class _Seq:
    """One request inside the core."""

    req: Add
    kv_pages: int = 0  # pages reserved while it runs
    seq: int | None = None  # the engine's sequence id, once admitted
    prefilled: int = 0  # prompt tokens fed so far
    last_token: int = 0
    n_generated: int = 0
    eog: frozenset[int] = frozenset()
    constraint: bytes | None = None  # Add.constraint: a Constraint's JSON (see the docstring)
    matcher: Matcher | None = None  # built when its prompt's last chunk is prefilled
    ctx_room: int = 0  # context minus the prompt: more generated tokens than this fill the context
    in_flight: int = 0  # launched steps that sample a token for it, not read yet (0 or 1)

    @property
    def live_seq(self) -> int:
        """The engine's sequence id of an admitted request."""
        if self.seq is None:
            raise RuntimeError("the request has no sequence yet")
        return self.seq

    @property
    def decoding(self) -> bool:
        return self.seq is not None and self.prefilled == len(self.req.prompt)

    @property
    def alive(self) -> bool:
        return self.seq is not None

    def ends_by_length(self, generated: int) -> bool:
        """Whether `generated` tokens end it by length: max_tokens, or a full context (the engine holds the prompt
        and every generated token but the last: prompt + generated - 1 tokens, which fill the context once
        generated > ctx_room, and the last token has no room to be fed)."""
        return generated >= self.req.max_tokens or generated > self.ctx_room

    def ends_in_flight(self) -> bool:
        """Whether the token in flight ends it by length: then it is not decoded again."""
        return self.in_flight > 0 and self.ends_by_length(self.n_generated + self.in_flight)

    @property
    def needs_token(self) -> bool:
        """Its next step needs its last token on the host: a grammar's mask, or the repetition penalty's window."""
        return self.matcher is not None or self.req.params.repetition_penalty != 1.0


@dataclass
class _Launched:
    """A step launched and not read yet."""

    handle: object  # the engine's (Engine.launch)
    batch: list[_Seq]
    chunks: list[tuple[_Seq, PrefillChunk]]


@dataclass
class _Outputs:
    """What one step produced, by request id (a sequence gets at most one entry per step)."""

    by_id: dict[int, Output] = field(default_factory=dict)

    def token(self, rid: int, token: int) -> None:
        """add(rid, token), without add's defaults: once per generated token, so it builds no Output it
        drops (setdefault would)."""
        out = self.by_id.get(rid)
        if out is None:
            self.by_id[rid] = Output(rid, [token])
        else:
            out.tokens.append(token)

    def add(self, rid: int, token: int | None = None, finish: str | None = None, status: int = 0, msg: str = ""):
        out = self.by_id.setdefault(rid, Output(rid, []))
        if token is not None:
            out.tokens.append(token)
        if finish is not None:
            out.finish, out.status, out.message = finish, status, msg


class Scheduler:
    def __init__(self, engine: Engine, prefill_chunk: int, tokenizer: Tokenizer | None = None):
        self.engine = engine
        self.tokenizer = tokenizer  # for constrained requests' grammars (None: they fail)
        self._grammars: Grammars | None = None  # built at the first constrained request
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admitted: being prefilled (in arrival order) or decoding
        self._by_id: dict[int, _Seq] = {}
        self._reserved = 0  # KV pages reserved by running sequences
        self._kv_total = engine.kv_pages_total
        self.async_steps = settings.ASYNC_STEPS.get()
        self._flight: _Launched | None = None  # the step launched last, while it is not read

    # --- messages ----------------------------------------------------------------------------------

    def add(self, req: Add) -> None:
        room = self.engine.max_ctx - len(req.prompt)
        s = _Seq(req, eog=frozenset(req.eog_ids), constraint=req.constraint, ctx_room=room)
        self._by_id[req.id] = s
        self._waiting.append(s)

    def abort(self, ids: list[int]) -> None:
        """Release these requests' sequences now; nothing more is reported for them."""
        for rid in ids:
            s = self._by_id.pop(rid, None)
            if s is None:  # it ended already
                continue
            if s in self._waiting:
                self._waiting.remove(s)
            else:
                self._release(s)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._flight)

    def end_all(self, status: int = SHUTDOWN_STATUS, message: str = SHUTDOWN_MESSAGE) -> Step:
        """Fail every queued and running request (shutdown) and report it (with what the step in flight
        finished)."""
        outputs = _Outputs()
        if self._flight is not None:
            self._collect(outputs)
        for s in list(self._waiting) + list(self._running):
            self._end(s, outputs, "error", status, message)
        self._waiting.clear()
        return self._report(outputs, [], 0, 0.0, 0)

    def report(self) -> Step:
        """A step message with no work in it: the stats now (after an Abort emptied the core)."""
        return self._report(_Outputs(), [], 0, 0.0, 0)

    # --- the step ----------------------------------------------------------------------------------

    def step(self) -> Step:
        """Launch the next step, then read the one in flight (or, with INGOT_ASYNC_STEPS=0, this one): the
        Step reports the tokens read."""
        outputs = _Outputs()
        if self._flight is not None and any(s.in_flight and s.needs_token for s in self._running):
            self._collect(outputs)
        decoding = [s for s in self._running if s.decoding and not s.ends_in_flight()]
        batch, masks = self._masks(decoding, outputs)
        started: list[tuple[int, int]] = []
        plan, prefilled = self._plan_prefill(outputs, started)
        chunks = self._chunks(plan, outputs)
        t0 = time.perf_counter()
        launched = self._launch(batch, masks, chunks, outputs)
        if self._flight is not None:
            self._collect(outputs)
        self._flight = launched
        if not self.async_steps and launched is not None:
            self._collect(outputs)
        return self._report(outputs, started, len(batch), time.perf_counter() - t0, prefilled)

    def _launch(
        self, batch: list[_Seq], masks: Masks, chunks: list[tuple[_Seq, PrefillChunk]], outputs: _Outputs
    ) -> _Launched | None:
        """The step's decode and prefill as one engine launch (the GPU engine runs the prefill beside the decode).
        Bad input the engine finds before any work (UsageError: a chunk it refuses) fails only its own
        sequence: the step is then run part by part, after the step in flight is read."""
        if not batch and not chunks:
            return None
        try:
            seqs = [s.live_seq for s in batch]
            last = [FROM_DEVICE if s.in_flight else s.last_token for s in batch]
            handle = self.engine.launch(seqs, last, masks, [c for _, c in chunks])
        except UsageError:
            if self._flight is not None:
                self._collect(outputs)
            kept = [(s, m) for s, m in zip(batch, masks or [None] * len(batch), strict=True) if s.alive]
            self._decode([s for s, _ in kept], [m for _, m in kept] if masks else None, outputs)
            for s, c in chunks:
                self._prefill_one(s, c, outputs)
            return None
        except Exception as e:
            for s in [*batch, *(s for s, _ in chunks)]:
                self._fail(s, e, outputs)
            return None
        for s in batch:
            s.in_flight += 1
        for s, c in chunks:
            s.prefilled += len(c.tokens)
            s.in_flight += c.last
        return _Launched(handle, batch, chunks)

    def _collect(self, outputs: _Outputs) -> None:
        """Read the step in flight and accept its tokens (a sequence ended since gets none)."""
        f, self._flight = self._flight, None
        assert f is not None
        try:
            tokens, firsts = self.engine.collect(f.handle)
        except Exception as e:
            for s in [*f.batch, *(s for s, _ in f.chunks)]:
                if s.alive:
                    self._fail(s, e, outputs)
            return
        for s, token in zip(f.batch, tokens, strict=True):
            s.in_flight -= 1
            if s.alive:
                self._accept(s, token, outputs)
        for (s, c), first in zip(f.chunks, firsts, strict=True):
            if c.last:
                s.in_flight -= 1
                if s.alive:
                    assert first is not None  # a last chunk samples
                    self._accept(s, first, outputs)

    def _decode(self, batch: list[_Seq], masks: Masks, outputs: _Outputs) -> None:
        if not batch:
            return
        try:
            seqs, last = [s.live_seq for s in batch], [s.last_token for s in batch]
            tokens = self.engine.decode(seqs, last, masks) if masks else self.engine.decode(seqs, last)
        except Exception as e:
            for s in batch:
                self._fail(s, e, outputs)
            return
        for s, token in zip(batch, tokens, strict=True):
            self._accept(s, token, outputs)

    def _plan_prefill(self, outputs: _Outputs, started: list[tuple[int, int]]) -> tuple[list[tuple[_Seq, int]], int]:
        """Spend the step's prompt-token budget: partly prefilled sequences first, then new admissions. Returns
        each sequence's chunk length, and their sum. (Sequences this step's decode ends free their slots and
        pages for the next step's admissions.)"""
        budget = self.prefill_chunk
        plan: list[tuple[_Seq, int]] = []  # each sequence and its chunk's length
        for partial in [s for s in self._running if not s.decoding]:
            n = self._chunk_len(partial, budget)
            if not n:  # the budget is spent: admissions wait too
                return plan, self.prefill_chunk - budget
            plan.append((partial, n))
            budget -= n
        while budget > 0 and self._waiting:
            new = self._admit(outputs)
            if new is None:  # no slot or KV pages free: the rest waits
                break
            if new.seq is not None:
                started.append((new.req.id, time.monotonic_ns()))
                n = self._chunk_len(new, budget)
                if not n:  # its first chunk waits for the next step's budget
                    break
                plan.append((new, n))
                budget -= n
        return plan, self.prefill_chunk - budget

    def _admit(self, outputs: _Outputs) -> _Seq | None:
        """Move the oldest waiting request into the running set if a slot and its KV pages are free (None if
        not); a request the engine refuses is ended with its error (and returned without a sequence)."""
        s = self._waiting[0]
        need = pages_for(min(len(s.req.prompt) + s.req.max_tokens, self.engine.max_ctx), self.engine.kv_page_size)
        if len(self._running) >= self.engine.max_seqs or self._reserved + need > self._kv_total:
            return None
        self._waiting.popleft()
        try:
            s.seq = self.engine.new_sequence(s.req.params)
        except Exception as e:
            self._fail(s, e, outputs)
            return s
        s.kv_pages = need
        self._reserved += need
        self._running.append(s)
        return s

    def _chunk_len(self, s: _Seq, budget: int) -> int:
        """How many more prompt tokens of s this step's `budget` takes: all that is left if it fits, else a chunk
        ending on a KV page boundary where the budget allows (the next chunk's prefill can then adopt
        prefix-cached pages)."""
        prompt_len = len(s.req.prompt)
        end = min(s.prefilled + budget, prompt_len)
        aligned = end - end % self.engine.kv_page_size
        if end < prompt_len and aligned > s.prefilled:
            end = aligned
        return end - s.prefilled

    def _chunks(self, plan: list[tuple[_Seq, int]], outputs: _Outputs) -> list[tuple[_Seq, PrefillChunk]]:
        """Each planned sequence's next prompt tokens as an engine PrefillChunk; a prompt's last chunk samples its first
        token, under its grammar's mask for a constrained request (its Matcher is built here). A sequence whose
        prompt cannot fit or whose grammar fails is ended instead."""
        chunks = []
        for s, n in plan:
            prompt = s.req.prompt
            last = s.prefilled + n == len(prompt)
            try:
                if len(prompt) > self.engine.max_ctx:
                    raise UsageError(
                        f"the prompt is {len(prompt)} tokens, longer than the context of {self.engine.max_ctx}"
                    )
                if last and s.constraint is not None and s.matcher is None:
                    s.matcher = self._grammars_of().matcher(Constraint.from_json(s.constraint.decode()))
                mask = s.matcher.mask() if last and s.matcher is not None else None
            except Exception as e:
                self._fail(s, e, outputs)
                continue
            chunks.append((s, PrefillChunk(s.live_seq, prompt[s.prefilled : s.prefilled + n], last, mask)))
        return chunks

    def _prefill_one(self, s: _Seq, chunk: PrefillChunk, outputs: _Outputs) -> None:
        try:
            tokens = self.engine.prefill_many([chunk])
        except Exception as e:
            self._fail(s, e, outputs)
            return
        self._prefilled([(s, chunk)], tokens, outputs)

    def _prefilled(self, batch: list[tuple[_Seq, PrefillChunk]], tokens: list[int | None], outputs: _Outputs) -> None:
        for (s, c), token in zip(batch, tokens, strict=True):
            s.prefilled += len(c.tokens)
            if s.decoding:
                assert token is not None  # a last chunk samples
                self._accept(s, token, outputs)

    def _accept(self, s: _Seq, token: int, outputs: _Outputs) -> None:
        """Record a sampled token; end the sequence on an end-of-generation token, max_tokens or a full
        context (the same rules as runtime.generate.Generation, which the front end runs on the same ids)."""
        s.last_token = token
        if s.matcher is not None:
            try:
                s.matcher.advance(token)
            except Exception as e:
                self._fail(s, e, outputs)
                return
        outputs.token(s.req.id, token)
        if token in s.eog:
            self._end(s, outputs, "eos")
            return
        s.n_generated += 1
        if s.ends_by_length(s.n_generated):
            self._end(s, outputs, "length")

    # Constrained decoding: masks before a step, matchers advanced in _accept. Sequences without a constraint
    # never reach a matcher, and a step with none of them computes no mask.

    def _grammars_of(self) -> Grammars:
        if self._grammars is None:
            if self.tokenizer is None:
                raise UsageError("this engine core has no tokenizer, so it cannot constrain output")
            self._grammars = Grammars(self.tokenizer, self.engine.config.n_vocab)
        return self._grammars

    def _masks(self, batch: list[_Seq], outputs: _Outputs) -> tuple[list[_Seq], Masks]:
        """The decode batch and its rows' masks (None: no row is constrained); a sequence whose grammar fails
        to give one is ended alone and leaves the batch."""
        if all(s.matcher is None for s in batch):
            return batch, None
        kept, masks = [], []
        for s in batch:
            try:
                masks.append(s.matcher.mask() if s.matcher is not None else None)
            except Exception as e:
                self._fail(s, e, outputs)
                continue
            kept.append(s)
        return kept, masks

    def _fail(self, s: _Seq, e: Exception, outputs: _Outputs) -> None:
        if isinstance(e, UsageError):  # e.g. a prompt that does not fit the context
            self._end(s, outputs, "error", 400, str(e))
        else:
            self._end(s, outputs, "error", 500, f"generation failed: {type(e).__name__}: {e}")

    def _end(self, s: _Seq, outputs: _Outputs, finish: str, status: int = 0, message: str = "") -> None:
        outputs.add(s.req.id, finish=finish, status=status, msg=message)
        self._by_id.pop(s.req.id, None)
        self._release(s)

    def _release(self, s: _Seq) -> None:
        if s in self._running:
            self._running.remove(s)
            self._reserved -= s.kv_pages
        if s.seq is not None:
            self.engine.release(s.seq)
            s.seq = None

    def _report(
        self, outputs: _Outputs, started: list[tuple[int, int]], batch: int, step_s: float, prefilled: int
    ) -> Step:
        prefix = self.engine.prefix_stats()
        stats = Stats(
            len(self._waiting),
            len(self._running),
            self.engine.kv_pages_used(),
            self._kv_total,
            prefix["queried_tokens"],
            prefix["hit_tokens"],
        )
        return Step(list(outputs.by_id.values()), started, batch, step_s, prefilled, stats)
