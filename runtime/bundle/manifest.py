"""The bundle manifest: canonical JSON, member digests, the root digest, and the schema check.

A manifest is canonical JSON (RFC 8785 / JCS: keys sorted by UTF-16 code units, no whitespace, UTF-8,
ECMAScript number formatting), so the same content always has the same bytes, and `verify` refuses any
manifest whose bytes are not the canonical form of what they parse to.

`files` lists every member except manifest.json and signature.dsse.json, sorted by name, in the layout of
the OpenSSF model_signing v1.0 predicate's `resources` ({name, algorithm, digest}) plus `size`, and, for
members larger than one chunk (64 MiB), `chunks`: the sha256 of each 64 MiB piece, so `verify` can name the
damaged piece of a 70 GB model.

The root digest follows model_signing's rule: sha256 over the raw digests of the resources in name order.
The resources are the files plus one entry named "manifest.json" whose digest is the sha256 of the
manifest's canonical bytes without `root_digest`. So a flipped byte anywhere (in a member, or in any
manifest field) changes the root, even in an unsigned bundle; signatures sign this root.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from decimal import Decimal

from ingot.runtime.errors import VerificationError
from ingot.runtime.limits import bounded_json_loads

FORMAT = "ingot-bundle/v1"
MANIFEST = "manifest.json"
SIGNATURE = "signature.dsse.json"
PROVENANCE = "provenance.json"
CHUNK_SIZE = 64 << 20
READ_SIZE = 8 << 20  # large reads keep hashing at disk speed
MAX_MEMBER_SIZE = 1 << 44  # 16 TiB: anything larger is a corrupt or hostile size field
MAX_MANIFEST_SIZE = 64 << 20
MAX_MEMBERS = 4096

_HEX64 = re.compile(r"[0-9a-f]{64}")


# --- canonical JSON (RFC 8785) -------------------------------------------------------------------


def canonical_json(obj) -> bytes:
    """obj -> its RFC 8785 canonical UTF-8 bytes. Refuses NaN/inf, floats out of range and non-str keys."""
    out: list[str] = []
    _emit(obj, out)
    return "".join(out).encode("utf-8")


def _emit(obj, out: list[str]) -> None:
    if obj is None or obj is True or obj is False:
        out.append({None: "null", True: "true", False: "false"}[obj])
    elif isinstance(obj, str):
        out.append(json.dumps(obj, ensure_ascii=False))  # JCS escaping: only " \ and control characters
    elif isinstance(obj, int):
        if abs(obj) > 2**53:
            raise ValueError(f"integer {obj} is outside the exactly representable range of JSON numbers")
        out.append(str(obj))
    elif isinstance(obj, float):
        out.append(_es6_number(obj))
    elif isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise ValueError("JSON object keys must be strings")
        out.append("{")
        for i, k in enumerate(sorted(obj, key=lambda s: s.encode("utf-16-be"))):
            out.append("," if i else "")
            _emit(k, out)
            out.append(":")
            _emit(obj[k], out)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            out.append("," if i else "")
            _emit(v, out)
        out.append("]")
    else:
        raise ValueError(f"cannot put a {type(obj).__name__} in canonical JSON")


def _es6_number(x: float) -> str:
    """ECMAScript Number.prototype.toString: shortest round-trip digits, exponent only outside 1e-7..1e21."""
    if not math.isfinite(x):
        raise ValueError(f"{x} is not a JSON number")
    if x == 0:
        return "0"
    _, digits, exp = Decimal(repr(abs(x))).as_tuple()
    ds = "".join(map(str, digits)).rstrip("0") or "0"
    n = exp + len(digits)  # value = 0.ds * 10**n
    k = len(ds)
    if k <= n <= 21:
        s = ds + "0" * (n - k)
    elif 0 < n <= 21:
        s = ds[:n] + "." + ds[n:]
    elif -6 < n <= 0:
        s = "0." + "0" * -n + ds
    else:
        e = n - 1
        s = (ds[0] + ("." + ds[1:] if k > 1 else "")) + ("e+" if e >= 0 else "e-") + str(abs(e))
    return ("-" if x < 0 else "") + s


# --- digests ---------------------------------------------------------------------------------------


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_range(f, offset: int, size: int, *, chunk_size: int | None = None, on_bytes=None) -> tuple[str, list[str]]:
    """sha256 of bytes [offset, offset+size) of the raw file f, and the sha256 of each chunk_size piece
    (an empty list when chunk_size is None). Raises EOFError if the file ends early."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    piece = hashlib.sha256() if chunk_size else None
    in_piece = 0
    buf = bytearray(min(READ_SIZE, max(size, 1)))  # small members need no 8 MiB buffer (zero-filled per call)
    view = memoryview(buf)
    f.seek(offset)
    left = size
    while left:
        want = min(READ_SIZE, left, chunk_size - in_piece) if piece else min(READ_SIZE, left)
        got = f.readinto(view[:want])
        if not got:
            raise EOFError(f"file ends {left} bytes early")
        whole.update(view[:got])
        if piece:
            piece.update(view[:got])
            in_piece += got
            if in_piece == chunk_size:
                chunks.append(piece.hexdigest())
                piece, in_piece = hashlib.sha256(), 0
        left -= got
        if on_bytes:
            on_bytes(got)
    if piece and in_piece:
        chunks.append(piece.hexdigest())
    return whole.hexdigest(), chunks


