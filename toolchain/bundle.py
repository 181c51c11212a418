"""Reading bundles, and load-time trust: `open_bundle` is what `ingot run/serve BUNDLE` call.

A bundle (`NAME.ingot`) is an uncompressed POSIX tar: manifest.json, kernels/<module>.fatbin, model/<name>.gguf,
provenance.json and, once signed, signature.dsse.json. Nothing is ever extracted: members are located by the
data offsets in their tar headers, small ones are read into memory, and the model is mapped in place by the
runtime (`load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size)`); pack aligns
the model's data to 4096 bytes for that.

Trust: open_bundle verifies every digest (and the signature, when a public key is given) before returning,
unless a verified-stamp says this exact file was already verified. A stamp is keyed by the file's real path,
size, mtime_ns, ctime_ns, inode, device and the manifest's root digest, so any change to the file means a
full re-verify. Stamps live in $INGOT_CACHE_DIR/verified (else $XDG_CACHE_HOME/ingot/verified); whoever can
write there can vouch for bundles, like whoever can write the user's files. Imports stay light (no numpy,
no rich, cryptography only to check a signature) because this is on the cold-start path.
"""
from __future__ import annotations

import json
import os
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError, VerificationError
from .files import cache_root, write_atomic
from .manifest import (MANIFEST, MAX_MANIFEST_SIZE, MAX_MEMBERS, SIGNATURE, check_member_name, parse_manifest,
                       sha256_hex)

STAMP_SCHEMA = "ingot-verified-v1"
MODEL_ALIGN = 4096
MAX_SIGNATURE_SIZE = 1 << 20
MAX_FATBIN_SIZE = 1 << 30
_PAX_KEYS = {"comment", "path", "size"}      # what pack writes: alignment padding, long names, sizes > 8 GiB
_DAMAGED = "the bundle is corrupt or was modified after packing; re-download or re-pack it"


@dataclass(frozen=True)
class Member:
    name: str
    offset: int     # of the member's data, from the start of the bundle file
    size: int
    mtime: int = 0  # from the tar header (pack writes SOURCE_DATE_EPOCH into every member)


@dataclass(frozen=True)
class OpenBundle:
    path: Path                  # as given
    manifest: dict
    model_path: Path            # the bundle file itself (real path): the GGUF is mapped in place from it
    model_offset: int           # byte range of the GGUF member inside the bundle, 4096-aligned
    model_size: int
    fatbins: dict[str, bytes]   # module name ("matvec") -> fatbin bytes, each checked against its digest
    verified: bool              # False only with allow_unverified=True and a failed check
    root_digest: str
    signer: str | None          # keyid of the public key the signature was checked against, if one was given


# --- the tar index -----------------------------------------------------------------------------------

def open_file(path: str | Path):
    """The bundle file, opened unbuffered for reading; UsageError when there is none."""
    try:
        return open(path, "rb", buffering=0)  # noqa: SIM115 (callers hold it in a with block)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such bundle", hint="make one with `ingot pack`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory", hint="pass a .ingot bundle file") from None


def is_bundle(path: Path) -> bool:
    """A tar archive (ustar magic) rather than a fatbin or a folder."""
    try:
        with open(path, "rb") as f:
            f.seek(257)
            return f.read(5) == b"ustar"
    except OSError:
        return False


def read_index(f, file_size: int) -> list[Member]:
    """Walk the tar headers of an open bundle (seeking over the data) and refuse anything that is not a
    plain, safely named, unique, complete regular file. Raises VerificationError naming the member."""
    members: list[Member] = []
    names: set[str] = set()
    f.seek(0)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except tarfile.ReadError as e:
        raise VerificationError(f"not an Ingot bundle: not a readable tar archive ({e})",
                                hint="pass a .ingot file made by `ingot pack`") from None
    with tar:
        while True:
            last = members[-1].name if members else None
            try:
                info = tar.next()
            except tarfile.ReadError as e:
                where = f"after member {last}" if last else "at the start"
                raise VerificationError(f"bundle is truncated or damaged {where} ({e})", hint=_DAMAGED) from None
            if info is None:
                break
            _check_member(info, names)
            if len(members) >= MAX_MEMBERS:
                raise VerificationError(f"bundle has more than {MAX_MEMBERS} members", hint=_DAMAGED)
            if info.offset_data + info.size > file_size:
                raise VerificationError(f"bundle is truncated: member {info.name} needs bytes up to "
                                        f"{info.offset_data + info.size:,} but the file has {file_size:,}",
                                        hint=_DAMAGED)
            names.add(info.name)
            members.append(Member(info.name, info.offset_data, info.size, int(info.mtime)))
        end = tar.offset
    _check_trailer(f, end, file_size, members)
    return members


def _check_member(info: tarfile.TarInfo, seen: set[str]) -> None:
    name = info.name
    if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        kind = ("a symlink" if info.issym() else "a hard link" if info.islnk() else "a directory" if info.isdir()
                else "a device file" if info.isdev() else f"of tar type {info.type!r}")
        raise VerificationError(f"member {name} is {kind}; bundles hold only regular files", hint=_DAMAGED)
    why = check_member_name(name)
    if why:
        raise VerificationError(f"member name {name!r} {why}", hint=_DAMAGED)
    if name in seen:
        raise VerificationError(f"member {name} appears twice", hint=_DAMAGED)
    extra = set(info.pax_headers) - _PAX_KEYS
    if extra:
        raise VerificationError(f"member {name} has unexpected pax header fields {sorted(extra)}", hint=_DAMAGED)


