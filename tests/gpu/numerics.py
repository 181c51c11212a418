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
