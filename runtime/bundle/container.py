"""The bundle container: one uncompressed POSIX tar, read and written here and nowhere else.

A bundle (`NAME.ingot`) holds manifest.json, kernels/<module>.fatbin, model/<name>.gguf, provenance.json and,
once signed, signature.sigstore.json, in name order. Nothing is ever extracted: members are located by the data
offsets in their tar headers, small ones are read into memory, and the model is mapped in place by the
runtime; the writer aligns the model's data to 4096 bytes for that (a pax `comment` pads its header).

Determinism (writer): every header has the caller's mtime ($SOURCE_DATE_EPOCH), uid/gid 0, no user or group
names, mode 0644; the same members give the same bytes. Reader: only unique, safely named, complete regular
files, nothing but end-of-archive zeros after the last member.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import stat
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, Literal, cast

from ingot.runtime.bundle.manifest import (
    MANIFEST,
    MAX_MANIFEST_SIZE,
    MAX_MEMBER_SIZE,
    MAX_MEMBERS,
    READ_SIZE,
    SIGNATURE,
    check_member_name,
    parse_manifest,
)
from ingot.runtime.errors import IngotError, UsageError, VerificationError

MODEL_ALIGN = 4096
MAX_SIGNATURE_SIZE = 1 << 20
MAX_FATBIN_SIZE = 1 << 30
MAX_TAR_HEADER = 64 << 10  # one header block or pax/GNU record set; the writer's largest is ~5 KiB (alignment)
_PAX_KEYS = {"comment", "path", "size"}  # what the writer emits: alignment padding, long names, sizes > 8 GiB
DAMAGED = "the bundle is corrupt or was modified after packing; re-download or re-pack it"


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # of the member's data, from the start of the bundle file
    size: int
    mtime: int = 0  # from the tar header (pack writes SOURCE_DATE_EPOCH into every member)


# --- the tar index -----------------------------------------------------------------------------------


def open_file(path: str | Path):
    """The bundle file, opened unbuffered for reading; UsageError when there is none or it is not a regular
    file (opened non-blocking first, so a named pipe is refused instead of hanging)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such bundle", hint="make one with `ingot pack`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory", hint="pass a .ingot bundle file") from None
    except PermissionError:
        raise UsageError(f"{path}: permission denied") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        kind = "a directory" if os.path.isdir(path) else "not a regular file (a pipe, socket or device)"
        raise UsageError(f"{path} is {kind}", hint="pass a .ingot bundle file")
    os.set_blocking(fd, True)
    return open(fd, "rb", buffering=0)  # noqa: SIM115 (callers hold it in a with block)


def is_bundle(path: Path) -> bool:
    """A tar archive (ustar magic) rather than a fatbin or a folder (never opens a pipe or device)."""
    if not Path(path).is_file():
        return False
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
        tar = tarfile.open(fileobj=cast(IO[bytes], _HeaderReader(f)), mode="r:")
    except tarfile.ReadError as e:
        raise VerificationError(
            f"not an Ingot bundle: not a readable tar archive ({e})", hint="pass a .ingot file made by `ingot pack`"
        ) from None
    with tar:
        while True:
            last = members[-1].name if members else None
            try:
                info = tar.next()
            except tarfile.ReadError as e:
                where = f"after member {last}" if last else "at the start"
                raise VerificationError(f"bundle is truncated or damaged {where} ({e})", hint=DAMAGED) from None
            if info is None:
                break
            _check_member(info, names)
            if len(members) >= MAX_MEMBERS:
                raise VerificationError(f"bundle has more than {MAX_MEMBERS} members", hint=DAMAGED)
            if info.offset_data + info.size > file_size:
                raise VerificationError(
                    f"bundle is truncated: member {info.name} needs bytes up to "
                    f"{info.offset_data + info.size:,} but the file has {file_size:,}",
                    hint=DAMAGED,
                )
            names.add(info.name)
            members.append(Member(info.name, info.offset_data, info.size, int(info.mtime)))
        end = tar.offset
    _check_trailer(f, end, file_size, members)
    return members