def _check_trailer(f, end: int, file_size: int, members: list[Member]) -> None:
    """After the last member only the end-of-archive zero blocks (at least two) may follow: anything else is
    a damaged header (tar stops reading there) or smuggled data."""
    f.seek(end)
    tail = f.read(file_size - end) if file_size - end <= 1 << 20 else None
    if tail is None or tail.strip(b"\0"):
        after = f"after member {members[-1].name}" if members else "at the start"
        raise VerificationError(f"bundle has a damaged tar header or stray data at offset {end:,} ({after})",
                                hint=_DAMAGED)
    if len(tail) < 1024:
        raise VerificationError(f"bundle is truncated: the end-of-archive marker after offset {end:,} is missing",
                                hint=_DAMAGED)


def read_member(f, member: Member, limit: int) -> bytes:
    if member.size > limit:
        raise VerificationError(f"member {member.name} is {member.size:,} bytes (at most {limit:,} expected)",
                                hint=_DAMAGED)
    f.seek(member.offset)
    data = f.read(member.size)
    if len(data) != member.size:
        raise VerificationError(f"bundle is truncated inside member {member.name}", hint=_DAMAGED)
    return data


def load_manifest(f, index: list[Member]) -> dict:
    by_name = {m.name: m for m in index}
    if MANIFEST not in by_name:
        raise VerificationError(f"bundle has no {MANIFEST}", hint="pass a .ingot file made by `ingot pack`")
    return parse_manifest(read_member(f, by_name[MANIFEST], MAX_MANIFEST_SIZE))


def read_signature(f, index: list[Member]) -> bytes | None:
    member = next((m for m in index if m.name == SIGNATURE), None)
    return read_member(f, member, MAX_SIGNATURE_SIZE) if member else None


# --- verified stamps ---------------------------------------------------------------------------------

def stamp_dir() -> Path:
    return cache_root() / "verified"


def _stamp_key(real: str, st: os.stat_result, root: str) -> dict:
    return {"schema": STAMP_SCHEMA, "path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev, "root_digest": root}


def _stamp_path(real: str) -> Path:
    return stamp_dir() / f"{sha256_hex(real.encode())[:32]}.json"


def read_stamp(real: str, st: os.stat_result, root: str) -> list[str] | None:
    """The keyids already checked for this exact file, or None when there is no valid stamp."""
    try:
        stamp = json.loads(_stamp_path(real).read_bytes())
        signers = stamp.pop("signers")
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return list(signers) if stamp == _stamp_key(real, st, root) and isinstance(signers, list) else None


def write_stamp(real: str, st: os.stat_result, root: str, signers: list[str]) -> None:
    """Atomically, keeping signers a still-valid stamp already lists; a cache that cannot be written only
    costs a re-verify next time."""
    path = _stamp_path(real)
    signers = signers + (read_stamp(real, st, root) or [])
    # Plain JSON, not canonical: nanosecond times exceed the 2**53 that canonical JSON numbers allow.
    data = json.dumps(_stamp_key(real, st, root) | {"signers": sorted(set(signers))}, sort_keys=True).encode()
    try:
        write_atomic(path, data)
    except OSError:
        pass


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
            print(f"WARNING: UNVERIFIED BUNDLE {given}: {e}. Running it anyway because verification was "
                  "explicitly disabled; its kernels and weights may not be what was packed.", file=sys.stderr)
        by_name = {m.name: m for m in index}
        fatbins = {}
        for k in manifest["kernels"]:
            if k["path"] not in by_name:       # only possible unverified: then the module is left out
                continue
            data = read_member(f, by_name[k["path"]], MAX_FATBIN_SIZE)
            if verified and sha256_hex(data) != k["sha256"]:   # the bytes we hand over are the checked ones
                raise VerificationError(f"member {k['path']} changed while the bundle was being opened",
                                        hint="do not modify a bundle while it is in use")
            fatbins[k["name"]] = data
        model = by_name.get(manifest["model"]["path"])
        if model is None:
            raise VerificationError(f"bundle has no model member {manifest['model']['path']}", hint=_DAMAGED)
    return OpenBundle(path=given, manifest=manifest, model_path=Path(real), model_offset=model.offset,
                      model_size=model.size, fatbins=fatbins, verified=verified, root_digest=root, signer=signer)


def _check(f, real: str, st: os.stat_result, index: list[Member], manifest: dict, pubkey) -> str | None:
    """Full verification unless stamped; returns the keyid of the checked signer (None without pubkey)."""
    root = manifest["root_digest"]
    signers = read_stamp(real, st, root)
    want = None
    if pubkey is not None:
        from .sign import keyid_of_pem_file
        want = keyid_of_pem_file(pubkey)
    if signers is not None and (want is None or want in signers):
        return want
    from .verify import check_members, check_signature
    if signers is None:
        check_members(f, index, manifest)
    sig = check_signature(read_signature(f, index), manifest, pubkey)
    write_stamp(real, st, root, [sig.keyid] if sig and sig.authenticated else [])
    return want
