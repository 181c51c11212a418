"""The CUDA driver layer: a thin, checked wrapper over `cuda.bindings.driver`.

Everything the GPU engine does on the device goes through here: the primary context, modules loaded from
fatbin bytes (every kernel fetched at load, so an incompatible image fails at load with the compatibility
explanation, not at first launch), device memory from a pool, pinned host staging, streams, events, kernel
launches with pre-packed arguments, and CUDA graph capture/replay.

`_check` is the one choke point for CUresults: a failure becomes a CudaError carrying the CUDA error name and
what it means for an Ingot user. The wrapper objects own what they wrap and free it in close().
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ingot.runtime.errors import IncompatibleError, IngotError
from ingot.runtime.gpu.compat import decide, driver_from_cuda_int
from ingot.runtime.gpu.fatbin import parse_fatbin

try:
    from cuda.bindings import driver as cu
except ImportError:  # the CPU-only path never imports this module
    cu = None

# What an Ingot user should do about the errors they can meet. The rest get the driver's own description.
_MEANING = {
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "the kernels hold no SASS for this GPU and no PTX it can JIT; "
    "run `ingot check-compat` and rebuild with `ingot build --arch sm_XY`",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": "the kernels' PTX is newer than this driver can JIT; "
    "upgrade the driver or add SASS for this GPU",
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU is out of memory; use a smaller --ctx/--max-seqs or free the GPU",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "a kernel accessed memory out of bounds (an Ingot bug; please report it)",
    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": "a kernel asked for more registers/shared memory than the GPU has",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the driver is older than this cuda-bindings needs (13.x needs >= 580.65.06)",
    "CUDA_ERROR_NO_DEVICE": "no CUDA-capable GPU is visible (check CUDA_VISIBLE_DEVICES)",
    "CUDA_ERROR_INVALID_DEVICE": "no GPU with that index",
}

_INCOMPATIBLE = {
    "CUDA_ERROR_NO_BINARY_FOR_GPU",
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    "CUDA_ERROR_NO_DEVICE",
    "CUDA_ERROR_INSUFFICIENT_DRIVER",
    "CUDA_ERROR_INVALID_DEVICE",
}


class CudaError(IngotError):
    """A failed driver call: `name` is the CUresult name, e.g. CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, call: str, name: str, meaning: str):
        super().__init__(f"{call} failed: {name}: {meaning}")
        self.call, self.name, self.meaning = call, name, meaning


class CudaIncompatibleError(CudaError, IncompatibleError):
    pass


def _describe(err) -> tuple[str, str]:
    name = getattr(err, "name", str(err))
    if name in _MEANING:
        return name, _MEANING[name]
    _, text = cu.cuGetErrorString(err)
    return name, text.decode() if isinstance(text, bytes) else str(text)


def _check(result, call: str):
    """(CUresult, *outputs) -> outputs (None, one value, or a tuple); raise CudaError on failure."""
    err, *out = result
    if err != cu.CUresult.CUDA_SUCCESS:
        name, meaning = _describe(err)
        cls = CudaIncompatibleError if name in _INCOMPATIBLE else CudaError
        raise cls(call, name, meaning)
    return None if not out else out[0] if len(out) == 1 else tuple(out)


def _require_driver() -> None:
    if cu is None:
        raise IncompatibleError("cuda-bindings is not installed", hint="pip install cuda-bindings")


# --- device and context -------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    cc: int  # 90 for compute capability 9.0
    sm_count: int
    max_smem_optin: int  # bytes of shared memory a block may opt into
    total_memory: int
    driver_cuda: int  # cuDriverGetVersion: 13000 for CUDA 13.0


_prewarm_thread = None


def prewarm(index: int = 0) -> None:
    """Start cuInit and the primary context's creation (~0.3 s) on a background thread, so they overlap the
    work a command does before it needs the GPU (opening and verifying the model). Device() then finds them
    done. Failures are ignored here: Device() reports them."""
    global _prewarm_thread
    if cu is None or _prewarm_thread is not None:
        return

    def work():
        try:
            if cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS:
                err, dev = cu.cuDeviceGet(index)
                if err == cu.CUresult.CUDA_SUCCESS:
                    cu.cuDevicePrimaryCtxRetain(dev)  # held for the process: the engine retains it again
        except Exception:  # noqa: BLE001 - no driver: Device() will say so with the right error
            pass

    _prewarm_thread = threading.Thread(target=work, name="cuda-prewarm", daemon=True)
    _prewarm_thread.start()


