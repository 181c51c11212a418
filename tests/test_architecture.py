"""The architecture's promises (README: Architecture), checked: the runtime works without the toolchain, the
shared CUDA constants header is generated from its one owner, every setting is documented, and the CLI's
command table resolves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

import ingot
from ingot.runtime import settings
from ingot.runtime.gpu import constants
from ingot.toolchain.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parent.parent


def test_the_runtime_imports_and_runs_without_the_toolchain(tmp_path):
    """Import every runtime module with the toolchain made unimportable: a target machine needs only the runtime."""
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "ingot.toolchain" or name.startswith("ingot.toolchain."):
            raise ImportError("the toolchain is blocked in this test")
sys.meta_path.insert(0, Block())
import ingot.runtime
skip = {"ingot.runtime.server.app", "ingot.runtime.server.server", "ingot.runtime.server.openai",
        "ingot.runtime.server.anthropic", "ingot.runtime.server.ollama", "ingot.runtime.server.metrics",
        "ingot.runtime.server.loadgen"}   # need the optional `serve` extra; imported below when present
for m in pkgutil.walk_packages(ingot.runtime.__path__, "ingot.runtime."):
    if m.name not in skip and not m.name.endswith("__main__"):
        importlib.import_module(m.name)
try:
    import starlette, uvicorn, sse_starlette, prometheus_client, httpx  # noqa: F401
except ImportError:
    pass
else:
    for name in skip:
        importlib.import_module(name)
assert not [m for m in sys.modules if m.startswith("ingot.toolchain")]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_cuda_constants_header_is_generated_from_python():
    """cuda/constants.cuh must be exactly what runtime/gpu/constants.py generates (regenerate with
    `python -m ingot.runtime.gpu.constants > cuda/constants.cuh`)."""
    assert (ROOT / "cuda" / "constants.cuh").read_text() == constants.header()


def test_no_kernel_source_redefines_a_shared_constant():
    """A .cu file that #defines a shared name again would shadow the generated value."""
    for source in sorted((ROOT / "cuda").glob("*.cu*")):
        if source.name == "constants.cuh":
            continue
        for line in source.read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "#define":
                assert words[1] not in constants.SHARED, f"{source.name} redefines {words[1]}"


def test_every_setting_is_an_ingot_variable_documented_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    names = [s.name for s in settings.ALL]
    assert len(set(names)) == len(names)
    for s in settings.ALL:
        assert s.name.startswith("INGOT_") and f"`{s.name}`" in readme, s.name


def test_no_ingot_variable_is_read_outside_settings():
    """Every INGOT_* variable goes through ingot.runtime.settings (tests and the CLI's envvar= are exempt)."""
    allowed = {ROOT / "runtime" / "settings.py"}
    for path in list((ROOT / "runtime").rglob("*.py")) + list((ROOT / "toolchain").rglob("*.py")):
        if path in allowed:
            continue
        text = path.read_text()
        assert 'environ.get("INGOT_' not in text and 'environ["INGOT_' not in text, path


def test_a_bad_setting_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("INGOT_KV_FRACTION", "2")
    try:
        settings.KV_FRACTION.get()
    except Exception as e:  # UsageError: exit 2 with the variable's name
        assert type(e).__name__ == "UsageError" and "INGOT_KV_FRACTION" in str(e)
    else:
        raise AssertionError("INGOT_KV_FRACTION=2 was accepted")


def test_every_command_in_the_table_resolves_and_help_lists_them():
    ctx = click.Context(cli)
    for name in COMMANDS:
        assert isinstance(cli.get_command(ctx, name), click.Command), name
    assert cli.list_commands(ctx) == list(COMMANDS)


def test_python_dash_m_ingot_and_version():
    out = subprocess.run([sys.executable, "-m", "ingot", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and ingot.__version__ in out.stdout
    assert ingot.__version__ != "0.0.0+source"  # installed: the distribution's version


def test_imports_inside_functions_only_defer_a_heavy_dependency():
    """README: no import inside a function except to defer a heavy optional dependency, with a comment (on
    the line, or in the docstring of the function holding it) saying so."""
    import ast

    offenders = []
    for path in sorted(list((ROOT / "runtime").rglob("*.py")) + list((ROOT / "toolchain").rglob("*.py"))):
        text = path.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = (ast.get_docstring(fn) or "").lower()
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    # the reason may stand on the import or on an earlier line of the same function
                    said = "\n".join(lines[fn.lineno - 1 : node.end_lineno]).lower()
                    if "deferred" not in said and "deferred" not in doc:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not offenders, "\n".join(offenders)
