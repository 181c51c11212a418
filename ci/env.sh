# Sourced by the README's two commands (ci/quickstart.sh, ci/test.sh): make sure an environment with Ingot
# installed from this checkout is active, creating and filling one when there is none.
#
#   - An active virtualenv ($VIRTUAL_ENV) is used as it is; otherwise ./.venv (created with python3 -m venv).
#   - Ingot is installed editable with the extras the commands need (INGOT_EXTRAS, default serve,test,dev);
#     `pip install` builds the CUDA kernels when nvcc is present. It is reinstalled only when what the
#     install depends on changed: pyproject.toml, CMakeLists.txt or cuda/ (a stamp in the environment).
# Needs Python >= 3.10 (python3 on PATH, or $PYTHON). Prints one line per step on stderr.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_py=${PYTHON:-python3}
if [ -z "${VIRTUAL_ENV:-}" ]; then
    if [ ! -x "$_root/.venv/bin/python" ]; then
        "$_py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
            || { echo "error: Python >= 3.10 is needed ($_py is $("$_py" --version 2>&1))" >&2; exit 2; }
        echo "== creating $_root/.venv" >&2
        "$_py" -m venv "$_root/.venv"
    fi
    . "$_root/.venv/bin/activate"
fi
_extras=${INGOT_EXTRAS:-serve,test,dev,release}
_stamp="$VIRTUAL_ENV/.ingot-install-stamp"
_want=$(cd "$_root" && cat pyproject.toml CMakeLists.txt cuda/* 2>/dev/null | python -c \
    'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')
_want="$_want $_root [$_extras]"
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_want" ] || ! python -c 'import ingot.toolchain.cli' 2>/dev/null; then
    echo "== installing ingot-llm[$_extras] from $_root into $VIRTUAL_ENV (builds the kernels for every GPU: 4-5 min on 2 cores)" >&2
    python -m pip install -q --upgrade pip
    python -m pip install -q -e "$_root[$_extras]"
    echo "$_want" > "$_stamp"
fi
unset _root _py _extras _stamp _want