class Device:
    """One GPU with its primary context made current on this thread."""

    def __init__(self, index: int = 0):
        _require_driver()
        if _prewarm_thread is not None:
            _prewarm_thread.join()
        try:
            _check(cu.cuInit(0), "cuInit")
        except RuntimeError as e:  # cuda.pathfinder: libcuda.so is not there at all
            raise IncompatibleError(
                f"no NVIDIA driver: {str(e).splitlines()[0]}",
                hint="install the NVIDIA driver, or run with --device cpu",
            ) from None
        count = _check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if index >= count:
            raise IncompatibleError(f"GPU {index} requested but {count} visible", hint="pick --gpu 0..{count - 1}")
        self.dev = _check(cu.cuDeviceGet(index), "cuDeviceGet")
        self.ctx = _check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        _check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        attr = cu.CUdevice_attribute
        get = lambda a: _check(cu.cuDeviceGetAttribute(a, self.dev), "cuDeviceGetAttribute")  # noqa: E731
        name = _check(cu.cuDeviceGetName(128, self.dev), "cuDeviceGetName")
        self.info = DeviceInfo(
            index=index,
            name=name.split(b"\0")[0].decode(),
            cc=get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) * 10
            + get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            max_smem_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            total_memory=int(_check(cu.cuDeviceTotalMem(self.dev), "cuDeviceTotalMem")),
            driver_cuda=int(_check(cu.cuDriverGetVersion(), "cuDriverGetVersion")),
        )

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        free, total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def synchronize(self) -> None:
        _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def close(self) -> None:
        if self.ctx is not None:
            _check(cu.cuDevicePrimaryCtxRelease(self.dev), "cuDevicePrimaryCtxRelease")
            self.ctx = None


# --- modules and kernels ----------------------------------------------------------------------


class Kernel:
    """A kernel of a loaded module. `pdl`: launch it with programmatic dependent launch (PDL) after another
    kernel; set by Kernels (runtime/gpu/kernels.py) only for kernels that begin with INGOT_PDL_ENTRY()
    (cuda/common.cuh), on a GPU that has it."""

    def __init__(self, fn, name: str, pdl: bool = False):
        self.fn, self.name, self.pdl = fn, name, pdl

    @property
    def static_smem(self) -> int:
        """Bytes of static __shared__ memory the compiler gave this kernel (as the loaded image says)."""
        return int(
            _check(
                cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, self.fn),
                f"cuFuncGetAttribute({self.name})",
            )
        )

    def blocks_per_sm(self, threads: int, smem: int) -> int:
        """Blocks of `threads` threads and `smem` bytes of dynamic shared memory one SM runs at once: the driver's
        occupancy calculator, from the registers and static shared memory of the loaded code and its launch bound."""
        return int(
            _check(
                cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, threads, smem),
                f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.name})",
            )
        )

    def allow_dynamic_smem(self, nbytes: int) -> None:
        """Needed before a launch asks for more than 48 KiB of dynamic shared memory."""
        _check(
            cu.cuFuncSetAttribute(
                self.fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes)
            ),
            f"cuFuncSetAttribute({self.name})",
        )


class Module:
    """A fatbin loaded with cuModuleLoadData; every listed kernel is fetched now, so failures surface here."""

    def __init__(self, image: bytes, name: str, kernel_names: list[str], device: Device):
        self.name = name
        try:
            self.mod = _check(cu.cuModuleLoadData(image), f"cuModuleLoadData({name})")
        except CudaIncompatibleError as e:
            raise IncompatibleError(f"{name}: {e.name}: {_explain_incompatible(image, name, device)}") from None
        self.kernels = {
            k: Kernel(_check(cu.cuModuleGetFunction(self.mod, k.encode()), f"cuModuleGetFunction({k})"), k)
            for k in kernel_names
        }

    def close(self) -> None:
        if self.mod is not None:
            _check(cu.cuModuleUnload(self.mod), "cuModuleUnload")
            self.mod = None


def _explain_incompatible(image: bytes, name: str, device: Device) -> str:
    """The doctor's explanation for a module the driver refused."""
    d = decide(parse_fatbin(image, name), device.info.cc, driver_from_cuda_int(None, device.info.driver_cuda), name)
    return f"{d.reason}; fix: {d.fix}" if d.fix else d.reason


# --- memory -------------------------------------------------------------------------------------


class DeviceBuffer:
    """A span of device memory: `ptr` (int) and `nbytes`. Owned by the DevicePool that made it."""

    __slots__ = ("ptr", "nbytes", "name")

    def __init__(self, ptr: int, nbytes: int, name: str):
        self.ptr, self.nbytes, self.name = ptr, nbytes, name

    def at(self, offset: int) -> int:
        return self.ptr + offset


