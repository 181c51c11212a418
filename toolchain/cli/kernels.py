"""Kernel commands: `ingot build`, `inspect`, `doctor`, `check-compat`."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ingot.runtime.errors import EXIT_INCOMPATIBLE, IncompatibleError
from ingot.runtime.gpu.archs import gpu_arch
from ingot.runtime.gpu.compat import driver_from_cuda_int, parse_driver
from ingot.runtime.gpu.fatbin import read_fatbin
from ingot.runtime.gpu.probe import probe
from ingot.toolchain.archs import kernel_source_dir, parse_arch_list
from ingot.toolchain.build import build as run_build
from ingot.toolchain.check import check_paths, modules_in
from ingot.toolchain.cli.output import emit_json, err, mib, out
from ingot.toolchain.doctor import report


@click.command()
@click.option(
    "--arch",
    "arch_list",
    metavar="LIST",
    help="Archs to build, e.g. sm_80,sm_90,compute_90 "
    "(default: SASS for sm_75..sm_120 plus compute_120 PTX; see cuda/archs.json).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("dist/kernels"),
    show_default=True,
    help="Folder for the fatbins and build.json.",
)
@click.option("--no-cache", is_flag=True, help="Recompile even if the kernel cache has this exact build.")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Archs nvcc compiles in parallel per module (0: one per CPU); the fatbins are the same bytes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def build(arch_list, out_dir, no_cache, jobs, as_json):
    """Compile cuda/*.cu into multi-arch fatbins (no GPU needed)."""
    archs = parse_arch_list(arch_list) if arch_list else None
    n = len(list(kernel_source_dir().glob("*.cu")))
    with Progress(
        TextColumn("compiling {task.fields[module]:<12}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=as_json,
    ) as bar:
        task = bar.add_task("build", total=n, module="")
        result = run_build(
            archs=archs,
            out_dir=out_dir,
            use_cache=not no_cache,
            threads=jobs,
            on_module=lambda m, done: bar.update(task, completed=done, module=m),
        )
    if as_json:
        emit_json(result.as_dict())
        return
    table = Table(title=f"nvcc {result.toolkit.version} ({result.toolkit.build}) -> {out_dir}")
    for col in ("module", "arch", "kind", "bytes", "compile s"):
        table.add_column(col, justify="right" if col in ("bytes", "compile s") else "left")
    for m in result.modules:
        for i, a in enumerate(m.per_arch):
            table.add_row(
                m.name if i == 0 else "", a.arch, a.kind, f"{a.bytes:,}", "cached" if m.cached else f"{a.seconds:.2f}"
            )
        table.add_row(
            "", "[b]total[/b]", "", f"[b]{m.size:,}[/b]", "cached" if m.cached else f"{m.seconds:.2f}", end_section=True
        )
    out.print(table)
    for m in result.modules:
        out.print(f"{m.sha256}  {m.path}  ({len(m.kernels)} kernels)")


@click.command()
@click.argument("fatbin", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the entries as JSON.")
def inspect(fatbin, as_json):
    """List every SASS and PTX image in a fatbin, and its kernels (no cuobjdump needed)."""
    fat = read_fatbin(fatbin)
    if as_json:
        emit_json({"path": str(fatbin)} | fat.as_dict())
        return
    table = Table(title=f"{fatbin} ({fat.size:,} bytes)")
    for col in ("kind", "arch", "variant", "PTX ISA", "built by", "compression", "stored", "size", "kernels"):
        table.add_column(col)
    for e in fat.entries:
        variant = {"a": "arch-specific", "f": "family", "": "-"}[e.variant]
        table.add_row(
            e.kind.upper(),
            e.arch,
            variant,
            e.isa or "-",
            f"CUDA {e.toolkit}" if e.toolkit else "-",
            e.compression,
            f"{e.stored_size:,}",
            f"{e.size:,}",
            str(len(e.kernels)),
        )
    out.print(table)
    out.print(f"kernels ({len(fat.kernels)}): " + ", ".join(fat.kernels))


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json):
    """Report nvcc, host compiler, CMake, driver and GPUs, and whether the installed kernels run here."""
    r = report()
    if as_json:
        emit_json(r)
        return
    tk = r["toolkit"]
    out.print("[b]Build[/b]")
    out.print(
        f"  nvcc          {tk['version']} {tk['build']} at {tk['nvcc']} (via {tk['found_via']})"
        if tk
        else "  nvcc          not found"
    )
    hc = r["host_compiler"]
    out.print(f"  host compiler {hc['version'] or 'not found'}" + (f" ({hc['path']})" if hc["path"] else ""))
    out.print(f"  cmake         {r['cmake'] or 'not found'}")
    m = r["machine"]
    out.print("[b]Run[/b]")
    out.print(
        f"  driver        {m['driver_version'] or '-'} (CUDA {m['driver_cuda']})"
        if m["driver_cuda"]
        else f"  driver        none ({m['problem']})"
    )
    for g in m["gpus"]:
        free = mib(g["memory_free"]) if g["memory_free"] is not None else "?"
        out.print(
            f"  GPU {g['index']}         {g['name']}, compute capability {g['compute_capability']}, "
            f"{free} free of {mib(g['memory_total'])}"
        )
    out.print(f"[b]Installed kernels[/b] ({r['kernel_dir']})")
    for k in r["kernels"]:
        out.print(
            f"  {k['module']:<20} "
            + (
                f"unreadable: {k['problem']}"
                if k["problem"]
                else f"SASS {','.join(k['sass']) or '-'}  PTX {','.join(k['ptx']) or '-'}"
            )
        )
        for g in k["on_gpus"]:
            out.print(
                f"      GPU {g['gpu']}: {g['verdict']} ({g['reason']})" + (f"; fix: {g['fix']}" if g["fix"] else "")
            )
    if r["advice"]:
        out.print("[b]Advice[/b]")
        for a in r["advice"]:
            out.print(f"  - {a}")


@click.command("check-compat")
@click.argument("target", metavar="FATBIN_DIR_OR_BUNDLE", type=click.Path(path_type=Path))
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    metavar="sm_XY",
    help="Target GPU compute capability (repeatable, or comma-separated). Default: this machine's GPUs.",
)
@click.option(
    "--driver",
    "driver_text",
    metavar="VERSION",
    help="Target driver version (535.104.05) or the CUDA version it supports (12.2). Default: this machine's.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the decisions as JSON.")
def check_compat(target, gpus, driver_text, as_json):
    """Decide, per kernel module, whether it runs on a GPU/driver: native SASS, PTX JIT, or incompatible.

    Exit 0 if every module runs on every target, 3 if any is incompatible or no GPU/driver is there to ask.
    """
    paths = modules_in(target)
    ccs = [gpu_arch(g) for spec in gpus for g in spec.split(",") if g.strip()]
    driver = parse_driver(driver_text) if driver_text else None
    if not ccs or driver is None:
        machine = probe()
        if driver is None:
            if not machine.driver_cuda:
                raise IncompatibleError(
                    f"no NVIDIA driver on this machine ({machine.problem})",
                    hint="pass --driver VERSION to check a hypothetical target",
                )
            driver = driver_from_cuda_int(machine.driver_version, machine.driver_cuda)
        if not ccs:
            if not machine.gpus:
                raise IncompatibleError(
                    f"no GPU on this machine ({machine.problem or 'none found'})",
                    hint="pass --gpu sm_XY to check a hypothetical target",
                )
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
