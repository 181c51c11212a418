"""A CPU measurement harness for the serving path: the real engine core (runtime/server/core.py) and the real
front end, around a stand-in engine whose decode step costs a fixed GPU-like wall time.

    python tests/serve_bench.py core [--streams 64] [--step-ms 2] [--seconds 10]
    python tests/serve_bench.py http [--streams 64] [--step-ms 2] [--requests 4] [--procs 1]
    python tests/serve_bench.py deliver [--streams 64] [--max-tokens 128]

The stand-in (StandIn) answers every Engine call without computing: decode sleeps --step-ms (time.sleep releases
the GIL, as cuStreamSynchronize does in cuda-bindings, so another thread of the core runs meanwhile) and
returns ordinary token ids; prefill sleeps --prefill-us per prompt token. It is plugged into the real core by
replacing core.open_serving_engine in the core process (core.main is swapped for _core_main, which the spawn
start method imports from this file); the model (a synthetic tiny GGUF) is opened as usual, for its
tokenizer and config.

    core   this process plays the front end on raw sockets (no detokenizing): it keeps --streams requests of
           --max-tokens running for --seconds and reports the core's tok/s against the engine alone (the
           stand-in's decode called back to back, as bench_tg times the real one) and the core's CPU µs per
           generated token.
    http   `ingot serve` (the real front end: HTTP, detokenizing, SSE) with the stand-in core, driven by the
           load generator (ingot.runtime.server.loadgen, 128-token prompts); reports its JSON and each
           process's CPU µs per generated token (front end, core, load generator).
    deliver  the front end's per-token work without HTTP or sockets, in this process: Step messages through
           EngineClient (detokenizing, stop strings, metrics), each Job's queue and OpenAI's event framing;
           CPU µs per token (the part of `http`'s front-end figure that is Ingot's own code).

Speed is printed, never asserted: on a shared CPU it says where the time goes, not whether the H200 passes.
On 2 CPU cores the load generator (~80 µs per token) and the front end compete for them, so `http` at 2 ms
steps measures the processes' cost per token, not the GPU server's tok/s (see the README's serving section).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from ingot.runtime.engines.base import PrefillChunk, pages_for
from ingot.runtime.generate import GenerationRequest
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.synth import synthesize
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.sampling import SamplingParams
from ingot.runtime.server import core, openai, protocol
from ingot.runtime.server.client import EngineClient, Job
from ingot.runtime.server.core import Options
from ingot.runtime.server.metrics import Metrics
from ingot.runtime.server.protocol import Add, Ready, Shutdown, Step
from ingot.toolchain.cli import main as ingot_main

PAGE = 32
TICK = os.sysconf("SC_CLK_TCK")


class StandIn:
    """An Engine that costs wall time, not CPU: decode sleeps `step_s`, prefill `prefill_s` per token."""

    name = "standin"

    def __init__(self, config: Any, max_seqs: int, max_ctx: int, step_s: float, prefill_s: float):
        self.config, self.max_seqs, self.max_ctx = config, max_seqs, max_ctx
        self.step_s, self.prefill_s = step_s, prefill_s
        self.kv_page_size = PAGE
        self.kv_pages_total = max_seqs * pages_for(max_ctx, PAGE)
        self._len: dict[int, int] = {}
        self._next = 0
        # decode's own wall time, and the time from the end of one decode to the start of the next: what the
        # core spends between GPU steps (its serialized work; a prefill in between counts here too)
        self.busy: list[float] = []
        self.gaps: list[float] = []
        self._last_end: float | None = None

    def new_sequence(self, params: SamplingParams) -> int:
        if len(self._len) >= self.max_seqs:
            raise RuntimeError("no sequence free")
        self._next += 1
        self._len[self._next] = 0
        return self._next

    def _token(self, seq: int) -> int:
        return 100 + (seq * 7 + self._len[seq]) % 400  # ordinary tokens, as the load generator's prompts

    def prefill(self, seq: int, tokens: Sequence[int], mask: np.ndarray | None = None) -> int:
        token = self.prefill_many([PrefillChunk(seq, tokens, True, mask)])[0]
        assert token is not None
        return token

    def prefill_many(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        return self.decode_and_prefill([], [], None, chunks)[1]

    def decode(
        self, seqs: Sequence[int], tokens: Sequence[int], masks: Sequence[np.ndarray | None] | None = None
    ) -> list[int]:
        return self.decode_and_prefill(seqs, tokens, masks, [])[0]

    def decode_and_prefill(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None]]:
        return self.collect(self.launch(seqs, tokens, masks, chunks))

    def launch(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None], float]:
        """The GPU's time of the step: a decode (step_s, when there are sequences) then the prefill (prefill_s
        per prompt token), one after the other as on one stream, starting when the step before it ends (or
        now, if that was earlier: the time between is a gap, the GPU idle while the core works)."""
        now = time.perf_counter()
        start = now if self._last_end is None else max(now, self._last_end)
        if seqs and self._last_end is not None:
            self.gaps.append(start - self._last_end)
        wait = (self.step_s if seqs else 0.0) + self.prefill_s * sum(len(c.tokens) for c in chunks)
        if seqs:
            self.busy.append(wait)
        self._last_end = start + wait
        out = []
        for q in seqs:
            self._len[q] += 1
            out.append(self._token(q))
        firsts: list[int | None] = []
        for c in chunks:
            self._len[c.seq] += len(c.tokens)
            firsts.append(self._token(c.seq) if c.last else None)
        return out, firsts, start + wait

    def collect(self, launched: tuple[list[int], list[int | None], float]) -> tuple[list[int], list[int | None]]:
        out, firsts, end = launched
        time.sleep(max(0.0, end - time.perf_counter()))
        return out, firsts

    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    def release(self, seq: int) -> None:
        self._len.pop(seq, None)

    def seq_len(self, seq: int) -> int:
        return self._len[seq]

    def kv_pages_used(self) -> int:
        return sum(pages_for(n, PAGE) for n in self._len.values())

    def prefix_stats(self) -> dict[str, Any]:
        return {"queried_tokens": 0, "hit_tokens": 0}

    def memory_report(self) -> dict[str, Any]:
        return {}

    def warm(self) -> None:
        pass

    def close(self) -> None:
        report = os.environ.get("SERVE_BENCH_REPORT")
        if report and self.gaps:
            gaps, busy = np.array(self.gaps[len(self.gaps) // 10 :]), np.array(self.busy)
            figures = {"decode_ms_mean": 1e3 * busy.mean(), "gap_ms_mean": 1e3 * gaps.mean()}
            figures |= {"gap_ms_p50": 1e3 * np.median(gaps), "gap_ms_p99": 1e3 * np.percentile(gaps, 99)}
            Path(report).write_text(json.dumps({k: round(v, 4) for k, v in figures.items()}))


def _standin_factory(step_s: float, prefill_s: float):
    def open_standin(opened: Any, options: Options) -> StandIn:
        return StandIn(opened.model.config, options.max_seqs, options.ctx or 2048, step_s, prefill_s)

    return open_standin


def _core_main(spec: str, options: Options, to_core: str, from_core: str) -> None:
    """core.main with the stand-in engine (run in the spawned core process)."""
    step_s = float(os.environ["SERVE_BENCH_STEP_MS"]) / 1e3
    prefill_s = float(os.environ["SERVE_BENCH_PREFILL_US"]) / 1e6
    core.open_serving_engine = _standin_factory(step_s, prefill_s)
    core.main(spec, options, to_core, from_core)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def engine_alone(streams: int, step_s: float, steps: int = 300) -> float:
    """tok/s of the stand-in's decode called back to back (what bench_tg measures of the real engine)."""
    e = StandIn(None, streams, 2048, step_s, 0)
    seqs = [e.new_sequence(SamplingParams()) for _ in range(streams)]
    t0 = time.perf_counter()
    for _ in range(steps):
        e.decode(seqs, [0] * streams)
    return streams * steps / (time.perf_counter() - t0)


