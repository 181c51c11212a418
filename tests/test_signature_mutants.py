"""runtime/bundle/signature.py unit by unit: every refusal of a malformed signature member (its exact message and
hint), trusted-key checks, exact_form, the signed statement, PAE, key loading, and what counts as a model_signing
statement. No bundle is packed: the documents are built with sigstore_bundle_dict and signed here."""

from __future__ import annotations

import base64
import copy
import json

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, x25519
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ingot.runtime.bundle.manifest import canonical_json
from ingot.runtime.bundle.signature import (
    PublicKey,
    SignatureCheck,
    _signed_resources,
    check_signature,
    exact_form,
    key_hint,
    load_public_key,
    pae,
    parse_signature_document,
    read_key_file,
    sigstore_bundle_dict,
    statement,
    verify_signature_document,
)
from ingot.runtime.errors import UsageError, VerificationError

SIG = "signature.sigstore.json"
BAD_SIG = "the signature member was damaged or does not belong to this bundle; re-sign with `ingot sign`"
KEY_HINT = "pass a PEM public key (PREFIX.pub from `ingot keygen`: ECDSA P-256 or Ed25519)"
IN_TOTO = "application/vnd.in-toto+json"
D1, D2, D3 = "11" * 32, "22" * 32, "33" * 32
ROOT = "ab" * 32


def _manifest(root: str = ROOT) -> dict:
    return {
        "name": "toy-model",
        "root_digest": root,
        "manifest_digest": D3,
        "files": [
            {"name": "weights/model.gguf", "algorithm": "sha256", "digest": D1},
            {"name": "kernels/sm_90.fatbin", "algorithm": "sha256", "digest": D2},
        ],
    }


def _pem(private) -> bytes:
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _sign(private, message: bytes) -> bytes:
    if isinstance(private, ec.EllipticCurvePrivateKey):
        h = {"secp256r1": hashes.SHA256, "secp384r1": hashes.SHA384, "secp521r1": hashes.SHA512}
        return private.sign(message, ec.ECDSA(h[private.curve.name]()))
    return private.sign(message)


@pytest.fixture(scope="module")
def p256():
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture(scope="module")
def other():
    return ec.generate_private_key(ec.SECP256R1())


def _payload(manifest: dict | None = None) -> bytes:
    return canonical_json(statement(manifest or _manifest()))


def _document(private, payload: bytes | None = None, hint: str | None = None) -> dict:
    payload = _payload() if payload is None else payload
    hint = key_hint(_pem(private)) if hint is None else hint
    return sigstore_bundle_dict(payload, _sign(private, pae(IN_TOTO, payload)), hint)


def _bytes(doc) -> bytes:
    return json.dumps(doc).encode()


def _refused(data: bytes, *args, error=VerificationError) -> tuple[str, str | None]:
    with pytest.raises(error) as e:
        verify_signature_document(data, _manifest(), *args)
    return e.value.message, e.value.hint


# --- PAE and the statement ---------------------------------------------------------------------------------


def test_pae_is_the_dsse_v1_encoding():
    # secure-systems-lab/dsse protocol.md's example, then lengths in bytes (UTF-8), not characters
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    assert pae("t\u00e9", b"") == b"DSSEv1 3 t\xc3\xa9 0 "


def test_statement_is_the_model_signing_v1_statement_of_the_bundle():
    assert statement(_manifest()) == {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": "toy-model", "digest": {"sha256": ROOT}}],
        "predicateType": "https://model_signing/signature/v1.0",
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": [SIG],
            },
            "resources": [
                {"name": "kernels/sm_90.fatbin", "algorithm": "sha256", "digest": D2},
                {"name": "manifest.json", "algorithm": "sha256", "digest": D3},
                {"name": "weights/model.gguf", "algorithm": "sha256", "digest": D1},
            ],
        },
    }


# --- keys ----------------------------------------------------------------------------------------------------


