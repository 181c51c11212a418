"""The signature format and its verification: in-toto statements in DSSE envelopes, Ed25519 keys.

What is signed: an in-toto v1 Statement whose one subject is the bundle (name, digest = the manifest's root
digest), with the OpenSSF model_signing v1.0 predicate (`resources`: every file plus the manifest itself,
{name, algorithm, digest}, the list the root digest is computed over). The statement's canonical JSON is the
DSSE payload (payloadType application/vnd.in-toto+json); the signature is Ed25519 over
PAE(payloadType, payload) exactly as the DSSE protocol defines it.

Where: the member `signature.dsse.json` inside the bundle (not a sidecar), so a bundle stays one file. The
member holds {mediaType, dsseEnvelope, verificationMaterial}, shaped like a Sigstore bundle:
verificationMaterial carries the public key, so an unsigned-key `ingot verify` still detects a damaged
signature; only `--pubkey` authenticates the signer. Making signatures (private keys) is the toolchain's
(toolchain/sign.py); this module is what a target machine needs to check them.

keyid: sha256 (hex) of the public key's DER SubjectPublicKeyInfo, i.e. of the body of the .pub PEM file.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.bundle.manifest import SIGNATURE, canonical_json, resources
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.limits import bounded_json_loads

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
MEDIA_TYPE = "application/vnd.ingot.signature.v1+json"
_BAD_SIG = "the signature member was damaged or does not belong to this bundle; re-sign with `ingot sign`"


@dataclass(frozen=True)
class SignatureCheck:
    keyid: str
    authenticated: bool  # True: checked against a public key the caller supplied


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


def keyid_of_der(der: bytes) -> str:
    return hashlib.sha256(der).hexdigest()


def _pem_body(pem: bytes, label: str, where: str) -> bytes:
    """The DER inside a PEM block (no cryptography import: this is on open_bundle's path)."""
    text = pem.decode("ascii", errors="replace")
    begin, end = f"-----BEGIN {label}-----", f"-----END {label}-----"
    if begin not in text or end not in text:
        raise UsageError(f"{where} is not a PEM {label.lower()}", hint="pass the PREFIX.pub written by `ingot keygen`")
    body = text.split(begin, 1)[1].split(end, 1)[0]
    try:
        return base64.b64decode("".join(body.split()), validate=True)
    except binascii.Error:
        raise UsageError(f"{where}: damaged PEM body", hint="pass the PREFIX.pub written by `ingot keygen`") from None


def read_key_file(path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such {what} file", hint="create keys with `ingot keygen --out PREFIX`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a {what} file") from None


def keyid_of_pem_file(path) -> str:
    return keyid_of_der(_pem_body(read_key_file(path, "public key"), "PUBLIC KEY", str(path)))


# --- signers and verifiers----------------------------------------------------------------------------


class Signer(ABC):
    """Produces signatures and the verification material a verifier needs besides the envelope."""

    keyid: str

    @abstractmethod
    def sign(self, message: bytes) -> bytes: ...

    @abstractmethod
    def material(self) -> dict: ...


class Verifier(ABC):
    keyid: str

    @abstractmethod
    def verify(self, message: bytes, signature: bytes) -> bool: ...


class Ed25519Verifier(Verifier):
    def __init__(self, der: bytes, where: str):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            key = serialization.load_der_public_key(der)
        except ValueError:
            raise VerificationError(f"{where} does not hold a readable public key", hint=_BAD_SIG) from None
        if not isinstance(key, Ed25519PublicKey):
            raise VerificationError(f"{where} is not an Ed25519 public key", hint="use a key from `ingot keygen`")
        self._key = key
        self.keyid = keyid_of_der(der)
        self.where = where

    @classmethod
    def from_pem_file(cls, path) -> Ed25519Verifier:
        der = _pem_body(read_key_file(path, "public key"), "PUBLIC KEY", str(path))
        try:
            return cls(der, str(path))
        except VerificationError as e:
            raise UsageError(e.message, hint="pass the PREFIX.pub written by `ingot keygen`") from None

    def verify(self, message: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, message)
            return True
        except InvalidSignature:
            return False


def load_public_key(path) -> Ed25519Verifier:
    """A --pubkey file, parsed once: a bad key file is a usage error, whatever the bundle holds."""
    return Ed25519Verifier.from_pem_file(path)


# --- the signature document------------------------------------------------------------------------------


def sign_document(manifest: dict, signer: Signer) -> bytes:
    payload = canonical_json(statement(manifest))
    sig = signer.sign(pae(PAYLOAD_TYPE, payload))
    envelope = {
        "payload": base64.b64encode(payload).decode(),
        "payloadType": PAYLOAD_TYPE,
        "signatures": [{"keyid": signer.keyid, "sig": base64.b64encode(sig).decode()}],
    }
    return canonical_json(
        {"mediaType": MEDIA_TYPE, "dsseEnvelope": envelope, "verificationMaterial": signer.material()}
    )


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


def verify_signature_document(data: bytes, manifest: dict, trusted: Verifier | None = None) -> SignatureCheck:
    """Check the signature member against this manifest. trusted: the key the caller requires (from
    load_public_key); without one the signature is checked against the key it carries."""

    doc = bounded_json_loads(data, what=SIGNATURE, max_size=1 << 20, hint=_BAD_SIG)
    if _field(doc, "mediaType", str, "") != MEDIA_TYPE:
        raise VerificationError(f"{SIGNATURE}: unknown mediaType {doc['mediaType']!r}", hint=_BAD_SIG)
    env = _field(doc, "dsseEnvelope", dict, "")
    if _field(env, "payloadType", str, "dsseEnvelope.") != PAYLOAD_TYPE:
        raise VerificationError(f"{SIGNATURE}: payloadType is not {PAYLOAD_TYPE}", hint=_BAD_SIG)
    payload = _b64(_field(env, "payload", str, "dsseEnvelope."), "the payload")
    sigs = _field(env, "signatures", list, "dsseEnvelope.")
    if len(sigs) != 1:
        raise VerificationError(f"{SIGNATURE}: expected one signature, found {len(sigs)}", hint=_BAD_SIG)
    keyid = _field(sigs[0], "keyid", str, "signatures[0].")
    sig = _b64(_field(sigs[0], "sig", str, "signatures[0]."), "the signature")

    if trusted is not None:
        verifier = trusted
        if verifier.keyid != keyid:
            raise VerificationError(
                f"{SIGNATURE}: signed by key {keyid[:16]}..., not by --pubkey {verifier.where} "
                f"({verifier.keyid[:16]}...)",
                hint="pass the public key of the signer",
            )
    else:
        key = _field(_field(doc, "verificationMaterial", dict, ""), "publicKey", dict, "verificationMaterial.")
        der = _b64(_field(key, "rawBytes", str, "publicKey."), "the embedded public key")
        verifier = Ed25519Verifier(der, f"{SIGNATURE}: the embedded public key")
        if verifier.keyid != keyid:
            raise VerificationError(
                f"{SIGNATURE}: the embedded public key does not match keyid {keyid[:16]}...", hint=_BAD_SIG
            )
    if not verifier.verify(pae(PAYLOAD_TYPE, payload), sig):
        raise VerificationError(f"{SIGNATURE}: the Ed25519 signature does not verify", hint=_BAD_SIG)
    # Signed and intact: now the statement must be about this very manifest.
    signed = bounded_json_loads(payload, what=f"{SIGNATURE}: the signed payload", max_size=1 << 20, hint=_BAD_SIG)
    if signed != statement(manifest):
        raise VerificationError(
            f"{SIGNATURE}: the signature is valid but for a different bundle (signed root "
            f"digest differs from {manifest['root_digest'][:16]}...)",
            hint=_BAD_SIG,
        )
    return SignatureCheck(keyid=keyid, authenticated=trusted is not None)


def check_signature(envelope: bytes | None, manifest: dict, trusted: Verifier | None) -> SignatureCheck | None:
    """The signature member, if any: it must sign this manifest's root digest. With pubkey it must be by
    that key (and an unsigned bundle fails); without, it is checked against the key it carries."""
    if envelope is None:
        if trusted is not None:
            raise VerificationError(
                "bundle is unsigned but a signature by --pubkey was required",
                hint="sign it with `ingot sign BUNDLE --key PREFIX.key`",
            )
        return None
    return verify_signature_document(envelope, manifest, trusted)
