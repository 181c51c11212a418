"""Benchmarks: `verify` throughput, and open_bundle's cold-start cost with a valid verified-stamp.

Run: pytest tests/bench_verify.py --benchmark-enable -s   (a 512 MiB bundle, timed rounds)
In the default test run (benchmarks disabled) the same tests run once each on a 4 MiB bundle, as plain tests of
what they measure: a full verification hashes every member, a cold page cache changes nothing, and a valid
verified-stamp makes open_bundle skip the hashing.
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

SIZE_MIB = 512  # when benchmarking
TEST_SIZE_MIB = 4  # as a plain test (benchmarks disabled, the default)


def _enabled(config) -> bool:
    return not config.getoption("benchmark_disable")


@pytest.fixture(scope="module")
def large_bundle(tmp_path_factory, kernel_dir, pytestconfig):
    d = tmp_path_factory.mktemp("bench")
    mib = SIZE_MIB if _enabled(pytestconfig) else TEST_SIZE_MIB
    weights = np.arange(mib * 2**18, dtype=np.float32).reshape(-1, 4096)  # mib MiB of tensor data
    model = write_gguf(d / "large.gguf", {"w.weight": weights})
    return pack(model, kernels=kernel_dir, out=d / "large.ingot", selftest=False)


def _check_full_verification(report: dict, bundle: dict) -> None:
    """A full verification: every member hashed (all of the file but tar headers and padding), the root as packed."""
    assert report["ok"] and report["root_digest"] == bundle["root_digest"]
    size = os.path.getsize(bundle["bundle"])
    assert size - 64 * 1024 < report["hashed_bytes"] <= size, (report["hashed_bytes"], size)


def test_verify_throughput(benchmark, large_bundle, stamp_cache, pytestconfig):
    report = benchmark.pedantic(verify_bundle, args=(large_bundle["bundle"],), rounds=5, iterations=1, warmup_rounds=1)
    _check_full_verification(report, large_bundle)
    if not _enabled(pytestconfig):
        return
    mb_per_s = report["hashed_bytes"] / 1e6 / benchmark.stats.stats.min
    benchmark.extra_info.update(hashed_mb=round(report["hashed_bytes"] / 1e6), best_mb_per_s=round(mb_per_s))
    print(
        f"\nverify: {report['hashed_bytes'] / 1e6:,.0f} MB hashed, best {mb_per_s:,.0f} MB/s "
        f"(median {report['hashed_bytes'] / 1e6 / benchmark.stats.stats.median:,.0f} MB/s)"
    )


def _evict(path) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_verify_throughput_cold_cache(benchmark, large_bundle, stamp_cache, pytestconfig):
    path = large_bundle["bundle"]
    report = benchmark.pedantic(verify_bundle, args=(path,), setup=lambda: _evict(path), rounds=3, iterations=1)
    _check_full_verification(report, large_bundle)  # read back from disk: the same bytes, the same root
    if not _enabled(pytestconfig):
        return
    mb_per_s = report["hashed_bytes"] / 1e6 / benchmark.stats.stats.median
    benchmark.extra_info.update(median_mb_per_s=round(mb_per_s))
    print(f"\nverify from disk (cold page cache): median {mb_per_s:,.0f} MB/s")


def test_open_bundle_with_a_valid_stamp(benchmark, large_bundle, stamp_cache, pytestconfig, monkeypatch):
    open_bundle(large_bundle["bundle"])  # the one full verification, which writes the stamp
    assert list(stamp_cache.glob("*.json")), "no verified-stamp written"
    # with a valid stamp the members are not hashed again
    import ingot.runtime.bundle.open  # open_bundle calls check_members through this module

    def no_hashing(*args, **kw):
        raise AssertionError("open_bundle hashed the members although the bundle has a valid stamp")

    monkeypatch.setattr(ingot.runtime.bundle.open, "check_members", no_hashing)
    b = benchmark(open_bundle, large_bundle["bundle"])
    assert b.verified and b.root_digest == large_bundle["root_digest"]
    if not _enabled(pytestconfig):
        return
    print(f"\nopen_bundle with a valid stamp: {benchmark.stats.stats.median * 1e3:.2f} ms median")
