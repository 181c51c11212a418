"""Signing: Ed25519 keys, in-toto statements in DSSE envelopes, and the signature member of a bundle.

What is signed: an in-toto v1 Statement whose one subject is the bundle (name, digest = the manifest's root
digest), with the OpenSSF model_signing v1.0 predicate (`resources`: every file plus the manifest itself,
{name, algorithm, digest}, the list the root digest is computed over). The statement's canonical JSON is the
DSSE payload (payloadType application/vnd.in-toto+json); the signature is Ed25519 over
PAE(payloadType, payload) exactly as the DSSE protocol defines it.

Where: the member `signature.dsse.json` inside the bundle (not a sidecar), so a bundle stays one file; pack
puts it in sorted position and `ingot sign` re-packs deterministically and atomically. Ed25519 signatures are
deterministic, so signing the same bundle with the same key gives the same bytes. The member holds
{mediaType, dsseEnvelope, verificationMaterial}, shaped like a Sigstore bundle: verificationMaterial carries
the public key, so an unsigned-key `ingot verify` still detects a damaged signature; only `--pubkey`
authenticates the signer. A keyless Sigstore signer would add a certificate and transparency-log entry to
verificationMaterial and implement Signer/Verifier below.

keyid: sha256 (hex) of the public key's DER SubjectPublicKeyInfo, i.e. of the body of the .pub PEM file.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path

from .errors import UsageError, VerificationError
from .files import write_atomic
from .manifest import SIGNATURE, canonical_json, resources

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
MEDIA_TYPE = "application/vnd.ingot.signature.v1+json"
_BAD_SIG = "the signature member was damaged or does not belong to this bundle; re-sign with `ingot sign`"


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
            "serialization": {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                              "ignore_paths": [SIGNATURE]},
            "resources": resources(manifest),
        },
    }


# --- keys --------------------------------------------------------------------------------------------

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


def _read(path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such {what} file", hint="create keys with `ingot keygen --out PREFIX`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory, not a {what} file") from None


def keyid_of_pem_file(path) -> str:
    return keyid_of_der(_pem_body(_read(path, "public key"), "PUBLIC KEY", str(path)))


def keygen(prefix: str | Path) -> dict:
    """PREFIX.key (PKCS8 PEM, mode 0600) and PREFIX.pub (SubjectPublicKeyInfo PEM); refuses to overwrite."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    prefix = Path(prefix)
    key_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (key_path, pub_path):
        if p.exists():
            raise UsageError(f"{p} already exists", hint="choose another --out PREFIX, or remove the old key first")
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_atomic(key_path, private, mode=0o600)
    write_atomic(pub_path, public, mode=0o644)
    return {"key": str(key_path), "pub": str(pub_path), "keyid": keyid_of_der(der)}


# --- signers and verifiers ---------------------------------------------------------------------------

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


class Ed25519Signer(Signer):
    def __init__(self, key_path: str | Path):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        pem = _read(key_path, "private key")
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except TypeError:
            raise UsageError(f"{key_path} is encrypted", hint="use an unencrypted key from `ingot keygen`") from None
        except ValueError:
            raise UsageError(f"{key_path} is not a PEM private key",
                             hint="pass PREFIX.key from `ingot keygen`") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise UsageError(f"{key_path} is not an Ed25519 key", hint="create one with `ingot keygen --out PREFIX`")
        self._key = key
        self._der = key.public_key().public_bytes(serialization.Encoding.DER,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo)
        self.keyid = keyid_of_der(self._der)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def material(self) -> dict:
        return {"publicKey": {"algorithm": "ed25519", "keyid": self.keyid,
                              "rawBytes": base64.b64encode(self._der).decode()}}


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

    @classmethod
    def from_pem_file(cls, path) -> Ed25519Verifier:
        der = _pem_body(_read(path, "public key"), "PUBLIC KEY", str(path))
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


# --- the signature document ------------------------------------------------------------------------------

