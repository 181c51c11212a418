"""The engine core's step loop (scheduler.py), in process on the tiny model: concurrent requests share decode
steps and get the same tokens as one-at-a-time generation, admission respects max_seqs and free KV pages, an
aborted request's sequence is released, a failing engine fails its requests instead of the loop, and a long
prompt is prefilled in chunks while running streams keep getting a token every step. Also the front end's Job:
stop_sequence and merged chunks."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.engines.kvcache import PagePool
from ingot.runtime.generate import Chunk, Generation, GenerationRequest, SamplingParams, generate
from ingot.runtime.server import anthropic, openai
from ingot.runtime.server.client import PING, SSE_PING_S, EngineClient, Job
from ingot.runtime.server.core import Options
from ingot.runtime.server.protocol import Add, Step, decode_from_core, decode_to_core, encode
from ingot.runtime.server.request import ApiError
from ingot.runtime.server.scheduler import Scheduler
from ingot.runtime.server.server import SSE_PING
from ingot.runtime.structured import json_schema


@pytest.fixture(autouse=True, params=["async", "sync"])
def step_mode(request, monkeypatch) -> bool:
    """Every test here in both step loops: steps launched one ahead of their readback (the default), and each
    step waited for (INGOT_ASYNC_STEPS=0). Their outputs must be the same."""
    monkeypatch.setenv("INGOT_ASYNC_STEPS", "1" if request.param == "async" else "0")
    return request.param == "async"


class Spy:
    """A CpuEngine that records how many sequences are alive at each decode, each prefill chunk's length and how
    many chunks each prefill_many call took, optionally with a smaller KV capacity (a page pool's size and page
    size, as the GPU engine reports them)."""

    def __init__(self, engine: CpuEngine, pages: PagePool | None = None, fail_decode: bool = False):
        self.engine, self.fail_decode, self.widest, self.prefills = engine, fail_decode, 0, []
        self.rows = 0  # decode rows computed
        self.prefill_calls: list[int] = []
        self.max_seqs, self.max_ctx = engine.max_seqs, engine.max_ctx
        if pages is not None:
            self.kv_page_size, self.kv_pages_total = pages.page_size, pages.n_pages

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def launch(self, seqs, tokens, masks, chunks):  # the scheduler's step (collect: the engine's)
        if self.fail_decode and seqs:
            raise RuntimeError("device lost")
        self.widest, self.rows = max(self.widest, len(seqs)), self.rows + len(seqs)
        if chunks:
            self.prefills += [len(c.tokens) for c in chunks]
            self.prefill_calls.append(len(chunks))
        return self.engine.launch(seqs, tokens, masks, chunks)

    def decode(self, seqs, tokens, masks=None):  # the scheduler's fallback when a step's input was refused
        if self.fail_decode:
            raise RuntimeError("device lost")
        self.widest = max(self.widest, len(seqs))
        return self.engine.decode(seqs, tokens, masks)

    def prefill_many(self, chunks):  # ... one chunk at a time
        self.prefills += [len(c.tokens) for c in chunks]
        self.prefill_calls.append(len(chunks))
        return self.engine.prefill_many(chunks)

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


def _add(rid, tokenizer, request):
    return Add(rid, list(request.prompt_tokens), request.params, request.max_tokens, sorted(tokenizer.eog_ids))


def _run(engine, tokenizer, requests, prefill_chunk=512, abort_after=None, max_steps=10_000):
    """Step a Scheduler until it is idle; each step goes through the wire encoding, as in the core process.
    Returns (text or (status, message) per request, the steps). abort_after=(i, n): abort request i after
    its n-th token."""
    scheduler = Scheduler(engine, prefill_chunk)
    for i, r in enumerate(requests):
        scheduler.add(_add(i, tokenizer, r))
    gens = [Generation(tokenizer, r) for r in requests]
    texts: list = [""] * len(requests)
    counts = [0] * len(requests)
    steps = []
    while scheduler.has_work() and len(steps) < max_steps:
        step = decode_from_core(encode(scheduler.step()))
        assert isinstance(step, Step)
        steps.append(step)
        for out in step.outputs:
            for t in out.tokens:
                texts[out.id] += gens[out.id].accept(t, context_full=out.finish == "length").text
                counts[out.id] += 1
            if out.finish == "error":
                texts[out.id] = (out.status, out.message)
            if abort_after and out.id == abort_after[0] and counts[out.id] >= abort_after[1] and not out.finish:
                scheduler.abort([out.id])
                texts[out.id] = "aborted"
    return texts, steps


def _one_at_a_time(tiny_model, tokenizer, requests):
    engine = CpuEngine(tiny_model, max_seqs=1)
    return [
        "".join(c.text for c in generate(engine, tokenizer, r.prompt_tokens, r.params, r.max_tokens)) for r in requests
    ]


def test_batched_output_equals_one_at_a_time(tiny_model, tiny_tokenizer):
    requests = [_request(tiny_tokenizer, p) for p in PROMPTS]
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    texts, steps = _run(spy, tiny_tokenizer, requests)
    assert texts == _one_at_a_time(tiny_model, tiny_tokenizer, requests)
    assert spy.widest == 4  # steps were shared, never past max_seqs
    assert spy.prefill_calls[0] == 4  # the first step's four new prompts went to the engine in one call
    assert spy.live == 0 and steps[-1].stats.running == 0 and steps[-1].stats.kv_pages_used == 0
    assert sorted(i for s in steps for i, _ in s.started) == list(range(len(PROMPTS)))


def test_seeded_sampling_is_the_same_chunked_batched_or_alone(tiny_model, tiny_tokenizer):
    """A seeded request at temperature 1 gives the same text whether its prompt is prefilled in one piece or in
    8-token chunks (whose intermediate samples the scheduler discards), and batched with others or alone: each
    draw depends on the seed and the position only."""
    long_prompt = " ".join(PROMPTS)  # ~30 tokens: four chunks of 8
    params = [SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=s) for s in (11, 12, 13)]
    requests = [GenerationRequest(tuple(tiny_tokenizer.encode(long_prompt)), p, 16) for p in params]
    whole, _ = _run(CpuEngine(tiny_model, max_seqs=4), tiny_tokenizer, requests)
    chunked, _ = _run(CpuEngine(tiny_model, max_seqs=4), tiny_tokenizer, requests, prefill_chunk=8)
    alone = _one_at_a_time(tiny_model, tiny_tokenizer, requests)
    assert whole == chunked == alone
    assert len(set(whole)) == 3  # different seeds, different samples: the draws are not all greedy


def test_a_bad_prompt_prefilled_with_others_fails_alone(tiny_model, tiny_tokenizer):
    """A prompt the engine refuses (a token id past the vocabulary) in the same prefill call as good ones: it
    gets its 400, the others their one-at-a-time text."""
    requests = [_request(tiny_tokenizer, p) for p in PROMPTS[:3]]
    bad = GenerationRequest((5, tiny_model.config.n_vocab + 7, 9), SamplingParams(), 12)
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    texts, _ = _run(spy, tiny_tokenizer, [requests[0], bad, *requests[1:]])
    assert texts[1][0] == 400 and "out of range" in texts[1][1]
    assert [texts[0], *texts[2:]] == _one_at_a_time(tiny_model, tiny_tokenizer, requests)
    assert spy.prefill_calls[0] == 4 and spy.live == 0


def test_a_bad_prompt_arriving_while_others_decode_costs_them_nothing(tiny_model, tiny_tokenizer):
    """The bad prompt's step also decodes two running sequences: the engine refuses the step before any work
    (the chunks are checked first), the scheduler reruns it part by part, and the running sequences are decoded
    once (their texts are one-at-a-time generation's), the new good prompt admitted beside the bad one too."""
    good = [_request(tiny_tokenizer, p) for p in PROMPTS[:3]]
    bad = GenerationRequest((5, tiny_model.config.n_vocab + 7, 9), SamplingParams(), 12)
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    scheduler = Scheduler(spy, 512)
    for i in (0, 1):
        scheduler.add(_add(i, tiny_tokenizer, good[i]))
    steps = [scheduler.step()]  # both prefilled: they decode from the next step on
    scheduler.add(_add(2, tiny_tokenizer, bad))
    scheduler.add(_add(3, tiny_tokenizer, good[2]))
    while scheduler.has_work():
        steps.append(scheduler.step())
    gens = {i: Generation(tiny_tokenizer, r) for i, r in ((0, good[0]), (1, good[1]), (3, good[2]))}
    texts = dict.fromkeys(gens, "")
    for step in steps:
        for out in step.outputs:
            if out.id == 2:
                assert out.finish == "error" and out.status == 400
            else:
                texts[out.id] += "".join(gens[out.id].accept(t).text for t in out.tokens)
    assert [texts[0], texts[1], texts[3]] == _one_at_a_time(tiny_model, tiny_tokenizer, good)
    assert spy.live == 0


def test_admission_waits_for_free_kv_pages(tiny_model, tiny_tokenizer):
    """Each request reserves pages for prompt + max_tokens (<= 64 tokens: one page); a pool of 2 pages runs at
    most 2 sequences at once, whatever max_seqs says."""
    requests = [_request(tiny_tokenizer, p, max_tokens=20) for p in PROMPTS]
    assert all(len(r.prompt_tokens) + r.max_tokens <= 64 for r in requests)
    spy = Spy(CpuEngine(tiny_model, max_seqs=8), pages=PagePool(2, 64))
    texts, steps = _run(spy, tiny_tokenizer, requests)
    assert spy.widest == 2 and max(s.stats.running for s in steps) == 2
    assert texts == _one_at_a_time(tiny_model, tiny_tokenizer, requests)


def test_abort_releases_the_sequence_and_spares_the_others(tiny_model, tiny_tokenizer):
    requests = [_request(tiny_tokenizer, p, max_tokens=200) for p in PROMPTS[:4]]
    spy = Spy(CpuEngine(tiny_model, max_seqs=4))
    texts, steps = _run(spy, tiny_tokenizer, requests, abort_after=(0, 2))
    assert texts[0] == "aborted" and all(0 not in [o.id for o in s.outputs] for s in steps[3:])
    assert texts[1:] == _one_at_a_time(tiny_model, tiny_tokenizer, requests[1:])
    assert spy.live == 0


def test_engine_failure_fails_its_requests_not_the_loop(tiny_model, tiny_tokenizer):
    spy = Spy(CpuEngine(tiny_model, max_seqs=4), fail_decode=True)
    texts, _ = _run(spy, tiny_tokenizer, [_request(tiny_tokenizer, p) for p in PROMPTS[:3]])
    assert all(t[0] == 500 and "device lost" in t[1] for t in texts)
    assert spy.live == 0


def test_end_all_fails_queued_and_running(tiny_model, tiny_tokenizer):
    spy = Spy(CpuEngine(tiny_model, max_seqs=2))
    scheduler = Scheduler(spy, 512)
    for i, p in enumerate(PROMPTS[:4]):
        scheduler.add(_add(i, tiny_tokenizer, _request(tiny_tokenizer, p, max_tokens=50)))
    scheduler.step()  # two admitted, two waiting
    step = scheduler.end_all()
    assert sorted((o.id, o.finish, o.status) for o in step.outputs) == [(i, "error", 503) for i in range(4)]
    assert spy.live == 0 and not scheduler.has_work() and step.stats.running == 0


def test_long_prompt_is_prefilled_in_chunks_while_a_stream_runs(tiny_model, tiny_tokenizer):
    """A running stream gets a token in every step while a 200-token prompt arrives: the prompt goes in chunks
    of at most `prefill_chunk` tokens, one per step, and its output is the same as unchunked."""
    stream = _request(tiny_tokenizer, "hello world", max_tokens=60)
    long_prompt = tuple(tiny_tokenizer.encode(" ".join(["the people of the country"] * 40)))[:200]
    long = GenerationRequest(long_prompt, SamplingParams(), 8)
    spy = Spy(CpuEngine(tiny_model, max_seqs=2, max_ctx=256))
    scheduler = Scheduler(spy, prefill_chunk=16)
    scheduler.add(_add(0, tiny_tokenizer, stream))
    steps = [scheduler.step(), scheduler.step()]  # the stream is prefilled and decoding
    scheduler.add(_add(1, tiny_tokenizer, long))
    while scheduler.has_work():
        steps.append(scheduler.step())
    firsts = [i for i, s in enumerate(steps) if any(o.id == 1 and o.tokens for o in s.outputs)]
    during = steps[2 : firsts[0] + 1]  # from the long prompt's arrival to its first token
    # one chunk per step; its first token is read a step after the step that samples it when steps overlap
    assert len(during) == -(-200 // 16) + scheduler.async_steps
    assert all(any(o.id == 0 and len(o.tokens) == 1 for o in s.outputs) for s in during)  # the stream advanced
    assert max(spy.prefills[1:]) <= 16 and sum(spy.prefills[1:]) == 200
    # the chunked prompt's output equals one-at-a-time generation's (greedy)
    texts, _ = _run(Spy(CpuEngine(tiny_model, max_seqs=2, max_ctx=256)), tiny_tokenizer, [stream, long], 16)
    assert texts == _one_at_a_time(tiny_model, tiny_tokenizer, [stream, long])


SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"enum": ["yes", "no"]}},
    "required": ["n", "s"],
    "additionalProperties": False,
}


