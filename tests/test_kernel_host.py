"""The new weight types' device code, run on the CPU: cuda/repack.cu, cuda/embed.cu and cuda/weights.cuh compiled
as host C++ (tests/kernel_host: a shim for the built-ins, a harness that runs them thread by thread).

Without a GPU this is how the kernels' bit manipulation is tested: the repacked arrays must equal
tests/soa_reference.py's byte for byte, the embedding rows and the GEMM's fp16 tiles must equal gguf's
dequantization bit for bit, and the matvec inner products (each struct's load/dot on q8x2 blocks) must match a
float64 product to ~1e-7. What stays for the GPU tests (tests/gpu/test_gpu_kernels.py) is the parallel part:
the warp loop, shuffles, tensor cores and launch geometry. Needs nvcc (for its host compiler and CUDA headers).
"""

from __future__ import annotations

import ctypes
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soa_reference as soa
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from kernel_sources import require_nvcc

from ingot.runtime.gpu.kernels import LAYOUTS, SUPERBLOCK_TYPES, layout_bytes

ROOT = Path(__file__).resolve().parent.parent
GENERIC = [
    "Q5_0",
    "Q5_1",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q3_K",
    "Q2_K",
    "IQ4_NL",
    "IQ4_XS",
]  # the types with a weights.cuh struct


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tk = require_nvcc()
    lib = tmp_path_factory.mktemp("kernel_host") / "harness.so"
    here = ROOT / "tests" / "kernel_host"
    cmd = [str(tk.nvcc), "-x", "c++", "-std=c++17", "-O1", "-Xcompiler", "-fPIC", "-shared"]
    cmd += ["-I", str(ROOT / "cuda"), "-include", str(here / "shim.h"), str(here / "harness.cpp"), "-o", str(lib)]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    return ctypes.CDLL(str(lib))


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.parametrize("qtype", GENERIC)
@pytest.mark.parametrize("odd", [False, True])
def test_kernel_code_repacks_embeds_tiles_and_dots_exactly(harness, qtype, odd):
    rng = np.random.default_rng(GENERIC.index(qtype) * 2 + odd)
    rows, cols, ncols = 9, (512 if qtype in SUPERBLOCK_TYPES else 96), 2
    raw = soa.random_blocks(rng, qtype, rows, cols, odd=odd)
    with np.errstate(over="ignore"):
        ref = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    sizes = layout_bytes(qtype, rows, cols)
    arrays = {f: np.zeros(n, np.uint8) for f, n in sizes.items()}
    ptrs = (ctypes.c_void_p * len(arrays))(*[_ptr(a) for a in arrays.values()])
    tokens = np.array([3, 0, 8, 3], np.int32)
    scale = np.float32(math.sqrt(640))
    x = np.full((len(tokens), cols), np.nan, np.float32)
    xq, xd = soa.q8x2(rng.standard_normal((ncols, cols)).astype(np.float32))
    y = np.full((ncols, rows), np.nan, np.float32)
    deq = np.full((rows, cols), np.nan, np.float16)
    rc = harness.host_run(
        qtype.lower().encode(), _ptr(raw), ptrs, rows, cols, _ptr(tokens), len(tokens), ctypes.c_float(scale),
        _ptr(x), _ptr(xq), _ptr(xd), ncols, _ptr(y), _ptr(deq),
    )  # fmt: skip
    assert rc == 0 and list(arrays) == [f for f, _ in LAYOUTS[qtype]]
    for field, want in soa.pack(qtype, raw, rows, cols).items():
        got = arrays[field]
        assert np.array_equal(got, want), f"{field}: first difference at byte {np.argmax(got != want)}"
    assert soa.bits_equal(x, ref[tokens] * scale)  # embed: the fp32 row, then one fp32 multiply
    with np.errstate(over="ignore"):  # odd scales overflow fp16 in both: inf == inf
        assert np.array_equal(deq.view(np.uint16), ref.astype(np.float16).view(np.uint16))  # GEMM tile
    xref = soa.dequant_q8x2(xq, xd).reshape(ncols, cols)
    yref = xref @ ref.astype(np.float64).T
    # 1e-6: fp32 accumulation over cols/32 blocks of exact integer dot products (measured ~1e-7)
    assert np.linalg.norm(y - yref) / np.linalg.norm(yref) < 1e-6


