"""Hostile inputs, built from code: GGUFs, fatbins and bundles that are small but claim huge counts, sizes,
offsets or nesting (issue #13's findings)."""

from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path

import numpy as np

# --- GGUF -------------------------------------------------------------------------------------------------

U8, I32, U32, F32, STR, ARR, U64 = 0, 5, 4, 6, 8, 9, 10


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str, vtype: int, value) -> bytes:
    head = gstr(key) + struct.pack("<I", vtype)
    if vtype == STR:
        return head + gstr(value)
    if vtype == U32:
        return head + struct.pack("<I", value)
    if vtype == I32:
        return head + struct.pack("<i", value)
    if vtype == F32:
        return head + struct.pack("<f", value)
    if vtype == U64:
        return head + struct.pack("<Q", value)
    raise ValueError(vtype)


def kv_array(key: str, itype: int, items: list | bytes, n: int | None = None) -> bytes:
    """items: a list of strings (STR) or raw element bytes; n overrides the stored length."""
    if itype == STR:
        body = b"".join(gstr(s) for s in items)
        count = len(items)
    else:
        body = items
        count = len(items) // {U8: 1, U32: 4, I32: 4, F32: 4, U64: 8}[itype]
    return gstr(key) + struct.pack("<IIQ", ARR, itype, count if n is None else n) + body


def tensor_info(name: str, dims: tuple[int, ...], ttype: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims) if n_dims is None else n_dims)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ttype, offset)
    )


def gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", *, n_kv=None, n_tensors=None) -> bytes:
    head = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    body += bytes(-len(body) % 32)
    return body + data


def llama_kvs(**override) -> list[bytes]:
    values = {
        "general.architecture": (STR, "llama"),
        "llama.embedding_length": (U32, 8),
        "llama.attention.head_count": (U32, 2),
        "llama.block_count": (U32, 1),
        "llama.feed_forward_length": (U32, 16),
        "llama.context_length": (U32, 64),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5),
    }
    for k, v in override.items():
        values[k.replace("__", ".")] = v
    return [kv(k, t, v) for k, (t, v) in values.items()]


def small_llama(**override) -> bytes:
    """A GGUF that gets past the reader to the hyperparameter checks: llama metadata, one F32 embedding."""
    emb = np.zeros((4, 8), dtype=np.float32).tobytes()
    return gguf(llama_kvs(**override), [tensor_info("token_embd.weight", (8, 4), 0, 0)], emb)


def rewrite_gguf(src: Path, dst: Path, *, replace: dict[str, bytes] | None = None, tensor_data=None) -> Path:
    """Copy a GGUF, swapping whole key/value records (raw bytes from kv()/kv_array()) and optionally editing
    the tensor data (tensor_data(bytearray, reader) edits in place)."""
    import gguf as gg

    replace = dict(replace or {})
    r = gg.GGUFReader(src)
    raw = bytes(np.asarray(r.data))
    kvs = []
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        size = sum(int(p.nbytes) for p in f.parts)
        kvs.append(replace.pop(name) if name in replace else raw[f.offset : f.offset + size])
    kvs.extend(replace.values())
    infos = [raw[t.field.offset : t.field.offset + sum(int(p.nbytes) for p in t.field.parts)] for t in r.tensors]
    data = bytearray(raw[r.data_offset :])
    if tensor_data:
        tensor_data(data, r)
    dst.write_bytes(gguf(kvs, infos, bytes(data)))
    return dst


# --- fatbin -------------------------------------------------------------------------------------------------


def fatbin(entries: list[bytes]) -> bytes:
    payload = b"".join(entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(payload)) + payload


def fat_entry(kind: int, payload: bytes, arch: int = 90) -> bytes:
    head = bytearray(64)
    struct.pack_into("<HxxIQ", head, 0, kind, 64, len(payload))
    struct.pack_into("<HHI", head, 24, 0, 8, arch)
    return bytes(head) + payload


def elf_with_section_offset(shoff: int) -> bytes:
    elf = bytearray(0x40)
    elf[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", elf, 0x28, shoff)
    struct.pack_into("<HH", elf, 0x3A, 64, 4)
    return bytes(elf)


# --- tar ------------------------------------------------------------------------------------------------------


def tar_with_pax_size(size: int) -> bytes:
    """A tar whose first header is a pax header claiming `size` bytes of records."""
    info = tarfile.TarInfo("manifest.json")
    info.size = 2
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        info.pax_headers = {"comment": "x"}
        t.addfile(info, io.BytesIO(b"{}"))
    data = bytearray(buf.getvalue())
    # the first block is the pax header ('x'): rewrite its size field (base-256 for huge values)
    field = bytearray(12)
    field[0] = 0x80
    field[4:] = size.to_bytes(8, "big")
    data[124:136] = field
    chksum = sum(data[:148]) + 8 * 32 + sum(data[156:512])
    data[148:156] = b"%06o\0 " % chksum
    return bytes(data)