class _HeaderReader:
    """The bundle file as tarfile sees it while indexing: tarfile only reads headers (it seeks over member
    data), so any single read larger than MAX_TAR_HEADER is a hostile size field (a pax header claiming 2**62
    bytes) and is refused before anything is allocated; seeks are bounded the same way."""

    def __init__(self, f):
        self.f = f

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > MAX_TAR_HEADER:
            raise VerificationError(
                f"bundle has a tar header of {'unbounded' if n is None or n < 0 else f'{n:,}'} bytes at offset "
                f"{self.f.tell():,} (at most {MAX_TAR_HEADER:,})",
                hint=DAMAGED,
            )
        return self.f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 0 and not 0 <= offset <= MAX_MEMBER_SIZE:
            raise VerificationError(f"bundle has a tar header pointing to offset {offset:,}", hint=DAMAGED)
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()


def _check_member(info: tarfile.TarInfo, seen: set[str]) -> None:
    name = info.name
    if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        kind = (
            "a symlink"
            if info.issym()
            else "a hard link"
            if info.islnk()
            else "a directory"
            if info.isdir()
            else "a device file"
            if info.isdev()
            else f"of tar type {info.type!r}"
        )
        raise VerificationError(f"member {name} is {kind}; bundles hold only regular files", hint=DAMAGED)
    why = check_member_name(name)
    if why:
        raise VerificationError(f"member name {name!r} {why}", hint=DAMAGED)
    if name in seen:
        raise VerificationError(f"member {name} appears twice", hint=DAMAGED)
    extra = set(info.pax_headers) - _PAX_KEYS
    if extra:
        raise VerificationError(f"member {name} has unexpected pax header fields {sorted(extra)}", hint=DAMAGED)


def _check_trailer(f, end: int, file_size: int, members: list[Member]) -> None:
    """After the last member only the end-of-archive zero blocks (at least two) may follow: anything else is
    a damaged header (tar stops reading there) or smuggled data."""
    f.seek(end)
    tail = f.read(file_size - end) if file_size - end <= 1 << 20 else None
    if tail is None or tail.strip(b"\0"):
        after = f"after member {members[-1].name}" if members else "at the start"
        raise VerificationError(
            f"bundle has a damaged tar header or stray data at offset {end:,} ({after})", hint=DAMAGED
        )
    if len(tail) < 1024:
        raise VerificationError(
            f"bundle is truncated: the end-of-archive marker after offset {end:,} is missing", hint=DAMAGED
        )


def read_member(f, member: Member, limit: int) -> bytes:
    if member.size > limit:
        raise VerificationError(
            f"member {member.name} is {member.size:,} bytes (at most {limit:,} expected)", hint=DAMAGED
        )
    f.seek(member.offset)
    data = f.read(member.size)
    if len(data) != member.size:
        raise VerificationError(f"bundle is truncated inside member {member.name}", hint=DAMAGED)
    return data


def load_manifest(f, index: list[Member]) -> dict:
    by_name = {m.name: m for m in index}
    if MANIFEST not in by_name:
        raise VerificationError(f"bundle has no {MANIFEST}", hint="pass a .ingot file made by `ingot pack`")
    return parse_manifest(read_member(f, by_name[MANIFEST], MAX_MANIFEST_SIZE))


def read_signature(f, index: list[Member]) -> bytes | None:
    member = next((m for m in index if m.name == SIGNATURE), None)
    return read_member(f, member, MAX_SIGNATURE_SIZE) if member else None


# --- the deterministic tar writer ------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One member to write: bytes in memory, or `size` bytes at `offset` of an open raw file or a path."""

    name: str
    size: int
    data: bytes | None = None
    file: BinaryIO | None = None
    path: Path | None = None
    offset: int = 0
    sha256: str | None = None  # when given, the copied bytes must have this digest


