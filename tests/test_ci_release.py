"""ci/release.sh end to end on a tiny synthetic Llama: build, pack, verify, check-compat, sign, verify, sbom,
rebuild. The wheel/sdist build and the install from ci/requirements.lock (WHEEL=1, INSTALL=1) are what
tests/test_packaging.py runs; here WHEEL=0 reuses this venv's ingot."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bundle_fixtures import TEST_ARCHS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "ci" / "release.sh"


INGOT = Path(sys.executable).parent / "ingot"


@pytest.fixture
def synth_model(tmp_path) -> Path:
    """The model a user would try the pipeline with: `ingot model synth --shape tiny`."""
    out = tmp_path / "tiny-llama.gguf"
    proc = subprocess.run(
        [INGOT, "model", "synth", "--shape", "tiny", "--quant", "Q8_0", "--out", out], capture_output=True, text=True
    )
    if proc.returncode == 2 and "No such command" in proc.stderr:
        pytest.skip("`ingot model synth` is not in this checkout")
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def release_env(tmp_path, kernel_dir, synth_model, keys):
    """Environment for ci/release.sh: this venv's ingot on PATH, a private cache that reuses the kernel cache."""
    from ingot.toolchain.build import cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    if cache_dir().is_dir():
        (cache / "kernels").symlink_to(cache_dir())  # compiled once this session already
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SOURCE_DATE_EPOCH", "PUBKEY", "PACK_FLAGS", "WHEEL", "INSTALL", "INGOT")
    }
    env.update(
        PATH=f"{INGOT.parent}{os.pathsep}{env.get('PATH', '')}",
        INGOT_CACHE_DIR=str(cache),
        MODELS=str(synth_model),
        KEY=keys["a"]["key"],
        OUT=str(tmp_path / "release"),
        ARCHS=TEST_ARCHS,
        TARGETS="sm_90:580.65.06 sm_100:580.65.06",
        WHEEL="0",
    )
    return env


def _run(env, cwd):
    return subprocess.run(["bash", str(SCRIPT)], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_release_script_produces_signed_verified_reproducible_bundles(tmp_path, release_env, keys):
    from ingot.runtime.engines.cpu import CpuEngine  # noqa: F401  (the pack-time self-test needs the CPU engine)

    proc = _run(release_env, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "release"
    bundle = out / "tiny-llama.ingot"
    for step in (
        "== build",
        "== pack",
        "== verify",
        "== check-compat",
        "== sign",
        "== verify the signature",
        "== sbom",
        "== rebuild --check",
    ):
        assert step in proc.stderr
    bom = out / "tiny-llama.cdx.json"
    assert json.loads(bom.read_text())["specVersion"] == "1.6"
    sums = (out / "SHA256SUMS").read_text().split()
    assert sums == [
        hashlib.sha256(bundle.read_bytes()).hexdigest(),
        "tiny-llama.ingot",
        hashlib.sha256(bom.read_bytes()).hexdigest(),
        "tiny-llama.cdx.json",
    ]
    check = subprocess.run(
        [INGOT, "verify", bundle, "--pubkey", keys["a"]["pub"]], env=release_env, capture_output=True, text=True
    )
    assert check.returncode == 0 and "valid, by --pubkey" in check.stdout


def test_release_stops_when_a_target_cannot_run_the_kernels(tmp_path, release_env):
    proc = _run(release_env | {"TARGETS": "sm_90:580.65.06 sm_80:580.65.06", "PACK_FLAGS": "--no-selftest"}, tmp_path)
    assert proc.returncode == 3
    assert "check-compat" in proc.stderr and "sm_80" in proc.stdout + proc.stderr
    assert "== sign" not in proc.stderr


def test_release_refuses_missing_inputs(tmp_path, release_env):
    proc = _run(release_env | {"KEY": str(tmp_path / "nokey.key")}, tmp_path)
    assert proc.returncode == 2 and "not found" in proc.stderr
    env = {k: v for k, v in release_env.items() if k != "MODELS"}
    proc = _run(env, tmp_path)
    assert proc.returncode != 0 and "set MODELS" in proc.stderr
