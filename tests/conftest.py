"""Shared test configuration. Fixtures live in plugin modules next to this file, one per area."""

from pathlib import Path

if Path(__file__).resolve().parent.parent.name == "mutants":  # under mutmut: test the mutated copies
    from mutation_imports import install

    install(Path(__file__).resolve().parent.parent)

# --- bundles: pack, verify, sign, rebuild (tests/bundle_fixtures.py); model runtime (tests/model_fixtures.py) ---
pytest_plugins = ["bundle_fixtures", "model_fixtures"]