def test_a_missing_key_file_is_a_usage_error_that_says_how_to_make_one(tmp_path):
    with pytest.raises(UsageError) as e:
        load_public_key(tmp_path / "nope.pub")
    assert e.value.message == f"{tmp_path / 'nope.pub'}: no such public key file"
    assert e.value.hint == "create keys with `ingot keygen --out PREFIX`"


def test_a_directory_is_not_a_key_file(tmp_path):
    with pytest.raises(UsageError) as e:
        read_key_file(tmp_path, "private key")
    assert (e.value.message, e.value.hint) == (f"{tmp_path} is a directory, not a private key file", None)
    with pytest.raises(UsageError) as e:
        load_public_key(tmp_path)
    assert str(e.value) == f"{tmp_path} is a directory, not a public key file"


def test_read_key_file_returns_the_bytes(tmp_path):
    (tmp_path / "k").write_bytes(b"\x00key")
    assert read_key_file(tmp_path / "k", "public key") == b"\x00key"


@pytest.mark.parametrize(
    ("pem", "message"),
    [
        (b"hello", "{} is not a PEM public key"),
        (b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "{} is not a PEM public key"),
        (b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "{}: damaged PEM public key"),
    ],
    ids=["not-pem", "private-pem", "damaged"],
)
def test_a_key_file_that_is_not_a_public_key_is_refused(tmp_path, pem, message):
    path = tmp_path / "release.pub"
    path.write_bytes(pem)
    with pytest.raises(UsageError) as e:
        load_public_key(path)
    assert (e.value.message, e.value.hint) == (message.format(path), KEY_HINT)


@pytest.mark.parametrize(
    "make",
    [lambda: ec.generate_private_key(ec.SECP256K1()), x25519.X25519PrivateKey.generate],
    ids=["secp256k1", "x25519"],
)
def test_an_unsupported_key_type_is_refused(make):
    with pytest.raises(UsageError) as e:
        PublicKey(_pem(make()), "k.pub")
    assert (e.value.message, e.value.hint) == (
        "k.pub is not an ECDSA P-256/384/521 or Ed25519 public key",
        KEY_HINT,
    )


@pytest.mark.parametrize(
    ("make", "algorithm"),
    [
        (lambda: ec.generate_private_key(ec.SECP256R1()), "ecdsa-secp256r1"),
        (lambda: ec.generate_private_key(ec.SECP384R1()), "ecdsa-secp384r1"),
        (lambda: ec.generate_private_key(ec.SECP521R1()), "ecdsa-secp521r1"),
        (Ed25519PrivateKey.generate, "ed25519"),
    ],
    ids=["p256", "p384", "p521", "ed25519"],
)
def test_supported_keys_load_and_verify_a_signature(tmp_path, make, algorithm):
    private = make()
    path = tmp_path / "release.pub"
    # the hint is over the canonical PEM, whatever line endings / trailing text the file has
    path.write_bytes(_pem(private).replace(b"\n", b"\r\n") + b"comment\n")
    key = load_public_key(path)
    assert key.algorithm == algorithm
    assert key.where == str(path)
    assert key.keyid == key_hint(_pem(private))
    assert key.verify(b"message", _sign(private, b"message"))
    assert not key.verify(b"other message", _sign(private, b"message"))
    check = verify_signature_document(_bytes(_document(private)), _manifest(), key)
    assert check == SignatureCheck(keyid=key.keyid, authenticated=True)


# --- parsing the signature member ----------------------------------------------------------------------------


def test_a_signature_member_of_more_than_1_mib_is_refused():
    with pytest.raises(VerificationError) as e:
        parse_signature_document(b" " * ((1 << 20) + 1))
    assert (e.value.message, e.value.hint) == (f"{SIG} is 1,048,577 bytes (at most 1,048,576)", BAD_SIG)


def test_a_signature_member_that_is_not_json_is_refused():
    with pytest.raises(VerificationError) as e:
        parse_signature_document(b"not json")
    assert e.value.message == f"{SIG} is not valid UTF-8 JSON (Expecting value: line 1 column 1 (char 0))"
    assert e.value.hint == BAD_SIG