class MaskSpy(Spy):
    """Records whether each prefill and decode got masks (and how many of a decode's rows were masked)."""

    def __init__(self, engine: CpuEngine):
        super().__init__(engine)
        self.prefill_masks: list[bool] = []
        self.decode_masks: list[int | None] = []

    def launch(self, seqs, tokens, masks, chunks):
        if seqs:
            self.decode_masks.append(None if masks is None else sum(m is not None for m in masks))
        self.prefill_masks += [c.mask is not None for c in chunks]
        return self.engine.launch(seqs, tokens, masks, chunks)


def test_constrained_sequence_gets_masks_and_a_schema_instance(tiny_model, tiny_tokenizer):
    """Add.constraint crosses the wire; the core masks only the constrained sequence's last prefill chunk and
    its decode rows, and its output is an instance of the schema, while a free sequence in the same batch
    matches one-at-a-time generation."""
    free = _request(tiny_tokenizer, "hello world", max_tokens=20)
    prompt = tuple(tiny_tokenizer.encode(" ".join(["the people of the country"] * 4)))
    constrained = GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=3), 200)
    spy = MaskSpy(CpuEngine(tiny_model, max_seqs=2, max_ctx=256))
    scheduler = Scheduler(spy, prefill_chunk=8, tokenizer=tiny_tokenizer)
    scheduler.add(_add(0, tiny_tokenizer, free))
    add = _add(1, tiny_tokenizer, constrained)
    add.constraint = json_schema(SCHEMA).to_json().encode()
    scheduler.add(decode_to_core(encode(add)))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish = {}
    while scheduler.has_work():
        step = decode_from_core(encode(scheduler.step()))
        assert isinstance(step, Step)
        for out in step.outputs:
            tokens[out.id] += out.tokens
            if out.finish:
                finish[out.id] = (out.finish, out.message)
    assert finish[1] == ("eos", ""), finish
    value = json.loads(tiny_tokenizer.decode([t for t in tokens[1] if t not in tiny_tokenizer.eog_ids]))
    assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and value["s"] in ("yes", "no")
    assert spy.prefill_masks.count(True) == 1 and len(spy.prefill_masks) > 2  # chunked: only the last is masked
    assert any(m == 1 for m in spy.decode_masks)  # the batch held both: one masked row
    assert all(m is None or m == 1 for m in spy.decode_masks)
    free_text = Generation(tiny_tokenizer, free)
    text = "".join(free_text.accept(t, context_full=False).text for t in tokens[0])
    assert text == _one_at_a_time(tiny_model, tiny_tokenizer, [free])[0]


