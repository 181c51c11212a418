"""Tiny CUDA sources for the toolchain tests (the real kernels take a minute to build for every arch), and
helpers to compile them with nvcc directly, independently of `ingot build`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ingot.toolchain.nvcc import find_toolkit

HEADER = "#pragma once\n#define SCALE 3.0f\n"

# One extern "C" kernel, one template instance (a mangled name) and one kernel in an anonymous namespace
# (whose mangled name carries a hash of the source path unless the build pins it), reading a local header.
SOURCE = r"""
#include "scale.cuh"
extern "C" __global__ void add_k(float* x, float y) { x[threadIdx.x] += y * SCALE; }
template <int N> __global__ void tmpl_k(float* x) { x[threadIdx.x] += N; }
template __global__ void tmpl_k<4>(float*);
namespace { __global__ void anon_k(float* x) { x[threadIdx.x] *= 2.0f; } }
void launch_anon(float* x) { anon_k<<<1, 32>>>(x); }
"""

# Kernel names by the Itanium C++ ABI: extern "C" is unmangled; tmpl_k<4>(float*) is _Z6tmpl_kILi4EEvPf.
PLAIN_KERNELS = {"add_k", "_Z6tmpl_kILi4EEvPf"}
ANON_PREFIX = "_ZN33_GLOBAL__N__"


def write_sources(folder: Path, name: str = "k", header: str = HEADER) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "scale.cuh").write_text(header)
    src = folder / f"{name}.cu"
    src.write_text(SOURCE)
    return src


def require_nvcc():
    tk = find_toolkit()
    if tk is None:
        pytest.skip("needs nvcc (the CUDA toolkit)")
    return tk


def nvcc_fatbin(src: Path, out: Path, *options: str) -> bytes:
    """Compile src with plain nvcc (not ingot build) and return the fatbin bytes."""
    tk = require_nvcc()
    subprocess.run(
        [str(tk.nvcc), "-fatbin", "-O3", *options, "-o", str(out), src.name],
        cwd=src.parent,
        check=True,
        capture_output=True,
    )
    return out.read_bytes()
