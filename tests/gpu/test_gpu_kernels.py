"""Every kernel against a numpy reference, on fresh random inputs of awkward sizes, with explicit tolerances.

Outputs are poisoned (0xFF bytes: NaN for floats) before each launch, so an element the kernel failed to write
fails the comparison. Tolerances: exact integer paths (dequantization, q8x2 dot products against an emulated
q8x2 input) ~1e-5 relative; fp16 operands (tensor-core GEMM, fp16 KV cache) ~2e-3.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import soa_reference as soa
from gguf import GGMLQuantizationType, quants
from numerics import rel_err
from sampling_reference import FILTERS, TEMPERATURES, assert_draws_match, filtered_distribution, penalized, top_p_margin
from soa_reference import bits_equal, dequant_q8x2, q8x2

from ingot.runtime.engines.cuda_weights import _alloc_matrix
from ingot.runtime.gpu import constants as K
from ingot.runtime.gpu.driver import Launch
from ingot.runtime.gpu.kernels import (
    LAYOUTS,
    MATMUL2_TILE_ROWS,
    MATMUL2R_TILE_ROWS,
    MATMUL2R_TYPES,
    MATMUL2T_TILE_ROWS,
    MATMUL2W_TILE_ROWS,
    MATMUL2W_TYPES,
    MATVEC_MMA_MIN_COLS,
    MATVEC_STAGED_CC,
    MATVEC_STAGED_TYPES,
    SAMPLE_CHUNK,
    SUPERBLOCK_TYPES,
    GpuMatrix,
    GpuStack,
    NormedQ8,
    fragment_args,
    i32,
    matmul2_smem,
    matmul2r_smem,
    matmul2t_smem,
    matmul2w_smem,
    sample_chunk_bytes,
)

QTYPES = ["Q4_0", "Q4_1", "Q8_0", "F16", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"]
QUANTIZED = [q for q in QTYPES if q != "F16"]


def width(qtype: str, cols: int) -> int:
    """cols rounded up to the type's block: 256 for the K-quants (GGUF's super-block), else 32."""
    block = 256 if qtype in SUPERBLOCK_TYPES else 32
    return -(-cols // block) * block


def staged_width(qtype: str, cols: int) -> int:
    """The least width >= cols that matvec_<type>_b1s stages (kernels.matvec_staged): whole 256-weight groups whose
    every array row is a multiple of 16 bytes (bulk copies). Q6_K's 2-byte d a group makes that 2,048 weights."""
    step = max(256 * 16 // math.gcd(16, b) for _, b in LAYOUTS[qtype])
    return -(-cols // step) * step


@pytest.fixture(params=["mma", "mma-tile", "wmma"])
def gemm(request, gpu):
    """The GEMM kernel families (cuda/matmul.cu), as INGOT_MATMUL picks them: the pipelined mma.sync kernels
    (compute capability >= 8.0), Q4_0 / Q4_1 dequantized into the fragments (matmul2r_*) and the other types
    through an fp16 tile (matmul2_*); mma-tile: matmul2_* for every type; v9's WMMA matmul_*. Kernels.matmul reads
    gpu.k.matmul_mma and gpu.k.matmul_frag at each call."""
    if request.param != "wmma" and gpu.dev.info.cc < 80:
        pytest.skip("matmul2_* needs compute capability 8.0 (mma.sync m16n8k16, cp.async)")
    saved = gpu.k.matmul_mma, gpu.k.matmul_frag
    gpu.k.matmul_mma = request.param != "wmma"
    gpu.k.matmul_frag = request.param == "mma"
    yield request.param
    gpu.k.matmul_mma, gpu.k.matmul_frag = saved


def _gemm_kernels(steps, kind: str) -> None:
    """The launches are the family under test."""
    for step in steps:
        name = step.kernel.name
        if kind == "wmma":
            assert name.startswith("matmul_"), name
        else:
            qtype, tm = name.split("_", 1)[1].upper().split("_BM")
            frag = kind == "mma" and qtype in MATMUL2R_TYPES and int(tm) in MATMUL2R_TILE_ROWS
            assert name.startswith(("matmul2r_", "matmul2w_", "matmul2t_") if frag else "matmul2_"), name


def _run_steps(gpu, steps):
    """Run a list of launches (matvec, matmul: one per part of a stack) and wait."""
    for step in steps:
        step(gpu.stream)
    gpu.stream.synchronize()


def make_weight(gpu, rng, qtype: str, rows: int, cols: int, odd: bool = False) -> tuple[GpuMatrix, np.ndarray]:
    """A random matrix quantized by gguf (or, for the types gguf-py cannot quantize, random GGUF blocks with
    sane scales: tests/soa_reference.py), uploaded and repacked; returns it and gguf's dequantization.
    odd: random blocks with all-zero blocks and zero, subnormal and large scales."""
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype == "F16":
        raw = w.astype(np.float16)
        W = _alloc_matrix(gpu.pool, "F16", rows, cols, "w")
        gpu.stream.upload(W.w.ptr, raw)
        gpu.stream.synchronize()
        return W, raw.astype(np.float64)
    raw = gguf_blocks(rng, w, qtype, odd)
    ref = quants.dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols).astype(np.float64)
    return repacked(gpu, qtype, raw, rows, cols), ref


def gguf_blocks(rng, w: np.ndarray, qtype: str, odd: bool = False) -> np.ndarray:
    """w quantized by gguf-py where it can; else (and for odd) random blocks of the type."""
    if not odd:
        try:
            return quants.quantize(w, GGMLQuantizationType[qtype])
        except NotImplementedError:  # gguf-py quantizes no K-quant
            pass
    return soa.random_blocks(rng, qtype, w.shape[0], w.shape[1], odd=odd)


def repacked(gpu, qtype: str, raw: np.ndarray, rows: int, cols: int) -> GpuMatrix:
    W = _alloc_matrix(gpu.pool, qtype, rows, cols, "w")
    gpu.run(gpu.k.repack(qtype, gpu.put(raw).ptr, W))
    return W


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("odd", [False, True])
def test_repack_and_embed_match_gguf_dequantization(gpu, rng, qtype, odd):
    rows, cols = 77, width(qtype, 96)
    W, ref = make_weight(gpu, rng, qtype, rows, cols, odd=odd)
    tokens = rng.integers(0, rows, size=13).astype(np.int32)
    x = gpu.empty(4 * 13 * cols)
    gpu.run(gpu.k.embed(W, gpu.put(tokens).ptr, x, 13))
    out = gpu.get(x, np.float32, (13, cols))
    # exact: each weight is gguf's fp32 value (same products, same rounding); Q4_0/Q4_1/Q8_0 from gguf's quantizer
    assert bits_equal(out, ref[tokens].astype(np.float32))


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_repack_writes_the_documented_layout(gpu, rng, qtype):
    """The device arrays byte for byte against tests/soa_reference.py (which test_gpu_layouts.py holds to gguf)."""
    rows, cols = 19, width(qtype, 512)
    raw = gguf_blocks(rng, np.zeros((rows, cols), np.float32), qtype, odd=True)
    W = repacked(gpu, qtype, raw, rows, cols)
    want = soa.pack(qtype, raw, rows, cols)
    for field, expected in want.items():
        buf = getattr(W, field)
        got = gpu.get(buf, np.uint8, (buf.nbytes,))
        assert np.array_equal(got, expected), f"{qtype}.{field}: first difference at byte {np.argmax(got != expected)}"


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F16"])
def test_embed_scale_multiplies_the_fp32_row(gpu, rng, qtype):
    """Gemma's x = embed(tokens) * sqrt(dim): the row in fp32, then one fp32 multiply (reference.forward)."""
    rows, cols = 50, width(qtype, 640)
    W, ref = make_weight(gpu, rng, qtype, rows, cols)
    scale = np.float32(math.sqrt(640))
    tokens = rng.integers(0, rows, size=5).astype(np.int32)
    x = gpu.empty(4 * 5 * cols)
    gpu.run(gpu.k.embed(W, gpu.put(tokens).ptr, x, 5, scale=float(scale)))
    assert bits_equal(gpu.get(x, np.float32, (5, cols)), ref[tokens].astype(np.float32) * scale)


@pytest.mark.parametrize("src_type", ["F32", "BF16"])
def test_convert_to_f16(gpu, rng, src_type):
    rows, cols = 5, 64
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    raw = w if src_type == "F32" else (w.view(np.uint32) >> 16).astype(np.uint16)
    ref = w if src_type == "F32" else (raw.astype(np.uint32) << 16).view(np.float32)
    W = _alloc_matrix(gpu.pool, src_type, rows, cols, "w")
    gpu.run(gpu.k.repack(src_type, gpu.put(raw).ptr, W))
    out = gpu.get(W.w, np.float16, (rows, cols))
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("n,dim", [(1, 64), (7, 576), (3, 4096)])
def test_rmsnorm_all_outputs(gpu, rng, n, dim):
    x = rng.standard_normal((n, dim)).astype(np.float32) * 3
    w = rng.standard_normal(dim).astype(np.float32)
    eps = 1e-5
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps) * w
    y, yh = gpu.empty(4 * n * dim), gpu.empty(2 * n * dim)
    yq, yd = gpu.empty(2 * n * dim), gpu.empty(16 * n * dim // 32)
    gpu.run(gpu.k.rmsnorm(gpu.put(x).ptr, gpu.put(w), n, dim, eps, y=y, yq=yq, yd=yd, yh=yh))
    assert rel_err(gpu.get(y, np.float32, (n, dim)), ref) < 1e-5
    assert rel_err(gpu.get(yh, np.float16, (n, dim)), ref) < 1e-3
    deq = dequant_q8x2(gpu.get(yq, np.int8, (n * dim // 32, 64)), gpu.get(yd, np.float32, (n * dim // 32, 4)))
    assert rel_err(deq.reshape(n, dim), ref) < 1e-4


@pytest.mark.parametrize("n,dim,threads", [(1, 4096, 1024), (3, 2080, 1024), (2, 16384, 1024), (1, 4064, 96)])
def test_rmsnorm_rows_split_over_blocks_give_the_same_bits(gpu, rng, n, dim, threads):
    """A row spread over S blocks (grid (n, S): each sums the whole row, writes its share; cuda/norm.cu) writes
    every output once, with the bits of S = 1, for every S up to the warps' trips over the row, in the register
    form (4096 and 2080 at 1024 threads: 4 and 3 trips, the last partial) and the loop form (16384: 16 trips;
    4064 at 3 warps: 43). Outputs are poisoned, so a block a split skipped fails; S = 1 is checked against numpy."""
    x = (rng.standard_normal((n, dim)) * 3).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
    trips = -(-(dim // 32) // (threads // 32))
    xp, wp = gpu.put(x).ptr, gpu.put(w)
    outs = []
    for s in sorted({1, 2, 3, trips - 1, trips}):
        y, yh = gpu.empty(4 * n * dim), gpu.empty(2 * n * dim)
        yq, yd = gpu.empty(2 * n * dim), gpu.empty(16 * n * dim // 32)
        args = [xp, wp, y, yq, yd, yh, np.int32(dim), np.float32(1e-5)]
        gpu.run(Launch(gpu.k.k["rmsnorm_f32"], (n, s), threads, args))
        outs.append([gpu.get(b, np.uint8, (b.nbytes,)) for b in (y, yh, yq, yd)])
    assert rel_err(outs[0][0].view(np.float32).reshape(n, dim), ref) < 1e-5
    for other in outs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(outs[0], other, strict=True))


def test_quantize_q8x2(gpu, rng):
    x = (rng.standard_normal(32 * 37) * rng.uniform(0.01, 10, 32 * 37)).astype(np.float32)
    x[:32] = 0.0  # an all-zero block must give d = 0, q = 0
    q_ref, d_ref = q8x2(x)
    xq, xd = gpu.empty(2 * x.size), gpu.empty(16 * x.size // 32)
    gpu.run(gpu.k.quantize(gpu.put(x).ptr, xq.ptr, xd.ptr, x.size))
    q = gpu.get(xq, np.int8, (x.size // 32, 64))
    d = gpu.get(xd, np.float32, (x.size // 32, 4))
    assert np.array_equal(q, q_ref)
    assert np.allclose(d[:, :2], d_ref[:, :2], rtol=1e-6) and np.allclose(d[:, 2:], d_ref[:, 2:], rtol=1e-5, atol=1e-7)
    assert rel_err(dequant_q8x2(q, d).ravel(), x) < 1e-4


def _activation(gpu, W, x):
    """What matvec reads for W: q8x2 of x (and its exact dequantization as the reference input), or fp32 x."""
    if not W.quantized:
        return gpu.put(x).ptr, x.astype(np.float64)
    xq, xd = q8x2(x)
    return (gpu.put(xq).ptr, gpu.put(xd).ptr), dequant_q8x2(xq, xd).reshape(x.shape)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols,ncols", [(37, 64, 1), (200, 576, 3), (1001, 4096, 8), (64, 1536, 11)])
def test_matvec_store_with_bias(gpu, rng, qtype, rows, cols, ncols):
    cols = width(qtype, cols)
    W, Wref = make_weight(gpu, rng, qtype, rows, cols)
    x = rng.standard_normal((ncols, cols)).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    xin, xref = _activation(gpu, W, x)
    y = gpu.empty(4 * ncols * rows)
    _run_steps(gpu, gpu.k.matvec(W, xin, y.ptr, ncols, ldy=rows, bias=gpu.put(bias)))
    ref = xref @ Wref.T + bias
    assert rel_err(gpu.get(y, np.float32, (ncols, rows)), ref) < 1e-5
    # and against the unquantized activation: q8x2 keeps ~15 bits, so the product is float-accurate
    assert rel_err(gpu.get(y, np.float32, (ncols, rows)), x @ Wref.T + bias) < 1e-4


def _silu(g):
    """g * sigmoid(g), with the sigmoid as 0.5 * (1 + tanh(g / 2)): the same function, without exp(-g)'s overflow
    (and its RuntimeWarning) for large negative g."""
    return g * 0.5 * (1 + np.tanh(g / 2))


def _gelu_tanh(g):
    return 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("ncols", [1, 5])  # 1: the one-column kernels (matvec_<type>_b1)
def test_matvec_add_and_gated(gpu, rng, qtype, ncols):
    F, cols = 96, 256
    W, Wref = make_weight(gpu, rng, qtype, 2 * F, cols)
    x = rng.standard_normal((ncols, cols)).astype(np.float32)
    xin, xref = _activation(gpu, W, x)
    g, u = xref @ Wref[:F].T, xref @ Wref[F:].T
    for mode, act in ((K.MODE_SWIGLU, _silu), (K.MODE_GEGLU, _gelu_tanh)):
        h = gpu.empty(4 * ncols * F)
        _run_steps(gpu, gpu.k.matvec(W, xin, h.ptr, ncols, ldy=F, mode=mode))
        # 1e-4: the product's ~1e-5 error passes through the activation's slope and the fp32 exp/tanh
        assert rel_err(gpu.get(h, np.float32, (ncols, F)), act(g) * u) < 1e-4, mode

    resid = rng.standard_normal((ncols, 2 * F)).astype(np.float32)
    y = gpu.put(resid)
    _run_steps(gpu, gpu.k.matvec(W, xin, y.ptr, ncols, ldy=2 * F, mode=K.MODE_ADD))
    assert rel_err(gpu.get(y, np.float32, (ncols, 2 * F)), resid + xref @ Wref.T) < 1e-5


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("rows,cols", [(1, 64), (37, 832), (203, 4096), (40, 14336)])
def test_tensor_core_matvec_against_numpy(gpu, rng, monkeypatch, qtype, rows, cols):
    """matvec_<type>_mma (cuda/matvec.cu: 3..MVM_COLS columns on the integer tensor cores) at every column count and
    in every mode, against the numpy product of the q8x2 activation's exact dequantization: odd row counts leave the
    last block part-empty (its rows re-read the last one and must be dropped), 3, 5..7 columns part of a
    sequence group, 2 blocks of 32 along a row idle warps and 26 a part-filled last chunk of 8 (zero-filled copies;
    Q4_K's rows are whole super-blocks, a chunk each: 256, 1,024, 4,096, 14,336). The integer sums are exact, so the
    bound is
    the dp4a kernel's (test_matvec_store_with_bias): fp32 rounding of the per-block scaling and its sum, 1e-5."""
    if gpu.dev.info.cc < 80:
        pytest.skip("matvec_<type>_mma needs compute capability 8.0 (mma.sync m16n8k32)")
    monkeypatch.setenv("INGOT_MATVEC_MMA", "1")
    cols = width(qtype, cols)
    Ws, Wsref = make_weight(gpu, rng, qtype, 2 * rows + 1, cols)
    Wg, Wgref = make_weight(gpu, rng, qtype, 2 * rows, cols)  # [gate; up]
    bias = rng.standard_normal(2 * rows + 1).astype(np.float32)
    for ncols in range(MATVEC_MMA_MIN_COLS, K.MATVEC_MMA_COLS + 1):
        x = rng.standard_normal((ncols, cols)).astype(np.float32)
        xin, xref = _activation(gpu, Ws, x)
        resid = rng.standard_normal((ncols, 2 * rows + 1)).astype(np.float32)
        g, u = xref @ Wgref[:rows].T, xref @ Wgref[rows:].T
        cases = (
            (K.MODE_STORE, Ws, 2 * rows + 1, None, xref @ Wsref.T + bias),
            (K.MODE_ADD, Ws, 2 * rows + 1, resid, resid + xref @ Wsref.T + bias),
            (K.MODE_SWIGLU, Wg, rows, None, _silu(g) * u),
            (K.MODE_GEGLU, Wg, rows, None, _gelu_tanh(g) * u),
        )
        for mode, W, n, start, ref in cases:
            y = gpu.put(start) if start is not None else gpu.empty(4 * ncols * n)
            b = gpu.put(bias) if n > rows else None
            launches = gpu.k.matvec(W, xin, y.ptr, ncols, ldy=n, mode=mode, bias=b, narrow=True)
            assert [launch.kernel.name for launch in launches] == [f"matvec_{qtype.lower()}_mma"]
            _run_steps(gpu, launches)
            out = gpu.get(y, np.float32, (ncols, n))
            # gated: 1e-4, the product's ~1e-5 through the activation's slope (test_matvec_add_and_gated)
            assert rel_err(out, ref) < (1e-4 if mode in (K.MODE_SWIGLU, K.MODE_GEGLU) else 1e-5), (ncols, mode)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 256), (37, 768), (203, 4096), (64, 14336)])
def test_matvec_one_column_kernel_matches_the_any_column_kernel(gpu, rng, monkeypatch, qtype, rows, cols):
    """matvec_<type>_b1 (one column, register-capped, cuda/matvec.cu) against the any-column kernel at one column,
    in every mode: odd row counts leave a half-empty last warp (its second row re-reads row 0 and must be dropped)
    and warps past the end; nb < 32 leaves idle lanes. Both run the same PTX (the NC = 1 loop), so they agree to
    fp32 rounding: 1e-6 leaves room only for ptxas contracting a mul+add differently under another register
    budget, while a wrong row, block or lane would be off by the size of the output."""
    cols = width(qtype, cols)
    Ws, _ = make_weight(gpu, rng, qtype, 2 * rows + 1, cols)  # an odd row count for the plain modes
    Wg, _ = make_weight(gpu, rng, qtype, 2 * rows, cols)  # [gate; up] for the gated ones
    x = rng.standard_normal((1, cols)).astype(np.float32)
    xin, _ = _activation(gpu, Ws, x)
    resid = rng.standard_normal(2 * rows + 1).astype(np.float32)
    bias = gpu.put(rng.standard_normal(2 * rows + 1).astype(np.float32))
    modes = (K.MODE_STORE, K.MODE_ADD, K.MODE_SWIGLU, K.MODE_GEGLU)
    outs = {}
    for b1 in ("1", "0"):
        monkeypatch.setenv("INGOT_MATVEC_B1", b1)
        for mode in modes:
            gated = mode in (K.MODE_SWIGLU, K.MODE_GEGLU)
            W, n = (Wg, rows) if gated else (Ws, 2 * rows + 1)
            y = gpu.put(resid[:n]) if mode == K.MODE_ADD else gpu.empty(4 * n)
            launches = gpu.k.matvec(W, xin, y.ptr, 1, ldy=n, mode=mode, bias=None if gated else bias)
            assert [launch.kernel.name.endswith(("_b1", "_b1s")) for launch in launches] == [b1 == "1"]
            _run_steps(gpu, launches)
            outs[b1, mode] = gpu.get(y, np.float32, (n,))
    for mode in modes:
        assert np.isfinite(outs["1", mode]).all(), mode  # every output written (the buffers start as NaN)
        assert rel_err(outs["1", mode], outs["0", mode]) < 1e-6, mode


@pytest.mark.parametrize("qtype", MATVEC_STAGED_TYPES)
@pytest.mark.parametrize("rows,cols", [(1, 256), (37, 1280), (203, 4096), (-1, 1024)])
def test_staged_one_column_matvec_gives_the_b1_bits(gpu, rng, monkeypatch, qtype, rows, cols):
    """matvec_<type>_b1s (cuda/matvec.cu matvec_staged: weights and the activation staged in shared memory by bulk
    copies, persistent warps) against matvec_<type>_b1: the same lanes sum the same blocks in the same order, so
    every mode, with a bias and with a pending norm, gives the same bits. 1280 (40 blocks) leaves a partial last
    step; odd row counts a last pair whose second row is dropped; rows = -1 stands for 3 x the grid's warps pairs
    and more, so warps take several pairs and their rings of MVS_STAGES stages wrap (a wrong phase or slot would
    read a stale or half-copied stage). Q6_K stages at multiples of 2,048 weights only (staged_width)."""
    if gpu.dev.info.cc != MATVEC_STAGED_CC:
        pytest.skip(f"matvec_<type>_b1s runs on compute capability {MATVEC_STAGED_CC} only")
    if rows < 0:
        rows = 3 * gpu.dev.info.sm_count * K.MATVEC_STAGED_WARPS + 19
    cols = staged_width(qtype, cols)
    Ws, _ = make_weight(gpu, rng, qtype, 2 * rows + 1, cols)  # an odd row count for the plain modes
    Wg, _ = make_weight(gpu, rng, qtype, 2 * rows, cols)  # [gate; up]
    x = rng.standard_normal(cols).astype(np.float32)
    plain, _ = _activation(gpu, Ws, x[None, :])
    ss = np.zeros(K.SHARED["MV_NORM_MAX"][0] // 32, np.float32)
    ss[: cols // 32] = (x.astype(np.float64).reshape(-1, 32) ** 2).sum(axis=1)
    normed = NormedQ8(*plain, gpu.put(ss).ptr, 1e-5)
    resid = rng.standard_normal(2 * rows + 1).astype(np.float32)
    bias = gpu.put(rng.standard_normal(2 * rows + 1).astype(np.float32))
    outs = {}
    for staged in ("1", "0"):
        monkeypatch.setenv("INGOT_MATVEC_STAGED", staged)
        for xin in (plain, normed):
            for mode in (K.MODE_STORE, K.MODE_ADD, K.MODE_SWIGLU, K.MODE_GEGLU):
                gated = mode in (K.MODE_SWIGLU, K.MODE_GEGLU)
                W, n = (Wg, rows) if gated else (Ws, 2 * rows + 1)
                y = gpu.put(resid[:n]) if mode == K.MODE_ADD else gpu.empty(4 * n)
                launches = gpu.k.matvec(W, xin, y.ptr, 1, ldy=n, mode=mode, bias=None if gated else bias)
                assert [launch.kernel.name for launch in launches] == [
                    f"matvec_{qtype.lower()}_b1" + "s" * (staged == "1")
                ]
                _run_steps(gpu, launches)
                outs[staged, xin is normed, mode] = gpu.get(y, np.float32, (n,))
    for key in [k for k in outs if k[0] == "1"]:
        got, want = outs[key], outs[("0", *key[1:])]
        assert np.isfinite(got).all(), key  # every output written (the buffers start as NaN)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), key


@pytest.mark.parametrize("qtype", MATVEC_STAGED_TYPES)
@pytest.mark.parametrize("ncols", [2, 3, 4])
@pytest.mark.parametrize("rows,cols", [(1, 256), (37, 1280), (203, 4096), (-1, 2304)])
def test_staged_columns_matvec_gives_the_any_column_bits(gpu, rng, monkeypatch, qtype, ncols, rows, cols):
    """matvec_<type>_bxs (cuda/matvec.cu matvec_cols_staged: the columns staged in shared memory, persistent warps
    taking MVX_PAIRS row pairs at a time) against the any-column matvec_<type>: the same lanes sum the same blocks
    in the same order, so every mode, with a bias, gives the same bits. 1280 (40 blocks) and 2304 (72) leave a
    partial last step of MVX_UNROLL blocks; odd row counts a last pair whose second row is dropped; 1 and 37 rows
    warps with pairs past the end; rows = -1 stands for 3 x the grid's warps' MVX_PAIRS pairs and more, so warps
    take several turns."""
    if gpu.dev.info.cc != MATVEC_STAGED_CC:
        pytest.skip(f"matvec_<type>_bxs runs on compute capability {MATVEC_STAGED_CC} only")
    if rows < 0:
        rows = 3 * 2 * gpu.dev.info.sm_count * K.MATVEC_STAGED_WARPS + 19
    cols = width(qtype, cols)
    Ws, _ = make_weight(gpu, rng, qtype, 2 * rows + 1, cols)  # an odd row count for the plain modes
    Wg, _ = make_weight(gpu, rng, qtype, 2 * rows, cols)  # [gate; up]
    x = rng.standard_normal((ncols, cols)).astype(np.float32)
    xin, _ = _activation(gpu, Ws, x)
    resid = rng.standard_normal((ncols, 2 * rows + 1)).astype(np.float32)
    bias = gpu.put(rng.standard_normal(2 * rows + 1).astype(np.float32))
    outs = {}
    for staged in ("1", "0"):
        monkeypatch.setenv("INGOT_MATVEC_STAGED", staged)
        for mode in (K.MODE_STORE, K.MODE_ADD, K.MODE_SWIGLU, K.MODE_GEGLU):
            gated = mode in (K.MODE_SWIGLU, K.MODE_GEGLU)
            W, n = (Wg, rows) if gated else (Ws, 2 * rows + 1)
            y = gpu.put(np.ascontiguousarray(resid[:, :n])) if mode == K.MODE_ADD else gpu.empty(4 * n * ncols)
            launches = gpu.k.matvec(W, xin, y.ptr, ncols, ldy=n, mode=mode, bias=None if gated else bias)
            assert [launch.kernel.name for launch in launches] == [f"matvec_{qtype.lower()}" + "_bxs" * (staged == "1")]
            _run_steps(gpu, launches)
            outs[staged, mode] = gpu.get(y, np.float32, (ncols, n))
    for key in [k for k in outs if k[0] == "1"]:
        got, want = outs[key], outs[("0", *key[1:])]
        assert np.isfinite(got).all(), key  # every output written (the buffers start as NaN)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), key


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("rows,cols", [(32, 256), (96, 768), (96, 2336), (4064, 4096), (544, 14336)])
def test_matvec_norm_adds_the_residual_and_writes_the_next_norm_input(gpu, rng, qtype, rows, cols):
    """matvec_<type>_b1n (cuda/matvec.cu, the fused norm): x += W·a (+ bias) at one column, then per 32 rows the
    q8x2 of x * w_next and the sum of x's squares. The residual is matched to the product's 1e-5 (as MODE_ADD);
    the q8x2 codes exactly against the numpy emulation applied to the kernel's own new x (the same fp32 product
    x * w, then warp_quantize_q8x2's operations); the sums to fp32 summation order (1e-6). Rows of 8 and 24
    blocks take one block a lane and step, those of 73 (80 for the K-quants: a last step past the row's end), 128
    and 448 two (MVN_WIDE_BLOCKS)."""
    cols = width(qtype, cols)
    W, Wref = make_weight(gpu, rng, qtype, rows, cols)
    a = rng.standard_normal((1, cols)).astype(np.float32)
    ain, aref = _activation(gpu, W, a)
    resid = (rng.standard_normal(rows) * 3).astype(np.float32)
    bias = rng.standard_normal(rows).astype(np.float32)
    w_next = rng.uniform(0.5, 1.5, rows).astype(np.float32)
    x = gpu.put(resid)
    out = NormedQ8(gpu.empty(2 * rows).ptr, gpu.empty(16 * rows // 32).ptr, gpu.empty(4 * rows // 32).ptr, 1e-5)
    launch = gpu.k.matvec_norm(W, ain, x.ptr, gpu.put(w_next), out, bias=gpu.put(bias))
    assert launch.kernel.name == f"matvec_{qtype.lower()}_b1n"
    gpu.run(launch)
    got = gpu.get(x, np.float32, (rows,))
    assert rel_err(got, resid + (aref @ Wref.T)[0] + bias) < 1e-5
    q_ref, d_ref = q8x2(got * w_next)
    q, d = gpu.get(out.xq, np.int8, (rows // 32, 64)), gpu.get(out.xd, np.float32, (rows // 32, 4))
    assert np.array_equal(q, q_ref)
    assert np.allclose(d[:, :2], d_ref[:, :2], rtol=1e-6) and np.allclose(d[:, 2:], d_ref[:, 2:], rtol=1e-5, atol=1e-6)
    ss = gpu.get(out.ss, np.float32, (rows // 32,))
    ss_ref = (got.astype(np.float64).reshape(-1, 32) ** 2).sum(axis=1)
    assert np.allclose(ss, ss_ref, rtol=1e-6)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("rows,cols", [(96, 768), (96, 2336), (544, 14336)])
def test_matvec_norm_gives_the_same_bits_with_x_in_shared_memory(gpu, rng, qtype, rows, cols):
    """On sm_90, matvec_<type>_b1n reads x of rows of at least MVN_WIDE_BLOCKS blocks (73 and 448 here) from its
    dynamic shared memory (stage_x) where that holds it, and from global memory where it does not (launched with
    none): the same products in the same order, so the new residual, the next norm's q8x2 and the sums of squares
    agree bit for bit. Rows of 24 blocks read x from global memory either way (the control)."""
    cols = width(qtype, cols)
    W, _ = make_weight(gpu, rng, qtype, rows, cols)
    ain, _ = _activation(gpu, W, rng.standard_normal((1, cols)).astype(np.float32))
    resid = (rng.standard_normal(rows) * 3).astype(np.float32)
    bias, w_next = (
        gpu.put(rng.standard_normal(rows).astype(np.float32)),
        gpu.put(rng.uniform(0.5, 1.5, rows).astype(np.float32)),
    )
    results = []
    for smem in ("as the host gives it", 0):
        x = gpu.put(resid)
        out = NormedQ8(gpu.empty(2 * rows).ptr, gpu.empty(16 * rows // 32).ptr, gpu.empty(4 * rows // 32).ptr, 1e-5)
        launch = gpu.k.matvec_norm(W, ain, x.ptr, w_next, out, bias=bias)
        if smem == 0:
            launch.smem = 0
            launch._configs.clear()
        gpu.run(launch)
        sizes = ((x.ptr, 4 * rows), (out.xq, 2 * rows), (out.xd, 16 * rows // 32), (out.ss, 4 * rows // 32))
        results.append([gpu.get(b, np.uint8, (n,)) for b, n in sizes])
    for got, want, what in zip(*results, ("x", "xq", "xd", "ss"), strict=True):
        assert np.array_equal(got, want), what


def test_matvec_norm_runs_one_block_an_sm_under_pdl(gpu):
    """Launched with PDL, matvec_<type>_b1n asks for just over half an SM's shared memory, so that the occupancy
    calculator (and so the block scheduler) puts at most one of its blocks on an SM (Kernels._one_block_an_sm:
    two on some SMs and none on others cost the 8B 10%); without PDL it asks for none."""
    threads = 32 * K.MATVEC_NORM_WARPS
    for q in QUANTIZED:
        kernel, smem = gpu.k.k[f"matvec_{q.lower()}_b1n"], gpu.k.norm_smem[q]
        if kernel.pdl:
            assert smem > 0 and kernel.blocks_per_sm(threads, smem) == 1, q
        else:
            assert smem == 0, q


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("rows,cols", [(37, 64), (203, 576), (101, 4096)])
def test_one_column_matvec_applies_a_pending_norm(gpu, rng, qtype, rows, cols):
    """matvec_<type>_b1 reading a NormedQ8: q8x2(x * w) and x's per-block sums of squares, the product scaled by
    rsqrt(mean(x^2) + eps) before the bias and the activation, in every mode. Against rmsnorm(x) * w in float64
    through the same weights: 1e-4, the q8x2 activation's budget against fp32 (test_matvec_store_with_bias)."""
    cols = width(qtype, cols)
    eps = float(rng.uniform(0.5, 2.0))  # of the order of mean(x^2): a wrong or missing eps shows
    x = rng.standard_normal(cols).astype(np.float32)
    w = rng.uniform(0.5, 1.5, cols).astype(np.float32)
    xq, xd = q8x2(x * w)
    ss = np.zeros(K.SHARED["MV_NORM_MAX"][0] // 32, np.float32)  # zero past cols / 32, as the engine's buffer
    ss[: cols // 32] = (x.astype(np.float64).reshape(-1, 32) ** 2).sum(axis=1)
    xin = NormedQ8(gpu.put(xq).ptr, gpu.put(xd).ptr, gpu.put(ss).ptr, eps)
    h = (x / np.sqrt((x.astype(np.float64) ** 2).mean() + eps) * w)[None, :]
    Ws, Wsref = make_weight(gpu, rng, qtype, rows, cols)
    bias = rng.standard_normal(rows).astype(np.float32)
    y = gpu.empty(4 * rows)
    _run_steps(gpu, gpu.k.matvec(Ws, xin, y.ptr, 1, ldy=rows, bias=gpu.put(bias)))
    assert rel_err(gpu.get(y, np.float32, (rows,)), (h @ Wsref.T)[0] + bias) < 1e-4
    Wg, Wgref = make_weight(gpu, rng, qtype, 2 * rows, cols)
    g, u = (h @ Wgref[:rows].T)[0], (h @ Wgref[rows:].T)[0]
    for mode, act in ((K.MODE_SWIGLU, _silu), (K.MODE_GEGLU, _gelu_tanh)):
        out = gpu.empty(4 * rows)
        launches = gpu.k.matvec(Wg, xin, out.ptr, 1, ldy=rows, mode=mode)
        assert [launch.kernel.name.removesuffix("s") for launch in launches] == [f"matvec_{qtype.lower()}_b1"]
        _run_steps(gpu, launches)
        assert rel_err(gpu.get(out, np.float32, (rows,)), act(g) * u) < 1e-4, mode


def _stack(gpu, rng, qtypes, rows, cols):
    parts, refs = zip(*(make_weight(gpu, rng, q, r, cols) for q, r in zip(qtypes, rows, strict=True)), strict=True)
    return GpuStack(list(parts)), np.concatenate(refs)


@pytest.mark.parametrize(
    "qtypes,rows",
    [
        (["Q5_0", "Q5_0", "Q8_0"], [256, 64, 64]),  # Gemma 3 270M Q4_K_M: q, k in Q5_0 and v in Q8_0
        (["Q4_K", "Q6_K"], [37, 91]),
        (["Q8_0", "Q4_0", "Q2_K", "Q3_K"], [8, 9, 10, 11]),
    ],
)
def test_matvec_and_matmul_on_mixed_type_stacks(gpu, rng, gemm, qtypes, rows):
    cols, ncols, M = 512, 3, 21
    S, Sref = _stack(gpu, rng, qtypes, rows, cols)
    N = S.rows
    x = rng.standard_normal((ncols, cols)).astype(np.float32)
    xq, xd = q8x2(x)
    xref = dequant_q8x2(xq, xd).reshape(x.shape)
    bias = rng.standard_normal(N).astype(np.float32)
    y = gpu.empty(4 * ncols * N)
    _run_steps(gpu, gpu.k.matvec(S, (gpu.put(xq).ptr, gpu.put(xd).ptr), y.ptr, ncols, ldy=N, bias=gpu.put(bias)))
    assert rel_err(gpu.get(y, np.float32, (ncols, N)), xref @ Sref.T + bias) < 1e-5
    A = rng.standard_normal((M, cols)).astype(np.float16)
    Wh = Sref.astype(np.float16).astype(np.float64)
    for split_k in (False, True):
        C = gpu.empty(4 * M * N)
        scratch = gpu.split_k if split_k else None
        steps = gpu.k.matmul(S, gpu.put(A).ptr, C.ptr, M, ldc=N, bias=gpu.put(bias), split_k=scratch)
        _gemm_kernels(steps, gemm)
        _run_steps(gpu, steps)
        assert rel_err(gpu.get(C, np.float32, (M, N)), A.astype(np.float64) @ Wh.T + bias) < 1e-3, split_k


# Sizes: M = 1 (one token), 37 and 200 (neither a multiple of any tile height: 32, 64, 128 or WMMA's 64), N not a
# multiple of 64 or 128, K not a multiple of 64 or 128 (K steps of 32: 2, 18 and 48 of them; 256-multiples for the
# super-block types: 256, 768, 1536); 200 x 1001 (row tiles of matmul2's 128 and 64 heights, 8 feature tiles).
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,N,K_", [(1, 70, 64), (37, 130, 576), (200, 64, 1536), (200, 1001, 96)])
@pytest.mark.parametrize("split_k", [False, True])
def test_matmul(gpu, rng, gemm, qtype, M, N, K_, split_k):
    K_ = width(qtype, K_)
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = rng.standard_normal((M, K_)).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float32)
    C = gpu.empty(4 * M * N)
    split_k = gpu.split_k if split_k else None
    steps = gpu.k.matmul(W, gpu.put(A).ptr, C.ptr, M, ldc=N, bias=gpu.put(bias), split_k=split_k)
    _gemm_kernels(steps, gemm)
    _run_steps(gpu, steps)
    Wh = Wref.astype(np.float16).astype(np.float64)  # the kernel multiplies fp16-rounded weights
    ref = A.astype(np.float64) @ Wh.T + bias
    assert rel_err(gpu.get(C, np.float32, (M, N)), ref) < 1e-3
    resid = rng.standard_normal((M, N)).astype(np.float32)
    Cb = gpu.put(resid)
    _run_steps(
        gpu, gpu.k.matmul(W, gpu.put(A).ptr, Cb.ptr, M, ldc=N, mode=K.MODE_ADD, bias=gpu.put(bias), split_k=split_k)
    )
    assert rel_err(gpu.get(Cb, np.float32, (M, N)), resid + A.astype(np.float64) @ Wh.T + bias) < 1e-3


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("tm", MATMUL2_TILE_ROWS)
def test_matmul2_every_tile_height_matches_wmma(gpu, rng, qtype, tm):
    """Each matmul2_<type>_bm<tm> kernel, launched directly on a strided output (ldc > N) with no bias, M one past
    a tile (rows of the second tile all padding but one), against the same product by v9's WMMA kernel and numpy.
    Kernels.matmul picks the height from M, so this reaches the heights the other tests' sizes do not."""
    if gpu.dev.info.cc < 80:
        pytest.skip("matmul2_* needs compute capability 8.0")
    from ingot.runtime.gpu.driver import Launch
    from ingot.runtime.gpu.kernels import GemmTiling, i32

    M, N, K_ = tm + 1, 203, width(qtype, 320)
    ldc = N + 5
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = gpu.put(rng.standard_normal((M, K_)).astype(np.float16))
    t = GemmTiling(True, tm, K.MATMUL2_BN, 1)
    C = gpu.empty(4 * M * ldc)
    args = [*W.args(), A, None, C.ptr, i32(M), i32(N), i32(K_), i32(ldc), i32(K.MODE_STORE), None, None]
    gpu.run(Launch(gpu.k.k[t.kernel(qtype)], t.grid(M, N), t.threads, args, smem=t.smem(qtype)))
    got = gpu.get(C, np.float32, (M, ldc))
    assert np.isnan(got[:, N:]).all(), "columns past N (the stride's padding) were written"
    Wh = Wref.astype(np.float16).astype(np.float64)
    assert rel_err(got[:, :N], gpu.get(A, np.float16, (M, K_)).astype(np.float64) @ Wh.T) < 1e-3
    saved = gpu.k.matmul_mma
    try:
        gpu.k.matmul_mma = False
        Cw = gpu.empty(4 * M * ldc)
        gpu.run(gpu.k.matmul(W, A.ptr, Cw.ptr, M, ldc=ldc))
    finally:
        gpu.k.matmul_mma = saved
    # the same fp16 weights (Q4_1: rounded once here, twice there, rarely one ulp apart) and products, summed in
    # other orders in fp32: ~1e-6, far below the 1e-3 both keep against numpy
    assert rel_err(got[:, :N], gpu.get(Cw, np.float32, (M, ldc))[:, :N].astype(np.float64)) < 1e-4


@pytest.mark.parametrize("qtype", MATMUL2R_TYPES)
@pytest.mark.parametrize("tm", MATMUL2R_TILE_ROWS)
@pytest.mark.parametrize("slices,cluster", [(1, False), (3, False), (5, True)])
def test_fragment_gemm_gives_the_bits_of_the_tile_gemm(gpu, rng, qtype, tm, slices, cluster):
    """matmul2r_<type>_bm<tm> (weights dequantized into the mma fragments, KB blocks a stage) against
    matmul2_<type>_bm<tm> (an fp16 tile, one block a step), both launched directly: the same bits, unsplit and in
    split-K slices summed by the last block or in a cluster. K = 37 blocks: slices of 13 and 11 blocks, so stages
    end part-full and each row's scales start at another offset in their 16-byte chunk (Q4_K: 56 blocks, 7 of its
    super-blocks: slices of 19 and 18, so stages of 2 and of 4 blocks both run into a second header; Q6_K the same
    56, so its stages run into a second super-block's d, the second of its 4-byte words too where a stage starts at
    an odd super-block); M and N past a tile, a strided output, MODE_ADD onto a residual with a bias. Both within
    numpy's 1e-3."""
    if gpu.dev.info.cc < (90 if cluster else 80):
        pytest.skip("needs compute capability 9.0 (clusters)" if cluster else "matmul2_* needs compute capability 8.0")
    M, N, K_ = tm + 3, 203, 32 * (56 if qtype in SUPERBLOCK_TYPES else 37)
    ldc = N + 5
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = gpu.put(rng.standard_normal((M, K_)).astype(np.float16))
    bias = gpu.put(rng.standard_normal(N).astype(np.float32))
    resid = rng.standard_normal((M, ldc)).astype(np.float32)
    grid = (-(-M // tm), -(-N // K.MATMUL2_BN), slices)
    scratch = [None, None] if cluster or slices == 1 else [gpu.split_k.ws, gpu.split_k.counters]
    out = {}
    for name, weights, smem in (
        (f"matmul2_{qtype.lower()}_bm{tm}", W.args(), matmul2_smem(qtype, tm, cluster)),
        (f"matmul2r_{qtype.lower()}_bm{tm}", fragment_args(W), matmul2r_smem(qtype, tm, cluster)),
    ):
        C = gpu.put(resid)
        args = [*weights, A, bias, C.ptr, i32(M), i32(N), i32(K_), i32(ldc), i32(K.MODE_ADD), *scratch]
        gpu.run(Launch(gpu.k.k[name], grid, K.MATMUL2_THREADS, args, smem=smem, cluster=slices if cluster else 1))
        out[name] = gpu.get(C, np.float32, (M, ldc))
    tile, frag = out.values()
    assert np.array_equal(frag.view(np.uint32), tile.view(np.uint32))
    ref = resid.astype(np.float64)
    Wh = Wref.astype(np.float16).astype(np.float64)
    ref[:, :N] += gpu.get(A, np.float16, (M, K_)).astype(np.float64) @ Wh.T + gpu.get(bias, np.float32, (N,))
    assert rel_err(frag, ref) < 1e-3
    assert np.array_equal(frag[:, N:], resid[:, N:]), "columns past N (the stride's padding) were written"


WGMMA_KERNELS = [
    *((f"matmul2w_{{}}_bm{tm}", tm, matmul2w_smem) for tm in MATMUL2W_TILE_ROWS),
    *((f"matmul2t_{{}}_bm{tm}", tm, matmul2t_smem) for tm in MATMUL2T_TILE_ROWS),
]


@pytest.mark.parametrize("qtype", MATMUL2W_TYPES)
@pytest.mark.parametrize("kernel,tm,smem", WGMMA_KERNELS, ids=[k.format("q") for k, _, _ in WGMMA_KERNELS])
@pytest.mark.parametrize(
    "M,K_,slices", [(-3, 32 * 37, 1), (-3, 32 * 37, 3), (300, 32 * 5, 1), (1, 32 * 64, 4), (5, 32 * 37, 4)]
)
def test_wgmma_gemm_against_the_fragment_gemm_and_numpy(gpu, rng, qtype, kernel, tm, smem, M, K_, slices):
    """The wgmma kernels (sm_90a images: matmul2w_<type>_bm<tm>, the weight tile in shared memory; matmul2t, the
    weights in registers and the tokens as wgmma's n) against matmul2r_<type>_bm<tm>, all launched directly,
    MODE_ADD onto a strided residual with a bias: M past a tile (-3: tm + 3, a second tile of 3 rows; 300: several
    tiles, the last part-full; 1; 5), N = 203 (a second, part-full tile of features), K odd in blocks (37: every
    stage full but the last; 5 unsplit; slices of 13 / 10 / 11 blocks starting at other scale-window offsets,
    summed through the scratch; Q4_K's K in whole 256-weight super-blocks: 56 blocks for 37, so slices of 19 start
    mid-header and its stages run into the next one, 8 for 5, 64). The same
    fp16 products summed in another order inside the tensor cores: within 1e-5 of matmul2r (fp32 sums of <= 2,048
    terms, measured ~1e-7), and both within numpy's 1e-3; columns past N untouched."""
    if not gpu.k.matmul_wgmma:
        pytest.skip("the wgmma kernels need the sm_90a image (a compute capability 9.0 GPU and INGOT_MATMUL=mma)")
    M, K_ = tm - M if M < 0 else M, (32 * 56 if K_ == 32 * 37 else width(qtype, K_)) if qtype == "Q4_K" else K_
    N, ldc = 203, 208
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = gpu.put(rng.standard_normal((M, K_)).astype(np.float16))
    bias = gpu.put(rng.standard_normal(N).astype(np.float32))
    resid = rng.standard_normal((M, ldc)).astype(np.float32)
    grid = (-(-M // tm), -(-N // K.MATMUL2_BN), slices)
    scratch = [None, None] if slices == 1 else [gpu.split_k.ws, gpu.split_k.counters]
    out = {}
    for name, nbytes in (
        (f"matmul2r_{qtype.lower()}_bm{tm}", matmul2r_smem(qtype, tm)),
        (kernel.format(qtype.lower()), smem(qtype, tm)),
    ):
        C = gpu.put(resid)
        args = [*fragment_args(W), A, bias, C.ptr, i32(M), i32(N), i32(K_), i32(ldc), i32(K.MODE_ADD), *scratch]
        gpu.run(Launch(gpu.k.k[name], grid, K.MATMUL2_THREADS, args, smem=nbytes))
        out[name] = gpu.get(C, np.float32, (M, ldc))
    frag, wg = out.values()
    ref = resid.astype(np.float64)
    Wh = Wref.astype(np.float16).astype(np.float64)
    ref[:, :N] += gpu.get(A, np.float16, (M, K_)).astype(np.float64) @ Wh.T + gpu.get(bias, np.float32, (N,))
    assert rel_err(wg, frag.astype(np.float64)) < 1e-5
    assert rel_err(wg, ref) < 1e-3 and rel_err(frag, ref) < 1e-3
    assert np.array_equal(wg[:, N:], resid[:, N:]), "columns past N (the stride's padding) were written"


@pytest.mark.parametrize(
    "qtype,M,N,K_,slice_rows,kernel",
    [
        ("Q4_0", 512, 16384 + 37, 320, 512, "matmul2w_q4_0_bm128"),  # a prefill pass: 128-row tiles, no split
        ("Q4_0", 40, 4096 + 37, 2048, None, "matmul2t_q4_0_bm64"),  # decode batches: 64-, 32-row tiles, K slices
        ("Q4_0", 20, 4096 + 37, 2048, None, "matmul2t_q4_0_bm32"),
        ("Q4_K", 512, 16384 + 37, 512, 512, "matmul2w_q4_k_bm128"),  # Q4_K: its super-block headers as the scales
        ("Q4_K", 40, 4096 + 37, 2048, None, "matmul2t_q4_k_bm64"),
        ("Q6_K", 512, 16384 + 37, 512, 512, "matmul2r_q6_k_bm128"),  # Q6_K: matmul2r at every height
        ("Q6_K", 40, 4096 + 37, 2048, None, "matmul2r_q6_k_bm64"),
    ],
)
def test_gemm_runs_on_wgmma_through_the_engine_tiling(gpu, rng, qtype, M, N, K_, slice_rows, kernel):
    """Kernels.matmul at a prefill pass's width and at decode batches (split-K scratch: K slices, summed through
    it) launches the wgmma kernel of its tiling where the image has wgmma (Q6_K: the fragment kernel, which it keeps
    there), and its result is numpy's."""
    if not gpu.k.matmul_wgmma:
        pytest.skip("the wgmma kernels need the sm_90a image (a compute capability 9.0 GPU and INGOT_MATMUL=mma)")
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = rng.standard_normal((M, K_)).astype(np.float16)
    C = gpu.empty(4 * M * N)
    steps = gpu.k.matmul(W, gpu.put(A).ptr, C.ptr, M, ldc=N, split_k=gpu.split_k, slice_rows=slice_rows)
    assert [s.kernel.name for s in steps] == [kernel]
    assert slice_rows is not None or steps[0].grid[2] > 1, "a decode width that is not split tests less"
    _run_steps(gpu, steps)
    Wh = Wref.astype(np.float16).astype(np.float64)
    assert rel_err(gpu.get(C, np.float32, (M, N)), A.astype(np.float64) @ Wh.T) < 1e-3


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K"])
def test_split_k_matmul_is_deterministic_and_leaves_its_counters_zero(gpu, rng, gemm, qtype):
    """The slices' partial tiles are summed in slice order by each tile's last block: five runs of a split decode
    GEMM (odd M, N not a tile multiple, a strided output, MODE_ADD) give the same bits, and the per-tile counters
    are back at zero after each launch (the next GEMM relies on it). With atomics (v9) runs differed in the last
    bits, which Gemma's fp16 activations amplified to 1e-2 on the logits."""
    M, N, K_, ldc = 13, 4096 + 96, width(qtype, 2048), 4096 + 128
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = gpu.put(rng.standard_normal((M, K_)).astype(np.float16))
    resid = rng.standard_normal((M, ldc)).astype(np.float32)
    steps = gpu.k.matmul(W, A.ptr, 0, M, ldc=ldc, mode=K.MODE_ADD, split_k=gpu.split_k)
    assert all(step.grid[2] > 1 for step in steps)
    _gemm_kernels(steps, gemm)
    runs = []
    for _ in range(5):
        C = gpu.put(resid)
        steps = gpu.k.matmul(W, A.ptr, C.ptr, M, ldc=ldc, mode=K.MODE_ADD, split_k=gpu.split_k)
        _run_steps(gpu, steps)
        runs.append(gpu.get(C, np.float32, (M, ldc)))
        counters = gpu.get(gpu.split_k.counters, np.int32, (gpu.split_k.counters.nbytes // 4,))
        assert not counters.any(), "split-K counters left non-zero"
    for r in runs[1:]:
        assert np.array_equal(r.view(np.uint32), runs[0].view(np.uint32))
    Wh = Wref.astype(np.float16).astype(np.float64)
    ref = resid.astype(np.float64)
    ref[:, :N] += gpu.get(A, np.float16, (M, K_)).astype(np.float64) @ Wh.T
    assert rel_err(runs[0], ref) < 1e-3
    assert np.array_equal(runs[0][:, N:], resid[:, N:]), "columns past N (the stride's padding) were written"


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("M,N,cols", [(13, 1037, 1000), (64, 965, 1500)])
def test_cluster_split_k_gives_the_bits_of_the_ordered_sum(gpu, rng, qtype, M, N, cols):
    """matmul2's two split-K sums (cuda/matmul.cu): the tile's slices as one thread-block cluster adding their
    partials from each other's shared memory (sm_90+), and the tile's last block adding them from global memory.
    Both add in slice order from 0, so a split decode GEMM (odd M and N, MODE_ADD onto a residual, a strided
    output) gives the same bits either way, and numpy's product within the GEMM tests' 1e-3. (Without the wgmma
    kernels: matmul2t, which takes Q4_0 / Q4_1's 64-row tiles on an sm_90a image, has only the second sum.)"""
    if gpu.dev.info.cc < 90:
        pytest.skip("thread-block clusters need compute capability 9.0")
    K_, ldc = width(qtype, cols), N + 11
    W, Wref = make_weight(gpu, rng, qtype, N, K_)
    A = gpu.put(rng.standard_normal((M, K_)).astype(np.float16))
    resid = rng.standard_normal((M, ldc)).astype(np.float32)
    saved = gpu.k.matmul_mma, gpu.k.split_k_cluster, gpu.k.matmul_wgmma
    out = {}
    try:
        gpu.k.matmul_mma, gpu.k.matmul_wgmma = True, False
        for cluster in (False, True):
            gpu.k.split_k_cluster = cluster
            C = gpu.put(resid)
            steps = gpu.k.matmul(W, A.ptr, C.ptr, M, ldc=ldc, mode=K.MODE_ADD, split_k=gpu.split_k)
            assert all(step.grid[2] > 1 and (step.cluster == step.grid[2]) == cluster for step in steps)
            _run_steps(gpu, steps)
            out[cluster] = gpu.get(C, np.float32, (M, ldc))
    finally:
        gpu.k.matmul_mma, gpu.k.split_k_cluster, gpu.k.matmul_wgmma = saved
    assert np.array_equal(out[True].view(np.uint32), out[False].view(np.uint32))
    ref = resid.astype(np.float64)
    ref[:, :N] += gpu.get(A, np.float16, (M, K_)).astype(np.float64) @ Wref.astype(np.float16).astype(np.float64).T
    assert rel_err(out[True], ref) < 1e-3
    assert np.array_equal(out[True][:, N:], resid[:, N:]), "columns past N (the stride's padding) were written"


class _Cfg:
    """The Config fields the attention/rope kernels read."""

    def __init__(self, H, Hkv, hd, neox=False):
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dim, self.rope_neox = H, Hkv, hd, hd, neox


def _rope_ref(x, pos, inv_freq, neox):
    from ingot.runtime.model.reference import rope

    return rope(x.astype(np.float32), pos, inv_freq, neox).astype(np.float64)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("hd", [64, 128])
def test_rope_and_kv_write(gpu, rng, neox, hd):
    H, Hkv, n, n_pages, max_pages = 6, 2, 9, 40, 8
    cfg = _Cfg(H, Hkv, hd, neox)
    qkv = rng.standard_normal((n, (H + 2 * Hkv) * hd)).astype(np.float32)
    slot = rng.choice(3 * max_pages * K.PAGE, size=n, replace=False)  # distinct (sequence, position) pairs
    seq, pos = (slot // (max_pages * K.PAGE)).astype(np.int32), (slot % (max_pages * K.PAGE)).astype(np.int32)
    table = rng.permutation(n_pages)[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
    inv_freq = 10000.0 ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angle = np.arange(max_pages * K.PAGE)[:, None] * inv_freq[None, :]
    rope_tab = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
    page_elems = K.PAGE * Hkv * hd
    kc, vc = gpu.empty(2 * n_pages * page_elems, 0), gpu.empty(2 * n_pages * page_elems, 0)
    dq = gpu.put(qkv)
    gpu.run(
        gpu.k.rope_kv(
            dq.ptr,
            gpu.put(rope_tab),
            gpu.put(seq).ptr,
            gpu.put(pos).ptr,
            gpu.put(table).ptr,
            max_pages,
            kc.ptr,
            vc.ptr,
            n,
            cfg,
        )
    )
    out = gpu.get(dq, np.float32, qkv.shape)
    q_ref = _rope_ref(qkv[:, : H * hd].reshape(n, H, hd), pos, inv_freq, neox).reshape(n, -1)
    k_ref = _rope_ref(qkv[:, H * hd : (H + Hkv) * hd].reshape(n, Hkv, hd), pos, inv_freq, neox)
    assert rel_err(out[:, : H * hd], q_ref) < 1e-5
    kcache = gpu.get(kc, np.float16, (n_pages, Hkv, K.PAGE, hd))
    vcache = gpu.get(vc, np.float16, (n_pages, Hkv, K.PAGE, hd))
    v_ref = qkv[:, (H + Hkv) * hd :].reshape(n, Hkv, hd)
    for i in range(n):
        page, slot = table[seq[i], pos[i] // K.PAGE], pos[i] % K.PAGE
        assert rel_err(kcache[page, :, slot], k_ref[i]) < 1e-3
        assert rel_err(vcache[page, :, slot], v_ref[i]) < 1e-3


def _random_cache(gpu, rng, n_pages, Hkv, hd):
    k = (rng.standard_normal((n_pages, Hkv, K.PAGE, hd))).astype(np.float16)
    v = (rng.standard_normal((n_pages, Hkv, K.PAGE, hd))).astype(np.float16)
    return k, v, gpu.put(k), gpu.put(v)


def _attend(q, k, v):
    """q [G, hd], k/v [n, hd] -> softmax(q k^T / sqrt(hd)) v, float64."""
    s = q.astype(np.float64) @ k.astype(np.float64).T / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def _rope_table(hd, n_pos, theta=10000.0):
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angle = np.arange(n_pos)[:, None] * inv_freq[None, :]
    return inv_freq, np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)


@pytest.mark.parametrize("hd,H,Hkv,neox", [(64, 9, 3, False), (128, 32, 8, False), (64, 8, 8, True)])
@pytest.mark.parametrize("splits", [1, 7, 32, 64])
def test_attention_decode_fused(gpu, rng, hd, H, Hkv, neox, splits):
    """rope + KV write + split-KV attention + last-block merge, for sequences of very different lengths."""
    lens = np.array([1, 31, 33, 100, 1000], dtype=np.int32)
    B, max_pages = len(lens), 40
    n_pages = B * max_pages
    kh, vh, kc, vc = _random_cache(gpu, rng, n_pages, Hkv, hd)
    table = rng.permutation(n_pages).reshape(B, max_pages).astype(np.int32)
    qkv = rng.standard_normal((B, (H + 2 * Hkv) * hd)).astype(np.float32)
    inv_freq, rope_tab = _rope_table(hd, max_pages * K.PAGE)
    cfg = _Cfg(H, Hkv, hd, neox)
    acc, ml = gpu.empty(4 * B * H * splits * hd), gpu.empty(8 * B * H * splits)
    counters = gpu.empty(4 * B * Hkv, 0)
    out, outq, outd = gpu.empty(4 * B * H * hd), gpu.empty(2 * B * H * hd), gpu.empty(16 * B * H * hd // 32)
    outh = gpu.empty(2 * B * H * hd)
    launch = gpu.k.attn_decode(
        gpu.put(qkv).ptr,
        gpu.put(rope_tab),
        kc.ptr,
        vc.ptr,
        gpu.put(table).ptr,
        max_pages,
        gpu.put(lens - 1).ptr,
        acc.ptr,
        ml.ptr,
        counters.ptr,
        out.ptr,
        B,
        splits,
        cfg,
        outq=outq.ptr,
        outd=outd.ptr,
        outh=outh.ptr,
    )
    gpu.run(launch)
    first = gpu.get(out, np.float32, (B, H, hd))
    gpu.stream.memset(out.ptr, 0xFF, 4 * B * H * hd)
    gpu.run(launch)  # the counters were reset: a replay gives the same result
    got = gpu.get(out, np.float32, (B, H, hd))
    assert np.array_equal(first, got)
    assert not gpu.get(counters, np.int32, (B * Hkv,)).any()

    kcache = gpu.get(kc, np.float16, kh.shape)
    G = H // Hkv
    for b, n in enumerate(lens):
        p = n - 1
        q = _rope_ref(qkv[b, : H * hd].reshape(1, H, hd), np.array([p]), inv_freq, neox)[0]
        k_new = _rope_ref(qkv[b, H * hd : (H + Hkv) * hd].reshape(1, Hkv, hd), np.array([p]), inv_freq, neox)[0]
        v_new = qkv[b, (H + Hkv) * hd :].reshape(Hkv, hd)
        page, slot = table[b, p // K.PAGE], p % K.PAGE
        assert rel_err(kcache[page, :, slot], k_new) < 1e-3  # the new key landed in its page
        kh[page, :, slot], vh[page, :, slot] = k_new, v_new  # the reference cache, updated
        pages = table[b, : (n + K.PAGE - 1) // K.PAGE]
        for kvh in range(Hkv):
            k = kh[pages, kvh].reshape(-1, hd)[:n]
            v = vh[pages, kvh].reshape(-1, hd)[:n]
            ref = _attend(q[kvh * G : (kvh + 1) * G], k, v)
            assert rel_err(got[b, kvh * G : (kvh + 1) * G], ref) < 2e-3, (b, n, kvh)
    deq = dequant_q8x2(gpu.get(outq, np.int8, (B * H * hd // 32, 64)), gpu.get(outd, np.float32, (B * H * hd // 32, 4)))
    assert rel_err(deq.ravel(), got.ravel()) < 1e-4
    assert rel_err(gpu.get(outh, np.float16, got.shape), got) < 1e-3


@pytest.mark.parametrize("hd,H,Hkv", [(64, 9, 3), (128, 8, 2)])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 17), (45, 100), (500, 40)])
def test_attention_prefill_causal(gpu, rng, hd, H, Hkv, start, T):
    total = start + T
    max_pages = (total + K.PAGE - 1) // K.PAGE
    kh, vh, kc, vc = _random_cache(gpu, rng, max_pages + 5, Hkv, hd)
    row = rng.permutation(max_pages + 5)[:max_pages].astype(np.int32)
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
    out = gpu.empty(2 * T * H * hd)
    positions = np.arange(start, start + T, dtype=np.int32)
    gpu.run(
        gpu.k.attn_prefill(
            gpu.put(qkv).ptr,
            qkv.shape[1],
            kc.ptr,
            vc.ptr,
            gpu.put(row).ptr,
            gpu.put(positions).ptr,
            T,
            out.ptr,
            _Cfg(H, Hkv, hd),
        )
    )
    got = gpu.get(out, np.float16, (T, H, hd))
    G = H // Hkv
    for t in range(T):
        n = start + t + 1
        for h in range(H):
            k = kh[row, h // G].reshape(-1, hd)[:n]
            v = vh[row, h // G].reshape(-1, hd)[:n]
            ref = _attend(qkv[t, h * hd : (h + 1) * hd][None], k, v)[0]
            assert rel_err(got[t, h], ref) < 2e-3, (t, h)


def test_swiglu(gpu, rng):
    n, F = 7, 96
    gu = rng.standard_normal((n, 2 * F)).astype(np.float32)
    h = gpu.empty(2 * n * F)
    gpu.run(gpu.k.swiglu(gpu.put(gu).ptr, h.ptr, F, n))
    g, u = gu[:, :F].astype(np.float64), gu[:, F:]
    assert rel_err(gpu.get(h, np.float16, (n, F)), _silu(g) * u) < 1e-3


class _Sampler:
    """Per-sequence sampling parameter arrays on the device, as the engine lays them out."""

    def __init__(
        self, gpu, B, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty=1.0, hist=None, seed=0, counter=0
    ):
        hist = np.zeros((B, 1), np.int32) if hist is None else np.asarray(hist, np.int32)
        f = lambda v, dt: gpu.put(np.broadcast_to(np.asarray(v, dt), (B,)).copy()).ptr  # noqa: E731
        self.args = {
            "temperature": f(temperature, np.float32),
            "top_k": f(top_k, np.int32),
            "top_p": f(top_p, np.float32),
            "min_p": f(min_p, np.float32),
            "penalty": f(penalty, np.float32),
            "hist": gpu.put(hist).ptr,
            "hist_len": f(hist.shape[1], np.int32),
            "hist_cap": hist.shape[1],
            "seed": f(seed, np.uint64),
            "counter": f(counter, np.int32),
        }


def _sample(gpu, logits, *, prep=False, mask=None, **kw):
    """Tokens sampled from logits [B, V]. prep: pass the chunk buffer, so a vocabulary of 65,536 or more goes
    through sample_prep_f32 first (else the single-block path); mask: allowed-token bits [B, ceil(V/32)] uint32
    (every row constrained)."""
    B, V = logits.shape
    out = gpu.empty(4 * B)
    args = _Sampler(gpu, B, **kw).args
    if prep:
        args["chunks"] = gpu.empty(sample_chunk_bytes(V, B)).ptr
    if mask is not None:
        args |= {"masked": gpu.put(np.ones(B, np.int32)).ptr, "mask": gpu.put(mask).ptr, "mask_words": mask.shape[1]}
    gpu.run(gpu.k.sample(gpu.put(logits).ptr, V, V, B, args, out.ptr))
    return gpu.get(out, np.int32, (B,))


@pytest.mark.parametrize("V", [65536, 100003, 128256, 262144])  # the prep path's sizes: even, odd, Llama 3, Gemma
@pytest.mark.parametrize("B", [1, 5])
def test_sample_prep_gives_the_single_block_paths_tokens(gpu, rng, V, B):
    """sample_prep_f32 + sample_f32 against sample_f32 alone (cuda/sample.cu): the same token for the same inputs
    under every rule (greedy with ties across and at chunk boundaries, penalty, mask, top-k/top-p/min-p draws),
    and greedy equal to numpy's argmax of the penalized, masked logits."""
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    logits[0, [V - 1, 5]] = 40.0  # a tie of the first and last chunk: the lower id wins
    if B > 1:
        logits[1, [SAMPLE_CHUNK, SAMPLE_CHUNK - 1]] = 40.0  # a tie straddling a chunk boundary
    hist = rng.integers(0, V, (B, 24)).astype(np.int32)
    hist[:, 1] = hist[:, 0]  # a repeat: penalized once
    hist[:, 2] = np.argmax(logits, axis=1)  # the favourite penalized: a greedy choice moves
    mask = rng.integers(0, 2**32, (B, -(-V // 32)), dtype=np.uint64).astype(np.uint32)
    seeds = np.arange(B, dtype=np.uint64) * 7919 + 3
    cases = [
        {},
        {"penalty": 1e6, "hist": hist},
        {"mask": mask},
        {"penalty": 1.3, "hist": hist, "mask": mask},
        {"temperature": 0.8, "top_k": 40, "seed": seeds},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "penalty": 1.1, "hist": hist, "seed": seeds},
        {"temperature": 0.7, "top_k": 64, "mask": mask, "seed": seeds, "counter": 11},
        {"temperature": 1.0, "top_p": 0.95, "seed": seeds},
        {"temperature": 1.5, "top_k": 128, "min_p": 0.01, "seed": seeds},  # k = Gemma's chunk count
        {"temperature": 0.9, "top_k": 200, "seed": seeds},  # k past the chunk count: the row path
    ]
    # rounded logits: many ties at the top-k cut and in the draw (the candidate path's fallbacks)
    rounded = np.round(logits * 2) / 2
    cases += [{"temperature": 1.0, "top_k": 40, "seed": seeds, "logits": rounded}, {"logits": rounded}]
    for kw in cases:
        rows = kw.pop("logits", logits)
        one = _sample(gpu, rows, **kw)
        two = _sample(gpu, rows, prep=True, **kw)
        assert list(two) == list(one), kw
        if "temperature" not in kw:
            ref = np.array(
                [
                    penalized(r, kw.get("penalty", 1.0), kw["hist"][b] if "hist" in kw else ())
                    for b, r in enumerate(rows)
                ]
            )
            if "mask" in kw:
                bits = (kw["mask"][:, np.arange(V) >> 5] >> (np.arange(V) & 31).astype(np.uint32)) & 1
                ref = np.where(bits == 1, ref, -np.inf)
            # float64 penalty vs the kernel's float32 division: a near-tie could differ, none at these gaps
            assert list(two) == [int(np.argmax(r)) for r in ref], kw


@pytest.mark.parametrize("V", [1000, 49152, 49157, 128256])
def test_sample_greedy_argmax_lowest_id_on_ties(gpu, rng, V):
    logits = rng.standard_normal((4, V)).astype(np.float32)
    logits[1, [17, 900]] = 50.0  # a tie: the lower id wins
    if V >= 10 * 1024:  # ties one thread meets in one round of its 8 loads in flight, and across rounds (scan_row)
        logits[2, [5 + 1024 * 9, 5 + 1024 * 3, 5 + 1024 * 6]] = 50.0
        logits[3, [V - 1, 1024 * 8 + 7]] = 50.0  # the last id (a remainder trip at V = 49,157) ties an earlier one
    assert list(_sample(gpu, logits)) == [int(np.argmax(r)) for r in logits]


def test_sample_repetition_penalty_changes_greedy_choice(gpu, rng):
    logits = rng.standard_normal((1, 500)).astype(np.float32)
    best = int(np.argmax(logits))
    logits[0, best] = abs(logits[0, best]) + 0.5
    second = int(np.argsort(logits[0])[-2])
    hist = np.array([[best, best, 3]], np.int32)  # repeated ids are penalized once
    got = _sample(gpu, logits, penalty=1e6, hist=hist)
    assert got[0] == (second if second != 3 else int(np.argsort(logits[0])[-3]))


@pytest.mark.parametrize("V", [5000, 128256])
def test_sample_top_k_top_p_min_p_and_seed(gpu, rng, V):
    B = 64
    base = rng.standard_normal(V).astype(np.float32) * 3
    logits = np.tile(base, (B, 1))
    order = np.argsort(-base)
    # top-k: every draw is among the k best
    got = _sample(gpu, logits, temperature=1.0, top_k=5, seed=np.arange(B, dtype=np.uint64))
    assert set(got) <= set(order[:5]) and len(set(got)) > 1
    # top-p: every draw is inside the smallest prefix holding p of the mass
    p = np.exp(base - base.max())
    p /= p.sum()
    cut = int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1
    got = _sample(gpu, logits, temperature=1.0, top_p=0.5, seed=np.arange(B, dtype=np.uint64) + 1000)
    assert set(got) <= set(order[: cut + 1])
    # min-p: only tokens at least min_p times as likely as the best
    got = _sample(gpu, logits, temperature=1.0, min_p=0.2, seed=np.arange(B, dtype=np.uint64))
    assert all(p[t] >= 0.2 * p.max() * (1 - 1e-4) for t in got)
    # same seed and counter -> same token; the counter changes the draw
    a = _sample(gpu, logits, temperature=1.0, seed=7, counter=3)
    assert len(set(a)) == 1
    draws = {int(_sample(gpu, logits[:1], temperature=1.0, seed=7, counter=c)[0]) for c in range(30)}
    assert len(draws) > 5


def test_sample_distribution_matches_softmax(gpu):
    V, B = 8, 4096
    base = np.log(np.array([0.4, 0.2, 0.15, 0.1, 0.08, 0.04, 0.02, 0.01], np.float32))
    got = _sample(gpu, np.tile(base, (B, 1)), temperature=1.0, seed=np.arange(B, dtype=np.uint64) * 7919)
    freq = np.bincount(got, minlength=V) / B
    assert np.abs(freq - np.exp(base)).max() < 0.03


# --- the sampler's distribution against the exact reference (tests/sampling_reference.py) --------------------

SAMPLE_B = 4096  # sequences per launch: one draw each, every row with its own seed
SAMPLE_DRAWS = 5 * SAMPLE_B  # 20,480 draws per case: at least the CPU test's 10,000 (see sampling_reference.ALPHA)


def _spread(logits: np.ndarray, V: int) -> tuple[np.ndarray, np.ndarray]:
    """The case's logits placed at scattered ids of a vocabulary of V (first, middle, last thread's chunk), every
    other token at -20: exercises the global-memory path (V*4 bytes past shared memory) and the draw's per-thread
    chunk scan across the whole row. Returns (logits [V], ids of the case's tokens)."""
    ids = np.linspace(0, V - 1, len(logits)).astype(np.int64)[
        np.random.default_rng(len(logits)).permutation(len(logits))
    ]
    row = np.full(V, -20.0, np.float32)
    row[ids] = logits
    return row, ids


def _gpu_counts(gpu, row: np.ndarray, seed0: int, recent=(), **kw) -> np.ndarray:
    """Histogram of SAMPLE_DRAWS draws of the GPU sampler from one logit row, seeds seed0, seed0+1, ...
    Without a penalty every sequence reads the same row (ld = 0: the kernel only reads logits then); with one,
    each sequence gets its own copy, re-uploaded per launch, since the penalty edits the logits in place."""
    V = len(row)
    hist = np.tile(np.asarray(recent, np.int32), (SAMPLE_B, 1)) if len(recent) else None
    counts = np.zeros(V, np.int64)
    for launch in range(SAMPLE_DRAWS // SAMPLE_B):
        logits = gpu.put(np.tile(row, (SAMPLE_B, 1)) if hist is not None else row)
        seeds = np.arange(SAMPLE_B, dtype=np.uint64) + np.uint64(seed0 + launch * SAMPLE_B)
        out = gpu.empty(4 * SAMPLE_B)
        args = _Sampler(gpu, SAMPLE_B, seed=seeds, hist=hist, **kw).args
        gpu.run(gpu.k.sample(logits.ptr, V, V if hist is not None else 0, SAMPLE_B, args, out.ptr))
        got = gpu.get(out, np.int32, (SAMPLE_B,))
        assert ((got >= 0) & (got < V)).all(), f"token ids out of range: {got[(got < 0) | (got >= V)][:5]}"
        counts += np.bincount(got, minlength=V)
    return counts


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("case", range(len(FILTERS)), ids=[f"{len(x)}-{'-'.join(kw) or 'none'}" for x, kw in FILTERS])
@pytest.mark.parametrize("V", [None, 128256], ids=["small-vocab", "llama3-vocab"])
def test_sample_draws_follow_the_exact_filtered_distribution(gpu, case, temperature, V):
    """The GPU sampler's draws against filtered_distribution, the same cases as the CPU sampler's test
    (tests/test_sampling.py): the same rules on both engines, checked by a chi-square test at alpha 1e-3."""
    logits, kw = FILTERS[case]
    kw = dict(kw)
    recent, penalty = kw.pop("recent", []), kw.pop("penalty", 1.0)
    if V is None:
        row, ids = np.asarray(logits, np.float32), np.arange(len(logits))
    else:
        row, ids = _spread(np.asarray(logits, np.float32), V)
    recent = [int(ids[r]) for r in recent]
    if "top_p" in kw:  # far from any cumulative sum, so float32 sums and the bisection cannot move the cut
        assert top_p_margin(penalized(row, penalty, recent), kw["top_p"], kw.get("top_k", 0)) > 0.01
    probs = filtered_distribution(row, temperature=temperature, penalty=penalty, recent=recent, **kw)
    seed = 10**6 * (1 + case) + 10**5 * TEMPERATURES.index(temperature) + (0 if V is None else 50_000)
    counts = _gpu_counts(gpu, row, seed, recent=recent, temperature=temperature, penalty=penalty, **kw)
    assert_draws_match(counts, probs, f"GPU V={len(row)} T={temperature} {kw} penalty={penalty} (seeds from {seed})")
