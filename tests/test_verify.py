"""`ingot verify`: every kind of damage or smuggling is refused with exit 4, naming the member (and chunk)."""

from __future__ import annotations

import json
import tarfile

import pytest
from bundle_fixtures import craft_tar, flip_byte, member_offset, repack, run_cli

from ingot.runtime.bundle.manifest import CHUNK_SIZE, MANIFEST, SIGNATURE, canonical_json

pytestmark = pytest.mark.usefixtures("stamp_cache")


def _verify(monkeypatch, capsys, bundle, *extra):
    code, out, err = run_cli(monkeypatch, capsys, "verify", bundle, "--json", *extra)
    assert "Traceback" not in err
    return code, json.loads(out), err


def test_intact_bundle_verifies(monkeypatch, capsys, toy_bundle):
    code, report, _ = _verify(monkeypatch, capsys, toy_bundle)
    assert code == 0
    assert report["ok"] and report["signature"] is None and report["members"] >= 4
    code, out, _ = run_cli(monkeypatch, capsys, "verify", toy_bundle)
    assert code == 0 and "ok" in out and report["root_digest"] in out


def _kernel(bundle) -> str:
    with tarfile.open(bundle) as tar:
        return next(n for n in tar.getnames() if n.startswith("kernels/"))


@pytest.mark.parametrize(
    "where", ["kernel", "model header", "model tensor data", "manifest", "provenance", "signature"]
)
def test_one_flipped_byte_anywhere_is_refused_naming_the_member(
    monkeypatch, capsys, copy_of, signed_bundle, keys, where
):
    bundle = copy_of(signed_bundle)
    name = {
        "kernel": _kernel(bundle),
        "model header": "model/toy.gguf",
        "model tensor data": "model/toy.gguf",
        "manifest": MANIFEST,
        "provenance": "provenance.json",
        "signature": SIGNATURE,
    }[where]
    offset, size = member_offset(bundle, name)
    data = bundle.read_bytes()[offset : offset + size]
    pos = {
        "model header": 9,  # inside the GGUF version / tensor count
        "model tensor data": size - 3,  # the last tensor's bytes
        "signature": data.find(b'"sig":"') + 12,  # inside the base64 of the ECDSA signature
    }.get(where, size // 2)
    flip_byte(bundle, offset + pos)
    code, report, err = _verify(monkeypatch, capsys, bundle, "--pubkey", keys["a"]["pub"])
    assert code == 4
    assert not report["ok"] and name in report["error"] and name in err


def test_damage_in_a_large_member_names_the_chunk(monkeypatch, capsys, copy_of, big_bundle):
    bundle = copy_of(big_bundle)
    offset, size = member_offset(bundle, "model/big.gguf")
    flip_byte(bundle, offset + CHUNK_SIZE + 1000)
    code, report, err = _verify(monkeypatch, capsys, bundle)
    assert code == 4
    assert report["problems"] == [
        {"member": "model/big.gguf", "chunk": 1, "bytes": [CHUNK_SIZE, size], "where": report["problems"][0]["where"]}
    ]
    assert "chunk 1 of 2" in err


def test_a_whole_digest_that_disagrees_with_its_chunks_is_refused(monkeypatch, capsys, tmp_path, big_bundle):
    from ingot.runtime.bundle.manifest import seal

    m = _manifest(big_bundle)
    m["model"]["sha256"] = "0" * 64
    m["files"] = [f | {"digest": "0" * 64} if f["name"] == "model/big.gguf" else f for f in m["files"]]
    bad = craft_tar(big_bundle, tmp_path / "bad.ingot", replace={MANIFEST: seal(m)})  # a consistent self digest
    code, report, _ = _verify(monkeypatch, capsys, bad)
    assert code == 4 and report["problems"][0]["chunk"] is None and "model/big.gguf" in report["error"]


def test_truncated_bundle_is_refused(monkeypatch, capsys, copy_of, toy_bundle):
    bundle = copy_of(toy_bundle)
    offset, size = member_offset(bundle, "model/toy.gguf")
    with open(bundle, "r+b") as f:
        f.truncate(offset + size // 2)
    code, report, _ = _verify(monkeypatch, capsys, bundle)
    assert code == 4 and "truncated" in report["error"] and "model/toy.gguf" in report["error"]
    with open(bundle, "r+b") as f:
        f.truncate(300)
    assert _verify(monkeypatch, capsys, bundle)[0] == 4


def _info(name: str, kind=tarfile.REGTYPE, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname = kind, size, link
    return info


@pytest.mark.parametrize(
    "extra, words",
    [
        ((_info("notes.txt", size=2), b"hi"), "notes.txt is in the bundle but not in the manifest"),
        ((_info("../evil", size=2), b"hi"), "'../evil'"),
        ((_info("/etc/evil", size=2), b"hi"), "absolute path"),
        ((_info("kernels/a/../../x", size=2), b"hi"), "'..'"),
        ((_info("link", tarfile.SYMTYPE, link="/etc/passwd"), None), "link is a symlink"),
        ((_info("hard", tarfile.LNKTYPE, link=MANIFEST), None), "hard is a hard link"),
        ((_info("dev", tarfile.CHRTYPE), None), "dev is a device file"),
        ((_info("dir", tarfile.DIRTYPE), None), "dir is a directory"),
        ((_info(MANIFEST, size=2), b"{}"), f"member {MANIFEST} appears twice"),
    ],
)
def test_smuggled_members_are_refused(monkeypatch, capsys, tmp_path, toy_bundle, extra, words):
    bad = craft_tar(toy_bundle, tmp_path / "bad.ingot", extra=[extra])
    code, report, _ = _verify(monkeypatch, capsys, bad)
    assert code == 4 and words in report["error"], report["error"]


def test_missing_member_is_refused(monkeypatch, capsys, tmp_path, toy_bundle):
    bad = craft_tar(toy_bundle, tmp_path / "bad.ingot", drop={"provenance.json"})
    code, report, _ = _verify(monkeypatch, capsys, bad)
    assert code == 4 and "provenance.json is listed in the manifest but missing" in report["error"]


def test_data_after_the_archive_end_is_refused(monkeypatch, capsys, copy_of, toy_bundle):
    bundle = copy_of(toy_bundle)
    with open(bundle, "ab") as f:
        f.write(b"smuggled payload")
    code, report, _ = _verify(monkeypatch, capsys, bundle)
    assert code == 4 and "stray data" in report["error"]


def test_damaged_tar_header_is_refused(monkeypatch, capsys, copy_of, toy_bundle):
    bundle = copy_of(toy_bundle)
    offset, _ = member_offset(bundle, "provenance.json")
    flip_byte(bundle, offset - 512 + 20)  # inside provenance.json's own tar header (its name field)
    code, report, _ = _verify(monkeypatch, capsys, bundle)
    assert code == 4 and "damaged tar header" in report["error"]


def _manifest(bundle) -> dict:
    with tarfile.open(bundle) as tar:
        return json.loads(tar.extractfile(MANIFEST).read())


def _with_files(m: dict, **fields) -> bytes:
    return canonical_json(m | {"files": [f | fields for f in m["files"]]})


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda m: b"{not json", "not valid UTF-8 JSON"),
        (lambda m: canonical_json(m | {"files": "all of them"}), "field files has type str"),
        (lambda m: _with_files(m, size=2**52), "files[0].size is out of range"),
        (lambda m: _with_files(m, size="12"), "files[0].size has type str"),
        (lambda m: _with_files(m, digest="AB" * 32), "files[0].digest"),
        (lambda m: _with_files(m, digest="abc"), "files[0].digest"),
        (lambda m: json.dumps(m, indent=2).encode(), "not in canonical JSON form"),
        (lambda m: canonical_json(m | {"name": "renamed"}), "self digest"),
        (lambda m: canonical_json([m]), "is a list"),
    ],
)
def test_malformed_manifest_is_refused(monkeypatch, capsys, tmp_path, toy_bundle, mutate, words):
    data = mutate(_manifest(toy_bundle))
    bad = craft_tar(toy_bundle, tmp_path / "bad.ingot", replace={MANIFEST: data})
    code, report, _ = _verify(monkeypatch, capsys, bad)
    assert code == 4 and MANIFEST in report["error"] and words in report["error"], report["error"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda st: st["top_logits"].__setitem__(0, st["top_logits"][0] + 1.0),
        lambda st: st.__setitem__("argmax", st["top_ids"][1]),
        lambda st: st["tokens"].reverse(),
    ],
    ids=["top logit", "argmax", "prompt tokens"],
)
def test_a_changed_selftest_record_is_refused(monkeypatch, capsys, tmp_path, selftest_bundle, mutate):
    """The self-test record is what `verify --device` trusts, so the manifest's digests must cover it: an edited
    record under the old self digest (format v2; the root digest covers manifest.json's bytes too) is refused like
    any other manifest change."""
    code, _, _ = _verify(monkeypatch, capsys, selftest_bundle)
    assert code == 0
    m = _manifest(selftest_bundle)
    mutate(m["selftest"])
    bad = craft_tar(selftest_bundle, tmp_path / "bad.ingot", replace={MANIFEST: canonical_json(m)})
    code, report, _ = _verify(monkeypatch, capsys, bad)
    assert code == 4 and "self digest" in report["error"], report["error"]