def _model(folder: Path) -> Path:
    return synthesize("tiny", "Q8_0", folder / "tiny.gguf", seed=7)


def bench_core(args: argparse.Namespace, folder: Path) -> dict:
    model = _model(folder)
    os.environ["SERVE_BENCH_STEP_MS"] = str(args.step_ms)
    os.environ["SERVE_BENCH_PREFILL_US"] = str(args.prefill_us)
    os.environ["SERVE_BENCH_REPORT"] = str(folder / "core.json")
    ctx = zmq.Context()
    to_core, from_core = f"ipc://{folder}/in", f"ipc://{folder}/out"
    outbox, inbox = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    outbox.connect(to_core)
    inbox.bind(from_core)
    options = Options(device="cpu", max_seqs=args.streams, ctx=2048)
    proc = multiprocessing.get_context("spawn").Process(
        target=_core_main, args=(str(model), options, to_core, from_core), daemon=True
    )
    proc.start()
    ready = protocol.decode_from_core(inbox.recv())
    assert isinstance(ready, Ready), ready
    ids = iter(range(1, 1 << 30))
    prompt = list(range(100, 100 + args.prompt_tokens))

    def add() -> None:
        outbox.send(protocol.encode(Add(next(ids), prompt, SamplingParams(), args.max_tokens, [])))

    for _ in range(args.streams):
        add()
    # warm up (every stream admitted and decoding), then measure
    tokens = 0
    t_end = time.monotonic() + 1.0
    measuring = False
    cpu0 = cpu_seconds(proc.pid)
    me0 = time.process_time()
    t0 = time.perf_counter()
    steps = batch_sum = 0
    while True:
        while not inbox.poll(1000):
            if not proc.is_alive():
                raise SystemExit(f"the engine core exited with code {proc.exitcode}")
        step = protocol.decode_from_core(inbox.recv())
        assert isinstance(step, Step)
        for out in step.outputs:
            tokens += len(out.tokens)
            if out.finish is not None:
                add()
        steps += 1
        batch_sum += step.batch
        if time.monotonic() >= t_end:
            if measuring:
                break
            measuring, t_end = True, time.monotonic() + args.seconds
            cpu0, me0, t0, tokens, steps, batch_sum = (
                cpu_seconds(proc.pid),
                time.process_time(),
                time.perf_counter(),
                0,
                0,
                0,
            )
    wall = time.perf_counter() - t0
    core_cpu, me_cpu = cpu_seconds(proc.pid) - cpu0, time.process_time() - me0
    outbox.send(protocol.encode(Shutdown()))
    proc.join(10)
    ideal = engine_alone(args.streams, args.step_ms / 1e3)
    tok_s = tokens / wall
    return json.loads((folder / "core.json").read_text()) | {
        "streams": args.streams,
        "step_ms": args.step_ms,
        "tok_s": round(tok_s),
        "engine_alone_tok_s": round(ideal),
        "vs_engine": round(tok_s / ideal, 3),
        "ms_per_step": round(1e3 * wall / steps, 3),
        "mean_batch": round(batch_sum / steps, 1),
        "core_cpu_us_per_token": round(1e6 * core_cpu / tokens, 2),
        "driver_cpu_us_per_token": round(1e6 * me_cpu / tokens, 2),
    }


