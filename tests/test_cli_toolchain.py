"""The `ingot build / inspect / doctor / check-compat` commands: output, JSON and exit codes
(0 ok, 2 usage error, 3 incompatible or no GPU/driver, 6 build failed), one-line errors, no tracebacks."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_sources import PLAIN_KERNELS, nvcc_fatbin, require_nvcc, write_sources

from ingot.runtime.gpu.probe import probe
from ingot.toolchain import build as build_mod
from ingot.toolchain.cli import main


def ingot(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["ingot", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def ampere(tmp_path_factory) -> Path:
    """A fatbin with SASS sm_80 only, built by this nvcc (13.x)."""
    src = write_sources(tmp_path_factory.mktemp("src"))
    nvcc_fatbin(src, src.parent / "ampere.fatbin", "-gencode=arch=compute_80,code=sm_80")
    return src.parent / "ampere.fatbin"


# --- check-compat ---------------------------------------------------------------------------------------


def test_check_compat_runs_exit_0(ampere, monkeypatch, capsys):
    code, out, _ = ingot(
        monkeypatch, capsys, "check-compat", ampere, "--gpu", "sm_86", "--driver", "580.65.06", "--json"
    )
    result = json.loads(out)
    assert code == 0 and result["ok"] is True
    assert [(d["gpu"], d["verdict"], d["image"]) for d in result["decisions"]] == [("sm_86", "native", "sm_80")]


def test_check_compat_incompatible_exit_3(ampere, monkeypatch, capsys):
    code, out, _ = ingot(
        monkeypatch, capsys, "check-compat", ampere.parent, "--gpu", "sm_80,sm_90", "--driver", "13.0", "--json"
    )
    verdicts = {d["gpu"]: d["verdict"] for d in json.loads(out)["decisions"] if d["module"] == "ampere.fatbin"}
    assert code == 3 and verdicts == {"sm_80": "native", "sm_90": "incompatible"}


def test_check_compat_hypothetical_old_driver(ampere, monkeypatch, capsys):
    """SASS from nvcc 13.x on an R535 driver: minor-version compatibility stops at 13.x's 580 floor."""
    code, out, _ = ingot(monkeypatch, capsys, "check-compat", ampere, "--gpu", "sm_80", "--driver", "535.104.05")
    assert code == 3
    assert "incompatible" in out and "580.65.06" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--gpu", "sm_9", "--driver", "13.0"],
        ["--gpu", "sm_90a", "--driver", "13.0"],
        ["--gpu", "sm_90", "--driver", "banana"],
    ],
)
def test_check_compat_usage_errors_exit_2(args, ampere, monkeypatch, capsys):
    code, _, err = ingot(monkeypatch, capsys, "check-compat", ampere, *args)
    assert code == 2
    one_line(err)


def test_check_compat_missing_input_exit_2(tmp_path, monkeypatch, capsys):
    code, _, err = ingot(
        monkeypatch, capsys, "check-compat", tmp_path / "nope.fatbin", "--gpu", "sm_80", "--driver", "13.0"
    )
    assert code == 2 and "no such file" in one_line(err)
    code, _, err = ingot(monkeypatch, capsys, "check-compat", tmp_path, "--gpu", "sm_80", "--driver", "13.0")
    assert code == 2 and "no .fatbin files" in one_line(err)


def test_check_compat_without_gpu_or_driver_here_exit_3(ampere, monkeypatch, capsys):
    if probe().gpus:
        pytest.skip("this machine has a GPU")
    code, _, err = ingot(monkeypatch, capsys, "check-compat", ampere)
    assert code == 3 and "--driver" in one_line(err)
    code, _, err = ingot(monkeypatch, capsys, "check-compat", ampere, "--driver", "13.0")
    assert code == 3 and "--gpu" in one_line(err)


# --- build ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["native", "sm_80,native", "all"])
def test_build_refuses_native(arch, tmp_path, monkeypatch, capsys):
    code, _, err = ingot(monkeypatch, capsys, "build", "--arch", arch, "--out", tmp_path)
    assert code == 2 and "--arch" in one_line(err)
    assert not tmp_path.joinpath("build.json").exists()


