"""Deliverable 1 of issue #13: the bytes that run are the bytes verified.

A bundle path is renamed over, in a loop, by a thread alternating a good bundle and a tampered one (each a
hard link, so each keeps its inode) while the main thread opens the path 200 times with open_model. Every
open must either refuse (exit 4) or map exactly the good model's bytes: never verify one file and run another.
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from ingot.runtime.bundle.open import open_bundle
from ingot.runtime.errors import VerificationError
from ingot.runtime.resolve import open_model

RUNS = 200


def _model_digest(model) -> str:
    h = hashlib.sha256()
    for name in sorted(model.tensors):
        h.update(model.tensors[name].raw.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny_llama_bundle(tmp_path_factory, kernel_dir, tiny_llama):
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("race") / "good.ingot"
    pack(tiny_llama, kernels=kernel_dir, out=out, selftest=False)
    return out


def test_a_bundle_swapped_by_rename_while_opening_never_runs_unverified(
    stamp_cache, tmp_path, tiny_llama_bundle, capsys
):
    good = tmp_path / "good.ingot"
    bad = tmp_path / "bad.ingot"
    good.write_bytes(tiny_llama_bundle.read_bytes())
    with open_bundle(good) as b:  # find a tensor byte to tamper with; warms the stamp and index caches
        spot = b.model_offset + b.model_size - 5
        model = open_model(str(good)).model
        want = _model_digest(model)
    data = bytearray(good.read_bytes())
    data[spot] ^= 0xFF
    bad.write_bytes(bytes(data))
    target = tmp_path / "target.ingot"
    os.link(good, target)

    stop = threading.Event()

    def swap():
        i = 0
        while not stop.is_set():
            src = bad if i % 2 == 0 else good
            tmp = tmp_path / f"next-{i}.ingot"
            os.link(src, tmp)
            os.replace(tmp, target)  # atomic rename over the path being opened
            i += 1

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    ran = refused = unverified = 0
    try:
        for _ in range(RUNS):
            try:
                opened = open_model(str(target))
            except VerificationError:
                refused += 1
                continue
            ran += 1
            if _model_digest(opened.model) != want:
                unverified += 1
    finally:
        stop.set()
        t.join()
    capsys.readouterr()
    print(f"race: {RUNS} opens, {ran} ran the good bundle, {refused} refused, {unverified} unverified")
    assert unverified == 0 and ran + refused == RUNS
    assert ran and refused  # the swap really raced both ways