class _HashingSink:
    """The output file, hashed as tarfile writes it (tarfile needs write and tell)."""

    def __init__(self, raw):
        self.raw, self.pos, self.hash = raw, 0, hashlib.sha256()

    def write(self, b) -> int:
        self.raw.write(b)
        self.hash.update(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos


class _RangeReader:
    """read(n) over [offset, offset+size) of a file descriptor with pread, hashing what it hands out."""

    def __init__(self, fd: int, offset: int, size: int, on_bytes):
        self.fd, self.pos, self.end, self.on_bytes = fd, offset, offset + size, on_bytes
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        n = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        data = os.pread(self.fd, n, self.pos)
        self.pos += len(data)
        self.hash.update(data)
        if self.on_bytes:
            self.on_bytes(len(data))
        return data


def _tarinfo(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, mtime, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


# What tarfile.TarFile uses by default, spelled out: the writer and the canonical check must agree exactly.
_FORMAT: Literal[2] = tarfile.PAX_FORMAT
_ENCODING, _ERRORS = tarfile.ENCODING, "surrogateescape"


def _align_data(info: tarfile.TarInfo, offset: int, align: int) -> None:
    """Grow a pax `comment` until this member's data (its header starting at `offset`) starts at a multiple of
    `align` in the archive."""
    for n in range(0, align + 4 * tarfile.BLOCKSIZE, 64):
        info.pax_headers = {"comment": "ingot: padding so the data below starts page-aligned " + "." * n}
        if (offset + len(info.tobuf(_FORMAT, _ENCODING, _ERRORS))) % align == 0:
            return
    raise AssertionError("no pax padding aligns the member")  # unreachable: 64-byte steps cover every block


def _member_info(name: str, size: int, mtime: int, offset: int) -> tarfile.TarInfo:
    """The header write_bundle writes for a member whose header starts at `offset`."""
    info = _tarinfo(name, size, mtime)
    if name.startswith("model/"):
        _align_data(info, offset, MODEL_ALIGN)
    return info


@functools.lru_cache(maxsize=256)
def _expected_header(name: str, size: int, mtime: int, offset: int) -> bytes:
    """The header bytes write_bundle writes (cached: the model's alignment search builds ~50 candidates)."""
    return _member_info(name, size, mtime, offset).tobuf(_FORMAT, _ENCODING, _ERRORS)


def _trailer_size(end: int) -> int:
    """tarfile.close(): two zero blocks, then zeros up to a whole record."""
    return 2 * tarfile.BLOCKSIZE + (-(end + 2 * tarfile.BLOCKSIZE) % tarfile.RECORDSIZE)


def check_canonical(f, index: list[Member], file_size: int) -> None:
    """Every byte of the file outside member data must be exactly what write_bundle writes for these members
    (headers and pax records, padding, end-of-archive, total length). With the members' digests this covers
    every byte of a bundle: a flipped padding byte, a pax comment or smuggled pax record, a truncated trailer
    are all refused, naming the offset. Reads only the headers and padding (a few KiB)."""
    names = [m.name for m in index]
    if names != sorted(names):
        raise VerificationError("bundle members are not in name order (not written by `ingot pack`)", hint=DAMAGED)
    mtime = index[0].mtime if index else 0
    offset = 0
    for m in index:
        header = _expected_header(m.name, m.size, mtime, offset)
        _expect(f, offset, header, f"the tar header of member {m.name}")
        end = offset + len(header) + m.size
        if offset + len(header) != m.offset:  # unreachable when the header bytes match; kept as a guard
            raise VerificationError(f"member {m.name} data starts at an unexpected offset {m.offset:,}", hint=DAMAGED)
        pad = -m.size % tarfile.BLOCKSIZE
        _expect(f, end, bytes(pad), f"the padding after member {m.name}")
        offset = end + pad
    want = offset + _trailer_size(offset)
    if file_size != want:
        raise VerificationError(
            f"bundle is {file_size:,} bytes but its members make a {want:,}-byte archive "
            f"({'truncated end-of-archive' if file_size < want else 'extra bytes at the end'})",
            hint=DAMAGED,
        )
    _expect(f, offset, bytes(want - offset), "the end-of-archive")


def _expect(f, offset: int, want: bytes, where: str) -> None:
    f.seek(offset)
    got = f.read(len(want))
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got))
        raise VerificationError(f"bundle has non-canonical bytes at offset {offset + at:,} (in {where})", hint=DAMAGED)


