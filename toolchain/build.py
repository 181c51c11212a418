"""`ingot build`: compile every cuda/*.cu into one multi-arch fatbin, reproducibly and with a cache.

One nvcc invocation per source file produces SASS for each requested arch plus PTX; `--threads` lets nvcc
compile the archs in parallel (the output is byte-identical to a serial build). Same sources + toolkit + flags
give the same bytes, wherever the checkout lives:
  - nvcc runs in the source folder on the bare file name, so __FILE__ holds no absolute path;
  - `-Xcicc=--orig_src_path_name=<name>.cu` replaces the absolute source path that cicc otherwise hashes into
    the mangled names of anonymous-namespace kernels (`_GLOBAL__N__<hash>_...`);
  - no -G / -lineinfo (they embed paths and temp names), and the environment variables that inject hidden
    flags or include paths are removed (nvcc.HIDDEN_INPUT_VARS).
The cache key covers everything that can change the bytes: the source, every local header it includes
(recursively), the nvcc build, the host compiler, the flags and the archs. After each compile (and on each
cache hit) the fatbin is read back and must hold exactly the archs that were asked for, so a silent fallback
(a dropped arch, PTX where SASS was wanted) fails the build instead of failing on a user's GPU.
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
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ingot.runtime.errors import BuildError, UsageError
from ingot.runtime.files import cache_root, write_atomic
from ingot.runtime.gpu.archs import Arch
from ingot.runtime.gpu.fatbin import Fatbin, parse_fatbin
from ingot.toolchain.archs import default_policy, kernel_source_dir
from ingot.toolchain.nvcc import HIDDEN_INPUT_VARS, Toolkit, host_compiler, require_toolkit

CACHE_SCHEMA = "ingot-kernel-cache-v2"


@dataclass
class ArchStat:
    arch: str
    kind: str  # "sass" or "ptx"
    bytes: int  # size of this arch's image in the fatbin (stored, i.e. compressed if compressed)
    seconds: float  # nvcc's own time for this target (`nvcc --time`): front end (shared by sm_XY and
    # compute_XY) + ptxas; with --threads these overlap, so they do not add up to wall time


@dataclass
class ModuleBuild:
    name: str
    path: str
    sha256: str
    size: int
    archs: dict
    kernels: list[str]
    per_arch: list[ArchStat]
    command: list[str]  # the exact nvcc argv that produced these bytes (run in `cwd`)
    cwd: str
    cached: bool
    seconds: float
    inputs: dict = field(default_factory=dict)  # file name -> sha256 of the source and each included header

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
        return {
            "toolkit": self.toolkit.as_dict(),
            "host_compiler": self.host_compiler,
            "archs": self.archs,
            "flags": self.flags,
            "out_dir": str(self.out_dir),
            "fatbins": [m.as_dict() for m in self.modules],
        }


def cache_dir() -> Path:
    return cache_root() / "kernels"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def included_headers(src: Path) -> dict[str, bytes]:
    """Local headers (#include "x.cuh") reachable from src, recursively, keyed by path relative to src's folder.

    A quoted include is looked up next to the file that includes it, then in src's folder (nvcc's own order
    for the folders we use; we pass no -I)."""
    root = src.parent
    seen: dict[str, bytes] = {}
    todo = [src]
    while todo:
        current = todo.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', current.read_text(errors="replace"), re.M):
            for path in (current.parent / name, root / name):
                if path.is_file():
                    key = os.path.relpath(path.resolve(), root.resolve())
                    if key not in seen:
                        seen[key] = path.read_bytes()
                        todo.append(path)
                    break
    return dict(sorted(seen.items()))


def nvcc_args(archs: list[Arch], flags: list[str], name: str) -> list[str]:
    """The nvcc arguments that decide the bytes of one module, run in the source folder on `<name>.cu`."""
    gencode = [f"-gencode={a.gencode()}" for a in archs]
    return ["-fatbin", *flags, f"-Xcicc=--orig_src_path_name={name}.cu", *gencode]


def _cache_key(src: Path, headers: dict[str, bytes], tk: Toolkit, args: list[str]) -> str:
    h = hashlib.sha256()
    for part in (
        CACHE_SCHEMA,
        tk.version_text,
        tk.build,
        str(host_compiler().get("version")),
        json.dumps(args),
        src.name,
    ):
        h.update(part.encode() + b"\0")
    h.update(src.read_bytes() + b"\0")
    for name, data in headers.items():
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()


def _per_arch_seconds(time_csv: str) -> dict[str, float]:
    """Sum nvcc --time phases per target ("compute_90", "sm_90", ...)."""
    out: dict[str, float] = {}
    for row in csv.reader(io.StringIO(time_csv)):
        if len(row) < 8 or row[7].strip() != "ms":
            continue
        arch = row[4].strip()
        if arch:
            out[arch] = out.get(arch, 0.0) + float(row[6]) / 1000.0
    return out


def check_archs(name: str, fat: Fatbin, archs: list[Arch]) -> None:
    """The fatbin must hold one image per requested arch, and nothing else."""
    want = Counter(a.name for a in archs)
    have = Counter(e.arch for e in fat.entries)
    if have != want:
        missing = sorted((want - have).elements())
        extra = sorted((have - want).elements())
        raise BuildError(
            f"{name}.fatbin does not hold exactly the requested archs: missing {missing or 'none'}, "
            f"unexpected {extra or 'none'}",
            hint="nvcc dropped or added an image; check the --arch list against `nvcc --list-gpu-code`",
        )


def _read_cache(key: str) -> tuple[bytes, dict] | None:
    """A cached build, if present and intact (its recorded sha256 matches)."""
    bin_path, meta_path = cache_dir() / f"{key}.fatbin", cache_dir() / f"{key}.json"
    try:
        data, meta = bin_path.read_bytes(), json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    return (data, meta) if meta.get("sha256") == sha256_bytes(data) else None


def _compile(src: Path, args: list[str], tk: Toolkit, threads: int) -> tuple[bytes, dict, list[str]]:
    """Run nvcc; returns the fatbin bytes, seconds per target and the exact argv."""
    env = {k: v for k, v in os.environ.items() if k not in HIDDEN_INPUT_VARS}
    with tempfile.TemporaryDirectory(prefix="ingot-nvcc-") as tmp:
        out, timing = Path(tmp) / f"{src.stem}.fatbin", Path(tmp) / "time.csv"
        argv = [str(tk.nvcc), *args, "--threads", str(threads), "--time", str(timing), "-o", str(out), src.name]
        try:
            proc = subprocess.run(argv, cwd=src.parent, capture_output=True, text=True, env=env)
        except OSError as e:
            raise BuildError(f"cannot run {tk.nvcc}: {e.strerror}", hint="check the CUDA toolkit install") from None
        if proc.returncode != 0:
            lines = proc.stderr.splitlines()
            errors = [ln for ln in lines if "error" in ln or "fatal" in ln] or lines
            raise BuildError(
                f"nvcc failed on {src.name}: {errors[0].strip() if errors else 'no output'}",
                hint=f"{len(errors)} error line(s); run `{' '.join(argv)}` in {src.parent}",
            )
        return out.read_bytes(), _per_arch_seconds(timing.read_text()), argv


def build_module(
    src: Path, archs: list[Arch], flags: list[str], tk: Toolkit, out_dir: Path, use_cache: bool = True, threads: int = 0
) -> ModuleBuild:
    name = src.stem
    headers = included_headers(src)
    args = nvcc_args(archs, flags, name)
    key = _cache_key(src, headers, tk, args)
    t0 = time.perf_counter()
    hit = _read_cache(key) if use_cache else None
    if hit:
        data, meta = hit
        secs_by_arch, argv = meta["seconds_by_arch"], meta["command"]
    else:
        data, secs_by_arch, argv = _compile(src, args, tk, threads or _cpus())
    fat = parse_fatbin(data, name=f"{name}.fatbin")
    check_archs(name, fat, archs)
    if not hit and use_cache:
        meta = {"sha256": sha256_bytes(data), "seconds_by_arch": secs_by_arch, "command": argv}
        write_atomic(cache_dir() / f"{key}.fatbin", data)
        write_atomic(cache_dir() / f"{key}.json", json.dumps(meta).encode())

    per_arch = []
    for e in fat.entries:
        front = secs_by_arch.get(f"compute_{e.cc}{e.variant}", 0.0)
        back = secs_by_arch.get(f"sm_{e.cc}{e.variant}", 0.0) if e.kind == "sass" else 0.0
        per_arch.append(ArchStat(arch=e.arch, kind=e.kind, bytes=e.stored_size, seconds=round(front + back, 3)))
    path = out_dir / f"{name}.fatbin"
    write_atomic(path, data)
    inputs = {src.name: sha256_bytes(src.read_bytes())} | {n: sha256_bytes(b) for n, b in headers.items()}
    return ModuleBuild(
        name=name,
        path=str(path),
        sha256=sha256_bytes(data),
        size=len(data),
        archs={"sass": fat.sass, "ptx": fat.ptx},
        kernels=list(fat.kernels),
        per_arch=per_arch,
        command=argv,
        cwd=str(src.parent),
        cached=bool(hit),
        seconds=round(time.perf_counter() - t0, 3),
        inputs=dict(sorted(inputs.items())),
    )


def _cpus() -> int:
    """CPUs this process may use (the affinity mask, not the host's count: CI containers get a share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_targets(archs: list[Arch], tk: Toolkit) -> None:
    unsupported = [a.name for a in archs if tk.targets and a.cc not in tk.targets]
    if unsupported:
        raise UsageError(
            f"nvcc {tk.version} cannot target {', '.join(unsupported)}",
            hint=f"it targets sm_{', sm_'.join(map(str, tk.targets))}",
        )


def build(
    archs: list[Arch] | None = None,
    out_dir: Path | str = "dist/kernels",
    sources: list[Path] | None = None,
    use_cache: bool = True,
    on_module: Callable[[str, int], None] | None = None,
    threads: int = 0,
) -> BuildResult:
    """Build every source (default: cuda/*.cu). threads: nvcc --threads per module (0 = one per CPU).
    on_module(name, n_done) is called before each module (for progress bars)."""
    tk = require_toolkit()
    policy = default_policy()
    archs = list(archs or policy.archs)
    _check_targets(archs, tk)
    flags = list(policy.flags)
    sources = sorted(Path(s) for s in sources) if sources else sorted(kernel_source_dir().glob("*.cu"))
    if not sources:
        raise UsageError(f"no kernel sources (*.cu) in {kernel_source_dir()}")
    dupes = sorted(n for n, c in Counter(s.stem for s in sources).items() if c > 1)
    if dupes:
        raise UsageError(f"two kernel sources would both build {dupes[0]}.fatbin", hint="rename one of them")
    out_dir = Path(out_dir)
    modules = []
    for i, src in enumerate(sources):
        if on_module:
            on_module(src.stem, i)
        modules.append(build_module(src, archs, flags, tk, out_dir, use_cache=use_cache, threads=threads))
    result = BuildResult(
        toolkit=tk,
        host_compiler=host_compiler(),
        archs=[a.name for a in archs],
        flags=flags,
        out_dir=out_dir,
        modules=modules,
    )
    write_atomic(out_dir / "build.json", (json.dumps(result.as_dict(), indent=2, sort_keys=True) + "\n").encode())
    return result
