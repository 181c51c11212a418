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
