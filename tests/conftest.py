"""Shared test configuration. Fixtures live in plugin modules next to this file, one per area."""

# --- bundles: pack, verify, sign, rebuild (tests/bundle_fixtures.py); model runtime (tests/model_fixtures.py) ---
pytest_plugins = ["bundle_fixtures", "model_fixtures"]
