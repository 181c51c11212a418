"""Engines run a model: `cpu` (the numpy reference) or `cuda` (the GPU engine). `open_engine` picks one."""
from __future__ import annotations

from ingot.toolchain.errors import IncompatibleError, UsageError

from ..model import Model
from .base import Engine

DEVICES = ("auto", "cpu", "cuda")


def _cuda_engine_class():
    try:
        from .cuda import CudaEngine
    except ImportError as e:
        raise IncompatibleError(f"the CUDA engine is not available ({e})", hint="use --device cpu") from None
    return CudaEngine


def _cuda(model: Model, kw: dict) -> Engine:
    if model.kernels is not None:
        kw = {"kernels": model.kernels} | kw
    return _cuda_engine_class()(model, **kw)


def open_engine(model: Model, device: str = "auto", **kw) -> Engine:
    """device "cpu" -> CpuEngine; "cuda" -> CudaEngine; "auto" -> cuda when a GPU is present and the CUDA engine
    imports, else cpu. Keyword arguments (max_seqs, max_ctx, ...) go to the engine; a bundle's kernels
    (model.kernels) go to the CUDA engine."""
    if device not in DEVICES:
        raise UsageError(f"unknown device {device!r}", hint=f"use one of {', '.join(DEVICES)}")
    if device == "auto":
        from ingot.toolchain.probe import probe

        if probe().gpus:
            try:
                return _cuda(model, kw)
            except IncompatibleError:
                pass
        device = "cpu"
    if device == "cuda":
        return _cuda(model, kw)
    from .cpu import CpuEngine

    return CpuEngine(model, **kw)
