"""`ingot build`: compile every cuda/*.cu into one multi-arch fatbin, reproducibly and with a cache.

One nvcc invocation per source file produces SASS for each requested arch plus PTX. The cache key covers
everything that can change the bytes: the source, every header it includes (recursively), the nvcc build,
the host compiler, the flags and the archs. After each compile the fatbin is read back and must hold exactly
the archs that were asked for, so a silent fallback (a dropped arch, PTX where SASS was wanted) fails the
build instead of failing on a user's GPU.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .archs import Arch, default_policy, kernel_source_dir
from .errors import BuildError, UsageError
from .fatbin import parse_fatbin
from .nvcc import Toolkit, host_compiler, require_toolkit

CACHE_SCHEMA = "ingot-kernel-cache-v1"


@dataclass
class ArchStat:
    arch: str
    kind: str           # "sass" or "ptx"
    bytes: int          # size of this arch's image in the fatbin (stored, i.e. compressed if compressed)
    seconds: float      # nvcc's own per-arch time (front end + ptxas), from `nvcc --time`


@dataclass
class ModuleBuild:
    name: str
    path: str
    sha256: str
    size: int
    archs: dict
    kernels: list[str]
    per_arch: list[ArchStat]
    command: list[str]
    cached: bool
    seconds: float
    inputs: dict = field(default_factory=dict)   # file name -> sha256 of the source and each included header

    def as_dict(self) -> dict:
        d = asdict(self)
        d["per_arch"] = [asdict(a) for a in self.per_arch]
        return d


@dataclass
class BuildResult:
    toolkit: Toolkit
    host_compiler: dict
    archs: list[str]
    flags: list[str]
    out_dir: Path
    modules: list[ModuleBuild]

    def as_dict(self) -> dict:
        return {"toolkit": self.toolkit.as_dict(), "host_compiler": self.host_compiler, "archs": self.archs,
                "flags": self.flags, "out_dir": str(self.out_dir),
                "fatbins": [m.as_dict() for m in self.modules]}


def cache_dir() -> Path:
    base = os.environ.get("INGOT_CACHE_DIR")
    if base:
        return Path(base) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "ingot" / "kernels"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def included_headers(src: Path) -> dict[str, bytes]:
    """Local headers (#include "x.cuh") reachable from src, recursively, keyed by name."""
    seen: dict[str, bytes] = {}
    todo = [src]
    while todo:
        text = todo.pop().read_text()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            path = src.parent / name
            if name not in seen and path.is_file():
                seen[name] = path.read_bytes()
                todo.append(path)
    return dict(sorted(seen.items()))


def nvcc_args(archs: list[Arch], flags: list[str], name: str) -> list[str]:
    """The exact nvcc argument list (after the nvcc path) for one module, run with cwd = the cuda/ folder."""
    gencode = [f"-gencode={a.gencode()}" for a in archs]
    return ["-fatbin", *flags, *gencode, "-o", f"{name}.fatbin", f"{name}.cu"]


def _cache_key(src: Path, headers: dict[str, bytes], tk: Toolkit, args: list[str]) -> str:
    h = hashlib.sha256()
    for part in (CACHE_SCHEMA, tk.version_text, tk.build, str(host_compiler().get("version")), json.dumps(args)):
        h.update(part.encode() + b"\0")
    h.update(src.read_bytes() + b"\0")
    for name, data in headers.items():
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def _per_arch_seconds(time_csv: str) -> dict[str, float]:
    """Sum nvcc --time phases per target: compute_XY front-end phases count towards sm_XY too."""
    out: dict[str, float] = {}
    for row in csv.reader(io.StringIO(time_csv)):
        if len(row) < 8 or row[7].strip() != "ms":
            continue
        arch = row[4].strip()
        if arch:
            out[arch] = out.get(arch, 0.0) + float(row[6]) / 1000.0
    return out


def _check_archs(name: str, fat, archs: list[Arch]) -> None:
    want_sass = sorted(a.name for a in archs if not a.ptx)
    want_ptx = sorted(a.name for a in archs if a.ptx)
    if sorted(fat.sass) != want_sass or sorted(fat.ptx) != want_ptx:
        raise BuildError(
            f"{name}.fatbin holds SASS {fat.sass} and PTX {fat.ptx}, but SASS {want_sass} and PTX {want_ptx} "
            "were requested", hint="nvcc fell back silently; check the --arch list against `nvcc --list-gpu-code`")


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_module(src: Path, archs: list[Arch], flags: list[str], tk: Toolkit, out_dir: Path,
                 use_cache: bool = True) -> ModuleBuild:
    name = src.stem
    headers = included_headers(src)
    args = nvcc_args(archs, flags, name)
    key = _cache_key(src, headers, tk, args)
    cached_bin = cache_dir() / f"{key}.fatbin"
    cached_meta = cache_dir() / f"{key}.json"
    t0 = time.perf_counter()
    if use_cache and cached_bin.is_file() and cached_meta.is_file():
        data, meta = cached_bin.read_bytes(), json.loads(cached_meta.read_text())
        cached, secs_by_arch = True, meta["seconds_by_arch"]
    else:
        with tempfile.TemporaryDirectory(prefix="ingot-nvcc-") as tmp:
            out = Path(tmp) / f"{name}.fatbin"
            timing = Path(tmp) / "time.csv"
            run = [str(tk.nvcc), *args[:-3], "-o", str(out), "--time", str(timing), f"{name}.cu"]
            proc = subprocess.run(run, cwd=src.parent, capture_output=True, text=True)
            if proc.returncode != 0:
                errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
                raise BuildError(f"nvcc failed on {src.name}: {errors[0].strip() if errors else 'no output'}",
                                 hint=f"{len(errors)} error line(s); run `nvcc {' '.join(args)}` in {src.parent}")
            data = out.read_bytes()
            secs_by_arch = _per_arch_seconds(timing.read_text())
        cached = False
    fat = parse_fatbin(data, name=f"{name}.fatbin")
    _check_archs(name, fat, archs)
    if not cached and use_cache:
        _write_atomic(cached_bin, data)
        _write_atomic(cached_meta, json.dumps({"seconds_by_arch": secs_by_arch, "args": args}).encode())

    per_arch = []
    for e in fat.entries:
        front = secs_by_arch.get(f"compute_{e.cc}{e.variant}", 0.0)
        back = secs_by_arch.get(f"sm_{e.cc}{e.variant}", 0.0) if e.kind == "sass" else 0.0
        per_arch.append(ArchStat(arch=e.arch, kind=e.kind, bytes=e.stored_size, seconds=round(front + back, 3)))
    path = out_dir / f"{name}.fatbin"
    _write_atomic(path, data)
    inputs = {src.name: sha256_bytes(src.read_bytes())} | {n: sha256_bytes(b) for n, b in headers.items()}
    return ModuleBuild(name=name, path=str(path), sha256=sha256_bytes(data), size=len(data),
                       archs={"sass": fat.sass, "ptx": fat.ptx}, kernels=list(fat.kernels), per_arch=per_arch,
                       command=["nvcc", *args], cached=cached, seconds=round(time.perf_counter() - t0, 3),
                       inputs=dict(sorted(inputs.items())))


def build(archs: list[Arch] | None = None, out_dir: Path | str = "dist/kernels", sources: list[Path] | None = None,
          use_cache: bool = True, on_module: Callable[[str, int], None] | None = None) -> BuildResult:
    """Build every source; on_module(name, n_done) is called before each module (for progress bars)."""
    tk = require_toolkit()
    policy = default_policy()
    archs = list(archs or policy.archs)
    flags = list(policy.flags)
    src_dir = kernel_source_dir()
    sources = sorted(sources or src_dir.glob("*.cu"))
    if not sources:
        raise UsageError(f"no kernel sources (*.cu) in {src_dir}")
    out_dir = Path(out_dir)
    modules = []
    for i, src in enumerate(sources):
        if on_module:
            on_module(src.stem, i)
        modules.append(build_module(src, archs, flags, tk, out_dir, use_cache=use_cache))
    result = BuildResult(toolkit=tk, host_compiler=host_compiler(), archs=[a.name for a in archs], flags=flags,
                         out_dir=out_dir, modules=modules)
    _write_atomic(out_dir / "build.json", (json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n").encode())
    return result
