"""`ingot verify`: stream every member of a bundle, recompute its digests, check the root digest and the
signature, and name exactly what is wrong.

Order of checks: the tar structure (container.read_index: only unique, safely named regular files, nothing
after the end), the manifest (canonical form, schema, root digest), the member set (every listed file
present, nothing extra), sizes, then the sha256 of every member with 8 MiB reads, the signature, and last
the container's canonical form (container.check_canonical: every byte outside member data is exactly what
`ingot pack` writes), so together every byte of the file is checked. A member whose digest is
wrong is re-read chunk by chunk (64 MiB) to name the damaged chunk. Nothing is extracted to disk.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ingot.runtime.bundle.container import DAMAGED as _DAMAGED
from ingot.runtime.bundle.container import (
    Member,
    check_canonical,
    load_manifest,
    open_file,
    read_index,
    read_signature,
)
from ingot.runtime.bundle.manifest import (
    CHUNK_SIZE,
    MANIFEST,
    SIGNATURE,
    check_runtime,
    files_by_name,
    hash_range,
)
from ingot.runtime.bundle.signature import PublicKey, check_signature, exact_form, load_public_key
from ingot.runtime.bundle.stamps import write_stamp
from ingot.runtime.errors import IngotError, VerificationError


class MemberError(VerificationError):
    """Members whose bytes differ from the manifest; `problems` lists each {member, chunk, bytes}."""

    def __init__(self, message: str, problems: list[dict], *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.problems = problems


def check_member_set(index: list[Member], manifest: dict) -> None:
    listed = files_by_name(manifest)
    present = {m.name for m in index}
    missing = sorted(set(listed) - present)
    extra = sorted(present - set(listed) - {MANIFEST, SIGNATURE})
    if missing:
        raise VerificationError(
            f"member {missing[0]} is listed in the manifest but missing from the bundle"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            hint=_DAMAGED,
        )
    if extra:
        raise VerificationError(
            f"member {extra[0]} is in the bundle but not in the manifest"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
            hint=_DAMAGED,
        )
    for m in index:
        if m.name in listed and listed[m.name]["size"] != m.size:
            raise VerificationError(
                f"member {m.name} is {m.size:,} bytes but the manifest says {listed[m.name]['size']:,}", hint=_DAMAGED
            )


def check_members(f, index: list[Member], manifest: dict, on_bytes=None) -> None:
    """Every listed member's sha256; raises MemberError naming each bad member and chunk."""
    check_member_set(index, manifest)
    listed = files_by_name(manifest)
    problems = []
    for m in index:
        entry = listed.get(m.name)
        if entry is None:
            continue
        try:
            digest, _ = hash_range(f, m.offset, m.size, on_bytes=on_bytes)
        except EOFError:
            raise VerificationError(f"bundle is truncated inside member {m.name}", hint=_DAMAGED) from None
        if digest != entry["digest"]:
            problems.extend(_locate(f, m, entry))
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise MemberError(
            f"member {first['member']}: sha256 mismatch in {first['where']}{more}", problems, hint=_DAMAGED
        )


def _locate(f, m: Member, entry: dict) -> list[dict]:
    """Which 64 MiB chunks of a bad member differ; the whole member when it has no chunk digests, or when
    every chunk matches (then the manifest's digests disagree with each other, or the file just changed)."""
    whole = [{"member": m.name, "chunk": None, "bytes": [0, m.size], "where": f"the whole member ({m.size:,} bytes)"}]
    if "chunks" not in entry:
        return whole
    _, chunks = hash_range(f, m.offset, m.size, chunk_size=CHUNK_SIZE)
    n = len(chunks)
    out = []
    for i, (got, want) in enumerate(zip(chunks, entry["chunks"], strict=True)):
        if got != want:
            lo, hi = i * CHUNK_SIZE, min((i + 1) * CHUNK_SIZE, m.size)
            out.append(
                {
                    "member": m.name,
                    "chunk": i,
                    "bytes": [lo, hi],
                    "where": f"chunk {i} of {n} (bytes {lo:,}-{hi - 1:,})",
                }
            )
    return out or whole


def check_signature_member(envelope: bytes | None, manifest: dict, trusted: PublicKey | None):
    """check_signature (the statement's binding to this bundle always, the signature bytes with a trusted key),
    then the member's exact form, so every byte of it counts (see _check_exact_form)."""
    try:
        sig = check_signature(envelope, manifest, trusted)
        if envelope is not None:
            _check_exact_form(envelope)
    except IngotError:
        raise
    except Exception as e:  # a library error on a damaged member (cryptography, base64): still exit 4, one line
        raise VerificationError(
            f"{SIGNATURE} is unreadable ({type(e).__name__}: {str(e)[:100]})", hint=_DAMAGED
        ) from None
    return sig


def _check_exact_form(envelope: bytes) -> None:
    """The signature member must be byte for byte what `ingot sign` writes (signature.exact_form): the root
    digest leaves the member out and the signature covers only its payload, so without this a byte changed in,
    say, the key hint's neighbourhood or the JSON's spacing would pass, and every byte must count."""
    if exact_form(envelope) != envelope:
        raise VerificationError(f"{SIGNATURE} is not in the exact form `ingot sign` writes", hint=_DAMAGED)


def verify_bundle(path: str | Path, *, pubkey=None, on_bytes=None) -> dict:
    """Full verification of one bundle file; returns the report `ingot verify --json` prints."""
    path = Path(path)
    t0 = time.perf_counter()
    trusted = load_public_key(pubkey) if pubkey is not None else None
    with open_file(path) as f:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        st = os.fstat(f.fileno())
        size = st.st_size
        index = read_index(f, size)
        manifest = load_manifest(f, index)
        check_members(f, index, manifest, on_bytes=on_bytes)
        sig = check_signature_member(read_signature(f, index), manifest, trusted)
        # The digests cover member data; this covers every other byte (headers, padding, end-of-archive).
        check_canonical(f, index, size)
    runtime = check_runtime(manifest)  # intact, but can this runtime run it? (exit 3 when not)
    # A full pass also vouches for this exact file to open_bundle (`ingot run` right after starts fast).
    write_stamp(os.path.realpath(path), st, manifest["root_digest"], [sig.keyid] if sig and sig.authenticated else [])
    seconds = time.perf_counter() - t0
    hashed = sum(e["size"] for e in manifest["files"])
    return {
        "ok": True,
        "bundle": str(path),
        "name": manifest["name"],
        "size": size,
        "root_digest": manifest["root_digest"],
        "members": len(index),
        "hashed_bytes": hashed,
        "seconds": round(seconds, 3),
        "mb_per_s": round(hashed / 1e6 / seconds, 1) if seconds else None,
        "signature": None if sig is None else {"keyid": sig.keyid, "authenticated": sig.authenticated},
        "runtime": runtime,
    }
