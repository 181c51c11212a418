"""`ingot serve`: the HTTP server (ingot.runtime.server) for one model or several."""

from __future__ import annotations

import click

from ingot.runtime.server import require_server_libraries
from ingot.toolchain.cli.options import device_option, gpu_option, pubkey_option


@click.command()
@click.argument("model_specs", metavar="MODEL...", nargs=-1, required=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@device_option
@gpu_option
@click.option(
    "--api-key",
    envvar="INGOT_API_KEY",
    help="Require this key (Authorization: Bearer KEY or x-api-key: KEY); also $INGOT_API_KEY.",
)
@click.option(
    "--max-seqs",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Sequences generated together (more requests wait in a queue).",
)
@click.option("--ctx", type=click.IntRange(min=16), help="Tokens per sequence (default: the model's, at most 8192).")
@pubkey_option
def serve(model_specs, host, port, device, gpu, api_key, max_seqs, ctx, pubkeys):
    """Serve MODEL over HTTP: OpenAI (/v1/chat/completions, /v1/completions, /v1/models), Anthropic
    (/v1/messages) and Ollama (/api/chat, /api/generate, /api/tags, /api/show) APIs, with streaming.

    MODEL is a .gguf file, a .ingot bundle, or `smollm2`; several, or a folder of them, serve several models
    (each loaded on its first request, unloaded after INGOT_KEEP_ALIVE idle seconds or a request's keep_alive).
    The socket opens at once and /health answers 503 until the model is loaded, then 200; /metrics is
    Prometheus text. Concurrent requests are batched into one decode step, in an engine process of its own;
    one front-end process detokenizes and streams every response (load test it with
    `python -m ingot.runtime.server.loadgen --clients 64 --procs 4`).
    Stop with Ctrl-C or SIGTERM: in-flight requests get a few seconds to finish. Replace the model file and
    send SIGHUP (or POST /api/reload) to swap it without dropping requests.
    """
    require_server_libraries()
    # deferred: the server's libraries are the optional `serve` extra (checked just above)
    from ingot.runtime.server.app import Options
    from ingot.runtime.server.app import serve as run_server

    run_server(
        list(model_specs),
        Options(device=device, gpu=gpu, max_seqs=max_seqs, ctx=ctx, api_key=api_key or None, pubkeys=tuple(pubkeys)),
        host=host,
        port=port,
    )
