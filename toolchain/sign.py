"""`ingot keygen` and `ingot sign`: ECDSA P-256 (default) or Ed25519 key pairs, and re-packing a bundle with
its signature member.

The format (statement, DSSE envelope, Sigstore bundle) and its verification live in the runtime
(ingot.runtime.bundle.signature); making keys and signatures is here. The Sigstore bundle is built and
schema-checked with `sigstore-models` (the models sigstore-python parses bundles with; the `release` extra),
then written as canonical JSON. Signatures are deterministic (Ed25519 always; ECDSA with RFC 6979 nonces), so
signing the same bundle with the same key gives the same bytes. `ingot sign` re-packs deterministically and
atomically, putting the signature member in sorted position.

`--attach FILE` puts an existing Sigstore bundle, e.g. one `model_signing sign key` made over the extracted
bundle, in as the signature member, after checking that it signs this bundle (and, with --pubkey, by whom).
"""

from __future__ import annotations

import os
from pathlib import Path

from ingot.runtime.bundle.container import Source, open_file, read_index, read_member, write_bundle
from ingot.runtime.bundle.manifest import (
    MANIFEST,
    MAX_MANIFEST_SIZE,
    SIGNATURE,
    canonical_json,
    files_by_name,
    parse_manifest,
)
from ingot.runtime.bundle.signature import (
    PAYLOAD_TYPE,
    PublicKey,
    exact_form,
    key_hint,
    load_public_key,
    pae,
    read_key_file,
    sigstore_bundle_dict,
    statement,
    verify_signature_document,
)
from ingot.runtime.bundle.verify import check_member_set
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.files import write_atomic

ALGORITHMS = ("p256", "ed25519")
_RELEASE_EXTRA = "install the release extra: pip install '.[release]' in a checkout, or 'WHEEL.whl[release]'"


def keygen(prefix: str | Path, algorithm: str = "p256") -> dict:
    """PREFIX.key (PKCS8 PEM, mode 0600) and PREFIX.pub (SubjectPublicKeyInfo PEM); refuses to overwrite.
    p256: ECDSA on NIST P-256 (what model_signing's key mode verifies); ed25519: Ed25519."""
    from cryptography.hazmat.primitives import serialization  # deferred: only keygen/sign need cryptography
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown key algorithm {algorithm!r}", hint=f"choose one of {', '.join(ALGORITHMS)}")
    prefix = Path(prefix)
    key_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (key_path, pub_path):
        if p.exists():
            raise UsageError(f"{p} already exists", hint="choose another --out PREFIX, or remove the old key first")
    key = ec.generate_private_key(ec.SECP256R1()) if algorithm == "p256" else Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_atomic(key_path, private, mode=0o600)
    write_atomic(pub_path, public, mode=0o644)
    return {"key": str(key_path), "pub": str(pub_path), "algorithm": algorithm, "keyid": key_hint(public)}


class KeySigner:
    """A PREFIX.key: ECDSA P-256 (SHA-256, deterministic RFC 6979 nonces) or Ed25519."""

    def __init__(self, key_path: str | Path):
        from cryptography.hazmat.primitives import serialization  # deferred: see keygen
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        pem = read_key_file(key_path, "private key")
        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except TypeError:
            raise UsageError(f"{key_path} is encrypted", hint="use an unencrypted key from `ingot keygen`") from None
        except ValueError:
            raise UsageError(
                f"{key_path} is not a PEM private key", hint="pass PREFIX.key from `ingot keygen`"
            ) from None
        if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
            self.algorithm = "p256"
        elif isinstance(key, Ed25519PrivateKey):
            self.algorithm = "ed25519"
        else:
            raise UsageError(
                f"{key_path} is not an ECDSA P-256 or Ed25519 key", hint="create one with `ingot keygen --out PREFIX`"
            )
        self._key = key
        public = key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.keyid = key_hint(public)

    def sign(self, message: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes  # deferred: see keygen
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        key = self._key
        if isinstance(key, ec.EllipticCurvePrivateKey):
            return key.sign(message, ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
        assert isinstance(key, Ed25519PrivateKey)
        return key.sign(message)


def signature_document(manifest: dict, signer: KeySigner) -> bytes:
    """The signature member: a Sigstore bundle (v0.3) built and schema-checked with sigstore-models."""
    try:
        from sigstore_models.bundle.v1 import Bundle  # deferred: the `release` extra, only `ingot sign` needs it
    except ImportError:
        raise UsageError("`ingot sign` needs the sigstore-models package", hint=_RELEASE_EXTRA) from None

    payload = canonical_json(statement(manifest))
    doc = sigstore_bundle_dict(payload, signer.sign(pae(PAYLOAD_TYPE, payload)), signer.keyid)
    # Round-trip through the library's strict model (unknown or missing fields are errors), then write its
    # output as canonical JSON so the same signature always has the same bytes.
    checked = Bundle.from_dict(doc).to_dict()
    if checked != doc:
        raise AssertionError(f"sigstore-models rewrote the bundle: {checked} != {doc}")
    return canonical_json(checked)


def sign_bundle(
    bundle: str | Path,
    key: str | Path | None = None,
    out: str | Path | None = None,
    *,
    attach: str | Path | None = None,
    pubkey: str | Path | None = None,
) -> dict:
    """Verify the bundle's digests, then re-pack it with a signature member (replacing any old one): made with
    `key`, or the Sigstore bundle in file `attach` (checked against this bundle, and against pubkey if given)."""
    if (key is None) == (attach is None):
        raise UsageError("pass exactly one of --key and --attach", hint="ingot sign BUNDLE --key PREFIX.key")
    bundle = Path(bundle)
    out = Path(out) if out else bundle
    signer = KeySigner(key) if key is not None else None
    trusted: PublicKey | None = load_public_key(pubkey) if pubkey is not None else None
    attached = read_key_file(attach, "signature") if attach is not None else None
    with open_file(bundle) as f:
        index = read_index(f, os.fstat(f.fileno()).st_size)
        by_name = {m.name: m for m in index}
        if MANIFEST not in by_name:
            raise VerificationError(f"{bundle} has no {MANIFEST}", hint="pass a .ingot file made by `ingot pack`")
        manifest_bytes = read_member(f, by_name[MANIFEST], MAX_MANIFEST_SIZE)
        manifest = parse_manifest(manifest_bytes)
        check_member_set(index, manifest)
        if signer is not None:
            doc = signature_document(manifest, signer)
            keyid = signer.keyid
        else:
            assert attached is not None
            keyid = verify_signature_document(attached, manifest, trusted).keyid
            doc = exact_form(attached)  # the same signature in ingot's canonical form (what verify requires)
        # Every member is re-hashed while it is copied, so only bytes matching the signed manifest go out.
        listed = files_by_name(manifest)
        sources = [Source(MANIFEST, len(manifest_bytes), data=manifest_bytes), Source(SIGNATURE, len(doc), data=doc)]
        sources += [
            Source(m.name, m.size, file=f, offset=m.offset, sha256=listed[m.name]["digest"])
            for m in index
            if m.name in listed
        ]
        written = write_bundle(out, sources, mtime=by_name[MANIFEST].mtime)
    return {"bundle": str(out), "keyid": keyid, "root_digest": manifest["root_digest"]} | written
