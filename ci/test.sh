#!/usr/bin/env bash
# The README's test command: everything CI checks, on a machine with or without a GPU.
#   1. the layering (import-linter contracts in pyproject.toml), 2. ruff lint and format, 3. mypy,
#   4. pytest (GPU tests skip cleanly without a GPU), with pytest-xdist across the CPUs.
# Arguments go to pytest (e.g. `bash ci/test.sh tests/test_verify.py -x`); with arguments the static
# checks are skipped. Creates and fills ./.venv first when no environment is active (ci/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/env.sh

# The real default model, for the end-to-end tests (cached; they skip without it).
ingot model fetch smollm2 >/dev/null
# The real Gemma 3 270M (253 MB: K-quants, gemma3, SentencePiece); its tests skip when it could not be fetched.
ingot model fetch gemma3-270m >/dev/null || echo "warning: gemma3-270m not fetched; its tests will skip" >&2

if [ $# -gt 0 ]; then
    exec python -m pytest "$@"
fi
echo "== import layering (lint-imports)" >&2
lint-imports --no-cache >/dev/null || lint-imports --no-cache
echo "== ruff check, ruff format --check" >&2
ruff check --quiet .
ruff format --check --quiet .
echo "== mypy" >&2
bash ci/typecheck.sh
echo "== pytest" >&2
python -m pytest -q -n "${PYTEST_WORKERS:-auto}"
