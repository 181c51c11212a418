#!/usr/bin/env bash
# mypy over the `ingot` package. The checkout maps ingot/, runtime/ and toolchain/ onto one namespace at
# install time, which mypy cannot follow through the editable install's import hook, so it checks a tree of
# symlinks laid out as the wheel is (build/typecheck/ingot/...).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=build/typecheck
rm -rf "$tree" && mkdir -p "$tree/ingot"
for f in __init__.py __main__.py; do ln -s "$PWD/ingot/$f" "$tree/ingot/$f"; done
ln -s "$PWD/runtime" "$tree/ingot/runtime"
ln -s "$PWD/toolchain" "$tree/ingot/toolchain"
cd "$tree" && mypy --config-file ../../pyproject.toml -p ingot
