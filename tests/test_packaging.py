"""Installable releases: the lock covers pyproject's dependencies, the wheel's tag matches what it holds, the
LICENSE ships, `twine check` passes, and a fresh venv installs the wheel from the lock and runs `ingot doctor`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from bundle_fixtures import session_lock
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ingot.runtime.gpu.fatbin import parse_fatbin
from ingot.toolchain.nvcc import find_toolkit

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "ci" / "requirements.lock"
LOCKED_EXTRAS = ("serve", "release")  # ci/requirements.lock: base + these (its header has the command)


def _locked() -> dict[str, list[tuple[str, str, int]]]:
    """name -> [(version, marker, number of hashes)] from the lock (uv/pip-compile format)."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    entries = re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text())
    for entry in entries:
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\\n]+))?", entry)
        if m:
            name, version, marker = m.groups()
            out.setdefault(canonicalize_name(name), []).append(
                (version, (marker or "").strip(), entry.count("--hash=sha256:"))
            )
    return out


def test_the_lock_pins_every_dependency_of_pyproject_with_hashes():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        wanted += project["optional-dependencies"][extra]
    locked = _locked()
    assert len(locked) > 30
    assert all(hashes for pins in locked.values() for _, _, hashes in pins), "every pin needs --hash lines"
    assert f"--extra {' --extra '.join(LOCKED_EXTRAS)} --generate-hashes" in LOCK.read_text().splitlines()[1]
    for text in wanted:
        req = Requirement(text)
        pins = locked.get(canonicalize_name(req.name))
        assert pins, f"{req.name} is a dependency in pyproject.toml but not in {LOCK.name}"
        for version, _, _ in pins:
            assert req.specifier.contains(version, prereleases=True), f"{req.name}=={version} violates {req}"


# The archs of the kernels in the test wheel. Compiling cuda/*.cu for every arch of cuda/archs.json takes ~5 min on
# 2 cores and says nothing more about the wheel than one arch does; the full policy goes through the same CMake
# path in every `pip install` of the checkout (ci/env.sh), and tests/test_build.py checks the CMake fatbins are
# byte-identical to `ingot build`'s.
WHEEL_ARCHS = "sm_90"


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The wheel and sdist, built from this checkout with `python -m build` (what ci/release.sh runs, but with the
    kernels for WHEEL_ARCHS only); once per test session, shared by the xdist workers (a lock file in the session's
    temp root: bundle_fixtures.session_lock)."""
    archs = [f"--config-setting=cmake.define.INGOT_ARCH_LIST={WHEEL_ARCHS}"]
    with session_lock(tmp_path_factory, "ingot-dist") as base:
        out = base / "ingot-dist"
        if not (out / "built").exists():
            proc = subprocess.run(
                [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(ROOT), *archs],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            (out / "built").touch()
    return {"wheel": next(out.glob("ingot_llm-*.whl")), "sdist": next(out.glob("ingot_llm-*.tar.gz"))}


@pytest.mark.slow
def test_the_wheel_tag_matches_its_contents(dists):
    wheel = dists["wheel"]
    tag = wheel.name.removesuffix(".whl").split("-", 2)[2]
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_dir = next(n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL"))
        wheel_file = z.read(f"{meta_dir}/WHEEL").decode()
        metadata = z.read(f"{meta_dir}/METADATA").decode()
        license_text = z.read(f"{meta_dir}/licenses/LICENSE").decode()
    # No CPython extension inside (no .so/.pyd), so no interpreter/ABI tag; fatbins and the kernel sources
    # make it Linux x86_64-specific data, hence the platform tag.
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))]
    python_tag, abi_tag, platform_tag = tag.split("-")
    assert (python_tag, abi_tag) == ("py3", "none") and platform_tag.startswith("linux_x86_64")
    assert f"Tag: {tag}" in wheel_file and "Root-Is-Purelib: false" in wheel_file
    if find_toolkit() is not None:  # built with nvcc: the kernels are in, as data, for the archs asked for
        fatbins = {f"ingot/runtime/fatbins/{p.stem}.fatbin" for p in (ROOT / "cuda").glob("*.cu")}
        assert {"ingot/runtime/fatbins/matvec.fatbin", "ingot/runtime/fatbins/norm.fatbin"} <= set(names)
        assert fatbins == {n for n in names if n.endswith(".fatbin")}
        with zipfile.ZipFile(wheel) as z:
            for name in sorted(fatbins):
                fat = parse_fatbin(z.read(name), name=name)
                assert (fat.sass, fat.ptx) == ([WHEEL_ARCHS], []) and fat.kernels, name
    assert "ingot/toolchain/cuda/archs.json" in names
    assert "Apache License" in license_text and "Version 2.0" in license_text
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    for extra in ("serve", "release"):
        assert f"Provides-Extra: {extra}" in metadata
    assert re.search(r"Requires-Dist: httpx.*extra == .serve.", metadata)


@pytest.mark.slow
def test_twine_check_passes(dists):
    twine = pytest.importorskip("twine", reason="twine is in the release extra")
    assert twine
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists["wheel"]), str(dists["sdist"])],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import tarfile

    with tarfile.open(dists["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"LICENSE", "ci/requirements.lock", "cuda/archs.json", "pyproject.toml"} <= names


@pytest.mark.slow
@pytest.mark.packaging
def test_a_fresh_venv_installs_the_wheel_from_the_lock_and_runs_doctor(tmp_path, dists):
    """The release path: hash-checked dependencies from ci/requirements.lock, then the wheel without deps."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    for args in (
        ["-m", "pip", "install", "-q", "--require-hashes", "-r", str(LOCK)],
        ["-m", "pip", "install", "-q", "--no-deps", str(dists["wheel"])],
        ["-m", "pip", "check"],
    ):
        proc = subprocess.run([py, *args], capture_output=True, text=True, env=env, timeout=1200)
        assert proc.returncode == 0, f"{args}: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    ingot = env_dir / "bin" / "ingot"
    proc = subprocess.run([ingot, "doctor"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode in (0, 3), proc.stderr  # 3: no GPU or toolkit here, said plainly
    assert "nvcc" in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([ingot, "--version"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "ingot" in proc.stdout