@pytest.mark.parametrize(
    "stops, text, matched", [((" world", "llo"), "hello world", "llo"), (("b", "ab"), "xab", "ab")]
)
def test_stop_sequence_is_named(tiny_tokenizer, stops, text, matched):
    """Anthropic's stop_sequence: which stop string ended the text (the earliest one in the text)."""
    job = Job(tiny_tokenizer, GenerationRequest((1,), SamplingParams(), 50, stops))
    for token in tiny_tokenizer.encode(text, add_special=False):
        if job.generation.accept(token).finish_reason:
            break
    assert job.generation.finish_reason == "stop" and job.stop_sequence == matched


def test_chunks_that_queue_up_come_out_merged(tiny_tokenizer):
    """A consumer that falls behind gets one delta for what piled up (fewer, larger stream events), and an error
    after text still delivers the text first."""

    async def consume(items):
        job = Job(tiny_tokenizer, GenerationRequest((1,), SamplingParams(), 8))
        for item in items:
            job.emit(item)
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


def test_a_silent_stream_gets_keep_alives(tiny_tokenizer):
    """A streamed job with nothing for SSE_PING_S (queued, or behind another request's long prefill) gets a PING
    from the receiver's check, which OpenAI's stream sends as an SSE comment and Anthropic's as its ping event;
    a job that is not a stream, or that had output lately, gets none; a PING never displaces real chunks."""
    client = EngineClient("unused.gguf", Options(), observer=None)  # type: ignore[arg-type]  # never started
    request = GenerationRequest((1,), SamplingParams(), 8)
    quiet, lively, whole = Job(tiny_tokenizer, request), Job(tiny_tokenizer, request), Job(tiny_tokenizer, request)
    quiet.ping = lively.ping = True  # server.stream() sets it for event streams; `whole` is a non-streamed request
    for i, job in enumerate((quiet, lively, whole)):
        client._jobs[i] = job
    now = time.monotonic()
    quiet.last_emit = whole.last_emit = now - SSE_PING_S
    lively.last_emit = now - SSE_PING_S / 2
    client.ping_idle(now)
    assert quiet.waiting == 1 and lively.waiting == 0 and whole.waiting == 0
    head = {"id": "x", "object": "o", "created": 0, "model": "m"}

    async def ping_then_text():
        stream = openai._stream(quiet, head, False, False, None).__aiter__()
        first = await stream.__anext__()  # the PING alone in the queue
        quiet.emit(Chunk("hi", (5,)))
        quiet.emit(Chunk("", (), "eos"))
        return [first] + [e async for e in stream]

    events = asyncio.run(ping_then_text())
    assert events[0] == SSE_PING and b'"hi"' in events[1]

    pinged = Job(tiny_tokenizer, request)
    pinged.emit(PING)

    async def anthropic_events():
        stream = anthropic._stream(pinged, {}, None).__aiter__()
        opening = [await stream.__anext__() for _ in range(4)]  # its opening events, then the PING's
        pinged.emit(Chunk("", (), "eos"))
        return [e.event for e in opening + [e async for e in stream]]

    assert asyncio.run(anthropic_events()) == [
        "message_start", "content_block_start", "ping", "ping", "content_block_stop", "message_delta", "message_stop"
    ]  # fmt: skip

    both = Job(tiny_tokenizer, request)
    both.emit(PING)
    both.emit(Chunk("a", (5,), "eos"))

    async def chunks(job):
        return [c async for c in job.chunks()]

    assert asyncio.run(chunks(both)) == [Chunk("a", (5,), "eos")]  # merged with real output, the PING is dropped


