"""What security teams run must verify what Ingot signs, and the reverse, with the real libraries:
OpenSSF model_signing (key mode) on the extracted bundle, sigstore's bundle models, plain `tar`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from bundle_fixtures import run_cli

from ingot.runtime.bundle.manifest import MANIFEST, SIGNATURE, parse_manifest

pytestmark = pytest.mark.usefixtures("stamp_cache")
model_signing = pytest.importorskip("model_signing", reason="the interop tests need model-signing (test extra)")


def _extract(bundle: Path, into: Path) -> Path:
    """The bundle as a model folder, with the system's tar (a bundle is a plain POSIX tar)."""
    into.mkdir()
    subprocess.run(["tar", "-xf", str(bundle), "-C", str(into)], check=True)
    return into


def _model_signing_verify(folder: Path, signature: Path, pub: str) -> None:
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=pub).verify(folder, signature)


def test_model_signing_verifies_an_ingot_signature_on_the_extracted_bundle(tmp_path, signed_bundle, keys):
    folder = _extract(signed_bundle, tmp_path / "model")
    _model_signing_verify(folder, folder / SIGNATURE, keys["a"]["pub"])
    with pytest.raises(ValueError, match="Key mismatch"):
        _model_signing_verify(folder, folder / SIGNATURE, keys["b"]["pub"])
    # and its root digest is Ingot's: model_signing's own hashing of the folder
    manifest = parse_manifest((folder / MANIFEST).read_bytes())
    hashed = model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE]).hash(folder)
    assert {rd.identifier: rd.digest.digest_hex for rd in hashed.resource_descriptors()} == {
        f["name"]: f["digest"] for f in manifest["files"]
    } | {MANIFEST: manifest["manifest_digest"]}


def test_the_model_signing_cli_verifies_it_too(tmp_path, signed_bundle, keys):
    cli = Path(sys.executable).parent / "model_signing"
    if not cli.exists():
        pytest.skip("no model_signing command in this environment")
    folder = _extract(signed_bundle, tmp_path / "model")
    args = [cli, "verify", "key", "--signature", folder / SIGNATURE, "--public_key", keys["a"]["pub"], folder]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (folder / "provenance.json").write_bytes(b"{}")
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode != 0 and "provenance.json" in proc.stdout + proc.stderr


def _members(bundle: Path) -> list[str]:
    with tarfile.open(bundle) as tar:
        return [n for n in tar.getnames() if n != SIGNATURE]


def test_tampering_with_any_member_makes_both_refuse(monkeypatch, capsys, tmp_path, signed_bundle, keys):
    members = _members(signed_bundle)
    assert {MANIFEST, "provenance.json", "model/toy.gguf"} <= set(members)
    for i, name in enumerate(members):
        folder = _extract(signed_bundle, tmp_path / f"m{i}")
        data = bytearray((folder / name).read_bytes())
        data[len(data) // 2] ^= 1
        (folder / name).write_bytes(bytes(data))
        with pytest.raises(ValueError, match="Signature mismatch"):
            _model_signing_verify(folder, folder / SIGNATURE, keys["a"]["pub"])
        # the same damage inside the bundle: ingot verify refuses it (exit 4), naming the member
        tampered = tmp_path / f"t{i}.ingot"
        with tarfile.open(signed_bundle) as tin, tarfile.open(tampered, "w", format=tarfile.PAX_FORMAT) as tout:
            for m in tin.getmembers():
                src = folder / m.name
                info = tarfile.TarInfo(m.name)
                info.size = src.stat().st_size
                with open(src, "rb") as f:
                    tout.addfile(info, f)
        code, _, err = run_cli(monkeypatch, capsys, "verify", tampered, "--pubkey", keys["a"]["pub"])
        assert code == 4 and name in err, err


def test_sigstore_models_parse_the_signature_and_sigstore_python_says_why_it_cannot(signed_bundle):
    from sigstore.errors import Error as SigstoreError
    from sigstore.models import Bundle
    from sigstore_models.bundle.v1 import Bundle as BundleModel

    with tarfile.open(signed_bundle) as tar:
        raw = tar.extractfile(SIGNATURE).read()
    parsed = BundleModel.from_json(raw)  # strict: unknown or missing fields are errors
    assert parsed.media_type == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert parsed.dsse_envelope.payload_type == "application/vnd.in-toto+json"
    assert json.loads(parsed.to_json()) == json.loads(raw)
    # sigstore-python's Bundle is for keyless signatures only: it demands a Fulcio certificate and a Rekor
    # entry, so no key-signed bundle (model_signing's included) gets past it. This is the documented reason.
    with pytest.raises(SigstoreError, match="expected certificate in bundle"):
        Bundle.from_json(raw)


def test_ingot_accepts_a_model_signing_signature_over_the_same_content(monkeypatch, capsys, tmp_path, toy_bundle, keys):
    folder = _extract(toy_bundle, tmp_path / "model")
    sig = tmp_path / "model.sig"  # outside the folder, so it is not part of what is signed
    model_signing.signing.Config().use_elliptic_key_signer(private_key=keys["b"]["key"]).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=[SIGNATURE])
    ).sign(folder, sig)
    signed = tmp_path / "signed.ingot"
    code, _, err = run_cli(
        monkeypatch, capsys, "sign", toy_bundle, "--attach", sig, "--pubkey", keys["b"]["pub"], "--out", signed
    )
    assert code == 0, err
    assert run_cli(monkeypatch, capsys, "verify", signed, "--pubkey", keys["b"]["pub"])[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "verify", signed, "--pubkey", keys["a"]["pub"])
    assert code == 4 and "not by --pubkey" in err
    # model_signing still verifies its own signature on the re-packed, extracted bundle
    again = _extract(signed, tmp_path / "again")
    _model_signing_verify(again, again / SIGNATURE, keys["b"]["pub"])


def test_extracting_with_tar_gives_exactly_the_signed_files(tmp_path, signed_bundle):
    folder = _extract(signed_bundle, tmp_path / "model")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert files == sorted(_members(signed_bundle) + [SIGNATURE])
    shutil.rmtree(folder)
