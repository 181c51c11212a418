"""`ingot serve`: an HTTP server for one model, speaking the OpenAI, Anthropic and Ollama APIs.

    app.py        the Starlette app: routes, API key, body limits, errors, streaming, startup and shutdown
    request.py    TextRequest, the one request type the three dialects translate into; ApiError
    openai.py, anthropic.py, ollama.py    each dialect's parsing and response shapes
    scheduler.py  continuous batching: the engine thread that admits, prefills and decodes all sequences
    metrics.py    /metrics (Prometheus)
    loadgen.py    a load generator: N concurrent streaming clients, aggregate tok/s and time to first token

The server's libraries (starlette, uvicorn, sse-starlette, prometheus-client) are the `serve` extra; this
module imports none of them, so the package works without them and `ingot serve` says what to install.
"""
from __future__ import annotations

import importlib

import click

from ingot.toolchain.errors import UsageError

from ..engines import DEVICES

SERVER_PACKAGES = ("starlette", "uvicorn", "sse_starlette", "prometheus_client")


def _require_server_libraries() -> None:
    for name in SERVER_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(f"ingot serve needs the {name} package", hint="pip install 'ingot-llm[serve]'") from None


@click.command()
@click.argument("model_spec", metavar="MODEL")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
              help="Engine: the GPU (cuda), the numpy reference (cpu), or cuda when a GPU is present.")
@click.option("--gpu", type=click.IntRange(min=0), help="GPU index (default: the one with the most free memory).")
@click.option("--api-key", envvar="INGOT_API_KEY",
              help="Require this key (Authorization: Bearer KEY or x-api-key: KEY); also $INGOT_API_KEY.")
@click.option("--max-seqs", default=32, show_default=True, type=click.IntRange(min=1),
              help="Sequences generated together (more requests wait in a queue).")
@click.option("--ctx", type=click.IntRange(min=16), help="Tokens per sequence (default: the model's, at most 8192).")
def serve(model_spec, host, port, device, gpu, api_key, max_seqs, ctx):
    """Serve MODEL over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models), Anthropic
    (/v1/messages) and Ollama (/api/chat, /api/generate, /api/tags, /api/show) APIs, with streaming.

    MODEL is a .gguf file, a .ingot bundle, or `smollm2`. The socket opens at once and /health answers 503
    until the model is loaded, then 200; /metrics is Prometheus text. Concurrent requests are batched into
    one decode step. Stop with Ctrl-C or SIGTERM: in-flight requests get a few seconds to finish.
    """
    _require_server_libraries()
    from .app import Options
    from .app import serve as run_server

    run_server(model_spec, Options(device=device, gpu=gpu, max_seqs=max_seqs, ctx=ctx, api_key=api_key or None),
               host=host, port=port)
