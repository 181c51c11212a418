"""Canonical JSON (RFC 8785), the root digest and the manifest schema check."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from ingot.runtime.bundle.manifest import (
    CHUNK_SIZE,
    DERIVED,
    FORMAT,
    MANIFEST,
    MAX_MEMBERS,
    canonical_json,
    check_runtime,
    file_entry,
    parse_manifest,
    runtime_identity,
    seal,
)
from ingot.runtime.errors import IncompatibleError, VerificationError
from ingot.runtime.gpu.constants import KERNEL_ABI


@pytest.mark.parametrize(
    "value, text",
    [
        # ECMAScript Number.prototype.toString, as RFC 8785 section 3.2.2.3 requires
        (0.0, "0"),
        (-0.0, "0"),
        (1.0, "1"),
        (-1.5, "-1.5"),
        (123.0, "123"),
        (0.1, "0.1"),
        (1e21, "1e+21"),
        (1e20, "100000000000000000000"),
        (1e-6, "0.000001"),
        (1e-7, "1e-7"),
        (5e-324, "5e-324"),
        (1.7976931348623157e308, "1.7976931348623157e+308"),
        (333333333.3333333, "333333333.3333333"),
        (9.999999747378752e-06, "0.000009999999747378752"),
        (123456789012345680000.0, "123456789012345680000"),
    ],
)
def test_numbers_follow_ecmascript(value, text):
    assert canonical_json(value) == text.encode()


def test_keys_sort_by_utf16_code_units_and_strings_escape_minimally():
    # RFC 8785 section 3.2.3's sorting example: U+1F600 (a surrogate pair) sorts before U+FB33.
    obj = {
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\U0001f600": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis",
    }
    keys = [k for k in json.loads(canonical_json(obj))]
    assert keys == ["\r", "1", "\u0080", "\u00f6", "\u20ac", "\U0001f600", "\ufb33"]
    assert (
        canonical_json({"a": 'é\n"\\\x01', "b": [True, None, 1]})
        == '{"a":"é\\n\\"\\\\\\u0001","b":[true,null,1]}'.encode()
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2**60, 2**53, -(2**53), {1: "x"}, b"bytes", "\ud800"])
def test_values_canonical_json_cannot_carry_are_refused(bad):
    # RFC 8785 section 3.2.2.3 / I-JSON: integers beyond +-(2**53 - 1) are not interoperable; store them as strings
    with pytest.raises(ValueError):
        canonical_json({"x": bad})


def test_the_largest_exact_integers_are_accepted():
    assert canonical_json([2**53 - 1, -(2**53 - 1)]) == b"[9007199254740991,-9007199254740991]"


def test_canonical_json_is_the_rfc8785_library():
    import rfc8785

    obj = {"b": [1.5, 1e21, "\u20ac"], "a": {"z": None, "\U0001f600": True}}
    assert canonical_json(obj) == rfc8785.dumps(obj)


def _manifest() -> dict:
    digest = hashlib.sha256(b"model").hexdigest()
    big = file_entry("model/m.gguf", CHUNK_SIZE + 5, digest, [digest, digest])
    k = hashlib.sha256(b"k").hexdigest()
    p = hashlib.sha256(b"p").hexdigest()
    return {
        "format": FORMAT,
        "name": "m",
        "chunk_size": CHUNK_SIZE,
        "toolchain": {},
        "runtime": runtime_identity("0.0.0", selftested=False),
        "provenance": "provenance.json",
        "kernels": [{"name": "norm", "path": "kernels/norm.fatbin", "sha256": k, "size": 1}],
        "model": {"path": "model/m.gguf", "sha256": digest, "size": CHUNK_SIZE + 5},
        "selftest": {"tokens": [1, 2], "argmax": 7, "top_ids": [7, 3], "top_logits": [12.5, 11.25], "logsumexp": 13.0},
        "files": [file_entry("kernels/norm.fatbin", 1, k, []), big, file_entry("provenance.json", 1, p, [])],
    }


def test_root_digest_is_model_signing_over_every_member_including_the_manifest_bytes():
    m = _manifest()
    data = seal(m)
    assert "root_digest" not in json.loads(data) and "manifest_digest" not in json.loads(data)
    digests = {f["name"]: bytes.fromhex(f["digest"]) for f in m["files"]} | {MANIFEST: hashlib.sha256(data).digest()}
    # model_signing orders resources by path components (PurePosixPath), then hashes the raw digests
    expect = hashlib.sha256(b"".join(digests[n] for n in sorted(digests, key=lambda n: n.split("/")))).hexdigest()
    assert m["root_digest"] == expect and m["manifest_digest"] == hashlib.sha256(data).hexdigest()
    assert parse_manifest(data) == m


def test_any_changed_field_changes_the_root():
    m = _manifest()
    seal(m)
    for mutate in (
        lambda x: x.__setitem__("name", "other"),
        lambda x: x["toolchain"].__setitem__("nvcc", "12.0"),
        lambda x: x["files"][0].__setitem__("size", 2),
        # the self-test record is what `verify --device` trusts: it must be covered by the root too
        lambda x: x["selftest"]["top_logits"].__setitem__(0, 99.0),
        lambda x: x["selftest"].__setitem__("argmax", 3),
        lambda x: x.pop("selftest"),
    ):
        other = {k: v for k, v in copy.deepcopy(m).items() if k not in DERIVED}
        mutate(other)
        seal(other)
        assert other["root_digest"] != m["root_digest"]


def test_derived_fields_are_never_stored():
    m = _manifest()
    seal(m)
    _refused(canonical_json(m), "field manifest_digest ")


def test_a_bundle_for_another_kernel_abi_is_incompatible():
    m = _manifest()
    assert check_runtime(m)["kernel_abi"] == KERNEL_ABI
    m["runtime"]["kernel_abi"] = KERNEL_ABI + 1
    with pytest.raises(IncompatibleError) as e:
        check_runtime(m)
    assert f"kernel ABI {KERNEL_ABI + 1}" in str(e.value) and "re-pack" in e.value.hint


def _refused(data: bytes, *words):
    with pytest.raises(VerificationError) as e:
        parse_manifest(data)
    for w in words:
        assert w in str(e.value)
    return e.value


def test_parse_refuses_non_canonical_bad_json_and_wrong_root():
    m = _manifest()
    data = seal(m)
    _refused(json.dumps({k: v for k, v in m.items() if k not in DERIVED}, indent=1).encode(), "canonical")
    _refused(data[:-1], "not valid UTF-8 JSON")
    stored = {k: v for k, v in m.items() if k not in DERIVED}
    _refused(data.replace(m["self_digest"].encode(), b"0" * 64), "self digest")
    _refused(canonical_json(stored | {"name": "renamed"}), "self digest")


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m["files"][0].__setitem__("size", "1"), "files[0].size"),
        (lambda m: m["files"][0].__setitem__("size", 2**50), "files[0].size"),
        (lambda m: m["files"][0].__setitem__("size", -1), "files[0].size"),
        (lambda m: m["files"][0].__setitem__("digest", "AB" * 32), "files[0].digest"),
        (lambda m: m["files"][0].__setitem__("digest", "ab" * 31), "files[0].digest"),
        (lambda m: m["files"][0].__setitem__("name", "../etc/passwd"), "files[0].name"),
        (lambda m: m["files"][0].__setitem__("name", "/abs"), "files[0].name"),
        (lambda m: m["files"][1].__setitem__("chunks", []), "files[1].chunks"),
        (lambda m: m["files"].reverse(), "files"),
        (lambda m: m.__setitem__("files", {}), "files"),
        (lambda m: m["model"].__setitem__("path", "model/other.gguf"), "model.path"),
        (lambda m: m["model"].__setitem__("size", 1), "model"),
        (lambda m: m["kernels"][0].__setitem__("name", "other"), "kernels[0].path"),
        (lambda m: m.pop("chunk_size"), "chunk_size"),
        (lambda m: m.__setitem__("selftest", [1]), "selftest"),
        (lambda m: m.pop("runtime"), "runtime"),
        (lambda m: m["runtime"].__setitem__("kernel_abi", "1"), "runtime.kernel_abi"),
        (lambda m: m["runtime"].__setitem__("kernel_abi", True), "runtime.kernel_abi"),
    ],
)
def test_schema_names_the_bad_field(mutate, field):
    m = _manifest()
    mutate(m)
    m["self_digest"] = "0" * 64
    _refused(canonical_json(m), f"field {field} ")


def test_unknown_format_is_refused_with_an_upgrade_hint():
    m = _manifest() | {"format": "ingot-bundle/v9", "self_digest": "0" * 64}
    err = _refused(canonical_json(m), "ingot-bundle/v9")
    assert "upgrade" in err.hint


def test_a_v1_bundle_is_refused_with_a_repack_hint():
    m = _manifest() | {"format": "ingot-bundle/v1", "root_digest": "0" * 64}
    err = _refused(canonical_json(m), "ingot-bundle/v1 is no longer read")
    assert "re-pack" in err.hint


def _resealed(m: dict) -> bytes:
    """A manifest with a consistent self digest around whatever the test put in it, so parsing gets past the
    digest check to the schema."""
    from ingot.runtime.bundle import manifest as manifest_mod

    m = {k: v for k, v in m.items() if k not in DERIVED and k != "self_digest"}
    return canonical_json(m | {"self_digest": manifest_mod._self_digest(m)})


# --- edges the mutation run found untested (tests/MUTATION.md) ----------------------------------------------


def test_number_edges():
    assert canonical_json(1.5e21) == b"1.5e+21" and canonical_json(-2.5e-7) == b"-2.5e-7"
    # RFC 8785 (the rfc8785 library): integers within +-(2**53 - 1), the exactly representable ones
    assert canonical_json(2**53 - 1) == b"9007199254740991" and canonical_json(-(2**53 - 1)) == b"-9007199254740991"
    for bad in (2**53, -(2**53), 2**53 + 1):
        with pytest.raises(ValueError, match="safe integer domain"):
            canonical_json(bad)
    with pytest.raises(ValueError, match="keys must be strings"):
        canonical_json({1: 2})


def test_hash_range_whole_and_per_chunk(tmp_path):
    from ingot.runtime.bundle.manifest import hash_range

    data = bytes(range(256)) * 3 + b"tail"  # 772 bytes
    p = tmp_path / "f"
    p.write_bytes(b"head" + data)
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    with open(p, "rb") as f:
        assert hash_range(f, 4, len(data)) == (sha(data), [])
        whole, chunks = hash_range(f, 4, len(data), chunk_size=100)
        assert whole == sha(data) and chunks == [sha(data[i : i + 100]) for i in range(0, len(data), 100)]
        whole, chunks = hash_range(f, 4, 700, chunk_size=100)  # an exact multiple: no empty last chunk
        assert chunks == [sha(data[i : i + 100]) for i in range(0, 700, 100)]
        seen = []
        hash_range(f, 4, len(data), chunk_size=100, on_bytes=seen.append)
        assert sum(seen) == len(data)
        with pytest.raises(EOFError, match="ends 10 bytes early"):
            hash_range(f, 4, len(data) + 10)


def test_member_names():
    from ingot.runtime.bundle.manifest import check_member_name

    assert check_member_name("kernels/a.fatbin") is None and check_member_name("x" * 255) is None
    assert check_member_name("") == "is empty"
    assert check_member_name("x" * 256) == "is longer than 255 characters"
    assert check_member_name("a\\b") == check_member_name("a\0b") == "contains a backslash or NUL"
    for name in ("a//b", "./a", "a/..", "a/"):
        assert check_member_name(name) == "contains an empty, '.' or '..' path component"


def test_file_entry_chunks_only_past_one_chunk():
    d = hashlib.sha256(b"").hexdigest()
    assert "chunks" not in file_entry("a", CHUNK_SIZE, d, [d])
    assert file_entry("a", CHUNK_SIZE + 1, d, [d, d])["chunks"] == [d, d]


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: m["files"].__setitem__(0, "kernels/norm.fatbin"), "files[0]"),
        (lambda m: m["files"][0].__setitem__("algorithm", "md5"), "files[0].algorithm"),
        (lambda m: m["files"][0].__setitem__("size", True), "files[0].size"),  # JSON true is not a number
        (lambda m: m["files"][0].__setitem__("name", "manifest.json"), "files[0].name"),
        (lambda m: m["files"][1].__setitem__("chunks", [1, 2]), "files[1].chunks"),
        (lambda m: m["files"][1].__setitem__("chunks", ["ab" * 32, "zz" * 32]), "files[1].chunks"),
        (lambda m: m["model"].__setitem__("path", "other/m.gguf"), "model.path"),
        (lambda m: m["model"].__setitem__("path", "model/m.bin"), "model.path"),
        (lambda m: m.__setitem__("model", []), "model"),
        (lambda m: m.__setitem__("kernels", {}), "kernels"),
        (lambda m: m["kernels"].__setitem__(0, "norm"), "kernels[0]"),
        (lambda m: m.pop("format"), "format"),
        (lambda m: m.pop("name"), "name"),
        (lambda m: m.pop("toolchain"), "toolchain"),
        (lambda m: m.__setitem__("provenance", 1), "provenance"),
        (lambda m: m.__setitem__("chunk_size", 1024), "chunk_size"),
        (lambda m: m["files"][0].__setitem__("name", 5), "files[0].name"),
        (lambda m: m["files"][0].__setitem__("algorithm", 5), "files[0].algorithm"),
        (lambda m: m["kernels"][0].__setitem__("name", 5), "kernels[0].name"),
        (lambda m: m["kernels"][0].__setitem__("size", 2), "kernels[0]"),  # disagrees with files
        (lambda m: m["kernels"].append(dict(m["kernels"][0])), "kernels[1].path"),  # a module named twice
        (lambda m: m["model"].__setitem__("sha256", "x"), "model.sha256"),
        (lambda m: m["model"].__setitem__("size", "1"), "model.size"),
        (lambda m: m["model"].__setitem__("path", 5), "model.path"),
        (
            lambda m: (m["model"].__setitem__("path", "model/m.bin"), m["files"][1].__setitem__("name", "model/m.bin")),
            "model.path",
        ),  # listed, but not a .gguf
    ],
)
def test_schema_names_more_bad_fields(mutate, field):
    m = _manifest()
    mutate(m)
    err = _refused(_resealed(m), f"field {field} ")
    assert "re-pack" in err.hint


def test_schema_messages():
    m = _manifest()
    m["files"][0]["name"] = "manifest.json"
    assert "files[0].name names the reserved member manifest.json" in str(_refused(_resealed(m)))
    m = _manifest() | {"self_digest": "XYZ"}
    assert "field self_digest is not a lowercase hex sha256 digest ('XYZ')" in str(_refused(canonical_json(m)))
    m = _manifest()
    m["model"]["path"] = m["files"][1]["name"] = "model/m.bin"
    assert "field model.path 'model/m.bin' is not model/<name>.gguf" in str(_refused(_resealed(m)))
    m = _manifest()
    m["files"] += [file_entry(f"x/{i:05d}", 1, "0" * 64, []) for i in range(MAX_MEMBERS - 3)]  # sorted after
    assert parse_manifest(seal(m)) == m  # exactly MAX_MEMBERS
    m["files"].insert(0, file_entry("a", 1, "0" * 64, []))
    assert f"field files lists {MAX_MEMBERS + 1} members (at most {MAX_MEMBERS})" in str(_refused(seal(m)))


def test_schema_accepts_edge_values():
    m = _manifest()
    m["files"][2]["size"] = CHUNK_SIZE  # one chunk: no chunk list
    assert parse_manifest(seal(m)) == m
    m = _manifest()
    m["files"][0]["size"] = m["kernels"][0]["size"] = 0  # an empty member is fine
    assert parse_manifest(seal(m)) == m
    m["files"][1]["size"] = m["model"]["size"] = 2 * CHUNK_SIZE  # exactly two chunks
    assert parse_manifest(seal(m)) == m


def test_every_refusal_carries_the_repack_hint():
    m = _manifest()
    data = seal(m)
    for bad in (
        data[:-1],
        json.dumps(m).encode(),
        canonical_json(m | {"name": "renamed"}),
        canonical_json(m | {"x": 1.5}).replace(b"1.5", b"1e999"),
    ):
        assert "re-pack" in _refused(bad).hint