STALE_TEMP_S = 300  # a temp file not written for this long, whose writer is gone, is an interrupted pack/sign


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temps(out: Path, *, now: float | None = None) -> list[Path]:
    """Remove `.NAME.ingot.PID.*.tmp` siblings of `out` left by a pack or sign that was killed: not written
    for STALE_TEMP_S and their writer's pid is not running here (names without a pid: age alone)."""
    prefix, removed = f".{out.name}.", cast(list[Path], [])
    now = time.time() if now is None else now
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return removed
    for e in entries:
        if not (e.name.startswith(prefix) and e.name.endswith(".tmp")):
            continue
        pid = e.name[len(prefix) :].split(".", 1)[0]
        try:
            if not e.is_file(follow_symlinks=False) or now - e.stat(follow_symlinks=False).st_mtime < STALE_TEMP_S:
                continue
            if pid.isdigit() and _alive(int(pid)):
                continue
            os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError:
            continue
    return removed


def write_bundle(out: Path, sources: list[Source], *, mtime: int, on_bytes=None) -> dict:
    """Write the members in name order as a PAX tar, atomically; returns sha256, size and member offsets."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    # The writer's pid is in the temp name, so a later run can tell an abandoned one (killed pack/sign) from
    # one still being written.
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp")
    offsets = {}
    try:
        with os.fdopen(fd, "wb") as raw:
            sink = _HashingSink(raw)
            # copybufsize is a real TarFile argument that typeshed's tarfile.open overloads omit
            with tarfile.open(  # type: ignore[call-overload]
                fileobj=sink, mode="w:", format=tarfile.PAX_FORMAT, copybufsize=READ_SIZE
            ) as tar:
                assert (tar.format, tar.encoding, tar.errors) == (_FORMAT, _ENCODING, _ERRORS)
                for src in sorted(sources, key=lambda s: s.name):
                    info = _member_info(src.name, src.size, mtime, tar.offset)
                    offsets[src.name] = tar.offset + len(info.tobuf(_FORMAT, _ENCODING, _ERRORS))
                    _add(tar, info, src, on_bytes)
            os.fchmod(raw.fileno(), 0o644)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"sha256": sink.hash.hexdigest(), "size": sink.pos, "offsets": offsets}


def _add(tar: tarfile.TarFile, info: tarfile.TarInfo, src: Source, on_bytes) -> None:
    if src.data is not None:
        tar.addfile(info, io.BytesIO(src.data))
        return
    if src.file is not None:
        owned, fd = None, src.file.fileno()
    else:
        assert src.path is not None, "a Source holds data, an open file or a path"
        owned = open(src.path, "rb", buffering=0)  # noqa: SIM115 (closed below)
        fd = owned.fileno()
    try:
        reader = _RangeReader(fd, src.offset, src.size, on_bytes)
        try:
            tar.addfile(info, reader)
        except OSError as e:  # tarfile's "unexpected end of data" when the source shrank
            raise IngotError(
                f"{src.name}: could not copy {src.size:,} bytes ({e})",
                hint="an input file changed while packing; run the command again",
            ) from None
    finally:
        if owned:
            owned.close()
    if src.sha256 and reader.hash.hexdigest() != src.sha256:
        raise VerificationError(
            f"member {src.name} changed while it was being copied (sha256 mismatch)",
            hint="do not modify inputs while packing or signing; run the command again",
        )
