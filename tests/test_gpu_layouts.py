"""The GPU weight layout (soa-v2) and the host's stacking and launch decisions, checked without a GPU.

tests/soa_reference.py models cuda/repack.cu and cuda/weights.cuh in numpy; here that model must reproduce
gguf's dequantization bit for bit for every GPU type (so the bit orders documented in cuda/common.cuh lose
nothing), and its arrays must have the sizes runtime/gpu/kernels.py allocates. The GPU tests then hold the
device arrays to the same model byte for byte (tests/gpu/test_gpu_kernels.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soa_reference as soa
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ingot.runtime.engines.cuda_weights import stack_plan, upload_weights
from ingot.runtime.errors import IncompatibleError, UsageError
from ingot.runtime.gpu import constants
from ingot.runtime.gpu.driver import DeviceBuffer
from ingot.runtime.gpu.kernels import (
    CLUSTER_GRID_PER_SM,
    DECODE_SLICE_MIN_STEPS,
    GPU_QTYPES,
    LAYOUTS,
    MATMUL2_LDS,
    MATMUL2_RAW_ROW,
    MATMUL2_THREADS,
    MATMUL2_TILE_ROWS,
    MATMUL2T_TILE_ROWS,
    MATMUL2W_TILE_ROWS,
    MATVEC_MMA_MIN_COLS,
    MATVEC_STAGED_TYPES,
    MAX_CLUSTER_SLICES,
    MAX_K_SLICES,
    SPLIT_K_TILES_PER_SM,
    SUPERBLOCK_TYPES,
    GpuMatrix,
    GpuStack,
    Kernels,
    NormedQ8,
    SplitK,
    _k_slices,
    image_cc,
    layout_bytes,
    matmul2_smem,
    matmul2r_blocks,
    matmul2r_smem,
    matmul2t_smem,
    matmul2w_smem,
    matmul_geometry,
    matmul_uses_mma,
    matmul_uses_wgmma,
    matvec_cols_staged_smem,
    matvec_mma_smem,
    matvec_staged_smem,
    norm_fusable,
    prefill_split_k_need,
    split_k_floats,
    split_k_uses_clusters,
)
from ingot.runtime.model.quants import QUANT_TYPES

QUANTIZED = [q for q in GPU_QTYPES if q != "F16"]


def _cols(qtype: str) -> int:
    return 768 if qtype in SUPERBLOCK_TYPES else 96


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("odd", [False, True])
def test_layout_model_dequantizes_like_gguf_bit_for_bit(qtype, odd):
    rows, cols = 13, _cols(qtype)
    raw = soa.random_blocks(np.random.default_rng(len(qtype) + odd), qtype, rows, cols, odd=odd)
    if odd:
        raw[-1] = 255  # every bit set: NaN f16 scales, the largest codes
    arrays = soa.pack(qtype, raw, rows, cols)
    with np.errstate(invalid="ignore", over="ignore"):
        ours = soa.dequantize(qtype, arrays, rows, cols)
        ref = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols)
    # bit for bit: the same fp32 values with the same signs of zero; NaNs (from NaN scales) only where gguf's are
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} weights differ, first at {np.argwhere(~same)[0]}"


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_layout_sizes_match_the_allocation_and_stay_near_gguf(qtype):
    rows, cols = 5, _cols(qtype)
    arrays = soa.pack(qtype, soa.random_blocks(np.random.default_rng(0), qtype, rows, cols), rows, cols)
    sizes = layout_bytes(qtype, rows, cols)
    assert list(sizes) == [f for f, _ in LAYOUTS[qtype]]  # kernel argument order = allocation order
    assert {f: a.nbytes for f, a in arrays.items()} == sizes
    gguf_bytes = QUANT_TYPES[qtype].row_bytes(cols) * rows
    # the layouts keep the bits packed: at most 4% over the GGUF (Q3_K: 114 vs 110 bytes per 256 weights)
    assert gguf_bytes <= sum(sizes.values()) <= 1.04 * gguf_bytes


@pytest.mark.parametrize("qtype,cols", [("Q4_K", 96), ("Q6_K", 640), ("Q5_0", 48)])
def test_layout_refuses_widths_the_blocks_do_not_divide(qtype, cols):
    with pytest.raises(IncompatibleError, match="multiple of"):
        layout_bytes(qtype, 4, cols)


def test_unsupported_type_is_refused_with_a_hint():
    with pytest.raises(IncompatibleError) as e:
        stack_plan(["blk.0.ffn_down.weight"], ["IQ3_S"])
    assert "IQ3_S" in str(e.value) and e.value.hint


@pytest.mark.parametrize(
    "qtypes,one_matrix",
    [
        (["Q4_0", "Q4_0", "Q4_0"], True),
        (["Q5_0", "Q5_0", "Q8_0"], False),  # Gemma 3 Q4_K_M: v in Q8_0 on half the layers
        (["Q4_K", "Q6_K"], False),
        (["F16", "F16"], True),
        (["F32", "BF16"], False),  # both become F16, from different sources: one part each
    ],
)
def test_stack_plan(qtypes, one_matrix):
    assert stack_plan([f"t{i}" for i in range(len(qtypes))], qtypes) is one_matrix


def test_stack_plan_refuses_float_mixed_with_quantized():
    with pytest.raises(IncompatibleError) as e:
        stack_plan(["q", "k", "v"], ["Q4_0", "Q4_0", "F16"])
    assert e.value.hint


def _matrix(qtype, rows, cols):
    return GpuMatrix(
        qtype, rows, cols, **{f: DeviceBuffer(1 << 20, n, f) for f, n in layout_bytes(qtype, rows, cols).items()}
    )


def test_gpu_stack_properties():
    s = GpuStack([_matrix("Q5_0", 64, 256), _matrix("Q5_0", 32, 256), _matrix("Q8_0", 32, 256)])
    assert (s.rows, s.cols, s.uniform, s.quantized) == (128, 256, False, True)
    assert GpuStack([_matrix("Q4_K", 8, 256)] * 2).uniform
    m = _matrix("Q6_K", 8, 256)
    assert m.uniform and m.parts == [m] and m.args() == [m.qs, m.qh, m.sc, m.d]
    with pytest.raises(IncompatibleError):
        GpuStack([_matrix("F16", 8, 256), _matrix("Q8_0", 8, 256)])


class _FakeKernel:
    def __init__(self, name, pdl=False):
        self.name, self.fn, self.pdl = name, None, pdl


def _kernels(sm_count=132, mma=False, cluster=False, smem_optin=0):
    """Kernels without a device: the launch geometry only (kernel lookups give named stand-ins). mma: the GEMMs are
    the pipelined matmul2_* (a GPU of compute capability >= 8.0 with INGOT_MATMUL=mma), else WMMA's; cluster: their
    split-K slices are summed in thread-block clusters (sm_90+, INGOT_SPLIT_K=cluster). The GPU is an sm_90 with mma,
    else an sm_75 (no tensor-core kernels). smem_optin: its shared-memory opt-in limit (0: too small for
    matvec_<type>_b1s, so the one-column products stay matvec_<type>_b1 unless a test raises it)."""
    k = Kernels.__new__(Kernels)
    k.device = SimpleNamespace(info=SimpleNamespace(sm_count=sm_count, cc=90 if mma else 75, max_smem_optin=smem_optin))
    k.matmul_mma = mma
    k.matmul_frag = mma  # MATMUL2R_TYPES through matmul2r_* (INGOT_MATMUL=mma)
    k.matmul_wgmma = False  # ... not matmul2w_* (an sm_90a image: the tests that want it set it)
    k.split_k_cluster = cluster
    k.norm_smem = dict.fromkeys(GPU_QTYPES, 0)  # matvec_<type>_b1n's dynamic shared memory (one block an SM)
    names = (
        "matvec_{}",
        "matvec_{}_b1",
        "matvec_{}_b1n",
        "matvec_{}_b1s",
        "matvec_{}_bxs",
        "matvec_{}_mma",
        "matmul_{}",
        *(f"matmul2{r}_{{}}_bm{tm}" for r in ("", "r") for tm in MATMUL2_TILE_ROWS),
        *(f"matmul2w_{{}}_bm{tm}" for tm in MATMUL2W_TILE_ROWS),
        *(f"matmul2t_{{}}_bm{tm}" for tm in MATMUL2T_TILE_ROWS),
    )
    k.k = {n.format(q.lower()): _FakeKernel(n.format(q.lower())) for q in GPU_QTYPES for n in names}
    return k


def _ptr_args(launch) -> list[int]:
    return [int(h) for h in launch._held]


def _fragment_ptrs(W) -> list[int]:
    """(qs, d, m) as the fragment kernels take them (cuda/matmul.cu Fq): Q4_0's m null, Q4_K's super-block headers
    in d's place and m null; Q6_K's four arrays (qs, qh, sc, d) as matmul2_q6_k's."""
    if W.qtype == "Q6_K":
        return [b.ptr for b in W.args()]
    if W.qtype == "Q4_K":
        return [W.qs.ptr, W.sc.ptr, 0]
    return [W.qs.ptr, W.d.ptr, W.m.ptr if W.qtype == "Q4_1" else 0]


