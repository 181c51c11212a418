"""`ingot bench`: llama-bench-style throughput of an engine (ingot.runtime.bench)."""

from __future__ import annotations

import click
from rich.table import Table

from ingot.runtime.bench import cold_start, run_benchmarks, tg_prompt_len
from ingot.runtime.engines import open_engine
from ingot.runtime.errors import UsageError
from ingot.toolchain.cli.models import open_model_for_cli
from ingot.toolchain.cli.options import device_option, json_option, model_argument, pubkey_option
from ingot.toolchain.cli.output import emit_json, out


def _int_list(option: str, text: str, low: int, example: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a list of integers", hint=f"e.g. {option} {example}") from None
    if not values or min(values) < low:
        raise UsageError(f"{option} values must be >= {low}", hint=f"e.g. {option} {example}")
    return values


@click.command()
@model_argument
@click.option(
    "-p",
    "--n-prompt",
    "prompts",
    default="512",
    show_default=True,
    metavar="LIST",
    help="Prompt tokens for the pp tests, e.g. 512,2048 (llama-bench's -p; 0 skips them).",
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
@click.option(
    "-d",
    "--depth",
    "depths",
    default="0",
    show_default=True,
    metavar="LIST",
    help="Tokens already in the cache before each test, e.g. 0,4096,16384 (llama-bench's -d).",
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
    model_spec,
    prompts,
    n_gen,
    n_prefix,
    reps,
    batches,
    depths,
    device,
    with_cold_start,
    allow_unverified,
    pubkeys,
    as_json,
):
    """Throughput like llama-bench: pp (prefill), tg (batch-1 and batched decode), each at the cache depths
    asked for, pp with a cached prefix, cold start, GPU memory; on a known GPU each figure's share of the
    hardware's ceiling."""
    sizes = _int_list("--batch", batches, 1, "1,4,16")
    depth_list = _int_list("--depth", depths, 0, "0,4096")
    prompt_list = [n for n in _int_list("-p", prompts, 0, "512,2048") if n]  # (0 only asks for no pp test)
    if n_prefix:
        if not prompt_list:
            raise UsageError("--prefix times a pp test, and -p 0 asks for none", hint=f"e.g. -p {n_prefix + 512}")
        shortest = prompt_list[0]  # (_int_list sorts)
        if n_prefix >= shortest:
            raise UsageError(
                f"--prefix {n_prefix} leaves no prompt tokens to compute in pp{shortest}",
                hint=f"use --prefix < {shortest}, the shortest -p",
            )
    opened = open_model_for_cli(model_spec, allow_unverified, quiet=as_json, pubkeys=pubkeys)
    model = opened.model
    # the longest sequence: the deepest cache, then the longest pp prompt or the longest tg prompt and its generation
    longest = max(depth_list) + max([*prompt_list, tg_prompt_len(max(sizes) - 1) + n_gen]) + 8
    engine = open_engine(model, device, kernels=opened.kernels, max_seqs=max(sizes), max_ctx=longest)
    try:
        report = run_benchmarks(
            engine,
            n_prompts=tuple(prompt_list),
            n_gen=n_gen,
            reps=reps,
            batches=sizes,
            depths=tuple(depth_list),
            n_prefix=n_prefix,
            model=model,
        )
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
    ceiling = report.get("ceiling")
    for col in ("test", "t/s", "of ceiling", "ms/rep", "reps"):
        table.add_column(col, justify="left" if col == "test" else "right")
    for r in report["results"]:
        rate = f"{r['tok_s_mean']:,.1f} ± {r['tok_s_std']:,.1f}" if r["n_tokens"] > 1 else "-"
        share = "-"
        if r.get("ceiling_share") is not None:
            share = f"{100 * r['ceiling_share']:.0f}% {'HBM' if r['bound'] == 'memory' else 'TC'}"
        table.add_row(r["test"], rate, share, f"{r['ms_mean']:,.2f}", str(r["reps"]))
    out.print(table)
    if ceiling:
        click.echo(
            f"ceiling ({ceiling['source']}, {ceiling['gpu']}): {ceiling['memory_bytes_s'] / 1e12:.2f} TB/s memory "
            f"(decode: weights + KV read per step), {ceiling['tensor_flop_s'] / 1e12:.0f} TFLOP/s dense fp16/bf16 "
            "(prefill)"
        )
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
