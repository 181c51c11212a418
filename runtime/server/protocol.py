"""The messages between the HTTP front end (client.py) and the engine core process (core.py).

They cross two pyzmq PUSH/PULL sockets (ipc:// in a private temporary folder), msgspec-encoded as MessagePack
(array-like structs: no field names on the wire). The front end binds both sockets; the core connects.

    front end -> core    Add (one request: prompt ids, sampling, limits, end-of-generation ids, constraint)
                         Abort (ids whose client went away, whose stop string matched, or whose drain expired)
                         Shutdown (end everything with a 503, close the engine, exit)
    core -> front end    Ready (the engine is loaded: its shape) or Failed (loading failed: the error)
                         Step (one per engine step: every sequence's new token ids, finishes, errors, stats)
                         Closed (after Shutdown: the engine is closed)

One Step message per engine step, never one per token: at 64 sequences and a few hundred steps a second this
is what keeps the socket and the decoder's cost per token small.

`Add.constraint` is where a structured-output spec travels: a runtime.structured.Constraint's JSON (to_json,
UTF-8), from which the core (scheduler.py) builds the sequence's llguidance matcher and masks its tokens in each
step; None for free text.
"""

from __future__ import annotations

import msgspec

from ingot.runtime.sampling import SamplingParams


class Add(msgspec.Struct, tag=True, array_like=True):
    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    eog_ids: list[int]  # tokens that end generation (EOS, <|im_end|>, ...), from the front end's tokenizer
    constraint: bytes | None = None  # Constraint.to_json(), UTF-8 (see the module docstring)


class Abort(msgspec.Struct, tag=True, array_like=True):
    ids: list[int]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    name: str  # the engine: "cpu" or "cuda"
    max_seqs: int
    max_ctx: int
    kv_pages_total: int
    memory: dict  # engine.memory_report()
    version: str  # the model's identity as the core opened it (core.model_version)


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str
    error: bytes  # the pickled exception (an IngotError keeps its exit code), b"" if it would not pickle


class Output(msgspec.Struct, array_like=True):
    """One sequence's part of a step: tokens sampled in it (the first one comes from its prefill), and how it
    ended, if it did: eos, length (max_tokens or a full context), or error with a status and message."""

    id: int
    tokens: list[int]
    finish: str | None = None
    status: int = 0
    message: str = ""


class Stats(msgspec.Struct, array_like=True):
    """The core's queue and KV state after a step (the gauges of /metrics)."""

    waiting: int = 0
    running: int = 0
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens the engine looked up in its prefix cache (engine.prefix_stats)
    prefix_hit_tokens: int = 0  # of those, adopted from cached pages: prefill work saved


class Step(msgspec.Struct, tag=True, array_like=True):
    outputs: list[Output]
    started: list[tuple[int, int]]  # (id, time.monotonic_ns()) of each prefill begun in this step
    batch: int  # sequences in this step's decode (0: none ran)
    step_s: float  # seconds of the step's engine call (its decode and the prefill queued behind it)
    prefill_tokens: int  # prompt tokens prefilled in this step
    stats: Stats


class Closed(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = Add | Abort | Shutdown
FromCore = Ready | Failed | Step | Closed

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)
