"""Several models in one server (`ingot serve A.ingot B.gguf ...` or a folder of them), Ollama-style.

Each model is a `Server` (server.py: its versions and engine cores), found by its id (the file name without
its extension, `name:latest` accepted). With one model nothing changes: it is loaded at start and stays. With
several:
    a model is loaded on its first request (that request waits; /health answers 200 as soon as the HTTP
        socket is up)
    it is unloaded `keep_alive` seconds after its last request ended: the request's own `keep_alive` (Ollama's
        field: seconds, or "5m", "1h"; negative keeps it loaded, 0 unloads it when idle) or INGOT_KEEP_ALIVE
    on a GPU, before a model is loaded, idle ones are unloaded, least recently used first, while the GPU's free
        memory is less than LOAD_MEMORY_FACTOR x the new model's file size (its weights, workspace and a KV
        cache); a model whose requests are running is never evicted
/metrics sums every model's gauges; the counters are shared.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.requests import Request

from ingot.runtime import settings
from ingot.runtime.errors import UsageError
from ingot.runtime.gpu import probe
from ingot.runtime.server.core import Options
from ingot.runtime.server.metrics import Metrics
from ingot.runtime.server.protocol import Stats
from ingot.runtime.server.request import ApiError
from ingot.runtime.server.server import Server, log

MODEL_SUFFIXES = (".gguf", ".ingot")
LOAD_MEMORY_FACTOR = 1.5  # free GPU memory wanted per byte of model file before loading another model
REAP_INTERVAL_S = 1.0
_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ms|s|m|h)?$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}


def model_specs(args: tuple[str, ...]) -> list[str]:
    """The MODEL arguments, a folder standing for the .gguf and .ingot files in it."""
    specs: list[str] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = sorted(str(p) for p in path.iterdir() if p.suffix in MODEL_SUFFIXES and p.is_file())
            if not found:
                raise UsageError(f"{arg}: no .gguf or .ingot files in this folder", hint="name the model files")
            specs += found
        else:
            specs.append(arg)
    return specs


def keep_alive_seconds(value: object) -> float | None:
    """Ollama's keep_alive: a number of seconds or a duration string ("5m", "1h", "30s", "-1"); None if absent."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _DURATION.match(str(value).strip()) if isinstance(value, str) else None
    if m is None:
        raise ApiError(400, f"keep_alive {value!r} is not a duration (seconds, or like '5m', '1h', '-1')")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


class _Slot:
    """A model's server and when it was last used."""

    def __init__(self, server: Server, keep_alive: float):
        self.server = server
        self.keep_alive = keep_alive
        self.last_used = time.monotonic()
        self.loading = asyncio.Lock()
        self.pending = 0  # requests routed to it whose handler has not returned yet


class Models:
    def __init__(self, specs: list[str], options: Options):
        self.options = options
        self.metrics = Metrics(self._stats)
        default_keep = settings.KEEP_ALIVE.get()
        self.slots: dict[str, _Slot] = {}
        for spec in specs:
            server = Server(spec, options, self.metrics)
            if server.model_id in self.slots:
                raise UsageError(f"two models are named {server.model_id!r}", hint="rename one of the files")
            self.slots[server.model_id] = _Slot(server, default_keep)
        self._reaper: asyncio.Task | None = None

    @property
    def single(self) -> Server | None:
        """The server of a one-model server (loaded at start, never unloaded), else None."""
        return next(iter(self.slots.values())).server if len(self.slots) == 1 else None

    @property
    def servers(self) -> list[Server]:
        return [slot.server for slot in self.slots.values()]

    def _stats(self) -> Stats:
        stats = [s.server.stats() for s in self.slots.values()]
        return Stats(*(sum(getattr(s, f) for s in stats) for f in Stats.__struct_fields__))

    # --- life ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.single is not None:
            await self.single.start_engine()
        else:
            self._reaper = asyncio.create_task(self._reap())

    def drain(self, seconds: float) -> None:
        for server in self.servers:
            server.drain(seconds)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for server in self.servers:
            await server.stop()

    # --- routing ------------------------------------------------------------------------------------

    def get(self, name: str) -> _Slot:
        slot = self.slots.get(name.removesuffix(":latest"))
        if slot is None:
            raise ApiError(
                404,
                f"model {name!r} not found; this server serves {', '.join(map(repr, self.slots))}",
                param="model",
                code="model_not_found",
            )
        return slot

    @asynccontextmanager
    async def using(self, request: Request) -> AsyncIterator[Server]:
        """route(), with the model held loaded until the handler returned (by then a request's job is in
        flight, which keeps it loaded too): keep_alive 0 cannot unload it between loading and submitting."""
        server = await self.route(request)
        slot = self.slots[server.model_id]
        slot.pending += 1
        try:
            yield server
        finally:
            slot.pending -= 1
            slot.last_used = time.monotonic()

    async def route(self, request: Request) -> Server:
        """The loaded model a request is for: the path's {model}, or the body's "model" (or "name")."""
        single = self.single
        if single is not None:
            if not single.ready:
                raise ApiError(503, "the model is still loading; retry when /health answers 200")
            return single
        name = request.path_params.get("model")
        keep_alive = None
        if name is None and request.method == "POST":
            body = await self.servers[0].read_json(request)  # bounded; cached for the handler's own read
            request._body = _encode(body)  # Starlette's body cache: the handler's read_json reads this
            if isinstance(body, dict):
                name = body.get("model") or body.get("name")
                keep_alive = keep_alive_seconds(body.get("keep_alive"))
        if not isinstance(name, str):
            raise ApiError(400, "this server serves several models: name one in the request's model field")
        return await self.acquire(name, keep_alive)

    async def acquire(self, name: str, keep_alive: float | None = None) -> Server:
        slot = self.get(name)
        if keep_alive is not None:
            slot.keep_alive = keep_alive
        slot.last_used = time.monotonic()
        async with slot.loading:
            if not slot.server.ready:
                await self._make_room(slot)
                await slot.server.start_engine()
                failure, slot.server.failure = slot.server.failure, None  # the next request tries again
                if failure is not None:
                    raise ApiError(500, f"loading model {name!r} failed: {failure}")
        return slot.server

    # --- unloading ----------------------------------------------------------------------------------

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now = time.monotonic()
            for name, slot in self.slots.items():
                server = slot.server
                if not server.ready or slot.loading.locked():
                    continue
                if server.in_flight or slot.pending:
                    slot.last_used = now
                elif slot.keep_alive >= 0 and now - slot.last_used >= slot.keep_alive:
                    log.info("unloading model %s (idle for %.0f s)", name, now - slot.last_used)
                    await server.unload()

    async def _make_room(self, slot: _Slot) -> None:
        """On a GPU: unload idle models, least recently used first, until the new one should fit."""
        if self.options.device == "cpu":
            return
        need = LOAD_MEMORY_FACTOR * Path(slot.server.spec).stat().st_size if Path(slot.server.spec).is_file() else 0
        while True:
            gpus = probe.probe().gpus
            free = max((g.memory_free or 0 for g in gpus), default=None)
            if free is None or free >= need:
                return
            idle = [
                s
                for s in self.slots.values()
                if s is not slot and s.server.ready and not s.server.in_flight and not s.pending
            ]
            if not idle:
                log.warning(
                    "loading %s with %.1f GiB free on the GPU: no idle model to evict", slot.server.spec, free / 2**30
                )
                return
            victim = min(idle, key=lambda s: s.last_used)
            log.info("evicting model %s to make room for %s", victim.server.model_id, slot.server.model_id)
            await victim.server.unload()


def _encode(body: object) -> bytes:
    return json.dumps(body).encode()