@pytest.mark.parametrize(
    "qtype,entry",
    [
        ("Q4_0", "host_mm2_deq"),
        ("Q4_1", "host_mm2_deq"),
        ("Q8_0", "host_mm2_deq"),
        ("Q4_0", "host_mm2r_deq"),
        ("Q4_1", "host_mm2r_deq"),
        ("Q4_K", "host_mm2r_deq"),
        ("Q4_K", "host_mm2_deq"),
    ],
)
@pytest.mark.parametrize("odd", [False, True])
def test_pipelined_gemm_dequantizes_its_raw_stage_like_gguf(harness, qtype, entry, odd):
    """cuda/matmul_tiles.cuh (the fp16 pair arithmetic of matmul2_*'s raw cp.async stages, host_mm2_deq, and of
    matmul2r_*'s mma fragments, host_mm2r_deq) against gguf: Q4_0 and Q8_0 bit for bit with gguf's fp32 value
    rounded to fp16 (the WMMA kernel's tile, exact products); Q4_1's d*q + m is rounded once (an fp16 fma), gguf's
    twice (fp32, then fp16): equal to the once-rounded float64 value, and within one fp16 ulp of gguf's. So the two
    GEMMs multiply the same fp16 weights. Q4_K (the fragment kernels' fp32 fma from its super-block header, and
    matmul2w's tile of it): bit for bit gguf's value rounded to fp16, as matmul2's tile makes it. odd: zero,
    subnormal and large scales (inf and NaN where gguf has them)."""
    rng = np.random.default_rng(["Q4_0", "Q4_1", "Q8_0", "Q4_K"].index(qtype) * 2 + odd)
    # 21 blocks: an odd count, so the last d sits at an even index with its word past the end; Q4_K: 3 super-blocks
    rows, cols = 7, 768 if qtype == "Q4_K" else 96
    raw = soa.random_blocks(rng, qtype, rows, cols, odd=odd)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    arrays = soa.pack(qtype, raw, rows, cols)
    qs = np.ascontiguousarray(arrays["qs"]).view(np.uint8)
    scales = arrays["sc"] if qtype == "Q4_K" else arrays["d"]  # Q4_K: the 16-byte headers, passed as d
    d = np.concatenate([scales.view(np.float16), np.zeros(1, np.float16)])  # the spare element
    m = np.concatenate([arrays["m"].view(np.float16), np.zeros(1, np.float16)]) if "m" in arrays else d
    out = np.full((rows, cols), np.nan, np.float16)
    rc = getattr(harness, entry)(qtype.lower().encode(), _ptr(qs), _ptr(d), _ptr(m), rows, cols, _ptr(out))
    assert rc == 0
    with np.errstate(over="ignore", invalid="ignore"):
        want = ref.astype(np.float16)
    if qtype != "Q4_1":
        same = (out.view(np.uint16) == want.view(np.uint16)) | (np.isnan(out) & np.isnan(want))
        assert same.all(), f"{(~same).sum()} weights differ, first at {np.argwhere(~same)[0]}"
        return
    nb = cols // 32
    dd = d[:-1].astype(np.float64).reshape(rows, nb, 1)
    mm = m[:-1].astype(np.float64).reshape(rows, nb, 1)
    nibbles = qs.reshape(rows, nb, 16)  # byte j: w[j] low, w[j + 16] high
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=2).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        once = (dd * codes + mm).reshape(rows, cols).astype(np.float16)
    same = (out.view(np.uint16) == once.view(np.uint16)) | (np.isnan(out) & np.isnan(once))
    assert same.all(), f"{(~same).sum()} weights differ, first at {np.argwhere(~same)[0]}"
    finite = np.isfinite(want) & np.isfinite(out)
    assert (np.isfinite(want) == np.isfinite(out)).all()
    o, w = out[finite].astype(np.float64), want[finite].astype(np.float64)
    assert (np.abs(o - w) <= np.spacing(np.abs(want[finite])).astype(np.float64)).all()  # within one fp16 ulp


@pytest.mark.parametrize("odd", [False, True])
def test_fragment_gemm_dequantizes_q6_k_like_gguf(harness, odd):
    """cuda/matmul_tiles.cuh deq_q6k_frag (matmul2r_q6_k's B fragments: low-bit nibbles, two high bits per weight,
    two sub-block scales times the super-block's d) against gguf, bit for bit with gguf's fp32 value rounded to
    fp16 (the products are exact): the fp16 weights matmul2's Q6_K tile multiplies. odd: zero, subnormal and large
    scales."""
    rng = np.random.default_rng(11 + odd)
    rows, cols = 5, 768  # 3 super-blocks a row
    raw = soa.random_blocks(rng, "Q6_K", rows, cols, odd=odd)
    with np.errstate(over="ignore", invalid="ignore"):
        want = gguf_dequantize(raw, GGMLQuantizationType.Q6_K).reshape(rows, cols).astype(np.float16)
    arrays = {f: np.ascontiguousarray(a) for f, a in soa.pack("Q6_K", raw, rows, cols).items()}
    out = np.full((rows, cols), np.nan, np.float16)
    rc = harness.host_mm2r_q6k_deq(*(_ptr(arrays[f]) for f in ("qs", "qh", "sc", "d")), rows, cols, _ptr(out))
    assert rc == 0
    same = (out.view(np.uint16) == want.view(np.uint16)) | (np.isnan(out) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} weights differ, first at {np.argwhere(~same)[0]}"
