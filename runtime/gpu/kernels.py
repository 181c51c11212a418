"""Ingot's GPU kernels as the host sees them: the modules to load, and the launch geometry of every op.

This is the one place that knows grid/block/shared-memory sizes and argument order for the kernels in
cuda/*.cu. Each method returns a driver.Launch (arguments packed once), so the engine can replay it directly
or capture it into a CUDA graph. Shapes are given per method; all activations are row-major, one row per token.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ingot.runtime import settings
from ingot.runtime.errors import IncompatibleError, UsageError
from ingot.runtime.gpu.archs import installed_kernel_dir
from ingot.runtime.gpu.compat import decide, driver_from_cuda_int
from ingot.runtime.gpu.constants import (
    ATT_ONE_SPLIT_PAGES,
    ATT_WARPS,
    CAND_SLOTS,
    DRAW_MAX,
    GATED_MODES,
    MATMUL2_BN,
    MATMUL2_SLICES,
    MATMUL2_STAGES,
    MATMUL2_THREADS,
    MATMUL2R_STAGES,
    MATMUL2T_STAGES,
    MATMUL2W_STAGES,
    MATMUL_TILE,
    MATVEC_COLS,
    MATVEC_MMA_CHUNK,
    MATVEC_MMA_COLS,
    MATVEC_MMA_ROWS,
    MATVEC_MMA_STAGES,
    MATVEC_MMA_WARPS,
    MATVEC_NORM_MAX,
    MATVEC_NORM_WARPS,
    MATVEC_ROWS_PER_BLOCK,
    MATVEC_STAGED_STAGES,
    MATVEC_STAGED_WARPS,
    MAX_SPLITS,
    MODE_STORE,
    PAGE,
    PDL_LATE,
    PDL_PREFETCH,
    PREFILL_MMA_ROWS,
    PREFILL_QUERIES,
    PREP_THREADS,
    QK,
    SAMPLE_THREADS,
)
from ingot.runtime.gpu.driver import DeviceBuffer, Kernel, Launch, Module
from ingot.runtime.gpu.fatbin import parse_fatbin

MODULES = (
    "activation",
    "attention",
    "attention_decode",
    "attention_prefill",
    "embed",
    "matmul",
    "matvec",
    "norm",
    "repack",
    "rope",
    "sample",
)
HEAD_DIMS = (64, 128, 256)  # the attention kernels' template instances (cuda/attention.cu)
PREFILL_MMA_PAD = 8  # halfs of padding per shared-memory row of cuda/attention_prefill.cu (SPAD there)
GQA_MAX = 8  # query heads per kv head one decode attention block serves (GMAX in cuda/attention.cu)

# The soa-v2 layout of each GPU weight type (cuda/common.cuh documents the bit orders): its device arrays, in
# kernel-argument order, as (GpuMatrix field, bytes per 256 weights). GGUF's own sizes are in
# runtime/model/quants.py; each layout keeps within 4% of them (cuda/PERF.md, "K-quant layouts").
LAYOUTS: dict[str, tuple[tuple[str, int], ...]] = {
    "F16": (("w", 512),),
    "Q8_0": (("qs", 256), ("d", 16)),
    "Q4_0": (("qs", 128), ("d", 16)),
    "Q4_1": (("qs", 128), ("d", 16), ("m", 16)),
    "Q5_0": (("qs", 128), ("qh", 32), ("d", 16)),
    "Q5_1": (("qs", 128), ("qh", 32), ("d", 16), ("m", 16)),
    "Q4_K": (("qs", 128), ("sc", 16)),
    "Q5_K": (("qs", 128), ("qh", 32), ("sc", 16)),
    "Q6_K": (("qs", 128), ("qh", 64), ("sc", 16), ("d", 2)),
    "Q3_K": (("qs", 64), ("qh", 32), ("sc", 16), ("d", 2)),
    "Q2_K": (("qs", 64), ("sc", 16), ("d", 2), ("m", 2)),
    "IQ4_NL": (("qs", 128), ("d", 16)),
    "IQ4_XS": (("qs", 128), ("sc", 8), ("d", 2)),
}
GPU_QTYPES = tuple(LAYOUTS)
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
SUPERBLOCK_TYPES = (*K_QUANTS, "IQ4_XS")  # 256-weight super-blocks: cols % 256 == 0

i32, f32, i64, u64 = np.int32, np.float32, np.int64, np.uint64

# Tile heights (tokens) of the pipelined GEMM's kernels, matmul2_<type>_bm<TM> (cuda/matmul.cu); prefill (no split-K)
# shrinks its tile only down to MATMUL2_PREFILL_MIN_ROWS (a 16-row tile dequantizes each weight for 16 tokens).
MATMUL2_TILE_ROWS = (16, 32, 64, 128)
# The types matmul2r_* dequantizes into the mma fragments (below; Q4_K from its super-block headers, Q6_K from its
# four arrays: cuda/matmul.cu Fq) ...
MATMUL2R_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
# ... at these tile heights: all of matmul2's, since its warps are 1 x 8 (each fragment dequantized once; PERF.md
# v18). With v17's 4 x 2 warps at 128 rows it was slower than matmul2 (the 8B's gate+up at 512 rows 575 against 544
# us) and served 16-64 rows only.
MATMUL2R_TILE_ROWS = (16, 32, 64, 128)
MATMUL2_PREFILL_MIN_ROWS = 32
# Where the loaded image is sm_90a (Kernels.matmul_wgmma), MATMUL2W_TYPES (the 4-bit ones; Q6_K keeps matmul2r: a
# wgmma tile of it took 193.9 us a launch of the 8B's prefill, matmul2r_q6_k 174.7, cuda/PERF.md v25-v26) in tiles
# of these heights run matmul2w_* (wgmma on a dequantized fp16 weight tile: two warpgroups of m64 along M) when
# their slices do not sum in a cluster ...
MATMUL2W_TYPES = ("Q4_0", "Q4_1", "Q4_K")
MATMUL2W_TILE_ROWS = (128,)
# ... and in tiles of these, matmul2t_* (wgmma with the weights dequantized into its register operand and the
# tokens as its n; its slices always sum through the scratch). 16-row tiles keep matmul2r, measured faster there
# (cuda/PERF.md v24).
MATMUL2T_TILE_ROWS = (32, 64)

# The types matvec_<type>_mma (cuda/matvec.cu: 2..MATVEC_MMA_COLS columns on the integer tensor cores, mma.sync
# m16n8k32 u8 x s8) serves, from this compute capability.
MATVEC_MMA_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # Q4_K: its super-block header where Q4_0 has a chunk's 8 scales
MATVEC_MMA_MIN_CC = 80
MATVEC_MMA_MIN_COLS = 3  # at 2 it measured no faster than the dp4a kernel (cuda/PERF.md v22)
# The types matvec_<type>_b1s serves (cuda/matvec.cu FOR_EACH_STAGED_TYPE: one column, weights by bulk copies), on
# this compute capability only: measured on an H100 (cuda/PERF.md v36, v37); the copies are sm_90+, but later archs'
# shared memory and SM counts were not measured.
MATVEC_STAGED_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
MATVEC_STAGED_CC = 90

# The FFN activation of each architecture (architectures.ACTIVATIONS) -> its gated kernel (cuda/activation.cu).
ACTIVATION_KERNELS = {"silu": "swiglu_f16", "gelu_tanh": "geglu_f16"}

# The kernels whose first statement is INGOT_PDL_ENTRY() (cuda/common.cuh: griddepcontrol.wait, then
# launch_dependents): only these may be launched with programmatic dependent launch, which lets a kernel's blocks
# start before its predecessor has finished. Opt-in by name, so a new kernel without the macro is never launched
# early (tests/test_pdl.py checks this list against cuda/*.cu and the built PTX, both ways).
PDL_KERNELS = frozenset(
    {
        *(f"{op}_{q.lower()}" for op in ("embed", "matvec", "matmul") for q in GPU_QTYPES),
        *(f"matmul2_{q.lower()}_bm{tm}" for q in GPU_QTYPES for tm in MATMUL2_TILE_ROWS),
        *(f"matmul2r_{q.lower()}_bm{tm}" for q in MATMUL2R_TYPES for tm in MATMUL2R_TILE_ROWS),
        *(f"matmul2w_{q.lower()}_bm{tm}" for q in MATMUL2W_TYPES for tm in MATMUL2W_TILE_ROWS),
        *(f"matmul2t_{q.lower()}_bm{tm}" for q in MATMUL2W_TYPES for tm in MATMUL2T_TILE_ROWS),
        *(f"matvec_{q.lower()}_b1" for q in GPU_QTYPES),
        *(f"matvec_{q.lower()}_b1n" for q in GPU_QTYPES if q != "F16"),
        *(f"matvec_{q.lower()}_b1s" for q in MATVEC_STAGED_TYPES),
        *(f"matvec_{q.lower()}_bxs" for q in MATVEC_STAGED_TYPES),
        *(f"matvec_{q.lower()}_mma" for q in MATVEC_MMA_TYPES),
        *(f"repack_{q.lower()}" for q in GPU_QTYPES if q != "F16"),
        "convert_bf16_f16",
        "convert_f32_f16",
        "quantize_q8x2",
        "rmsnorm_f32",
        "add_rmsnorm_f32",
        "rope_kv_f32",
        "swiglu_f16",
        "geglu_f16",
        "attn_decode_f16",
        "attn_decode_f16_hd256",
        "attn_prefill_f16",
        "attn_prefill_f16_hd256",
        "attn_decode_tile_f16",
        "attn_decode_tile_f16_hd256",
        "attn_prefill_mma_f16",
        "attn_prefill_mma_f16_hd256",
        "attn_prefill_mma_varlen_f16",
        "attn_prefill_mma_varlen_f16_hd256",
        "sample_prep_f32",
        "sample_f32",
    }
)
PDL_MIN_CC = 90  # griddepcontrol is sm_90 PTX (Hopper and newer)


def pdl_enabled(cc: int) -> bool:
    """Programmatic dependent launch on a GPU of compute capability `cc` (90 = 9.0): sm_90+, unless INGOT_PDL=0."""
    return cc >= PDL_MIN_CC and settings.PDL.get()


def mark_pdl(kernels: dict[str, Kernel], cc: int) -> None:
    """Set Kernel.pdl: the PDL_KERNELS among `kernels`, when the GPU has PDL and it is not turned off."""
    on = pdl_enabled(cc)
    for name, kernel in kernels.items():
        kernel.pdl = on and name in PDL_KERNELS


MAX_K_SLICES = 16  # split-K slices of one GEMM at most
MAX_CLUSTER_SLICES = MATMUL2_SLICES  # matmul2's: a tile's slices may form one thread-block cluster (portable size)
# Clusters only for grids of at most CLUSTER_GRID_PER_SM blocks per SM. A cluster's blocks wait for each other at
# its barrier and need S free slots in one GPC at once: measured on the H200 (cuda/PERF.md v13), SmolLM2's decode
# GEMMs (30-144 blocks on 132 SMs) are 8-21% faster as clusters, the 8B's (256-448 blocks) 0-14% slower.
CLUSTER_GRID_PER_SM = 1.5
CLUSTER_MIN_CC = 90  # thread-block clusters and distributed shared memory are sm_90+
# matmul2's split-K cost, measured on the H200 (cuda/PERF.md v11; SmolLM2's decode GEMMs at M=16 and 64): a block
# of a 64-row tile spends ~0.45 us per 32-wide k-step and the tile's last block ~0.24 us per slice it adds up
# (a 16-row tile's partial is a quarter of that), so t(s) ~ a + 0.45 steps/s + 0.24 s (tm/64) is least at
# s = sqrt(1.9 steps 64/tm): 6 slices for K = 576 at M = 64, where 16 cost 45% more.
SPLIT_K_BALANCE = 2  # the fit's 1.9, rounded
SPLIT_K_BALANCE_ROWS = 64  # the tile height the costs were measured at
SPLIT_K_TILES_PER_SM = 4  # partial tiles of SPLIT_K_TILE_FLOATS that SplitK holds per SM (Kernels.split_k)
# The unit: a 64x128 fp32 tile, matmul2's at decode batches up to 64 (a 128x128 tile counts twice, WMMA's 64x64
# half). matmul_geometry caps the slices so that a grid's partial tiles fit.
SPLIT_K_TILE_FLOATS = 64 * 128
# DECODE_FILL_ROUND: a decode batch's matmul2 (no slice_rows) whose grid would be too large for clusters even at
# MAX_CLUSTER_SLICES takes, if more, the slices that fill one round of resident blocks (MATMUL2_BLOCKS_PER_SM[tm] x
# SMs; its scratch sum has no cluster's bound, up to MAX_K_SLICES), each at least DECODE_SLICE_MIN_STEPS k-steps,
# and as few as cut K the same way where more would leave slices empty (the kernel gives each ceil(steps/slices)).
# Measured on the H200 (cuda/PERF.md v16): in a sweep of the 8B's decode GEMMs (every tile height, 1-16 slices)
# the best slices were the round's (qkv 8, o and down 12 at 64 rows; o and down 16 at 16 rows), 15-24% faster
# than the 2 x SMs rule's 6-8, and tg128 rose 8.5% at b16, 2% at b64. Slices of 2 k-steps lost on Gemma 3 270M's
# gate+up (20 steps, Q4_K: 10 slices 4.5% slower at b16) and won on Qwen3 0.6B's (32 steps, Q4_0: 16 slices
# +15.7%); at 3, Gemma keeps its slices and Qwen3's gate+up takes 8 (b16 the same, b32 +3.9%; its qkv then took
# 10 slices of which 2 were empty, now v15's 8: the same cut of K). The rule still gives the 8B's gate+up (224
# tiles) 2 slices, where 4 measured 12% faster alone. On the H100 (PERF.md v28) it ran unsplit 13% faster alone, and
# in the decode graph +5.0% at b4, +4.0% at b16 but -6.9% at b8: not modeled. SmolLM2's GEMMs keep their slices.
DECODE_SLICE_MIN_STEPS = 3

# matmul2's prefill tiling (matmul_geometry with slice_rows): a cost model fitted on the H200 (cuda/PERF.md v15: every
# tile height of 32-128 rows with 1-8 slices, at 512 rows of the 8B's and SmolLM2's four matrices). An SM runs up to
# MATMUL2_BLOCKS_PER_SM[tm] blocks at once (the kernels' __launch_bounds__ minimum; registers and shared memory
# allow no more at 128 rows), so the busiest SM's rounds of blocks, each the k-steps of its slice at
# ~MATMUL2_STEP_US[tm] a step, set the time, and each slice past the first adds ~MATMUL2_SLICE_US (its partial tile,
# the ordered sum, a block's start). Its picks are the measured best for the 8B's four: its o runs as 4 x 32 tiles
# of 128 rows in 2 slices, one round, 88 us, where v14's rule (64-row tiles, taken to give 132 SMs a tile each, and
# 2 slices) took 121.
MATMUL2_BLOCKS_PER_SM = {16: 4, 32: 3, 64: 3, 128: 2}
MATMUL2_STEP_US = {16: 0.9, 32: 0.9, 64: 0.9, 128: 1.0}
MATMUL2_SLICE_US = 4.0
# ... where the main loop dominates: a matrix whose full pass the model puts at PREFILL_MODEL_MIN_US or more (the
# 8B's four: 68-512 us). SmolLM2's (10-25 us) are set by per-launch latencies the model leaves out, and its picks,
# faster alone (63.8 us a layer against 69.9), made the whole pass slower: pp512 130.8k against v14's 140.6k
# (PERF.md v15); those keep v14's rule.
PREFILL_MODEL_MIN_US = 40.0

# The pipelined tensor-core GEMM (cuda/matmul.cu, matmul2_<type>_bm<TM>, compute capability >= 8.0): the bytes of
# one weight row in a raw cp.async stage (its Mm2* structs' RAW_ROW; the weights.cuh types load from global memory
# and have none), and its shared-memory rows of 32 + 8 halfs. Its tile heights: MATMUL2_TILE_ROWS (above).
MATMUL2_RAW_ROW = {"Q4_0": 20, "Q4_1": 24, "Q8_0": 36, "F16": 2 * (QK + 8)}
MATMUL2_LDS = QK + 8
# Its twin that dequantizes Q4_0 / Q4_1 / Q4_K / Q6_K straight into the mma fragments (matmul2r_<type>_bm<TM>):
# the same tiles, slices and bits (MATMUL2R_TYPES), MATMUL2R_STAGES stages of matmul2r_blocks(tm) blocks.


def matmul2r_blocks(tm: int) -> int:
    """Quantization blocks (of 32 along K) in one stage of matmul2r_*_bm<tm> (cuda/matmul.cu Mm2rShape::KB)."""
    return 4 if tm <= 32 else 2


def _fragment_weight_stage_bytes(qtype: str, kb: int) -> int:
    """The weights' part of a stage of kb quantization blocks in matmul2r_*, matmul2w_* and matmul2t_* (cuda/matmul.cu
    Mm2rShape and mm2r_stage_bytes, whose layout the wgmma kernels share): quant bytes [128][16 kb (+16 when kb is
    even)] and scale windows [128][32] of d (Q6_K: of its sub-block scales), then Q4_1's windows of m [128][32], or
    Q6_K's super-block d (two 4-byte words a row, [128][8]) and high bits [128][8 kb + 8]."""
    qrow = 16 * kb + (16 if kb % 2 == 0 else 0)
    second = {"Q4_1": 32, "Q6_K": 8 + 8 * kb + 8}.get(qtype, 0)
    return MATMUL2_BN * (qrow + 32 + second)


