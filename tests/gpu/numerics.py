"""The kernel tests' error measure, once (test_gpu_kernels, test_gpu_arch_kernels, test_gpu_attention_prefill)."""

from __future__ import annotations

import numpy as np


def rel_err(out, ref) -> float:
    """Relative L2 error of a kernel's output against its numpy reference, in float64. A non-finite output fails
    at once (an unwritten element, an overflow, or a poisoned cache slot read) instead of giving a nan error."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite output (unwritten element, overflow, or a poisoned slot was read)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
