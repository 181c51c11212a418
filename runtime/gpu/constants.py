"""Numbers the CUDA kernels and the Python host code must agree on, defined here once.

`cuda/constants.cuh` is generated from this module (`python -m ingot.runtime.gpu.constants > cuda/constants.cuh`)
and committed; a test regenerates it and fails if the two differ, so a number is never copied by hand. Values
the compiler decides (a kernel's static shared memory) are not here: the host asks the loaded kernel
(cuFuncGetAttribute), never a `ptxas -v` printout.
"""

from __future__ import annotations

import sys

# name -> (value, what it is); the order is the header's
SHARED: dict[str, tuple[int, str]] = {
    "QK": (32, "values per quantization block, for every quant type the GPU kernels take"),
    "PAGE": (32, "tokens per KV-cache page"),
    "MODE_STORE": (0, "matvec/matmul epilogue: y = W x (+ bias)"),
    "MODE_ADD": (1, "matvec/matmul epilogue: y += W x (+ bias), the residual"),
    "MODE_SWIGLU": (2, "matvec epilogue: y = silu(W_gate x) * (W_up x), W = [gate; up] stacked"),
    "MODE_GEGLU": (3, "matvec epilogue: y = gelu_tanh(W_gate x) * (W_up x), W = [gate; up] stacked"),
    "PDL_PREFETCH": (1, "matvec `pdl` flag: prefetch the first weights into L2 before the PDL wait"),
    "PDL_LATE": (2, "matvec `pdl` flag: let the next kernel launch only after this one's main loop"),
    "MV_WARPS": (4, "warps per matvec block (2 rows each; 1 row pair each in the gated modes)"),
    "MV_COLS": (4, "batch columns (sequences) per matvec block"),
    "MVN_WARPS": (16, "warps per matvec_<type>_b1n block: 32 rows, one q8x2 block of the fused norm's output"),
    "MV_NORM_MAX": (4096, "widest row a fused norm's consumer (matvec_<type>_b1) sums: a float4 of partials a lane"),
    "MVS_WARPS": (16, "warps per matvec_<type>_b1s block (one block an SM; each warp streams its own row pairs)"),
    "MVS_STAGES": (2, "row pairs in flight per matvec_<type>_b1s warp (its ring of bulk-copy stages)"),
    "MVM_WARPS": (4, "warps per matvec_<type>_mma block (16 rows, K split between the warps)"),
    "MVM_ROWS": (16, "rows per matvec_<type>_mma block: one m16 tile (8 outputs in the gated modes)"),
    "MVM_STAGES": (3, "cp.async stages of each matvec_<type>_mma warp's own pipeline"),
    "MVM_CHUNK": (8, "32-weight blocks per row in a matvec_<type>_mma stage (128 bytes of Q4 quants)"),
    "MVM_COLS": (8, "most batch columns (sequences) matvec_<type>_mma takes: two mma of 4 sequences x 2 levels"),
    "MATMUL_BM": (64, "matmul tile rows (tokens)"),
    "MATMUL_BN": (64, "matmul tile columns (output features)"),
    "MATMUL2_BN": (128, "pipelined mma matmul (matmul2_*): tile columns (output features)"),
    "MATMUL2_STAGES": (4, "pipelined mma matmul: cp.async stages of 32 along K"),
    "MATMUL2_THREADS": (256, "pipelined mma matmul: threads per block (8 warps)"),
    "MATMUL2R_STAGES": (3, "pipelined mma matmul, fragment-dequantizing (matmul2r_*): cp.async stages"),
    "MATMUL2W_STAGES": (3, "warpgroup-mma matmul (matmul2w_*, sm_90a): cp.async stages of 64 along K"),
    "MATMUL2T_STAGES": (4, "warpgroup-mma decode matmul (matmul2t_*, sm_90a): cp.async stages"),
    "MATMUL2_SLICES": (8, "pipelined mma matmul: split-K slices at most (a thread-block cluster, portable size)"),
    "NORM_REGS": (8, "rmsnorm: 32-value blocks of a row each warp holds in registers (wider rows loop)"),
    "ATT_WARPS": (4, "warps per attention block"),
    "ATT_QPW": (4, "prefill attention: queries per warp"),
    "ATT_ONE_SPLIT_PAGES": (2, "decode attention: keys on at most this many pages run as one split (no merge)"),
    "MAX_SPLITS": (64, "split-KV partials per (sequence, head) that v8's decode attention merges"),
    "MERGE_U": (16, "decode attention's merge: splits' partials loaded a round, before any is used"),
    "SAMPLE_THREADS": (1024, "threads per sampling block"),
    "PREP_THREADS": (256, "threads per sample_prep_f32 block (one chunk of a large vocabulary)"),
    "CAND_SLOTS": (4, "sample_f32, top-k over chunks: candidate logits kept per thread"),
    "DRAW_MAX": (128, "sample_f32, top-k over chunks: most drawable candidates sorted for the draw"),
}

