"""The GPU tests' error measures, once: rel_err (the kernel tests and the engine tests) and the fp16 budget of the
GEMM paths (test_gpu_precision explains it; test_gpu_engine applies it to decode after a long prefill)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ingot.runtime.model import reference


def rel_err(out, ref) -> float:
    """Relative L2 error of a kernel's output against its numpy reference, in float64. A non-finite output fails
    at once (an unwritten element, an overflow, or a poisoned cache slot read) instead of giving a nan error."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element, overflow, or a poisoned slot was read)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


Q8X2_TOL = 1e-3  # what the q8x2 matvec paths reach against fp32 on the same models (test_gpu_engine prints it)


def fp16_budget(d16: float) -> float:
    """How far from fp32 a GEMM path may be: twice what fp16 operands alone cost (d16), plus the q8x2 budget."""
    return 2 * d16 + Q8X2_TOL


def within_fp16_budget(errs: dict) -> bool:
    return errs["gpu-fp32"] <= fp16_budget(errs["fp16emu-fp32"])


def fp16_run_failure(errs: list[float], d16s: list[float], floor: float = 0.0) -> str | None:
    """Why a run of GEMM-path results (rel errs against fp32, one per step and sequence) lost precision the
    design does not account for, or None. d16s: the fp16 emulation's distances to fp32 over the same samples.

    Per sample, the GPU's and the emulation's distances are two draws, not one quantity: both round the same
    fp32 values to fp16, but their fp32 arithmetic differs in order, so a value near a rounding boundary goes
    one way in one and the other way in the other, and a real model carries that difference on (Gemma 3: two
    emulations that differ only in fp32 vs float64 accumulation move d16 by 1.5e-3..3e-3). So the bound is on
    the run's distribution, which is what fp16 operands cost on this model and these prompts:
      every sample within the budget of the run's worst d16 (a broken sequence or step is far outside), and
      the mean within the budget of the mean d16 (a systematic loss, such as an fp16 accumulation, moves it).
    `floor`: a bound every path may use anyway (the fp32 comparison's tolerance)."""
    worst, mean_bound = max(floor, fp16_budget(max(d16s))), max(floor, fp16_budget(float(np.mean(d16s))))
    if max(errs) > worst:
        i = int(np.argmax(errs))
        return f"sample {i}: rel err {errs[i]:.2e} > {worst:.2e} (from the run's worst fp16 distance {max(d16s):.2e})"
    if float(np.mean(errs)) > mean_bound:
        return f"mean rel err {np.mean(errs):.2e} > {mean_bound:.2e} (from the mean fp16 distance {np.mean(d16s):.2e})"
    return None


@contextmanager
def fp16_operands():
    """The CPU reference with the GPU GEMM path's roundings: matmul operands fp16, KV cache fp16."""
    rounded: dict[int, np.ndarray] = {}
    plain_linear, plain_empty = reference.linear, reference.KVCache.empty

    def linear(x, w):
        if id(w) not in rounded:
            rounded[id(w)] = w.astype(np.float16).astype(np.float32)
        return plain_linear(x.astype(np.float16).astype(np.float32), rounded[id(w)])

    def empty(c, capacity):
        shape = (c.n_layers, capacity, c.n_kv_heads, c.head_dim)
        return reference.KVCache(np.zeros(shape, np.float16), np.zeros(shape, np.float16))

    reference.linear, reference.KVCache.empty = linear, empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        reference.linear, reference.KVCache.empty = plain_linear, plain_empty  # type: ignore[method-assign]
