"""Every INGOT_* environment variable, in one place: its name, default, meaning and how it is parsed.

Values are read when asked for (never at import), so a test or a long-lived process sees the environment of
the moment. A malformed value is a UsageError naming the variable and what it accepts. The README's
"Settings" table is this list; `ingot doctor --json` prints the values in force.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingot.runtime.errors import UsageError


@dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[str], Any]
    accepts: str  # what a valid value looks like, for the error message
    doc: str

    def get(self) -> Any:
        text = os.environ.get(self.name, "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise UsageError(
                f"{self.name}={text!r} is not {self.accepts}", hint=f"unset it or set {self.accepts}"
            ) from None


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def _nonneg_int(text: str) -> int:
    n = int(text)
    if n < 0:
        raise ValueError(text)
    return n


def _fraction(text: str) -> float:
    x = float(text)
    if not 0 < x <= 1:
        raise ValueError(text)
    return x


def _flag(text: str) -> bool:
    return text.lower() not in ("0", "false", "no", "off")


def _one_of(*choices: str, fold_case: bool = False) -> Callable[[str], str]:
    """A parser that accepts exactly these values (any letter case with fold_case, returned in lower case)."""

    def parse(text: str) -> str:
        value = text.lower() if fold_case else text
        if value not in choices:
            raise ValueError(text)
        return value

    return parse


CACHE_DIR = Setting(
    "INGOT_CACHE_DIR",
    None,
    Path,
    "a folder path",
    "Root of Ingot's caches (kernels/, models/, verified/, index/); default $XDG_CACHE_HOME/ingot or ~/.cache/ingot.",
)
KERNELS = Setting(
    "INGOT_KERNELS",
    None,
    Path,
    "a folder path",
    "Run bare GGUFs with the fatbins of `ingot build --out DIR` instead of the installed ones.",
)
DEBUG = Setting(
    "INGOT_DEBUG",
    False,
    _flag,
    "1 or 0",
    "Print a traceback with internal errors (exit 1) instead of one line.",
)
CPU_WEIGHT_CACHE_MIB = Setting(
    "INGOT_CPU_WEIGHT_CACHE_MIB",
    4096,
    _nonneg_int,
    "a number of MiB (0 or more)",
    "The CPU engine keeps dequantized float32 weights up to this size; beyond it, it dequantizes each matrix on use.",
)
DECODE_GEMM_MIN_BATCH = Setting(
    "INGOT_DECODE_GEMM_MIN_BATCH",
    None,
    _positive_int,
    "a positive integer",
    "The decode batch size from which the GPU engine uses tensor-core GEMMs instead of matrix-vector kernels "
    "(default: chosen per model, 3-16; runtime/gpu/kernels.py decode_gemm_min_batch).",
)
# The decode attention grid's splits (cuda/PERF.md v20): a tuning and measuring knob; the default fills one round of
# the kernel's resident blocks at long context.
DECODE_SPLITS = Setting(
    "INGOT_DECODE_SPLITS",
    None,
    _positive_int,
    "a positive integer",
    "Split-KV blocks per (sequence, kv head) in the GPU decode attention grid, at most 64 (32 for v7); default: one"
    " round of the kernel's resident blocks (runtime/gpu/kernels.py decode_splits).",
)
DECODE_ATTN = Setting(
    "INGOT_DECODE_ATTN",
    "v8",
    _one_of("v7", "v8", fold_case=True),
    "v8 or v7",
    "The GPU decode attention kernel: v8 (per-page tiles, cost follows the context) or v7 (the previous one).",
)
MATVEC_B1 = Setting(
    "INGOT_MATVEC_B1",
    True,
    _flag,
    "1 or 0",
    "Single-sequence decode runs the one-column matrix-vector kernels (matvec_<type>_b1); 0 uses the any-batch ones.",
)
MATVEC_STAGED = Setting(
    "INGOT_MATVEC_STAGED",
    True,
    _flag,
    "1 or 0",
    "On Hopper (compute capability 9.0), decode's Q4_0/Q4_1/Q4_K/Q6_K matrix-vector products stage their"
    " activations in shared memory: one sequence as matvec_<type>_b1s (weights by bulk copies too, where each"
    " array's row is a multiple of 16 bytes), 2-4 sequences of models whose layers are not launch-bound as"
    " matvec_<type>_bxs; 0 keeps matvec_<type>_b1 and the any-batch kernel.",
)
MATVEC_MMA = Setting(
    "INGOT_MATVEC_MMA",
    True,
    _flag,
    "1 or 0",
    "Decode batches of 3-8 sequences of small models (layers under 64 MiB) run their Q4_0/Q4_1/Q4_K matrix-vector"
    " products on the integer tensor cores (matvec_<type>_mma, compute capability 8.0+); 0 uses the dp4a kernels.",
)
FUSED_NORM = Setting(
    "INGOT_FUSED_NORM",
    True,
    _flag,
    "1 or 0",
    "Single-sequence decode fuses each pre-norm into the residual projection before it (matvec_<type>_b1n);"
    " 0 launches rmsnorm_f32 instead.",
)
KV_FRACTION = Setting(
    "INGOT_KV_FRACTION",
    0.5,
    _fraction,
    "a fraction in (0, 1]",
    "The largest share of free GPU memory the GPU engine's KV cache takes.",
)
PREFIX_CACHE = Setting(
    "INGOT_PREFIX_CACHE",
    True,
    _flag,
    "1 or 0",
    "Engines reuse the KV pages of a prompt prefix seen before instead of recomputing it; 0 turns it off (benchmarks).",
)


# The prefill attention kernel: cuda/attention_prefill.cu's tensor-core one (default; compute capability >= 8.0,
# the scalar kernel below that) or attention.cu's scalar one. On the H200 (2026-12-01, cuda/PERF.md) it makes Gemma 3
# 270M's pp512 90.1k tok/s instead of 48.0k, with the same accuracy budget: the transformers oracle passes with it
# (57 of 57) and decode after a 500-token prefill is 1.11e-2 from fp32 (scalar 7.2e-3), while the fp16 roundings
# the design makes put the CPU reference itself 9.3e-3 from fp32 there (tests/gpu/test_gpu_engine.py's budget).
ATTN_PREFILL = Setting(
    "INGOT_ATTN_PREFILL",
    "mma",
    _one_of("mma", "scalar"),
    "mma or scalar",
    "The GPU engine's prefill attention: mma (tensor cores, compute capability >= 8.0) or scalar (any GPU).",
)


# The GEMM kernels (prefill, wide-batch decode): cuda/matmul.cu's pipelined mma.sync ones (default; compute
# capability >= 8.0, WMMA below that): Q4_0, Q4_1, Q4_K and Q6_K dequantized into the mma fragments (matmul2r_*, v17,
# v26) or, for the first three, from an sm_90a image, multiplied on wgmma (128-row tiles: matmul2w_*, v23; 32- and
# 64-row ones: matmul2t_*, v24), the
# other types through an fp16 tile (matmul2_*); mma-sync keeps matmul2r_* where the wgmma kernels would run (v22's
# kernels, the A/B switch); mma-tile runs matmul2_* for every type (v16's; the same bits as matmul2r_*); wmma the
# WMMA ones of v9 (matmul_*).
MATMUL = Setting(
    "INGOT_MATMUL",
    "mma",
    _one_of("mma", "mma-sync", "mma-tile", "wmma"),
    "mma, mma-sync, mma-tile or wmma",
    "The GPU engine's GEMMs: mma (pipelined tensor-core kernels, compute capability >= 8.0; Q4_0/Q4_1/Q4_K tiles of 32"
    " to 128 rows on Hopper's wgmma where the kernels are an sm_90a image, as the release policy builds them),"
    " mma-sync (the same without wgmma, v22's), mma-tile"
    " (mma.sync with every type through an fp16 tile, v16's) or wmma (v9's, any GPU).",
)
PDL = Setting(
    "INGOT_PDL",
    True,
    _flag,
    "1 or 0",
    "GPU kernels start while the previous one finishes (programmatic dependent launch, sm_90+); 0 turns it off.",
)
WEIGHT_PREFETCH = Setting(
    "INGOT_WEIGHT_PREFETCH",
    True,
    _flag,
    "1 or 0",
    "Matrix-vector kernels launched with PDL request their first weights into L2 while the previous kernel finishes;"
    " 0 turns it off.",
)
PDL_TRIGGER = Setting(
    "INGOT_PDL_TRIGGER",
    "auto",
    _one_of("auto", "early", "late", fold_case=True),
    "auto, early or late",
    "When a matrix-vector kernel lets the next kernel launch under PDL: at its start (early), after its main loop"
    " (late), or late for those reading at least 4 MiB of weights (auto).",
)
# Prefill passes beside the decode step (cuda/PERF.md v13): at SmolLM2's size both are bound by per-kernel
# latency, not by the GPU's width, so a prefill pass's layers on a second stream fill SMs the decode graph leaves idle.
PREFILL_STREAM = Setting(
    "INGOT_PREFILL_STREAM",
    True,
    _flag,
    "1 or 0",
    "The GPU engine runs prefill passes on a second stream, concurrent with the decode step; 0 queues them behind it.",
)
# The server's step loop launches step n+1 before it reads step n's tokens (runtime/server/scheduler.py): the host's
# work between two steps (the scheduler's books, the core's messages, the engine's step inputs) hides behind the GPU.
ASYNC_STEPS = Setting(
    "INGOT_ASYNC_STEPS",
    True,
    _flag,
    "1 or 0",
    "The server launches each step before it reads the previous step's tokens; 0 waits for each step first.",
)
# Prefill passes' GEMMs cut K too (cuda/PERF.md v14): at SmolLM2's size a 512-row pass's GEMMs fill ~1 block per SM
# and each block runs the whole K loop; slices chosen for a full pass (runtime/gpu/kernels.py matmul_geometry).
PREFILL_SPLIT_K = Setting(
    "INGOT_PREFILL_SPLIT_K",
    True,
    _flag,
    "1 or 0",
    "Prefill GEMMs that would leave the GPU half idle split K into slices (the same for every pass); 0: they do not.",
)
# How a decode GEMM's split-K slices are summed (cuda/matmul.cu, cuda/PERF.md v13): by the tile's S blocks as one
# thread-block cluster through distributed shared memory (sm_90+), or by the tile's last block from global memory.
# Both add in slice order: the same bits either way.
SPLIT_K = Setting(
    "INGOT_SPLIT_K",
    "cluster",
    _one_of("cluster", "ordered", fold_case=True),
    "cluster or ordered",
    "How split-K GEMM slices are summed: cluster (thread-block clusters, compute capability >= 9.0) or ordered"
    " (the tile's last block, any GPU).",
)
API_KEY = Setting(
    "INGOT_API_KEY",
    None,
    str,
    "a key string",
    "`ingot serve` requires this key (Authorization: Bearer KEY or x-api-key: KEY); same as --api-key.",
)
# 512: the GPU and CPU engines' own prefill pass (PREFILL_CHUNK in engines/), so a chunk costs one pass and no
# extra launches; on the H200 a 512-token pass of a small model takes a few ms, well inside the 50 ms a running
# stream may be delayed. Smaller chunks cut that delay further but add a pass (and a sampled token) per chunk.
PREFILL_CHUNK = Setting(
    "INGOT_PREFILL_CHUNK",
    512,
    _positive_int,
    "a positive integer",
    "`ingot serve`: prompt tokens prefilled per engine step, so a long prompt never stalls running streams for long.",
)


def _seconds(text: str) -> float:
    return float(text)


def _nonneg_seconds(text: str) -> float:
    x = float(text)
    if not 0 <= x < float("inf"):
        raise ValueError(text)
    return x


KEEP_ALIVE = Setting(
    "INGOT_KEEP_ALIVE",
    300.0,
    _seconds,
    "a number of seconds (negative: forever)",
    "`ingot serve` with several models: seconds a model stays loaded after its last request (Ollama's keep_alive).",
)
SHUTDOWN_GRACE = Setting(
    "INGOT_SHUTDOWN_GRACE",
    5.0,
    _nonneg_seconds,
    "a number of seconds (0 or more)",
    "`ingot serve`: seconds the requests still running at SIGINT/SIGTERM get to finish before they end with a 503.",
)
TEST_MODEL = Setting(
    "INGOT_TEST_MODEL",
    None,
    Path,
    "a GGUF path",
    "Tests only: the real SmolLM2 GGUF, when it is not in the model cache (the end-to-end CPU tests skip without it).",
)
TEST_GEMMA3 = Setting(
    "INGOT_TEST_GEMMA3",
    None,
    Path,
    "a GGUF path",
    "Tests only: the real Gemma 3 270M GGUF, when it is not in the model cache (its tests skip without it).",
)


def _paths(text: str) -> list[Path]:
    return [Path(p) for p in text.split(":") if p.strip()]


TRUSTED_KEYS = Setting(
    "INGOT_TRUSTED_KEYS",
    None,
    _paths,
    "a list of public key (.pub) paths separated by ':'",
    "Trust policy for `ingot run/serve/bench`: a bundle must be signed by one of these keys (like --pubkey).",
)
TEST_MODELS = Setting(
    "INGOT_TEST_MODELS",
    None,
    str,
    "a list of GGUF or bundle paths separated by ':'",
    "Tests only: extra real models the GPU engine tests run against (tests/gpu).",
)
TEST_ORACLE_LONG = Setting(
    "INGOT_TEST_ORACLE_LONG",
    False,
    _flag,
    "1 or 0",
    "Tests only: 1 runs the long transformers-oracle tests (tests/oracle: Gemma 3 270M perplexity, minutes on CPU).",
)

ALL: tuple[Setting, ...] = (
    CACHE_DIR,
    KERNELS,
    DEBUG,
    CPU_WEIGHT_CACHE_MIB,
    DECODE_GEMM_MIN_BATCH,
    DECODE_SPLITS,
    DECODE_ATTN,
    MATVEC_B1,
    MATVEC_STAGED,
    MATVEC_MMA,
    FUSED_NORM,
    KV_FRACTION,
    PREFIX_CACHE,
    ATTN_PREFILL,
    MATMUL,
    PDL,
    WEIGHT_PREFETCH,
    PDL_TRIGGER,
    API_KEY,
    PREFILL_CHUNK,
    KEEP_ALIVE,
    SHUTDOWN_GRACE,
    TEST_MODEL,
    TEST_GEMMA3,
    TRUSTED_KEYS,
    TEST_MODELS,
    TEST_ORACLE_LONG,
)


def in_force() -> dict[str, Any]:
    """Every setting's current value (API_KEY masked), for `ingot doctor --json`."""
    values = {s.name: s.get() for s in ALL}
    if values[API_KEY.name]:
        values[API_KEY.name] = "***"
    return {k: _plain(v) for k, v in values.items()}


def _plain(v: Any) -> Any:
    return str(v) if isinstance(v, Path) else [str(p) for p in v] if isinstance(v, list) else v