def _serve(argv: list[str]) -> None:
    """`ingot serve` with core.main swapped for _core_main (run as this file's `_serve` subcommand)."""
    core.main = _core_main  # client.py starts core.main: the spawned process then imports it from here
    sys.argv = ["ingot", "serve", *argv]
    profile = os.environ.get("SERVE_BENCH_PROFILE")
    if not profile:
        ingot_main()
        return
    profiler = cProfile.Profile()
    try:
        profiler.runcall(ingot_main)
    finally:
        profiler.dump_stats(profile)


def bench_http(args: argparse.Namespace, folder: Path) -> dict:
    model = _model(folder)
    port = _free_port()
    env = os.environ | {"SERVE_BENCH_STEP_MS": str(args.step_ms), "SERVE_BENCH_PREFILL_US": str(args.prefill_us)}
    if args.profile:  # the front end's profile (cProfile), written when it exits
        env["SERVE_BENCH_PROFILE"] = str(Path(args.profile).resolve())
    log = open(folder / "serve.log", "w+")
    server = subprocess.Popen(
        [sys.executable, __file__, "_serve", str(model), "--port", str(port), "--device", "cpu"]
        + ["--max-seqs", str(args.streams), "--ctx", "2048"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        loadgen = [sys.executable, "-m", "ingot.runtime.server.loadgen", "--url", f"http://127.0.0.1:{port}"]
        loadgen += ["--clients", str(args.streams), "--prompt-tokens", str(args.prompt_tokens)]
        loadgen += ["--max-tokens", str(args.max_tokens), "--procs", str(args.procs)]
        # one short run to warm up (and wait for /health), then the measured one
        subprocess.run([*loadgen, "--requests", "1"], check=True, capture_output=True)
        core_pid = _child(server.pid)
        fe0, core0, t0 = cpu_seconds(server.pid), cpu_seconds(core_pid), time.perf_counter()
        # the load generator's CPU: what reaped children used (its own --procs children count into it)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([*loadgen, "--requests", str(args.requests)], check=True, capture_output=True).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        lg_cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        report = json.loads(out)
        fe, core_cpu = cpu_seconds(server.pid) - fe0, cpu_seconds(core_pid) - core0
        n = report["generated_tokens"]
        return {
            "loadgen": report,
            "wall_s": round(time.perf_counter() - t0, 2),
            "engine_alone_tok_s": round(engine_alone(args.streams, args.step_ms / 1e3)),
            "front_end_cpu_us_per_token": round(1e6 * fe / n, 2),
            "core_cpu_us_per_token": round(1e6 * core_cpu / n, 2),
            "loadgen_cpu_us_per_token": round(1e6 * lg_cpu / n, 2),
        }
    finally:
        server.terminate()
        server.wait(30)


def bench_deliver(args: argparse.Namespace, folder: Path) -> dict:
    """The front end's per-token path without HTTP, in this process: Step messages -> EngineClient._on_step
    (Generation, metrics) -> each Job's queue -> openai._stream's event bytes, for --streams jobs and
    --max-tokens steps of one token each. CPU time per token, best of three (one core, no other process)."""
    tokenizer = Tokenizer.from_model(load_model(_model(folder)))
    head = {"id": "x", "object": "text_completion", "created": 0, "model": "m"}

    async def run() -> float:
        client = EngineClient("unused.gguf", Options(), observer=Metrics(lambda: protocol.Stats()))
        jobs = []
        for i in range(args.streams):
            job = Job(tokenizer, GenerationRequest((1,), SamplingParams(), args.max_tokens))
            job.id, client._jobs[i] = i, job
            jobs.append(job)

        async def consume(job: Job) -> int:
            return sum([len(event) async for event in openai._stream(job, head, False, True, None)])

        tasks = [asyncio.create_task(consume(job)) for job in jobs]
        await asyncio.sleep(0)
        t0 = time.process_time()
        for step in range(args.max_tokens):
            outputs = [protocol.Output(i, [100 + (7 * step + i) % 300]) for i in range(args.streams)]
            client._on_step(Step(outputs, [], args.streams, 0.003, 0, protocol.Stats()))
            await asyncio.sleep(0)  # each consumer takes its chunk and yields its event
        await asyncio.gather(*tasks)
        return time.process_time() - t0

    best = min(asyncio.run(run()) for _ in range(3))
    return {
        "streams": args.streams,
        "tokens": args.streams * args.max_tokens,
        "cpu_us_per_token": round(1e6 * best / (args.streams * args.max_tokens), 2),
    }


def _child(pid: int) -> int:
    """The engine core: the server's spawned child (not multiprocessing's resource tracker)."""
    for kid in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            return int(kid)
    raise RuntimeError("the server has no engine core")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_serve":
        _serve(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=["core", "http", "deliver"])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--prefill-us", type=float, default=10.0, help="stand-in prefill wall time per prompt token")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seconds", type=float, default=10.0, help="core: how long to measure")
    p.add_argument("--requests", type=int, default=4, help="http: requests per client")
    p.add_argument("--procs", type=int, default=1, help="http: load generator processes")
    p.add_argument("--profile", help="http: write the front end's cProfile stats to this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as d:
        result = {"core": bench_core, "http": bench_http, "deliver": bench_deliver}[args.mode](args, Path(d))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
