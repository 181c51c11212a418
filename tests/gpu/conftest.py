"""GPU test fixtures. Every test here is skipped cleanly when no NVIDIA GPU/driver is present (CI)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ingot.runtime.gpu.probe import probe

_machine = probe()
HAVE_GPU = bool(_machine.gpus)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason=f"no NVIDIA GPU ({_machine.problem or 'none found'})")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAVE_GPU:
                item.add_marker(skip)


class Gpu:
    """A device, stream, memory pool and all kernels, plus numpy <-> device helpers for kernel tests."""

    def __init__(self):
        from ingot.runtime.gpu.driver import Device, DevicePool, Stream
        from ingot.runtime.gpu.kernels import Kernels, kernel_images

        self.dev = Device(0)
        self.stream = Stream()
        self.pool = DevicePool()
        self.k = Kernels(self.dev, kernel_images())
        self.split_k = self.k.split_k(self.pool, self.stream)

    def put(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        buf = self.pool.alloc(a.nbytes)
        self.stream.upload(buf.ptr, a)
        self.stream.synchronize()
        return buf

    def empty(self, nbytes: int, poison: int = 0xFF):
        """Device memory filled with a poison byte (0xFF -> NaN for floats) to catch unwritten outputs."""
        buf = self.pool.alloc(nbytes)
        self.stream.memset(buf.ptr, poison, nbytes)
        return buf

    def get(self, buf, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self.stream.synchronize()
        self.stream.download(out, buf if isinstance(buf, int) else buf.ptr)
        self.stream.synchronize()
        return out

    def run(self, launch) -> None:
        """Run one launch, or a list of steps (what Kernels.matvec/matmul return), and wait for it."""
        for step in launch if isinstance(launch, list) else [launch]:
            step(self.stream)
        self.stream.synchronize()

    def close(self):
        self.k.close()
        self.pool.close()
        self.stream.close()
        self.dev.close()


@pytest.fixture(scope="session")
def gpu():
    g = Gpu()
    yield g
    g.close()


def stable_seed(name: str) -> int:
    """A seed from the test's name that is the same in every process (hash() of a str is salted per process)."""
    return zlib.crc32(name.encode())


@pytest.fixture
def rng(request):
    """Random inputs seeded from the test's name (with its parameters); a failure report names the seed."""
    seed = stable_seed(request.node.name)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "rng_seed"]
    if report.failed and seeds:
        report.sections.append(
            (
                "random inputs",
                f"numpy.random.default_rng({seeds[0]}): zlib.crc32 of {item.name!r}, the same in every run",
            )
        )
