"""The front end's side of the engine core: `EngineClient` starts the core process (core.py), sends it requests
and aborts, and turns its Step messages into text for each request's `Job`, on the event loop.

    submit(job)   Add -> the core; a core that crashed is started again first
    core's Step   for each sequence in it: its token ids through the Job's Generation (incremental
                  detokenization, stop strings), one Chunk per step into the Job's queue; a stop string that
                  matched -> Abort (the core does not know text); the observer (metrics) hears of
                  admissions, first tokens, decode steps, generated tokens and finishes
    cancel(job)   the client went away: Abort, and the job ends with 499 at once
    drain(s)      SIGINT/SIGTERM: new requests get 503; what is unfinished `s` seconds later ends with 503
    stop()        Shutdown -> the core ends what is left (503), closes the engine and exits

A core that dies (a crash, the OOM killer) fails its in-flight requests with 503; the next request starts a
new one (the model is loaded again: that request waits for it). Detokenizing here, off the core, is what
keeps the engine's step loop free of Python text work.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
import pickle
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Protocol

import zmq
import zmq.asyncio

from ingot.runtime.errors import IngotError
from ingot.runtime.generate import Chunk, Generation, GenerationRequest, StopStrings
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.server import core, protocol
from ingot.runtime.server.core import Options
from ingot.runtime.server.protocol import Abort, Add, Closed, Failed, Output, Ready, Shutdown, Stats, Step
from ingot.runtime.server.request import ApiError

RECEIVE_POLL_MS = 200  # how often the receiver checks that the core is alive while it is quiet
# A streamed response with nothing to send for SSE_PING_S (queued behind full sequences, waiting out another
# request's long prefill) gets a keep-alive, so that a proxy's read timeout (nginx: 60 s) does not cut it: its
# Job's chunks() yields PING, which the SSE dialects send as a comment line (OpenAI) or a ping event
# (Anthropic). The receiver looks for such jobs every PING_CHECK_S; nothing is added per token.
SSE_PING_S = 15.0
PING_CHECK_S = 1.0
STOP_TIMEOUT_S = 10  # how long stop() waits for the core to close its engine before killing it
log = logging.getLogger("uvicorn.error")


class Observer(Protocol):
    """What the client reports (metrics.py implements it)."""

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


PING = Chunk("", ())  # what chunks() yields for a keep-alive (compared by identity)


class Job:
    """One request in the front end: its Generation (text, stop strings, finish) and the queue its chunks (then
    the end, or an ApiError) go to. `constraint` is a serialized structured-output spec for the core (None:
    free text)."""

    def __init__(self, tokenizer: Tokenizer, request: GenerationRequest, constraint: bytes | None = None):
        self.request = request
        self.constraint = constraint
        self.generation = Generation(tokenizer, request)
        self.generation.stops = self._stops = _StopMatch(request.stop)
        self.eog_ids = sorted(t for t in tokenizer.eog_ids if t is not None)
        self.id = 0  # the core's request id, set by submit
        self.client: EngineClient | None = None  # the core it went to, set by submit
        self.cancelled = False
        self.ping = False  # a server-sent-event stream: chunks() yields PING after SSE_PING_S of silence
        self.last_emit = time.monotonic()
        self.submitted = time.monotonic_ns()
        # time.monotonic_ns() (CLOCK_MONOTONIC, the same clock in the core process): prefill start, first token, end
        self.started = self.first_token = self.ended = 0
        # What emit() put and chunks() has not taken yet, and the future chunks() waits on when there is none
        # (an asyncio.Queue's put/get cost about twice as much per token, with nothing here it would add).
        self._items: collections.deque[Chunk | ApiError] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def completion_tokens(self) -> int:
        return self.generation.n_generated

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.matched

    def cancel(self) -> None:
        """The client went away (or the response is over): release its sequence if it is still running."""
        if self.client is not None:
            self.client.cancel(self)

    def emit(self, item: Chunk | ApiError) -> None:
        """On the event loop."""
        self.last_emit = time.monotonic()
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def waiting(self) -> int:
        """Items emitted and not yet taken by chunks()."""
        return len(self._items)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The generated chunks; the last has a finish_reason. Raises ApiError if generation failed.

        Chunks that arrived while the consumer was busy come out merged into one, so a response that falls
        behind the engine (many streams, a fast GPU) sends fewer, larger deltas instead of falling further
        behind. A PING (keep-alive) comes out only when nothing else did."""
        while True:
            while not self._items:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            items = [self._items.popleft()]
            while self._items and not isinstance(items[-1], ApiError):
                items.append(self._items.popleft())
            chunks = [c for c in items if isinstance(c, Chunk) and c is not PING]
            if chunks:
                yield _merged(chunks)
                if chunks[-1].finish_reason:
                    return
            elif items[-1] is PING:
                yield PING
            if isinstance(items[-1], ApiError):
                raise items[-1]


