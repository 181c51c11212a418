"""Deliverable 6 (files) of issue #13: an interrupted pack/sign leaves no temp file behind for good."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ingot.runtime.bundle.container import STALE_TEMP_S, Source, remove_stale_temps, write_bundle


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _temp(folder, name, age):
    path = folder / name
    path.write_bytes(b"x" * 1000)
    old = time.time() - age
    os.utime(path, (old, old))
    return path


def test_stale_temps_of_a_killed_writer_are_removed_on_the_next_write(tmp_path):
    out = tmp_path / "m.ingot"
    dead, live = _dead_pid(), os.getpid()
    stale = _temp(tmp_path, f".m.ingot.{dead}.abc.tmp", STALE_TEMP_S + 10)
    legacy = _temp(tmp_path, ".m.ingot.k2j3h4.tmp", STALE_TEMP_S + 10)  # the old name, without a pid
    running = _temp(tmp_path, f".m.ingot.{live}.def.tmp", STALE_TEMP_S + 10)  # its writer still runs
    fresh = _temp(tmp_path, f".m.ingot.{dead}.ghi.tmp", 5)  # written seconds ago
    other = _temp(tmp_path, f".n.ingot.{dead}.abc.tmp", STALE_TEMP_S + 10)  # another bundle's
    write_bundle(out, [Source("a.txt", 2, data=b"hi")], mtime=0)
    assert not stale.exists() and not legacy.exists()
    assert running.exists() and fresh.exists() and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".m.ingot")) == sorted(
        [running.name, fresh.name]
    )


def test_the_temp_name_carries_the_writer_pid(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_bundle(tmp_path / "m.ingot", [Source("a.txt", 2, data=b"hi")], mtime=0)
    assert seen and seen[0].startswith(f".m.ingot.{os.getpid()}.") and seen[0].endswith(".tmp")
    assert remove_stale_temps(tmp_path / "m.ingot") == []


def test_a_killed_pack_leaves_nothing_after_the_next_one(tmp_path, toy_model, kernel_dir):
    """SIGKILL a pack mid-write, then run pack again: the next run removes the abandoned temp file."""
    out = tmp_path / "t.ingot"
    code = (
        "import os, signal, sys\n"
        "from ingot.runtime.bundle import container\n"
        "real = container._add\n"
        "def add(tar, info, src, on_bytes):\n"
        "    real(tar, info, src, on_bytes)\n"
        "    if src.name.startswith('model/'):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "container._add = add\n"
        "from ingot.toolchain.pack import pack\n"
        f"pack({str(toy_model)!r}, kernels={str(kernel_dir)!r}, out={str(out)!r}, selftest=False)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert p.returncode == -9
    left = [f for f in tmp_path.iterdir() if f.name.startswith(".t.ingot.")]
    assert len(left) == 1 and not out.exists()
    old = time.time() - STALE_TEMP_S - 1
    os.utime(left[0], (old, old))
    from ingot.toolchain.pack import pack

    pack(toy_model, kernels=kernel_dir, out=out, selftest=False)
    assert out.exists() and [f.name for f in tmp_path.iterdir() if f.name.startswith(".t.ingot.")] == []