def matmul2r_smem(qtype: str, tm: int, cluster: bool = False) -> int:
    """Dynamic shared memory of matmul2r_<qtype>_bm<tm> (cuda/matmul.cu mm2r_stage_bytes; the kernel traps if given
    less): MATMUL2R_STAGES stages of the weights' regions (_fragment_weight_stage_bytes) and the A tile
    [tm][32 KB + 8] fp16. cluster: at least the fp32 partial tile, as matmul2_smem."""
    kb = matmul2r_blocks(tm)
    stage = _fragment_weight_stage_bytes(qtype, kb) + tm * (QK * kb + 8) * 2
    pipeline = MATMUL2R_STAGES * stage
    return max(pipeline, 4 * tm * MATMUL2_BN) if cluster else pipeline


def matmul2w_smem(qtype: str, tm: int) -> int:
    """Dynamic shared memory of matmul2w_<qtype>_bm<tm> (tm 128, MATMUL2W_TILE_ROWS: cuda/matmul.cu Mm2wShape::SMEM; the
    kernel traps if given less): MATMUL2W_STAGES stages of the A tile [tm][64] fp16, quant bytes [128][48] and scale
    windows [128][32] of d (and of m: Q4_1), the fp16 weight tile [128][64], and 1 KiB to align the base to the
    swizzle's 1024 bytes."""
    stage = tm * 64 * 2 + _fragment_weight_stage_bytes(qtype, matmul2r_blocks(128))  # KB 2: 64 weights along K
    return MATMUL2W_STAGES * stage + MATMUL2_BN * 64 * 2 + 1024


def matmul2t_smem(qtype: str, tm: int) -> int:
    """Dynamic shared memory of matmul2t_<qtype>_bm<tm> (cuda/matmul.cu Mm2tShape::SMEM; the kernel traps if given
    less): MATMUL2T_STAGES stages of the tokens [tm][32 KB] fp16 (64-wide swizzled regions), quant bytes
    [128][16 KB (+16 when KB is even)] and scale windows [128][32] of d (and of m: Q4_1), and 1 KiB of alignment."""
    kb = matmul2r_blocks(tm)
    return MATMUL2T_STAGES * (tm * 64 * kb + _fragment_weight_stage_bytes(qtype, kb)) + 1024


def matmul_uses_wgmma(image: str | None) -> bool:
    """Whether MATMUL2W_TYPES GEMMs in tiles of MATMUL2W_TILE_ROWS and MATMUL2T_TILE_ROWS run the wgmma kernels
    (matmul2w_*, matmul2t_*: Hopper's wgmma, which only an sm_90a image holds; elsewhere they trap) rather than
    matmul2r_*, for the matmul image the driver loads: INGOT_MATMUL=mma (the default; mma-sync keeps matmul2r)."""
    return image == "sm_90a" and settings.MATMUL.get() == "mma"


def matmul2r_serves(part: GpuMatrix, tiling: GemmTiling, M: int) -> bool:
    """Whether matmul2r_* computes this part's GEMM (else matmul2_*, the same bits): MATMUL2R_TYPES at its tile
    heights, with what its addressing assumes: 32-bit offsets (a part's quant bytes and the pass's A under 4 GiB),
    and for Q4_1 m at d's offset within 16 bytes (it reads m's scale windows at d's offsets; separate pool
    allocations, 256-byte aligned, always are). Q4_K's headers are read as 16-byte chunks, here as by every Q4_K
    kernel (weights.cuh Q4_KW): the pool's alignment. Q6_K's d is read as the aligned 4-byte words holding its
    elements (up to 2 bytes past either end, within the pool's 256-byte rounding)."""
    if part.qtype not in MATMUL2R_TYPES or tiling.tm not in MATMUL2R_TILE_ROWS:
        return False
    if part.rows * part.cols // 2 >= 1 << 32 or M * part.cols >= 1 << 32:
        return False
    d, m = part.d, part.m
    return m is None or (d is not None and (_ptr(d) - _ptr(m)) % 16 == 0)


def fragment_args(part: GpuMatrix) -> list:
    """The weight arguments (qs, d, m) of matmul2r_*, matmul2w_* and matmul2t_* for a part of MATMUL2R_TYPES: Q4_0
    (qs, d, null), Q4_1 (qs, d, m), Q4_K (qs, its super-block headers sc in d's place, null); matmul2r_q6_k takes
    matmul2_q6_k's (qs, qh, sc, d)."""
    if part.qtype == "Q6_K":
        return part.args()
    if part.qtype == "Q4_K":
        return [part.qs, part.sc, None]
    return [part.qs, part.d, part.m if part.qtype == "Q4_1" else None]


def split_k_floats(sm_count: int) -> int:
    """fp32 elements of SplitK's partial-tile scratch on a GPU of sm_count SMs."""
    return SPLIT_K_TILES_PER_SM * sm_count * SPLIT_K_TILE_FLOATS


def image_cc(arch: str | None) -> int:
    """The compute capability of a fatbin image's arch as compat.Decision names it: "sm_90a" -> 90,
    "compute_120" -> 120 (None, no image: 0)."""
    return int(re.sub(r"\D", "", arch)) if arch else 0


def split_k_uses_clusters(cc: int) -> bool:
    """Whether matmul2's split-K slices are summed in a thread-block cluster (cuda/matmul.cu) on a GPU of compute
    capability cc: sm_90+, unless INGOT_SPLIT_K=ordered (the tile's last block sums them from global memory)."""
    return cc >= CLUSTER_MIN_CC and settings.SPLIT_K.get() == "cluster"


def matmul_uses_mma(cc: int) -> bool:
    """Whether GEMMs run the pipelined mma.sync kernels (matmul2_*: mma.sync m16n8k16, ldmatrix and cp.async need
    compute capability 8.0) on a GPU of compute capability cc, unless INGOT_MATMUL=wmma; else matmul_<type>."""
    return cc >= 80 and settings.MATMUL.get() != "wmma"