def test_build_refuses_an_arch_nvcc_lacks(tmp_path, monkeypatch, capsys):
    require_nvcc()
    code, _, err = ingot(monkeypatch, capsys, "build", "--arch", "sm_70", "--out", tmp_path)
    assert code == 2 and "sm_70" in one_line(err)


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch) -> Path:
    """`ingot build` on the tiny kernel instead of cuda/*.cu (the real ones are built in test_build.py)."""
    require_nvcc()
    src = write_sources(tmp_path / "cuda")
    monkeypatch.setattr(build_mod, "kernel_source_dir", lambda: src.parent)
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    return src


def test_build_table(tiny_sources, tmp_path, monkeypatch, capsys):
    code, out, _ = ingot(monkeypatch, capsys, "build", "--arch", "sm_80,sm_90a,compute_90", "--out", tmp_path / "d")
    assert code == 0
    rows = {ln.split("│")[2].strip(): ln for ln in out.splitlines() if ln.count("│") >= 5}
    assert {"sm_80", "sm_90a", "compute_90", "total"} <= set(rows)
    assert all(any(ch.isdigit() for ch in rows[a].split("│")[4]) for a in ("sm_80", "sm_90a", "compute_90"))
    assert str(tmp_path / "d" / "k.fatbin") in out


def test_build_json(tiny_sources, tmp_path, monkeypatch, capsys):
    code, out, _ = ingot(
        monkeypatch, capsys, "build", "--json", "--jobs", "1", "--arch", "sm_80,compute_80", "--out", tmp_path / "d"
    )
    assert code == 0
    fatbin = json.loads(out)["fatbins"][0]
    assert Path(fatbin["path"]) == tmp_path / "d" / "k.fatbin"
    assert fatbin["archs"] == {"sass": ["sm_80"], "ptx": ["compute_80"]}
    assert set(fatbin["kernels"]) >= PLAIN_KERNELS
    assert fatbin["sha256"] == hashlib.sha256(Path(fatbin["path"]).read_bytes()).hexdigest()


def test_build_failure_exit_6(tiny_sources, tmp_path, monkeypatch, capsys):
    tiny_sources.write_text("__global__ void k() { this is not C++; }\n")
    code, _, err = ingot(monkeypatch, capsys, "build", "--arch", "sm_80", "--out", tmp_path / "d")
    assert code == 6 and "nvcc failed on k.cu" in one_line(err)


# --- inspect ----------------------------------------------------------------------------------------------


def test_inspect_json(ampere, monkeypatch, capsys):
    code, out, _ = ingot(monkeypatch, capsys, "inspect", ampere, "--json")
    entries = json.loads(out)["entries"]
    assert code == 0 and [(e["kind"], e["arch"]) for e in entries] == [("sass", "sm_80")]
    assert set(entries[0]["kernels"]) >= PLAIN_KERNELS


def test_inspect_table(ampere, monkeypatch, capsys):
    code, out, _ = ingot(monkeypatch, capsys, "inspect", ampere)
    assert code == 0 and "SASS" in out and "sm_80" in out and "add_k" in out


def test_inspect_non_fatbin_exit_2(tmp_path, monkeypatch, capsys):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\0" * 64)
    code, _, err = ingot(monkeypatch, capsys, "inspect", bogus)
    assert code == 2 and "not a CUDA fatbin" in one_line(err)


def test_console_script_gives_one_line_and_no_traceback(tmp_path):
    script = Path(sys.executable).with_name("ingot")
    if not script.exists():
        pytest.skip("the ingot console script is not installed next to this Python")
    bogus = tmp_path / "x.fatbin"
    bogus.write_text("hello")
    run = subprocess.run([script, "inspect", bogus], capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert "not a CUDA fatbin" in one_line(run.stderr)


# --- doctor -----------------------------------------------------------------------------------------------


def test_doctor_json_without_driver_exit_0(monkeypatch, capsys):
    if probe().gpus:
        pytest.skip("this machine has a GPU")
    code, out, _ = ingot(monkeypatch, capsys, "doctor", "--json")
    r = json.loads(out)
    assert code == 0
    assert r["machine"]["driver_version"] is None and r["machine"]["gpus"] == [] and r["machine"]["problem"]
    assert r["ready"]["gpu"] is False


def test_doctor_text(monkeypatch, capsys):
    code, out, _ = ingot(monkeypatch, capsys, "doctor")
    assert code == 0 and "nvcc" in out and "driver" in out and "Installed kernels" in out
