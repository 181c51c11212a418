"""`ingot keygen` and `ingot sign`: Ed25519 key pairs, and re-packing a bundle with its signature member.

The format (statement, DSSE envelope, verification material) and its verification live in the runtime
(ingot.runtime.bundle.signature); only making keys and signatures is here. `ingot sign` re-packs
deterministically and atomically, putting the signature member in sorted position; Ed25519 signatures are
deterministic, so signing the same bundle with the same key gives the same bytes.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

from ingot.runtime.bundle.container import Source, open_file, read_index, read_member, write_bundle
from ingot.runtime.bundle.manifest import MANIFEST, MAX_MANIFEST_SIZE, SIGNATURE, files_by_name, parse_manifest
from ingot.runtime.bundle.signature import Signer, keyid_of_der, read_key_file, sign_document
from ingot.runtime.bundle.verify import check_member_set
from ingot.runtime.errors import UsageError, VerificationError
from ingot.runtime.files import write_atomic


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
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_atomic(key_path, private, mode=0o600)
    write_atomic(pub_path, public, mode=0o644)
    return {"key": str(key_path), "pub": str(pub_path), "keyid": keyid_of_der(der)}


class Ed25519Signer(Signer):
    def __init__(self, key_path: str | Path):
        from cryptography.hazmat.primitives import serialization
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
        if not isinstance(key, Ed25519PrivateKey):
            raise UsageError(f"{key_path} is not an Ed25519 key", hint="create one with `ingot keygen --out PREFIX`")
        self._key = key
        self._der = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.keyid = keyid_of_der(self._der)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)

    def material(self) -> dict:
        return {
            "publicKey": {"algorithm": "ed25519", "keyid": self.keyid, "rawBytes": base64.b64encode(self._der).decode()}
        }


def sign_bundle(bundle: str | Path, key: str | Path, out: str | Path | None = None) -> dict:
    """Verify the bundle's digests, then re-pack it with a signature member (replacing any old one)."""
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
        sources = [Source(MANIFEST, len(manifest_bytes), data=manifest_bytes), Source(SIGNATURE, len(doc), data=doc)]
        sources += [
            Source(m.name, m.size, file=f, offset=m.offset, sha256=listed[m.name]["digest"])
            for m in index
            if m.name in listed
        ]
        written = write_bundle(out, sources, mtime=by_name[MANIFEST].mtime)
    return {"bundle": str(out), "keyid": signer.keyid, "root_digest": manifest["root_digest"]} | written
