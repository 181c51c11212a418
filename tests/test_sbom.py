"""`ingot sbom`: a CycloneDX 1.6 ML-BOM of a verified bundle, valid against the schema, every member by sha256."""

from __future__ import annotations

import hashlib
import json
import tarfile

import gguf
import numpy as np
import pytest
from bundle_fixtures import flip_byte, member_offset, run_cli

from ingot.runtime.bundle.manifest import SIGNATURE

pytestmark = pytest.mark.usefixtures("stamp_cache")
pytest.importorskip("cyclonedx", reason="ingot sbom needs cyclonedx-python-lib (the release extra)")


def _validate(text: str) -> dict:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
    return json.loads(text)


def _props(component: dict) -> dict:
    return {p["name"]: p["value"] for p in component.get("properties", [])}


def test_the_bom_lists_every_member_by_sha256_and_validates(monkeypatch, capsys, tmp_path, signed_bundle, keys):
    out = tmp_path / "bom.json"
    code, _, err = run_cli(monkeypatch, capsys, "sbom", signed_bundle, "--out", out)
    assert code == 0, err
    bom = _validate(out.read_text())
    assert bom["bomFormat"] == "CycloneDX" and bom["specVersion"] == "1.6"
    with tarfile.open(signed_bundle) as tar:
        members = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest() for m in tar.getmembers()}
    assert SIGNATURE in members
    listed = {
        c["name"] if c["type"] != "machine-learning-model" else _props(c)["ingot:path"]: c for c in bom["components"]
    }
    for name, digest in members.items():
        assert listed[name]["hashes"] == [{"alg": "SHA-256", "content": digest}], name
    model = listed["model/toy.gguf"]
    assert model["type"] == "machine-learning-model" and _props(model)["ingot:architecture"] == "toy"
    kernel = next(c for n, c in listed.items() if n.startswith("kernels/"))
    assert _props(kernel)["ingot:sass_archs"] == "sm_90" and "compute_90" in _props(kernel)["ingot:ptx_archs"]
    subject = bom["metadata"]["component"]
    assert subject["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(signed_bundle.read_bytes()).hexdigest()}]
    assert _props(subject)["ingot:signature_key_hint"] == keys["a"]["keyid"]
    tools = {t["name"]: t.get("version") for t in bom["metadata"]["tools"]["components"]}
    assert {"ingot-llm", "nvcc"} <= set(tools)
    python = {c["name"]: c["purl"] for c in bom["components"] if c.get("purl", "").startswith("pkg:pypi/")}
    assert "numpy" in python and "cryptography" in python
    deps = {d["ref"]: set(d.get("dependsOn", [])) for d in bom["dependencies"]}
    assert deps["bundle"] == set(members)
    assert deps["model/toy.gguf"] == {n for n in members if n.startswith("kernels/")}
    # reproducible: the same bundle gives the same BOM
    code, again, _ = run_cli(monkeypatch, capsys, "sbom", signed_bundle)
    assert code == 0 and again == out.read_text()


def test_the_model_component_carries_its_license_and_source(monkeypatch, capsys, tmp_path, kernel_dir):
    from ingot.toolchain.pack import pack

    path = tmp_path / "licensed.gguf"
    w = gguf.GGUFWriter(str(path), "toy")
    w.add_name("Licensed Toy")
    w.add_license("apache-2.0")
    w.add_source_url("https://example.org/licensed-toy")
    w.add_tensor("w", np.ones((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bundle = tmp_path / "licensed.ingot"
    pack(path, kernels=kernel_dir, out=bundle, selftest=False, source_urls=("https://example.org/mirror/toy.gguf",))
    code, out, err = run_cli(monkeypatch, capsys, "sbom", bundle)
    assert code == 0, err
    model = next(c for c in _validate(out)["components"] if c["type"] == "machine-learning-model")
    assert model["name"] == "Licensed Toy"
    assert model["licenses"] == [{"license": {"id": "Apache-2.0"}}]
    assert model["externalReferences"] == [
        {"type": "distribution", "url": url}
        for url in ("https://example.org/licensed-toy", "https://example.org/mirror/toy.gguf")
    ]


def test_no_bom_for_a_damaged_bundle(monkeypatch, capsys, copy_of, toy_bundle, tmp_path):
    bundle = copy_of(toy_bundle)
    offset, size = member_offset(bundle, "model/toy.gguf")
    flip_byte(bundle, offset + size - 1)
    code, _, err = run_cli(monkeypatch, capsys, "sbom", bundle, "--out", tmp_path / "bom.json")
    assert code == 4 and "model/toy.gguf" in err and not (tmp_path / "bom.json").exists()