QK = SHARED["QK"][0]
PAGE = SHARED["PAGE"][0]
MODE_STORE, MODE_ADD, MODE_SWIGLU, MODE_GEGLU = (
    SHARED[k][0] for k in ("MODE_STORE", "MODE_ADD", "MODE_SWIGLU", "MODE_GEGLU")
)
GATED_MODES = (MODE_SWIGLU, MODE_GEGLU)
PDL_PREFETCH, PDL_LATE = SHARED["PDL_PREFETCH"][0], SHARED["PDL_LATE"][0]
MATVEC_COLS = SHARED["MV_COLS"][0]
MATVEC_ROWS_PER_BLOCK = 2 * SHARED["MV_WARPS"][0]
MATVEC_NORM_WARPS = SHARED["MVN_WARPS"][0]
assert 2 * MATVEC_NORM_WARPS == QK, "a matvec_<type>_b1n block's rows are one q8x2 block of the norm's output"
MATVEC_NORM_MAX = SHARED["MV_NORM_MAX"][0]
MATVEC_STAGED_WARPS = SHARED["MVS_WARPS"][0]
MATVEC_STAGED_STAGES = SHARED["MVS_STAGES"][0]
MATVEC_MMA_WARPS = SHARED["MVM_WARPS"][0]
MATVEC_MMA_COLS = SHARED["MVM_COLS"][0]
MATVEC_MMA_ROWS = SHARED["MVM_ROWS"][0]
MATVEC_MMA_STAGES = SHARED["MVM_STAGES"][0]
MATVEC_MMA_CHUNK = SHARED["MVM_CHUNK"][0]
MATMUL_TILE = SHARED["MATMUL_BM"][0]
assert SHARED["MATMUL_BM"][0] == SHARED["MATMUL_BN"][0], "kernels.py sizes matmul grids with one square tile"
MATMUL2_BN = SHARED["MATMUL2_BN"][0]
MATMUL2_STAGES = SHARED["MATMUL2_STAGES"][0]
MATMUL2_THREADS = SHARED["MATMUL2_THREADS"][0]
MATMUL2_SLICES = SHARED["MATMUL2_SLICES"][0]
MATMUL2R_STAGES = SHARED["MATMUL2R_STAGES"][0]
MATMUL2W_STAGES = SHARED["MATMUL2W_STAGES"][0]
MATMUL2T_STAGES = SHARED["MATMUL2T_STAGES"][0]
NORM_REGS = SHARED["NORM_REGS"][0]
PREFILL_QUERIES = SHARED["ATT_WARPS"][0] * SHARED["ATT_QPW"][0]
ATT_WARPS = SHARED["ATT_WARPS"][0]
PREFILL_MMA_ROWS = 16 * ATT_WARPS  # tensor-core prefill: one m16 tile of packed query rows per warp (BQ there)
MAX_SPLITS = SHARED["MAX_SPLITS"][0]
MERGE_U = SHARED["MERGE_U"][0]
ATT_ONE_SPLIT_PAGES = SHARED["ATT_ONE_SPLIT_PAGES"][0]
SAMPLE_THREADS = SHARED["SAMPLE_THREADS"][0]
PREP_THREADS = SHARED["PREP_THREADS"][0]
CAND_SLOTS = SHARED["CAND_SLOTS"][0]
DRAW_MAX = SHARED["DRAW_MAX"][0]

