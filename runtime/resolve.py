"""The MODEL argument of `ingot run` / `perplexity` / `serve` / `bench`: a GGUF path, a bundle (*.ingot), or a
model name (`smollm2`, fetched into the cache when missing).

A bundle is verified on opening (ingot.runtime.bundle.open); its GGUF is mapped in place and its verified
fatbins come back beside the model, for the GPU engine to load (`open_engine(..., kernels=opened.kernels)`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.bundle.open import OpenBundle, open_bundle
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.model.fetch import MODELS, Progress, fetch
from ingot.runtime.model.gguf import Model, load_model
from ingot.runtime.settings import TRUSTED_KEYS


@dataclass(frozen=True)
class Opened:
    model: Model
    kernels: dict[str, bytes] | None = None  # a bundle's verified fatbins by module; None: the installed ones
    bundle: OpenBundle | None = None


def trusted_keys(pubkeys: Sequence[str | Path] = ()) -> list[Path]:
    """The run-time trust policy: --pubkey files plus INGOT_TRUSTED_KEYS; empty means no policy."""
    return [Path(p) for p in pubkeys] + list(TRUSTED_KEYS.get() or [])


def open_model(
    spec: str,
    *,
    allow_unverified: bool = False,
    progress: Progress | None = None,
    pubkeys: Sequence[str | Path] = (),
) -> Opened:
    """pubkeys: trusted public keys (with INGOT_TRUSTED_KEYS, the policy). With a policy, only a bundle signed
    by one of them runs (VerificationError otherwise, a bare GGUF included); without one, an unsigned bundle
    runs with a one-line notice on stderr."""
    keys = trusted_keys(pubkeys)
    path = Path(spec)
    if path.suffix != ".ingot" and keys and not allow_unverified:
        raise VerificationError(
            f"{spec} is not a signed bundle, but a trust policy is set (--pubkey or INGOT_TRUSTED_KEYS)",
            hint="run a bundle signed by a trusted key (`ingot pack`, `ingot sign`), or drop the policy",
        )
    if spec in MODELS and not path.exists():
        return Opened(load_model(fetch(spec, progress=progress)))
    if path.suffix == ".ingot":
        if not path.is_file():
            raise UsageError(f"bundle not found: {path}")
        bundle = open_bundle(path, allow_unverified=allow_unverified, pubkeys=keys)
        try:  # mapped from the verified descriptor, never by path again (the map outlives the descriptor)
            model = load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size, file=bundle.file)
        finally:
            bundle.close()
        if not keys and not bundle.signed and bundle.verified:
            print(
                f"note: {path} is unsigned: its digests match, but nothing says who made it "
                "(set --pubkey or INGOT_TRUSTED_KEYS to require a signature)",
                file=sys.stderr,
            )
        return Opened(model, kernels=bundle.fatbins, bundle=bundle)
    return Opened(load_model(path))