def test_matvec_on_a_stack_launches_one_kernel_per_part_at_its_row_offset():
    parts = [_matrix("Q5_0", 40, 256), _matrix("Q5_0", 8, 256), _matrix("Q8_0", 8, 256)]
    y, bias, xq, xd = 10_000, DeviceBuffer(50_000, 4 * 56, "b"), 1, 2
    launches = _kernels().matvec(GpuStack(parts), (xq, xd), y, 3, ldy=56, bias=bias)
    assert [launch.kernel.name for launch in launches] == ["matvec_q5_0", "matvec_q5_0", "matvec_q8_0"]
    offsets = [0, 40, 48]
    for launch, part, off in zip(launches, parts, offsets, strict=True):
        args = _ptr_args(launch)
        n = len(part.args())
        assert args[n : n + 2] == [xq, xd]
        assert args[n + 2] == bias.ptr + 4 * off and args[n + 3] == y + 4 * off  # bias, y at the part's rows
        assert args[n + 4 :] == [part.rows, 256, 3, 56, constants.MODE_STORE, 0]  # ..., mode, no prefetch


def test_matvec_on_one_matrix_is_one_launch_and_gated_modes_halve_the_rows():
    W = _matrix("Q4_K", 96, 512)
    (launch,) = _kernels().matvec(W, (1, 2), 100, 1, ldy=48, mode=constants.MODE_GEGLU)
    # ..., mode, pdl flags, then the one-column kernel's fused-norm arguments: no partial sums, eps 0
    assert _ptr_args(launch)[-8:] == [48, 512, 1, 48, constants.MODE_GEGLU, 0, 0, 0]
    assert launch.grid[0] == -(-48 // (constants.MATVEC_ROWS_PER_BLOCK // 2))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("prefetch", ["1", "0"])
@pytest.mark.parametrize("trigger", ["auto", "early", "late"])
def test_matvec_pdl_flags_follow_pdl_and_the_settings(pdl, prefetch, trigger, monkeypatch):
    """The matvec's last argument (cuda/matvec.cu): zero unless the kernel is launched with PDL; then the L2
    prefetch unless INGOT_WEIGHT_PREFETCH=0, and the late trigger as INGOT_PDL_TRIGGER says (auto: matrices of
    at least PDL_LATE_MIN_BYTES: an 8B-shaped 4096x4096 Q4_0 is 9 MiB, SmolLM2's 1536x576 Q4_1 0.5 MiB)."""
    monkeypatch.setenv("INGOT_WEIGHT_PREFETCH", prefetch)
    monkeypatch.setenv("INGOT_PDL_TRIGGER", trigger)
    k = _kernels()
    for kernel in k.k.values():
        kernel.pdl = pdl
    for W, big in ((_matrix("Q4_0", 4096, 4096), True), (_matrix("Q4_1", 1536, 576), False)):
        for ncols in (1, 3):
            (launch,) = k.matvec(W, (1, 2), 100, ncols, ldy=W.rows)
            flags = _ptr_args(launch)[-3 if ncols == 1 else -1]  # the one-column kernel: then (ss, eps)
            late = trigger == "late" or (trigger == "auto" and big)
            assert flags == (pdl and prefetch == "1") * constants.PDL_PREFETCH + (pdl and late) * constants.PDL_LATE


@pytest.mark.parametrize("ncols", [1, 2, 4, 5])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "F16"])
def test_one_column_runs_the_b1_kernel_and_the_setting_turns_it_off(monkeypatch, qtype, ncols):
    """cuda/matvec.cu: matvec_<type>_b1 computes exactly one column (it ignores blockIdx.y and ncols), so it may
    only be chosen for ncols == 1; INGOT_MATVEC_B1=0 falls back to the any-column kernel."""
    W = _matrix(qtype, 64, 256)
    xin = (1, 2) if W.quantized else 1
    (launch,) = _kernels().matvec(W, xin, 100, ncols, ldy=64)
    assert launch.kernel.name == f"matvec_{qtype.lower()}" + ("_b1" if ncols == 1 else "")
    assert launch.grid[:2] == (-(-64 // constants.MATVEC_ROWS_PER_BLOCK), -(-ncols // constants.MATVEC_COLS))
    monkeypatch.setenv("INGOT_MATVEC_B1", "0")
    (launch,) = _kernels().matvec(W, xin, 100, ncols, ldy=64)
    assert launch.kernel.name == f"matvec_{qtype.lower()}"


@pytest.mark.parametrize("mode", [constants.MODE_STORE, constants.MODE_ADD, constants.MODE_SWIGLU])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_two_to_eight_columns_run_the_tensor_core_matvec(monkeypatch, qtype, mode):
    """matvec_<type>_mma (cuda/matvec.cu) takes 3..MVM_COLS columns of Q4_0 / Q4_1 / Q4_K on compute capability
    8.0+ where the model allows it (narrow): one block of MVM_WARPS warps per 16 rows (8 outputs gated), every column
    in the block (blockIdx.y unused). One or two columns, more than MVM_COLS, another type, an odd number of blocks a
    row, 4 GiB of quants, an older GPU, a model that did not allow it or INGOT_MATVEC_MMA=0 keep the dp4a kernels."""
    W = _matrix(qtype, 1000, 512)  # 1000 rows: a last block of 8 (gated: 500 outputs, a last block of 4)
    outputs = 500 if mode == constants.MODE_SWIGLU else 1000
    for ncols in range(MATVEC_MMA_MIN_COLS, constants.MATVEC_MMA_COLS + 1):
        (launch,) = _kernels(mma=True).matvec(W, (1, 2), 100, ncols, ldy=1000, mode=mode, narrow=True)
        per_block = constants.MATVEC_MMA_ROWS // (2 if mode == constants.MODE_SWIGLU else 1)
        assert launch.kernel.name == f"matvec_{qtype.lower()}_mma"
        assert launch.grid[:2] == (-(-outputs // per_block), 1) and launch.block == 32 * constants.MATVEC_MMA_WARPS
        assert _ptr_args(launch)[len(W.args()) :] == [1, 2, 0, 100, outputs, 512, ncols, 1000, mode, 0]
        kib = {("Q4_0", 1): 61.5, ("Q4_1", 1): 64.5, ("Q4_0", 2): 93, ("Q4_1", 2): 96}  # Q4_K: Q4_0's (headers)
        kib = kib["Q4_0" if qtype == "Q4_K" else qtype, -(-ncols // 4)]
        assert launch.smem == matvec_mma_smem(qtype, ncols) == kib * 1024
    (launch,) = _kernels(mma=True).matvec(W, (1, 2), 100, 4, ldy=1000, mode=mode)  # the model did not allow it
    assert launch.kernel.name == f"matvec_{qtype.lower()}"
    for k, ncols, M in (
        (_kernels(mma=True), 1, W),
        (_kernels(mma=True), 2, W),
        (_kernels(mma=True), constants.MATVEC_MMA_COLS + 1, W),
        (_kernels(mma=True), 4, _matrix("Q6_K", 1000, 512)),
        (_kernels(mma=True), 4, _matrix("Q4_0" if qtype == "Q4_K" else qtype, 1000, 544)),  # 17 blocks: words straddle
        (_kernels(mma=True), 4, _matrix(qtype, 1 << 17, 1 << 16)),  # 4 GiB of quants: past 32-bit offsets
        (_kernels(mma=False), 4, W),
    ):
        (launch,) = k.matvec(M, (1, 2), 100, ncols, ldy=1000, mode=mode, narrow=True)
        assert not launch.kernel.name.endswith("_mma"), (ncols, M.qtype)
    monkeypatch.setenv("INGOT_MATVEC_MMA", "0")
    (launch,) = _kernels(mma=True).matvec(W, (1, 2), 100, 4, ldy=1000, mode=mode, narrow=True)
    assert launch.kernel.name == f"matvec_{qtype.lower()}"


H100_SMEM_OPTIN = 227 * 1024  # an H100's / H200's cudaDevAttrMaxSharedMemoryPerBlockOptin


def test_staged_one_column_kernel_where_it_applies_with_its_own_grid(monkeypatch):
    """matvec_<type>_b1s (cuda/matvec.cu matvec_staged) takes a one-column product of a MATVEC_STAGED_TYPES matrix
    on compute capability 9.0 whose rows are whole 256-weight groups and whose shared memory fits the GPU's opt-in:
    one block an SM of MATVEC_STAGED_WARPS warps, the activation plus each warp's stages of two whole rows, and the
    one-column kernel's arguments (ss, eps last). Anything else keeps matvec_<type>_b1 (or the any-column kernel),
    and so does INGOT_MATVEC_STAGED=0."""
    k = _kernels(sm_count=132, mma=True, smem_optin=H100_SMEM_OPTIN)
    W = _matrix("Q4_0", 6144, 4096)  # the 8B's qkv
    (launch,) = k.matvec(W, (1, 2), 100, 1, ldy=6144)
    assert launch.kernel.name == "matvec_q4_0_b1s"
    assert launch.grid == (132, 1, 1) and launch.block == 32 * constants.MATVEC_STAGED_WARPS
    stage = 2 * 2 * (4096 // 32) * 18  # two rows of 128 blocks of 16 quant bytes and a 2-byte scale
    assert launch.smem == 80 * 128 + constants.MATVEC_STAGED_WARPS * constants.MATVEC_STAGED_STAGES * (stage // 2 + 8)
    assert launch.smem == matvec_staged_smem("Q4_0", 4096) <= H100_SMEM_OPTIN
    assert _ptr_args(launch)[-8:] == [6144, 4096, 1, 6144, constants.MODE_STORE, 0, 0, 0]
    # gated: the same grid (its warps take (gate r, up r + rows) pairs)
    (gated,) = k.matvec(_matrix("Q4_0", 2 * 512, 1024), (1, 2), 100, 1, ldy=512, mode=constants.MODE_SWIGLU)
    assert gated.kernel.name == "matvec_q4_0_b1s" and gated.grid == (132, 1, 1)
    assert _ptr_args(gated)[-8:-5] == [512, 1024, 1]
    cases = [
        (k, _matrix("Q4_0", 64, 576), 1, "matvec_q4_0_b1"),  # 18 blocks
        (k, _matrix("Q5_0", 64, 4096), 1, "matvec_q5_0_b1"),
        # Q6_K's d row is 2 bytes a 256-weight group: a bulk copy needs 16-byte rows, so widths of 2,048 and more
        (k, _matrix("Q6_K", 64, 1024), 1, "matvec_q6_k_b1"),
        (k, _matrix("Q6_K", 64, 2048), 1, "matvec_q6_k_b1s"),
        (k, _matrix("Q4_K", 64, 4096), 1, "matvec_q4_k_b1s"),
        (k, _matrix("Q4_0", 64, 4096), 2, "matvec_q4_0_bxs"),
        (_kernels(mma=True, smem_optin=100 * 1024), _matrix("Q4_0", 64, 4096), 1, "matvec_q4_0_b1"),  # too little
        (_kernels(mma=False, smem_optin=H100_SMEM_OPTIN), _matrix("Q4_0", 64, 4096), 1, "matvec_q4_0_b1"),  # sm_75
    ]
    for kk, Wx, ncols, name in cases:
        (launch,) = kk.matvec(Wx, (1, 2), 100, ncols, ldy=Wx.rows)
        assert launch.kernel.name == name, (Wx.qtype, Wx.cols, ncols)
    monkeypatch.setenv("INGOT_MATVEC_STAGED", "0")
    (launch,) = k.matvec(W, (1, 2), 100, 1, ldy=6144)
    assert launch.kernel.name == "matvec_q4_0_b1"


def test_staged_columns_kernel_where_it_applies_with_its_own_grid(monkeypatch):
    """matvec_<type>_bxs (cuda/matvec.cu matvec_cols_staged) takes 2..MATVEC_COLS columns of a MATVEC_STAGED_TYPES
    matrix on compute capability 9.0 where the columns' q8x2 fits the GPU's opt-in: one block an SM of
    MATVEC_STAGED_WARPS warps, 80 bytes a block of each column in shared memory, the any-column kernel's arguments.
    One column, five, another type, too little shared memory, sm_75, a model whose layers are launch-bound (narrow)
    and INGOT_MATVEC_STAGED=0 keep the others."""
    k = _kernels(sm_count=132, mma=True, smem_optin=H100_SMEM_OPTIN)
    W = _matrix("Q4_0", 4096, 14336)  # the 8B's down: 448 blocks a row, x at 4 columns 140 KiB
    (launch,) = k.matvec(W, (1, 2), 100, 4, ldy=4096, mode=constants.MODE_ADD)
    assert launch.kernel.name == "matvec_q4_0_bxs"
    assert launch.grid == (132, 1, 1) and launch.block == 32 * constants.MATVEC_STAGED_WARPS
    assert launch.smem == 4 * 448 * 80 == matvec_cols_staged_smem(14336, 4) <= H100_SMEM_OPTIN
    assert _ptr_args(launch)[-6:] == [4096, 14336, 4, 4096, constants.MODE_ADD, 0]
    (gated,) = k.matvec(_matrix("Q4_K", 2 * 512, 1024), (1, 2), 100, 3, ldy=512, mode=constants.MODE_SWIGLU)
    assert gated.kernel.name == "matvec_q4_k_bxs" and gated.smem == 3 * 32 * 80
    assert _ptr_args(gated)[-6:-3] == [512, 1024, 3]
    cases = [
        (k, _matrix("Q4_0", 64, 4096), 1, "matvec_q4_0_b1s"),
        (k, _matrix("Q4_0", 64, 4096), 5, "matvec_q4_0"),
        (k, _matrix("Q5_0", 64, 4096), 2, "matvec_q5_0"),
        (_kernels(mma=True, smem_optin=100 * 1024), _matrix("Q4_0", 64, 14336), 4, "matvec_q4_0"),  # 140 KiB
        (_kernels(mma=True, smem_optin=100 * 1024), _matrix("Q4_0", 64, 14336), 2, "matvec_q4_0_bxs"),  # 70 KiB
        (_kernels(mma=False, smem_optin=H100_SMEM_OPTIN), _matrix("Q4_0", 64, 4096), 2, "matvec_q4_0"),  # sm_75
    ]
    for kk, Wx, ncols, name in cases:
        (launch,) = kk.matvec(Wx, (1, 2), 100, ncols, ldy=Wx.rows)
        assert launch.kernel.name == name, (Wx.qtype, Wx.cols, ncols)
    # a launch-bound model (narrow: matvec_<type>_mma from 3 columns) keeps the any-column kernel at 2
    for ncols, name in ((2, "matvec_q4_0"), (3, "matvec_q4_0_mma"), (4, "matvec_q4_0_mma")):
        (launch,) = k.matvec(_matrix("Q4_0", 1536, 576), (1, 2), 100, ncols, ldy=1536, narrow=True)
        assert launch.kernel.name == name, ncols
    monkeypatch.setenv("INGOT_MATVEC_STAGED", "0")
    (launch,) = k.matvec(W, (1, 2), 100, 4, ldy=4096)
    assert launch.kernel.name == "matvec_q4_0"


def test_the_staged_kernels_array_sizes_are_the_layouts():
    """matvec_staged copies each array of a row by its size from W::stage_b8 (cuda/matvec.cu): bytes per 256
    weights, in argument order, which must be LAYOUTS' (a wrong one copies the wrong bytes or overruns a stage)."""
    cuda = Path(__file__).resolve().parents[1] / "cuda"
    src = (cuda / "matvec.cu").read_text()
    structs_src = (cuda / "weights.cuh").read_text() + src
    structs = dict(re.findall(r"X\((\w+), (\w+W), \w+_PARAMS", src[src.index("#define FOR_EACH_STAGED_TYPE") :]))
    assert sorted(structs) == sorted(q.lower() for q in MATVEC_STAGED_TYPES)
    for q in MATVEC_STAGED_TYPES:
        body = structs_src[structs_src.index(f"struct {structs[q.lower()]} {{") :].split("\n};")[0]
        table = re.search(r"constexpr int b\[STAGE_ARRAYS\] = \{([\d, ]+)\}", body).group(1)
        assert [int(v) for v in table.split(",")] == [b for _, b in LAYOUTS[q]], q


def test_every_type_has_both_matvec_kernels_in_the_source():
    """The host asks for matvec_<type> and matvec_<type>_b1 for every GPU type: both must exist in cuda/matvec.cu
    (one X-macro row per type, expanded by MATVEC_KERNELS into the two kernels; F16 written out)."""
    src = (Path(__file__).parents[1] / "cuda" / "matvec.cu").read_text()
    generic = (Path(__file__).parents[1] / "cuda" / "weights.cuh").read_text()
    assert "matvec_##NAME(" in src and "matvec_##NAME##_b1(" in src and "matvec_f16_b1(" in src
    for q in GPU_QTYPES:
        if q == "F16":
            continue
        row = f"X({q.lower()}, {q}W,"
        assert row in src or row in generic, f"{q}: no X-macro row in matvec.cu or weights.cuh"


def test_a_pending_norm_goes_to_the_one_column_kernel_with_its_sums_and_eps(monkeypatch):
    """A NormedQ8 (the fused norm's output, cuda/matvec.cu) reaches matvec_<type>_b1 as (xq, xd, ..., ss, eps), on
    every part of a stack; any other kernel (more columns, INGOT_MATVEC_B1=0, F16, wider than MV_NORM_MAX) would
    drop the scale, so asking for one is refused."""
    k = _kernels()
    x = NormedQ8(11, 12, 13, 1e-6)
    parts = [_matrix("Q4_K", 64, 512), _matrix("Q6_K", 32, 512)]
    launches = k.matvec(GpuStack(parts), x, 100, 1, ldy=96)
    assert [launch.kernel.name for launch in launches] == ["matvec_q4_k_b1", "matvec_q6_k_b1"]
    for launch, part in zip(launches, parts, strict=True):
        n = len(part.args())
        assert _ptr_args(launch)[n : n + 2] == [11, 12] and _ptr_args(launch)[-2] == 13
        assert launch._held[-1] == np.float32(1e-6)
    for W, ncols in ((_matrix("Q4_0", 64, 256), 2), (_matrix("F16", 64, 256), 1), (_matrix("Q4_0", 64, 4128), 1)):
        with pytest.raises(IncompatibleError, match="pending norm"):
            k.matvec(W, x, 100, ncols, ldy=64)
    monkeypatch.setenv("INGOT_MATVEC_B1", "0")
    with pytest.raises(IncompatibleError, match="INGOT_FUSED_NORM=0"):
        k.matvec(_matrix("Q4_0", 64, 256), x, 100, 1, ldy=64)


def test_matvec_norm_launches_a_block_per_32_rows():
    W = _matrix("Q5_K", 4096, 14336)
    out = NormedQ8(21, 22, 23, 1e-5)
    launch = _kernels().matvec_norm(W, (1, 2), 100, DeviceBuffer(5000, 4 * 4096, "w_next"), out)
    assert launch.kernel.name == "matvec_q5_k_b1n"
    assert launch.grid[0] == 4096 // 32 and launch.block == 32 * constants.MATVEC_NORM_WARPS
    n = len(W.args())
    assert _ptr_args(launch)[n:] == [1, 2, 0, 100, 4096, 14336, 5000, 21, 22, 23, 0]  # ..., bias none, pdl flags
    for bad, x in ((_matrix("Q4_0", 48, 256), (1, 2)), (_matrix("F16", 64, 256), (1, 2)), (W, out)):
        with pytest.raises(IncompatibleError, match="INGOT_FUSED_NORM=0"):
            _kernels().matvec_norm(bad, x, 100, DeviceBuffer(5000, 4 * 4096, "w_next"), out)


def test_the_f16_one_column_kernel_gets_no_norm_arguments():
    """matvec_f16_b1 (fp32 activations) has no (ss, eps) parameters: its launch passes exactly its own."""
    W = _matrix("F16", 64, 256)
    (launch,) = _kernels().matvec(W, 1, 100, 1, ldy=64)
    assert launch.kernel.name == "matvec_f16_b1" and len(launch._held) == len(W.args()) + 9


def test_norm_fusable_only_for_one_quantized_projection_into_a_quantized_product(monkeypatch):
    Wo, Wqkv = _matrix("Q4_0", 4096, 4096), _matrix("Q4_K", 6144, 4096)
    assert norm_fusable(Wo, Wqkv, 1) and norm_fusable(Wo, GpuStack([_matrix("Q4_K", 32, 4096)] * 2), 1)
    assert not norm_fusable(Wo, Wqkv, 2)  # one sequence only
    assert not norm_fusable(_matrix("F16", 4096, 4096), Wqkv, 1)
    assert not norm_fusable(Wo, _matrix("F16", 6144, 4096), 1)
    assert not norm_fusable(GpuStack([_matrix("Q4_0", 2048, 4096)] * 2), Wqkv, 1)
    assert not norm_fusable(_matrix("Q4_0", 8192, 4096), _matrix("Q4_0", 8192, 8192), 1)  # wider than MV_NORM_MAX
    monkeypatch.setenv("INGOT_FUSED_NORM", "0")
    assert not norm_fusable(Wo, Wqkv, 1)
    monkeypatch.setenv("INGOT_FUSED_NORM", "1")
    monkeypatch.setenv("INGOT_MATVEC_B1", "0")
    assert not norm_fusable(Wo, Wqkv, 1)


@pytest.mark.parametrize("mode", [constants.MODE_SWIGLU, constants.MODE_GEGLU])
def test_gated_matvec_refuses_a_stack(mode):
    s = GpuStack([_matrix("Q5_0", 8, 256), _matrix("Q8_0", 8, 256)])
    with pytest.raises(IncompatibleError) as e:
        _kernels().matvec(s, (1, 2), 100, 1, ldy=8, mode=mode)
    assert e.value.hint


@pytest.mark.parametrize("mma", [False, True])
def test_split_k_matmul_on_a_stack_is_one_launch_per_part_sharing_the_scratch(mma):
    """No memset before the slices (their sums are ordered in the kernel), one launch per part at its column
    offset, every part with the same partial-tile and counter buffers, and grids within what SplitK holds."""
    parts = [_matrix("Q4_K", 64, 256), _matrix("Q6_K", 32, 256)]
    C, ws, counters = 1 << 30, DeviceBuffer(1 << 32, 4, "ws"), DeviceBuffer(1 << 33, 4, "counters")
    launches = _kernels(mma=mma).matmul(GpuStack(parts), 7, C, 2, ldc=96, split_k=SplitK(ws, counters))
    names = ["matmul2r_q4_k_bm16", "matmul2r_q6_k_bm16"] if mma else ["matmul_q4_k", "matmul_q6_k"]
    assert [launch.kernel.name for launch in launches] == names
    for launch, part, off in zip(launches, parts, [0, 64], strict=True):
        args = _ptr_args(launch)
        frag = launch.kernel.name.startswith("matmul2r_")
        n = len(_fragment_ptrs(part)) if frag else len(part.args())  # the fragment kernels' weight arguments
        assert args[:n] == (_fragment_ptrs(part) if frag else [b.ptr for b in part.args()])
        assert args[n] == 7 and args[n + 2] == C + 4 * off
        assert args[n + 3 : n + 7] == [2, part.rows, 256, 96]
        assert args[n + 8 :] == [ws.ptr, counters.ptr]
        assert launch.grid[2] > 1
        assert launch.block == (MATMUL2_THREADS if mma else 128)
        frag = launch.kernel.name.startswith("matmul2r_")
        assert launch.smem == ((matmul2r_smem if frag else matmul2_smem)(part.qtype, 16) if mma else 0)
    plain = _kernels(mma=mma).matmul(GpuStack(parts), 7, C, 2, ldc=96)
    assert all(launch.grid[2] == 1 and _ptr_args(launch)[-2:] == [0, 0] for launch in plain)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("sm_count", [1, 8, 132])
@pytest.mark.parametrize(
    "rows,cols,M", [(64, 256, 1), (4096, 4096, 16), (576, 1536, 37), (28672, 4096, 64), (6144, 4096, 200)]
)
def test_split_k_grids_fit_the_scratch(sm_count, rows, cols, M, mma):
    """SplitK is sized once per GPU (Kernels.split_k): any shape's grid must fit its tiles and counters, and the
    grid must cover C with tiles of the kernel's size."""
    ws, counters = DeviceBuffer(1 << 32, 4, "ws"), DeviceBuffer(1 << 33, 4, "counters")
    (launch,) = _kernels(sm_count, mma).matmul(
        _matrix("Q4_0", rows, cols), 7, 1 << 30, M, ldc=rows, split_k=SplitK(ws, counters)
    )
    t = matmul_geometry(M, rows, cols, sm_count, mma=mma, split=True)
    gx, gy, gz = launch.grid
    tm_tiles, tn_tiles = (gx, gy) if mma else (gy, gx)
    assert tm_tiles == -(-M // t.tm) and tn_tiles == -(-rows // t.tn)
    assert gz == 1 or (gx * gy < 2 * sm_count and gx * gy * gz * t.tm * t.tn <= split_k_floats(sm_count))
    assert gz <= min(MAX_K_SLICES, cols // 32)
    if not mma:  # v9's bound, in 64x64 tiles
        assert gz == 1 or gx * gy * gz < SPLIT_K_TILES_PER_SM * sm_count


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "F16"])
@pytest.mark.parametrize("rows,cols,M", [(960, 768, 64), (576, 1536, 16), (28672, 4096, 64), (6144, 4096, 128)])
def test_cluster_split_k_launches_a_tiles_slices_as_one_cluster(qtype, rows, cols, M):
    """INGOT_SPLIT_K=cluster (sm_90+): the slices of a tile are one (1, 1, S) cluster of at most 8 blocks (the
    portable size), with no SplitK scratch passed (ws, counters null: the kernel's cluster path) and shared memory
    for the fp32 partial tile, while the grid has at most CLUSTER_GRID_PER_SM blocks per SM (SmolLM2's shapes
    here; the 8B's take the last-block sum); without split-K the launch is the plain one."""
    scratch = SplitK(DeviceBuffer(1 << 32, 4, "ws"), DeviceBuffer(1 << 33, 4, "counters"))
    k = _kernels(132, mma=True, cluster=True)
    (launch,) = k.matmul(_matrix(qtype, rows, cols), 7, 1 << 30, M, ldc=rows, split_k=scratch)
    t = matmul_geometry(M, rows, cols, 132, mma=True, split=True, cluster=True)
    assert t.slices == matmul_geometry(M, rows, cols, 132, mma=True, split=True).slices  # one geometry: same bits
    gz = launch.grid[2]
    assert gz == t.slices <= MAX_CLUSTER_SLICES
    blocks = launch.grid[0] * launch.grid[1] * gz
    assert t.cluster == (gz > 1 and blocks <= CLUSTER_GRID_PER_SM * 132)  # a larger grid: the last block sums
    assert launch.cluster == (gz if t.cluster else 1)
    assert _ptr_args(launch)[-2:] == ([0, 0] if t.cluster else [scratch.ws.ptr, scratch.counters.ptr])
    assert launch.smem >= matmul2_smem(qtype, t.tm) and (not t.cluster or launch.smem >= 4 * t.tm * t.tn)
    assert launch.smem + 16 <= 99 * 1024
    (plain,) = k.matmul(_matrix(qtype, rows, cols), 7, 1 << 30, M, ldc=rows)
    assert plain.grid[2] == 1 and plain.cluster == 1


def test_split_k_sum_choice(monkeypatch):
    """Clusters from compute capability 9.0 unless INGOT_SPLIT_K=ordered; never below 9.0, and the image the
    driver loads counts (Kernels takes the lower of the GPU's and its arch's: PTX of compute_80 JIT-compiled for
    an H200 has no cluster code)."""
    monkeypatch.delenv("INGOT_SPLIT_K", raising=False)
    assert split_k_uses_clusters(90) and not split_k_uses_clusters(89)
    assert [image_cc(a) for a in ("sm_90", "sm_90a", "compute_80", "compute_120", None)] == [90, 90, 80, 120, 0]
    monkeypatch.setenv("INGOT_SPLIT_K", "ordered")
    assert not split_k_uses_clusters(90)


@pytest.mark.parametrize(
    "M,N,K,slices",
    [
        (64, 960, 576, 6),  # SmolLM2's qkv at batch 64: 18 k-steps; 16 slices measured 45% slower than 6
        (64, 3072, 576, 5),  # gate+up: 24 tiles x 6 would put two blocks on 12 of the 132 SMs
        (64, 576, 1536, 8),  # down: 48 k-steps (9 by the balance; a cluster holds 8)
        (16, 960, 576, 8),  # a 16-row tile's partial costs a quarter: more slices pay, up to a cluster's 8
        # the 8B's (DECODE_FILL_ROUND): slices for one round of resident blocks, past a cluster's 8 where the grid
        # is too large for clusters anyway; the H200's fastest in the sweep (PERF.md v16) but where noted
        (64, 4096, 14336, 12),  # down: 32 tiles x 12 = 384 of 396 slots; 58.7 us, 8 slices 72.9
        (64, 4096, 4096, 12),  # o: 25.6 us, 8 slices 30.5
        (64, 6144, 4096, 8),  # qkv: 48 x 8 = 384; 30.2 us, 6 slices 39.0
        (16, 6144, 4096, 11),  # qkv: 48 x 11 = 528 (16-row tiles: 4 a SM); 12 measured 21.7 us, 6 slices 25.6
        (16, 4096, 14336, 16),  # down: 41.0 us, 8 slices 52.4
        (64, 28672, 4096, 2),  # gate+up: 224 tiles fill the round alone; 2 slices as before (4 measured 12% faster)
        (16, 4096, 640, 8),  # Gemma 3's gate+up: 20 k-steps; 10 slices of 2 measured 4.5% slower at b16
        (16, 6144, 1024, 8),  # Qwen3 0.6B's gate+up: 32 k-steps, 3 at least a slice (10) and none empty (8)
        (16, 4096, 1024, 8),  # its qkv: 10 would leave two empty; 8 cut K the same way
    ],
)
def test_matmul2_split_k_balances_the_main_loop_and_the_ordered_sum(M, N, K, slices):
    assert matmul_geometry(M, N, K, 132, mma=True, split=True).slices == slices
    # the cluster flag never changes the slices (both sums give the same bits)
    assert matmul_geometry(M, N, K, 132, mma=True, split=True, cluster=True).slices == slices


@pytest.mark.parametrize("sm_count", [16, 46, 108, 132, 188])
def test_decode_slices_past_the_old_rule_are_long_enough_and_none_empty(sm_count):
    """Where a decode GEMM takes more slices than the 2 x SMs rule (DECODE_FILL_ROUND), each gets at least
    DECODE_SLICE_MIN_STEPS k-steps and none is left empty (the kernel gives each ceil(steps / slices)), the grid
    is too large for clusters, and the scratch holds it."""
    raised = 0
    for tm in MATMUL2_TILE_ROWS[:3]:  # the decode batches' tile heights (16, 32, 64)
        for N in (576, 960, 1024, 1536, 3072, 4096, 5120, 6144, 14336, 28672):
            for K in (576, 640, 960, 1024, 1152, 1536, 2048, 3072, 4096, 14336):
                tiles = -(-N // constants.MATMUL2_BN)
                if tiles >= 2 * sm_count:  # no split-K
                    continue
                new = _k_slices(tiles, tm, constants.MATMUL2_BN, K, sm_count, True, decode=True)
                old = _k_slices(tiles, tm, constants.MATMUL2_BN, K, sm_count, True)
                if new == old:
                    continue
                raised += 1
                steps = K // 32
                per = -(-steps // new)
                assert new > old and per >= DECODE_SLICE_MIN_STEPS, (tm, N, K)
                assert (new - 1) * per < steps, f"an empty slice at {(tm, N, K)}"
                assert tiles * MAX_CLUSTER_SLICES > CLUSTER_GRID_PER_SM * sm_count
                assert tiles * new * tm * constants.MATMUL2_BN <= split_k_floats(sm_count)
    assert raised > 0


@pytest.mark.parametrize("shape", ["smollm2-135m", "gemma3-270m", "llama3-8b"])
@pytest.mark.parametrize("sm_count", [132, 46])
def test_prefill_passes_slice_k_alike_whatever_their_rows(shape, sm_count):
    """A prefill pass's GEMMs (slice_rows = PREFILL_CHUNK) cut K in the same slices for every row count, so a row's
    result does not depend on the pass it was in; each grid is one the kernel and the passes' scratch (sized by
    prefill_split_k_need for the model's matrices) can take. SmolLM2's full pass splits K (its GEMMs' tiles
    alone fill about one block per SM)."""
    from ingot.runtime.engines.cuda import PREFILL_CHUNK
    from ingot.runtime.model.synth import SHAPES, config_of

    c = config_of(SHAPES[shape])
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    gemms = {"qkv": (qkv, c.dim), "o": (c.dim, c.n_heads * c.head_dim), "gu": (2 * c.ffn_dim, c.dim)}
    gemms["down"] = (c.dim, c.ffn_dim)
    need_floats, need_tiles = prefill_split_k_need(gemms.values(), sm_count, PREFILL_CHUNK)
    for name, (N, K) in gemms.items():
        tilings = {
            M: matmul_geometry(M, N, K, sm_count, mma=True, split=True, cluster=True, slice_rows=PREFILL_CHUNK)
            for M in (1, 7, 16, 33, 100, 128, 255, 300, 480, 500, 511, 512)
        }
        assert len({t.slices for t in tilings.values()}) == 1, (name, tilings)
        for M, t in tilings.items():
            tiles = -(-M // t.tm) * -(-N // t.tn)
            if t.slices > 1 and not t.cluster:
                assert tiles < 2 * sm_count and tiles <= max(2 * sm_count, need_tiles)
                assert tiles * t.slices * t.tm * t.tn <= max(split_k_floats(sm_count), need_floats), (name, M)
        if shape == "smollm2-135m" and sm_count == 132:
            assert tilings[512].slices > 1, name


@pytest.mark.parametrize(
    "N,K,tm,slices,measured",
    [
        (6144, 4096, 128, 4, "137 us; v14's 128 rows, 1 slice: 153"),  # the 8B's qkv
        (4096, 4096, 128, 2, "88 us; v14's 64 rows, 2 slices: 121"),  # o
        (28672, 4096, 128, 1, "543 us, as v14"),  # gate+up: 896 tiles fill the GPU 3.4 times
        (4096, 14336, 128, 2, "265 us; v14's 64 rows, 2 slices: 384"),  # down
        # SmolLM2's, under PREFILL_MODEL_MIN_US: v14's rule, as its whole pass measured faster
        (960, 576, 32, 3, "14.5 us alone (64 rows, 2 slices: 13.0); pp512 140.6k against 130.8k"),  # qkv
        (576, 1536, 32, 4, "20.0 us alone (64 rows, 3 slices: 16.2)"),  # down
    ],
)
def test_a_full_prefill_pass_takes_the_tiling_measured_fastest_on_the_h200(N, K, tm, slices, measured):
    """The prefill cost model (MATMUL2_STEP_US ...) against the H200 sweep it was fitted on (cuda/PERF.md v15: every
    tile height of 32-128 rows with 1-8 slices at 512 rows): for the 8B's four matrices it picks the fastest
    measured tiling. SmolLM2's GEMMs are outside its range and keep v14's tiling, which their whole pass ran
    faster with, though each alone was slower."""
    t = matmul_geometry(512, N, K, 132, mma=True, split=True, cluster=True, slice_rows=512)
    assert (t.tm, t.slices, t.cluster) == (tm, slices, False), measured


@pytest.mark.parametrize(
    "M,N,split,tm",
    [
        (1, 4096, True, 16),  # decode batches: the smallest tile that covers M
        (16, 28672, True, 16),
        (17, 28672, True, 32),
        (33, 28672, True, 64),
        (64, 4096, True, 64),
        (65, 4096, True, 128),
        (512, 28672, False, 128),  # prefill: 4 x 224 tiles
        (512, 4096, False, 64),  # 4 x 32 = 128 tiles < 132 SMs: 8 x 32
        (512, 576, False, 32),  # SmolLM2: as many tiles as 32 rows give (prefill stops there)
        (7, 49152, False, 16),  # a short prompt: covered by 16
    ],
)
def test_matmul2_tile_height(M, N, split, tm):
    t = matmul_geometry(M, N, 4096, 132, mma=True, split=split)
    assert (t.tm, t.tn) == (tm, constants.MATMUL2_BN)
    assert t.kernel("Q4_K") == f"matmul2_q4_k_bm{tm}"


@pytest.mark.parametrize("qtype", GPU_QTYPES)
@pytest.mark.parametrize("tm", MATMUL2_TILE_ROWS)
def test_matmul2_shared_memory_fits_every_arch_with_mma(qtype, tm):
    """The opt-in limit of sm_86/89/120 is 99 KiB (sm_80/90/100: more), less the kernel's 16 static bytes; and the
    numbers are those of cuda/matmul.cu's layout (mm2_smem_bytes), worked out by hand for two types."""
    assert matmul2_smem(qtype, tm) + 16 <= 99 * 1024
    cluster = matmul2_smem(qtype, tm, cluster=True)  # what Kernels opts every matmul2 kernel into
    assert cluster == max(matmul2_smem(qtype, tm), 4 * tm * constants.MATMUL2_BN) and cluster + 16 <= 99 * 1024
    assert matmul2_smem("Q4_0", 128) == 4 * 128 * 80 + 2 * 128 * 80 + 4 * 128 * (16 + 4)
    assert matmul2_smem("F16", 32) == 4 * 32 * 80 + 4 * 128 * 80


def test_matmul2_raw_rows_match_the_kernel_source():
    """kernels.py MATMUL2_RAW_ROW is the RAW_ROW of each raw-stage struct in cuda/matmul.cu (the host sizes the
    shared memory from it; the kernel checks %dynamic_smem_size and traps if short)."""
    src = (Path(__file__).parents[1] / "cuda" / "matmul.cu").read_text()
    assert "static constexpr int RAW_ROW = MIN ? 24 : 20;" in src  # Mm2Q4<MIN>: Q4_1, Q4_0
    assert MATMUL2_RAW_ROW["Q4_1"] == 24 and MATMUL2_RAW_ROW["Q4_0"] == 20
    q8 = src[src.index("struct Mm2Q8_0 {") :]
    assert q8[: q8.index("};")].count(f"RAW_ROW = {MATMUL2_RAW_ROW['Q8_0']};") == 1
    f16 = src[src.index("struct Mm2F16 {") :]
    assert "RAW_ROW = MM2_LDS * 2;" in f16[: f16.index("};")] and MATMUL2_RAW_ROW["F16"] == 2 * MATMUL2_LDS
    assert "#define MM2_LDS (QK + 8)" in src and MATMUL2_LDS == constants.QK + 8


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("tm", [16, 32, 64, 128])
def test_fragment_gemm_shared_memory_fits_every_arch_with_mma(qtype, tm):
    """matmul2r_*'s layout (cuda/matmul.cu Mm2rShape, mm2r_stage_bytes), worked out by hand: MATMUL2R_STAGES stages
    of quant rows (16 bytes a block, + 16 when the block count is even), 32-byte scale windows of d (Q4_K's of its
    headers, Q6_K's of its sub-block scales), Q4_1's of m, Q6_K's two 4-byte words of d and its high bits (8 bytes a
    block + 8), and the A tile; within sm_86/89/120's 99 KiB opt-in, the cluster's partial tile included."""
    kb = matmul2r_blocks(tm)
    second = {"Q4_1": 32, "Q6_K": 8 + 8 * kb + 8}.get(qtype, 0)
    stage = 128 * (16 * kb + (16 if kb % 2 == 0 else 0) + 32 + second) + tm * (32 * kb + 8) * 2
    assert matmul2r_smem(qtype, tm) == constants.MATMUL2R_STAGES * stage
    assert matmul2r_smem(qtype, tm, cluster=True) == max(matmul2r_smem(qtype, tm), 4 * tm * 128) <= 99 * 1024 - 16
    src = (Path(__file__).parents[1] / "cuda" / "matmul.cu").read_text()
    assert "static constexpr int KB = TM <= 32 ? 4 : 2;" in src and kb == (4 if tm <= 32 else 2)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_q4_gemms_take_the_fragment_kernel_with_its_arguments(qtype):
    """Q4_0 / Q4_1 / Q4_K / Q6_K at a decode width: matmul2r_<type>_bm16 with (qs, d, m) (_fragment_ptrs) and its own
    shared memory, and at prefill width its 128-row tiles; the other types and INGOT_MATMUL=mma-tile (matmul_frag
    off) keep matmul2_*."""
    W = _matrix(qtype, 300, 512)
    k = _kernels(mma=True)
    (launch,) = k.matmul(W, 7, 1 << 30, 5, ldc=300)
    assert launch.kernel.name == f"matmul2r_{qtype.lower()}_bm16"
    assert _ptr_args(launch)[: len(_fragment_ptrs(W)) + 1] == [*_fragment_ptrs(W), 7]
    assert launch.smem == matmul2r_smem(qtype, 16)
    (wide,) = k.matmul(_matrix(qtype, 28672, 4096), 7, 1 << 30, 512, ldc=28672)
    assert wide.kernel.name == f"matmul2r_{qtype.lower()}_bm128" and wide.smem == matmul2r_smem(qtype, 128)
    for other in ("Q8_0", "Q5_K", "Q3_K"):
        (tile,) = k.matmul(_matrix(other, 300, 512), 7, 1 << 30, 5, ldc=300)
        assert tile.kernel.name == f"matmul2_{other.lower()}_bm16"
    k.matmul_frag = False
    (tile,) = k.matmul(W, 7, 1 << 30, 5, ldc=300)
    assert tile.kernel.name == f"matmul2_{qtype.lower()}_bm16" and tile.smem == matmul2_smem(qtype, 16)
    assert _ptr_args(tile)[: len(W.args()) + 1] == [*(b.ptr for b in W.args()), 7]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_tiles_take_the_wgmma_kernels_where_the_image_has_them(qtype):
    """With an sm_90a image (matmul_wgmma), Q4_0 / Q4_1 / Q4_K GEMMs in 128-row tiles run matmul2w_<type>_bm128 with
    matmul2r's arguments and grid and its own shared memory, unless their slices sum in a cluster; 32- and 64-row
    tiles run matmul2t_<type>_bm<tm>, whose slices always sum through the scratch; 16-row tiles keep matmul2r;
    without the image, every tile keeps matmul2r."""
    W = _matrix(qtype, 28672, 4096)
    k = _kernels(mma=True, cluster=True)
    k.matmul_wgmma = True
    (wide,) = k.matmul(W, 7, 1 << 30, 512, ldc=28672)
    assert wide.kernel.name == f"matmul2w_{qtype.lower()}_bm128" and wide.smem == matmul2w_smem(qtype, 128)
    assert _ptr_args(wide)[:4] == [*_fragment_ptrs(W), 7]
    assert wide.grid == (4, 224, 1) and wide.block == MATMUL2_THREADS
    (narrow,) = k.matmul(W, 7, 1 << 30, 5, ldc=28672)
    assert narrow.kernel.name == f"matmul2r_{qtype.lower()}_bm16" and narrow.smem == matmul2r_smem(qtype, 16)
    scratch = SplitK(DeviceBuffer(3 << 30, 1 << 30, "ws"), DeviceBuffer(5 << 30, 1 << 20, "counters"))
    for M, tm in ((20, 32), (64, 64)):
        (dec,) = k.matmul(W, 7, 1 << 30, M, ldc=28672, split_k=scratch)
        assert dec.kernel.name == f"matmul2t_{qtype.lower()}_bm{tm}" and dec.smem == matmul2t_smem(qtype, tm)
        assert _ptr_args(dec)[:4] == [*_fragment_ptrs(W), 7]
    (split,) = k.matmul(_matrix(qtype, 4096, 4096), 7, 1 << 30, 100, ldc=4096, split_k=scratch)
    assert split.kernel.name == f"matmul2w_{qtype.lower()}_bm128" and split.grid == (1, 32, 8)
    assert _ptr_args(split)[-2:] == [3 << 30, 5 << 30]  # the slices sum through the scratch, as matmul2r's
    clustered = _kernels(mma=True, cluster=True)
    clustered.matmul_wgmma = True
    (cl,) = clustered.matmul(_matrix(qtype, 1024, 4096), 7, 1 << 30, 100, ldc=1024, split_k=scratch)
    assert cl.kernel.name == f"matmul2r_{qtype.lower()}_bm128" and cl.grid[2] > 1 and cl.cluster == cl.grid[2]
    # decode widths: matmul2t, whose slices always sum through the scratch, even where matmul2r's would cluster
    assert matmul_geometry(40, 1024, 4096, 132, mma=True, split=True, cluster=True).cluster
    (dec,) = clustered.matmul(_matrix(qtype, 1024, 4096), 7, 1 << 30, 40, ldc=1024, split_k=scratch)
    assert dec.kernel.name == f"matmul2t_{qtype.lower()}_bm64" and dec.grid[2] > 1 and dec.cluster == 1
    assert _ptr_args(dec)[-2:] == [3 << 30, 5 << 30]
    k.matmul_wgmma = False
    (sync,) = k.matmul(W, 7, 1 << 30, 512, ldc=28672)
    assert sync.kernel.name == f"matmul2r_{qtype.lower()}_bm128"


@pytest.mark.parametrize(
    "image,setting,wgmma",
    [
        ("sm_90a", None, True),
        ("sm_90a", "mma", True),
        ("sm_90a", "mma-sync", False),
        ("sm_90a", "mma-tile", False),
        ("sm_90", None, False),
        ("compute_90", None, False),
        ("sm_100", None, False),
        (None, None, False),
    ],
)
def test_wgmma_needs_the_sm_90a_image(monkeypatch, image, setting, wgmma):
    """wgmma exists only in arch-specific sm_90a code: a plain sm_90 build (or PTX JIT-compiled for a Hopper)
    holds a matmul2w_* that traps, so the engine takes it only when the driver loads the sm_90a image, and not
    under INGOT_MATMUL=mma-sync (v22's kernels) or the other settings."""
    if setting is None:
        monkeypatch.delenv("INGOT_MATMUL", raising=False)
    else:
        monkeypatch.setenv("INGOT_MATMUL", setting)
    assert matmul_uses_wgmma(image) is wgmma


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
@pytest.mark.parametrize("tm", MATMUL2T_TILE_ROWS)
def test_swapped_wgmma_gemm_shared_memory(qtype, tm):
    """matmul2t_smem is cuda/matmul.cu's Mm2tShape::SMEM: stages of the tokens' swizzled regions, quants and scale
    windows (matmul2r's), each a multiple of 1 KiB (the swizzle's alignment), and two blocks an SM fit."""
    kb = matmul2r_blocks(tm)
    stage = tm * 64 * kb + 128 * (16 * kb + 16 * (kb % 2 == 0) + 32 * (2 if qtype == "Q4_1" else 1))
    assert stage % 1024 == 0 and matmul2t_smem(qtype, tm) == constants.MATMUL2T_STAGES * stage + 1024
    assert 2 * (matmul2t_smem(qtype, tm) + 1024) <= 228 * 1024
    src = (Path(__file__).parents[1] / "cuda" / "matmul.cu").read_text()
    assert "static constexpr int SMEM = MATMUL2T_STAGES * STAGE + 1024;" in src


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_wgmma_gemm_shared_memory_fits_its_blocks_an_sm(qtype):
    """matmul2w_smem is cuda/matmul.cu's Mm2wShape::SMEM (stages of A, quants and scale windows, the fp16 weight
    tile, 1 KiB of alignment), and two blocks of it (each with the driver's 1 KiB) fit a Hopper SM's 228 KiB: the
    kernel's __launch_bounds__(256, 2) counts on it."""
    stage = 128 * 128 + 128 * (48 + 32 * (2 if qtype == "Q4_1" else 1))
    assert stage % 1024 == 0 and matmul2w_smem(qtype, 128) == constants.MATMUL2W_STAGES * stage + 128 * 128 + 1024
    assert 2 * (matmul2w_smem(qtype, 128) + 1024) <= 228 * 1024
    src = (Path(__file__).parents[1] / "cuda" / "matmul.cu").read_text()
    assert "static constexpr int SMEM = MATMUL2W_STAGES * STAGE + B_BYTES + 1024;" in src


def test_q6_k_keeps_the_fragment_kernel_where_the_image_has_wgmma():
    """Q6_K has no wgmma kernel (a wgmma tile of it was slower than matmul2r_q6_k, cuda/PERF.md v25-v26): with an
    sm_90a image its tiles of every height run matmul2r_q6_k_bm<tm> with (qs, qh, sc, d), clustered or not;
    INGOT_MATMUL=mma-tile keeps matmul2."""
    W = _matrix("Q6_K", 4096, 14336)
    k = _kernels(mma=True, cluster=True)
    k.matmul_wgmma = True
    scratch = SplitK(DeviceBuffer(3 << 30, 1 << 30, "ws"), DeviceBuffer(5 << 30, 1 << 20, "counters"))
    (pre,) = k.matmul(W, 7, 1 << 30, 512, ldc=4096, split_k=scratch, slice_rows=512)  # a prefill pass
    assert pre.kernel.name == "matmul2r_q6_k_bm128" and pre.smem == matmul2r_smem("Q6_K", 128, cluster=False)
    assert _ptr_args(pre)[:5] == [W.qs.ptr, W.qh.ptr, W.sc.ptr, W.d.ptr, 7]
    for M, tm in ((5, 16), (20, 32), (40, 64)):
        (dec,) = k.matmul(W, 7, 1 << 30, M, ldc=4096, split_k=scratch)
        assert dec.kernel.name == f"matmul2r_q6_k_bm{tm}" and dec.grid[2] > 1, M
    (cl,) = k.matmul(_matrix("Q6_K", 1024, 4096), 7, 1 << 30, 100, ldc=1024, split_k=scratch)
    assert cl.kernel.name == "matmul2r_q6_k_bm128" and cl.cluster > 1
    k.matmul_frag = False
    (tile,) = k.matmul(W, 7, 1 << 30, 512, ldc=4096, split_k=scratch, slice_rows=512)
    assert tile.kernel.name == "matmul2_q6_k_bm128"


def test_q4_1_with_its_min_at_another_16_byte_offset_keeps_the_tile_kernel():
    """matmul2r reads m's scale windows at d's offsets within 16 bytes: a Q4_1 matrix whose m is not at d's offset
    (not the pool's layout, but a view could be) runs matmul2 instead (the same bits)."""
    n, cols = 300, 512
    sizes = layout_bytes("Q4_1", n, cols)
    for m_at, kernel in (((3 << 20) + 32, "matmul2r_q4_1_bm16"), ((3 << 20) + 2, "matmul2_q4_1_bm16")):
        W = GpuMatrix(
            "Q4_1",
            n,
            cols,
            qs=DeviceBuffer(1 << 20, sizes["qs"], "qs"),
            d=DeviceBuffer(2 << 20, sizes["d"], "d"),
            m=DeviceBuffer(m_at, sizes["m"], "m"),
        )
        (launch,) = _kernels(mma=True).matmul(W, 7, 1 << 30, 5, ldc=n)
        assert launch.kernel.name == kernel


@pytest.mark.parametrize(
    "cc,setting,mma",
    [(75, "mma", False), (80, "mma", True), (90, None, True), (90, "wmma", False), (90, "mma-tile", True)],
)
def test_matmul_kernel_choice(monkeypatch, cc, setting, mma):
    """sm_75 has no mma.sync m16n8k16 / cp.async: always WMMA; from 8.0 the pipelined kernels unless
    INGOT_MATMUL=wmma (mma-tile: the pipelined kernels through the fp16 tile for every type)."""
    if setting is None:
        monkeypatch.delenv("INGOT_MATMUL", raising=False)
    else:
        monkeypatch.setenv("INGOT_MATMUL", setting)
    assert matmul_uses_mma(cc) is mma


def test_matmul_setting_rejects_other_values(monkeypatch):
    monkeypatch.setenv("INGOT_MATMUL", "cutlass")
    with pytest.raises(UsageError):
        matmul_uses_mma(90)


def test_weight_layout_and_abi_name_the_new_layout():
    # bundles packed with soa-v1 kernels must be refused by this runtime (runtime/bundle/manifest.check_runtime)
    assert constants.WEIGHT_LAYOUT.startswith("soa-v2:") and constants.KERNEL_ABI > 1  # soa-v1 runtimes had ABI 1
    assert constants.MODE_GEGLU not in (constants.MODE_STORE, constants.MODE_ADD, constants.MODE_SWIGLU)


class _FakePool:
    """Device memory as numbers only: enough for the upload plan (sizes, which arrays exist)."""

    def __init__(self):
        self.allocated = 0
        self.by_name: dict[str, int] = {}

    def alloc(self, nbytes, name=""):
        buf = DeviceBuffer(1 << 40 | self.allocated, nbytes, name)
        self.allocated += nbytes
        self.by_name[name] = self.by_name.get(name, 0) + nbytes
        return buf

    def close(self):
        pass


class _FakeStream:
    def upload(self, ptr, array):
        pass

    def synchronize(self):
        pass


class _FakeKernels:
    def __init__(self):
        self.repacked: list[str] = []

    def repack(self, qtype, src, W):
        self.repacked.append(qtype)
        return lambda stream: None


def test_gemma3_q4_k_m_uploads_as_mixed_stacks_with_its_norms(gemma3_model):
    """The real Gemma 3 270M Q4_K_M, planned for the GPU without one: v in Q8_0 on half the layers makes q,k,v a
    stack there; Q4_K/Q6_K attn_output and ffn_down are single matrices; the block's extra norms are uploaded."""
    c = gemma3_model.config
    pool, k = _FakePool(), _FakeKernels()
    w = upload_weights(gemma3_model, pool, _FakeStream(), k)
    kinds = set()
    for i, lw in enumerate(w.layers):
        p = f"blk.{i}."
        types = [gemma3_model.tensors[p + f"attn_{n}.weight"].qtype for n in "qkv"]
        assert isinstance(lw.wqkv, GpuStack) == (len(set(types)) > 1)
        assert [m.qtype for m in lw.wqkv.parts] == (types if len(set(types)) > 1 else types[:1])
        assert lw.wqkv.rows == (c.n_heads + 2 * c.n_kv_heads) * c.head_dim and lw.wqkv.cols == c.dim
        assert lw.wgu.uniform and lw.wgu.rows == 2 * c.ffn_dim
        assert lw.wdown.qtype == gemma3_model.tensors[p + "ffn_down.weight"].qtype
        kinds.add((type(lw.wqkv).__name__, lw.wdown.qtype))
        for norm, n in ((lw.q_norm, c.head_dim), (lw.k_norm, c.head_dim), (lw.post_attn_norm, c.dim)):
            assert norm is not None and norm.nbytes == 4 * n
        assert lw.post_ffn_norm is not None and lw.post_ffn_norm.nbytes == 4 * c.dim
    # both halves of the mix occur (the file's point), and the embedding is Q8_0 and tied
    assert {"GpuStack", "GpuMatrix"} <= {kind for kind, _ in kinds} and {"Q4_K", "Q6_K"} <= {q for _, q in kinds}
    assert w.embed.qtype == "Q8_0" and w.head is w.embed
    # the bits stay packed: the matrices take at most 4% more than in the GGUF
    gguf = sum(t.raw.nbytes for t in gemma3_model.tensors.values() if t.qtype != "F32")
    norms = sum(t.raw.nbytes for t in gemma3_model.tensors.values() if t.qtype == "F32")
    assert "staging" not in pool.by_name  # the staging buffer comes from a pool of its own, freed after upload
    matrices = w.nbytes - norms
    assert gguf <= matrices < 1.04 * gguf


def test_llama_layers_have_no_extra_norms(real_model):
    w = upload_weights(real_model, _FakePool(), _FakeStream(), _FakeKernels())
    lw = w.layers[0]
    assert (lw.q_norm, lw.k_norm, lw.post_attn_norm, lw.post_ffn_norm) == (None, None, None, None)
    assert isinstance(lw.wqkv, GpuMatrix) and isinstance(lw.wgu, GpuMatrix)
