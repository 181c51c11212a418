"""Ingot's build toolchain: kernel builds, fatbin inspection, compatibility rules, bundles."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("ingot-llm")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+source"
