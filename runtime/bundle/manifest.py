"""The bundle manifest: canonical JSON, member digests, the root digest, the runtime identity, the schema check.

A manifest is canonical JSON (RFC 8785 / JCS, through the `rfc8785` library), so the same content always has
the same bytes, and `verify` refuses any manifest whose bytes are not the canonical form of what they parse to.

`files` lists every member except manifest.json and the signature, sorted by name, in the layout of the
OpenSSF model_signing v1.0 predicate's `resources` ({name, algorithm, digest}) plus `size`, and, for members
larger than one chunk (64 MiB), `chunks`: the sha256 of each 64 MiB piece, so `verify` can name the damaged
piece of a 70 GB model. `self_digest` is the sha256 of the manifest's canonical bytes without that field: a
flipped byte in any manifest field is caught even in an unsigned bundle.

The root digest is exactly what OpenSSF model_signing (`method: files`, sha256) computes for the extracted
bundle with the signature ignored: the resources are every member but the signature, manifest.json
included as its file bytes, in model_signing's order (path components compared one by one), and the root is
the sha256 of their raw digests concatenated. It cannot live in manifest.json (which it covers), so
parse_manifest derives it, with `manifest_digest` (sha256 of the manifest.json bytes), into the returned
dict; neither is ever stored. Signatures sign this root (signature.py).

`runtime` records what interprets the bundle: the kernel ABI / weight-layout version of the runtime that
packed and self-tested it. check_runtime refuses, as IncompatibleError (exit 3), a bundle whose ABI this
runtime does not run.
"""

from __future__ import annotations

import hashlib
import re

import rfc8785

from ingot.runtime.errors import IncompatibleError, VerificationError
from ingot.runtime.gpu.constants import KERNEL_ABI, WEIGHT_LAYOUT
from ingot.runtime.limits import bounded_json_loads

FORMAT = "ingot-bundle/v2"
# Formats this Ingot recognises but no longer reads, and why.
RETIRED_FORMATS = {
    "ingot-bundle/v1": "its root digest and signature predate the model_signing/Sigstore-compatible v2 format",
}
MANIFEST = "manifest.json"
SIGNATURE = "signature.sigstore.json"
DERIVED = ("manifest_digest", "root_digest")  # set by parse_manifest/derive, never stored in manifest.json
PROVENANCE = "provenance.json"
CHUNK_SIZE = 64 << 20
READ_SIZE = 8 << 20  # large reads keep hashing at disk speed
MAX_MEMBER_SIZE = 1 << 44  # 16 TiB: anything larger is a corrupt or hostile size field
MAX_MANIFEST_SIZE = 64 << 20
MAX_MEMBERS = 4096

_HEX64 = re.compile(r"[0-9a-f]{64}")


# --- canonical JSON (RFC 8785) -------------------------------------------------------------------


def canonical_json(obj) -> bytes:
    """obj -> its RFC 8785 canonical UTF-8 bytes, through the `rfc8785` library (the one sigstore uses).

    Raises ValueError (rfc8785.CanonicalizationError) for what JCS cannot carry: NaN/inf, integers outside
    +-(2**53 - 1) (store those as strings), non-str keys, bytes and other types."""
    return rfc8785.dumps(obj)


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
        want = min(READ_SIZE, left, chunk_size - in_piece) if chunk_size else min(READ_SIZE, left)
        got = f.readinto(view[:want])
        if not got:
            raise EOFError(f"file ends {left} bytes early")
        whole.update(view[:got])
        if piece is not None:
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
    """The model_signing resources of the bundle (every member but the signature), in model_signing's order.
    Needs the derived manifest_digest (parse_manifest or derive set it)."""
    own = {"name": MANIFEST, "algorithm": "sha256", "digest": manifest["manifest_digest"]}
    files = [{"name": f["name"], "algorithm": f["algorithm"], "digest": f["digest"]} for f in manifest["files"]]
    return sorted(files + [own], key=lambda r: r["name"].split("/"))


