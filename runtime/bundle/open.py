"""Load-time trust: `open_bundle` is what `ingot run/serve BUNDLE` call.

open_bundle verifies every digest (and the signature, when a public key is given) before returning, unless
a verified-stamp (stamps.py) says this exact file was already verified. Imports stay light (no numpy, no rich,
cryptography only to check a signature) because this is on the cold-start path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ingot.runtime.bundle.container import (
    DAMAGED,
    MAX_FATBIN_SIZE,
    Member,
    check_canonical,
    load_manifest,
    open_file,
    read_index,
    read_member,
    read_signature,
)
from ingot.runtime.bundle.manifest import SIGNATURE, check_runtime, sha256_hex
from ingot.runtime.bundle.signature import PublicKey, load_public_key
from ingot.runtime.bundle.stamps import read_stamp, write_stamp
from ingot.runtime.bundle.verify import check_members, check_signature_member
from ingot.runtime.errors import VerificationError


@dataclass(frozen=True)
class OpenBundle:
    path: Path  # as given
    manifest: dict
    model_path: Path  # the bundle file itself (real path), for messages: map the GGUF from `file`, never by path
    file: BinaryIO  # the open descriptor that was verified; the model is mapped from it (then close() it)
    model_offset: int  # byte range of the GGUF member inside the bundle, 4096-aligned
    model_size: int
    fatbins: dict[str, bytes]  # module name ("matvec") -> fatbin bytes, each checked against its digest
    verified: bool  # False only with allow_unverified=True and a failed check
    root_digest: str
    signer: str | None  # keyid of the trusted key the signature was checked against, if a policy was given
    signed: bool = False  # carries a signature member (checked at least against the key it embeds)

    def close(self) -> None:
        """Close the verified descriptor (a map made from it stays valid)."""
        self.file.close()

    def __enter__(self) -> OpenBundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- open_bundle -----------------------------------------------------------------------------------------


def open_bundle(
    path: str | Path,
    *,
    allow_unverified: bool = False,
    pubkey: str | Path | None = None,
    pubkeys: Sequence[str | Path] = (),
) -> OpenBundle:
    """Verify a bundle (or trust a valid stamp) and return what the runtime needs to load it.

    pubkey / pubkeys: PEM public key files (the trust policy); with any, the bundle must carry a valid
    signature by one of them. allow_unverified: on a digest or signature failure, warn loudly on stderr and
    return verified=False instead of raising. A bundle whose structure or manifest cannot be read raises
    VerificationError always.

    Everything is read through one descriptor, kept open in the result (`file`): the runtime maps the model
    from it, so the bytes that run are the bytes verified even if `path` is renamed over meanwhile. The caller
    closes it (OpenBundle.close, or `with`) once the model is mapped.
    """
    given = Path(path)
    real = os.path.realpath(given)
    keys = [*([pubkey] if pubkey is not None else []), *pubkeys]
    trusted = [load_public_key(k) for k in keys]  # a bad key file is a usage error, whatever the bundle holds
    f = open_file(real)
    try:
        return _open(f, given, real, allow_unverified, trusted)
    except BaseException:
        f.close()
        raise


def _open(f, given: Path, real: str, allow_unverified: bool, trusted: Sequence[PublicKey]) -> OpenBundle:
    st = os.fstat(f.fileno())  # the stamp is keyed by this descriptor's identity, never by a fresh stat(path)
    index = read_index(f, st.st_size)
    manifest = load_manifest(f, index)
    root = manifest["root_digest"]
    signer, verified = None, True
    try:
        signer = _check(f, real, st, index, manifest, trusted)
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
        file=f,
        model_offset=model.offset,
        model_size=model.size,
        fatbins=fatbins,
        verified=verified,
        root_digest=root,
        signer=signer,
        signed=SIGNATURE in by_name,
    )


def _check(f, real: str, st: os.stat_result, index: list[Member], manifest: dict, trusted: Sequence[PublicKey]):
    """Full verification unless stamped; returns the keyid of the trusted signer (None without a policy)."""
    root = manifest["root_digest"]
    signers = read_stamp(real, st, root)
    wanted = {t.keyid for t in trusted}
    if signers is not None and not wanted:
        return None
    if signers is not None and wanted & set(signers):
        return sorted(wanted & set(signers))[0]
    if signers is None:
        check_members(f, index, manifest)
        check_canonical(f, index, st.st_size)  # every byte outside member data (verify.py)
    envelope = read_signature(f, index)
    if not trusted:
        check_signature_member(envelope, manifest, None)
        write_stamp(real, st, root, [])
        return None
    error: VerificationError | None = None
    for key in trusted:  # the policy: a valid signature by any one of the trusted keys
        try:
            sig = check_signature_member(envelope, manifest, key)
        except VerificationError as e:
            error = error or e
            continue
        write_stamp(real, st, root, [sig.keyid] if sig else [])
        return key.keyid
    assert error is not None
    if len(trusted) > 1 and envelope is not None:
        raise VerificationError(
            f"bundle is not signed by any of the {len(trusted)} trusted keys ({error.message})", hint=error.hint
        )
    raise error
