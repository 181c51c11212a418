"""The MODEL argument of `ingot run` / `perplexity` / `serve`: a GGUF path, a bundle (*.ingot), or a model name
(`smollm2`, fetched into the cache when missing). A bundle is verified on opening (toolchain/bundle.py); its
GGUF is mapped in place and its fatbins ride along as Model.kernels for the GPU engine."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ingot.toolchain.errors import IngotError, UsageError

from .fetch import MODELS, Progress, fetch
from .model import Model, load_model


def open_model(spec: str, *, allow_unverified: bool = False, progress: Progress | None = None) -> Model:
    path = Path(spec)
    if spec in MODELS and not path.exists():
        return load_model(fetch(spec, progress=progress))
    if path.suffix == ".ingot":
        if not path.is_file():
            raise UsageError(f"bundle not found: {path}")
        try:
            from ingot.toolchain.bundle import open_bundle
        except ImportError:
            raise IngotError("this installation cannot open bundles (ingot.toolchain.bundle is missing)",
                             hint="pass the model's .gguf instead") from None
        bundle = open_bundle(path, allow_unverified=allow_unverified)
        model = load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size)
        return dataclasses.replace(model, kernels=bundle.fatbins)   # the GPU engine runs the bundle's kernels
    return load_model(path)
