"""Signing: P-256 and Ed25519 keys, Sigstore bundles with DSSE envelopes of in-toto statements, `ingot sign`
and `verify --pubkey`. Interop with model_signing and sigstore: tests/test_interop.py."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest
from bundle_fixtures import craft_tar, repack, run_cli
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ingot.runtime.bundle.manifest import MANIFEST, SIGNATURE, canonical_json, parse_manifest
from ingot.runtime.bundle.signature import pae

pytestmark = pytest.mark.usefixtures("stamp_cache")


def test_pae_matches_the_dsse_spec_example():
    # secure-systems-lab/dsse protocol.md: PAE("http://example.com/HelloWorld", "hello world")
    assert (
        pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


@pytest.mark.parametrize("algorithm", [None, "p256", "ed25519"])
def test_keygen_writes_a_private_pkcs8_key_and_a_public_key(monkeypatch, capsys, tmp_path, algorithm):
    args = ["--algorithm", algorithm] if algorithm else []
    code, out, _ = run_cli(monkeypatch, capsys, "keygen", "--out", tmp_path / "release", *args, "--json")
    assert code == 0
    r = json.loads(out)
    key, pub = tmp_path / "release.key", tmp_path / "release.pub"
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert key.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS8
    private = serialization.load_pem_private_key(key.read_bytes(), password=None)
    public = serialization.load_pem_public_key(pub.read_bytes())
    if algorithm == "ed25519":
        assert isinstance(private, Ed25519PrivateKey) and isinstance(public, Ed25519PublicKey)
    else:  # the default: what `model_signing verify key` takes
        assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp256r1"
    # keyid = model_signing's key hint: sha256 of the public key PEM
    assert r["keyid"] == hashlib.sha256(pub.read_bytes()).hexdigest()
    code, _, err = run_cli(monkeypatch, capsys, "keygen", "--out", tmp_path / "release")
    assert code == 2 and "already exists" in err


def _members(bundle) -> tuple[dict, bytes]:
    with tarfile.open(bundle) as tar:
        return json.loads(tar.extractfile(SIGNATURE).read()), tar.extractfile(MANIFEST).read()


def test_signature_is_a_sigstore_bundle_with_a_dsse_envelope_anyone_can_check(signed_bundle, keys):
    doc, manifest_bytes = _members(signed_bundle)
    manifest = parse_manifest(manifest_bytes)
    assert doc["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert doc["verificationMaterial"] == {"publicKey": {"hint": keys["a"]["keyid"]}, "tlogEntries": []}
    env = doc["dsseEnvelope"]
    assert env["payloadType"] == "application/vnd.in-toto+json" and len(env["signatures"]) == 1
    payload = base64.b64decode(env["payload"])
    public = serialization.load_pem_public_key(Path(keys["a"]["pub"]).read_bytes())
    # PAE written out by hand, per the DSSE protocol, then a plain ECDSA P-256/SHA-256 check with the key.
    kind = b"application/vnd.in-toto+json"
    message = b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)
    public.verify(base64.b64decode(env["signatures"][0]["sig"]), message, ec.ECDSA(hashes.SHA256()))
    statement = json.loads(payload)
    assert statement["_type"] == "https://in-toto.io/Statement/v1"
    assert statement["subject"] == [{"name": manifest["name"], "digest": {"sha256": manifest["root_digest"]}}]
    assert statement["predicateType"] == "https://model_signing/signature/v1.0"
    assert statement["predicate"]["serialization"] == {
        "method": "files",
        "hash_type": "sha256",
        "allow_symlinks": False,
        "ignore_paths": [SIGNATURE],
    }
    resources = statement["predicate"]["resources"]
    assert [r["name"] for r in resources] == sorted((r["name"] for r in resources), key=lambda n: n.split("/"))
    assert {r["name"]: r["digest"] for r in resources} == {f["name"]: f["digest"] for f in manifest["files"]} | {
        MANIFEST: hashlib.sha256(manifest_bytes).hexdigest()
    }
    # model_signing's rule: the subject digest is sha256 over the resource digests in order
    root = hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()
    assert root == manifest["root_digest"]


def test_sign_then_verify_with_the_right_and_wrong_keys(monkeypatch, capsys, copy_of, toy_bundle, signed_bundle, keys):
    bundle = copy_of(toy_bundle)
    code, out, err = run_cli(monkeypatch, capsys, "sign", bundle, "--key", keys["a"]["key"], "--json")
    assert code == 0, err
    assert json.loads(out)["keyid"] == keys["a"]["keyid"]
    assert bundle.read_bytes() == signed_bundle.read_bytes()  # RFC 6979 ECDSA is deterministic: same bytes
    code, out, _ = run_cli(monkeypatch, capsys, "verify", bundle, "--pubkey", keys["a"]["pub"])
    assert code == 0 and "valid, by --pubkey" in out
    code, _, err = run_cli(monkeypatch, capsys, "verify", bundle, "--pubkey", keys["b"]["pub"])
    assert code == 4 and "not by --pubkey" in err
    code, _, err = run_cli(monkeypatch, capsys, "verify", bundle, "--pubkey", keys["ed"]["pub"])
    assert code == 4 and "not by --pubkey" in err
    code, _, err = run_cli(monkeypatch, capsys, "verify", toy_bundle, "--pubkey", keys["a"]["pub"])
    assert code == 4 and "unsigned" in err
    code, out, _ = run_cli(monkeypatch, capsys, "verify", bundle)  # no key: binding checked, signer not
    assert code == 0 and "pass --pubkey" in out


def test_ed25519_signatures_verify_and_are_deterministic(monkeypatch, capsys, tmp_path, toy_bundle, keys):
    one, two = tmp_path / "one.ingot", tmp_path / "two.ingot"
    for out in (one, two):
        assert run_cli(monkeypatch, capsys, "sign", toy_bundle, "--key", keys["ed"]["key"], "--out", out)[0] == 0
    assert one.read_bytes() == two.read_bytes()
    code, out, _ = run_cli(monkeypatch, capsys, "verify", one, "--pubkey", keys["ed"]["pub"], "--json")
    assert code == 0 and json.loads(out)["signature"] == {"keyid": keys["ed"]["keyid"], "authenticated": True}
    assert run_cli(monkeypatch, capsys, "verify", one, "--pubkey", keys["a"]["pub"])[0] == 4


def test_a_signature_without_a_key_hint_is_checked_by_the_key(monkeypatch, capsys, tmp_path, signed_bundle, keys):
    doc, _ = _members(signed_bundle)
    doc["verificationMaterial"]["publicKey"] = {"hint": ""}
    doc["dsseEnvelope"]["signatures"][0]["keyid"] = ""
    # the member in the exact form `ingot sign` writes (canonical JSON; verify refuses any other bytes), intact
    nohint = repack(signed_bundle, tmp_path / "nohint.ingot", replace={SIGNATURE: canonical_json(doc)})
    code, _, err = run_cli(monkeypatch, capsys, "verify", nohint, "--pubkey", keys["a"]["pub"])
    assert code == 0, err
    code, _, err = run_cli(monkeypatch, capsys, "verify", nohint, "--pubkey", keys["b"]["pub"])
    assert code == 4 and "does not verify" in err


def test_resigning_replaces_the_signature(monkeypatch, capsys, copy_of, signed_bundle, keys, tmp_path):
    out = tmp_path / "resigned.ingot"
    assert run_cli(monkeypatch, capsys, "sign", signed_bundle, "--key", keys["b"]["key"], "--out", out)[0] == 0
    with tarfile.open(out) as tar:
        assert tar.getnames().count(SIGNATURE) == 1
    assert run_cli(monkeypatch, capsys, "verify", out, "--pubkey", keys["b"]["pub"])[0] == 0
    assert run_cli(monkeypatch, capsys, "verify", out, "--pubkey", keys["a"]["pub"])[0] == 4


def test_signing_in_place_is_atomic_and_keeps_the_content(monkeypatch, capsys, copy_of, toy_bundle, keys):
    bundle = copy_of(toy_bundle)
    before = os.stat(bundle).st_ino
    assert run_cli(monkeypatch, capsys, "sign", bundle, "--key", keys["a"]["key"])[0] == 0
    assert os.stat(bundle).st_ino != before  # a new file renamed over the old one
    assert not list(bundle.parent.glob(f".{bundle.name}.*"))
    with tarfile.open(toy_bundle) as a, tarfile.open(bundle) as b:
        assert {m.name: a.extractfile(m).read() for m in a.getmembers()} == {
            m.name: b.extractfile(m).read() for m in b.getmembers() if m.name != SIGNATURE
        }


def test_a_signature_moved_to_another_bundle_is_refused(monkeypatch, capsys, tmp_path, signed_bundle, big_bundle, keys):
    with tarfile.open(signed_bundle) as tar:
        sig = tar.extractfile(SIGNATURE).read()
    info = tarfile.TarInfo(SIGNATURE)
    info.size = len(sig)
    moved = craft_tar(big_bundle, tmp_path / "moved.ingot", extra=[(info, sig)])
    code, _, err = run_cli(monkeypatch, capsys, "verify", moved, "--pubkey", keys["a"]["pub"])
    assert code == 4 and "for a different bundle" in err
    assert run_cli(monkeypatch, capsys, "verify", moved)[0] == 4  # also without a key
    # and `ingot sign --attach` refuses to put it in
    code, _, err = run_cli(monkeypatch, capsys, "sign", big_bundle, "--attach", tmp_path / "sig.json")
    assert code == 2 and "no such signature file" in err
    (tmp_path / "sig.json").write_bytes(sig)
    code, _, err = run_cli(monkeypatch, capsys, "sign", big_bundle, "--attach", tmp_path / "sig.json")
    assert code == 4 and "for a different bundle" in err


def test_signing_a_damaged_bundle_is_refused(monkeypatch, capsys, copy_of, toy_bundle, keys):
    from bundle_fixtures import flip_byte, member_offset

    bundle = copy_of(toy_bundle)
    offset, size = member_offset(bundle, "model/toy.gguf")
    flip_byte(bundle, offset + size - 1)
    before = bundle.read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "sign", bundle, "--key", keys["a"]["key"])
    assert code == 4 and "model/toy.gguf" in err
    assert bundle.read_bytes() == before and not list(bundle.parent.glob(f".{bundle.name}.*"))


def test_bad_key_files_are_usage_errors(monkeypatch, capsys, tmp_path, toy_bundle, keys):
    junk = tmp_path / "junk.pub"
    junk.write_text("hello")
    code, _, err = run_cli(monkeypatch, capsys, "verify", toy_bundle, "--pubkey", junk)
    assert code == 2 and "not a PEM public key" in err
    code, _, err = run_cli(monkeypatch, capsys, "sign", toy_bundle, "--key", keys["a"]["pub"])
    assert code == 2 and "not a PEM private key" in err
    code, _, err = run_cli(monkeypatch, capsys, "sign", toy_bundle)
    assert code == 2 and "exactly one of --key and --attach" in err
