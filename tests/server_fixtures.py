"""Helpers for the server tests: a real `ingot serve` process on a free port, and reference outputs.

A ServerProcess runs `python -m ingot.toolchain serve MODEL --port P ...` and is ready when /health answers
200 (polled, with a deadline). `reference` runs the same request through runtime.generate in this process,
building the prompt as `ingot run` does (chat_prompt with --chat, Tokenizer.encode without), so a server
answer can be compared token for token.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.generate import SamplingParams, generate
from ingot.runtime.model.chat import chat_prompt
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.tokenizer import Tokenizer

READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | str, *args: str):
        self.args = [sys.executable, "-m", "ingot", "serve", str(model), *args]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ingot-serve-", suffix=".log", delete=False)
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [*self.args, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"NO_COLOR": "1"},
        )

    @property
    def output(self) -> str:
        return Path(self.log.name).read_text()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        """Poll /health until 200; fail with the server's output if it exits or the deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if "cannot listen on" in self.output:  # another process took the free port first: again
                    self.log.seek(0)
                    self.log.truncate()
                    self._start()
                    continue
                raise AssertionError(f"ingot serve exited with {self.proc.returncode}:\n{self.output}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"ingot serve was not ready within {timeout} s:\n{self.output}")

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"ingot serve did not exit within {timeout} s:\n{self.output}") from None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.wait_exit()
        os.unlink(self.log.name)
        return code

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}, e.g. 'ingot_sequences_total{reason="cancelled"}'."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_metric(self, name: str, predicate, timeout: float = 60) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics().get(name, 0.0)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)


@dataclass(frozen=True)
class Reference:
    text: str
    finish_reason: str  # eos, stop, length
    prompt_tokens: int
    completion_tokens: int


class ReferenceRunner:
    """Greedy generation in this process on the CPU engine, the prompt built as `ingot run` builds it."""

    def __init__(self, model_path: Path):
        self.model = load_model(model_path)
        self.tokenizer = Tokenizer.from_model(self.model)
        self.engine = CpuEngine(self.model, max_seqs=1)

    def prompt_tokens(self, messages: list[dict] | None = None, prompt: str | None = None) -> list[int]:
        return chat_prompt(self.tokenizer, messages) if messages is not None else self.tokenizer.encode(prompt)

    def __call__(
        self,
        messages: list[dict] | None = None,
        prompt: str | None = None,
        max_tokens: int = 16,
        stop: tuple[str, ...] = (),
    ) -> Reference:
        tokens = self.prompt_tokens(messages, prompt)
        chunks = list(generate(self.engine, self.tokenizer, tokens, SamplingParams(), max_tokens, stop))
        return Reference(
            "".join(c.text for c in chunks),
            chunks[-1].finish_reason,
            len(tokens),
            sum(len(c.token_ids) for c in chunks),
        )


def sse_events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of each server-sent event in a streamed response."""
    events, name, data = [], None, []
    for line in response.iter_lines():
        if line == "":
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        events.append((name, "\n".join(data)))
    return events
