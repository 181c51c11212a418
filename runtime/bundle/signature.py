"""The signature format and its verification: Sigstore bundles (v0.3) holding a DSSE envelope of an in-toto
statement, signed with an ECDSA (P-256, P-384, P-521) or Ed25519 key.

What is signed: an in-toto v1 Statement whose one subject is the bundle (name, digest = the root digest),
with the OpenSSF model_signing v1.0 predicate (`serialization`: files, sha256, no symlinks, the signature
member ignored; `resources`: every member but the signature, {name, algorithm, digest}, the list the root
digest is computed over). The statement's canonical JSON is the DSSE payload (payloadType
application/vnd.in-toto+json); the signature is over PAE(payloadType, payload) exactly as the DSSE protocol
defines it (ECDSA signatures DER-encoded, with SHA-256/384/512 by curve size, like model_signing).

Where: the member `signature.sigstore.json` inside the bundle, a Sigstore bundle in its v0.3 JSON form
(mediaType application/vnd.dev.sigstore.bundle.v0.3+json; verificationMaterial.publicKey.hint; no
transparency-log entries). That is what `model_signing sign key` writes, so `model_signing verify key` checks
an Ingot signature on the extracted bundle, and `ingot verify --pubkey` checks one model_signing made.

The key hint (keyid) is model_signing's: the sha256 (hex) of the public key's SubjectPublicKeyInfo PEM, as
`ingot keygen` writes PREFIX.pub. A Sigstore bundle names its key but does not carry it, so only `--pubkey`
checks the signature bytes; without it `verify` still checks that the signed statement is about this bundle.
Keyless signatures (a Fulcio certificate and a Rekor entry instead of a key hint) are refused here: verify
those with `sigstore verify` or `model_signing verify sigstore` on the extracted bundle.

Making signatures (private keys) is the toolchain's (toolchain/sign.py); this module is what a target machine
needs to check them, with no dependency beyond `cryptography`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.bundle.manifest import SIGNATURE, canonical_json, resources
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.limits import bounded_json_loads

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
_MEDIA_TYPES = (MEDIA_TYPE, "application/vnd.dev.sigstore.bundle+json;version=0.3")
_BAD_SIG = "the signature member was damaged or does not belong to this bundle; re-sign with `ingot sign`"
_KEY_HINT = "pass a PEM public key (PREFIX.pub from `ingot keygen`: ECDSA P-256 or Ed25519)"
# curve -> the hash model_signing (and Sigstore's key details) pair with it
_EC_HASHES = {"secp256r1": "SHA256", "secp384r1": "SHA384", "secp521r1": "SHA512"}


@dataclass(frozen=True)
class SignatureCheck:
    keyid: str  # the signature's key hint ("" when it names none)
    authenticated: bool  # True: the signature bytes were checked against a public key the caller supplied


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 Pre-Authentication Encoding: "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)


def statement(manifest: dict) -> dict:
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": manifest["name"], "digest": {"sha256": manifest["root_digest"]}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": [SIGNATURE],
            },
            "resources": resources(manifest),
        },
    }


# --- keys---------------------------------------------------------------------------------------------


def key_hint(public_pem: bytes) -> str:
    """model_signing's public-key hint: sha256 (hex) of the SubjectPublicKeyInfo PEM bytes."""
    return hashlib.sha256(public_pem).hexdigest()


