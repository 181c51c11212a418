"""The `ingot` command line. Commands are thin: they parse options, call one module, and print a table
or JSON. `main` is the one place where errors become exit codes (see toolchain/errors.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from rich.markup import escape

from .errors import EXIT_FAILURE, EXIT_INCOMPATIBLE, EXIT_USAGE, IncompatibleError, IngotError

out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ingot-llm", prog_name="ingot")
def cli():
    """Ingot: build verifiable LLM inference bundles for NVIDIA GPUs, and run them.

    Exit codes: 0 ok, 1 runtime failure, 2 usage error, 3 incompatible or missing GPU/driver/toolkit,
    4 verification failed, 5 bad or unsupported model, 6 kernel build failed.
    """


# --- kernels: build, inspect, doctor, check-compat ----------------------------------------------

@cli.command()
@click.option("--arch", "arch_list", metavar="LIST", help="Archs to build, e.g. sm_80,sm_90,compute_90 "
              "(default: SASS for sm_75..sm_120 plus compute_120 PTX; see cuda/archs.json).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=Path("dist/kernels"),
              show_default=True, help="Folder for the fatbins and build.json.")
@click.option("--no-cache", is_flag=True, help="Recompile even if the kernel cache has this exact build.")
@click.option("--jobs", "-j", type=click.IntRange(min=0), default=0, show_default=True,
              help="Archs nvcc compiles in parallel per module (0: one per CPU); the fatbins are the same bytes.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def build(arch_list, out_dir, no_cache, jobs, as_json):
    """Compile cuda/*.cu into multi-arch fatbins (no GPU needed)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .archs import parse_arch_list
    from .build import build as run_build
    from .build import kernel_source_dir

    archs = parse_arch_list(arch_list) if arch_list else None
    n = len(list(kernel_source_dir().glob("*.cu")))
    with Progress(TextColumn("compiling {task.fields[module]:<12}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=as_json) as bar:
        task = bar.add_task("build", total=n, module="")
        result = run_build(archs=archs, out_dir=out_dir, use_cache=not no_cache, threads=jobs,
                           on_module=lambda m, done: bar.update(task, completed=done, module=m))
    if as_json:
        emit_json(result.as_dict())
        return
    table = Table(title=f"nvcc {result.toolkit.version} ({result.toolkit.build}) -> {out_dir}")
    for col in ("module", "arch", "kind", "bytes", "compile s"):
        table.add_column(col, justify="right" if col in ("bytes", "compile s") else "left")
    for m in result.modules:
        for i, a in enumerate(m.per_arch):
            table.add_row(m.name if i == 0 else "", a.arch, a.kind, f"{a.bytes:,}",
                          "cached" if m.cached else f"{a.seconds:.2f}")
        table.add_row("", "[b]total[/b]", "", f"[b]{m.size:,}[/b]", "cached" if m.cached else f"{m.seconds:.2f}",
                      end_section=True)
    out.print(table)
    for m in result.modules:
        out.print(f"{m.sha256}  {m.path}  ({len(m.kernels)} kernels)")


@cli.command()
@click.argument("fatbin", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def inspect(fatbin, as_json):
    """List every SASS and PTX image in a fatbin, and its kernels (no cuobjdump needed)."""
    from .fatbin import read_fatbin

    fat = read_fatbin(fatbin)
    if as_json:
        emit_json({"path": str(fatbin)} | fat.as_dict())
        return
    table = Table(title=f"{fatbin} ({fat.size:,} bytes)")
    for col in ("kind", "arch", "variant", "PTX ISA", "built by", "compression", "stored", "size", "kernels"):
        table.add_column(col)
    for e in fat.entries:
        variant = {"a": "arch-specific", "f": "family", "": "-"}[e.variant]
        table.add_row(e.kind.upper(), e.arch, variant, e.isa or "-", f"CUDA {e.toolkit}" if e.toolkit else "-",
                      e.compression, f"{e.stored_size:,}", f"{e.size:,}", str(len(e.kernels)))
    out.print(table)
    out.print(f"kernels ({len(fat.kernels)}): " + ", ".join(fat.kernels))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json):
    """Report nvcc, host compiler, CMake, driver and GPUs, and whether the installed kernels run here."""
    from .doctor import report

    r = report()
    if as_json:
        emit_json(r)
        return
    tk = r["toolkit"]
    out.print("[b]Build[/b]")
    out.print(f"  nvcc          {tk['version']} {tk['build']} at {tk['nvcc']} (via {tk['found_via']})" if tk
              else "  nvcc          not found")
    hc = r["host_compiler"]
    out.print(f"  host compiler {hc['version'] or 'not found'}" + (f" ({hc['path']})" if hc["path"] else ""))
    out.print(f"  cmake         {r['cmake'] or 'not found'}")
    m = r["machine"]
    out.print("[b]Run[/b]")
    out.print(f"  driver        {m['driver_version'] or '-'} (CUDA {m['driver_cuda']})" if m["driver_cuda"]
              else f"  driver        none ({m['problem']})")
    for g in m["gpus"]:
        free = _mib(g["memory_free"]) if g["memory_free"] is not None else "?"
        out.print(f"  GPU {g['index']}         {g['name']}, compute capability {g['compute_capability']}, "
                  f"{free} free of {_mib(g['memory_total'])}")
    out.print(f"[b]Installed kernels[/b] ({r['kernel_dir']})")
    for k in r["kernels"]:
        out.print(f"  {k['module']:<20} " + (f"unreadable: {k['problem']}" if k["problem"] else
                                            f"SASS {','.join(k['sass']) or '-'}  PTX {','.join(k['ptx']) or '-'}"))
        for g in k["on_gpus"]:
            out.print(f"      GPU {g['gpu']}: {g['verdict']} ({g['reason']})" + (f"; fix: {g['fix']}" if g["fix"] else ""))
    if r["advice"]:
        out.print("[b]Advice[/b]")
        for a in r["advice"]:
            out.print(f"  - {a}")


@cli.command("check-compat")
@click.argument("target", metavar="FATBIN_DIR_OR_BUNDLE", type=click.Path(path_type=Path))
@click.option("--gpu", "gpus", multiple=True, metavar="sm_XY",
              help="Target GPU compute capability (repeatable, or comma-separated). Default: this machine's GPUs.")
@click.option("--driver", "driver_text", metavar="VERSION",
              help="Target driver version (535.104.05) or the CUDA version it supports (12.2). Default: this machine's.")
@click.option("--json", "as_json", is_flag=True, help="Print the decisions as JSON.")
def check_compat(target, gpus, driver_text, as_json):
    """Decide, per kernel module, whether it runs on a GPU/driver: native SASS, PTX JIT, or incompatible.

    Exit 0 if every module runs on every target, 3 if any is incompatible or no GPU/driver is there to ask.
    """
    from .archs import gpu_arch
    from .compat import check_paths, driver_from_cuda_int, modules_in, parse_driver
    from .probe import probe

    paths = modules_in(target)
    ccs = [gpu_arch(g) for spec in gpus for g in spec.split(",") if g.strip()]
    driver = parse_driver(driver_text) if driver_text else None
    if not ccs or driver is None:
        machine = probe()
        if driver is None:
            if not machine.driver_cuda:
                raise IncompatibleError(f"no NVIDIA driver on this machine ({machine.problem})",
                                        hint="pass --driver VERSION to check a hypothetical target")
            driver = driver_from_cuda_int(machine.driver_version, machine.driver_cuda)
        if not ccs:
            if not machine.gpus:
                raise IncompatibleError(f"no GPU on this machine ({machine.problem or 'none found'})",
                                        hint="pass --gpu sm_XY to check a hypothetical target")
            ccs = sorted({g.cc for g in machine.gpus})

    rows = []
    for cc in ccs:
        for d in check_paths(paths, cc, driver):
            rows.append({"gpu": f"sm_{cc}", "driver": driver.label} | d.as_dict())
    ok = all(r["verdict"] != "incompatible" for r in rows)
    if as_json:
        emit_json({"ok": ok, "decisions": rows})
    else:
        table = Table(title=f"compatibility with driver {driver.label}")
        for col in ("gpu", "module", "verdict", "image", "reason / fix"):
            table.add_column(col)
        style = {"native": "green", "jit": "yellow", "incompatible": "red"}
        for r in rows:
            why = r["reason"] + (f"\n[b]fix:[/b] {r['fix']}" if r["fix"] else "")
            table.add_row(r["gpu"], r["module"], f"[{style[r['verdict']]}]{r['verdict']}[/]", r["image"] or "-", why)
        out.print(table)
    if not ok:
        sys.exit(EXIT_INCOMPATIBLE)


# --- bundles: pack, verify, sign, rebuild ---------------------------------------------------------

def _bytes_bar(disable: bool):
    """A rich progress bar on stderr that counts bytes (hashing and copying)."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TransferSpeedColumn)
    return Progress(TextColumn("{task.description:<40}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeElapsedColumn(), console=err, transient=True, disable=disable or not err.is_terminal)


@cli.command()
@click.option("--model", "model", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The GGUF model to pack.")
@click.option("--kernels", "kernel_dir", type=click.Path(file_okay=False, path_type=Path),
              help="A folder written by `ingot build` (default: run the default build into dist/kernels).")
@click.option("--name", help="Bundle name; the model becomes model/NAME.gguf (default: the model file's stem).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path),
              help="The bundle file to write (default: dist/NAME.ingot).")
@click.option("--no-selftest", is_flag=True,
              help="Skip the CPU reference logits recorded for `ingot verify --device` (for huge models).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def pack(model, kernel_dir, name, out_file, no_selftest, as_json):
    """Pack fatbins, a GGUF model, provenance and a manifest into one deterministic bundle.

    Same inputs give the same bytes: members are sorted, every mtime is $SOURCE_DATE_EPOCH (default 0).
    """
    from .pack import pack as run_pack

    size = model.stat().st_size if model.is_file() else 0
    with _bytes_bar(as_json) as bar:
        task = bar.add_task("packing", total=2 * size)     # hashed once, then copied
        result = run_pack(model, kernels=kernel_dir, name=name, out=out_file, selftest=not no_selftest,
                          on_stage=lambda text: bar.update(task, description=text),
                          on_bytes=lambda n: bar.advance(task, n))
    if as_json:
        emit_json(result)
        return
    out.print(f"{result['sha256']}  {result['bundle']}  ({_mib(result['size'])})")
    out.print(f"  root digest  {result['root_digest']}")
    out.print(f"  model data   at offset {result['model_offset']:,} (4096-aligned, mapped in place)")
    out.print(f"  members      {', '.join(m['name'] for m in result['members'])}")
    if not result["selftest"]:
        out.print("  self-test    skipped (--no-selftest)")


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--pubkey", type=click.Path(dir_okay=False, path_type=Path),
              help="Require a valid signature by this public key (PREFIX.pub from `ingot keygen`).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (also on failure).")
@click.option("--device", "on_device", is_flag=True,
              help="Also run the on-GPU self-test: the bundle's kernels on this GPU must reproduce the CPU "
                   "reference logits recorded at pack time.")
@click.option("--gpu", "gpu_index", default=0, show_default=True, type=int, help="GPU for --device.")
def verify(bundle, pubkey, as_json, on_device, gpu_index):
    """Recompute every digest of a bundle, check its root digest and signature, and refuse unsafe members.

    Exit 0 if it verifies, 4 naming the bad member (and 64 MiB chunk) otherwise; with --device, 4 also when
    the GPU self-test disagrees with the CPU reference, 3 when there is no GPU to run it on.
    """
    from .errors import VerificationError
    from .verify import verify_bundle

    size = bundle.stat().st_size if bundle.is_file() else 0
    try:
        with _bytes_bar(as_json) as bar:
            task = bar.add_task(f"verifying {bundle.name}", total=size)
            report = verify_bundle(bundle, pubkey=pubkey, on_bytes=lambda n: bar.advance(task, n))
    except VerificationError as e:
        if as_json:
            emit_json({"ok": False, "bundle": str(bundle), "error": e.message, "hint": e.hint,
                       "problems": getattr(e, "problems", [])})
        raise
    if on_device:
        from ingot.runtime.selftest import run_selftest

        report["selftest"] = run_selftest(bundle, gpu=gpu_index, pubkey=pubkey)
    if as_json:
        emit_json(report)
        return
    out.print(f"[green]ok[/green]  {bundle}  root {report['root_digest']}")
    out.print(f"  {report['members']} members, {_mib(report['hashed_bytes'])} hashed in {report['seconds']:.2f} s"
              + (f" ({report['mb_per_s']:,.0f} MB/s)" if report["mb_per_s"] else ""))
    sig = report["signature"]
    if sig is None:
        out.print("  signature    none (unsigned bundle)")
    elif sig["authenticated"]:
        out.print(f"  signature    valid, by --pubkey {pubkey} (keyid {sig['keyid'][:16]}...)")
    else:
        out.print(f"  signature    intact, keyid {sig['keyid'][:16]}... (pass --pubkey to check who signed it)")
    if on_device:
        st = report["selftest"]
        out.print(f"  GPU self-test passed on {st['device']}: argmax {st['argmax']} as recorded, top logits within "
                  f"{st['top_rel_err']:.1e}, log-sum-exp {st['logsumexp']:.3f} (recorded {st['expected_logsumexp']:.3f})")


@cli.command()
@click.option("--out", "prefix", required=True, type=click.Path(path_type=Path), metavar="PREFIX",
              help="Writes PREFIX.key (private, mode 0600) and PREFIX.pub.")
@click.option("--json", "as_json", is_flag=True, help="Print the paths and keyid as JSON.")
def keygen(prefix, as_json):
    """Create an Ed25519 signing key pair for `ingot sign` and `ingot verify --pubkey`."""
    from .sign import keygen as run_keygen

    result = run_keygen(prefix)
    if as_json:
        emit_json(result)
        return
    out.print(f"private key  {result['key']}  (keep it secret; mode 0600)")
    out.print(f"public key   {result['pub']}  (give it to users: ingot verify BUNDLE --pubkey {result['pub']})")
    out.print(f"keyid        {result['keyid']}")


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--key", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="PREFIX.key from `ingot keygen`.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the signed bundle here (default: replace BUNDLE, atomically).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sign(bundle, key, out_file, as_json):
    """Sign a bundle's root digest (Ed25519, DSSE envelope of an in-toto statement) into signature.dsse.json."""
    from .sign import sign_bundle

    result = sign_bundle(bundle, key, out_file)
    if as_json:
        emit_json(result)
        return
    out.print(f"{result['sha256']}  {result['bundle']}  signed by keyid {result['keyid'][:16]}...")


@cli.command()
@click.argument("bundle", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--check", is_flag=True, help="Rebuild the kernels here and compare them byte for byte.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def rebuild(bundle, check, as_json):
    """Prove a bundle's kernels are a reproducible build: recompile with the recorded archs and flags.

    Exit 0 if every fatbin is byte-identical, 4 naming each module that differs and why.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .errors import UsageError, VerificationError
    from .rebuild import rebuild_check

    if not check:
        raise UsageError("rebuild only checks for now", hint="run `ingot rebuild --check BUNDLE`")
    with Progress(TextColumn("rebuilding {task.fields[module]:<12}"), BarColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=as_json or not err.is_terminal) as bar:
        task = bar.add_task("rebuild", total=None, module="")
        report = rebuild_check(bundle, on_module=lambda m, done: bar.update(task, completed=done, module=m))
    if as_json:
        emit_json(report)
    else:
        table = Table(title=f"rebuild of {bundle} with {report['local']['nvcc']}")
        for col in ("module", "result", "sha256 (bundle)", "why it differs"):
            table.add_column(col)
        for m in report["modules"]:
            table.add_row(m["module"], "[green]identical[/]" if m["identical"] else "[red]differs[/]",
                          m["recorded_sha256"][:16], "\n".join(m["reasons"]))
        out.print(table)
    bad = [m for m in report["modules"] if not m["identical"]]
    if bad:
        raise VerificationError(f"{len(bad)} of {len(report['modules'])} kernel modules differ from the bundle: "
                                f"{bad[0]['module']} ({bad[0]['reasons'][0]})",
                                hint="rebuild with the recorded toolkit and sources (see the table or --json)")


# --- entry point ----------------------------------------------------------------------------------

def _register_runtime_commands() -> None:
    """Runtime commands (run, bench, serve, ...) live with the runtime; they are optional at import."""
    try:
        from ingot.runtime.commands import register
    except ImportError:
        return
    register(cli)
    from ingot.runtime.bench import register as register_bench
    register_bench(cli)


_register_runtime_commands()


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code if e.exit_code else EXIT_USAGE)
    except IngotError as e:
        err.print(f"[red]error:[/red] {escape(str(e))}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except Exception as e:  # the last resort: one line, and the traceback only on request
        if os.environ.get("INGOT_DEBUG"):
            raise
        err.print(f"[red]internal error:[/red] {type(e).__name__}: {escape(str(e))} (set INGOT_DEBUG=1 for a traceback)")
        sys.exit(EXIT_FAILURE)
