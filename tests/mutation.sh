#!/usr/bin/env bash
# Mutation testing with mutmut 3 (pip install mutmut) of the modules where a silent bug does the most harm.
#
#   bash tests/mutation.sh                          # every module below, one after the other
#   bash tests/mutation.sh runtime.bundle.manifest ...   # just these
#   MUTMUT_CHILDREN=4 bash tests/mutation.sh        # parallel workers (default: the CPU count)
#
# mutmut runs in .mutation/ (git-ignored): a copy of the checkout laid out as the installed package
# (ingot/toolchain, ingot/runtime), so mutmut's module names are the import names; tests/conftest.py then imports
# the mutated copies (tests/mutation_imports.py). Results are kept there between runs: a run only re-tests mutants
# whose function or tests changed. Each module's tests are the ones that call it, out of the in-process test files
# listed in pyproject.toml's [tool.mutmut]. Prints killed/survived per module; `cd .mutation && mutmut show NAME`
# shows a mutant's diff. Surviving mutants are killed with a test or listed as equivalent in tests/MUTATION.md.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage="$root/.mutation"
modules=("$@")
[ ${#modules[@]} -gt 0 ] || modules=(runtime.bundle.manifest runtime.gpu.compat runtime.sampling runtime.generate
                                     runtime.bundle.signature runtime.model.quants runtime.server.request)
command -v mutmut >/dev/null || { echo "mutmut is not installed: pip install mutmut" >&2; exit 2; }

mkdir -p "$stage/ingot"
copy() {   # copy a folder, keeping the mtimes of unchanged files (mutmut re-tests what changed)
    python3 -c 'import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.fatbin"))' "$1" "$2"
}
cp -p "$root/ingot/__init__.py" "$root/ingot/__main__.py" "$stage/ingot/"
copy "$root/toolchain" "$stage/ingot/toolchain"
copy "$root/runtime" "$stage/ingot/runtime"
copy "$root/cuda" "$stage/ingot/cuda"
copy "$root/tests" "$stage/tests"
cp -p "$root/CMakeLists.txt" "$stage/ingot/CMakeLists.txt"
cp -p "$root/pyproject.toml" "$stage/pyproject.toml"
export INGOT_CACHE_DIR="${INGOT_CACHE_DIR:-$stage/cache}"

cd "$stage"
for m in "${modules[@]}"; do
    echo "== mutmut: ingot.$m" >&2
    mutmut run --max-children "${MUTMUT_CHILDREN:-$(nproc)}" "ingot.$m.*" >/dev/null || true
done
python3 - "${modules[@]}" <<'PY'
import json, pathlib, sys
from collections import Counter

from mutmut.stats import status_by_exit_code
# mutmut keeps each file's results in mutants/<path>.meta: the exit code of its test run, per mutant
for m in sys.argv[1:]:
    meta = pathlib.Path("mutants", "ingot", *m.split(".")).with_suffix(".py.meta")
    if not meta.is_file():
        print(f"ingot.{m}: no results")
        continue
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    c = Counter(status_by_exit_code[v] for v in codes.values())
    killed = c["killed"] + c["timeout"] + c["segfault"]
    print(f"ingot.{m}: {len(codes)} mutants, killed {killed} ({100 * killed / max(len(codes), 1):.1f}%); "
          + ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if k not in ("killed", "timeout", "segfault")))
PY
