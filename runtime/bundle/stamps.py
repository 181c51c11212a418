"""The verified-stamp cache: a bundle file already verified is not hashed again until it changes.

A stamp is keyed by the file's real path, size, mtime_ns, ctime_ns, inode, device and the manifest's root
digest, so any change to the file means a full re-verify. Stamps live in $INGOT_CACHE_DIR/verified (else
$XDG_CACHE_HOME/ingot/verified); whoever can write there can vouch for bundles, like whoever can write the
user's files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ingot.runtime.bundle.manifest import sha256_hex
from ingot.runtime.files import cache_root, write_atomic

STAMP_SCHEMA = "ingot-verified-v1"


# --- stamps -----------------------------------------------------------------------------------------


def stamp_dir() -> Path:
    return cache_root() / "verified"


def _stamp_key(real: str, st: os.stat_result, root: str) -> dict:
    return {
        "schema": STAMP_SCHEMA,
        "path": real,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
        "root_digest": root,
    }


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
