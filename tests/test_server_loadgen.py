"""The load generator and the streaming path it measures, on the tiny synthetic model: the report's TTFT and
per-stream figures are present (they came back null on the H200: the synthetic SmolLM2 generates control tokens,
which have no text and used to have no event), clients split across processes are merged into one report, a
completion stream has an event per generated token, and the interference mode runs against a server whose
context holds the long prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_fixtures import ServerProcess
from sse_starlette import ServerSentEvent

from ingot.runtime.generate import Chunk
from ingot.runtime.server import loadgen, openai
from ingot.runtime.server.server import frame


@pytest.fixture(scope="module")
def server(synth_model):
    s = ServerProcess(synth_model("tiny", "Q8_0"), "--device", "cpu", "--max-seqs", "8").wait_ready()
    yield s
    s.stop()


@pytest.mark.parametrize("procs", [1, 2])
def test_the_load_report_has_ttft_and_merges_processes(server, procs):
    report = asyncio.run(loadgen.run(server.url, 4, 2, 16, 12, 0.0, None, seed=0, procs=procs))
    assert report["failed"] == 0, report["errors"]
    assert report["procs"] == procs and report["requests"] == 8  # every process's samples are in it
    assert report["client_processes"] == procs  # each share in its own process (the start barrier)
    assert 0 < report["generated_tokens"] <= 8 * 12  # the server's usage, EOS may end one early
    ttft, decode = report["ttft_ms"], report["decode_tok_s_per_stream"]
    assert ttft["p50"] is not None and 0 < ttft["p50"] <= ttft["p95"] <= ttft["max"]
    assert ttft["max"] < report["wall_s"] * 1000  # a first token comes before the run's end
    assert decode["p50"] is not None and decode["p50"] > 0
    # What the server counted over the run: the same tokens as the clients' usage, every prompt token admitted
    # (none cached: fresh prompts of 16 tokens fill no page), steps no wider than the clients
    srv = report["server"]
    assert srv["generated_tokens"] == report["generated_tokens"]
    assert srv["prompt_tokens"] == 8 * 16 and srv["prefix_saved_tokens"] == 0
    assert srv["decode_steps"] >= 11  # 12 tokens: the first comes from the prefill
    assert 1 <= srv["mean_batch"] <= 4
    # measured (the process collector's CPU seconds), not computed: /proc counts them in 10 ms ticks, and a run
    # this short can cost the front end less than one (the CI's fresh clone saw 0.0), so only its presence and sign
    assert srv["front_end_cpu_us_per_token"] is not None and srv["front_end_cpu_us_per_token"] >= 0


def test_the_load_report_has_no_server_figures_without_ingot_metrics():
    """Another server's /metrics (or none): the report says nothing rather than something wrong."""

    async def scrape_nothing():
        async with httpx.AsyncClient() as client:
            return await loadgen._scrape(client, "http://127.0.0.1:9")  # nothing listens (the discard port)

    assert asyncio.run(scrape_nothing()) is None
    assert loadgen._server_figures(None, {"ingot_decode_batch_size_count": 1.0}, 1.0) is None
    before = dict.fromkeys(loadgen._SERIES, 0.0)
    after = before | {"ingot_decode_batch_size_count": 4.0, "ingot_decode_batch_size_sum": 10.0}
    after |= {"ingot_generated_tokens_total": 20.0, "process_cpu_seconds_total": 0.001}
    figures = loadgen._server_figures(before, after, 2.0)
    assert figures is not None
    assert (figures["decode_steps"], figures["mean_batch"], figures["wall_ms_per_decode_step"]) == (4, 2.5, 500.0)
    assert figures["front_end_cpu_us_per_token"] == 50.0


def test_each_run_sends_fresh_prompts_unless_seeded(server):
    """Two runs without a seed share no prompt page with each other (the prefix cache saves nothing); the same seed
    twice does (so this test can tell the two apart)."""
    saved = "ingot_prefix_cache_saved_prefill_tokens"

    def run(seed):
        before = server.metrics()[saved]
        report = asyncio.run(loadgen.run(server.url, 2, 1, 64, 2, 0.0, None, seed=seed))
        assert report["failed"] == 0, report["errors"]
        return server.metrics()[saved] - before

    run(None)
    assert run(None) == 0
    run(12345)
    assert run(12345) >= 2 * 32  # each client's first page (the last one holds the token that must be computed)


class _Job:
    """What openai._stream reads of a Job: its chunks (and the usage at the end)."""

    prompt_tokens, completion_tokens = 3, 3

    def __init__(self, chunks: list[Chunk]):
        self._chunks = chunks

    async def chunks(self):
        for c in self._chunks:
            yield c


def _events(chat: bool) -> list[dict | str]:
    chunks = [Chunk("", (5,)), Chunk("a", (6,)), Chunk("", (7,)), Chunk("", (), "eos")]
    head = {"id": "x", "object": "o", "created": 0, "model": "m"}

    async def run() -> list[bytes]:
        return [e async for e in openai._stream(_Job(chunks), head, chat, True, None)]

    out: list[dict | str] = []
    for e in asyncio.run(run()):
        assert e.startswith(b"data: ") and e.endswith(b"\n\n") and e.count(b"\n") == 2  # one data line
        data = e[6:-2].decode()
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_a_completion_stream_has_an_event_per_token_with_text_or_not():
    events = _events(chat=False)
    texts = [e["choices"][0]["text"] for e in events[:-2] if isinstance(e, dict) and e["choices"]]
    assert texts == ["", "a", "", ""]  # three tokens, then the finish event
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-1] == "[DONE]"


def test_a_chat_stream_has_no_empty_deltas():
    events = _events(chat=True)
    deltas = [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {}]  # role, text, finish


def test_frames():
    assert frame(b"data: x\n\n") == b"data: x\n\n"
    assert frame('{"a":1}\n') == b'{"a":1}\n'  # an NDJSON line
    assert frame(ServerSentEvent(event="ping", data="{}", sep="\n")) == b"event: ping\ndata: {}\n\n"


def test_interference_runs_against_a_long_context(synth_model):
    """The interference mode end to end on the CPU (its delay is the CPU engine's, not checked here): the
    server's --ctx holds the long prompt, and the stream's tokens are timed although they have no text."""
    s = ServerProcess(synth_model("tiny-4k", "Q8_0"), "--device", "cpu", "--max-seqs", "2", "--ctx", "4096")
    try:
        report = asyncio.run(loadgen.interference(s.wait_ready().url, 1200, 600, None, seed=2))
    finally:
        s.stop()
    assert report["long_prompt_tokens"] == 1200 and report["long_prompt_s"] > 0
    assert report["stream_tokens"] > 64  # it kept streaming past the long prompt
    assert report["gap_ms_during_max"] >= report["gap_ms_before_p50"] >= 0
