"""Load-time trust: `open_bundle` is what `ingot run/serve BUNDLE` call.

open_bundle verifies every digest (and the signature, when a public key is given) before returning, unless
a verified-stamp (stamps.py) says this exact file was already verified. Imports stay light (no numpy, no rich,
cryptography only to check a signature) because this is on the cold-start path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.bundle.container import (
    DAMAGED,
    MAX_FATBIN_SIZE,
    Member,
    load_manifest,
    open_file,
    read_index,
    read_member,
    read_signature,
)
from ingot.runtime.bundle.manifest import check_runtime, sha256_hex
from ingot.runtime.bundle.signature import check_signature, load_public_key
from ingot.runtime.bundle.stamps import read_stamp, write_stamp
from ingot.runtime.bundle.verify import check_members
from ingot.runtime.errors import VerificationError


@dataclass(frozen=True)
class OpenBundle:
    path: Path  # as given
    manifest: dict
    model_path: Path  # the bundle file itself (real path): the GGUF is mapped in place from it
    model_offset: int  # byte range of the GGUF member inside the bundle, 4096-aligned
    model_size: int
    fatbins: dict[str, bytes]  # module name ("matvec") -> fatbin bytes, each checked against its digest
    verified: bool  # False only with allow_unverified=True and a failed check
    root_digest: str
    signer: str | None  # keyid of the public key the signature was checked against, if one was given


# --- open_bundle -----------------------------------------------------------------------------------------


def open_bundle(path: str | Path, *, allow_unverified: bool = False, pubkey: str | Path | None = None) -> OpenBundle:
    """Verify a bundle (or trust a valid stamp) and return what the runtime needs to load it.

    pubkey: a PEM public key file; then the bundle must carry a valid signature by that key.
    allow_unverified: on a digest or signature failure, warn loudly on stderr and return verified=False
    instead of raising. A bundle whose structure or manifest cannot be read raises VerificationError always.
    """
    given = Path(path)
    real = os.path.realpath(given)
    with open_file(real) as f:
        st = os.fstat(f.fileno())
        index = read_index(f, st.st_size)
        manifest = load_manifest(f, index)
        root = manifest["root_digest"]
        signer, verified = None, True
        try:
            signer = _check(f, real, st, index, manifest, pubkey)
        except VerificationError as e:
            if not allow_unverified:
                raise
            verified = False
            print(
                f"WARNING: UNVERIFIED BUNDLE {given}: {e}. Running it anyway because verification was "
                "explicitly disabled; its kernels and weights may not be what was packed.",
                file=sys.stderr,
            )
        check_runtime(manifest)  # an intact bundle for another kernel ABI still cannot run here (exit 3)
        by_name = {m.name: m for m in index}
        fatbins = {}
        for k in manifest["kernels"]:
            if k["path"] not in by_name:  # only possible unverified: then the module is left out
                continue
            data = read_member(f, by_name[k["path"]], MAX_FATBIN_SIZE)
            if verified and sha256_hex(data) != k["sha256"]:  # the bytes we hand over are the checked ones
                raise VerificationError(
                    f"member {k['path']} changed while the bundle was being opened",
                    hint="do not modify a bundle while it is in use",
                )
            fatbins[k["name"]] = data
        model = by_name.get(manifest["model"]["path"])
        if model is None:
            raise VerificationError(f"bundle has no model member {manifest['model']['path']}", hint=DAMAGED)
    return OpenBundle(
        path=given,
        manifest=manifest,
        model_path=Path(real),
        model_offset=model.offset,
        model_size=model.size,
        fatbins=fatbins,
        verified=verified,
        root_digest=root,
        signer=signer,
    )


def _check(f, real: str, st: os.stat_result, index: list[Member], manifest: dict, pubkey) -> str | None:
    """Full verification unless stamped; returns the keyid of the checked signer (None without pubkey)."""
    root = manifest["root_digest"]
    signers = read_stamp(real, st, root)
    trusted = load_public_key(pubkey) if pubkey is not None else None
    want = trusted.keyid if trusted is not None else None
    if signers is not None and (want is None or want in signers):
        return want
    if signers is None:
        check_members(f, index, manifest)
    sig = check_signature(read_signature(f, index), manifest, trusted)
    write_stamp(real, st, root, [sig.keyid] if sig and sig.authenticated else [])
    return want