def test_a_full_context_ends_the_sequence_with_length(tiny_model, tiny_tokenizer):
    """max_tokens beyond the context: the sequence ends ("length") when the engine holds max_ctx tokens, at the
    same token whether or not other sequences run beside it (the scheduler asks the engine only near the end)."""
    engine = CpuEngine(tiny_model, max_seqs=2, max_ctx=64)
    long = _request(tiny_tokenizer, "the capital of France", max_tokens=1000)
    short = _request(tiny_tokenizer, "hello world", max_tokens=3)
    for requests in ([long], [long, short]):
        scheduler = Scheduler(engine, 512)
        for i, r in enumerate(requests):
            scheduler.add(_add(i, tiny_tokenizer, r))
        tokens, finish = [], None
        while scheduler.has_work():
            for out in scheduler.step().outputs:
                if out.id == 0:
                    tokens += out.tokens
                    finish = out.finish or finish
        assert finish == "length"
        # prefill samples the first token; each decode feeds one and samples the next, until 64 are held
        assert len(tokens) == 64 - len(long.prompt_tokens) + 1
        assert engine.kv_pages_used() == 0


def test_an_end_token_read_a_step_late_ends_the_sequence_there(tiny_model, tiny_tokenizer, step_mode):
    """End of generation is known only once a step is read. With steps launched ahead, the sequence has already
    been decoded once more when its end token is read: that extra token is dropped. Its tokens stop at the end
    token, exactly as with steps waited for, its batch-mate's are unchanged, and no sequence or page is left.
    The end by length is known ahead: the batch-mate is decoded exactly once per token after its first."""
    free, ending = _request(tiny_tokenizer, "hello world", 20), _request(tiny_tokenizer, "the people of", 20)
    engine = CpuEngine(tiny_model, max_seqs=2)
    greedy = list(generate_ids(engine, ending.prompt_tokens, 20))
    end = greedy[4]  # made an end-of-generation token for this request: it ends on its first occurrence
    spy = Spy(CpuEngine(tiny_model, max_seqs=2))
    scheduler = Scheduler(spy, 512)
    scheduler.add(_add(0, tiny_tokenizer, free))
    scheduler.add(Add(1, list(ending.prompt_tokens), ending.params, 20, [end]))
    tokens: dict[int, list[int]] = {0: [], 1: []}
    finish = {}
    while scheduler.has_work():
        for out in scheduler.step().outputs:
            tokens[out.id] += out.tokens
            if out.finish:
                finish[out.id] = out.finish
    assert tokens[1] == greedy[: greedy.index(end) + 1] and finish[1] == "eos"
    assert tokens[0] == list(generate_ids(engine, free.prompt_tokens, 20)) and finish[0] == "length"
    assert spy.live == 0 and spy.kv_pages_used() == 0
    assert spy.rows == len(tokens[0]) - 1 + len(tokens[1]) - 1 + step_mode  # the one row dropped ahead


def generate_ids(engine, prompt, n: int) -> list[int]:
    """Greedy token ids of one sequence alone, no end token."""
    q = engine.new_sequence(SamplingParams())
    out = [engine.prefill(q, prompt)]
    while len(out) < n:
        out += engine.decode([q], [out[-1]])
    engine.release(q)
    return out
