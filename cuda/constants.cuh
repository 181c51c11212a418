// Generated from runtime/gpu/constants.py by `python -m ingot.runtime.gpu.constants`: do not edit.
// The host's launch geometry (runtime/gpu/kernels.py) reads the same numbers from that module.
#pragma once

#define QK                  32    // values per quantization block, for every quant type the GPU kernels take
#define PAGE                32    // tokens per KV-cache page
#define MODE_STORE          0     // matvec/matmul epilogue: y = W x (+ bias)
#define MODE_ADD            1     // matvec/matmul epilogue: y += W x (+ bias), the residual
#define MODE_SWIGLU         2     // matvec epilogue: y = silu(W_gate x) * (W_up x), W = [gate; up] stacked
#define MODE_GEGLU          3     // matvec epilogue: y = gelu_tanh(W_gate x) * (W_up x), W = [gate; up] stacked
#define PDL_PREFETCH        1     // matvec `pdl` flag: prefetch the first weights into L2 before the PDL wait
#define PDL_LATE            2     // matvec `pdl` flag: let the next kernel launch only after this one's main loop
#define MV_WARPS            4     // warps per matvec block (2 rows each; 1 row pair each in the gated modes)
#define MV_COLS             4     // batch columns (sequences) per matvec block
#define MVN_WARPS           16    // warps per matvec_<type>_b1n block: 32 rows, one q8x2 block of the fused norm's output
#define MV_NORM_MAX         4096  // widest row a fused norm's consumer (matvec_<type>_b1) sums: a float4 of partials a lane
#define MVS_WARPS           16    // warps per matvec_<type>_b1s block (one block an SM; each warp streams its own row pairs)
#define MVS_STAGES          2     // row pairs in flight per matvec_<type>_b1s warp (its ring of bulk-copy stages)
#define MVM_WARPS           4     // warps per matvec_<type>_mma block (16 rows, K split between the warps)
#define MVM_ROWS            16    // rows per matvec_<type>_mma block: one m16 tile (8 outputs in the gated modes)
#define MVM_STAGES          3     // cp.async stages of each matvec_<type>_mma warp's own pipeline
#define MVM_CHUNK           8     // 32-weight blocks per row in a matvec_<type>_mma stage (128 bytes of Q4 quants)
#define MVM_COLS            8     // most batch columns (sequences) matvec_<type>_mma takes: two mma of 4 sequences x 2 levels
#define MATMUL_BM           64    // matmul tile rows (tokens)
#define MATMUL_BN           64    // matmul tile columns (output features)
#define MATMUL2_BN          128   // pipelined mma matmul (matmul2_*): tile columns (output features)
#define MATMUL2_STAGES      4     // pipelined mma matmul: cp.async stages of 32 along K
#define MATMUL2_THREADS     256   // pipelined mma matmul: threads per block (8 warps)
#define MATMUL2R_STAGES     3     // pipelined mma matmul, fragment-dequantizing (matmul2r_*): cp.async stages
#define MATMUL2W_STAGES     3     // warpgroup-mma matmul (matmul2w_*, sm_90a): cp.async stages of 64 along K
#define MATMUL2T_STAGES     4     // warpgroup-mma decode matmul (matmul2t_*, sm_90a): cp.async stages
#define MATMUL2_SLICES      8     // pipelined mma matmul: split-K slices at most (a thread-block cluster, portable size)
#define NORM_REGS           8     // rmsnorm: 32-value blocks of a row each warp holds in registers (wider rows loop)
#define ATT_WARPS           4     // warps per attention block
#define ATT_QPW             4     // prefill attention: queries per warp
#define ATT_ONE_SPLIT_PAGES 2     // decode attention: keys on at most this many pages run as one split (no merge)
#define MAX_SPLITS          64    // split-KV partials per (sequence, head) that v8's decode attention merges
#define MERGE_U             16    // decode attention's merge: splits' partials loaded a round, before any is used
#define SAMPLE_THREADS      1024  // threads per sampling block
#define PREP_THREADS        256   // threads per sample_prep_f32 block (one chunk of a large vocabulary)
#define CAND_SLOTS          4     // sample_f32, top-k over chunks: candidate logits kept per thread
#define DRAW_MAX            128   // sample_f32, top-k over chunks: most drawable candidates sorted for the draw