# The GPU engine's weight layout: recorded in a bundle's manifest so a runtime that repacks differently can
# refuse it (cuda/common.cuh describes it).
WEIGHT_LAYOUT = (
    "soa-v2: quantized matrices repacked at load into separate quant/high-bit/scale/min arrays, K-quant sub-block"
    " scales as small integers; q,k,v and gate,up stacked when their types agree"
)
# The version of the contract between this host code and a bundle's kernels and weights: kernel signatures
# and launch contracts, the numbers in SHARED, and WEIGHT_LAYOUT. Bump it with any change to those; a bundle
# records the value it was packed and self-tested with, and a runtime with another value refuses to run it
# (exit 3, ingot.runtime.bundle.manifest.check_runtime) instead of launching kernels it does not match.
KERNEL_ABI = 19  # 2: soa-v2 weight layouts (K-quants, Q5, IQ4) and allowed-token masks in sample_f32
# 3: v8 decode attention (attention_decode module), sample_prep_f32 and sample_f32's chunk arguments,
# matvec_<type>_b1 kernels, attention_prefill module
# 4: matmul_<type> take split-K scratch (ws, counters): ordered split-K sums instead of atomics
# 5: matmul2_<type>_bm{16,32,64,128}, the pipelined mma.sync GEMM (dynamic shared memory, its own grid order and
# split-K tile size; SplitK's scratch doubled); MATMUL2_* in SHARED; matvec kernels' last argument, a word of
# PDL_PREFETCH | PDL_LATE flags (no release carried 4, so 5 covers both)
# 6: matmul2_<type>_bm* with ws == null are launched as clusters of a tile's split-K slices (sm_90+) and sum
# them through distributed shared memory
# 7: attn_prefill_mma_varlen_f16{,_hd256}: a prefill pass's sequences in one attention launch
# 8: v8 decode attention merges up to MAX_SPLITS = 64 splits (v7's stays at 32: the host caps its grid)
# 9: matvec_<type>_b1n (a residual projection with the next RMSNorm fused) and matvec_<type>_b1's (ss, eps)
# 10: (matvec_<type>_b1q, measured slower and reverted: never landed)
# 11: ATT_ONE_SPLIT_PAGES: decode attention runs up to 2 pages of keys as one split
# 12: matvec_<type>_mma (Q4_0, Q4_1): 2..MVM_COLS columns on the integer tensor cores
# 13: matmul2w_<type>_bm{128,64} (Q4_0, Q4_1): the prefill GEMM on Hopper's wgmma (sm_90a images); MATMUL2W_STAGES
# 14: matmul2t_<type>_bm{32,64}: decode batches on wgmma, weights from registers; MATMUL2T_STAGES;
# matmul2w_*_bm64 removed
# 15: matmul2r/2w/2t_q4_k_*: Q4_K in the fragment and wgmma GEMMs, its super-block headers in d's argument;
# matvec_q4_k_mma
# 16: matmul2r_q6_k_bm{16,32,64,128}: Q6_K in the fragment GEMM, its four arrays as matmul2_q6_k's arguments
# 17: matvec_<type>_b1s (Q4_0, sm_90): the one-column product with bulk-copied weights; MVS_WARPS, MVS_STAGES
# 18: matvec_<type>_b1s for Q4_1, Q4_K, Q6_K
# 19: matvec_<type>_bxs (the b1s types, sm_90): 2..MV_COLS columns with their activations staged


def header() -> str:
    """The text of cuda/constants.cuh."""
    lines = [
        "// Generated from runtime/gpu/constants.py by `python -m ingot.runtime.gpu.constants`: do not edit.",
        "// The host's launch geometry (runtime/gpu/kernels.py) reads the same numbers from that module.",
        "#pragma once",
        "",
    ]
    width = max(len(k) for k in SHARED)
    lines += [f"#define {k:<{width}} {v:<5} // {why}" for k, (v, why) in SHARED.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(header())
