"""open_bundle: load-time trust for the runtime, and the verified-stamp cache."""

from __future__ import annotations

import json
import os
import shutil
import tarfile

import pytest
from bundle_fixtures import flip_byte, member_offset, run_cli

import ingot.runtime.bundle.open as verify_mod  # open_bundle calls check_members through this module
from ingot.runtime.bundle.open import open_bundle
from ingot.runtime.errors import UsageError, VerificationError


def test_open_returns_what_the_runtime_needs(stamp_cache, toy_bundle, toy_model, kernel_dir):
    b = open_bundle(toy_bundle)
    assert b.verified and b.signer is None
    assert b.model_path == toy_bundle.resolve() and b.model_offset % 4096 == 0
    with open(b.model_path, "rb") as f:
        f.seek(b.model_offset)
        assert f.read(b.model_size) == toy_model.read_bytes()
    assert b.fatbins == {p.stem: p.read_bytes() for p in kernel_dir.glob("*.fatbin")}
    with tarfile.open(toy_bundle) as tar:
        stored = json.loads(tar.extractfile("manifest.json").read())
    # the manifest as stored, plus what parse_manifest derives: its own digest and the bundle's root digest
    assert b.manifest == stored | {"manifest_digest": b.manifest["manifest_digest"], "root_digest": b.root_digest}
    assert "root_digest" not in stored


def test_runtime_maps_the_model_in_place(stamp_cache, tmp_path, kernel_dir, tiny_llama):
    from ingot.runtime.model.gguf import load_model
    from ingot.toolchain.pack import pack

    bundle = tmp_path / "tiny.ingot"
    pack(tiny_llama, kernels=kernel_dir, out=bundle, selftest=False)
    b = open_bundle(bundle)
    inside, alone = load_model(b.model_path, offset=b.model_offset, size=b.model_size), load_model(tiny_llama)
    assert inside.config == alone.config and inside.n_tensors == alone.n_tensors
    assert (inside.tensors["blk.1.ffn_down.weight"].raw == alone.tensors["blk.1.ffn_down.weight"].raw).all()


def test_a_tampered_bundle_is_refused_at_load(stamp_cache, copy_of, toy_bundle, capsys):
    bundle = copy_of(toy_bundle)
    offset, size = member_offset(bundle, "model/toy.gguf")
    flip_byte(bundle, offset + size - 1)
    with pytest.raises(VerificationError, match="model/toy.gguf"):
        open_bundle(bundle)
    b = open_bundle(bundle, allow_unverified=True)
    assert not b.verified and b.model_size == size
    assert "UNVERIFIED BUNDLE" in capsys.readouterr().err
    assert not stamp_cache.exists() or not any(stamp_cache.iterdir())  # failures are never stamped


def test_the_stamp_skips_rehashing_until_the_file_changes(stamp_cache, copy_of, toy_bundle, monkeypatch):
    bundle = copy_of(toy_bundle)
    open_bundle(bundle)
    assert len(list(stamp_cache.iterdir())) == 1

    def must_not_hash(*a, **k):
        raise AssertionError("a valid stamp must skip hashing")

    with monkeypatch.context() as m:
        m.setattr(verify_mod, "check_members", must_not_hash)
        assert open_bundle(bundle).verified

    # Change a byte and put the mtime back: size, mtime and inode all match, the ctime does not.
    st = os.stat(bundle)
    offset, size = member_offset(bundle, "model/toy.gguf")
    flip_byte(bundle, offset + size - 1)
    os.utime(bundle, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(VerificationError, match="model/toy.gguf"):
        open_bundle(bundle)


def test_a_replaced_file_is_reverified(stamp_cache, copy_of, toy_bundle, big_bundle, monkeypatch):
    bundle = copy_of(toy_bundle)
    open_bundle(bundle)
    calls = []
    real = verify_mod.check_members
    monkeypatch.setattr(verify_mod, "check_members", lambda *a, **k: calls.append(1) or real(*a, **k))
    shutil.copyfile(big_bundle, bundle.with_suffix(".new"))
    os.replace(bundle.with_suffix(".new"), bundle)  # same path, new inode and content
    assert open_bundle(bundle).manifest["name"] == "big" and calls == [1]


def test_verify_command_stamps_for_a_fast_first_run(stamp_cache, monkeypatch, capsys, copy_of, toy_bundle):
    bundle = copy_of(toy_bundle)
    assert run_cli(monkeypatch, capsys, "verify", bundle)[0] == 0
    monkeypatch.setattr(verify_mod, "check_members", lambda *a, **k: pytest.fail("stamp not used"))
    assert open_bundle(bundle).verified


def test_pubkey_is_checked_even_with_a_valid_stamp(stamp_cache, copy_of, signed_bundle, keys):
    bundle = copy_of(signed_bundle)
    assert open_bundle(bundle).signer is None
    assert open_bundle(bundle, pubkey=keys["a"]["pub"]).signer == keys["a"]["keyid"]
    with pytest.raises(VerificationError, match="not by --pubkey"):
        open_bundle(bundle, pubkey=keys["b"]["pub"])


def test_unsigned_bundle_with_pubkey_and_missing_file(stamp_cache, toy_bundle, keys, tmp_path):
    with pytest.raises(VerificationError, match="unsigned"):
        open_bundle(toy_bundle, pubkey=keys["a"]["pub"])
    with pytest.raises(UsageError, match="no such bundle"):
        open_bundle(tmp_path / "missing.ingot")


def test_check_compat_reads_a_bundle(stamp_cache, monkeypatch, capsys, toy_bundle):
    code, out, _ = run_cli(
        monkeypatch, capsys, "check-compat", toy_bundle, "--gpu", "sm_90,sm_100", "--driver", "580.65.06", "--json"
    )
    assert code == 0
    rows = json.loads(out)["decisions"]
    assert {(r["gpu"], r["verdict"]) for r in rows} == {("sm_90", "native"), ("sm_100", "jit")}
    code, _, _ = run_cli(monkeypatch, capsys, "check-compat", toy_bundle, "--gpu", "sm_80", "--driver", "580.65.06")
    assert code == 3
