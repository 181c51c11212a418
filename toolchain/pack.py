"""`ingot pack`: one deterministic bundle file from a GGUF model and a kernel build.

Members, in sorted order (ingot.runtime.bundle.container describes the format):
  kernels/<module>.fatbin   every fatbin of the build (build.json lists them)
  manifest.json             canonical JSON: toolchain, runtime identity, kernels, model, selftest, files
  model/<name>.gguf         stored uncompressed, data 4096-aligned (a pax `comment` pads its header) so the
                            runtime maps tensors in place. The GGUF carries the tokenizer and chat template.
  provenance.json           SLSA v1 provenance of the kernel build (provenance.py)
  signature.sigstore.json   added by `ingot sign` (a Sigstore bundle; runtime/bundle/signature.py)
Determinism: every header has mtime $SOURCE_DATE_EPOCH (default 0), uid/gid 0, no user or group names,
mode 0644; no host path or timestamp enters the manifest; the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import gguf

import ingot
from ingot.runtime.bundle.container import Source, write_bundle
from ingot.runtime.bundle.manifest import (
    CHUNK_SIZE,
    FORMAT,
    MANIFEST,
    PROVENANCE,
    canonical_json,
    file_entry,
    hash_range,
    runtime_identity,
    seal,
    sha256_hex,
)
from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.constants import WEIGHT_LAYOUT
from ingot.runtime.gpu.fatbin import parse_fatbin
from ingot.runtime.model.gguf import describe_file
from ingot.runtime.selftest import record as record_selftest
from ingot.toolchain.archs import kernel_source_dir, project_root
from ingot.toolchain.build import build
from ingot.toolchain.nvcc import cmake_version
from ingot.toolchain.provenance import LOCK_FILE, kernel_provenance, python_environment

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


# --- inputs: kernels, model, selftest --------------------------------------------------------------


def source_date_epoch() -> int:
    text = os.environ.get("SOURCE_DATE_EPOCH", "0").strip() or "0"
    if not text.isdigit():
        raise UsageError(
            f"SOURCE_DATE_EPOCH={text!r} is not a non-negative integer",
            hint="set it to a Unix timestamp, e.g. $(git log -1 --format=%ct), or unset it",
        )
    return int(text)


def load_build_record(kernel_dir: Path) -> dict:
    path = kernel_dir / "build.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(
            f"{path} not found: --kernels must be a folder written by `ingot build`",
            hint=f"run `ingot build --out {kernel_dir}`",
        ) from None
    except ValueError:
        record = None
    if not isinstance(record, dict) or any(k not in record for k in ("fatbins", "toolkit", "archs", "flags")):
        raise UsageError(
            f"{path} is not a build record of `ingot build`", hint=f"rebuild with `ingot build --out {kernel_dir}`"
        )
    if not record["fatbins"]:
        raise UsageError(f"{path} lists no kernel modules", hint=f"rebuild with `ingot build --out {kernel_dir}`")
    return record


def describe_kernels(kernel_dir: Path, record: dict) -> list[tuple[dict, bytes]]:
    """(manifest kernel entry, fatbin bytes) for every module of the build, checked against build.json."""

    out = []
    for b in sorted(record["fatbins"], key=lambda b: b["name"]):
        name = b["name"]
        path = kernel_dir / f"{name}.fatbin"
        if not _NAME.fullmatch(name):
            raise UsageError(f"{kernel_dir}/build.json names a module {name!r} that is not a plain file name")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise UsageError(
                f"{path} is listed in build.json but missing", hint=f"rebuild with `ingot build --out {kernel_dir}`"
            ) from None
        if sha256_hex(data) != b["sha256"]:
            raise UsageError(
                f"{path} does not match the digest in {kernel_dir}/build.json",
                hint=f"the folder was modified after the build; run `ingot build --out {kernel_dir}`",
            )
        fat = parse_fatbin(data, name=str(path))
        ptx = [{"arch": e.arch, "isa": e.isa} for e in fat.entries if e.kind == "ptx"]
        entry = {
            "name": name,
            "path": f"kernels/{name}.fatbin",
            "sha256": b["sha256"],
            "size": len(data),
            "archs": {"sass": fat.sass, "ptx": sorted(ptx, key=lambda p: fat.ptx.index(str(p["arch"])))},
            "kernels": list(fat.kernels),
        }
        out.append((entry, data))
    return out


def _toolchain(record: dict) -> dict:
    try:
        bindings = version("cuda-bindings")
    except PackageNotFoundError:
        bindings = None
    tk = record["toolkit"]
    return {
        "ingot": ingot.__version__,
        "nvcc": {"version": tk["version"], "build": tk["build"]},
        "host_compiler": (record.get("host_compiler") or {}).get("version"),
        "cmake": cmake_version(),
        "cuda_bindings": bindings,
    }


def _build_inputs() -> dict[str, str]:
    """Digests of the build inputs that are not nvcc inputs: cuda/archs.json, and, when running from a
    checkout (an installed wheel ships neither), CMakeLists.txt and the Python lock file ci/requirements.lock."""
    out = {"cuda/archs.json": sha256_hex((kernel_source_dir() / "archs.json").read_bytes())}
    root = project_root()
    if root is not None:
        for name in ("CMakeLists.txt", LOCK_FILE):
            if (root / name).is_file():
                out[name] = sha256_hex((root / name).read_bytes())
    return out


_MAX_EXACT = 2**53 - 1  # RFC 8785 (I-JSON): larger integers are not exact in every JSON reader


def _exact_json(obj):
    """obj with every integer beyond +-(2**53 - 1) as its decimal string (canonical JSON refuses those)."""
    if isinstance(obj, dict):
        return {k: _exact_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_exact_json(v) for v in obj]
    if isinstance(obj, int) and not isinstance(obj, bool) and abs(obj) > _MAX_EXACT:
        return str(obj)
    return obj


def model_origin(path: Path, extra_sources: tuple[str, ...] = ()) -> dict:
    """The license and source URLs the GGUF declares (general.license, general.source.*, general.url,
    general.repo_url) plus the packer's --source URLs, for the manifest and the AI-BOM."""
    reader = gguf.GGUFReader(path)

    def text(key: str) -> str | None:
        field = reader.fields.get(key)
        if field is None or len(field.types) != 1 or field.types[0] != gguf.GGUFValueType.STRING:
            return None
        value = field.contents()
        return value.strip() if isinstance(value, str) and value.strip() else None

    sources = [text(k) for k in ("general.source.url", "general.url", "general.repo_url")]
    repo = text("general.source.huggingface.repository")
    if repo:
        sources.append(f"https://huggingface.co/{repo}")
    for url in extra_sources:
        if not url.startswith(("https://", "http://")):
            raise UsageError(f"--source {url!r} is not an http(s) URL", hint="pass where the model was downloaded from")
    sources += list(extra_sources)
    out: dict = {"sources": sorted({s for s in sources if s and s.startswith(("https://", "http://"))})}
    if text("general.license"):
        out["license"] = text("general.license")
    return out