def _set(doc: dict, path: str, value) -> dict:
    """A copy of doc with the value at a dotted path replaced (value ... deletes the key)."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        last = int(last)
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return doc


MALFORMED = [
    # (dotted path, new value (... deletes it), the field named in the message)
    ("mediaType", ..., "mediaType"),
    ("mediaType", 3, "mediaType"),
    ("verificationMaterial", ..., "verificationMaterial"),
    ("verificationMaterial", [], "verificationMaterial"),
    ("verificationMaterial.publicKey", "abc", "verificationMaterial.publicKey"),
    ("verificationMaterial.publicKey", None, "verificationMaterial.publicKey"),
    ("dsseEnvelope", ..., "dsseEnvelope"),
    ("dsseEnvelope", "abc", "dsseEnvelope"),
    ("dsseEnvelope.payloadType", ..., "dsseEnvelope.payloadType"),
    ("dsseEnvelope.payloadType", 1, "dsseEnvelope.payloadType"),
    ("dsseEnvelope.payload", ..., "dsseEnvelope.payload"),
    ("dsseEnvelope.payload", ["x"], "dsseEnvelope.payload"),
    ("dsseEnvelope.signatures", ..., "dsseEnvelope.signatures"),
    ("dsseEnvelope.signatures", {"sig": "AA=="}, "dsseEnvelope.signatures"),
    ("dsseEnvelope.signatures.0.sig", ..., "signatures[0].sig"),
    ("dsseEnvelope.signatures.0.sig", 7, "signatures[0].sig"),
    ("dsseEnvelope.signatures.0", "AA==", "signatures[0].sig"),  # not an object
    ("dsseEnvelope.signatures.0", None, "signatures[0].sig"),
]


@pytest.mark.parametrize(("path", "value", "field"), MALFORMED)
def test_each_missing_or_malformed_field_is_named(p256, path, value, field):
    data = _bytes(_set(_document(p256), path, value))
    with pytest.raises(VerificationError) as e:
        parse_signature_document(data)
    assert (e.value.message, e.value.hint) == (f"{SIG}: {field} is missing or malformed", BAD_SIG)
    assert str(e.value) == f"{SIG}: {field} is missing or malformed ({BAD_SIG})"


@pytest.mark.parametrize("doc", [[], "a string", 3, None], ids=["list", "str", "int", "null"])
def test_a_document_that_is_not_an_object_is_refused(doc):
    with pytest.raises(VerificationError) as e:
        parse_signature_document(json.dumps(doc).encode())
    assert (e.value.message, e.value.hint) == (f"{SIG}: mediaType is missing or malformed", BAD_SIG)


@pytest.mark.parametrize("media", ["application/json", "application/vnd.dev.sigstore.bundle.v0.2+json", ""])
def test_a_media_type_other_than_sigstore_bundle_v0_3_is_refused(p256, media):
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(_set(_document(p256), "mediaType", media)))
    assert e.value.message == f"{SIG}: mediaType {media!r} is not a Sigstore bundle v0.3"
    assert e.value.hint == "re-sign with `ingot sign`"


def test_both_spellings_of_the_v0_3_media_type_are_accepted(p256):
    doc = _set(_document(p256), "mediaType", "application/vnd.dev.sigstore.bundle+json;version=0.3")
    assert parse_signature_document(_bytes(doc)).hint == key_hint(_pem(p256))


def test_a_keyless_signature_is_refused_with_where_to_check_it(p256):
    doc = _set(_document(p256), "verificationMaterial", {"certificate": {"rawBytes": "AA=="}, "tlogEntries": []})
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(doc))
    assert e.value.message == f"{SIG} is a keyless (certificate) Sigstore signature, which Ingot does not verify"
    assert e.value.hint == (
        "check it with `sigstore verify` or `model_signing verify sigstore` on the extracted bundle"
    )


@pytest.mark.parametrize("hint", [5, ["a"], {"a": 1}, True])
def test_a_key_hint_that_is_not_a_string_is_refused(p256, hint):
    doc = _set(_document(p256), "verificationMaterial.publicKey", {"hint": hint})
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(doc))
    assert (e.value.message, e.value.hint) == (f"{SIG}: verificationMaterial.publicKey.hint is malformed", BAD_SIG)


@pytest.mark.parametrize("public_key", [{}, {"hint": ""}, {"hint": None}])
def test_no_key_hint_reads_as_the_empty_hint(p256, public_key):
    doc = _set(_document(p256), "verificationMaterial.publicKey", public_key)
    assert parse_signature_document(_bytes(doc)).hint == ""


@pytest.mark.parametrize("kind", ["application/json", "application/vnd.in-toto+JSON", ""])
def test_a_payload_type_other_than_in_toto_is_refused(p256, kind):
    doc = _set(_document(p256), "dsseEnvelope.payloadType", kind)
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(doc))
    assert (e.value.message, e.value.hint) == (f"{SIG}: payloadType is not {IN_TOTO}", BAD_SIG)


@pytest.mark.parametrize("text", ["aGVsbG8*", "aGVs bG8=", "aGVsbG8", "a"], ids=["star", "space", "unpadded", "one"])
@pytest.mark.parametrize(
    ("path", "what"),
    [("dsseEnvelope.payload", "the payload"), ("dsseEnvelope.signatures.0.sig", "the signature")],
    ids=["payload", "sig"],
)
def test_text_that_is_not_strict_base64_is_refused(p256, text, path, what):
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(_set(_document(p256), path, text)))
    assert (e.value.message, e.value.hint) == (f"{SIG}: {what} is not valid base64", BAD_SIG)


@pytest.mark.parametrize("n", [0, 2, 3])
def test_exactly_one_signature_is_required(p256, n):
    one = _document(p256)["dsseEnvelope"]["signatures"][0]
    doc = _set(_document(p256), "dsseEnvelope.signatures", [one] * n)
    with pytest.raises(VerificationError) as e:
        parse_signature_document(_bytes(doc))
    assert (e.value.message, e.value.hint) == (f"{SIG}: expected one signature, found {n}", BAD_SIG)


def test_parse_returns_the_payload_signature_and_hint(p256):
    doc = _document(p256, payload=b"\x00\xffpayload", hint="the-hint")
    e = parse_signature_document(_bytes(doc))
    assert e.payload == b"\x00\xffpayload"
    assert e.sig == base64.b64decode(doc["dsseEnvelope"]["signatures"][0]["sig"])
    assert e.hint == "the-hint"


# --- exact_form ------------------------------------------------------------------------------------------------


def test_exact_form_of_what_ingot_sign_writes_is_itself(p256):
    data = canonical_json(_document(p256))
    assert exact_form(data) == data


def test_exact_form_drops_what_no_signature_covers(p256):
    doc = _document(p256)
    canonical = canonical_json(doc)
    extra = copy.deepcopy(doc)
    extra["mediaType"] = "application/vnd.dev.sigstore.bundle+json;version=0.3"
    extra["verificationMaterial"]["tlogEntries"] = [{"logIndex": "1"}]
    extra["dsseEnvelope"]["signatures"][0]["keyid"] = "someone else"
    extra["note"] = "not signed"
    assert exact_form(json.dumps(extra, indent=2).encode()) == canonical
    no_hint = _set(doc, "verificationMaterial.publicKey", {})
    assert json.loads(exact_form(_bytes(no_hint))) == _set(doc, "verificationMaterial.publicKey", {"hint": ""}) | {
        "dsseEnvelope": {**doc["dsseEnvelope"], "signatures": [{**doc["dsseEnvelope"]["signatures"][0], "keyid": ""}]}
    }


def test_exact_form_refuses_what_parse_refuses(p256):
    with pytest.raises(VerificationError) as e:
        exact_form(_bytes(_set(_document(p256), "dsseEnvelope.signatures", [])))
    assert e.value.message == f"{SIG}: expected one signature, found 0"


# --- verification against the bundle and a trusted key --------------------------------------------------------


def test_a_signature_of_this_bundle_verifies_with_and_without_the_key(p256):
    key = PublicKey(_pem(p256), "release.pub")
    data = _bytes(_document(p256))
    assert verify_signature_document(data, _manifest()) == SignatureCheck(keyid=key.keyid, authenticated=False)
    assert verify_signature_document(data, _manifest(), key) == SignatureCheck(keyid=key.keyid, authenticated=True)
    assert check_signature(data, _manifest(), key) == SignatureCheck(keyid=key.keyid, authenticated=True)
    assert check_signature(None, _manifest(), None) is None


def test_a_hintless_signature_checked_with_a_key_reports_that_key(p256):
    key = PublicKey(_pem(p256), "release.pub")
    data = _bytes(_document(p256, hint=""))
    assert verify_signature_document(data, _manifest()) == SignatureCheck(keyid="", authenticated=False)
    assert verify_signature_document(data, _manifest(), key) == SignatureCheck(keyid=key.keyid, authenticated=True)


def test_a_signature_naming_another_key_is_refused_before_its_bytes_are_checked(p256, other):
    key = PublicKey(_pem(other), "other.pub")
    hint = key_hint(_pem(p256))
    assert _refused(_bytes(_document(p256)), key) == (
        f"{SIG}: signed by key {hint[:16]}..., not by --pubkey other.pub ({key.keyid[:16]}...)",
        "pass the public key of the signer",
    )


@pytest.mark.parametrize("make", [lambda: ec.generate_private_key(ec.SECP384R1()), Ed25519PrivateKey.generate])
def test_a_signature_that_does_not_verify_names_the_algorithm_and_key(p256, make):
    key = PublicKey(_pem(make()), "trusted.pub")
    # signed by p256 but naming the trusted key (or no key): the bytes are checked and fail
    for hint in (key.keyid, ""):
        assert _refused(_bytes(_document(p256, hint=hint)), key) == (
            f"{SIG}: the {key.algorithm} signature does not verify with --pubkey trusted.pub",
            BAD_SIG,
        )


def test_a_tampered_payload_does_not_verify(p256):
    key = PublicKey(_pem(p256), "release.pub")
    doc = _document(p256)
    doc["dsseEnvelope"]["payload"] = base64.b64encode(_payload(_manifest(root="cd" * 32))).decode()
    assert _refused(_bytes(doc), key) == (
        f"{SIG}: the ecdsa-secp256r1 signature does not verify with --pubkey release.pub",
        BAD_SIG,
    )


def test_a_signed_payload_that_is_not_json_is_refused(p256):
    assert _refused(_bytes(_document(p256, payload=b"not json"))) == (
        f"{SIG}: the signed payload is not valid UTF-8 JSON (Expecting value: line 1 column 1 (char 0))",
        BAD_SIG,
    )


NOT_A_STATEMENT = f"{SIG}: the signed payload is not a model_signing v1.0 statement over sha256 files"


def _statement_with(path: str, value) -> bytes:
    return canonical_json(_set(statement(_manifest()), path, value))


def _duplicated_resource() -> bytes:
    s = statement(_manifest())
    s["predicate"]["resources"].insert(0, s["predicate"]["resources"][-1])
    return canonical_json(s)


STATEMENT_CASES = {
    "type": ("_type", "https://in-toto.io/Statement/v0.1"),
    "predicate-type": ("predicateType", "https://slsa.dev/provenance/v1"),
    "method": ("predicate.serialization.method", "shards"),
    "hash-type": ("predicate.serialization.hash_type", "blake2b"),
    "two-subjects": ("subject", [statement(_manifest())["subject"][0]] * 2),
    "no-subject": ("subject", []),
    "no-serialization": ("predicate.serialization", ...),
    "no-resources": ("predicate.resources", ...),
    "resource-without-digest": ("predicate.resources.0.digest", ...),
    "subject-without-sha256": ("subject.0.digest", {"sha512": ROOT}),
    "predicate-not-object": ("predicate", ["a"]),
}


@pytest.mark.parametrize("case", [*STATEMENT_CASES, "duplicate-resource", "not-an-object"])
def test_a_payload_that_is_not_a_model_signing_statement_is_refused(p256, case):
    if case == "duplicate-resource":
        payload = _duplicated_resource()
    elif case == "not-an-object":
        payload = b"[1, 2]"
    else:
        payload = _statement_with(*STATEMENT_CASES[case])
    assert _signed_resources(json.loads(payload)) is None
    assert _refused(_bytes(_document(p256, payload=payload))) == (NOT_A_STATEMENT, BAD_SIG)
    assert _refused(_bytes(_document(p256, payload=payload)), PublicKey(_pem(p256), "k.pub")) == (
        NOT_A_STATEMENT,
        BAD_SIG,
    )


def test_signed_resources_of_a_statement():
    assert _signed_resources(statement(_manifest())) == (
        {
            "kernels/sm_90.fatbin": ("sha256", D2),
            "manifest.json": ("sha256", D3),
            "weights/model.gguf": ("sha256", D1),
        },
        ROOT,
    )
    assert _signed_resources(_set(statement(_manifest()), "predicate.resources", [])) == ({}, ROOT)


@pytest.mark.parametrize(
    "manifest",
    [
        _manifest(root="cd" * 32),
        {**_manifest(), "manifest_digest": D1},
        {**_manifest(), "files": _manifest()["files"][:1]},
        {**_manifest(), "files": [*_manifest()["files"], {"name": "x", "algorithm": "sha256", "digest": D1}]},
    ],
    ids=["root", "manifest-digest", "fewer-files", "more-files"],
)
def test_a_signature_of_another_bundle_is_refused(p256, manifest):
    data = _bytes(_document(p256))
    for trusted in (None, PublicKey(_pem(p256), "k.pub")):
        with pytest.raises(VerificationError) as e:
            verify_signature_document(data, manifest, trusted)
        assert (e.value.message, e.value.hint) == (
            f"{SIG}: the signature is for a different bundle (signed root digest differs from "
            f"{manifest['root_digest'][:16]}...)",
            BAD_SIG,
        )


def test_an_unsigned_bundle_fails_only_when_a_key_is_required(p256):
    key = PublicKey(_pem(p256), "k.pub")
    with pytest.raises(VerificationError) as e:
        check_signature(None, _manifest(), key)
    assert (e.value.message, e.value.hint) == (
        "bundle is unsigned but a signature by --pubkey was required",
        "sign it with `ingot sign BUNDLE --key PREFIX.key`",
    )


def test_a_key_on_a_curve_cryptography_cannot_load_is_a_usage_error():
    """An EC key on a curve cryptography does not implement (secp224k1 here, built by hand) used to end in
    `internal error: UnsupportedAlgorithm` (exit 1); it is the user's key file to fix: UsageError (exit 2)."""
    import base64

    from ingot.runtime.bundle.signature import PublicKey
    from ingot.runtime.errors import UsageError

    # SubjectPublicKeyInfo: id-ecPublicKey with namedCurve secp224k1 (1.3.132.0.32), an uncompressed point
    point = b"\x04" + b"\x01" * 56
    algo = bytes.fromhex("301006072a8648ce3d020106052b81040020")
    bitstring = b"\x03" + bytes([len(point) + 1]) + b"\x00" + point
    body = algo + bitstring
    der = b"\x30" + bytes([len(body)]) + body
    pem = b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(der) + b"-----END PUBLIC KEY-----\n"
    with pytest.raises(UsageError, match="is not an ECDSA P-256/384/521 or Ed25519 public key"):
        PublicKey(pem, "k.pub")


def test_a_non_string_key_hint_is_malformed_even_when_falsy():
    from ingot.runtime.bundle.signature import parse_signature_document, sigstore_bundle_dict

    for bad in (0, False, [], {}):
        doc = sigstore_bundle_dict(b"{}", b"sig", "")
        doc["verificationMaterial"]["publicKey"]["hint"] = bad
        with pytest.raises(VerificationError, match="publicKey.hint is malformed"):
            parse_signature_document(json.dumps(doc).encode())
