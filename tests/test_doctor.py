"""`ingot doctor`: the toolchain it finds, the machine it probes, and its verdict on installed kernels.
This CI machine has nvcc but no driver or GPU; a GPU machine is simulated by replacing the probe."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_sources import nvcc_fatbin, require_nvcc, write_sources

from ingot.runtime.gpu.probe import Gpu, Machine, probe
from ingot.toolchain import doctor, nvcc


@pytest.fixture
def real_nvcc():
    """The nvcc found normally; the test then searches afresh under its own environment."""
    tk = require_nvcc()
    nvcc.find_toolkit.cache_clear()
    yield tk
    nvcc.find_toolkit.cache_clear()


def test_machine_without_driver_is_a_report_not_a_crash(tmp_path):
    machine = probe()
    if machine.gpus:
        pytest.skip("this machine has a GPU")
    r = doctor.report(kernel_dir=tmp_path)
    assert r["machine"]["driver_version"] is None and r["machine"]["gpus"] == []
    assert "driver" in r["machine"]["problem"] and "\n" not in r["machine"]["problem"]
    assert r["ready"]["gpu"] is False
    assert any(a.startswith("cannot run on a GPU here") for a in r["advice"])
    assert any(a.startswith("no installed kernels") for a in r["advice"])


def test_reports_the_toolchain_as_the_tools_themselves_say(tmp_path):
    tk = require_nvcc()
    r = doctor.report(kernel_dir=tmp_path)
    text = subprocess.run([r["toolkit"]["nvcc"], "--version"], capture_output=True, text=True).stdout
    assert re.search(rf"release {re.escape(r['toolkit']['version'])}, {re.escape(r['toolkit']['build'])}", text)
    assert r["ready"]["build"] is True and tk.targets and "sm_90" in r["toolkit"]["targets"]
    cmake = shutil.which("cmake")
    if cmake:
        line = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        assert r["cmake"] and r["cmake"] in line
    hc = r["host_compiler"]
    assert hc["path"] and hc["version"] and shutil.which(hc["path"])


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> Path:
    require_nvcc()
    d = tmp_path_factory.mktemp("kernels")
    src = write_sources(tmp_path_factory.mktemp("src"))
    nvcc_fatbin(src, d / "ampere.fatbin", "-gencode=arch=compute_80,code=sm_80")
    nvcc_fatbin(src, d / "hopper.fatbin", "-gencode=arch=compute_90,code=sm_90")
    return d


def _fake_gpu_machine(monkeypatch, cc: int = 80):
    machine = Machine("580.65.06", 13000, (Gpu(0, "Simulated GPU", cc, 80 << 30, 70 << 30),), None, "nvml")
    monkeypatch.setattr(doctor, "probe", lambda: machine)


def test_says_how_each_kernel_runs_on_each_gpu_and_what_to_do(kernels, tmp_path, monkeypatch):
    _fake_gpu_machine(monkeypatch, cc=86)
    kdir = tmp_path / "k"
    shutil.copytree(kernels, kdir)
    (kdir / "broken.fatbin").write_bytes(b"not a fatbin")
    r = doctor.report(kernel_dir=kdir)
    by_name = {k["module"]: k for k in r["kernels"]}
    assert by_name["ampere.fatbin"]["sass"] == ["sm_80"]
    assert [(g["verdict"], g["image"]) for g in by_name["ampere.fatbin"]["on_gpus"]] == [("native", "sm_80")]
    hopper = by_name["hopper.fatbin"]["on_gpus"][0]
    assert hopper["verdict"] == "incompatible" and "sm_86" in hopper["fix"]
    assert by_name["broken.fatbin"]["problem"]
    assert any(a.startswith("hopper.fatbin cannot run on GPU 0") for a in r["advice"])
    assert any(a.startswith("broken.fatbin is unreadable") for a in r["advice"])
    assert r["ready"]["gpu"] is False


def test_ready_when_every_kernel_runs(kernels, tmp_path, monkeypatch):
    _fake_gpu_machine(monkeypatch, cc=80)
    (tmp_path / "k").mkdir()
    shutil.copy(kernels / "ampere.fatbin", tmp_path / "k")
    r = doctor.report(kernel_dir=tmp_path / "k")
    assert r["ready"]["gpu"] is True and r["advice"] == []


def test_no_nvcc_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "find_toolkit", lambda: None)
    r = doctor.report(kernel_dir=tmp_path)
    assert r["toolkit"] is None and r["ready"]["build"] is False
    assert any(a.startswith("no nvcc") for a in r["advice"])


# --- where nvcc is found ------------------------------------------------------------------------------


def _path_without_nvcc() -> str:
    return os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvcc").exists())


def test_nvcc_from_cudacxx_then_path(real_nvcc, monkeypatch):
    real = real_nvcc.nvcc
    monkeypatch.setenv("CUDACXX", str(real))
    assert nvcc.find_toolkit().found_via == "CUDACXX"
    nvcc.find_toolkit.cache_clear()
    monkeypatch.delenv("CUDACXX")
    monkeypatch.setenv("PATH", f"{real.parent}{os.pathsep}{_path_without_nvcc()}")
    assert nvcc.find_toolkit().found_via == "PATH"


def test_nvcc_from_cuda_home(real_nvcc, monkeypatch):
    real = real_nvcc.nvcc.resolve()
    home = real.parent.parent
    if not (home / "bin" / "nvcc").is_file():
        pytest.skip("nvcc is not inside a toolkit folder")
    monkeypatch.delenv("CUDACXX", raising=False)
    monkeypatch.setenv("PATH", _path_without_nvcc())
    monkeypatch.setenv("CUDA_HOME", str(home))
    assert nvcc.find_toolkit().found_via == "CUDA_HOME"


def test_nvcc_from_the_pip_wheel_layout(real_nvcc, monkeypatch, tmp_path):
    """nvidia-cuda-nvcc 13.x installs site-packages/nvidia/cu13/bin/nvcc (here: a script that runs the real one)."""
    real = real_nvcc.nvcc
    fake = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvcc"
    fake.parent.mkdir(parents=True)
    fake.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    fake.chmod(0o755)
    for var in ("CUDACXX", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", _path_without_nvcc())
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    tk = nvcc.find_toolkit()
    assert (tk.found_via, tk.nvcc) == ("nvidia-cuda-nvcc wheel", fake)
    assert tk.version == real_nvcc.version
