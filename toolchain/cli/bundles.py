"""Bundle commands: `ingot pack`, `verify`, `keygen`, `sign`, `rebuild`, `sbom`."""

from __future__ import annotations

from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ingot.runtime.bundle.verify import verify_bundle
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.selftest import run_selftest
from ingot.toolchain.cli.output import bytes_bar, emit_json, err, mib, out
from ingot.toolchain.pack import pack as run_pack
from ingot.toolchain.rebuild import rebuild_check
from ingot.toolchain.sbom import FORMATS as SBOM_FORMATS
from ingot.toolchain.sbom import write_sbom
from ingot.toolchain.sign import keygen as run_keygen
from ingot.toolchain.sign import sign_bundle


@click.command()
@click.option(
    "--model", "model", required=True, type=click.Path(dir_okay=False, path_type=Path), help="The GGUF model to pack."
)
@click.option(
    "--kernels",
    "kernel_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="A folder written by `ingot build` (default: run the default build into dist/kernels).",
)
@click.option("--name", help="Bundle name; the model becomes model/NAME.gguf (default: the model file's stem).")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The bundle file to write (default: dist/NAME.ingot).",
)
@click.option(
    "--no-selftest",
    is_flag=True,
    help="Skip the CPU reference logits recorded for `ingot verify --device` (for huge models).",
)
@click.option(
    "--source",
    "sources",
    multiple=True,
    metavar="URL",
    help="Where the model came from (repeatable), for the manifest and `ingot sbom`; added to the URLs the GGUF "
    "declares.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def pack(model, kernel_dir, name, out_file, no_selftest, sources, as_json):
    """Pack fatbins, a GGUF model, provenance and a manifest into one deterministic bundle.

    Same inputs give the same bytes: members are sorted, every mtime is $SOURCE_DATE_EPOCH (default 0).
    """
    size = model.stat().st_size if model.is_file() else 0
    with bytes_bar(as_json) as bar:
        task = bar.add_task("packing", total=2 * size)  # hashed once, then copied
        result = run_pack(
            model,
            kernels=kernel_dir,
            name=name,
            out=out_file,
            selftest=not no_selftest,
            source_urls=sources,
            on_stage=lambda text: bar.update(task, description=text),
            on_bytes=lambda n: bar.advance(task, n),
        )
    if as_json:
        emit_json(result)
        return
    out.print(f"{result['sha256']}  {result['bundle']}  ({mib(result['size'])})")
    out.print(f"  root digest  {result['root_digest']}")
    out.print(f"  model data   at offset {result['model_offset']:,} (4096-aligned, mapped in place)")
    out.print(f"  members      {', '.join(m['name'] for m in result['members'])}")
    if not result["selftest"]:
        out.print("  self-test    skipped (--no-selftest)")


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option(
    "--pubkey",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Require a valid signature by this public key (PREFIX.pub from `ingot keygen`: ECDSA P-256 or Ed25519).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (also on failure).")
@click.option(
    "--device",
    "on_device",
    is_flag=True,
    help="Also run the on-GPU self-test: the bundle's kernels on this GPU must reproduce the CPU "
    "reference logits recorded at pack time.",
)
@click.option("--gpu", "gpu_index", default=0, show_default=True, type=int, help="GPU for --device.")
def verify(bundle, pubkey, as_json, on_device, gpu_index):
    """Recompute every digest of a bundle, check its root digest and signature, and refuse unsafe members.

    Exit 0 if it verifies, 4 naming the bad member (and 64 MiB chunk) otherwise, 3 if it is intact but
    packed for a kernel ABI this Ingot does not run; with --device, 4 also when the GPU self-test disagrees
    with the CPU reference, 3 when there is no GPU to run it on.
    """
    size = bundle.stat().st_size if bundle.is_file() else 0
    try:
        with bytes_bar(as_json) as bar:
            task = bar.add_task(f"verifying {bundle.name}", total=size)
            report = verify_bundle(bundle, pubkey=pubkey, on_bytes=lambda n: bar.advance(task, n))
    except VerificationError as e:
        if as_json:
            emit_json(
                {
                    "ok": False,
                    "bundle": str(bundle),
                    "error": e.message,
                    "hint": e.hint,
                    "problems": getattr(e, "problems", []),
                }
            )
        raise
    if on_device:
        report["selftest"] = run_selftest(bundle, gpu=gpu_index, pubkey=pubkey)
    if as_json:
        emit_json(report)
        return
    out.print(f"[green]ok[/green]  {bundle}  root {report['root_digest']}")
    out.print(
        f"  {report['members']} members, {mib(report['hashed_bytes'])} hashed in {report['seconds']:.2f} s"
        + (f" ({report['mb_per_s']:,.0f} MB/s)" if report["mb_per_s"] else "")
    )
    sig = report["signature"]
    if sig is None:
        out.print("  signature    none (unsigned bundle)")
    elif sig["authenticated"]:
        out.print(f"  signature    valid, by --pubkey {pubkey} (keyid {sig['keyid'][:16]}...)")
    else:
        out.print(
            f"  signature    present, key hint {sig['keyid'][:16] or '(none)'}..., signs this bundle "
            "(pass --pubkey to check the signature and who made it)"
        )
    rt = report["runtime"]
    out.print(
        f"  runtime      this Ingot runs it: kernel ABI {rt['kernel_abi']} ({rt['weight_layout']}), "
        f"packed by Ingot {rt['packed_by']}"
    )
    if on_device:
        st = report["selftest"]
        out.print(
            f"  GPU self-test passed on {st['device']}: argmax {st['argmax']} as recorded, top logits within "
            f"{st['top_rel_err']:.1e}, log-sum-exp {st['logsumexp']:.3f} (recorded {st['expected_logsumexp']:.3f})"
        )


@click.command()
@click.option(
    "--out",
    "prefix",
    required=True,
    type=click.Path(path_type=Path),
    metavar="PREFIX",
    help="Writes PREFIX.key (private, mode 0600) and PREFIX.pub.",
)
@click.option(
    "--algorithm",
    type=click.Choice(["p256", "ed25519"]),
    default="p256",
    show_default=True,
    help="ECDSA P-256 (verifiable with `model_signing verify key`) or Ed25519.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the paths and keyid as JSON.")
def keygen(prefix, algorithm, as_json):
    """Create a signing key pair for `ingot sign` and `ingot verify --pubkey`."""
    result = run_keygen(prefix, algorithm)
    if as_json:
        emit_json(result)
        return
    out.print(f"private key  {result['key']}  (keep it secret; mode 0600)")
    out.print(f"public key   {result['pub']}  (give it to users: ingot verify BUNDLE --pubkey {result['pub']})")
    out.print(f"keyid        {result['keyid']}  ({result['algorithm']}; sha256 of the .pub file, model_signing's hint)")


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--key", type=click.Path(dir_okay=False, path_type=Path), help="PREFIX.key from `ingot keygen`.")
@click.option(
    "--attach",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Instead of --key: put in this Sigstore bundle (e.g. from `model_signing sign key` over the extracted "
    "bundle) after checking it signs this bundle.",
)
@click.option(
    "--pubkey",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --attach: also require the attached signature to be valid for this public key.",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the signed bundle here (default: replace BUNDLE, atomically).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sign(bundle, key, attach, pubkey, out_file, as_json):
    """Sign a bundle's root digest into signature.sigstore.json: a Sigstore bundle (v0.3) with a DSSE envelope
    of an in-toto statement in the OpenSSF model_signing v1.0 format (needs the `release` extra)."""
    result = sign_bundle(bundle, key, out_file, attach=attach, pubkey=pubkey)
    if as_json:
        emit_json(result)
        return
    out.print(f"{result['sha256']}  {result['bundle']}  signed by keyid {result['keyid'][:16]}...")


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--check", is_flag=True, help="Rebuild the kernels here and compare them byte for byte.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def rebuild(bundle, check, as_json):
    """Prove a bundle's kernels are a reproducible build: recompile with the recorded archs and flags.

    Exit 0 if every fatbin is byte-identical, 4 naming each module that differs and why.
    """
    if not check:
        raise UsageError("rebuild only checks for now", hint="run `ingot rebuild --check BUNDLE`")
    with Progress(
        TextColumn("rebuilding {task.fields[module]:<12}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=as_json or not err.is_terminal,
    ) as bar:
        task = bar.add_task("rebuild", total=None, module="")
        report = rebuild_check(bundle, on_module=lambda m, done: bar.update(task, completed=done, module=m))
    if as_json:
        emit_json(report)
    else:
        table = Table(title=f"rebuild of {bundle} with {report['local']['nvcc']}")
        for col in ("module", "result", "sha256 (bundle)", "why it differs"):
            table.add_column(col)
        for m in report["modules"]:
            table.add_row(
                m["module"],
                "[green]identical[/]" if m["identical"] else "[red]differs[/]",
                m["recorded_sha256"][:16],
                "\n".join(m["reasons"]),
            )
        out.print(table)
    bad = [m for m in report["modules"] if not m["identical"]]
    if bad:
        raise VerificationError(
            f"{len(bad)} of {len(report['modules'])} kernel modules differ from the bundle: "
            f"{bad[0]['module']} ({bad[0]['reasons'][0]})",
            hint="rebuild with the recorded toolkit and sources (see the table or --json)",
        )


@click.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(SBOM_FORMATS),
    default="cyclonedx-json",
    show_default=True,
    help="The BOM format.",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the BOM here (default: print it).",
)
def sbom(bundle, fmt, out_file):
    """Emit the AI-BOM of a verified bundle: a CycloneDX 1.6 ML-BOM (model with license and source, kernels
    with archs, every member's sha256, toolchain, Python dependencies), schema-validated (`release` extra).

    Exit 0 written; 4 the bundle fails verification; 2 bad arguments or the extra is missing.
    """
    text = write_sbom(bundle, out_file, fmt)
    if out_file is None:
        click.echo(text, nl=False)
    else:
        out.print(f"{out_file}  CycloneDX 1.6 ML-BOM of {bundle}")
