"""`ingot serve`: an HTTP server for one model, speaking the OpenAI, Anthropic and Ollama APIs.

    server.py     Server: the loaded model, engine client, metrics and limits; API key, body, prompt, jobs, streaming
    app.py        the Starlette app: assembles the dialects' routes, errors, startup and shutdown; runs uvicorn
    request.py    TextRequest, the one request type the three dialects translate into; ApiError
    openai.py, anthropic.py, ollama.py    each dialect's parsing and response shapes
    client.py     the front end's side of the engine core: Jobs, detokenization and stop strings, cancel, drain
    core.py       the engine core process: opens the engine, runs the step loop, talks over pyzmq
    scheduler.py  continuous batching with chunked prefill: the step loop (inside the core process)
    protocol.py   the msgspec messages between front end and core
    metrics.py    /metrics (Prometheus)
    loadgen.py    a load generator: N concurrent streaming clients, aggregate tok/s and time to first token

The server's libraries (starlette, uvicorn, sse-starlette, prometheus-client, pyzmq, msgspec) are the `serve`
extra; this package's __init__ imports none of them, so the runtime works without them, and `ingot serve`
(toolchain/cli/serve.py) checks for them with `require_server_libraries` and says what to install.
"""

from __future__ import annotations

import importlib

from ingot.runtime.errors import UsageError

SERVER_PACKAGES = ("starlette", "uvicorn", "sse_starlette", "prometheus_client", "zmq", "msgspec")
INSTALL_HINT = "install the serve extra: pip install '.[serve]' in a checkout, or 'WHEEL.whl[serve]'"


def require_server_libraries() -> None:
    for name in SERVER_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            raise UsageError(f"ingot serve needs the {name} package", hint=INSTALL_HINT) from None
