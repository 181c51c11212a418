"""`ingot pack`: one deterministic bundle file from a GGUF model and a kernel build.

Members, in sorted order (bundle.py describes the format):
  kernels/<module>.fatbin   every fatbin of the build (build.json lists them)
  manifest.json             canonical JSON: toolchain, kernels, model, selftest, files, root digest
  model/<name>.gguf         stored uncompressed, data 4096-aligned (a pax `comment` pads its header) so the
                            runtime maps tensors in place. The GGUF carries the tokenizer and chat template.
  provenance.json           SLSA v1 provenance of the kernel build (provenance.py)
  signature.dsse.json       added by `ingot sign`
Determinism: every header has mtime $SOURCE_DATE_EPOCH (default 0), uid/gid 0, no user or group names,
mode 0644; no host path or timestamp enters the manifest; the same inputs give the same bytes.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .bundle import MODEL_ALIGN
from .errors import IngotError, ModelError, UsageError
from .manifest import (CHUNK_SIZE, FORMAT, MANIFEST, PROVENANCE, READ_SIZE, canonical_json, file_entry,
                       hash_range, seal, sha256_hex)

# The GPU engine's weight layout (ingot.runtime.engines.cuda_weights.LAYOUT), recorded so a runtime that
# repacks differently can refuse the bundle. This copy is used only where the GPU engine cannot be imported.
_WEIGHT_LAYOUT = ("soa-v1: quantized matrices repacked at load into separate quant/scale(/min) arrays; "
                  "q,k,v and gate,up stacked")
SELFTEST_PROMPT = "The capital of France is"
SELFTEST_TOP_K = 32
# Logits are rounded so BLAS summation-order noise across machines does not change the bundle's bytes;
# the GPU self-test's tolerance is far looser than this.
SELFTEST_DECIMALS = 4
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


# --- the deterministic tar writer ------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """One member to write: bytes in memory, or `size` bytes at `offset` of an open raw file or a path."""
    name: str
    size: int
    data: bytes | None = None
    file: object | None = None
    path: Path | None = None
    offset: int = 0
    sha256: str | None = None       # when given, the copied bytes must have this digest


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


def _align_data(info: tarfile.TarInfo, tar: tarfile.TarFile, align: int) -> None:
    """Grow a pax `comment` until this member's data starts at a multiple of `align` in the archive."""
    for n in range(0, align + 4 * tarfile.BLOCKSIZE, 64):
        info.pax_headers = {"comment": "ingot: padding so the data below starts page-aligned " + "." * n}
        if (tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))) % align == 0:
            return
    raise AssertionError("no pax padding aligns the member")   # unreachable: 64-byte steps cover every block


