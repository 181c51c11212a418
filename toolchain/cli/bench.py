"""`ingot bench`: llama-bench-style throughput of an engine (ingot.runtime.bench)."""

from __future__ import annotations

import click
from rich.table import Table

from ingot.runtime.bench import cold_start, run_benchmarks
from ingot.runtime.engines import open_engine
from ingot.runtime.errors import UsageError
from ingot.runtime.resolve import open_model
from ingot.toolchain.cli.options import device_option, json_option, model_argument, pubkey_option
from ingot.toolchain.cli.output import emit_json, out


@click.command()
@model_argument
@click.option(
    "-p",
    "--n-prompt",
    default=512,
    show_default=True,
    type=click.IntRange(min=0),
    help="Prompt tokens for the pp test (0 skips it).",
)
@click.option(
    "-n",
    "--n-gen",
    default=128,
    show_default=True,
    type=click.IntRange(min=0),
    help="Generated tokens for the tg tests (0 skips them).",
)
@click.option(
    "--prefix",
    "n_prefix",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Also run pp with its first N tokens shared by every repetition (the prefix cache's saving; 0 skips it).",
)
@click.option(
    "-r",
    "--reps",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Timed repetitions per test (after one warm-up).",
)
@click.option(
    "--batch",
    "batches",
    default="1",
    show_default=True,
    metavar="LIST",
    help="Decode batch sizes, e.g. 1,4,16,64 (tg at each).",
)
@device_option
@click.option(
    "--cold-start/--no-cold-start",
    "with_cold_start",
    default=True,
    show_default=True,
    help="Also time `ingot run MODEL -n 1` in a fresh process (spawn -> first token).",
)
@click.option("--allow-unverified", is_flag=True, help="Benchmark a bundle that does not verify.")
@pubkey_option
@json_option("the results")
def bench(
    model_spec, n_prompt, n_gen, n_prefix, reps, batches, device, with_cold_start, allow_unverified, pubkeys, as_json
):
    """Throughput like llama-bench: pp (prefill), tg (batch-1 and batched decode), cold start, GPU memory."""
    try:
        sizes = sorted({int(b) for b in batches.split(",") if b.strip()})
    except ValueError:
        raise UsageError(f"--batch {batches!r} is not a list of integers", hint="e.g. --batch 1,4,16") from None
    if not sizes or min(sizes) < 1:
        raise UsageError("--batch sizes must be >= 1")
    if n_prefix and n_prefix >= n_prompt:
        raise UsageError(
            f"--prefix {n_prefix} leaves no prompt tokens to compute", hint=f"use --prefix < -p {n_prompt}"
        )
    opened = open_model(model_spec, allow_unverified=allow_unverified, pubkeys=pubkeys)
    model = opened.model
    engine = open_engine(
        model, device, kernels=opened.kernels, max_seqs=max(sizes), max_ctx=max(n_prompt, 8 * max(sizes)) + n_gen + 8
    )
    try:
        report = run_benchmarks(engine, n_prompt=n_prompt, n_gen=n_gen, reps=reps, batches=sizes, n_prefix=n_prefix)
        backend = engine.name
    finally:
        engine.close()
    if with_cold_start:
        report["results"].append(cold_start(model_spec, backend).as_dict())
    c = model.config
    report["model"] = {
        "name": model.name,
        "arch": c.arch,
        "params": model.n_params,
        "size_bytes": sum(t.nbytes for t in model.tensors.values()),
        "quant_types": model.quant_types,
        "backend": backend,
    }
    if as_json:
        emit_json(report)
        return
    m = report["model"]
    table = Table(
        title=f"{m['name']} ({m['arch']}, {m['params'] / 1e6:,.0f}M params, "
        f"{m['size_bytes'] / 2**20:,.0f} MiB, {'/'.join(m['quant_types'])}) on {backend}"
    )
    for col in ("test", "t/s", "ms/rep", "reps"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for r in report["results"]:
        rate = f"{r['tok_s_mean']:,.1f} ± {r['tok_s_std']:,.1f}" if r["n_tokens"] > 1 else "-"
        table.add_row(r["test"], rate, f"{r['ms_mean']:,.2f}", str(r["reps"]))
    out.print(table)
    p = report["prefix_cache"]
    if n_prefix and p["queried_tokens"]:
        click.echo(
            f"prefix cache {'on' if p['enabled'] else 'off (INGOT_PREFIX_CACHE=0)'}: {p['hit_tokens']} of "
            f"{p['queried_tokens']} prompt tokens read from cached pages ({p['hit_rate']:.0%})"
        )
    if "gpu" in report:
        g = report["gpu"]
        click.echo(
            f"GPU {g['device']}: weights {g['weights_bytes'] / 2**20:,.0f} MiB, engine total "
            f"{g['engine_bytes'] / 2**20:,.0f} MiB ({g['kv_pages']} KV pages), device memory in use "
            f"{g['device_used_bytes'] / 2**20:,.0f} MiB"
        )
