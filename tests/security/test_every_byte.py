"""Deliverable 2 of issue #13: every byte of a signed bundle is covered.

The member digests cover member data; the canonical-container check (container.check_canonical) covers
every other byte: tar headers and pax records, padding, the end-of-archive blocks and the total length.
On the smallest signed bundle (one kernel module, 40,960 bytes) this flips every byte of the file in turn (xor
0x01) and requires the full verification (`verify_bundle` with --pubkey) to refuse each: 40,960 flips, ~27 s on
one core.
"""

from __future__ import annotations

import os
import tarfile
import time

import pytest

from ingot.runtime.bundle import verify as verify_mod
from ingot.runtime.bundle.verify import verify_bundle
from ingot.runtime.errors import VerificationError


def _offsets(bundle) -> list[int]:
    size = bundle.stat().st_size
    data_ranges = []
    with tarfile.open(bundle) as tar:
        for m in tar.getmembers():
            data_ranges.append((m.name, m.offset_data, m.offset_data + m.size))
    covered = set()
    out = []
    for _name, lo, hi in data_ranges:
        covered.update(range(lo, hi))
        out.extend(range(lo, hi))
    out.extend(i for i in range(size) if i not in covered)  # headers, pax records, padding, trailer
    return sorted(out)


def test_every_byte_flip_of_a_signed_bundle_is_refused(monkeypatch, stamp_cache, tmp_path, small_signed_bundle, keys):
    monkeypatch.setattr(verify_mod, "write_stamp", lambda *a, **k: None)  # only failures are expected
    work = tmp_path / "flip.ingot"
    data = small_signed_bundle.read_bytes()
    work.write_bytes(data)
    verify_bundle(work, pubkey=keys["a"]["pub"])  # the untouched bundle verifies
    offsets = _offsets(small_signed_bundle)
    assert offsets == list(range(len(data)))  # every byte, not a sample
    t0 = time.perf_counter()
    accepted = []
    fd = os.open(work, os.O_RDWR)
    try:
        for i in offsets:
            os.pwrite(fd, bytes([data[i] ^ 0x01]), i)
            try:
                verify_bundle(work, pubkey=keys["a"]["pub"])
                accepted.append(i)
            except VerificationError:
                pass
            os.pwrite(fd, data[i : i + 1], i)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    print(f"every-byte: {len(offsets)} of {len(data)} bytes flipped, {len(accepted)} accepted, {dt:.1f} s")
    assert not accepted, f"flips accepted at offsets {accepted[:20]}"


@pytest.mark.parametrize("cut", [512, 1024, 10240])
def test_truncating_the_end_of_archive_is_refused(stamp_cache, tmp_path, small_signed_bundle, cut):
    bad = tmp_path / "cut.ingot"
    bad.write_bytes(small_signed_bundle.read_bytes()[:-cut])
    with pytest.raises(VerificationError):
        verify_bundle(bad)


def test_a_pax_comment_or_smuggled_pax_record_is_refused(stamp_cache, tmp_path, small_signed_bundle):
    """Rewrite the model's pax header with an extra 500 kB record: digests still match, the layout does not."""
    src = small_signed_bundle.read_bytes()
    with tarfile.open(small_signed_bundle) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    bad = tmp_path / "smuggled.ingot"
    with tarfile.open(bad, "w", format=tarfile.PAX_FORMAT) as out:
        for m, body in members:
            if m.name.startswith("model/"):
                m.pax_headers = dict(m.pax_headers) | {"comment": "x" * 500_000}
            out.addfile(m, __import__("io").BytesIO(body))
    assert bad.read_bytes() != src
    with pytest.raises(VerificationError, match="tar header of|non-canonical"):
        verify_bundle(bad)
