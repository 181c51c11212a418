"""The continuous-batching scheduler, in process on the tiny model: concurrent requests share decode steps and
get the same tokens as one-at-a-time generation, admission respects max_seqs and free KV pages, a cancelled
request's sequence is released, and a failing engine fails its requests instead of the loop."""

from __future__ import annotations

import asyncio

import pytest

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.engines.kvcache import PagePool
from ingot.runtime.generate import GenerationRequest, SamplingParams, generate
from ingot.runtime.server.request import ApiError
from ingot.runtime.server.scheduler import Job, Scheduler


class Recorder:
    """The scheduler's observer, keeping what it is told."""

    def __init__(self):
        self.batches, self.reasons, self.first_tokens = [], [], 0

    def admitted(self, prompt_tokens, queued_s):
        pass

    def first_token(self, seconds):
        self.first_tokens += 1

    def step(self, batch, seconds):
        self.batches.append(batch)

    def generated(self, n_tokens):
        pass

    def retired(self, reason):
        self.reasons.append(reason)


class Spy:
    """A CpuEngine that records how many sequences are alive at each decode, optionally with a smaller KV
    capacity (a page pool's size and page size, as the GPU engine reports them)."""

    def __init__(self, engine: CpuEngine, pages: PagePool | None = None, fail_decode: bool = False):
        self.engine, self.fail_decode, self.widest = engine, fail_decode, 0
        self.max_seqs, self.max_ctx = engine.max_seqs, engine.max_ctx
        if pages is not None:
            self.kv_page_size, self.kv_pages_total = pages.page_size, pages.n_pages

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def decode(self, seqs, tokens):
        if self.fail_decode:
            raise RuntimeError("device lost")
        self.widest = max(self.widest, len(seqs))
        return self.engine.decode(seqs, tokens)

    @property
    def live(self) -> int:
        return len(self.engine._seqs)


PROMPTS = [
    "the capital of France",
    "hello world",
    "one two three four",
    "what is the name of the city",
    "water",
    "the people of the country",
    "yes no",
    "find the number",
]


def _request(tokenizer, text, max_tokens=12):
    return GenerationRequest(tuple(tokenizer.encode(text)), SamplingParams(), max_tokens)


async def _serve(engine, tokenizer, requests, cancel_after: int | None = None):
    """Run requests through a Scheduler; returns (texts or ApiErrors, the observer)."""
    observer = Recorder()
    scheduler = Scheduler(observer)
    scheduler.start(lambda: engine, lambda e: None)
    loop = asyncio.get_running_loop()
    jobs = [Job(tokenizer, r, loop) for r in requests]

    async def drain(i, job):
        text = ""
        try:
            async for chunk in job.chunks():
                text += chunk.text
                if i == 0 and cancel_after is not None and len(text) >= cancel_after:
                    scheduler.cancel(job)
            return text
        except ApiError as e:
            return e

    for job in jobs:
        scheduler.submit(job)
    results = await asyncio.gather(*[drain(i, j) for i, j in enumerate(jobs)])
    await asyncio.to_thread(scheduler.stop)
    return results, observer


def _one_at_a_time(tiny_model, tokenizer, requests):
    engine = CpuEngine(tiny_model, max_seqs=1)
    return [
        "".join(c.text for c in generate(engine, tokenizer, r.prompt_tokens, r.params, r.max_tokens)) for r in requests
    ]


def test_batched_output_equals_one_at_a_time(tiny_model, tiny_tokenizer):
    requests = [_request(tiny_tokenizer, p) for p in PROMPTS]
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    results, observer = asyncio.run(_serve(spy, tiny_tokenizer, requests))
    assert results == _one_at_a_time(tiny_model, tiny_tokenizer, requests)
    assert spy.widest == 4  # steps were shared, never past max_seqs
    assert observer.first_tokens == len(PROMPTS) and spy.live == 0


