"""Engines run a model: `cpu` (the numpy reference) or `cuda` (the GPU engine). `open_engine` picks one."""

from __future__ import annotations

from typing import Any

from ingot.runtime.engines.base import Engine
from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.errors import IncompatibleError, UsageError
from ingot.runtime.gpu import probe
from ingot.runtime.model.gguf import Model

DEVICES = ("auto", "cpu", "cuda")


def _cuda(model: Model, kernels: dict[str, bytes] | None, kw: dict[str, Any]) -> Engine:
    try:
        # deferred: cuda-bindings is heavy, and a CPU-only run must not pay for (or need) it
        from ingot.runtime.engines.cuda import CudaEngine
    except ImportError as e:
        raise IncompatibleError(f"the CUDA engine is not available ({e})", hint="use --device cpu") from None
    return CudaEngine(model, kernels=kernels, **kw)


def open_engine(model: Model, device: str = "auto", *, kernels: dict[str, bytes] | None = None, **kw: Any) -> Engine:
    """device "cpu" -> CpuEngine; "cuda" -> CudaEngine; "auto" -> cuda when a GPU is present and the CUDA engine
    loads, else cpu. kernels: the fatbins the GPU engine loads (a bundle's verified ones); None means the
    installed kernels (or $INGOT_KERNELS). Keyword arguments (max_seqs, max_ctx, ...) go to the engine."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", hint=f"use one of {', '.join(DEVICES)}")
    if device == "auto":
        if probe.probe().gpus:
            try:
                return _cuda(model, kernels, kw)
            except IncompatibleError:
                pass
        device = "cpu"
    if device == "cuda":
        return _cuda(model, kernels, kw)
    return CpuEngine(model, **kw)