def _merged(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        "".join(c.text for c in chunks), tuple(t for c in chunks for t in c.token_ids), chunks[-1].finish_reason
    )


class EngineClient:
    def __init__(self, spec: str, options: Options, observer: Observer):
        self.spec, self.options, self.observer = spec, options, observer
        self.stats = Stats()
        self.info: Ready | None = None  # the engine's shape, once a core answered Ready
        self.process: multiprocessing.process.BaseProcess | None = None
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._draining = self._stopping = self._retiring = self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: asyncio.Task | None = None
        self._closed = asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._inbox: zmq.asyncio.Socket | None = None
        self._outbox: zmq.Socket | None = None
        self._dir: str | None = None

    # --- the core's life ---------------------------------------------------------------------------

    async def start(self) -> Ready:
        """Spawn a core and wait until it has loaded the model; raises its loading error."""
        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="ingot-core-")
        to_core, from_core = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        # The core binds its inbox and we connect to it: a connecting PUSH has its pipe at once, so what we send
        # before the core has even started queues until it is there. (A binding PUSH has no pipe until a peer's
        # handshake completes, and a non-blocking send then fails: under CPU load an Add sent right after Ready
        # was lost that way, and its request waited forever.)
        self._outbox = self._sync_ctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: messages queue instead
        self._outbox.connect(to_core)
        self._inbox = self._ctx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self._inbox.bind(from_core)
        self._closed.clear()
        process = multiprocessing.get_context("spawn").Process(
            target=core.main, args=(self.spec, self.options, to_core, from_core), name="ingot-core", daemon=True
        )
        process.start()
        self.process = process
        while not await self._inbox.poll(RECEIVE_POLL_MS):
            if not process.is_alive():
                self._close_sockets()
                raise IngotError(f"the engine process exited with code {process.exitcode} while loading the model")
        message = protocol.decode_from_core(await self._inbox.recv())
        if isinstance(message, Failed):
            process.join(10)
            self._close_sockets()
            raise _error(message)
        if not isinstance(message, Ready):
            raise RuntimeError(f"the engine core answered {type(message).__name__} before Ready")
        self.info = message
        self._receiver = asyncio.create_task(self._receive(process))
        return message

    async def retire(self) -> None:
        """After a reload: new requests go elsewhere; once the ones running here are done, stop."""
        self._retiring = True
        while self._jobs and self.process is not None:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        """Shutdown: the core ends what is left with 503, closes the engine and exits."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        process = self.process
        if process is not None and process.is_alive():
            self._send(Shutdown())
            try:
                await asyncio.wait_for(self._closed.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                log.error("the engine process did not close within %d s: killing it", STOP_TIMEOUT_S)
            await asyncio.to_thread(process.join, 2)
            if process.is_alive():
                process.kill()
        if self._receiver is not None:
            self._receiver.cancel()
        self._fail_all(ApiError(503, "the server is shutting down"), "cancelled")
        self._close_sockets()
        self._ctx.term()
        self._sync_ctx.term()

    def _close_sockets(self) -> None:
        for sock in (self._inbox, self._outbox):
            if sock is not None:
                sock.close(0)
        self._inbox = self._outbox = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def _receive(self, process: multiprocessing.process.BaseProcess) -> None:
        inbox = self._inbox
        assert inbox is not None  # set by start
        next_ping = time.monotonic() + PING_CHECK_S
        while True:
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + PING_CHECK_S
                self.ping_idle(now)
            if await inbox.poll(RECEIVE_POLL_MS):
                message = protocol.decode_from_core(await inbox.recv())
                if isinstance(message, Step):
                    try:
                        self._on_step(message)
                    except Exception:  # a bug: the other requests keep being served
                        log.exception("handling an engine step failed")
                elif isinstance(message, Closed):
                    self._closed.set()
                    return
            elif not process.is_alive():
                self._crashed(process)
                return

    def _crashed(self, process: multiprocessing.process.BaseProcess) -> None:
        log.error("the engine process exited with code %s; the next request starts a new one", process.exitcode)
        self._fail_all(ApiError(503, "the engine process exited; retry (the next request starts a new one)"), "error")
        self.process = None
        self._close_sockets()

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def ping_idle(self, now: float) -> None:
        """A keep-alive for every streamed job that has had nothing for SSE_PING_S (see PING)."""
        for job in self._jobs.values():
            if job.ping and now - job.last_emit >= SSE_PING_S:
                job.emit(PING)

    # --- requests ----------------------------------------------------------------------------------

    async def submit(self, job: Job) -> None:
        if self._stopping or self._draining or self._retiring:
            raise ApiError(503, "the server is shutting down")
        async with self._lock:
            if self.process is None:  # the core crashed: start another
                await self.start()
        job.id, job.client = next(self._ids), self
        self._jobs[job.id] = job
        r = job.request
        self._send(Add(job.id, list(r.prompt_tokens), r.params, r.max_tokens, job.eog_ids, job.constraint))

    def cancel(self, job: Job) -> None:
        """The client is gone: the core releases the sequence before its next step; the job ends with 499."""
        if self._jobs.pop(job.id, None) is None:
            return
        job.cancelled = True
        self._end(job, "cancelled")
        self._send(Abort([job.id]))
        job.emit(ApiError(499, "the request was cancelled (the client went away)"))

    def drain(self, seconds: float) -> None:
        """Shutdown has begun: new requests get a 503, and what is still queued or generating after `seconds`
        is ended with a 503. Called from a signal handler, so it only sets flags and schedules the rest on
        the event loop."""
        if self._draining:
            return
        self._draining = True
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._expire)
            except RuntimeError:  # the loop is closed already
                pass

    def _expire(self) -> None:
        ids = list(self._jobs)
        self._fail_all(ApiError(503, "the server is shutting down"), "cancelled")
        if ids:
            self._send(Abort(ids))

    def _fail_all(self, error: ApiError, reason: str) -> None:
        jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            self._end(job, reason)
            job.emit(error)

    def _send(self, message: protocol.ToCore) -> None:
        if self._outbox is None:
            return
        try:
            self._outbox.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # cannot happen on a connected PUSH without a high-water mark; never silently
            log.error("the engine core's inbox refused %s; its requests are failed", type(message).__name__)
            self._fail_all(ApiError(503, "the engine process is not accepting requests; retry"), "error")

    # --- the core's steps --------------------------------------------------------------------------

    def _on_step(self, step: Step) -> None:
        now = time.monotonic_ns()
        self.stats = step.stats
        if step.batch:
            self.observer.step(step.batch, step.step_s)
        for rid, started in step.started:
            job = self._jobs.get(rid)
            if job is not None:
                job.started = started
                self.observer.admitted(job.prompt_tokens, (started - job.submitted) / 1e9)
        generated = 0
        try:
            for out in step.outputs:
                job = self._jobs.get(out.id)
                if job is not None:  # else it was cancelled or stopped already
                    generated += self._deliver(job, out, now)
        finally:  # once a step (a counter's lock and call per sequence add up), even if a delivery raised
            if generated:
                self.observer.generated(generated)

    def _deliver(self, job: Job, out: Output, now: int) -> int:
        """The output's tokens through the job's Generation, as one chunk; returns the tokens generated."""
        if out.tokens and not job.first_token:
            job.first_token = now
            self.observer.first_token((now - job.submitted) / 1e9)
        chunks = []
        for i, token in enumerate(out.tokens):
            chunk = job.generation.accept(token, context_full=i == len(out.tokens) - 1 and out.finish == "length")
            chunks.append(chunk)
            if chunk.finish_reason:
                break
        finish = chunks[-1].finish_reason if chunks else None
        if finish is None and out.finish in ("eos", "length"):  # they follow the same rules: a bug if reached
            log.error("the core ended request %d (%s) but its Generation did not", out.id, out.finish)
            finish = job.generation.finish_reason = out.finish
            chunks.append(Chunk("", (), finish))
        if finish is not None:
            del self._jobs[job.id]
            self._end(job, finish)
            if out.finish is None:  # a stop string: the core does not know it is over
                self._send(Abort([job.id]))
        if chunks:
            job.emit(_merged(chunks))
        if out.finish == "error" and finish is None:
            del self._jobs[job.id]
            self._end(job, "cancelled" if out.status == 503 else "error")
            job.emit(ApiError(out.status, out.message))
        return sum(len(c.token_ids) for c in chunks)

    def _end(self, job: Job, reason: str) -> None:
        job.ended = time.monotonic_ns()
        self.observer.retired(reason)


def _error(failed: Failed) -> BaseException:
    """The core's loading error as it was raised there (an IngotError keeps its exit code)."""
    if failed.error:
        try:
            error = pickle.loads(failed.error)
            if isinstance(error, BaseException):
                return error
        except Exception:
            pass
    return IngotError(failed.message)
