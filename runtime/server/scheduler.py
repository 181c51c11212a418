"""Continuous batching: one thread owns the engine and runs every live sequence's decode step together.

The loop, on the engine thread:
    retire sequences whose client went away (engine.release)
    admit waiting requests in arrival order while a sequence slot (max_seqs) and their KV pages are free,
        prefilling each as it is admitted (one at a time)
    one engine.decode(running seqs, their last tokens) step for all running sequences
    push each new token through its request's Generation; the Chunk goes to the request's asyncio queue
        (loop.call_soon_threadsafe); a finished sequence is released at once
A request waits in the queue until it is admitted, so a burst of clients costs queueing, never a failure.

KV admission reserves a request's worst case, pages for min(prompt + max_tokens, context) tokens, so a
running sequence can always grow to its end. The GPU engine has a page pool (runtime/engines/kvcache.py); the CPU
engine keeps a whole-context cache per sequence, which is counted here in pages of the same size.

The engine thread also loads the model (`load`), so the HTTP socket is up, answering /health with 503, while
weights are read.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ingot.runtime.engines.base import Engine
from ingot.runtime.errors import UsageError
from ingot.runtime.generate import Chunk, Generation, GenerationRequest, StopStrings
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.server.request import ApiError
from ingot.runtime.structured import Constraint, Grammars, Matcher


class Observer(Protocol):
    """What the scheduler reports (metrics.py implements it)."""

    def admitted(self, prompt_tokens: int, queued_s: float) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def step(self, batch: int, seconds: float) -> None: ...
    def generated(self, n_tokens: int) -> None: ...
    def retired(self, reason: str) -> None: ...


class _StopMatch(StopStrings):
    """StopStrings that also records which stop string ended the text (Anthropic's stop_sequence)."""

    matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        pending = self.pending + text
        out, stopped = super().push(text)
        if stopped:
            self.matched = next(s for s in self.stops if pending.startswith(s, len(out)))
        return out, stopped


class Job:
    """One request inside the server: its Generation, and the asyncio queue its chunks (then the end) go to.
    Written by the engine thread, read on the event loop; `cancelled` is the one field the loop writes."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        constraint: Constraint | None = None,
    ):
        self.request = request
        self.tokenizer = tokenizer
        self.constraint = constraint  # what the output must be (serializable); the matcher is built at prefill
        self.matcher: Matcher | None = None
        self.generation = Generation(tokenizer, request)
        self.generation.stops = self._stops = _StopMatch(request.stop)
        self.cancelled = False
        self.seq: int | None = None  # the engine's sequence id, once admitted
        self.last_token = 0
        self.kv_pages = 0  # pages reserved for it while it runs
        self.submitted = time.perf_counter_ns()
        self.started = self.first_token = self.ended = 0  # perf_counter_ns: prefill start, first token, end
        self._loop = loop
        self._queue: asyncio.Queue[Chunk | ApiError] = asyncio.Queue()

    @property
    def live_seq(self) -> int:
        """The sequence id of an admitted job."""
        if self.seq is None:
            raise RuntimeError("the job has no sequence yet")
        return self.seq

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return self.generation.n_generated

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.matched

    def emit(self, item: Chunk | ApiError) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is left to read it
            pass

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The generated chunks; the last has a finish_reason. Raises ApiError if generation failed.

        Chunks that arrived while the consumer was busy come out merged into one, so a response that falls
        behind the engine (many streams, a fast GPU) sends fewer, larger deltas instead of falling further
        behind."""
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty() and not isinstance(items[-1], ApiError):
                items.append(self._queue.get_nowait())
            chunks = [c for c in items if isinstance(c, Chunk)]
            if chunks:
                yield (
                    Chunk(
                        "".join(c.text for c in chunks),
                        tuple(t for c in chunks for t in c.token_ids),
                        chunks[-1].finish_reason,
                    )
                    if len(chunks) > 1
                    else chunks[0]
                )
                if chunks[-1].finish_reason:
                    return
            if isinstance(items[-1], ApiError):
                raise items[-1]


@dataclass(frozen=True)
class Stats:
    """A snapshot the engine thread publishes after each step (read by /metrics from other threads)."""

    waiting: int = 0
    running: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens the engine looked up in its prefix cache (engine.prefix_stats)
    prefix_hit_tokens: int = 0  # of those, adopted from cached pages: prefill work saved


class Scheduler:
    def __init__(self, observer: Observer):
        self.observer = observer
        self.engine: Engine | None = None
        self.failure: BaseException | None = None  # what `load` raised, or what ended the engine thread
        self.ready = threading.Event()
        self.stats = Stats()
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping = False
        self._draining = False  # set by drain(): new requests get a 503
        self._deadline: float | None = None  # set by drain()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grammars: Grammars | None = None  # built at the first constrained request
        self._reserved = 0  # KV pages reserved by running jobs
        self._kv_total = self._page_tokens = 0
        self._thread: threading.Thread | None = None

    # --- called from the event loop ---------------------------------------------------------------

    def start(self, load: Callable[[], Engine], on_failure: Callable[[BaseException], None]) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # started outside an event loop (tests): drain then relies on the engine thread
            self._loop = None
        self._thread = threading.Thread(target=self._main, args=(load, on_failure), name="ingot-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping or self._draining:
                raise ApiError(503, "the server is shutting down")
            self._waiting.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: the engine thread releases the job's sequence before its next step."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def drain(self, seconds: float) -> None:
        """Shutdown has begun: new requests get a 503, and what is still queued or generating after `seconds`
        is ended with a 503. Called from a signal handler, so it only sets flags and wakes the event loop
        (taking the lock there could deadlock); the 503s are sent from the event loop, so they go out on time
        even while the engine thread is busy in a long prefill."""
        if self._deadline is not None:
            return
        self._draining = True
        self._deadline = time.monotonic() + seconds
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._expire)
            except RuntimeError:  # the loop is closed already
                pass

    def _expire(self) -> None:
        """On the event loop, at the drain deadline: every request not finished yet gets its 503 now (its
        sequence is released by the engine thread as soon as it is free; no new prefill starts)."""
        with self._cv:
            jobs = list(self._waiting) + list(self._running)
            for job in jobs:
                job.cancelled = True
            self._cv.notify()
        for job in jobs:
            if not job.ended:
                job.emit(ApiError(503, "the server is shutting down"))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still queued or running, release it, close the engine, and end the thread. After a
        drain deadline the engine thread gets 0.2 s more (it may be in a long prefill whose requests
        were already answered); it is a daemon thread, so the process can exit without it."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._deadline is not None:
            timeout = min(timeout, max(self._deadline - time.monotonic(), 0.0) + 0.2)
        if self._thread is not None:
            self._thread.join(timeout)

    # --- the engine thread ------------------------------------------------------------------------

    def _main(self, load: Callable[[], Engine], on_failure: Callable[[BaseException], None]) -> None:
        try:
            self.engine = load()
            self._page_tokens = self.engine.kv_page_size
            self._kv_total = self.engine.kv_pages_total
        except BaseException as e:  # reported by `ingot serve` as its exit status
            self.failure = e
            on_failure(e)
            return
        self._publish()
        self.ready.set()
        try:
            while self._wait_for_work():
                self._retire_cancelled()
                self._admit()
                self._step()
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._end_all()
                self._publish()
        except BaseException as e:  # a bug here would leave every request waiting: stop the server instead
            self.failure = e
            on_failure(e)
            raise
        finally:
            self._shut_down()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self._page_tokens)

    def _wait_for_work(self) -> bool:
        with self._cv:
            while not self._stopping and not self._waiting and not self._running:
                self._cv.wait()
            return not self._stopping

    def _retire_cancelled(self) -> None:
        with self._cv:
            gone = [j for j in self._waiting if j.cancelled]
            for job in gone:
                self._waiting.remove(job)
        for job in gone + [j for j in self._running if j.cancelled]:
            self._fail(job, ApiError(499, "the request was cancelled (the client went away)"), "cancelled")

    def _live_engine(self) -> Engine:
        """The engine, once `load` returned (the loop runs only after that)."""
        if self.engine is None:
            raise RuntimeError("the scheduler ran before its engine was loaded")
        return self.engine

    def _admit(self) -> None:
        engine = self._live_engine()
        while True:
            with self._cv:
                if not self._waiting or self._past_deadline():
                    return
                job = self._waiting[0]
                r = job.request
                need = self._pages(min(len(r.prompt_tokens) + r.max_tokens, engine.max_ctx))
                if len(self._running) >= engine.max_seqs or self._reserved + need > self._kv_total:
                    return
                self._waiting.popleft()
            job.kv_pages = need
            self._prefill(job)

    def _prefill(self, job: Job) -> None:
        engine = self._live_engine()
        job.started = time.perf_counter_ns()
        self.observer.admitted(job.prompt_tokens, (job.started - job.submitted) / 1e9)
        try:
            job.seq = seq = engine.new_sequence(job.request.params)
            self._reserved += job.kv_pages
            self._running.append(job)
            if job.constraint is not None:
                job.matcher = self._grammars_of(job).matcher(job.constraint)
            prompt = job.request.prompt_tokens
            token = engine.prefill(seq, prompt, job.matcher.mask()) if job.matcher else engine.prefill(seq, prompt)
        except Exception as e:
            self._fail(job, e)
            return
        job.first_token = time.perf_counter_ns()
        self.observer.first_token((job.first_token - job.submitted) / 1e9)
        self.observer.generated(self._accept(job, token))

    def _step(self) -> None:
        batch = list(self._running)
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            seqs, last, masks = [j.live_seq for j in batch], [j.last_token for j in batch], self._masks(batch)
            engine = self._live_engine()
            tokens = engine.decode(seqs, last, masks) if masks else engine.decode(seqs, last)
        except Exception as e:
            for job in batch:
                self._fail(job, e)
            return
        self.observer.step(len(batch), time.perf_counter() - t0)
        self.observer.generated(sum(self._accept(job, token) for job, token in zip(batch, tokens, strict=False)))

    # Constrained decoding (runtime/structured.py): masks before a step, matchers advanced after it. Jobs
    # without a constraint never reach a matcher, and a step with none of them computes no mask.

    def _grammars_of(self, job: Job) -> Grammars:
        if self._grammars is None:
            self._grammars = Grammars(job.tokenizer, self._live_engine().config.n_vocab)
        return self._grammars

    def _masks(self, batch: list[Job]) -> list[np.ndarray | None] | None:
        if all(j.matcher is None for j in batch):
            return None
        return [j.matcher.mask() if j.matcher else None for j in batch]

    def _accept(self, job: Job, token: int) -> int:
        """Feed one sampled token to the job's Generation and emit the chunk; returns tokens generated (0 for
        the end-of-generation token)."""
        engine = self._live_engine()
        if job.matcher is not None:
            job.matcher.advance(token)
        chunk = job.generation.accept(token, context_full=engine.seq_len(job.live_seq) >= engine.max_ctx)
        job.last_token = token
        if chunk.finish_reason:
            self._retire(job, chunk.finish_reason)
        job.emit(chunk)
        return len(chunk.token_ids)

    def _retire(self, job: Job, reason: str) -> None:
        job.ended = time.perf_counter_ns()
        if job in self._running:
            self._running.remove(job)
            self._reserved -= job.kv_pages
        if job.seq is not None:
            self._live_engine().release(job.seq)
        self.observer.retired(reason)

    def _fail(self, job: Job, e: Exception, reason: str = "error") -> None:
        """End the job with an error (its consumer, if still there, raises it)."""
        self._retire(job, reason)
        if isinstance(e, UsageError):  # e.g. a prompt that does not fit the context
            e = ApiError(400, str(e))
        job.emit(e if isinstance(e, ApiError) else ApiError(500, f"generation failed: {type(e).__name__}: {e}"))

    def _publish(self) -> None:
        engine = self._live_engine()
        prefix = engine.prefix_stats()
        self.stats = Stats(
            len(self._waiting),
            len(self._running),
            engine.kv_pages_used(),
            self._kv_total,
            prefix["queried_tokens"],
            prefix["hit_tokens"],
        )

    def _end_all(self) -> None:
        """End every queued and running request with a 503 (shutdown)."""
        with self._cv:
            queued, self._waiting = list(self._waiting), deque()
        for job in queued + list(self._running):
            self._fail(job, ApiError(503, "the server is shutting down"), "cancelled")

    def _shut_down(self) -> None:
        with self._cv:
            self._stopping = True  # later submits get 503
        self._end_all()
        self._publish()
        if self.engine is not None:
            self.engine.close()  # the GPU engine frees its device memory