def test_not_a_bundle(monkeypatch, capsys, tmp_path, toy_model):
    code, report, _ = _verify(monkeypatch, capsys, toy_model)
    assert code == 4 and "not an Ingot bundle" in report["error"]
    code, _, err = run_cli(monkeypatch, capsys, "verify", tmp_path / "nope.ingot")
    assert code == 2 and "no such bundle" in err


def test_a_bundle_for_another_kernel_abi_is_refused_with_exit_3(monkeypatch, capsys, tmp_path, toy_bundle):
    from ingot.runtime.bundle.manifest import seal
    from ingot.runtime.bundle.open import open_bundle
    from ingot.runtime.errors import IncompatibleError
    from ingot.runtime.gpu.constants import KERNEL_ABI

    code, out, _ = run_cli(monkeypatch, capsys, "verify", toy_bundle)
    assert code == 0 and f"this Ingot runs it: kernel ABI {KERNEL_ABI}" in out
    m = _manifest(toy_bundle)
    m["runtime"]["kernel_abi"] = KERNEL_ABI + 1  # intact and consistent, but for another runtime
    other = repack(toy_bundle, tmp_path / "other-abi.ingot", replace={MANIFEST: seal(m)})
    code, out, err = run_cli(monkeypatch, capsys, "verify", other)
    assert code == 3 and out == ""
    assert err.count("\n") == 1 and f"needs kernel ABI {KERNEL_ABI + 1}" in err and "re-pack" in err
    with pytest.raises(IncompatibleError, match="kernel ABI"):
        open_bundle(other)


def test_a_v1_bundle_is_refused_with_a_repack_hint(monkeypatch, capsys, tmp_path, toy_bundle):
    m = _manifest(toy_bundle) | {"format": "ingot-bundle/v1"}
    old = craft_tar(toy_bundle, tmp_path / "old.ingot", replace={MANIFEST: canonical_json(m)})
    code, report, err = _verify(monkeypatch, capsys, old)
    assert code == 4 and "ingot-bundle/v1 is no longer read" in err and "re-pack it with `ingot pack`" in err