def write_bundle(out: Path, sources: list[Source], *, mtime: int, on_bytes=None) -> dict:
    """Write the members in name order as a PAX tar, atomically; returns sha256, size and member offsets."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    offsets = {}
    try:
        with os.fdopen(fd, "wb") as raw:
            sink = _HashingSink(raw)
            with tarfile.open(fileobj=sink, mode="w:", format=tarfile.PAX_FORMAT, copybufsize=READ_SIZE) as tar:
                for src in sorted(sources, key=lambda s: s.name):
                    info = _tarinfo(src.name, src.size, mtime)
                    if src.name.startswith("model/"):
                        _align_data(info, tar, MODEL_ALIGN)
                    offsets[src.name] = tar.offset + len(info.tobuf(tar.format, tar.encoding, tar.errors))
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
    owned = open(src.path, "rb", buffering=0) if src.file is None else None
    try:
        reader = _RangeReader((owned or src.file).fileno(), src.offset, src.size, on_bytes)
        try:
            tar.addfile(info, reader)
        except OSError as e:   # tarfile's "unexpected end of data" when the source shrank
            raise IngotError(f"{src.name}: could not copy {src.size:,} bytes ({e})",
                             hint="an input file changed while packing; run the command again") from None
    finally:
        if owned:
            owned.close()
    if src.sha256 and reader.hash.hexdigest() != src.sha256:
        from .errors import VerificationError
        raise VerificationError(f"member {src.name} changed while it was being copied (sha256 mismatch)",
                                hint="do not modify inputs while packing or signing; run the command again")


# --- inputs: kernels, model, selftest --------------------------------------------------------------

def source_date_epoch() -> int:
    text = os.environ.get("SOURCE_DATE_EPOCH", "0").strip() or "0"
    if not text.isdigit():
        raise UsageError(f"SOURCE_DATE_EPOCH={text!r} is not a non-negative integer",
                         hint="set it to a Unix timestamp, e.g. $(git log -1 --format=%ct), or unset it")
    return int(text)


def load_build_record(kernel_dir: Path) -> dict:
    import json
    path = kernel_dir / "build.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path} not found: --kernels must be a folder written by `ingot build`",
                         hint=f"run `ingot build --out {kernel_dir}`") from None
    except ValueError:
        record = None
    if not isinstance(record, dict) or any(k not in record for k in ("fatbins", "toolkit", "archs", "flags")):
        raise UsageError(f"{path} is not a build record of `ingot build`",
                         hint=f"rebuild with `ingot build --out {kernel_dir}`")
    if not record["fatbins"]:
        raise UsageError(f"{path} lists no kernel modules", hint=f"rebuild with `ingot build --out {kernel_dir}`")
    return record


def describe_kernels(kernel_dir: Path, record: dict) -> list[tuple[dict, bytes]]:
    """(manifest kernel entry, fatbin bytes) for every module of the build, checked against build.json."""
    from .fatbin import parse_fatbin

    out = []
    for b in sorted(record["fatbins"], key=lambda b: b["name"]):
        name = b["name"]
        path = kernel_dir / f"{name}.fatbin"
        if not _NAME.fullmatch(name):
            raise UsageError(f"{kernel_dir}/build.json names a module {name!r} that is not a plain file name")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UsageError(f"{path} is listed in build.json but missing",
                             hint=f"rebuild with `ingot build --out {kernel_dir}`") from None
        if sha256_hex(data) != b["sha256"]:
            raise UsageError(f"{path} does not match the digest in {kernel_dir}/build.json",
                             hint=f"the folder was modified after the build; run `ingot build --out {kernel_dir}`")
        fat = parse_fatbin(data, name=str(path))
        ptx = [{"arch": e.arch, "isa": e.isa} for e in fat.entries if e.kind == "ptx"]
        entry = {"name": name, "path": f"kernels/{name}.fatbin", "sha256": b["sha256"], "size": len(data),
                 "archs": {"sass": fat.sass, "ptx": sorted(ptx, key=lambda p: fat.ptx.index(p["arch"]))},
                 "kernels": list(fat.kernels)}
        out.append((entry, data))
    return out


def _scalar(value):
    """GGUF metadata values -> plain JSON scalars (numpy ints/floats/bools come out of the reader)."""
    if isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def describe_gguf(path: Path) -> dict:
    """Architecture, hyperparameters (the `<arch>.*` metadata), quant types and tensor count, via gguf."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:   # the reader raises ValueError, struct.error, IndexError... on bad files
        raise ModelError(f"{path}: not a readable GGUF model ({type(e).__name__}: {e})",
                         hint="pass a .gguf file (llama.cpp's convert_hf_to_gguf.py writes them)") from None

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return _scalar(field.contents()) if field is not None and len(field.types) == 1 else default

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: GGUF has no general.architecture", hint="re-convert the model with llama.cpp")
    hyper = {k[len(arch) + 1:]: value(k) for k, f in reader.fields.items()
             if k.startswith(arch + ".") and len(f.types) == 1}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "name": value("general.name"),
        "hyperparameters": dict(sorted(hyper.items())),
        "quant_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "n_tensors": len(reader.tensors),
        "tokenizer": {"model": value("tokenizer.ggml.model"), "pre": value("tokenizer.ggml.pre"),
                      "n_tokens": len(tokens.data) if tokens is not None else 0,
                      "chat_template": "tokenizer.chat_template" in reader.fields},
        "weight_layout": gpu_weight_layout(),
    }


def gpu_weight_layout() -> str:
    try:
        from ingot.runtime.engines.cuda_weights import LAYOUT
    except ImportError:
        return _WEIGHT_LAYOUT
    return LAYOUT


def compute_selftest(path: Path) -> dict:
    """The CPU reference's logits at the last position of a fixed prompt, for `ingot verify --device`."""
    try:
        import numpy as np

        from ingot.runtime.engines.cpu import CpuEngine
        from ingot.runtime.generate import SamplingParams
        from ingot.runtime.model import load_model
        from ingot.runtime.tokenizer import Tokenizer
    except ImportError as e:
        raise IngotError(f"cannot compute the pack-time self-test: the CPU engine is not available ({e})",
                         hint="pass --no-selftest to pack without it") from None
    try:
        model = load_model(path)
        ids = [int(t) for t in Tokenizer.from_model(model).encode(SELFTEST_PROMPT)]
        engine = CpuEngine(model)
        seq = engine.new_sequence(SamplingParams())
        try:
            logits = np.asarray(engine.logits(seq, ids), dtype=np.float64)[-1]   # [n_vocab]
        finally:
            engine.release(seq)
    except ModelError as e:
        raise ModelError(f"self-test: {e.message}", hint="pass --no-selftest to pack a model the CPU engine "
                         "cannot run") from None
    top = np.lexsort((np.arange(len(logits)), -logits))[:SELFTEST_TOP_K]   # by value, ties by id
    peak = logits.max()
    lse = float(peak + np.log(np.exp(logits - peak).sum()))
    return {"prompt": SELFTEST_PROMPT, "tokens": ids, "position": len(ids) - 1, "n_vocab": len(logits),
            "engine": "cpu", "decimals": SELFTEST_DECIMALS, "argmax": int(top[0]),
            "top_ids": [int(i) for i in top],
            "top_logits": [round(float(logits[i]), SELFTEST_DECIMALS) for i in top],
            "logsumexp": round(lse, SELFTEST_DECIMALS)}