class DevicePool:
    """Device memory from a few large cuMemAlloc slabs, sub-allocated with 256-byte alignment (16-byte vector
    loads and WMMA tiles need >= 32). Everything is freed together in close(): engine lifetime = pool lifetime."""

    SLAB = 256 << 20

    def __init__(self):
        self._slabs: list[tuple[int, int]] = []  # (base, size)
        self._cursor = 0  # offset in the last slab
        self.allocated = 0

    def alloc(self, nbytes: int, name: str = "") -> DeviceBuffer:
        nbytes = max(int(nbytes), 1)
        aligned = (nbytes + 255) & ~255
        if not self._slabs or self._cursor + aligned > self._slabs[-1][1]:
            size = max(self.SLAB, aligned)
            try:
                base = int(_check(cu.cuMemAlloc(size), f"cuMemAlloc({size})"))
            except CudaError as e:
                raise CudaError(
                    f"cuMemAlloc of {size / 2**20:.0f} MiB for {name or 'buffer'}", e.name, e.meaning
                ) from None
            self._slabs.append((base, size))
            self._cursor = 0
        base, _ = self._slabs[-1]
        buf = DeviceBuffer(base + self._cursor, nbytes, name)
        self._cursor += aligned
        self.allocated += aligned
        return buf

    def close(self) -> None:
        for base, _ in self._slabs:
            _check(cu.cuMemFree(base), "cuMemFree")
        self._slabs.clear()


