"""Finding the CUDA compiler and the tools around it, and reading their versions.

Search order for nvcc: $CUDACXX, `nvcc` on PATH, $CUDA_HOME/bin ($CUDA_PATH/bin), the `nvidia-cuda-nvcc` wheel
(site-packages/nvidia/cu13/bin for 13.x wheels, nvidia/cuda_nvcc/bin for 12.x), then /usr/local/cuda/bin.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ingot.runtime.errors import IncompatibleError

# Environment variables that change what nvcc compiles without showing on its command line. A release build
# runs nvcc without them, so the recorded command line is the whole story (NVCC_CCBIN stays: it picks the host
# compiler, which is recorded and part of the cache key).
HIDDEN_INPUT_VARS = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH")


@dataclass(frozen=True)
class Toolkit:
    nvcc: Path
    found_via: str  # "CUDACXX", "PATH", "CUDA_HOME", "/usr/local/cuda", "nvidia-cuda-nvcc wheel"
    version: str  # "13.0"
    build: str  # "V13.0.88"
    version_text: str  # nvcc --version's release line, recorded in provenance
    targets: tuple[int, ...] = ()  # compute capabilities it can compile SASS for (nvcc --list-gpu-code): 75, 80, ...

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    def as_dict(self) -> dict:
        return {
            "nvcc": str(self.nvcc),
            "found_via": self.found_via,
            "version": self.version,
            "build": self.build,
            "version_text": self.version_text,
            "targets": [f"sm_{cc}" for cc in self.targets],
        }


def _candidates() -> list[tuple[Path, str]]:
    out: list[tuple[Path, str]] = []
    if os.environ.get("CUDACXX"):
        out.append((Path(os.environ["CUDACXX"]), "CUDACXX"))
    on_path = shutil.which("nvcc")
    if on_path:
        out.append((Path(on_path), "PATH"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            out.append((Path(os.environ[var]) / "bin" / "nvcc", var))
    # A wheel in this environment was installed on purpose; /usr/local/cuda is only the system default.
    for base in map(Path, sys.path):
        for sub in ("nvidia/cu13/bin/nvcc", "nvidia/cuda_nvcc/bin/nvcc", "nvidia/cu12/bin/nvcc"):
            out.append((base / sub, "nvidia-cuda-nvcc wheel"))
    out.append((Path("/usr/local/cuda/bin/nvcc"), "/usr/local/cuda"))
    return out


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def probe_nvcc(path: Path, found_via: str) -> Toolkit | None:
    """The toolkit behind this nvcc, or None if it is not a working nvcc."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        return None
    text = _run([str(path), "--version"]) or ""
    m = re.search(r"release (\d+\.\d+), (V[\d.]+)", text)
    if not m:
        return None
    line = next(ln for ln in text.splitlines() if "release" in ln)
    codes = _run([str(path), "--list-gpu-code"]) or ""
    targets = tuple(sorted({int(c) for c in re.findall(r"\bsm_(\d+)\b", codes)}))
    return Toolkit(
        nvcc=path, found_via=found_via, version=m.group(1), build=m.group(2), version_text=line.strip(), targets=targets
    )


@cache
def find_toolkit() -> Toolkit | None:
    for path, how in _candidates():
        tk = probe_nvcc(path, how)
        if tk:
            return tk
    return None


def require_toolkit() -> Toolkit:
    tk = find_toolkit()
    if tk is None:
        raise IncompatibleError(
            "no CUDA compiler (nvcc) found on PATH, in $CUDA_HOME, /usr/local/cuda or the nvidia-cuda-nvcc wheel",
            hint="install the CUDA toolkit 12.x/13.x or `pip install nvidia-cuda-nvcc`, or set CUDACXX",
        )
    return tk


def _first_line(cmd: list[str]) -> str | None:
    text = (_run(cmd) or "").strip()
    return text.splitlines()[0] if text else None


@cache
def host_compiler() -> dict:
    """The host compiler nvcc runs (it preprocesses device code too): $NVCC_CCBIN, else gcc on PATH."""
    cxx = os.environ.get("NVCC_CCBIN") or shutil.which("gcc")
    if not cxx:
        return {"path": None, "version": None}
    return {"path": cxx, "version": _first_line([cxx, "--version"])}


@cache
def cmake_version() -> str | None:
    line = _first_line(["cmake", "--version"])
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", line or "")
    return m.group(1) if m else None