def read_key_file(path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such {what} file", hint="create keys with `ingot keygen --out PREFIX`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a {what} file") from None
    except OSError as e:  # unreadable (permissions, I/O): still the user's file to fix
        raise UsageError(f"{path}: cannot read the {what} file ({e.strerror or e})") from None


class PublicKey:
    """A --pubkey: ECDSA (P-256/384/521) or Ed25519, with its hint; checks DSSE signatures."""

    def __init__(self, pem: bytes, where: str):
        # deferred: cryptography is only needed when a key is given, and open_bundle is on the cold-start path
        from cryptography.exceptions import UnsupportedAlgorithm
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if b"-----BEGIN PUBLIC KEY-----" not in pem:
            raise UsageError(f"{where} is not a PEM public key", hint=_KEY_HINT)
        try:
            key = serialization.load_pem_public_key(pem)
        except ValueError:
            raise UsageError(f"{where}: damaged PEM public key", hint=_KEY_HINT) from None
        except UnsupportedAlgorithm:  # e.g. an EC key on a curve cryptography does not implement
            raise UsageError(f"{where} is not an ECDSA P-256/384/521 or Ed25519 public key", hint=_KEY_HINT) from None
        if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in _EC_HASHES:
            self.algorithm = f"ecdsa-{key.curve.name}"
        elif isinstance(key, Ed25519PublicKey):
            self.algorithm = "ed25519"
        else:
            raise UsageError(f"{where} is not an ECDSA P-256/384/521 or Ed25519 public key", hint=_KEY_HINT)
        self._key = key
        canonical = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.keyid = key_hint(canonical)
        self.where = where

    def verify(self, message: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature  # deferred: see __init__
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        try:
            if isinstance(self._key, ec.EllipticCurvePublicKey):
                algorithm = getattr(hashes, _EC_HASHES[self._key.curve.name])()
                self._key.verify(signature, message, ec.ECDSA(algorithm))
            else:
                self._key.verify(signature, message)
            return True
        except InvalidSignature:
            return False


def load_public_key(path) -> PublicKey:
    """A --pubkey file, parsed once: a bad key file is a usage error, whatever the bundle holds."""
    return PublicKey(read_key_file(path, "public key"), str(path))


# --- the signature document------------------------------------------------------------------------------


def sigstore_bundle_dict(payload: bytes, signature: bytes, hint: str) -> dict:
    """The Sigstore bundle (v0.3, JSON form) of one DSSE signature by the key with this hint."""
    return {
        "mediaType": MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": hint}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": hint}],
        },
    }


def _field(obj, key: str, types, where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, types):
        raise VerificationError(f"{SIGNATURE}: {where}{key} is missing or malformed", hint=_BAD_SIG)
    return value


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise VerificationError(f"{SIGNATURE}: {where} is not valid base64", hint=_BAD_SIG) from None


def _signed_resources(signed) -> tuple[dict, str] | None:
    """({name: (algorithm, digest)}, subject sha256) of a model_signing v1.0 statement over sha256 files."""
    try:
        ser = signed["predicate"]["serialization"]
        if signed["_type"] != STATEMENT_TYPE or signed["predicateType"] != PREDICATE_TYPE:
            return None
        if ser["method"] != "files" or ser["hash_type"] != "sha256" or len(signed["subject"]) != 1:
            return None
        out = {r["name"]: (r["algorithm"], r["digest"]) for r in signed["predicate"]["resources"]}
        root = signed["subject"][0]["digest"]["sha256"]
        return (out, root) if len(out) == len(signed["predicate"]["resources"]) else None
    except (KeyError, TypeError, IndexError):
        return None


@dataclass(frozen=True)
class Envelope:
    """What a signature member says: the DSSE payload, the signature over PAE(payload), the key hint."""

    payload: bytes
    sig: bytes
    hint: str


