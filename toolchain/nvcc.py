"""Finding the CUDA compiler and the tools around it, and reading their versions.

Search order for nvcc: $CUDACXX, `nvcc` on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, and the
`nvidia-cuda-nvcc` wheel (site-packages/nvidia/cuda_nvcc/bin or nvidia/cu13/bin).
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

from .errors import IncompatibleError


@dataclass(frozen=True)
class Toolkit:
    nvcc: Path
    found_via: str         # "CUDACXX", "PATH", "CUDA_HOME", "/usr/local/cuda", "nvidia-cuda-nvcc wheel"
    version: str           # "13.0"
    build: str             # "V13.0.88"
    version_text: str      # nvcc --version's release line, recorded in provenance

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    def as_dict(self) -> dict:
        return {"nvcc": str(self.nvcc), "found_via": self.found_via, "version": self.version,
                "build": self.build, "version_text": self.version_text}


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
    out.append((Path("/usr/local/cuda/bin/nvcc"), "/usr/local/cuda"))
    for base in map(Path, sys.path):
        for sub in ("nvidia/cuda_nvcc/bin/nvcc", "nvidia/cu13/bin/nvcc", "nvidia/cu12/bin/nvcc"):
            out.append((base / sub, "nvidia-cuda-nvcc wheel"))
    return out


@cache
def find_toolkit() -> Toolkit | None:
    for path, how in _candidates():
        if path.is_file() and os.access(path, os.X_OK):
            try:
                text = subprocess.run([str(path), "--version"], capture_output=True, text=True,
                                      timeout=60, check=True).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            m = re.search(r"release (\d+\.\d+), (V[\d.]+)", text)
            if m:
                line = next(ln for ln in text.splitlines() if "release" in ln)
                return Toolkit(nvcc=path, found_via=how, version=m.group(1), build=m.group(2),
                               version_text=line.strip())
    return None


def require_toolkit() -> Toolkit:
    tk = find_toolkit()
    if tk is None:
        raise IncompatibleError(
            "no CUDA compiler (nvcc) found on PATH, in $CUDA_HOME, /usr/local/cuda or the nvidia-cuda-nvcc wheel",
            hint="install the CUDA toolkit 12.x/13.x or `pip install nvidia-cuda-nvcc`, or set CUDACXX")
    return tk


def _first_line(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if out.returncode == 0 and text else None


@cache
def host_compiler() -> dict:
    """The host C++ compiler nvcc will use: $NVCC_CCBIN / $CUDAHOSTCXX, else g++ on PATH."""
    cxx = os.environ.get("NVCC_CCBIN") or os.environ.get("CUDAHOSTCXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        return {"path": None, "version": None}
    return {"path": cxx, "version": _first_line([cxx, "--version"])}


@cache
def cmake_version() -> str | None:
    line = _first_line(["cmake", "--version"])
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", line or "")
    return m.group(1) if m else None