def matmul2_smem(qtype: str, tm: int, cluster: bool = False) -> int:
    """Dynamic shared memory of matmul2_<qtype>_bm<tm> (cuda/matmul.cu mm2_smem_bytes; the kernel traps if given
    less): A stages [STAGES][tm][40] fp16, the dequantized tile [2][128][40] fp16 (F16 multiplies its raw stage in
    place: none), raw weight stages [STAGES][128][RAW_ROW] bytes. cluster: a slice of a cluster split-K also keeps
    its fp32 partial tile [tm][128] there once the main loop is done (the larger of the two)."""
    direct = qtype == "F16"
    pipeline = (
        MATMUL2_STAGES * tm * MATMUL2_LDS * 2
        + (0 if direct else 2 * MATMUL2_BN * MATMUL2_LDS * 2)
        + MATMUL2_STAGES * MATMUL2_BN * MATMUL2_RAW_ROW.get(qtype, 0)
    )
    return max(pipeline, 4 * tm * MATMUL2_BN) if cluster else pipeline


@dataclass(frozen=True)
class GemmTiling:
    """How one GEMM C[M, N] = A[M, K] W[N, K]^T is cut: tm tokens x tn features per block, `slices` along K."""

    mma: bool  # matmul2_<type>_bm<tm> (else the WMMA matmul_<type>, 64x64)
    tm: int
    tn: int
    slices: int
    cluster: bool = False  # the slices of a tile are one thread-block cluster (matmul2, sm_90+): no SplitK scratch

    def kernel(self, qtype: str) -> str:
        return f"matmul2_{qtype.lower()}_bm{self.tm}" if self.mma else f"matmul_{qtype.lower()}"

    @property
    def threads(self) -> int:
        return MATMUL2_THREADS if self.mma else 128

    def smem(self, qtype: str) -> int:
        return matmul2_smem(qtype, self.tm, self.cluster) if self.mma else 0

    def grid(self, M: int, N: int) -> tuple[int, int, int]:
        """matmul2: tokens along x, so the few token tiles sharing a weight tile run side by side (the weights are
        read from DRAM once); WMMA: features along x (cuda/matmul.cu)."""
        tm_tiles, tn_tiles = -(-M // self.tm), -(-N // self.tn)
        return (tm_tiles, tn_tiles, self.slices) if self.mma else (tn_tiles, tm_tiles, self.slices)


def matmul_geometry(
    M: int,
    N: int,
    K: int,
    sm_count: int,
    *,
    mma: bool,
    split: bool,
    cluster: bool = False,
    slice_rows: int | None = None,
) -> GemmTiling:
    """The tiling of a GEMM (the whole matrix's N; a stack's parts take the same tiling). matmul2's tile height is
    the smallest of MATMUL2_TILE_ROWS covering M (decode batches: no multiplies wasted on padding rows); without
    split-K (prefill) a smaller one, down to MATMUL2_PREFILL_MIN_ROWS, while the larger would leave SMs idle.
    split: K is cut into slices while the tiles alone would not fill the GPU twice, as many as bring tiles x slices
    to about 2 x SMs, at most MAX_K_SLICES and K/32, and no more than SplitK's scratch holds (split_k_floats); for
    matmul2 also no more than sqrt(SPLIT_K_BALANCE x k-steps x 64 / tm), where a slice's share of the main loop
    stops paying for its partial tile in the last block's ordered sum (SPLIT_K_BALANCE).
    matmul2 takes at most MAX_CLUSTER_SLICES, whether its slices are summed in a thread-block cluster (`cluster`,
    which uses no SplitK scratch; for grids of at most CLUSTER_GRID_PER_SM blocks per SM) or by the last block:
    one geometry, so the two sums give the same bits; but a decode batch's grid too large for clusters even then
    takes more, if one round of resident blocks holds more (DECODE_FILL_ROUND). A grid of 1 to
    CLUSTER_GRID_PER_SM blocks per SM takes fewer slices, down to one block per SM: a cluster waits for its
    slowest block, and a block sharing an SM is that (SmolLM2's gate+up at 64 rows: 24 tiles x 6 slices on 132
    SMs 12.1 us, x 4 slices 10.4 us).
    slice_rows (prefill passes, split): K is cut as it would be for a pass of slice_rows rows, whatever M, so every
    pass sums a matrix's K in the same slices and a row's result does not depend on the rows beside it (a
    prompt's tokens and the prefix cache's pages are the same however the passes were composed). The cut: the
    cost model's (_prefill_tiling, with the tile height its best for M at those slices) for a matrix whose full
    pass it estimates at PREFILL_MODEL_MIN_US or more; below that, the tile height follows the rule without
    split-K for M, and the slices _k_slices's for a full pass (v14's rule)."""
    modeled = _prefill_tiling(M, N, K, sm_count, slice_rows) if mma and split and slice_rows is not None else None
    if modeled is not None:
        # the slices sum through the scratch (Kernels.split_k sizes it for them): as clusters, the 8B's 512-row
        # GEMMs in their best tilings ran 6-19% slower (PERF.md v15), and the bits are the same
        return GemmTiling(mma, modeled[0], MATMUL2_BN, modeled[1])
    if mma:
        tn = MATMUL2_BN
        tm = _tile_rows(M, N, sm_count, shrink=not split or slice_rows is not None)
    else:
        tm = tn = MATMUL_TILE
    tiles = -(-M // tm) * -(-N // tn)
    slices = 1
    if split and tiles < 2 * sm_count:
        if slice_rows is None:
            slices = _k_slices(tiles, tm, tn, K, sm_count, mma, decode=True)
        else:
            tm_pass = _tile_rows(slice_rows, N, sm_count, shrink=True) if mma else tm
            slices = _k_slices(-(-slice_rows // tm_pass) * -(-N // tn), tm_pass, tn, K, sm_count, mma)
    cluster = cluster and mma and slices > 1 and tiles * slices <= CLUSTER_GRID_PER_SM * sm_count
    return GemmTiling(mma, tm, tn, slices, cluster=cluster)


def _covering_rows(M: int) -> int:
    """matmul2's smallest tile height covering M rows (its tallest for more)."""
    return next((t for t in MATMUL2_TILE_ROWS if t >= M), MATMUL2_TILE_ROWS[-1])


def _prefill_heights(rows: int) -> list[int]:
    """Tile heights a prefill pass of `rows` rows may take, tallest first: the smallest covering them, and those
    below it down to MATMUL2_PREFILL_MIN_ROWS."""
    cover = _covering_rows(rows)
    return [t for t in reversed(MATMUL2_TILE_ROWS) if t <= cover and (t >= MATMUL2_PREFILL_MIN_ROWS or t == cover)]


def _prefill_cost(M: int, N: int, K: int, tm: int, slices: int, sm_count: int) -> float:
    """Estimated microseconds of matmul2 on M rows in tm-row tiles and `slices` slices of K (the model above): the
    busiest SM's rounds of MATMUL2_BLOCKS_PER_SM[tm] blocks, each the k-steps of its slice."""
    per_sm = -(-(-(-M // tm) * -(-N // MATMUL2_BN) * slices) // sm_count)
    rounds = -(-per_sm // MATMUL2_BLOCKS_PER_SM[tm])
    return rounds * -(-(K // QK) // slices) * MATMUL2_STEP_US[tm] + (slices - 1) * MATMUL2_SLICE_US


@functools.lru_cache(maxsize=256)
def _prefill_plan(rows: int, N: int, K: int, sm_count: int) -> tuple[int, int] | None:
    """(tile height, slices) of least estimated time for a pass of `rows` rows; ties go to taller tiles and fewer
    slices. No split once the tiles alone fill the GPU twice (the counters' bound, as _k_slices), and at most
    MAX_CLUSTER_SLICES (a cluster's portable size: a pass small enough for clusters sums the same slices there).
    None outside the model's range: a best estimate under PREFILL_MODEL_MIN_US. Cached: every GEMM of every new
    pass shape asks (128 a pass for the 8B), with a handful of distinct (rows, N, K)."""
    best: tuple[float, int, int] | None = None
    for tm in _prefill_heights(rows):
        tiles = -(-rows // tm) * -(-N // MATMUL2_BN)
        most = min(K // QK, MAX_CLUSTER_SLICES) if tiles < 2 * sm_count else 1
        for slices in range(1, most + 1):
            cost = _prefill_cost(rows, N, K, tm, slices, sm_count)
            if best is None or cost < best[0] - 1e-9:
                best = (cost, tm, slices)
    assert best is not None
    return None if best[0] < PREFILL_MODEL_MIN_US else (best[1], best[2])


def _prefill_tiling(M: int, N: int, K: int, sm_count: int, slice_rows: int) -> tuple[int, int] | None:
    """A prefill pass of M <= slice_rows rows: the slices of a full pass (_prefill_plan(slice_rows)), and the tile
    height the model prefers for M at those slices, among those giving no more tiles than the full pass (the
    scratch and counters Kernels.split_k sizes for it). None for a matrix outside the model's range."""
    plan = _prefill_plan(slice_rows, N, K, sm_count)
    if plan is None:
        return None
    tm_full, slices = plan
    n_tiles = -(-N // MATMUL2_BN)
    most_tiles = -(-slice_rows // tm_full) * n_tiles
    fits = [tm for tm in _prefill_heights(M) if -(-M // tm) * n_tiles <= most_tiles]
    costs = [_prefill_cost(M, N, K, tm, slices, sm_count) for tm in fits]
    return fits[costs.index(min(costs))], slices  # ties: the taller tile


def prefill_split_k_need(shapes, sm_count: int, slice_rows: int) -> tuple[int, int]:
    """fp32 elements of partial tiles and tile counters that prefill passes of up to slice_rows rows need for the
    matrices `shapes` ((N, K) each) under the prefill tiling: Kernels.split_k sizes the passes' scratch with it."""
    floats = tiles = 0
    for N, K in shapes:
        plan = _prefill_plan(slice_rows, N, K, sm_count)
        if plan is not None and plan[1] > 1:
            tm, slices = plan
            n = -(-slice_rows // tm) * -(-N // MATMUL2_BN)
            floats, tiles = max(floats, n * slices * tm * MATMUL2_BN), max(tiles, n)
    return floats, tiles


def _attn_prefill_heads(cfg, scale: float, window: int, softcap: float) -> list:
    """The prefill attention kernels' last arguments (both entry points): H, Hkv, hd, scale, window, softcap."""
    return [
        i32(cfg.n_heads),
        i32(cfg.n_kv_heads),
        i32(cfg.head_dim),
        f32(scale or cfg.head_dim**-0.5),
        i32(window),
        f32(softcap),
    ]


def _tile_rows(M: int, N: int, sm_count: int, *, shrink: bool) -> int:
    """matmul2's tile height for M rows: the smallest tile covering M; shrink (no split-K to fill the GPU with): a
    smaller one, down to MATMUL2_PREFILL_MIN_ROWS, while the larger would leave SMs idle."""
    tm = _covering_rows(M)
    while shrink and tm > MATMUL2_PREFILL_MIN_ROWS and -(-M // tm) * -(-N // MATMUL2_BN) < sm_count:
        tm //= 2
    return tm


def _k_slices(tiles: int, tm: int, tn: int, K: int, sm_count: int, mma: bool, *, decode: bool = False) -> int:
    """Split-K slices for a grid of `tiles` tiles of tm x tn (fewer than 2 x SMs): matmul_geometry's rule. decode
    (matmul2 on a decode batch) whose grid at MAX_CLUSTER_SLICES would be too large for clusters: as many as fill
    one round of resident blocks if more, each of DECODE_SLICE_MIN_STEPS k-steps at least and none empty
    (DECODE_FILL_ROUND)."""
    fit = split_k_floats(sm_count) // (tiles * tm * tn)
    steps = K // QK
    balance = math.isqrt(SPLIT_K_BALANCE * steps * SPLIT_K_BALANCE_ROWS // tm) if mma else MAX_K_SLICES
    most = MAX_CLUSTER_SLICES if mma else MAX_K_SLICES
    slices = max(1, min(steps, most, -(-2 * sm_count // tiles), balance, fit))
    if mma and decode and tiles * MAX_CLUSTER_SLICES > CLUSTER_GRID_PER_SM * sm_count:
        fill = min(MATMUL2_BLOCKS_PER_SM[tm] * sm_count // tiles, steps // DECODE_SLICE_MIN_STEPS, MAX_K_SLICES)
        fill = min(fill, balance, fit)
        if fill > 0:  # no slice left empty: the kernel gives each ceil(steps / slices) k-steps
            fill = -(-steps // -(-steps // fill))
        slices = max(slices, fill)
    if mma and sm_count < tiles * slices <= CLUSTER_GRID_PER_SM * sm_count:
        slices = max(1, sm_count // tiles)  # a grid this small: a block per SM (none waits on a shared one)
    return slices


@dataclass(frozen=True)
class SplitK:
    """Scratch of the split-K GEMM (cuda/matmul.cu): ws fp32 partial tiles, counters int32 per output tile."""

    ws: DeviceBuffer
    counters: DeviceBuffer


@dataclass
class GpuMatrix:
    """A weight matrix [rows, cols] on the GPU in the soa-v2 layout (cuda/common.cuh): the arrays LAYOUTS names."""

    qtype: str  # one of GPU_QTYPES
    rows: int
    cols: int
    qs: DeviceBuffer | None = None  # low bits of the codes
    qh: DeviceBuffer | None = None  # high bits (Q5_*, Q6_K, Q3_K)
    sc: DeviceBuffer | None = None  # sub-block scales (and mins) of the K-quants and IQ4_XS (Q4_K/Q5_K: with d)
    d: DeviceBuffer | None = None  # f16 scales [rows, cols/32], or [rows, cols/256] (Q6_K, Q3_K, Q2_K, IQ4_XS)
    m: DeviceBuffer | None = None  # f16 mins [rows, cols/32] (Q4_1, Q5_1), or Q2_K's dmin [rows, cols/256]
    w: DeviceBuffer | None = None  # f16 weights [rows, cols] (F16)

    def args(self) -> list:
        return [getattr(self, field) for field, _ in LAYOUTS[self.qtype]]

    @property
    def quantized(self) -> bool:
        return self.qtype != "F16"

    @property
    def uniform(self) -> bool:
        return True

    @property
    def parts(self) -> list[GpuMatrix]:
        return [self]


@dataclass
class GpuStack:
    """Matrices multiplied by the same input, stacked by rows but each in its own type (a GGUF that quantizes
    q, k, v or gate, up differently): one kernel launch per part, each writing its rows of the output."""

    parts: list[GpuMatrix]

    def __post_init__(self) -> None:
        if len({p.cols for p in self.parts}) != 1:
            raise ValueError(f"stacked matrices differ in width: {[p.cols for p in self.parts]}")
        if len({p.quantized for p in self.parts}) != 1:
            raise IncompatibleError(
                f"cannot stack F16 and quantized matrices ({', '.join(p.qtype for p in self.parts)}): they read "
                "different activations (fp32 vs q8x2)",
                hint="requantize the model so these tensors are all quantized (e.g. llama-quantize) or all F16",
            )

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def uniform(self) -> bool:
        return len({p.qtype for p in self.parts}) == 1

    @property
    def quantized(self) -> bool:
        return self.parts[0].quantized


def _ptr(a: int | DeviceBuffer) -> int:
    return a.ptr if isinstance(a, DeviceBuffer) else a


def layout_bytes(qtype: str, rows: int, cols: int) -> dict[str, int]:
    """Bytes of each device array of a [rows, cols] matrix in qtype's soa-v2 layout."""
    if qtype not in LAYOUTS:
        raise IncompatibleError(f"quant type {qtype} is not supported on the GPU", hint=f"GPU types: {GPU_QTYPES}")
    block = 256 if qtype in SUPERBLOCK_TYPES else QK
    if cols % block:
        raise IncompatibleError(
            f"a {qtype} matrix needs a multiple of {block} columns, got {cols}",
            hint="the GGUF is malformed (its blocks cannot split these rows); re-quantize it",
        )
    return {field: rows * cols * per_256 // 256 for field, per_256 in LAYOUTS[qtype]}


def norm_splits(n: int, dim: int, threads: int, sm_count: int) -> int:
    """Blocks per row of an n-row rmsnorm_f32 (cuda/norm.cu): as many as its warps take 32-value blocks in turn
    (a 4096-wide row at 1024 threads: 4, each warp then quantizing one) while the spread rows stay within a
    quarter of the SMs; else one (any count gives the same bits). The 8B's decode norm was one SM issuing 70% of
    its cycles, 4.6 us of a 2.5 ms step, 65 times (PERF.md v15); spread, 2.7 us and tg128 +4.5% (PERF.md v16). At
    4 and 8 rows it measured the same as one block a row, at 16 (64 blocks) 1.5% slower, at 64 the same: rows that
    already occupy many SMs gain nothing from summing each row 4 times."""
    trips = -(-(dim // QK) // max(threads // 32, 1))  # 32-value blocks per warp
    return trips if n * trips <= sm_count // 4 else 1


# Which decode batches take the GEMMs (the engine's _GemmDecodeOps: weights read once for every sequence) instead of
# the dp4a matrix-vector kernels (matvec_*: each weight read once, but 2 x 16 dp4a and the activations' loads per
# 32 weights and column, so their step grows with the batch). Measured with `ingot bench` tg128 (H100, 2026-12-06,
# PERF.md v18), tok/s matvec / GEMM:
#   8B Q4_0 (layer 123 MB, fragment GEMMs)   b2 566 / 516, b3 637 / 757 (PERF.md v19), b4 681 / 1,016, b8 715 / 1,966
#   8B Q4_K_M (layer ~140 MB, tile GEMMs)    b2 534 / 212, b4 632 / 420,   b8 684 / 829
#   ... Q4_K in fragment GEMMs (PERF.md v25)  b3 600 / 418, b4 628 / 551,   b8 GEMM 1,086 (tile GEMMs 830)
#   ... and Q6_K (PERF.md v26)                b3 591 / 496, b4 625 / 652,   b8 672 / 1,282
#   SmolLM2 Q4_1 (layer 2.2 MB)              b2 2,580 / 1,918, b4 4,205 / 3,786, b8 7,694 / 7,444
# A layer under DECODE_GEMM_LAYER_BYTES is launch-bound: its matvecs' extra columns cost little, and the GEMM
# path's longer launch list more (SmolLM2's GEMM step is flat at ~1.04 ms; its matvec step 0.78 ms at b2).
DECODE_GEMM_LAYER_BYTES = 64 << 20
DECODE_GEMM_MIN_BATCH_FRAG = 3  # most of a large layer's bytes in DECODE_GEMM_EARLY_TYPES' fragment GEMMs
DECODE_GEMM_EARLY_TYPES = ("Q4_0", "Q4_1")
# The K-quants' fragment GEMMs (Q4_K's header decoding, Q6_K's fp32 dequantization) lose to the matvecs at 3
# sequences and win from 4: a layer mostly in MATMUL2R_TYPES takes them from 4 ...
DECODE_GEMM_MIN_BATCH_FRAG_K = 4
DECODE_GEMM_MIN_BATCH_TILE = 8  # ... the other types' matmul2 (dequantized through a shared-memory tile) from 8
DECODE_GEMM_MIN_BATCH_SMALL = 16  # launch-bound layers (and any GPU without the mma GEMMs)
# Where the GPU runs matvec_<type>_bxs (staged_gpu: the activations staged once a block) and most of a layer's
# bytes are in its types, the matvecs win every width they serve. H100, 2026-12-07 (PERF.md v39), tok/s bxs / GEMM:
#   8B Q4_0     b3 1,109 / 773, b4 1,265 / 1,020 (and b2 834 against the any-column kernel's 587)
#   8B Q4_K_M   b3 959, b4 1,134 / 666 (the GEMM from 4)
DECODE_GEMM_MIN_BATCH_STAGED = MATVEC_COLS + 1


def launch_bound_layers(layer_bytes: dict[str, int]) -> bool:
    """Whether a model's decoder layers (layer_bytes: one layer's matrix bytes by quant type) are launch-bound:
    under DECODE_GEMM_LAYER_BYTES."""
    return sum(layer_bytes.values()) < DECODE_GEMM_LAYER_BYTES


def decode_gemm_min_batch(layer_bytes: dict[str, int], mma: bool, frag: bool, cols_staged: bool = False) -> int:
    """The narrowest decode batch that runs the GEMMs. layer_bytes: one decoder layer's matrix bytes by quant type;
    mma, frag: the GEMM kernels in use (Kernels.matmul_mma, .matmul_frag); cols_staged: the GPU runs
    matvec_<type>_bxs (staged_gpu). INGOT_DECODE_GEMM_MIN_BATCH overrides."""
    if not mma or launch_bound_layers(layer_bytes):
        return DECODE_GEMM_MIN_BATCH_SMALL
    total = sum(layer_bytes.values())
    if cols_staged and 2 * sum(n for q, n in layer_bytes.items() if q in MATVEC_STAGED_TYPES) >= total:
        return DECODE_GEMM_MIN_BATCH_STAGED
    early = sum(n for q, n in layer_bytes.items() if q in DECODE_GEMM_EARLY_TYPES) if frag else 0
    fragment = sum(n for q, n in layer_bytes.items() if q in MATMUL2R_TYPES) if frag else 0
    if 2 * early >= total:
        return DECODE_GEMM_MIN_BATCH_FRAG
    return DECODE_GEMM_MIN_BATCH_FRAG_K if 2 * fragment >= total else DECODE_GEMM_MIN_BATCH_TILE


def one_column_kernel(ncols: int) -> bool:
    """Whether a matvec of ncols columns runs the one-column kernels (matvec_<type>_b1: single-sequence decode,
    fewer registers than the any-column kernel and so more warps per SM, cuda/matvec.cu); INGOT_MATVEC_B1=0: never.
    Only they take a fused norm's scale."""
    return ncols == 1 and settings.MATVEC_B1.get()


def matvec_mma_smem(qtype: str, ncols: int) -> int:
    """Dynamic shared memory of matvec_<type>_mma at ncols columns (cuda/matvec.cu mvm_stage_bytes): each warp's
    MATVEC_MMA_STAGES stages of 16 rows x (MATVEC_MMA_CHUNK blocks of 16 quant bytes + 16 bytes of padding), their
    f16 scales (d, and m for Q4_1; Q4_K: the chunk's super-block header, the same 16 bytes a row as Q4_0's d), and
    per group of 4 sequences their q8x2 words (2 levels x 4 x (MATVEC_MMA_CHUNK x 32 + 16) bytes) and block scales
    (4 x MATVEC_MMA_CHUNK float4). Q4_0 and Q4_K / Q4_1: 61.5 / 64.5 KiB up to 4 columns (three blocks an SM on
    sm_90), 93 / 96 KiB above (two; one on sm_86 / 89 / 120's 99 KiB)."""
    groups = -(-ncols // 4)
    scales = 2 if qtype == "Q4_1" else 1
    quants = MATVEC_MMA_ROWS * (MATVEC_MMA_CHUNK * 16 + 16) + MATVEC_MMA_ROWS * MATVEC_MMA_CHUNK * 2 * scales
    acts = groups * (2 * 4 * (MATVEC_MMA_CHUNK * QK + 16) + 4 * MATVEC_MMA_CHUNK * 16)
    return MATVEC_MMA_WARPS * MATVEC_MMA_STAGES * (quants + acts)


def narrow_mma_model(layer_bytes: dict[str, int]) -> bool:
    """Whether a model's decode batches may run matvec_<type>_mma (the integer tensor cores, cuda/matvec.cu):
    models whose layers are launch-bound (launch_bound_layers). Measured on an H100 (cuda/PERF.md v22), tg128 against
    the dp4a kernel: the real SmolLM2 (2.2 MB layers) +6% at 3 sequences, +14% at 4, +8% at 8; on the 8B (123 MB
    layers) the kernel reached 0.8-1.1 TB/s, slower than the fragment GEMM from 3 sequences and the dp4a kernel at 2."""
    return launch_bound_layers(layer_bytes)


def narrow_mma_kernel(qtype: str, ncols: int, cc: int, rows: int, cols: int) -> bool:
    """Whether a matvec of ncols columns of a [rows, cols] qtype matrix may run matvec_<type>_mma (the caller
    decides per model: narrow_mma_model) on a GPU of compute capability cc: MATVEC_MMA_MIN_COLS..MATVEC_MMA_COLS
    columns of MATVEC_MMA_TYPES, rows of whole pairs of blocks (its scales are copied 4 bytes at a time) and under
    4 GiB of quants (32-bit offsets), from MATVEC_MMA_MIN_CC; INGOT_MATVEC_MMA=0: never."""
    return (
        MATVEC_MMA_MIN_COLS <= ncols <= MATVEC_MMA_COLS
        and qtype in MATVEC_MMA_TYPES
        and cols % (2 * QK) == 0
        and rows * cols // 2 < 1 << 32
        and cc >= MATVEC_MMA_MIN_CC
        and settings.MATVEC_MMA.get()
    )


def matvec_staged_smem(qtype: str, cols: int) -> int:
    """Dynamic shared memory of matvec_<type>_b1s for rows of `cols` weights (cuda/matvec.cu matvec_staged): the
    activation (80 bytes a 32-weight block), each warp's MATVEC_STAGED_STAGES stages of two whole rows of every
    array of the type (LAYOUTS' bytes per 256 weights), and an 8-byte mbarrier a stage. The 8B's 4,096-wide rows
    at Q4_0: 154 KiB, so one block an SM."""
    nb = cols // QK
    stage = 2 * (cols // 256) * sum(b for _, b in LAYOUTS[qtype])
    return 80 * nb + MATVEC_STAGED_WARPS * MATVEC_STAGED_STAGES * (stage + 8)


def staged_gpu(cc: int) -> bool:
    """Whether a GPU of compute capability cc runs the staged matvecs (matvec_<type>_b1s and _bxs) at all:
    MATVEC_STAGED_CC, unless INGOT_MATVEC_STAGED=0."""
    return cc == MATVEC_STAGED_CC and settings.MATVEC_STAGED.get()


def matvec_staged(qtype: str, cols: int, cc: int, smem_optin: int) -> bool:
    """Whether a one-column matvec of `cols`-wide qtype rows runs matvec_<type>_b1s: a MATVEC_STAGED_TYPES type on a
    staged_gpu, rows of whole 256-weight groups whose every array is a multiple of 16 bytes (bulk copies), its shared
    memory within the GPU's opt-in limit."""
    return (
        qtype in MATVEC_STAGED_TYPES
        and cols % 256 == 0
        and all(cols // 256 * b % 16 == 0 for _, b in LAYOUTS[qtype])
        and matvec_staged_smem(qtype, cols) <= smem_optin
        and staged_gpu(cc)
    )


def matvec_cols_staged_smem(cols: int, ncols: int) -> int:
    """Dynamic shared memory of matvec_<type>_bxs (cuda/matvec.cu matvec_cols_staged): each column's q8x2
    activation, 80 bytes a 32-weight block. The 8B's 14,336-wide down at 4 columns: 140 KiB."""
    return 80 * (cols // QK) * ncols


def matvec_cols_staged(qtype: str, cols: int, ncols: int, cc: int, smem_optin: int) -> bool:
    """Whether a matvec of 2..MATVEC_COLS columns of `cols`-wide qtype rows runs matvec_<type>_bxs (the columns
    staged in shared memory once per block, persistent warps): a MATVEC_STAGED_TYPES type on a staged_gpu,
    the columns within the GPU's opt-in limit."""
    return (
        2 <= ncols <= MATVEC_COLS
        and qtype in MATVEC_STAGED_TYPES
        and matvec_cols_staged_smem(cols, ncols) <= smem_optin
        and staged_gpu(cc)
    )


def matvec_kernel(
    qtype: str, ncols: int, cc: int, rows: int, cols: int, narrow: bool = False, smem_optin: int = 0
) -> str:
    """The matvec kernel for ncols columns of a [rows, cols] qtype matrix: the one-column kernel where
    one_column_kernel says so (its staged form where matvec_staged says so, given the GPU's shared-memory opt-in
    limit); for a model whose layers are launch-bound (narrow: narrow_mma_model) the tensor-core one where
    narrow_mma_kernel says so, for other models the staged columns where matvec_cols_staged says so; else the
    any-column one. (The staged columns on a SmolLM2-shaped model at 2 sequences: 2,101-2,181 tok/s against the
    any-column kernel's 2,908-2,914, H100, cuda/PERF.md v39: its persistent grid's copy and barrier outweigh
    matrices of a few hundred KiB.)"""
    if narrow and narrow_mma_kernel(qtype, ncols, cc, rows, cols):
        return f"matvec_{qtype.lower()}_mma"
    if not narrow and matvec_cols_staged(qtype, cols, ncols, cc, smem_optin):
        return f"matvec_{qtype.lower()}_bxs"
    if not one_column_kernel(ncols):
        return f"matvec_{qtype.lower()}"
    return f"matvec_{qtype.lower()}_b1{'s' if matvec_staged(qtype, cols, cc, smem_optin) else ''}"


class NormedQ8(NamedTuple):
    """A q8x2 activation whose RMSNorm scale is still to come (cuda/matvec.cu, the fused norm): q8x2(x * w) and
    ss, the sums of squares of x's 32-value blocks, as matvec_<type>_b1n writes them. The one-column matvec that
    reads it multiplies its products by rsqrt(sum(ss) / cols + eps)."""

    xq: int
    xd: int
    ss: int
    eps: float


def norm_fusable(W: GpuMatrix | GpuStack, W_next: GpuMatrix | GpuStack, ncols: int) -> bool:
    """Whether the residual projection x += W · a and the norm after it, read by W_next, run as one
    matvec_<type>_b1n (cuda/matvec.cu): one sequence through the one-column kernels, W one quantized matrix, W_next
    quantized (so W's rows, its columns, come in whole blocks of 32) and at most MATVEC_NORM_MAX wide;
    INGOT_FUSED_NORM=0: never."""
    return (
        settings.FUSED_NORM.get()
        and one_column_kernel(ncols)
        and len(W.parts) == 1
        and W.quantized
        and W_next.quantized
        and W_next.cols == W.rows <= MATVEC_NORM_MAX
    )


PDL_LATE_MIN_BYTES = 4 << 20  # INGOT_PDL_TRIGGER=auto: matvecs reading this much trigger after their main loop


def matvec_pdl_flags(pdl: bool, W: GpuMatrix) -> int:
    """The `pdl` argument of a matvec kernel (cuda/matvec.cu): nothing without PDL; else PDL_PREFETCH (the first
    weights into L2 before the wait) unless INGOT_WEIGHT_PREFETCH=0, and PDL_LATE (the next kernel launches after
    the main loop, not at entry) as INGOT_PDL_TRIGGER says: for auto, when W is big enough (PDL_LATE_MIN_BYTES)
    for its blocks' placement to matter more than the overlap of the next launch (cuda/common.cuh)."""
    if not pdl:
        return 0
    trigger = settings.PDL_TRIGGER.get()
    big = sum(layout_bytes(W.qtype, W.rows, W.cols).values()) >= PDL_LATE_MIN_BYTES
    late = trigger == "late" or (trigger == "auto" and big)
    return (PDL_PREFETCH if settings.WEIGHT_PREFETCH.get() else 0) | (PDL_LATE if late else 0)


def kernel_images() -> dict[str, bytes]:
    """Fatbins for running a bare GGUF without a bundle: $INGOT_KERNELS (a folder of fatbins, e.g. `ingot build
    --out DIR`), else the ones `pip install` built (ingot/runtime/fatbins). A folder named in INGOT_KERNELS that
    is absent or incomplete is a usage error: --device auto falls back to the CPU engine only on an
    IncompatibleError (a CPU-only install), and a mistyped INGOT_KERNELS must not turn a GPU run into a silent
    CPU one."""
    named = settings.KERNELS.get()
    kdir = Path(named or installed_kernel_dir())
    if named and not kdir.is_dir():
        raise UsageError(f"INGOT_KERNELS {kdir}: no such folder", hint="name the output of `ingot build --out DIR`")
    images = {p.stem: p.read_bytes() for p in sorted(kdir.glob("*.fatbin"))}
    missing = [m for m in MODULES if m not in images]
    if missing and named:
        raise UsageError(
            f"INGOT_KERNELS {kdir} lacks {', '.join(f'{m}.fatbin' for m in missing)}",
            hint=f"rebuild it with `ingot build --out {kdir}`",
        )
    if missing:
        raise IncompatibleError(
            f"GPU kernels missing from {kdir}: {', '.join(missing)}",
            hint="reinstall with nvcc present, or run a bundle built by `ingot pack`",
        )
    return images


def prefill_uses_mma(cc: int) -> bool:
    """Whether prefill attention runs the tensor-core kernel (cuda/attention_prefill.cu: mma.sync m16n8k16 and
    cp.async need compute capability 8.0) on a GPU of compute capability cc (90 for 9.0)."""
    return cc >= 80 and settings.ATTN_PREFILL.get() == "mma"


# Large-vocabulary sampling (cuda/sample.cu): from SAMPLE_PREP_MIN_V logits a row's penalty, mask and argmax pass
# runs over ceil(V / SAMPLE_CHUNK) blocks of sample_prep_f32 (Gemma's 262,144: 128 blocks of 2,048 logits,
# 8 per thread) before sample_f32; below it one block's pass is shorter than the extra launch.
SAMPLE_CHUNK = 2048
SAMPLE_PREP_MIN_V = 65536
# sample_f32's dynamic shared memory on the prep path: candidate (logit, id) [CAND_SLOTS][SAMPLE_THREADS] and the
# draw's sorted (id, weight) [DRAW_MAX] (33 KiB: under the 48 KiB default)
SAMPLE_CAND_SMEM = 8 * (CAND_SLOTS * SAMPLE_THREADS + DRAW_MAX)


def sample_chunks(V: int) -> int:
    """sample_prep_f32 blocks per sequence for a vocabulary of V (0: the single-block path)."""
    return -(-V // SAMPLE_CHUNK) if V >= SAMPLE_PREP_MIN_V else 0


def sample_chunk_bytes(V: int, B: int) -> int:
    """Bytes of the chunk-result buffer (float4 [B, sample_chunks(V)]) for up to B sequences (at least 16)."""
    return 16 * B * max(1, sample_chunks(V))


def decode_splits(sm_count: int, B: int, n_kv_heads: int, per_sm: int, cap: int = MAX_SPLITS) -> int:
    """Splits per (sequence, kv head) in the decode attention grid: one round of the kernel's resident blocks
    (per_sm an SM) if every split were active, at most cap (MAX_SPLITS; v7's merge takes one split a lane: 32).
    The kernel uses only the splits a sequence's pages need (decode_split_ranges), so a large grid costs little at
    short context; at long context each block's page loop is latency-bound (cuda/PERF.md v19-v20), so the
    blocks an SM runs at once, not the bytes, set its speed."""
    return max(1, min(cap, -(-per_sm * sm_count // (B * n_kv_heads))))


def decode_split_ranges(pos: int, window: int, splits: int) -> list[tuple[int, int]]:
    """The key ranges [k_begin, k_end) of the ACTIVE splits of v8's decode attention (cuda/attention_decode.cu
    computes the same from pos[b] on the device) for a token at position pos: the pages holding the visible
    keys [lo, pos] (lo = pos - window + 1 on a sliding-window layer) cut into runs of ceil(npages / splits), or
    one run of up to ATT_ONE_SPLIT_PAGES pages."""
    lo = max(0, pos - window + 1) if window > 0 else 0
    first_page, npages = lo // PAGE, pos // PAGE - lo // PAGE + 1
    per_split = npages if npages <= ATT_ONE_SPLIT_PAGES else -(-npages // splits)
    active = -(-npages // per_split)
    ranges = []
    for s in range(active):
        page_begin = first_page + s * per_split
        page_end = min(page_begin + per_split, first_page + npages)
        ranges.append((max(lo, page_begin * PAGE), min(page_end * PAGE, pos + 1)))
    return ranges


class Kernels:
    """All kernel modules loaded into the current context, and the launch geometry of each op."""

    def __init__(self, device, images: dict[str, bytes]):
        self.device = device
        self.modules = []
        self.k: dict[str, Kernel] = {}
        fatbins = {}
        for name in MODULES:
            if name not in images:
                raise IncompatibleError(f"kernel module {name}.fatbin missing", hint="rebuild with `ingot build`")
            fatbins[name] = parse_fatbin(images[name], name)
            mod = Module(images[name], f"{name}.fatbin", list(fatbins[name].kernels), device)
            self.modules.append(mod)
            self.k.update(mod.kernels)
        # Prefill attention: the tensor-core kernel (cuda/attention_prefill.cu) from compute capability 8.0 (its
        # mma.sync m16n8k16 / cp.async), unless INGOT_ATTN_PREFILL=scalar; else attention.cu's scalar one.
        self.prefill_mma = prefill_uses_mma(device.info.cc)
        # GEMMs: the pipelined tensor-core kernels (matmul2_*) from compute capability 8.0 unless INGOT_MATMUL=wmma
        # (tests flip this attribute to run both). Their shared memory passes the 48 KiB default: opted into once
        # per kernel (at most 96 KiB: matmul2r_q4_1_bm128; under the 99 KiB of sm_86/89/120).
        self.matmul_mma = matmul_uses_mma(device.info.cc)
        # ... of which MATMUL2R_TYPES dequantize into the mma fragments (matmul2r_*) unless INGOT_MATMUL=mma-tile
        # (tests flip this one too: the two give the same bits).
        self.matmul_frag = settings.MATMUL.get() in ("mma", "mma-sync")
        # Split-K slices summed in a thread-block cluster (sm_90+, INGOT_SPLIT_K; tests flip it too): a slice then
        # keeps its fp32 partial tile in the pipeline's shared memory, so the opt-in covers that as well. That path
        # is sm_90 code, so the matmul image the driver loads must be one too (compute_80 PTX JIT-compiled for an
        # H200 holds the older code, whose cluster branch traps).
        loaded = decide(fatbins["matmul"], device.info.cc, driver_from_cuda_int(None, device.info.driver_cuda))
        self.split_k_cluster = split_k_uses_clusters(min(device.info.cc, image_cc(loaded.image)))
        # ... and their tiles of 32-128 rows run on Hopper's wgmma (matmul2w_*, matmul2t_*) where that image
        # is sm_90a (tests flip this one too: against matmul2r to fp32 rounding).
        self.matmul_wgmma = matmul_uses_wgmma(loaded.image)
        if device.info.cc >= 80:
            for q in GPU_QTYPES:
                for tm in MATMUL2_TILE_ROWS:
                    self.k[f"matmul2_{q.lower()}_bm{tm}"].allow_dynamic_smem(matmul2_smem(q, tm, cluster=True))
                    if q in MATMUL2R_TYPES and tm in MATMUL2R_TILE_ROWS:
                        self.k[f"matmul2r_{q.lower()}_bm{tm}"].allow_dynamic_smem(matmul2r_smem(q, tm, cluster=True))
            if self.matmul_wgmma:
                for q in MATMUL2W_TYPES:
                    for tm in MATMUL2W_TILE_ROWS:
                        self.k[f"matmul2w_{q.lower()}_bm{tm}"].allow_dynamic_smem(matmul2w_smem(q, tm))
                    for tm in MATMUL2T_TILE_ROWS:
                        self.k[f"matmul2t_{q.lower()}_bm{tm}"].allow_dynamic_smem(matmul2t_smem(q, tm))
        # Its shared memory grows with the head size (scalar: 80 KiB at hd 256, more than sm_75's 64 KiB opt-in;
        # mma: 99 KiB); one opt-in per head size this GPU can hold.
        self.prefill_head_dims = tuple(h for h in HEAD_DIMS if self.prefill_bytes(h) <= device.info.max_smem_optin)
        mark_pdl(self.k, device.info.cc)
        # matvec_<type>_b1n launched with PDL: its blocks are placed while the kernel before it drains, and where
        # the registers let two of them share an SM some SMs took two and others none (the 8B's tg128 380 tok/s
        # against 420 at one an SM: cuda/PERF.md v21). Just over half an SM's shared memory keeps them one to an SM.
        self.norm_smem = {q: self._one_block_an_sm(f"matvec_{q.lower()}_b1n") for q in GPU_QTYPES if q != "F16"}
        if device.info.cc == MATVEC_STAGED_CC:  # matvec_staged keeps each launch within this
            for q in MATVEC_STAGED_TYPES:
                self.k[f"matvec_{q.lower()}_b1s"].allow_dynamic_smem(device.info.max_smem_optin)
                self.k[f"matvec_{q.lower()}_bxs"].allow_dynamic_smem(device.info.max_smem_optin)
        if device.info.cc >= MATVEC_MMA_MIN_CC:
            for q in MATVEC_MMA_TYPES:
                self.k[f"matvec_{q.lower()}_mma"].allow_dynamic_smem(matvec_mma_smem(q, MATVEC_MMA_COLS))
        for hd in self.prefill_head_dims:
            self.k[self._prefill_kernel(hd)].allow_dynamic_smem(self.prefill_bytes(hd))
            if self.prefill_mma:  # the several-sequence launch of the same kernel (attn_prefill_varlen)
                self.k[self._attn_kernel("attn_prefill_mma_varlen_f16", hd)].allow_dynamic_smem(self.prefill_bytes(hd))
        # the staged logits share the block's shared memory with the kernel's own static arrays
        self.sample_smem_limit = device.info.max_smem_optin - self.k["sample_f32"].static_smem

    def _one_block_an_sm(self, name: str) -> int:
        """Dynamic shared memory for the kernel `name` (MATVEC_NORM_WARPS warps a block) that leaves room for one of
        its blocks per SM when it is launched with PDL (0 without PDL, or when the occupancy calculator says even
        that allows two)."""
        kernel = self.k[name]
        if not kernel.pdl:
            return 0
        smem, threads = self.device.info.max_smem_optin // 2 + 1, 32 * MATVEC_NORM_WARPS
        kernel.allow_dynamic_smem(smem)
        return smem if kernel.blocks_per_sm(threads, smem) == 1 else 0

    def close(self) -> None:
        for m in self.modules:
            m.close()

    # --- weights ---------------------------------------------------------------------------------

    def repack(self, qtype: str, src: int, W: GpuMatrix) -> Launch:
        """GGUF blocks at device address src -> W's soa-v2 arrays. One thread per 32-weight block."""
        if qtype in ("BF16", "F32"):
            n = W.rows * W.cols
            return Launch(self.k[f"convert_{qtype.lower()}_f16"], ((n + 255) // 256,), 256, [src, W.w, i64(n)])
        nblocks = W.rows * W.cols // QK
        return Launch(self.k[f"repack_{qtype.lower()}"], ((nblocks + 255) // 256,), 256, [src, *W.args(), i64(nblocks)])

    # --- per-token ops ---------------------------------------------------------------------------

    def embed(self, E: GpuMatrix, tokens: int, x: DeviceBuffer, n: int, scale: float = 1.0) -> Launch:
        """x[n, dim] fp32 = E[tokens[i]] * scale (each row dequantized in fp32, then multiplied in fp32). 512 threads:
        a decode step's one row is a few loop trips per thread, not 32 (4096 wide at 128 threads)."""
        args = [tokens, *E.args(), x, i32(E.cols), f32(scale)]
        return Launch(self.k[f"embed_{E.qtype.lower()}"], (n,), min(512, E.cols), args)

    def rmsnorm(
        self, x: int, w: DeviceBuffer, n: int, dim: int, eps: float, *, y=None, yq=None, yd=None, yh=None
    ) -> Launch:
        """x[n, dim] -> normalized rows in any of: y fp32, (yq, yd) q8x2, yh fp16."""
        # One warp per 32-value block when the row allows; a decode row spread over norm_splits blocks.
        threads = min(1024, dim)
        grid = (n, norm_splits(n, dim, threads, self.device.info.sm_count))
        return Launch(self.k["rmsnorm_f32"], grid, threads, [x, w, y, yq, yd, yh, i32(dim), f32(eps)])

    def add_rmsnorm(
        self,
        x: int,
        o: int,
        w: DeviceBuffer,
        n: int,
        dim: int,
        eps: float,
        *,
        w_next: DeviceBuffer | None = None,
        y=None,
        yq=None,
        yd=None,
        yh=None,
    ) -> Launch:
        """x[n, dim] += rmsnorm(o[n, dim]) * w: the post-norm residual (architectures with post_norms); then, with
        w_next, the rows rmsnorm(x) * w_next in the forms given (as rmsnorm's y, yq/yd, yh)."""
        return Launch(
            self.k["add_rmsnorm_f32"],
            (n,),
            min(1024, dim),
            [x, o, w, w_next, y, yq, yd, yh, i32(dim), f32(eps)],
        )

    def matvec(
        self,
        W: GpuMatrix | GpuStack,
        x,
        y: int,
        ncols: int,
        *,
        ldy: int,
        mode: int = MODE_STORE,
        bias: DeviceBuffer | None = None,
        narrow: bool = False,
    ) -> list[Launch]:
        """y[c, :] (op)= W · x[c, :] for c < ncols. x is (xq, xd) q8x2 for quantized W, fp32 for F16 W, or a
        NormedQ8 (one column: the fused norm's output, norm_fusable). Gated modes (MODE_SWIGLU, MODE_GEGLU): W stacks
        [gate; up] in one matrix and y gets act(gate·x) * (up·x), rows/2 outputs per column. A GpuStack gets one
        launch per part, writing its rows at the part's offset. narrow: the model allows matvec_<type>_mma
        (narrow_mma_model; narrow_mma_kernel decides per matrix)."""
        if mode in GATED_MODES and len(W.parts) > 1:
            raise IncompatibleError(
                f"a gated matvec needs [gate; up] in one matrix, got a stack of {[p.qtype for p in W.parts]}",
                hint="run gate and up as MODE_STORE into one buffer, then the activation kernel",
            )
        normed = isinstance(x, NormedQ8)
        if normed and not (one_column_kernel(ncols) and W.quantized and W.cols <= MATVEC_NORM_MAX):
            raise IncompatibleError(
                f"a pending norm's scale is applied by the one-column matvec of a quantized matrix at most "
                f"{MATVEC_NORM_MAX} wide, not at {ncols} columns of {W.cols}",
                hint="set INGOT_FUSED_NORM=0 (an engine bug: norm_fusable should have refused it)",
            )
        launches, offset, info = [], 0, self.device.info
        for part in W.parts:
            rows = part.rows // 2 if mode in GATED_MODES else part.rows
            xs = list(x[:2]) if part.quantized else [x]
            part_bias = None if bias is None else bias.at(4 * offset)
            name = matvec_kernel(part.qtype, ncols, info.cc, part.rows, part.cols, narrow, info.max_smem_optin)
            kernel, smem = self.k[name], 0
            if name.endswith("_b1s"):  # persistent: one block an SM, its warps take row pairs in turn
                grid, threads = (info.sm_count, 1), 32 * MATVEC_STAGED_WARPS
                smem = matvec_staged_smem(part.qtype, part.cols)
            elif name.endswith("_bxs"):  # persistent, as b1s
                grid, threads = (info.sm_count, 1), 32 * MATVEC_STAGED_WARPS
                smem = matvec_cols_staged_smem(part.cols, ncols)
            elif name.endswith("_mma"):  # one block of MATVEC_MMA_WARPS warps per 16 rows (8 gated outputs)
                per_block = MATVEC_MMA_ROWS // 2 if mode in GATED_MODES else MATVEC_MMA_ROWS
                grid, threads = ((rows + per_block - 1) // per_block, 1), 32 * MATVEC_MMA_WARPS
                smem = matvec_mma_smem(part.qtype, ncols)
            else:
                per_block = MATVEC_ROWS_PER_BLOCK // 2 if mode in GATED_MODES else MATVEC_ROWS_PER_BLOCK
                grid, threads = ((rows + per_block - 1) // per_block, (ncols + MATVEC_COLS - 1) // MATVEC_COLS), 128
            # the one-column kernel's fused-norm arguments: the partial sums (null: none) and eps
            b1 = [x.ss, f32(x.eps)] if normed else [None, f32(0.0)]
            launches.append(
                Launch(
                    kernel,
                    grid,
                    threads,
                    [
                        *part.args(),
                        *xs,
                        part_bias,
                        _ptr(y) + 4 * offset,
                        i32(rows),
                        i32(part.cols),
                        i32(ncols),
                        i32(ldy),
                        i32(mode),
                        i32(matvec_pdl_flags(kernel.pdl, part)),
                        *(b1 if name.endswith(("_b1", "_b1s")) and part.quantized else []),  # matvec_f16_b1: none
                    ],
                    smem=smem,
                )
            )
            offset += part.rows
        return launches

    def matvec_norm(
        self, W: GpuMatrix, x, resid: int, w_next: DeviceBuffer, out: NormedQ8, bias: DeviceBuffer | None = None
    ) -> Launch:
        """resid[:] += W · x (one column, x q8x2), then the next norm's input as `out` reads it: q8x2(resid * w_next)
        into (out.xq, out.xd) and the sums of squares of resid's 32-value blocks into out.ss (matvec_<type>_b1n,
        one block of MATVEC_NORM_WARPS warps per 32 rows). Only where norm_fusable said so."""
        if not (W.quantized and W.rows % QK == 0 and W.rows <= MATVEC_NORM_MAX) or isinstance(x, NormedQ8):
            raise IncompatibleError(
                f"matvec_norm takes a quantized matrix of at most {MATVEC_NORM_MAX} rows in whole blocks of 32 and "
                f"a plain q8x2 input; got {W.qtype} [{W.rows}, {W.cols}] and {type(x).__name__}",
                hint="set INGOT_FUSED_NORM=0 (an engine bug: norm_fusable should have refused it)",
            )
        kernel = self.k[f"matvec_{W.qtype.lower()}_b1n"]
        args = [*W.args(), *x, bias, resid, i32(W.rows), i32(W.cols), w_next, out.xq, out.xd, out.ss]
        args.append(i32(matvec_pdl_flags(kernel.pdl, W)))
        return Launch(kernel, (W.rows // QK,), 32 * MATVEC_NORM_WARPS, args, smem=self.norm_smem[W.qtype])

    def quantize(self, x: int, xq: int, xd: int, n_values: int) -> Launch:
        """x fp32 [n_values] -> q8x2: xq int8 [2 * n_values], xd float4 [n_values / 32] (cuda/common.cuh)."""
        nblocks = n_values // QK
        return Launch(self.k["quantize_q8x2"], ((nblocks + 3) // 4,), 128, [x, xq, xd, i64(nblocks)])

    def split_k_size(self, prefill_shapes=(), prefill_rows: int = 0) -> tuple[int, int]:
        """fp32 elements of partial tiles and int32 tile counters a split-K scratch holds. Decode: slices are only
        added while tiles < 2 x SMs (the counters), and matmul_geometry caps them so that tiles x slices x the
        tile's floats fit split_k_floats. prefill_shapes ((N, K) of the model's matrices) and prefill_rows (a
        pass's most rows): a prefill passes' scratch, also as large as their tiling needs (prefill_split_k_need:
        50 MB for the 8B's qkv in 4 slices of 128-row tiles)."""
        sm = self.device.info.sm_count
        floats, tiles = prefill_split_k_need(prefill_shapes, sm, prefill_rows) if self.matmul_mma else (0, 0)
        return max(split_k_floats(sm), floats), max(2 * sm, tiles)

    def split_k(self, pool, stream, prefill_shapes=(), prefill_rows: int = 0) -> SplitK:
        """The split-K GEMM's scratch for this GPU, from `pool`: slices' partial tiles and per-tile counters (zeroed
        here once; every launch leaves them zero), as split_k_size says."""
        floats, tiles = self.split_k_size(prefill_shapes, prefill_rows)
        ws = pool.alloc(4 * floats, "split-K partial tiles")
        counters = pool.alloc(4 * tiles, "split-K tile counters")
        stream.memset(counters.ptr, 0, counters.nbytes)
        return SplitK(ws, counters)

    def matmul(
        self,
        W: GpuMatrix | GpuStack,
        A: int,
        C: int,
        M: int,
        *,
        ldc: int,
        mode: int = MODE_STORE,
        bias: DeviceBuffer | None = None,
        split_k: SplitK | None = None,
        slice_rows: int | None = None,
    ) -> list:
        """C[M, N] (op)= A[M, K] fp16 · W[N, K]^T, C fp32 with row stride ldc. Returns the steps to run.
        split_k: when the tiles alone would not fill the GPU twice over, slice K too (decode batches), with this
        scratch; the partial sums are added in a fixed order (cuda/matmul.cu), so results do not vary between runs.
        slice_rows: K sliced as for that many rows, whatever M (prefill passes: matmul_geometry).
        With self.split_k_cluster (sm_90+) a tile's slices run as one thread-block cluster and sum through its
        shared memory instead (the scratch unused; the same bits). A GpuStack gets one launch per part, writing
        its columns of C at the part's offset. The kernels and their tiling: matmul_geometry (self.matmul_mma: the
        pipelined mma.sync ones, else WMMA; with self.matmul_wgmma, MATMUL2W_TYPES tiles of MATMUL2W_TILE_ROWS whose
        slices do not sum in a cluster run matmul2w_*, and tiles of MATMUL2T_TILE_ROWS matmul2t_*: the same tiling
        on Hopper's wgmma, matmul2t's slices summing through split_k)."""
        if mode in GATED_MODES:
            raise ValueError("matmul has no gated epilogue: run the activation kernel on its output")
        sm = self.device.info.sm_count
        tiling = matmul_geometry(
            M,
            W.rows,
            W.cols,
            sm,
            mma=self.matmul_mma,
            split=split_k is not None,
            cluster=self.split_k_cluster,
            slice_rows=slice_rows,
        )
        steps: list = []
        offset = 0
        for part in W.parts:
            grid = tiling.grid(M, part.rows)
            part_bias = None if bias is None else bias.at(4 * offset)
            frag = self.matmul_frag and matmul2r_serves(part, tiling, M) if tiling.mma else False
            cluster = tiling.cluster  # the slices sum in their thread-block cluster, else through the scratch
            if frag:  # matmul2r_*: the same tiling, weights (fragment_args) into the mma fragments ...
                kernel, smem = (
                    f"matmul2r_{part.qtype.lower()}_bm{tiling.tm}",
                    matmul2r_smem(part.qtype, tiling.tm, tiling.cluster),
                )
                wgmma = self.matmul_wgmma and part.qtype in MATMUL2W_TYPES
                if wgmma and tiling.tm in MATMUL2W_TILE_ROWS and not tiling.cluster:  # ... on wgmma
                    kernel, smem = f"matmul2w_{part.qtype.lower()}_bm{tiling.tm}", matmul2w_smem(part.qtype, tiling.tm)
                elif wgmma and tiling.tm in MATMUL2T_TILE_ROWS:  # ... or wgmma with the roles swapped
                    kernel, smem = f"matmul2t_{part.qtype.lower()}_bm{tiling.tm}", matmul2t_smem(part.qtype, tiling.tm)
                    cluster = False  # matmul2t has no cluster path: its slices sum through the scratch
                weights = fragment_args(part)
            else:
                kernel, smem, weights = tiling.kernel(part.qtype), tiling.smem(part.qtype), part.args()
            scratch = None if cluster else split_k
            if tiling.slices > 1 and not cluster:  # what SplitK holds (a part has at most the matrix's tiles)
                assert scratch is not None
                tiles = grid[0] * grid[1]
                if slice_rows is None:  # matmul_geometry keeps decode tilings in it, clustered or not
                    most_floats, most_tiles = split_k_floats(sm), 2 * sm - 1
                else:  # a prefill pass: as sized by split_k(prefill_shapes=...)
                    most_floats, most_tiles = scratch.ws.nbytes // 4, scratch.counters.nbytes // 4
                assert tiles <= most_tiles and tiles * tiling.slices * tiling.tm * tiling.tn <= most_floats
            steps.append(
                Launch(
                    self.k[kernel],
                    grid,
                    tiling.threads,
                    [
                        *weights,
                        A,
                        part_bias,
                        _ptr(C) + 4 * offset,
                        i32(M),
                        i32(part.rows),
                        i32(part.cols),
                        i32(ldc),
                        i32(mode),
                        None if scratch is None else scratch.ws,  # null: the slices sum in their cluster
                        None if scratch is None else scratch.counters,
                    ],
                    smem=smem,
                    cluster=tiling.slices if cluster else 1,
                )
            )
            offset += part.rows
        return steps

    def rope_kv(
        self,
        qkv: int,
        rope: DeviceBuffer,
        tok_seq: int,
        tok_pos: int,
        block_table: int,
        max_pages: int,
        k_cache: int,
        v_cache: int,
        n: int,
        cfg,
        *,
        q_norm: DeviceBuffer | None = None,
        k_norm: DeviceBuffer | None = None,
        eps: float = 0.0,
    ) -> Launch:
        """RMSNorm each q and k head of qkv[n, (H+2Hkv)*hd] (when q_norm, k_norm [hd] are given), rotate them in
        place with the `rope` table [positions, rope_dim/2] (cos, sin); write k,v of token i to the cache at
        tok_pos[i]. One block per token, one warp per head."""
        return Launch(
            self.k["rope_kv_f32"],
            (n,),
            128,
            [
                qkv,
                rope,
                tok_seq,
                tok_pos,
                block_table,
                i32(max_pages),
                k_cache,
                v_cache,
                i32(cfg.n_heads),
                i32(cfg.n_kv_heads),
                i32(cfg.head_dim),
                i32(cfg.rope_dim),
                i32(1 if cfg.rope_neox else 0),
                q_norm,
                k_norm,
                f32(eps),
            ],
        )

    def attn_decode(
        self,
        qkv: int,
        rope: DeviceBuffer,
        k_cache: int,
        v_cache: int,
        block_table: int,
        max_pages: int,
        pos: int,
        part_acc: int,
        part_ml: int,
        counters: int,
        out: int,
        B: int,
        splits: int,
        cfg,
        *,
        outq=None,
        outd=None,
        outh=None,
        scale: float = 0.0,
        window: int = 0,
        softcap: float = 0.0,
        q_norm: DeviceBuffer | None = None,
        k_norm: DeviceBuffer | None = None,
        eps: float = 0.0,
    ) -> Launch:
        """One new token per sequence (at pos[b]): [q/k head norms,] rope, KV write, split-KV attention and the
        merge, in one launch. out [B, H*hd] fp32, also as q8x2 (outq, outd) and/or fp16 (outh) when given;
        partials [B, H, splits, hd]; counters [B*Hkv] zeroed. splits <= MAX_SPLITS: the grid's splits, of which
        the kernel uses only as many as the sequence's pages need (decode_split_geometry). scale on q.k (0:
        1/sqrt(hd)); window > 0: the token sees the last `window` positions, itself included; softcap > 0:
        scores -> softcap * tanh(scores / softcap); q_norm, k_norm [hd] fp32 (qk_norm architectures).
        The kernel is v8's attn_decode_tile_f16* (cuda/attention_decode.cu), or v7's attn_decode_f16*
        (cuda/attention.cu) with INGOT_DECODE_ATTN=v7; both take the same arguments."""
        version = settings.DECODE_ATTN.get()
        assert 1 <= splits <= self._split_cap(version) and cfg.n_heads // cfg.n_kv_heads <= GQA_MAX
        return Launch(
            self.k[self._attn_kernel(self._decode_name(version), cfg.head_dim)],
            (splits, cfg.n_kv_heads, B),
            128,
            [
                qkv,
                rope,
                i32(cfg.rope_dim),
                i32(1 if cfg.rope_neox else 0),
                k_cache,
                v_cache,
                block_table,
                i32(max_pages),
                pos,
                part_acc,
                part_ml,
                counters,
                out,
                outq,
                outd,
                outh,
                i32(cfg.n_heads),
                i32(cfg.n_kv_heads),
                i32(cfg.head_dim),
                i32(splits),
                f32(scale or cfg.head_dim**-0.5),
                q_norm,
                k_norm,
                f32(eps),
                i32(window),
                f32(softcap),
            ],
            smem=self.decode_smem(cfg.head_dim, version),
        )

    def _split_rule(self, cfg) -> Callable[[int], int]:
        """splits(B), the decode attention grid's splits for B sequences on this GPU: INGOT_DECODE_SPLITS, else
        decode_splits from the kernel's occupancy (the driver's, for its registers and shared memory: 4 blocks an
        SM at head_dim 64/128 on sm_90, 3 elsewhere and at 256), asked once."""
        version = settings.DECODE_ATTN.get()
        cap = self._split_cap(version)
        forced = settings.DECODE_SPLITS.get()
        if forced:
            return lambda B: min(forced, cap)
        kernel = self.k[self._attn_kernel(self._decode_name(version), cfg.head_dim)]
        per_sm = max(kernel.blocks_per_sm(ATT_WARPS * 32, self.decode_smem(cfg.head_dim, version)), 1)
        sm_count = self.device.info.sm_count
        return lambda B: decode_splits(sm_count, B, cfg.n_kv_heads, per_sm, cap)

    def attn_decode_splits(self, B: int, cfg) -> int:
        """The decode attention grid's splits for B sequences on this GPU (attn_decode's `splits`, _split_rule)."""
        return self._split_rule(cfg)(B)

    def attn_decode_split_room(self, B: int, cfg) -> int:
        """The most (sequence, split) pairs a decode attention grid of up to B sequences has: the rows of the
        partials buffers (the widest b * splits(b) for b <= B; B at the least)."""
        splits = self._split_rule(cfg)
        return max(b * splits(b) for b in range(1, B + 1))

    @staticmethod
    def _decode_name(version: str) -> str:
        return "attn_decode_tile_f16" if version == "v8" else "attn_decode_f16"

    @staticmethod
    def _split_cap(version: str) -> int:
        """Splits a decode attention kernel merges: v8 MAX_SPLITS, v7 one a lane of its merging warp."""
        return MAX_SPLITS if version == "v8" else 32

    @staticmethod
    def _attn_kernel(name: str, hd: int) -> str:
        """hd 256 has kernels of its own (cuda/attention.cu: the 64/128 ones keep their register counts)."""
        return f"{name}_hd256" if hd == 256 else name

    @staticmethod
    def decode_smem(hd: int, version: str = "v8") -> int:
        """Dynamic shared memory of a decode attention block. v8 (cuda/attention_decode.cu): the staged page
        sK, sV fp16 [PAGE][hd + 8]; fp32 sq [GMAX * 256] (also the merge weights), sk, sv, snq, snk [hd], scs
        float2 [hd/2], sp [GMAX][PAGE], and scorr, sl, sm [GMAX] (47.1 KiB at hd 256). v7: sq [GMAX][hd],
        sk [hd], sm_m and sm_l [ATT_WARPS][GMAX], sm_acc [ATT_WARPS][GMAX][hd], fp32."""
        if version == "v8":
            return 2 * PAGE * (hd + 8) * 2 + (GQA_MAX * 256 + 5 * hd + GQA_MAX * PAGE + 3 * GQA_MAX) * 4
        return (GQA_MAX * hd + hd + 2 * ATT_WARPS * GQA_MAX + ATT_WARPS * GQA_MAX * hd) * 4

    @staticmethod
    def prefill_smem(hd: int) -> int:
        """The scalar kernel (attention.cu): sQ [16][hd], sK [PAGE][hd+1], sV [PAGE][hd], fp32."""
        return (PREFILL_QUERIES * hd + PAGE * (hd + 1) + PAGE * hd) * 4

    @staticmethod
    def prefill_mma_smem(hd: int) -> int:
        """The tensor-core kernel (attention_prefill.cu): sQ [64][hd+8], sK and sV [2][PAGE][hd+8], fp16
        (24 / 51 / 99 KiB at hd 64 / 128 / 256)."""
        return (PREFILL_MMA_ROWS + 4 * PAGE) * (hd + PREFILL_MMA_PAD) * 2

    def prefill_bytes(self, hd: int) -> int:
        """Dynamic shared memory of the prefill kernel this GPU runs."""
        return self.prefill_mma_smem(hd) if self.prefill_mma else self.prefill_smem(hd)

    def _prefill_kernel(self, hd: int) -> str:
        return self._attn_kernel("attn_prefill_mma_f16" if self.prefill_mma else "attn_prefill_f16", hd)

    def prefill_grid(self, T: int, cfg) -> tuple[int, int]:
        """mma: one block per 64 packed rows (token, query head) of one kv head, the G = H/Hkv heads of a token
        adjacent; scalar: one block per 16 tokens of one query head."""
        if self.prefill_mma:
            G = cfg.n_heads // cfg.n_kv_heads
            return ((T * G + PREFILL_MMA_ROWS - 1) // PREFILL_MMA_ROWS, cfg.n_kv_heads)
        return ((T + PREFILL_QUERIES - 1) // PREFILL_QUERIES, cfg.n_heads)

    def attn_prefill(
        self,
        qkv: int,
        ldqkv: int,
        k_cache: int,
        v_cache: int,
        block_row: int,
        tok_pos: int,
        T: int,
        out: int,
        cfg,
        *,
        scale: float = 0.0,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Launch:
        """out[T, H*hd] fp16 for tokens at positions tok_pos[0]..tok_pos[0]+T-1 of one sequence (causal; scale,
        window and softcap as in attn_decode). Both kernels take the same arguments."""
        return Launch(
            self.k[self._prefill_kernel(cfg.head_dim)],
            self.prefill_grid(T, cfg),
            ATT_WARPS * 32,
            [
                qkv,
                i32(ldqkv),
                k_cache,
                v_cache,
                block_row,
                tok_pos,
                i32(T),
                out,
                *_attn_prefill_heads(cfg, scale, window, softcap),
            ],
            smem=self.prefill_bytes(cfg.head_dim),
        )

    def attn_prefill_varlen(
        self,
        qkv: int,
        ldqkv: int,
        k_cache: int,
        v_cache: int,
        block_table: int,
        max_pages: int,
        tok_pos: int,
        starts: int,
        lengths: Sequence[int],
        out: int,
        cfg,
        *,
        scale: float = 0.0,
        window: int = 0,
        softcap: float = 0.0,
    ) -> Launch:
        """attn_prefill for the chunks of several sequences in one launch (the mma kernel only: prefill_mma):
        sequence z's lengths[z] rows at starts[z] (device int32 [S+1], its running sums) of qkv, tok_pos and out,
        its pages at row z of block_table [S, max_pages]. The same bits as a launch per sequence."""
        G = cfg.n_heads // cfg.n_kv_heads
        tiles = (max(lengths) * G + PREFILL_MMA_ROWS - 1) // PREFILL_MMA_ROWS
        return Launch(
            self.k[self._attn_kernel("attn_prefill_mma_varlen_f16", cfg.head_dim)],
            (tiles, cfg.n_kv_heads, len(lengths)),
            ATT_WARPS * 32,
            [
                qkv,
                i32(ldqkv),
                k_cache,
                v_cache,
                block_table,
                i32(max_pages),
                tok_pos,
                starts,
                out,
                *_attn_prefill_heads(cfg, scale, window, softcap),
            ],
            smem=self.prefill_mma_smem(cfg.head_dim),
        )

    def gated_act(self, activation: str, gu: int, F: int, n: int, *, hh: int | None = None, hf: int | None = None):
        """h[n, F] = act(gu[:, :F]) * gu[:, F:] as fp16 (hh) and/or fp32 (hf); activation: "silu" (SwiGLU) or
        "gelu_tanh" (GEGLU), the names of architectures.ACTIVATIONS."""
        total = n * F
        return Launch(
            self.k[ACTIVATION_KERNELS[activation]], ((total + 255) // 256,), 256, [gu, hh, hf, i32(F), i64(n)]
        )

    def swiglu(self, gu: int, h: int, F: int, n: int) -> Launch:
        """h[n, F] fp16 = silu(gu[:, :F]) * gu[:, F:]."""
        return self.gated_act("silu", gu, F, n, hh=h)

    def geglu(self, gu: int, h: int, F: int, n: int) -> Launch:
        """h[n, F] fp16 = gelu_tanh(gu[:, :F]) * gu[:, F:]."""
        return self.gated_act("gelu_tanh", gu, F, n, hh=h)

    def sample(self, logits: int, V: int, ld: int, B: int, p: dict, out_tokens: int) -> list[Launch]:
        """One token per sequence from logits[B, ld] (first V used); p holds the per-sequence parameter arrays,
        and for constrained decoding "masked" (int32 [B] flags) and "mask" (uint32 [B, mask_words] allowed-token
        bitmasks) with "mask_words"; without them no row is masked. The logits of masked tokens become -inf.
        With "chunks" (a device buffer of sample_chunk_bytes(V, B)) a vocabulary of SAMPLE_PREP_MIN_V or more
        first goes through sample_prep_f32 over many blocks (cuda/sample.cu): the same tokens, fewer µs."""
        steps: list[Launch] = []
        nchunks = sample_chunks(V) if p.get("chunks") else 0
        if nchunks:
            steps.append(
                Launch(
                    self.k["sample_prep_f32"],
                    (nchunks, B),
                    PREP_THREADS,
                    [
                        logits,
                        i32(V),
                        i32(ld),
                        i32(SAMPLE_CHUNK),
                        p["penalty"],
                        p["hist"],
                        p["hist_len"],
                        i32(p["hist_cap"]),
                        p.get("masked", 0),
                        p.get("mask", 0),
                        i32(p.get("mask_words", 0)),
                        p["chunks"],
                    ],
                )
            )
        # staged logits (small vocabularies), or with the prep pass the top-k candidate lists (cuda/sample.cu)
        use_smem = not nchunks and V * 4 <= self.sample_smem_limit
        smem = V * 4 if use_smem else SAMPLE_CAND_SMEM if nchunks else 0
        if use_smem and smem > 48 * 1024:
            self.k["sample_f32"].allow_dynamic_smem(smem)
        steps.append(self._sample_final(logits, V, ld, B, p, out_tokens, use_smem, smem, nchunks))
        return steps

    def _sample_final(
        self, logits: int, V: int, ld: int, B: int, p: dict, out_tokens: int, use_smem: bool, smem: int, nchunks: int
    ) -> Launch:
        return Launch(
            self.k["sample_f32"],
            (B,),
            SAMPLE_THREADS,
            [
                logits,
                i32(V),
                i32(ld),
                p["temperature"],
                p["top_k"],
                p["top_p"],
                p["min_p"],
                p["penalty"],
                p["hist"],
                p["hist_len"],
                i32(p["hist_cap"]),
                p["seed"],
                p["counter"],
                p.get("masked", 0),  # a null pointer: no row is masked
                p.get("mask", 0),
                i32(p.get("mask_words", 0)),
                out_tokens,
                i32(1 if use_smem else 0),
                p["chunks"] if nchunks else 0,  # null: step 1 and the argmax in sample_f32's own block
                i32(nchunks),
            ],
            smem=smem,
        )