def parse_signature_document(data: bytes) -> Envelope:
    """The signature member (a Sigstore bundle v0.3 with a public-key hint and one DSSE signature), read with
    bounded size and depth; VerificationError naming what is malformed."""
    doc = bounded_json_loads(data, what=SIGNATURE, max_size=1 << 20, hint=_BAD_SIG)
    media = _field(doc, "mediaType", str, "")
    if media not in _MEDIA_TYPES:
        raise VerificationError(
            f"{SIGNATURE}: mediaType {media!r} is not a Sigstore bundle v0.3", hint="re-sign with `ingot sign`"
        )
    material = _field(doc, "verificationMaterial", dict, "")
    if "publicKey" not in material:
        raise VerificationError(
            f"{SIGNATURE} is a keyless (certificate) Sigstore signature, which Ingot does not verify",
            hint="check it with `sigstore verify` or `model_signing verify sigstore` on the extracted bundle",
        )
    hint = _field(material, "publicKey", dict, "verificationMaterial.").get("hint")
    hint = "" if hint is None else hint  # a signature may name no key; then --pubkey decides alone
    if not isinstance(hint, str):
        raise VerificationError(f"{SIGNATURE}: verificationMaterial.publicKey.hint is malformed", hint=_BAD_SIG)
    env = _field(doc, "dsseEnvelope", dict, "")
    if _field(env, "payloadType", str, "dsseEnvelope.") != PAYLOAD_TYPE:
        raise VerificationError(f"{SIGNATURE}: payloadType is not {PAYLOAD_TYPE}", hint=_BAD_SIG)
    payload = _b64(_field(env, "payload", str, "dsseEnvelope."), "the payload")
    sigs = _field(env, "signatures", list, "dsseEnvelope.")
    if len(sigs) != 1:
        raise VerificationError(f"{SIGNATURE}: expected one signature, found {len(sigs)}", hint=_BAD_SIG)
    sig = _b64(_field(sigs[0], "sig", str, "signatures[0]."), "the signature")
    return Envelope(payload, sig, hint)


def exact_form(data: bytes) -> bytes:
    """The bytes `ingot sign` writes for this signature member: the same payload, signature and key hint in
    ingot's canonical Sigstore bundle. A member whose bytes differ carries something no signature covers (the
    root digest leaves the signature member out, and the signature covers only the payload), so verify
    refuses it; `ingot sign --attach` stores a model_signing signature in this form."""
    e = parse_signature_document(data)
    return canonical_json(sigstore_bundle_dict(e.payload, e.sig, e.hint))


def verify_signature_document(data: bytes, manifest: dict, trusted: PublicKey | None = None) -> SignatureCheck:
    """Check the signature member against this bundle. trusted: the key the caller requires (from
    load_public_key); without one only the statement's binding to this bundle is checked."""
    e = parse_signature_document(data)
    payload, sig, hint = e.payload, e.sig, e.hint

    if trusted is not None:
        if hint and hint != trusted.keyid:
            raise VerificationError(
                f"{SIGNATURE}: signed by key {hint[:16]}..., not by --pubkey {trusted.where} ({trusted.keyid[:16]}...)",
                hint="pass the public key of the signer",
            )
        if not trusted.verify(pae(PAYLOAD_TYPE, payload), sig):
            raise VerificationError(
                f"{SIGNATURE}: the {trusted.algorithm} signature does not verify with --pubkey {trusted.where}",
                hint=_BAD_SIG,
            )
    # The statement must be about this very bundle: its resources and root digest.
    signed = bounded_json_loads(payload, what=f"{SIGNATURE}: the signed payload", max_size=1 << 20, hint=_BAD_SIG)
    got = _signed_resources(signed)
    if got is None:
        raise VerificationError(
            f"{SIGNATURE}: the signed payload is not a model_signing v1.0 statement over sha256 files",
            hint=_BAD_SIG,
        )
    ours = {r["name"]: (r["algorithm"], r["digest"]) for r in resources(manifest)}
    if got != (ours, manifest["root_digest"]):
        raise VerificationError(
            f"{SIGNATURE}: the signature is for a different bundle (signed root digest differs from "
            f"{manifest['root_digest'][:16]}...)",
            hint=_BAD_SIG,
        )
    return SignatureCheck(keyid=trusted.keyid if trusted else hint, authenticated=trusted is not None)


def check_signature(envelope: bytes | None, manifest: dict, trusted: PublicKey | None) -> SignatureCheck | None:
    """The signature member, if any: it must sign this bundle's root digest. With pubkey it must be by
    that key (and an unsigned bundle fails); without, only its binding to this bundle is checked."""
    if envelope is None:
        if trusted is not None:
            raise VerificationError(
                "bundle is unsigned but a signature by --pubkey was required",
                hint="sign it with `ingot sign BUNDLE --key PREFIX.key`",
            )
        return None
    return verify_signature_document(envelope, manifest, trusted)
