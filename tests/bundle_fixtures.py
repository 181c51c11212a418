"""Fixtures for the bundle tests (pack, verify, sign, rebuild, open_bundle, ci/release.sh).

Kernels are built once per session for two archs (sm_90 SASS + compute_90 PTX) and reused through --kernels;
models are small GGUFs written with gguf.GGUFWriter, or the runtime's tiny Llama (`ingot model synth`) where
the CPU engine must run them. Bundles are made once and copied before tampering.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import shutil
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

TEST_ARCHS = "sm_90,compute_90"


def run_cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `ingot ARGS` in-process through main() (the real exit-code mapping); returns (code, stdout, stderr)."""
    from ingot.toolchain.cli import main

    monkeypatch.setattr(sys, "argv", ["ingot", *map(str, args)])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "toy") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def member_offset(bundle: Path, name: str) -> tuple[int, int]:
    """(data offset, size) of a member, read with tarfile (independently of ingot's own reader)."""
    with tarfile.open(bundle) as tar:
        m = tar.getmember(name)
        return m.offset_data, m.size


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def craft_tar(src: Path, dst: Path, *, drop=(), replace=None, extra=()) -> Path:
    """Rewrite a bundle by hand with tarfile: drop members, replace member bytes, append (TarInfo, bytes)."""
    replace = replace or {}
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for m in tin.getmembers():
            if m.name in drop:
                continue
            data = replace.get(m.name, tin.extractfile(m).read())
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tout.addfile(info, io.BytesIO(data) if data is not None else None)
    return dst


def repack(src: Path, dst: Path, *, replace: dict[str, bytes]) -> Path:
    """Rewrite a bundle with Ingot's own deterministic writer (a canonical container), replacing member bytes:
    for bundles that must be intact apart from what the test changes in a member."""
    from ingot.runtime.bundle.container import Source, write_bundle

    with tarfile.open(src) as tin:
        members = [(m.name, replace.get(m.name, tin.extractfile(m).read()), int(m.mtime)) for m in tin.getmembers()]
    write_bundle(dst, [Source(name, len(data), data=data) for name, data, _ in members], mtime=members[0][2])
    return dst


@contextlib.contextmanager
def session_lock(tmp_path_factory, name: str) -> Iterator[Path]:
    """Hold an exclusive lock shared by every pytest-xdist worker of this session; yields the session's root
    temp folder (common to the workers), where work done under the lock can leave a marker for the others."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's root, common to every worker
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield base


@pytest.fixture(scope="session")
def kernel_dir(tmp_path_factory) -> Path:
    """The real kernels, built once for sm_90 + compute_90 (the kernel cache makes repeat sessions fast).

    Every xdist worker needs them at about the same time; under a session lock the first one compiles into the
    kernel cache and the others wait and read the same entries from it, instead of each running nvcc on the
    same sources at once."""
    from ingot.toolchain.archs import parse_arch_list
    from ingot.toolchain.build import build
    from ingot.toolchain.nvcc import find_toolkit

    if find_toolkit() is None:
        pytest.skip("needs nvcc to build the kernels that go into bundles")
    out = tmp_path_factory.mktemp("kernels")
    with session_lock(tmp_path_factory, "kernel-dir"):
        build(archs=parse_arch_list(TEST_ARCHS), out_dir=out)
    return out


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory) -> Path:
    rng = np.random.default_rng(1)
    return write_gguf(
        tmp_path_factory.mktemp("models") / "toy.gguf",
        {"tok.weight": rng.standard_normal((64, 32)).astype(np.float32), "norm.weight": np.ones(32, dtype=np.float32)},
    )


@pytest.fixture(scope="session")
def big_model(tmp_path_factory) -> Path:
    """Just over one 64 MiB chunk (68 MB): exercises per-chunk digests."""
    data = np.arange(17 * 2**20, dtype=np.float32).reshape(-1, 1024)
    return write_gguf(tmp_path_factory.mktemp("models") / "big.gguf", {"big.weight": data})


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A runnable tiny Llama (random weights, real tokenizer), from `ingot model synth --shape tiny`."""
    from ingot.runtime.model import synth

    return synth.synthesize("tiny", "Q8_0", tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def toy_bundle(tmp_path_factory, kernel_dir, toy_model) -> Path:
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("bundles") / "toy.ingot"
    pack(toy_model, kernels=kernel_dir, out=out, selftest=False)
    return out


@pytest.fixture(scope="session")
def selftest_bundle(tmp_path_factory, kernel_dir, tiny_llama) -> Path:
    """A runnable bundle packed WITH its self-test record (the CPU reference logits `verify --device` checks)."""
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("bundles") / "tiny-selftest.ingot"
    pack(tiny_llama, kernels=kernel_dir, out=out, selftest=True)
    return out


@pytest.fixture(scope="session")
def big_bundle(tmp_path_factory, kernel_dir, big_model) -> Path:
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("bundles") / "big.ingot"
    pack(big_model, kernels=kernel_dir, out=out, selftest=False)
    return out


@pytest.fixture(scope="session")
def keys(tmp_path_factory) -> dict:
    from ingot.toolchain.sign import keygen

    d = tmp_path_factory.mktemp("keys")
    return {"a": keygen(d / "a"), "b": keygen(d / "b"), "ed": keygen(d / "ed", "ed25519")}


@pytest.fixture(scope="session")
def signed_bundle(tmp_path_factory, toy_bundle, keys) -> Path:
    from ingot.toolchain.sign import sign_bundle

    out = tmp_path_factory.mktemp("bundles") / "toy-signed.ingot"
    sign_bundle(toy_bundle, keys["a"]["key"], out)
    return out


@pytest.fixture
def copy_of(tmp_path):
    """copy_of(bundle) -> a private copy to tamper with."""

    def copy(src: Path) -> Path:
        dst = tmp_path / src.name
        shutil.copyfile(src, dst)
        return dst

    return copy


@pytest.fixture
def stamp_cache(tmp_path, monkeypatch) -> Path:
    """A private INGOT_CACHE_DIR: verify and open_bundle write verified-stamps, never into the user's cache."""
    d = tmp_path / "cache"
    monkeypatch.setenv("INGOT_CACHE_DIR", str(d))
    return d / "verified"