def _toolchain(record: dict) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__
    from .nvcc import cmake_version
    try:
        bindings = version("cuda-bindings")
    except PackageNotFoundError:
        bindings = None
    tk = record["toolkit"]
    return {"ingot": __version__, "nvcc": {"version": tk["version"], "build": tk["build"]},
            "host_compiler": (record.get("host_compiler") or {}).get("version"), "cmake": cmake_version(),
            "cuda_bindings": bindings}


def _build_inputs() -> dict[str, str]:
    """Digests of the build policy files that are not nvcc inputs: cuda/archs.json, and CMakeLists.txt
    when running from a checkout (an installed wheel does not ship it)."""
    from .archs import kernel_source_dir, project_root

    out = {"cuda/archs.json": sha256_hex((kernel_source_dir() / "archs.json").read_bytes())}
    root = project_root()
    if root is not None:
        out["CMakeLists.txt"] = sha256_hex((root / "CMakeLists.txt").read_bytes())
    return out


# --- pack ----------------------------------------------------------------------------------------------

def pack(model: str | Path, *, kernels: str | Path | None = None, name: str | None = None,
         out: str | Path | None = None, selftest: bool = True, on_stage=None, on_bytes=None) -> dict:
    """Build (unless `kernels` is given), describe, digest and write one bundle. on_stage(text) reports
    progress between steps; on_bytes(n) counts model bytes hashed and copied."""
    from . import __version__
    from .provenance import kernel_provenance

    stage = on_stage or (lambda text: None)
    model = Path(model)
    if not model.is_file():
        raise UsageError(f"{model}: no such model file", hint="pass --model PATH.gguf")
    name = name or model.stem
    if not _NAME.fullmatch(name):
        raise UsageError(f"bundle name {name!r} must be letters, digits, '.', '_' or '-' (at most 100)",
                         hint="pass --name NAME")
    out = Path(out) if out else Path("dist") / f"{name}.ingot"
    mtime = source_date_epoch()

    if kernels is None:
        from .build import build
        stage("building kernels (ingot build -> dist/kernels)")
        kernel_dir = build(out_dir="dist/kernels").out_dir
    else:
        kernel_dir = Path(kernels)
    record = load_build_record(kernel_dir)
    modules = describe_kernels(kernel_dir, record)

    stage("reading the model")
    model_info = describe_gguf(model)
    size = model.stat().st_size
    with open(model, "rb", buffering=0) as f:
        digest, chunks = hash_range(f, 0, size, chunk_size=CHUNK_SIZE, on_bytes=on_bytes)
    model_path = f"model/{name}.gguf"

    kernel_entries = [entry for entry, _ in modules]
    provenance = canonical_json(kernel_provenance(record, kernel_entries, _build_inputs(), __version__))
    files = [file_entry(e["path"], e["size"], e["sha256"], []) for e in kernel_entries]
    files.append(file_entry(model_path, size, digest, chunks))
    files.append(file_entry(PROVENANCE, len(provenance), sha256_hex(provenance), []))
    manifest = {
        "format": FORMAT, "name": name, "chunk_size": CHUNK_SIZE,
        "toolchain": _toolchain(record),
        "kernels": kernel_entries,
        "model": {"path": model_path, "sha256": digest, "size": size} | model_info,
        "provenance": PROVENANCE,
        "files": sorted(files, key=lambda e: e["name"]),
    }
    if selftest:
        stage("computing the CPU self-test logits")
        manifest["selftest"] = compute_selftest(model)
    manifest_bytes = seal(manifest)

    stage(f"writing {out}")
    sources = [Source(MANIFEST, len(manifest_bytes), data=manifest_bytes),
               Source(PROVENANCE, len(provenance), data=provenance),
               Source(model_path, size, path=model, sha256=digest)]
    sources += [Source(e["path"], len(data), data=data) for e, data in modules]
    written = write_bundle(out, sources, mtime=mtime, on_bytes=on_bytes)
    return {"bundle": str(out), "sha256": written["sha256"], "size": written["size"], "name": name,
            "root_digest": manifest["root_digest"], "model_offset": written["offsets"][model_path],
            "members": [{"name": n, "offset": o} for n, o in sorted(written["offsets"].items())],
            "selftest": "selftest" in manifest, "kernel_dir": str(kernel_dir)}
