"""Ingot: ahead-of-time built, verifiable LLM inference bundles for NVIDIA GPUs.

    ingot.runtime     what a target machine needs to verify and run a bundle (README: Architecture)
    ingot.toolchain   build, pack, sign, rebuild, doctor and the `ingot` CLI; built on the runtime

This module imports nothing of either, so `import ingot.runtime` never loads the toolchain.
"""

from __future__ import annotations

import os

# In a source checkout the subpackages sit beside this folder (runtime/, toolchain/), which the wheel maps to
# ingot/runtime and ingot/toolchain (pyproject.toml, wheel.packages). Looking for subpackages in the checkout
# too lets it run uninstalled (`PYTHONPATH=. python -m ingot`, the GPU machine's tests/gpu/device_env.sh);
# an installed wheel has no pyproject.toml beside its folder and is left alone.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_checkout, "pyproject.toml")) and os.path.isdir(os.path.join(_checkout, "runtime")):
    __path__.append(_checkout)


def __getattr__(name: str) -> str:
    # Looked up on first use, not at import: importlib.metadata costs ~40 ms, which `ingot run`'s cold start
    # would pay on every launch.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version  # deferred: see above

        try:
            return version("ingot-llm")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0.0.0+source"
    raise AttributeError(name)