# --- pack ----------------------------------------------------------------------------------------------


def pack(
    model: str | Path,
    *,
    kernels: str | Path | None = None,
    name: str | None = None,
    out: str | Path | None = None,
    selftest: bool = True,
    source_urls: tuple[str, ...] = (),
    on_stage=None,
    on_bytes=None,
) -> dict:
    """Build (unless `kernels` is given), describe, digest and write one bundle. on_stage(text) reports
    progress between steps; on_bytes(n) counts model bytes hashed and copied."""
    stage = on_stage or (lambda text: None)
    model = Path(model)
    if not model.is_file():
        raise UsageError(f"{model}: no such model file", hint="pass --model PATH.gguf")
    name = name or model.stem
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"bundle name {name!r} must be letters, digits, '.', '_' or '-' (at most 100)", hint="pass --name NAME"
        )
    out = Path(out) if out else Path("dist") / f"{name}.ingot"
    mtime = source_date_epoch()

    if kernels is None:
        stage("building kernels (ingot build -> dist/kernels)")
        kernel_dir = build(out_dir="dist/kernels").out_dir
    else:
        kernel_dir = Path(kernels)
    record = load_build_record(kernel_dir)
    modules = describe_kernels(kernel_dir, record)

    stage("reading the model")
    described = _exact_json(describe_file(model))  # first: it refuses a file that is not a GGUF (exit 5)
    model_info = described | {"weight_layout": WEIGHT_LAYOUT, "origin": model_origin(model, tuple(source_urls))}
    size = model.stat().st_size
    with open(model, "rb", buffering=0) as f:
        digest, chunks = hash_range(f, 0, size, chunk_size=CHUNK_SIZE, on_bytes=on_bytes)
    model_path = f"model/{name}.gguf"

    kernel_entries = [entry for entry, _ in modules]
    provenance = canonical_json(
        kernel_provenance(record, kernel_entries, _build_inputs(), ingot.__version__, python_environment())
    )
    files = [file_entry(e["path"], e["size"], e["sha256"], []) for e in kernel_entries]
    files.append(file_entry(model_path, size, digest, chunks))
    files.append(file_entry(PROVENANCE, len(provenance), sha256_hex(provenance), []))
    manifest = {
        "format": FORMAT,
        "name": name,
        "chunk_size": CHUNK_SIZE,
        "toolchain": _toolchain(record),
        "runtime": runtime_identity(ingot.__version__, selftested=selftest),
        "kernels": kernel_entries,
        "model": {"path": model_path, "sha256": digest, "size": size} | model_info,
        "provenance": PROVENANCE,
        "files": sorted(files, key=lambda e: e["name"]),
    }
    if selftest:
        stage("computing the CPU self-test logits")
        manifest["selftest"] = record_selftest(model)
    manifest_bytes = seal(manifest)

    stage(f"writing {out}")
    sources = [
        Source(MANIFEST, len(manifest_bytes), data=manifest_bytes),
        Source(PROVENANCE, len(provenance), data=provenance),
        Source(model_path, size, path=model, sha256=digest),
    ]
    sources += [Source(e["path"], len(data), data=data) for e, data in modules]
    written = write_bundle(out, sources, mtime=mtime, on_bytes=on_bytes)
    return {
        "bundle": str(out),
        "sha256": written["sha256"],
        "size": written["size"],
        "name": name,
        "root_digest": manifest["root_digest"],
        "model_offset": written["offsets"][model_path],
        "members": [{"name": n, "offset": o} for n, o in sorted(written["offsets"].items())],
        "selftest": "selftest" in manifest,
        "kernel_dir": str(kernel_dir),
    }
