"""The engine core: a process of its own that opens the model, owns the engine and runs the step loop
(scheduler.py), so neither the GIL nor the HTTP work of the front end can stall a decode step.

The front end (client.py) starts it with multiprocessing's "spawn" context (CUDA cannot be forked) and passes
only the model spec and the Options; the core opens the model and the engine itself, then answers Ready (or
Failed, with the pickled error, which keeps its exit code) on its output socket. Its loop:

    take every message waiting (Add, Abort, Shutdown); block for the next one only when there is no work
    one Scheduler.step() -> one protocol.Step message (token ids, finishes, errors, stats)

The sockets are served by two threads (_Wire), so that encoding and sending a step's message and receiving
the front end's run while the next step waits for the GPU, instead of between steps.

Shutdown ends every request left with a 503, closes the engine (the GPU engine frees its memory) and answers
Closed. If the front end dies, the core notices within a second (its parent changed) and exits.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import queue
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from ingot.runtime import settings
from ingot.runtime.engines import open_engine
from ingot.runtime.engines.base import Engine
from ingot.runtime.errors import IncompatibleError, UsageError
from ingot.runtime.gpu import probe
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.resolve import Opened, open_model
from ingot.runtime.server import protocol
from ingot.runtime.server.protocol import Abort, Add, Closed, Failed, Ready, Shutdown
from ingot.runtime.server.scheduler import Scheduler

IDLE_POLL_S = 1.0  # how often an idle core checks that its front end is still alive
RECEIVE_POLL_MS = 100  # how often the receiver thread checks that the core is ending


@dataclass(frozen=True)
class Options:
    device: str = "auto"
    gpu: int | None = None  # None: the GPU with the most free memory
    max_seqs: int = 32  # sequences decoded together
    ctx: int | None = None  # tokens per sequence; None: the engine's default
    api_key: str | None = None
    pubkeys: tuple[str, ...] = ()  # trusted public keys (with INGOT_TRUSTED_KEYS: the trust policy)
    prefill_chunk: int | None = None  # prompt tokens per step; None: INGOT_PREFILL_CHUNK


def pick_gpu(requested: int | None) -> int:
    """--gpu N, checked against the machine; without it the GPU with the most free memory (NVML)."""
    gpus = probe.probe().gpus
    if requested is not None:
        if gpus and not 0 <= requested < len(gpus):
            raise UsageError(f"--gpu {requested}: this machine has {len(gpus)} GPU(s)", hint=f"use 0..{len(gpus) - 1}")
        return requested
    return max(gpus, key=lambda g: g.memory_free or 0).index if gpus else 0


def open_serving_engine(opened: Opened, options: Options) -> Engine:
    """open_engine's device rule (auto: the GPU engine when a GPU is present and the engine loads), with a
    choice of GPU and the server's batch width and context."""
    model = opened.model
    kw: dict[str, Any] = {"max_seqs": options.max_seqs, "max_ctx": options.ctx}
    if options.device == "cpu" or (options.device == "auto" and not probe.probe().gpus):
        return open_engine(model, "cpu", **kw)
    try:
        return open_engine(model, "cuda", kernels=opened.kernels, gpu=pick_gpu(options.gpu), **kw)
    except IncompatibleError:
        if options.device == "cuda":
            raise
        return open_engine(model, "cpu", **kw)


def model_version(opened: Opened) -> str:
    """Which model this is, so that every response can say which one answered it: a bundle's root digest (its
    content); for a bare GGUF, a digest of its path, size, modification time and inode (hashing gigabytes at
    every load would cost more than it tells: replacing the file changes these)."""
    if opened.bundle is not None:
        return opened.bundle.root_digest
    path = opened.model.path.resolve()
    st = path.stat()
    ident = f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    return "file:" + hashlib.sha256(ident.encode()).hexdigest()[:32]


def _failed(e: BaseException) -> Failed:
    try:
        error = pickle.dumps(e)
        pickle.loads(error)  # an exception whose constructor takes other arguments does not come back
    except Exception:
        error = b""
    return Failed(str(e), error)


