"""Ingot's build toolchain: kernel builds, fatbin inspection, compatibility rules, bundles."""


def __getattr__(name: str):
    # Looked up on first use, not at import: importlib.metadata costs ~40 ms, which `ingot run`'s cold start
    # would pay on every launch.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("ingot-llm")
        except PackageNotFoundError:  # a source tree that was never installed
            return "0.0.0+source"
    raise AttributeError(name)
