"""Benchmarks: `verify` throughput, and open_bundle's cold-start cost with a valid verified-stamp.

Run: pytest tests/bench_verify.py --benchmark-enable -s   (not part of the default test run)
Warm: the bundle is in the page cache, so this measures the verifier itself (8 MiB reads + sha256).
Cold: the bundle's pages are evicted before each round (posix_fadvise DONTNEED), so reads hit the disk.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from bundle_fixtures import write_gguf

from ingot.runtime.bundle.open import open_bundle
from ingot.runtime.bundle.verify import verify_bundle
from ingot.toolchain.pack import pack

SIZE_MIB = 512


@pytest.fixture(scope="module")
def large_bundle(tmp_path_factory, kernel_dir):
    d = tmp_path_factory.mktemp("bench")
    weights = np.arange(SIZE_MIB * 2**18, dtype=np.float32).reshape(-1, 4096)  # SIZE_MIB MiB of tensor data
    model = write_gguf(d / "large.gguf", {"w.weight": weights})
    return pack(model, kernels=kernel_dir, out=d / "large.ingot", selftest=False)


def test_verify_throughput(benchmark, large_bundle, stamp_cache):
    report = benchmark.pedantic(verify_bundle, args=(large_bundle["bundle"],), rounds=5, iterations=1, warmup_rounds=1)
    assert report["ok"]
    mb_per_s = report["hashed_bytes"] / 1e6 / benchmark.stats.stats.min
    benchmark.extra_info.update(hashed_mb=round(report["hashed_bytes"] / 1e6), best_mb_per_s=round(mb_per_s))
    print(
        f"\nverify: {report['hashed_bytes'] / 1e6:,.0f} MB hashed, best {mb_per_s:,.0f} MB/s "
        f"(median {report['hashed_bytes'] / 1e6 / benchmark.stats.stats.median:,.0f} MB/s)"
    )


def _evict(path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_verify_throughput_cold_cache(benchmark, large_bundle, stamp_cache):
    path = large_bundle["bundle"]
    report = benchmark.pedantic(verify_bundle, args=(path,), setup=lambda: _evict(path), rounds=3, iterations=1)
    mb_per_s = report["hashed_bytes"] / 1e6 / benchmark.stats.stats.median
    benchmark.extra_info.update(median_mb_per_s=round(mb_per_s))
    print(f"\nverify from disk (cold page cache): median {mb_per_s:,.0f} MB/s")


def test_open_bundle_with_a_valid_stamp(benchmark, large_bundle, stamp_cache):
    open_bundle(large_bundle["bundle"])  # the one full verification, which writes the stamp
    b = benchmark(open_bundle, large_bundle["bundle"])
    assert b.verified
    print(f"\nopen_bundle with a valid stamp: {benchmark.stats.stats.median * 1e3:.2f} ms median")