def sign_document(manifest: dict, signer: Signer) -> bytes:
    payload = canonical_json(statement(manifest))
    sig = signer.sign(pae(PAYLOAD_TYPE, payload))
    envelope = {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                "signatures": [{"keyid": signer.keyid, "sig": base64.b64encode(sig).decode()}]}
    return canonical_json({"mediaType": MEDIA_TYPE, "dsseEnvelope": envelope,
                           "verificationMaterial": signer.material()})


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


def verify_signature_document(data: bytes, manifest: dict, pubkey=None):
    """Check the signature member against this manifest; returns verify.SignatureCheck."""
    from .verify import SignatureCheck

    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise VerificationError(f"{SIGNATURE} is not valid UTF-8 JSON", hint=_BAD_SIG) from None
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

    if pubkey is not None:
        verifier = Ed25519Verifier.from_pem_file(pubkey)
        if verifier.keyid != keyid:
            raise VerificationError(f"{SIGNATURE}: signed by key {keyid[:16]}..., not by --pubkey {pubkey} "
                                    f"({verifier.keyid[:16]}...)", hint="pass the public key of the signer")
    else:
        key = _field(_field(doc, "verificationMaterial", dict, ""), "publicKey", dict, "verificationMaterial.")
        der = _b64(_field(key, "rawBytes", str, "publicKey."), "the embedded public key")
        verifier = Ed25519Verifier(der, f"{SIGNATURE}: the embedded public key")
        if verifier.keyid != keyid:
            raise VerificationError(f"{SIGNATURE}: the embedded public key does not match keyid {keyid[:16]}...",
                                    hint=_BAD_SIG)
    if not verifier.verify(pae(PAYLOAD_TYPE, payload), sig):
        raise VerificationError(f"{SIGNATURE}: the Ed25519 signature does not verify", hint=_BAD_SIG)
    # Signed and intact: now the statement must be about this very manifest.
    try:
        signed = json.loads(payload)
    except ValueError:
        raise VerificationError(f"{SIGNATURE}: the signed payload is not JSON", hint=_BAD_SIG) from None
    if signed != statement(manifest):
        raise VerificationError(f"{SIGNATURE}: the signature is valid but for a different bundle (signed root "
                                f"digest differs from {manifest['root_digest'][:16]}...)", hint=_BAD_SIG)
    return SignatureCheck(keyid=keyid, authenticated=pubkey is not None)


def sign_bundle(bundle: str | Path, key: str | Path, out: str | Path | None = None) -> dict:
    """Verify the bundle's digests, then re-pack it with a signature member (replacing any old one)."""
    from .bundle import open_file, read_index, read_member
    from .manifest import MANIFEST, MAX_MANIFEST_SIZE, files_by_name, parse_manifest
    from .pack import Source, write_bundle
    from .verify import check_member_set

    bundle = Path(bundle)
    out = Path(out) if out else bundle
    signer = Ed25519Signer(key)
    with open_file(bundle) as f:
        index = read_index(f, os.fstat(f.fileno()).st_size)
        by_name = {m.name: m for m in index}
        if MANIFEST not in by_name:
            raise VerificationError(f"{bundle} has no {MANIFEST}", hint="pass a .ingot file made by `ingot pack`")
        manifest_bytes = read_member(f, by_name[MANIFEST], MAX_MANIFEST_SIZE)
        manifest = parse_manifest(manifest_bytes)
        check_member_set(index, manifest)
        doc = sign_document(manifest, signer)
        # Every member is re-hashed while it is copied, so only bytes matching the signed manifest go out.
        listed = files_by_name(manifest)
        sources = [Source(MANIFEST, len(manifest_bytes), data=manifest_bytes),
                   Source(SIGNATURE, len(doc), data=doc)]
        sources += [Source(m.name, m.size, file=f, offset=m.offset, sha256=listed[m.name]["digest"])
                    for m in index if m.name in listed]
        written = write_bundle(out, sources, mtime=by_name[MANIFEST].mtime)
    return {"bundle": str(out), "keyid": signer.keyid, "root_digest": manifest["root_digest"]} | written