def file_entry(name: str, size: int, digest: str, chunks: list[str]) -> dict:
    """One `files` entry; chunk digests only for members bigger than a chunk."""
    entry = {"name": name, "algorithm": "sha256", "digest": digest, "size": size}
    if size > CHUNK_SIZE:
        entry["chunks"] = chunks
    return entry


def resources(manifest: dict) -> list[dict]:
    """The model_signing resources the root digest is taken over: the files plus the manifest itself."""
    body = {k: v for k, v in manifest.items() if k != "root_digest"}
    own = {"name": MANIFEST, "algorithm": "sha256", "digest": sha256_hex(canonical_json(body))}
    files = [{"name": f["name"], "algorithm": f["algorithm"], "digest": f["digest"]} for f in manifest["files"]]
    return sorted(files + [own], key=lambda r: r["name"])


def root_digest(manifest: dict) -> str:
    return hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources(manifest))).hexdigest()


def seal(manifest: dict) -> bytes:
    """Set root_digest and return the manifest's canonical bytes (what goes into the bundle)."""
    manifest["root_digest"] = root_digest(manifest)
    return canonical_json(manifest)


# --- parsing and the schema check --------------------------------------------------------------------


def parse_manifest(data: bytes) -> dict:
    """manifest.json bytes -> the manifest, after the canonical-form, schema and root-digest checks."""
    where = MANIFEST
    manifest = bounded_json_loads(data, what=where, max_size=MAX_MANIFEST_SIZE, hint=_TAMPERED)
    validate(manifest)
    try:
        canonical = canonical_json(manifest)
    except ValueError as e:
        raise VerificationError(f"{where} holds a value canonical JSON cannot carry ({e})", hint=_TAMPERED) from None
    if canonical != data:
        raise VerificationError(
            f"{where} is not in canonical JSON form (same content must have the same bytes)", hint=_TAMPERED
        )
    expect = root_digest(manifest)
    if manifest["root_digest"] != expect:
        raise VerificationError(
            f"{where}: root digest {manifest['root_digest'][:16]}... does not match its content ({expect[:16]}...)",
            hint=_TAMPERED,
        )
    return manifest


_TAMPERED = "the bundle is corrupt or was modified after packing; re-download or re-pack it"


def _bad(field: str, what: str) -> VerificationError:
    return VerificationError(f"{MANIFEST}: field {field} {what}", hint=_TAMPERED)


def _get(obj: dict, key: str, types, field: str):
    if key not in obj:
        raise _bad(field, "is missing")
    value = obj[key]
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
        raise _bad(field, f"has type {type(value).__name__}")
    return value


def _tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _size(obj: dict, key: str, field: str) -> int:
    n = _get(obj, key, int, field)
    if not 0 <= n <= MAX_MEMBER_SIZE:
        raise _bad(field, f"is out of range ({n})")
    return n


def _digest(obj: dict, key: str, field: str) -> str:
    d = _get(obj, key, str, field)
    if not _HEX64.fullmatch(d):
        raise _bad(field, f"is not a lowercase hex sha256 digest ({d[:20]!r})")
    return d