def test_admission_waits_for_free_kv_pages(tiny_model, tiny_tokenizer):
    """Each request reserves pages for prompt + max_tokens (<= 64 tokens: one page); a pool of 2 pages runs at
    most 2 sequences at once, whatever max_seqs says."""
    requests = [_request(tiny_tokenizer, p, max_tokens=20) for p in PROMPTS]
    assert all(len(r.prompt_tokens) + r.max_tokens <= 64 for r in requests)
    spy = Spy(CpuEngine(tiny_model, max_seqs=8), pages=PagePool(2, 64))
    results, _ = asyncio.run(_serve(spy, tiny_tokenizer, requests))
    assert spy.widest == 2
    assert results == _one_at_a_time(tiny_model, tiny_tokenizer, requests)


def test_cancel_releases_the_sequence_and_spares_the_others(tiny_model, tiny_tokenizer):
    requests = [_request(tiny_tokenizer, p, max_tokens=200) for p in PROMPTS[:4]]
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    results, observer = asyncio.run(_serve(spy, tiny_tokenizer, requests, cancel_after=1))
    assert isinstance(results[0], ApiError) and results[0].status == 499
    assert results[1:] == _one_at_a_time(tiny_model, tiny_tokenizer, requests[1:])
    assert observer.reasons.count("cancelled") == 1 and spy.live == 0


def test_engine_failure_fails_its_requests_not_the_loop(tiny_model, tiny_tokenizer):
    spy = Spy(CpuEngine(tiny_model, max_seqs=4), fail_decode=True)
    results, observer = asyncio.run(_serve(spy, tiny_tokenizer, [_request(tiny_tokenizer, p) for p in PROMPTS[:3]]))
    assert all(isinstance(r, ApiError) and r.status == 500 and "device lost" in r.message for r in results)
    assert observer.reasons == ["error"] * 3 and spy.live == 0


def test_load_failure_is_reported():
    failures = []
    scheduler = Scheduler(Recorder())

    def load():
        raise OSError("no such model")

    scheduler.start(load, failures.append)
    scheduler._thread.join(10)
    assert isinstance(scheduler.failure, OSError) and failures == [scheduler.failure]
    assert not scheduler.ready.is_set()


@pytest.mark.parametrize(
    "stops, text, matched", [((" world", "llo"), "hello world", "llo"), (("b", "ab"), "xab", "ab")]
)
def test_stop_sequence_is_named(tiny_model, tiny_tokenizer, stops, text, matched):
    """Anthropic's stop_sequence: which stop string ended the text (the earliest one in the text)."""
    request = GenerationRequest((1,), SamplingParams(), 50, stops)
    loop = asyncio.new_event_loop()
    try:
        job = Job(tiny_tokenizer, request, loop)
        for token in tiny_tokenizer.encode(text, add_special=False):
            if job.generation.accept(token).finish_reason:
                break
    finally:
        loop.close()
    assert job.generation.finish_reason == "stop" and job.stop_sequence == matched


def test_chunks_that_queue_up_come_out_merged(tiny_tokenizer):
    """A consumer that falls behind gets one delta for what piled up (fewer, larger stream events), and an error
    after text still delivers the text first."""
    from ingot.runtime.generate import Chunk

    async def consume(items):
        job = Job(tiny_tokenizer, GenerationRequest((1,), SamplingParams(), 8), asyncio.get_running_loop())
        for item in items:
            job.emit(item)
        await asyncio.sleep(0)  # let the emitted items land in the queue
        got = []
        try:
            async for chunk in job.chunks():
                got.append(chunk)
        except ApiError as e:
            got.append(e.status)
        return got

    done = asyncio.run(consume([Chunk("a", (5,)), Chunk("b", (6,)), Chunk("", (), "eos")]))
    assert done == [Chunk("ab", (5, 6), "eos")]
    failed = asyncio.run(consume([Chunk("a", (5,)), ApiError(500, "device lost")]))
    assert failed == [Chunk("a", (5,)), 500]