def main(spec: str, options: Options, to_core: str, from_core: str) -> None:
    """The core process: connect, open the engine, serve steps until Shutdown (or the front end is gone)."""
    parent = os.getppid()
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    outbox.connect(from_core)
    outbox.setsockopt(zmq.LINGER, 5000)  # the last messages (Closed) still go out as the process ends
    try:
        try:
            inbox.bind(to_core)  # bound here, connected by the front end: its messages queue until we are up
            opened = open_model(spec, pubkeys=options.pubkeys)
            version = model_version(opened)
            engine = open_serving_engine(opened, options)
            try:
                engine.warm()  # every decode batch width's graph before the first request (Engine.warm)
            except BaseException:
                engine.close()  # e.g. out of GPU memory: the server does not start (a step would fail later)
                raise
            chunk = options.prefill_chunk or settings.PREFILL_CHUNK.get()
        except BaseException as e:
            outbox.send(protocol.encode(_failed(e)))
            return
        outbox.send(
            protocol.encode(
                Ready(
                    engine.name,
                    engine.max_seqs,
                    engine.max_ctx,
                    engine.kv_pages_total,
                    engine.memory_report(),
                    version,
                )
            )
        )
        wire = _Wire(inbox, outbox)
        try:
            _loop(Scheduler(engine, chunk, Tokenizer.from_model(opened.model)), wire, parent)
        finally:
            wire.close()  # the last steps go out before the engine closes (a GPU engine takes a while)
            engine.close()
        outbox.send(protocol.encode(Closed()))
    finally:
        inbox.close(0)
        outbox.close()
        ctx.term()


def _loop(scheduler: Scheduler, wire: _Wire, parent: int) -> None:
    while True:
        received = False
        try:
            # Block for the next message only when there is no work; else take what is waiting, without a
            # system call (the receiver thread has already read it off the socket).
            message = wire.incoming.get(timeout=IDLE_POLL_S) if not scheduler.has_work() else None
            while True:
                if message is None:
                    message = wire.incoming.get_nowait()
                received = True
                if isinstance(message, Add):
                    scheduler.add(message)
                elif isinstance(message, Abort):
                    scheduler.abort(message.ids)
                elif isinstance(message, Shutdown):
                    wire.send(scheduler.end_all())
                    return
                else:  # the receiver's error (a message that does not decode): the core fails as it used to
                    raise message
                message = None
        except queue.Empty:
            pass
        if not scheduler.has_work():
            if received:  # e.g. the last sequence was aborted: the gauges should say so
                wire.send(scheduler.report())
            if os.getppid() != parent:  # the front end died without a Shutdown
                scheduler.end_all()
                return
            continue
        wire.send(scheduler.step())


class _Wire:
    """The core's two sockets, each served by a thread of its own, so that the step loop never waits on them.

    A decode step spends most of its time waiting for the GPU (cuStreamSynchronize releases the GIL, as do the
    CPU engine's numpy kernels in part); meanwhile the sender thread encodes and sends the previous step's
    message and the receiver thread reads and decodes what the front end sent. The step loop only puts Steps
    on one queue and takes messages off another. Each socket is used by one thread only (zmq sockets are not
    thread-safe); messages keep their order (one FIFO each way)."""

    def __init__(self, inbox: zmq.Socket, outbox: zmq.Socket):
        self.incoming: queue.SimpleQueue[protocol.ToCore | Exception] = queue.SimpleQueue()
        self._outgoing: queue.SimpleQueue[protocol.FromCore | None] = queue.SimpleQueue()
        self._inbox, self._outbox = inbox, outbox
        self._stop = threading.Event()
        self._error: Exception | None = None  # the sender's, raised by the next send()
        # daemons: a core whose step loop raised must still exit (its front end then restarts it)
        self._receiver = threading.Thread(target=self._receive, name="ingot-core-receive", daemon=True)
        self._sender = threading.Thread(target=self._send, name="ingot-core-send", daemon=True)
        self._receiver.start()
        self._sender.start()

    def send(self, message: protocol.FromCore) -> None:
        if self._error is not None:  # the core cannot reach its front end: end it, as a failed send used to
            raise self._error
        self._outgoing.put(message)

    def close(self) -> None:
        """Send what is queued, then stop both threads; the sockets are the caller's again."""
        self._stop.set()
        self._outgoing.put(None)
        self._sender.join()
        self._receiver.join()

    def _receive(self) -> None:
        while not self._stop.is_set():
            if not self._inbox.poll(RECEIVE_POLL_MS):
                continue
            try:
                message: protocol.ToCore | Exception = protocol.decode_to_core(self._inbox.recv())
            except Exception as e:
                message = e
            self.incoming.put(message)
            if isinstance(message, Shutdown | Exception):
                return

    def _send(self) -> None:
        while (message := self._outgoing.get()) is not None:
            try:
                self._outbox.send(protocol.encode(message))
            except Exception as e:
                self._error = e
                return