def check_member_name(name: str) -> str | None:
    """Why a member name is unsafe or malformed, or None if it is fine."""
    if not name:
        return "is empty"
    if name.startswith("/"):
        return "is an absolute path"
    if "\\" in name or "\0" in name:
        return "contains a backslash or NUL"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "contains an empty, '.' or '..' path component"
    if len(name) > 255:
        return "is longer than 255 characters"
    return None


def validate(m) -> None:
    """Types and ranges of every field verify and the runtime rely on; raises VerificationError naming it."""
    if not isinstance(m, dict):
        raise _bad("(top level)", f"is a {type(m).__name__}, not an object")
    fmt = _get(m, "format", str, "format")
    if fmt != FORMAT:
        raise VerificationError(
            f"{MANIFEST}: unknown bundle format {fmt!r} (this Ingot reads {FORMAT})",
            hint="upgrade Ingot, or re-pack the bundle with this version",
        )
    _get(m, "name", str, "name")
    _digest(m, "root_digest", "root_digest")
    chunk = _get(m, "chunk_size", int, "chunk_size")
    if chunk != CHUNK_SIZE:
        raise _bad("chunk_size", f"is {chunk}, expected {CHUNK_SIZE}")
    files = _get(m, "files", list, "files")
    if len(files) > MAX_MEMBERS:
        raise _bad("files", f"lists {len(files)} members (at most {MAX_MEMBERS})")
    names = []
    for i, f in enumerate(files):
        where = f"files[{i}]"
        if not isinstance(f, dict):
            raise _bad(where, "is not an object")
        name = _get(f, "name", str, f"{where}.name")
        why = check_member_name(name)
        if why or name in (MANIFEST, SIGNATURE):
            raise _bad(f"{where}.name", why or f"names the reserved member {name}")
        if _get(f, "algorithm", str, f"{where}.algorithm") != "sha256":
            raise _bad(f"{where}.algorithm", "is not sha256")
        _digest(f, "digest", f"{where}.digest")
        size = _size(f, "size", f"{where}.size")
        n_chunks = -(-size // CHUNK_SIZE) if size > CHUNK_SIZE else 0
        chunks = f.get("chunks", [])
        if (
            not isinstance(chunks, list)
            or len(chunks) != n_chunks
            or not all(isinstance(c, str) and _HEX64.fullmatch(c) for c in chunks)
        ):
            raise _bad(f"{where}.chunks", f"must be {n_chunks} hex sha256 digests for a {size}-byte member")
        names.append(name)
    if names != sorted(names) or len(set(names)) != len(names):
        raise _bad("files", "is not sorted by name, or names a member twice")

    listed = {f["name"]: f for f in files}
    model = _get(m, "model", dict, "model")
    _described(model, "model", listed)
    if not model["path"].startswith("model/") or not model["path"].endswith(".gguf"):
        raise _bad("model.path", f"{model['path']!r} is not model/<name>.gguf")
    kernels = _get(m, "kernels", list, "kernels")
    seen = set()
    for i, k in enumerate(kernels):
        where = f"kernels[{i}]"
        if not isinstance(k, dict):
            raise _bad(where, "is not an object")
        name = _get(k, "name", str, f"{where}.name")
        path = _described(k, where, listed)
        if path != f"kernels/{name}.fatbin" or name in seen:
            raise _bad(f"{where}.path", f"{path!r} is not kernels/<name>.fatbin of a unique module name")
        seen.add(name)
    for key, types in (("toolchain", dict), ("provenance", str)):
        _get(m, key, types, key)
    if "selftest" in m and not isinstance(m["selftest"], dict):
        raise _bad("selftest", "is not an object")


def _described(section: dict, where: str, listed: dict[str, dict]) -> str:
    """A section that describes a member (path, sha256, size) must agree with its `files` entry."""
    path = _get(section, "path", str, f"{where}.path")
    digest = _digest(section, "sha256", f"{where}.sha256")
    size = _size(section, "size", f"{where}.size")
    entry = listed.get(path)
    if entry is None:
        raise _bad(f"{where}.path", f"names {path!r}, which is not in files")
    if (entry["digest"], entry["size"]) != (digest, size):
        raise _bad(where, f"disagrees with the files entry of {path}")
    return path


def files_by_name(manifest: dict) -> dict[str, dict]:
    return {f["name"]: f for f in manifest["files"]}
