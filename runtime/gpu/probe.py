"""What this machine has: the NVIDIA driver and its GPUs, read through NVML (nvidia-ml-py) or, failing
that, the CUDA driver API. A machine with no driver or no GPU is a normal answer, not an error."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    cc: int  # compute capability as an int, 90 for 9.0
    memory_total: int  # bytes
    memory_free: int | None  # bytes (None where only the driver API answered: it needs a context for that)

    def as_dict(self) -> dict:
        return asdict(self) | {"compute_capability": f"{self.cc // 10}.{self.cc % 10}"}


@dataclass(frozen=True)
class Machine:
    driver_version: str | None  # "580.159.04"
    driver_cuda: int | None  # 13000 for CUDA 13.0
    gpus: tuple[Gpu, ...] = ()
    problem: str | None = None  # why no driver/GPU could be read
    source: str | None = None  # "nvml" or "cuda driver API"

    def as_dict(self) -> dict:
        cuda = self.driver_cuda
        return {
            "driver_version": self.driver_version,
            "driver_cuda": f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else None,
            "gpus": [g.as_dict() for g in self.gpus],
            "problem": self.problem,
            "source": self.source,
        }


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _nvml() -> Machine | None:
    try:
        import pynvml  # deferred: NVML loads the driver library; only probing needs it

        pynvml.nvmlInit()
    except Exception:  # no libnvidia-ml.so, or no driver loaded: NVMLError_LibraryNotFound / DriverNotLoaded
        return None
    try:
        version = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(Gpu(i, _text(pynvml.nvmlDeviceGetName(h)), major * 10 + minor, int(mem.total), int(mem.free)))
        return Machine(version, cuda, tuple(gpus), None if gpus else "the driver reports no GPU", "nvml")
    except Exception:  # NVMLError subclasses (a GPU fell off the bus, no permission): ask the driver API instead
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _cuda_driver() -> Machine:
    try:
        from cuda.bindings import driver as cu  # deferred: heavy, and absent on CPU-only installs
    except ImportError:
        return Machine(None, None, (), "cuda-bindings is not installed (pip install cuda-bindings)")
    try:
        (err,) = cu.cuInit(0)
    except RuntimeError:  # cuda.pathfinder: libcuda.so not found
        return Machine(None, None, (), "no NVIDIA driver installed (libcuda.so not found)")
    if err != cu.CUresult.CUDA_SUCCESS:
        return Machine(None, None, (), f"the NVIDIA driver does not initialise (cuInit: {err.name})")
    _, version = cu.cuDriverGetVersion()
    _, count = cu.cuDeviceGetCount()
    gpus = []
    attr = cu.CUdevice_attribute
    for i in range(count):
        _, dev = cu.cuDeviceGet(i)
        _, name = cu.cuDeviceGetName(64, dev)
        _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, total = cu.cuDeviceTotalMem(dev)
        gpus.append(Gpu(i, name.split(b"\0")[0].decode(), major * 10 + minor, int(total), None))
    return Machine(None, int(version), tuple(gpus), None if gpus else "the driver reports no GPU", "cuda driver API")


def probe() -> Machine:
    return _nvml() or _cuda_driver()
