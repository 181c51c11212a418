"""Where Ingot keeps files: the cache root, and atomic writes.

Atomic writes: a temp file in the destination folder, then a rename, so a reader (or a crash) never sees half a
file. Every small output Ingot writes (fatbins, build records, keys, stamps, index entries) goes through here;
streamed outputs (bundles, downloads) follow the same temp-then-rename rule in their modules."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ingot.runtime import settings


def write_atomic(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` atomically. mode: the file's permissions (default: 0666 minus the umask, as
    open() would give; the temp file itself is created 0600, so a private key is never briefly readable)."""
    path = Path(path)
    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cache_root() -> Path:
    """$INGOT_CACHE_DIR if set, else $XDG_CACHE_HOME/ingot, else ~/.cache/ingot. Callers add their own folder
    (kernels/, models/, verified/, index/)."""
    root = settings.CACHE_DIR.get()
    if root is not None:
        return root
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ingot"