class PinnedBuffer:
    """Page-locked host memory viewed as a numpy uint8 array (fast, truly async host<->device copies)."""

    def __init__(self, nbytes: int):
        self.ptr = int(_check(cu.cuMemHostAlloc(nbytes, 0), f"cuMemHostAlloc({nbytes})"))
        self.nbytes = nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.ptr))

    def view(self, dtype, offset: int, count: int) -> np.ndarray:
        return self.array[offset : offset + count * np.dtype(dtype).itemsize].view(dtype)

    def close(self) -> None:
        if self.ptr:
            _check(cu.cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


# --- streams, events, copies --------------------------------------------------------------------


class Stream:
    """A CUDA stream. `after_kernel` says whether the last work put on it through these wrappers was a kernel
    launch: only then may a PDL launch (Launch) overlap its predecessor. Copies, memsets, event records and graph
    launches clear it, so the kernel after them is fully serialized (programmatic edges join two kernels only)."""

    def __init__(self):
        self.handle = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self.after_kernel = False

    def synchronize(self) -> None:
        _check(cu.cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def upload(self, dst: int, src: np.ndarray) -> None:
        """Host -> device, ordered on this stream. `src` must stay alive until the stream passes this point
        (pinned memory is truly async; pageable memory is staged by the driver)."""
        src = np.ascontiguousarray(src)
        self.after_kernel = False
        if src.nbytes:
            _check(cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, self.handle), "cuMemcpyHtoDAsync")

    def download(self, dst: np.ndarray, src: int) -> None:
        assert dst.flags.c_contiguous
        self.after_kernel = False
        if dst.nbytes:
            _check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, self.handle), "cuMemcpyDtoHAsync")

    def wait(self, event: Event) -> None:
        """Work queued on this stream after this point waits until `event` (recorded on another stream) has
        happened."""
        self.after_kernel = False
        _check(cu.cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def memset(self, dst: int, value: int, nbytes: int) -> None:
        self.after_kernel = False
        _check(cu.cuMemsetD8Async(dst, value, nbytes, self.handle), "cuMemsetD8Async")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device -> device, ordered on this stream."""
        self.after_kernel = False
        _check(cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.handle), "cuMemcpyDtoDAsync")

    def close(self) -> None:
        if self.handle is not None:
            _check(cu.cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, timing: bool = True):
        """timing=False: an event only waited on, never timed (cheaper to record)."""
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = _check(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        stream.after_kernel = False
        _check(cu.cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        _check(cu.cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, start: Event) -> float:
        return float(_check(cu.cuEventElapsedTime(start.handle, self.handle), "cuEventElapsedTime"))

    def close(self) -> None:
        if self.handle is not None:
            _check(cu.cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None


# --- launches ----------------------------------------------------------------------------------


class Launch:
    """A kernel launch with its arguments packed once into a void*[] (re-launchable, graph-capturable).

    Arguments are numpy scalars of the kernel's parameter types (np.int32, np.float32, np.int64,
    np.uint64) or device addresses (int or DeviceBuffer, passed as 64-bit pointers; None = null).

    A kernel marked `pdl` that directly follows another kernel on the stream is launched with cuLaunchKernelEx
    and CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (programmatic dependent launch, sm_90+): its blocks
    may be scheduled while the previous kernel finishes, and its griddepcontrol.wait (INGOT_PDL_ENTRY) holds
    them until that kernel has completed. Stream capture records this as a programmatic graph edge (CUDA 12.3+),
    so a captured decode step keeps it on every replay. After anything but a kernel (Stream.after_kernel) the
    launch is a plain cuLaunchKernel.

    `cluster` > 1: the grid runs as thread-block clusters of (1, 1, cluster) blocks (sm_90+; grid z a multiple of
    it), always through cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (and PDL's attribute as above)."""

    __slots__ = ("kernel", "grid", "block", "smem", "cluster", "_held", "_params", "_configs")

    def __init__(self, kernel: Kernel, grid: tuple, block: int, args: list, smem: int = 0, cluster: int = 1):
        self.kernel, self.grid, self.block, self.smem = kernel, tuple(grid) + (1,) * (3 - len(grid)), block, smem
        self.cluster = cluster
        held = []
        for a in args:
            if isinstance(a, np.generic):
                held.append(np.array(a))  # 0-d array: stable address, exact width
            elif isinstance(a, DeviceBuffer):
                held.append(np.array(a.ptr, dtype=np.uint64))
            elif a is None or isinstance(a, int):
                held.append(np.array(a or 0, dtype=np.uint64))
            else:
                raise TypeError(f"{kernel.name}: unsupported kernel argument {a!r}")
        self._held = held
        self._params = np.array([h.ctypes.data for h in held], dtype=np.uint64)
        self._configs: dict[bool, Any] = {}  # cuLaunchKernelEx configurations (with PDL or not), built on first use
        if any(g <= 0 for g in self.grid):
            raise ValueError(f"{kernel.name}: empty grid {self.grid}")
        if cluster < 1 or self.grid[2] % cluster:
            raise ValueError(f"{kernel.name}: grid {self.grid} is not made of clusters of (1, 1, {cluster}) blocks")

    @property
    def pdl(self) -> bool:
        return self.kernel.pdl

    def __call__(self, stream: Stream) -> None:
        pdl = self.kernel.pdl and stream.after_kernel
        if pdl or self.cluster > 1:
            config = self._configs.get(pdl) or self._ex_config(pdl)
            config.hStream = stream.handle
            _check(
                cu.cuLaunchKernelEx(config, self.kernel.fn, self._params.ctypes.data, 0),
                f"cuLaunchKernelEx({self.kernel.name})",
            )
        else:
            gx, gy, gz = self.grid
            _check(
                cu.cuLaunchKernel(
                    self.kernel.fn, gx, gy, gz, self.block, 1, 1, self.smem, stream.handle, self._params.ctypes.data, 0
                ),
                f"cuLaunchKernel({self.kernel.name})",
            )
        stream.after_kernel = True

    def _ex_config(self, pdl: bool):
        attrs = []
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if self.cluster > 1:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 1, 1, self.cluster
            attrs.append(attr)
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = self.grid
        config.blockDimX, config.blockDimY, config.blockDimZ = self.block, 1, 1
        config.sharedMemBytes = self.smem
        config.attrs = attrs
        config.numAttrs = len(attrs)
        self._configs[pdl] = config
        return config


class Memset:
    """A capturable fill of `count` 32-bit words with `value` (e.g. zeroing a split-K GEMM's output)."""

    __slots__ = ("ptr", "value", "count")

    def __init__(self, ptr: int, value: int, count: int):
        self.ptr, self.value, self.count = int(ptr), value, count

    def __call__(self, stream: Stream) -> None:
        stream.after_kernel = False
        _check(cu.cuMemsetD32Async(self.ptr, self.value, self.count, stream.handle), "cuMemsetD32Async")


class Copy:
    """A capturable device-to-device copy of `nbytes` (e.g. gathering the rows a prefill samples from)."""

    __slots__ = ("dst", "src", "nbytes")

    def __init__(self, dst: int, src: int, nbytes: int):
        self.dst, self.src, self.nbytes = int(dst), int(src), nbytes

    def __call__(self, stream: Stream) -> None:
        stream.copy(self.dst, self.src, self.nbytes)


class Graph:
    """A captured sequence of stream work, instantiated once and replayed with one cuGraphLaunch."""

    def __init__(self, stream: Stream, work):
        stream.after_kernel = False  # the graph's first kernel has no kernel before it
        _check(
            cu.cuStreamBeginCapture(stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "cuStreamBeginCapture",
        )
        try:
            work()
        finally:
            graph = _check(cu.cuStreamEndCapture(stream.handle), "cuStreamEndCapture")
            stream.after_kernel = False  # the captured work did not run: the stream is where it was
        self.graph = graph
        self.exec = _check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream: Stream) -> None:
        stream.after_kernel = False
        _check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec is not None:
            _check(cu.cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            _check(cu.cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.exec = None
