"""`ingot pack`: deterministic, aligned, complete bundles with a truthful manifest and provenance."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tarfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
from bundle_fixtures import TEST_ARCHS, member_offset, run_cli

import ingot
from ingot.runtime.bundle.manifest import CHUNK_SIZE, MANIFEST, PROVENANCE
from ingot.runtime.gpu.constants import KERNEL_ABI, WEIGHT_LAYOUT


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _member(bundle: Path, name: str) -> bytes:
    with tarfile.open(bundle) as tar:
        return tar.extractfile(name).read()


def _manifest(bundle: Path) -> dict:
    return json.loads(_member(bundle, MANIFEST))


def test_pack_twice_in_different_places_and_times_gives_identical_bytes(
    tmp_path, monkeypatch, capsys, kernel_dir, toy_model
):
    shas = []
    for i, epoch in enumerate((None, "0")):
        where = tmp_path / f"run{i}"
        where.mkdir()
        model = where / "toy.gguf"
        shutil.copyfile(toy_model, model)
        os.utime(model, (1_000_000 * (i + 1), 1_000_000 * (i + 1)))  # different input mtimes
        kernels = shutil.copytree(kernel_dir, where / "kernels")  # different kernel folder path
        monkeypatch.chdir(where)
        if epoch is None:
            monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
        else:
            monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)
        code, out, err = run_cli(
            monkeypatch, capsys, "pack", "--model", "toy.gguf", "--kernels", kernels, "--no-selftest", "--json"
        )
        assert code == 0, err
        result = json.loads(out)
        assert result["bundle"] == "dist/toy.ingot"
        assert _sha(where / "dist" / "toy.ingot") == result["sha256"]
        shas.append(result["sha256"])
    assert shas[0] == shas[1]

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    code, out, _ = run_cli(
        monkeypatch,
        capsys,
        "pack",
        "--model",
        "toy.gguf",
        "--kernels",
        kernels,
        "--no-selftest",
        "--out",
        tmp_path / "later.ingot",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["sha256"] != shas[0]
    with tarfile.open(tmp_path / "later.ingot") as tar:
        assert {m.mtime for m in tar.getmembers()} == {1700000000}


def test_headers_are_anonymous_and_members_sorted(toy_bundle, tmp_path):
    with tarfile.open(toy_bundle) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert set(names) >= {MANIFEST, PROVENANCE, "model/toy.gguf"} and any(n.startswith("kernels/") for n in names)
    for m in members:
        assert (m.uid, m.gid, m.uname, m.gname, m.mtime, m.mode, m.type) == (0, 0, "", "", 0, 0o644, tarfile.REGTYPE)
    text = toy_bundle.read_bytes()
    for private in (str(Path.home()) + "/", str(tmp_path.parent), "/tmp/"):  # user names: uname/gname above
        assert private.encode() not in text, private


def test_model_is_stored_raw_and_page_aligned(toy_bundle, toy_model, big_bundle, big_model):
    for bundle, model in ((toy_bundle, toy_model), (big_bundle, big_model)):
        offset, size = member_offset(bundle, f"model/{model.stem}.gguf")
        assert offset % 4096 == 0
        with open(bundle, "rb") as f:
            f.seek(offset)
            assert f.read(size) == model.read_bytes()


def test_manifest_describes_members_truthfully(toy_bundle, toy_model, kernel_dir):
    m = _manifest(toy_bundle)
    with tarfile.open(toy_bundle) as tar:
        actual = {x.name: hashlib.sha256(tar.extractfile(x).read()).hexdigest() for x in tar.getmembers()}
    files = {f["name"]: f for f in m["files"]}
    assert [f["name"] for f in m["files"]] == sorted(files)
    assert set(files) == set(actual) - {MANIFEST}
    for name, f in files.items():
        assert (f["algorithm"], f["digest"]) == ("sha256", actual[name])
    build = json.loads((kernel_dir / "build.json").read_text())
    assert {k["name"]: k["sha256"] for k in m["kernels"]} == {b["name"]: b["sha256"] for b in build["fatbins"]}
    for k in m["kernels"]:
        assert k["archs"]["sass"] == ["sm_90"]
        assert [p["arch"] for p in k["archs"]["ptx"]] == ["compute_90"] and k["archs"]["ptx"][0]["isa"]
        assert k["kernels"] and all(isinstance(s, str) for s in k["kernels"])
    model = m["model"]
    assert (model["path"], model["sha256"], model["size"]) == (
        "model/toy.gguf",
        _sha(toy_model),
        toy_model.stat().st_size,
    )
    assert model["architecture"] == "toy" and model["n_tensors"] == 2 and model["quant_types"] == ["F32"]
    assert model["weight_layout"].startswith(WEIGHT_LAYOUT.split(":")[0])
    assert model["origin"] == {"sources": []}  # the toy GGUF declares no license or source
    assert m["runtime"] == {
        "kernel_abi": KERNEL_ABI,
        "weight_layout": WEIGHT_LAYOUT,
        "ingot": ingot.__version__,
        "selftested": False,
    }
    assert m["toolchain"]["nvcc"]["build"] == build["toolkit"]["build"]
    assert "selftest" not in m


def test_large_members_carry_64mib_chunk_digests(big_bundle, big_model):
    data = big_model.read_bytes()
    entry = next(f for f in _manifest(big_bundle)["files"] if f["name"] == "model/big.gguf")
    assert len(entry["chunks"]) == math.ceil(len(data) / CHUNK_SIZE) == 2
    for i, digest in enumerate(entry["chunks"]):
        assert digest == hashlib.sha256(data[i * CHUNK_SIZE : (i + 1) * CHUNK_SIZE]).hexdigest()


def test_provenance_is_slsa_v1_for_the_fatbins(toy_bundle, kernel_dir):
    from ingot.toolchain.archs import kernel_source_dir

    prov = json.loads(_member(toy_bundle, PROVENANCE))
    assert prov["_type"] == "https://in-toto.io/Statement/v1"
    assert prov["predicateType"] == "https://slsa.dev/provenance/v1"
    subjects = {s["name"]: s["digest"]["sha256"] for s in prov["subject"]}
    assert subjects == {f"kernels/{p.name}": _sha(p) for p in kernel_dir.glob("*.fatbin")}
    d = prov["predicate"]["buildDefinition"]
    assert d["externalParameters"]["archs"] == TEST_ARCHS.split(",")
    deps = {r["name"]: r["digest"]["sha256"] for r in d["resolvedDependencies"] if "digest" in r}
    src = kernel_source_dir()
    assert deps["cuda/archs.json"] == _sha(src / "archs.json")
    assert deps["cuda/norm.cu"] == _sha(src / "norm.cu")
    root = Path(__file__).resolve().parent.parent
    assert deps["ci/requirements.lock"] == _sha(root / "ci" / "requirements.lock")  # the pinned Python set
    # and the Python distributions that actually packed it, as purls
    python = {r["name"]: r["uri"] for r in d["resolvedDependencies"] if "uri" in r}
    assert python["numpy"] == f"pkg:pypi/numpy@{version('numpy')}" and "ingot-llm" not in python
    norm = d["internalParameters"]["modules"]["norm"]["command"]
    assert norm[0] == "nvcc" and norm[-3:] == ["-o", "norm.fatbin", "norm.cu"] and "--time" not in norm
    assert d["internalParameters"]["nvcc"]["version_text"].startswith("Cuda compilation tools")


def test_selftest_records_cpu_reference_logits(tmp_path, kernel_dir, tiny_llama):
    from ingot.runtime.engines.cpu import CpuEngine
    from ingot.runtime.generate import SamplingParams
    from ingot.runtime.model.gguf import load_model
    from ingot.runtime.model.tokenizer import Tokenizer
    from ingot.toolchain.pack import pack

    out = tmp_path / "tiny.ingot"
    pack(tiny_llama, kernels=kernel_dir, out=out)
    st = _manifest(out)["selftest"]
    model = load_model(tiny_llama)
    assert st["tokens"] == Tokenizer.from_model(model).encode(st["prompt"])
    eng = CpuEngine(model)
    seq = eng.new_sequence(SamplingParams())
    logits = eng.logits(seq, st["tokens"])[-1].astype(np.float64)
    assert st["argmax"] == int(np.argmax(logits)) == st["top_ids"][0]
    assert len(st["top_ids"]) == 32 and st["n_vocab"] == len(logits)
    assert st["top_logits"] == sorted(st["top_logits"], reverse=True)
    np.testing.assert_allclose(st["top_logits"], logits[st["top_ids"]], atol=1e-4)
    assert min(st["top_logits"]) >= np.sort(logits)[-32] - 1e-4
    assert st["logsumexp"] == pytest.approx(np.log(np.exp(logits - logits.max()).sum()) + logits.max(), abs=1e-4)


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-qwen3"])
def test_pack_accepts_k_quant_gemma3_and_qwen3_models(tmp_path, monkeypatch, capsys, kernel_dir, synth_model, shape):
    """The pack-time CPU self-test runs on them; the manifest records the architecture and every tensor type."""
    from ingot.runtime.model.gguf import load_model

    model = synth_model(shape, "Q4_K_M")
    out = tmp_path / f"{shape}.ingot"
    code, _, err = run_cli(monkeypatch, capsys, "pack", "--model", model, "--kernels", kernel_dir, "--out", out)
    assert code == 0, err
    m = _manifest(out)
    assert m["model"]["architecture"] == shape.split("-")[1]
    loaded = load_model(model)
    assert m["model"]["quant_types"] == loaded.quant_types and "Q4_K" in m["model"]["quant_types"]
    assert m["model"]["tensor_types"] == {name: t.qtype for name, t in loaded.tensors.items()}
    assert len(m["selftest"]["top_ids"]) == 32
    code, _, err = run_cli(monkeypatch, capsys, "verify", out)
    assert code == 0, err


def test_pack_without_kernels_runs_the_default_build_into_dist(tmp_path, monkeypatch, capsys, kernel_dir, toy_model):
    import ingot.toolchain.build as build_mod
    import ingot.toolchain.pack as pack_mod
    from ingot.toolchain.archs import parse_arch_list

    calls = []
    real = build_mod.build

    def small_build(**kw):  # the default arch list takes minutes on 2 cores: same code, fewer archs
        calls.append(kw)
        return real(archs=parse_arch_list(TEST_ARCHS), **kw)

    monkeypatch.setattr(pack_mod, "build", small_build)  # pack calls the build it imported
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "pack", "--model", toy_model, "--no-selftest", "--json")
    assert code == 0, err
    assert calls == [{"out_dir": "dist/kernels"}]
    assert (tmp_path / "dist/kernels/build.json").is_file() and (tmp_path / "dist/toy.ingot").is_file()


def test_pack_errors_are_one_line_with_exit_codes(tmp_path, monkeypatch, capsys, kernel_dir, toy_model):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"not a model")
    bad_kernels = shutil.copytree(kernel_dir, tmp_path / "k")
    (bad_kernels / "norm.fatbin").write_bytes(b"\0" + (bad_kernels / "norm.fatbin").read_bytes()[1:])
    cases = [
        (["--model", tmp_path / "missing.gguf", "--kernels", kernel_dir], 2, "no such model"),
        (["--model", not_gguf, "--kernels", kernel_dir], 5, "not a readable GGUF"),
        (["--model", toy_model, "--kernels", tmp_path], 2, "build.json not found"),
        (["--model", toy_model, "--kernels", bad_kernels], 2, "does not match the digest"),
        (["--model", toy_model, "--kernels", kernel_dir, "--name", "../evil"], 2, "bundle name"),
    ]
    for args, code, words in cases:
        got, _, err = run_cli(monkeypatch, capsys, "pack", *args, "--no-selftest", "--out", tmp_path / "o.ingot")
        assert (got, words in err) == (code, True), err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.ingot").exists() and not list(tmp_path.glob(".o.ingot.*"))


def test_gguf_values_beyond_exact_json_integers_are_stored_as_strings():
    from ingot.runtime.bundle.manifest import canonical_json
    from ingot.toolchain.pack import _exact_json

    hyper = {"big": 2**60, "neg": -(2**53), "ok": 2**53 - 1, "flag": True, "list": [2**64 - 1, 3]}
    safe = _exact_json(hyper)
    assert safe == {"big": str(2**60), "neg": str(-(2**53)), "ok": 2**53 - 1, "flag": True, "list": [str(2**64 - 1), 3]}
    canonical_json(safe)  # what canonical JSON refuses is gone
