"""The MODEL argument of `ingot run` / `perplexity` / `serve` / `bench`: a GGUF path, a bundle (*.ingot), or a
model name (`smollm2`, fetched into the cache when missing).

A bundle is verified on opening (ingot.runtime.bundle.open); its GGUF is mapped in place and its verified
fatbins come back beside the model, for the GPU engine to load (`open_engine(..., kernels=opened.kernels)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.bundle.open import OpenBundle, open_bundle
from ingot.runtime.errors import UsageError
from ingot.runtime.model.fetch import MODELS, Progress, fetch
from ingot.runtime.model.gguf import Model, load_model


@dataclass(frozen=True)
class Opened:
    model: Model
    kernels: dict[str, bytes] | None = None  # a bundle's verified fatbins by module; None: the installed ones
    bundle: OpenBundle | None = None


def open_model(spec: str, *, allow_unverified: bool = False, progress: Progress | None = None) -> Opened:
    path = Path(spec)
    if spec in MODELS and not path.exists():
        return Opened(load_model(fetch(spec, progress=progress)))
    if path.suffix == ".ingot":
        if not path.is_file():
            raise UsageError(f"bundle not found: {path}")
        bundle = open_bundle(path, allow_unverified=allow_unverified)
        model = load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size)
        return Opened(model, kernels=bundle.fatbins, bundle=bundle)
    return Opened(load_model(path))
