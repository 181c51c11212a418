"""`ingot rebuild --check`: the bundle's fatbins are rebuilt here, compared byte for byte, differences explained."""

from __future__ import annotations

import json
import shutil

from bundle_fixtures import run_cli

from ingot.runtime.bundle.manifest import sha256_hex


def _kernels_subset(src, dst, keep):
    """A copy of a kernel build with only some modules (rebuilding all of them costs seconds each)."""
    shutil.copytree(src, dst)
    record = json.loads((dst / "build.json").read_text())
    record["fatbins"] = [b for b in record["fatbins"] if b["name"] in keep]
    return record


def test_an_honest_bundle_rebuilds_byte_identical(monkeypatch, capsys, tmp_path, kernel_dir, toy_model):
    from ingot.toolchain.pack import pack

    record = _kernels_subset(kernel_dir, tmp_path / "k", {"norm", "rope"})
    (tmp_path / "k/build.json").write_text(json.dumps(record))
    bundle = tmp_path / "b.ingot"
    pack(toy_model, kernels=tmp_path / "k", out=bundle, selftest=False)
    code, out, err = run_cli(monkeypatch, capsys, "rebuild", "--check", bundle, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["identical"] and [m["module"] for m in report["modules"]] == ["norm", "rope"]
    assert all(m["rebuilt_sha256"] == m["recorded_sha256"] for m in report["modules"])


def test_a_different_module_is_named_with_its_reasons(monkeypatch, capsys, tmp_path, kernel_dir, toy_model):
    """A bundle whose norm.fatbin was not built from these sources by this nvcc: forge its record."""
    from ingot.toolchain.pack import pack

    k = tmp_path / "k"
    record = _kernels_subset(kernel_dir, k, {"norm", "rope"})
    forged = bytearray((k / "norm.fatbin").read_bytes())
    forged[-1] ^= 0xFF
    (k / "norm.fatbin").write_bytes(forged)
    norm = next(b for b in record["fatbins"] if b["name"] == "norm")
    norm["sha256"] = sha256_hex(bytes(forged))
    norm["inputs"]["norm.cu"] = "0" * 64
    record["toolkit"]["build"] = "V13.0.1"
    record["toolkit"]["version_text"] = "Cuda compilation tools, release 13.0, V13.0.1"
    (k / "build.json").write_text(json.dumps(record))
    bundle = tmp_path / "b.ingot"
    pack(toy_model, kernels=k, out=bundle, selftest=False)

    code, out, err = run_cli(monkeypatch, capsys, "rebuild", "--check", bundle, "--json")
    assert code == 4 and "1 of 2 kernel modules differ" in err and "norm" in err
    by_name = {m["module"]: m for m in json.loads(out)["modules"]}
    assert by_name["rope"]["identical"] and not by_name["norm"]["identical"]
    reasons = " | ".join(by_name["norm"]["reasons"])
    assert "nvcc differs" in reasons and "V13.0.1" in reasons
    assert "source digest of norm.cu differs" in reasons
    code, out, _ = run_cli(monkeypatch, capsys, "rebuild", "--check", bundle)  # the table names it too
    assert code == 4 and "norm" in out and "differs" in out


def test_rebuild_needs_check_and_a_bundle(monkeypatch, capsys, tmp_path, toy_bundle):
    assert run_cli(monkeypatch, capsys, "rebuild", toy_bundle)[0] == 2
    assert run_cli(monkeypatch, capsys, "rebuild", "--check", tmp_path / "none.ingot")[0] == 2
