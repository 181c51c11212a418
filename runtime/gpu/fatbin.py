"""A pure-Python reader for CUDA fatbins: which SASS and PTX images a module holds, and its kernels.

No cuobjdump needed. Layout (little-endian), as nvcc 12.x/13.x writes it:

  container header, 16 bytes:  u32 magic 0xBA55ED50 | u16 version | u16 header size | u64 payload size
  entry header (64/80/112 B):  u16 kind (1 PTX, 2 ELF/SASS) @0 | u32 header size @4 | u64 padded payload @8
                               u32 compressed size @16 | u16 minor, u16 major @24 (PTX ISA for PTX)
                               u32 arch @28 | u64 flags @40 | u64 uncompressed size @56 (0 when raw)
  payload follows the entry header; the next entry starts header size + padded payload later.
  Containers may be concatenated (and padded with zeros between them).

Flags: 0x2000 LZ4, 0x8000 zstd, 0x100000 arch-specific ('sm_90a'), 0x200000 family ('sm_100f').
`--compress-mode=speed` gives LZ4, `default`/`balance`/`size` zstd (nvcc 13.0), `none` raw.
Any malformed input raises UsageError with a one-line message; nothing else escapes.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ingot.runtime.errors import UsageError

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
FLAG_LZ4 = 0x2000
FLAG_ZSTD = 0x8000
FLAG_ARCH_SPECIFIC = 0x100000
FLAG_FAMILY = 0x200000

# Limits (README: Limits): a hostile fatbin costs at most this much to inspect.
MAX_FATBIN_ENTRIES = 4096  # images in one file; nvcc writes one per arch (~10-20)
MAX_IMAGE_SIZE = 1 << 30  # one decompressed image
MAX_COMPRESSION_RATIO = 256  # a decompressed size claim beyond 256x the stored bytes (+1 MiB) is refused
MAX_ELF_SECTIONS = 1 << 16
MAX_ELF_SYMBOLS = 1 << 20

_CONTAINER = struct.Struct("<IHHQ")
_ENTRY_MIN = 64
_NONZERO = re.compile(rb"[^\0]")
_MAGIC_BYTES = struct.pack("<I", MAGIC)


@dataclass(frozen=True)
class Entry:
    kind: str  # "sass" or "ptx"
    arch: str  # "sm_90", "sm_90a", "sm_100f", "compute_120"
    cc: int  # compute capability as an int: 90, 100, 120
    variant: str  # "", "a" or "f"
    isa: str | None  # PTX ISA "9.0" for PTX entries, None for SASS
    compression: str  # "none", "zstd" or "lz4"
    stored_size: int  # bytes in the file (compressed if compressed)
    size: int  # uncompressed bytes
    kernels: tuple[str, ...]
    offset: int  # of the entry header, from the start of the file
    toolkit: str | None = None  # CUDA release that built a SASS image ("13.0"), from the cubin's tool notes
    container: int = 0  # which of the concatenated containers holds it

    @property
    def toolkit_major(self) -> int | None:
        return int(self.toolkit.split(".")[0]) if self.toolkit else None

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "arch": self.arch,
            "cc": self.cc,
            "variant": self.variant,
            "isa": self.isa,
            "compression": self.compression,
            "stored_size": self.stored_size,
            "size": self.size,
            "kernels": list(self.kernels),
            "offset": self.offset,
            "toolkit": self.toolkit,
            "container": self.container,
        }


@dataclass(frozen=True)
class Fatbin:
    entries: tuple[Entry, ...]
    size: int
    kernels: tuple[str, ...] = field(default=())
    containers: int = 1

    @property
    def sass(self) -> list[str]:
        return sorted({e.arch for e in self.entries if e.kind == "sass"}, key=_arch_sort_key)

    @property
    def ptx(self) -> list[str]:
        return sorted({e.arch for e in self.entries if e.kind == "ptx"}, key=_arch_sort_key)

    def as_dict(self) -> dict:
        return {
            "size": self.size,
            "containers": self.containers,
            "archs": {"sass": self.sass, "ptx": self.ptx},
            "kernels": list(self.kernels),
            "entries": [e.as_dict() for e in self.entries],
        }


def _arch_sort_key(arch: str) -> tuple[int, str]:
    m = re.match(r"(?:sm|compute)_(\d+)([af]?)$", arch)
    return (int(m.group(1)), m.group(2)) if m else (0, arch)


def read_fatbin(path: str | Path) -> Fatbin:
    path = Path(path)
    if path.exists() and not path.is_dir() and not path.is_file():
        raise UsageError(f"{path} is not a regular file (a pipe, socket or device)", hint="pass one .fatbin file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file", hint="pass a .fatbin built by `ingot build`") from None
    except IsADirectoryError:
        raise UsageError(f"{path} is a directory", hint="pass one .fatbin file") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read ({e.strerror})") from None
    return parse_fatbin(data, name=str(path))


def parse_fatbin(data: bytes, name: str = "<bytes>") -> Fatbin:
    entries: list[Entry] = []
    pos = containers = 0
    while pos < len(data):
        if entries and data[pos] == 0:  # zero padding between or after containers (host objects align them)
            nonzero = _NONZERO.search(data, pos)
            pos = nonzero.start() if nonzero else len(data)
            continue
        if data[pos : pos + 4] != _MAGIC_BYTES:
            if not entries:
                raise UsageError(
                    f"{name}: not a CUDA fatbin (no 0xBA55ED50 magic at offset {pos})",
                    hint="pass a .fatbin produced by nvcc -fatbin or `ingot build`",
                )
            raise UsageError(f"{name}: unexpected bytes after fatbin container at offset {pos}")
        if pos + _CONTAINER.size > len(data):
            raise UsageError(f"{name}: truncated fatbin (partial container header at offset {pos})")
        _magic, _version, header_size, payload_size = _CONTAINER.unpack_from(data, pos)
        end = pos + header_size + payload_size
        if header_size < _CONTAINER.size or end > len(data):
            raise UsageError(
                f"{name}: truncated fatbin (container at {pos} needs {end} bytes, file has {len(data)})",
                hint="the file was cut short; rebuild or re-download it",
            )
        entries.extend(_parse_entries(data, pos + header_size, end, name, containers, len(entries)))
        containers += 1
        pos = end
    if not data:
        raise UsageError(f"{name}: not a CUDA fatbin (empty file)")
    if not entries:
        raise UsageError(f"{name}: empty fatbin (no images)", hint="rebuild it with `ingot build`")
    kernels = sorted({k for e in entries for k in e.kernels})
    return Fatbin(entries=tuple(entries), size=len(data), kernels=tuple(kernels), containers=containers)


def _parse_entries(data: bytes, pos: int, end: int, name: str, container: int, before: int) -> list[Entry]:
    out: list[Entry] = []
    while pos < end:
        if before + len(out) >= MAX_FATBIN_ENTRIES:
            raise UsageError(
                f"{name}: more than {MAX_FATBIN_ENTRIES} images in one fatbin", hint="not a fatbin of nvcc"
            )
        if pos + _ENTRY_MIN > end:
            raise UsageError(f"{name}: corrupt fatbin (partial entry header at offset {pos})")
        (kind,) = struct.unpack_from("<H", data, pos)
        (header_size,) = struct.unpack_from("<I", data, pos + 4)
        (padded,) = struct.unpack_from("<Q", data, pos + 8)
        (compressed,) = struct.unpack_from("<I", data, pos + 16)
        minor, major, arch = struct.unpack_from("<HHI", data, pos + 24)
        (flags,) = struct.unpack_from("<Q", data, pos + 40)
        (uncompressed,) = struct.unpack_from("<Q", data, pos + 56)
        if kind not in (KIND_PTX, KIND_ELF) or header_size < _ENTRY_MIN or pos + header_size + padded > end:
            raise UsageError(f"{name}: corrupt fatbin entry header at offset {pos}")
        payload = data[pos + header_size : pos + header_size + padded]
        compression = "zstd" if flags & FLAG_ZSTD else "lz4" if flags & FLAG_LZ4 else "none"
        stored = compressed if compression != "none" else padded
        if stored > padded:
            raise UsageError(f"{name}: corrupt fatbin entry at offset {pos} (compressed size beyond its payload)")
        if compression != "none" and uncompressed > min(MAX_IMAGE_SIZE, MAX_COMPRESSION_RATIO * stored + (1 << 20)):
            raise UsageError(
                f"{name}: corrupt fatbin entry at offset {pos} "
                f"(claims {uncompressed:,} bytes from {stored:,} compressed)"
            )
        raw = _decompress(payload[:stored], compression, uncompressed, name, pos)
        variant = "a" if flags & FLAG_ARCH_SPECIFIC else "f" if flags & FLAG_FAMILY else ""
        if kind == KIND_PTX:
            out.append(
                Entry(
                    "ptx",
                    f"compute_{arch}{variant}",
                    arch,
                    variant,
                    f"{major}.{minor}",
                    compression,
                    stored,
                    len(raw),
                    tuple(_ptx_kernels(raw)),
                    pos,
                    container=container,
                )
            )
        else:
            tk = re.search(rb"Cuda compilation tools, release (\d+\.\d+)", raw)
            out.append(
                Entry(
                    "sass",
                    f"sm_{arch}{variant}",
                    arch,
                    variant,
                    None,
                    compression,
                    stored,
                    len(raw),
                    tuple(_elf_kernels(raw, name, pos)),
                    pos,
                    toolkit=tk.group(1).decode() if tk else None,
                    container=container,
                )
            )
        pos += header_size + padded
    return out


def _decompress(payload: bytes, compression: str, size: int, name: str, pos: int) -> bytes:
    try:
        if compression == "zstd":
            import zstandard  # deferred: only compressed fatbins need it

            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
        elif compression == "lz4":
            import lz4.block  # deferred: only compressed fatbins need it

            raw = lz4.block.decompress(payload, uncompressed_size=size)
        else:
            return payload
    except Exception as e:  # the codecs raise their own error types
        raise UsageError(f"{name}: cannot decompress {compression} entry at offset {pos}: {e}") from None
    if len(raw) != size:
        raise UsageError(
            f"{name}: {compression} entry at offset {pos} decompressed to {len(raw)} bytes, header says {size}"
        )
    return raw


def _ptx_kernels(ptx: bytes) -> list[str]:
    text = ptx.decode("utf-8", errors="replace")
    return re.findall(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([A-Za-z_$][\w$]*)", text, re.M)


def _elf_kernels(elf: bytes, name: str, pos: int) -> list[str]:
    """Kernel entry points of a cubin: FUNC symbols with the CUDA entry flag (st_other 0x10)."""
    if elf[:4] != b"\x7fELF" or len(elf) < 0x40 or elf[4] != 2:
        raise UsageError(f"{name}: SASS entry at offset {pos} is not a 64-bit ELF cubin")
    corrupt = UsageError(f"{name}: corrupt cubin in the SASS entry at offset {pos}")
    try:
        (shoff,) = struct.unpack_from("<Q", elf, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
        # Every offset and size is checked against the image before use (a 2**63 offset is refused, not an
        # OverflowError; a symbol table claiming more entries than bytes is refused, not iterated).
        if shnum > MAX_ELF_SECTIONS or shentsize < 64 or shoff + shnum * shentsize > len(elf):
            raise corrupt
        sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
        kernels = []
        for _name, sh_type, _flags, _addr, off, size, link, _info, _align, entsize in sections:
            if sh_type != 2 or not entsize:  # SHT_SYMTAB
                continue
            if entsize < 24 or off + size > len(elf) or size // entsize > MAX_ELF_SYMBOLS or link >= len(sections):
                raise corrupt
            str_off = sections[link][4]
            if str_off >= len(elf):
                raise corrupt
            for i in range(size // entsize):
                st_name, st_info, st_other = struct.unpack_from("<IBB", elf, off + i * entsize)
                if st_info & 0xF == 2 and st_other & 0x10:  # STT_FUNC, STO_CUDA_ENTRY
                    end = elf.index(b"\0", str_off + st_name)
                    kernels.append(elf[str_off + st_name : end].decode())
        return kernels
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError):
        raise corrupt from None