def root_of(resources: list[dict]) -> str:
    """model_signing's subject digest: sha256 over the raw resource digests, in the order given."""
    return hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()


def _self_digest(manifest: dict) -> str:
    return sha256_hex(canonical_json({k: v for k, v in manifest.items() if k not in ("self_digest", *DERIVED)}))


def seal(manifest: dict) -> bytes:
    """Set self_digest and return the manifest's canonical bytes (what goes into the bundle); then derive the
    manifest_digest and root_digest of those bytes into the dict."""
    manifest["self_digest"] = _self_digest(manifest)
    data = canonical_json({k: v for k, v in manifest.items() if k not in DERIVED})
    derive(manifest, data)
    return data


def derive(manifest: dict, data: bytes) -> dict:
    """Add the derived manifest_digest (of `data`, the manifest.json bytes) and root_digest to manifest."""
    manifest["manifest_digest"] = sha256_hex(data)
    manifest["root_digest"] = root_of(resources(manifest))
    return manifest


# --- the runtime identity ----------------------------------------------------------------------------


def runtime_identity(ingot_version: str, selftested: bool) -> dict:
    """The manifest's `runtime` section, for a bundle packed (and self-tested) by this Ingot."""
    return {
        "kernel_abi": KERNEL_ABI,
        "weight_layout": WEIGHT_LAYOUT,
        "ingot": ingot_version,
        "selftested": selftested,
    }


def check_runtime(manifest: dict) -> dict:
    """Whether this runtime can run the bundle: IncompatibleError (exit 3) naming the fix when its kernel ABI
    differs; otherwise the report `ingot verify` prints."""
    rt = manifest["runtime"]
    if rt["kernel_abi"] != KERNEL_ABI:
        raise IncompatibleError(
            f"bundle {manifest['name']!r} needs kernel ABI {rt['kernel_abi']} (weight layout "
            f"{rt['weight_layout'].split(':')[0]!r}, packed by Ingot {rt['ingot']}); this Ingot runs kernel ABI "
            f"{KERNEL_ABI} ({WEIGHT_LAYOUT.split(':')[0]!r})",
            hint=f"install Ingot {rt['ingot']} to run it, or re-pack the model with this Ingot (`ingot pack`)",
        )
    return {"kernel_abi": KERNEL_ABI, "weight_layout": WEIGHT_LAYOUT.split(":")[0], "packed_by": rt["ingot"]}


# --- parsing and the schema check --------------------------------------------------------------------


def parse_manifest(data: bytes) -> dict:
    """manifest.json bytes -> the manifest, after the canonical-form, schema and self-digest checks, with the
    derived manifest_digest and root_digest added (see the module docstring)."""
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
    expect = _self_digest(manifest)
    if manifest["self_digest"] != expect:
        raise VerificationError(
            f"{where}: self digest {manifest['self_digest'][:16]}... does not match its content ({expect[:16]}...)",
            hint=_TAMPERED,
        )
    return derive(manifest, data)


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
    if fmt in RETIRED_FORMATS:
        raise VerificationError(
            f"{MANIFEST}: bundle format {fmt} is no longer read by this Ingot ({RETIRED_FORMATS[fmt]})",
            hint=f"re-pack it with `ingot pack` (writes {FORMAT}) and sign it again",
        )
    if fmt != FORMAT:
        raise VerificationError(
            f"{MANIFEST}: unknown bundle format {fmt!r} (this Ingot reads {FORMAT})",
            hint="upgrade Ingot, or re-pack the bundle with this version",
        )
    _get(m, "name", str, "name")
    _digest(m, "self_digest", "self_digest")
    for key in DERIVED:
        if key in m:
            raise _bad(key, "must not be stored (it is derived from the bundle)")
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
    rt = _get(m, "runtime", dict, "runtime")
    _get(rt, "kernel_abi", int, "runtime.kernel_abi")
    for key in ("weight_layout", "ingot"):
        _get(rt, key, str, f"runtime.{key}")
    _get(rt, "selftested", bool, "runtime.selftested")
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
