"""The compatibility rules: will this kernel module run on that GPU with that driver, and how?

The driver picks, for a GPU of compute capability X.Y:
  1. SASS sm_XZ with the same major X and Z <= Y (the highest such), sm_XYa only on exactly X.Y,
     sm_XZf on the same family (major X, Z <= Y). SASS also needs the driver to accept the toolkit that
     built it: minor-version compatibility lets a 12.x cubin run on any driver >= 525.60.13 and a 13.x
     cubin on any driver >= 580.65.06.
  2. Else PTX compute_XZ with XZ <= X.Y, JIT-compiled at load, only if the driver knows that PTX ISA
     (ISA 9.0 needs a CUDA 13.0 driver). Plain PTX runs on any newer GPU; compute_XYa only on X.Y.
  3. Else nothing runs: CUDA_ERROR_NO_BINARY_FOR_GPU (209) or CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222).
A driver must also know the GPU itself (Blackwell needs CUDA 12.8+ drivers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .fatbin import Entry, Fatbin, read_fatbin

# First Linux driver of each CUDA release (release notes, "CUDA Toolkit and Corresponding Driver Versions").
DRIVER_FOR_CUDA: list[tuple[tuple[int, int], str]] = [
    ((11, 0), "450.80.02"), ((11, 1), "455.23.05"), ((11, 2), "460.27.03"), ((11, 3), "465.19.01"),
    ((11, 4), "470.42.01"), ((11, 5), "495.29.05"), ((11, 6), "510.39.01"), ((11, 7), "515.43.04"),
    ((11, 8), "520.61.05"), ((12, 0), "525.60.13"), ((12, 1), "530.30.02"), ((12, 2), "535.54.03"),
    ((12, 3), "545.23.06"), ((12, 4), "550.54.14"), ((12, 5), "555.42.02"), ((12, 6), "560.28.03"),
    ((12, 8), "570.26"), ((12, 9), "575.51.03"), ((13, 0), "580.65.06"), ((13, 1), "590.44.01"),
]

# Minor-version compatibility: the lowest driver that runs SASS built by any toolkit of this major.
MINOR_COMPAT_FLOOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# PTX ISA -> the CUDA release that introduced it (cuda.bindings.utils has the same table).
PTX_ISA_TO_CUDA = {
    "7.0": (11, 0), "7.1": (11, 1), "7.2": (11, 2), "7.3": (11, 3), "7.4": (11, 4), "7.5": (11, 5),
    "7.6": (11, 6), "7.7": (11, 7), "7.8": (11, 8), "8.0": (12, 0), "8.1": (12, 1), "8.2": (12, 2),
    "8.3": (12, 3), "8.4": (12, 4), "8.5": (12, 5), "8.6": (12, 7), "8.7": (12, 8), "8.8": (12, 9),
    "9.0": (13, 0), "9.1": (13, 1), "9.2": (13, 2), "9.3": (13, 3), "9.4": (13, 4), "9.5": (13, 5),
}

# The first CUDA release that supports each GPU generation (a driver older than this does not know the GPU).
GPU_FIRST_CUDA = {
    75: (10, 0), 80: (11, 0), 86: (11, 1), 87: (11, 4), 88: (13, 0), 89: (11, 8), 90: (11, 8),
    100: (12, 8), 101: (12, 8), 103: (12, 9), 110: (13, 0), 120: (12, 8), 121: (12, 9),
}


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


@dataclass(frozen=True)
class Driver:
    """A driver, known by its version string (580.159.04) or only by the CUDA version it supports (13.0)."""
    version: str | None
    cuda: tuple[int, int]

    @property
    def label(self) -> str:
        cuda = f"CUDA {self.cuda[0]}.{self.cuda[1]}"
        return f"{self.version} ({cuda})" if self.version else cuda

    def meets(self, floor: str) -> bool:
        """At least this driver version? (A CUDA-version-only driver meets the floor of its own release.)"""
        if self.version:
            return _vtuple(self.version) >= _vtuple(floor)
        return self.cuda >= cuda_of_driver(floor)


def cuda_of_driver(version: str) -> tuple[int, int]:
    """The newest CUDA release a driver version supports."""
    best = (0, 0)
    for cuda, floor in DRIVER_FOR_CUDA:
        if _vtuple(version) >= _vtuple(floor):
            best = cuda
    return best


def driver_for_cuda(cuda: tuple[int, int]) -> str | None:
    for c, floor in DRIVER_FOR_CUDA:
        if c >= cuda:
            return floor
    return None


def parse_driver(text: str) -> Driver:
    """'535.104.05' (driver) or '12.2' / '13.0' (CUDA version the driver supports)."""
    t = text.strip()
    if re.fullmatch(r"\d{3}\.\d+(\.\d+)?", t):
        cuda = cuda_of_driver(t)
        if cuda == (0, 0):
            raise UsageError(f"driver {t} is older than CUDA 11.0", hint="Ingot needs a CUDA 12.0+ driver")
        return Driver(version=t, cuda=cuda)
    if re.fullmatch(r"\d{1,2}\.\d", t):
        major, minor = map(int, t.split("."))
        return Driver(version=None, cuda=(major, minor))
    raise UsageError(f"cannot read driver version {text!r}",
                     hint="pass a driver version like 535.104.05 or the CUDA version it supports, like 12.2")


def driver_from_cuda_int(version: str | None, cuda_int: int) -> Driver:
    """From NVML's driver string and cuDriverGetVersion's 1000*major + 10*minor."""
    return Driver(version=version, cuda=(cuda_int // 1000, (cuda_int % 1000) // 10))


@dataclass(frozen=True)
class Decision:
    module: str
    verdict: str            # "native", "jit" or "incompatible"
    image: str | None       # the SASS or PTX arch the driver will load
    reason: str
    fix: str | None = None

    def as_dict(self) -> dict:
        return {"module": self.module, "verdict": self.verdict, "image": self.image, "reason": self.reason,
                "fix": self.fix}


def _toolkit_major(entry: Entry, fallback: int | None) -> int | None:
    return entry.toolkit_major if getattr(entry, "toolkit_major", None) else fallback


def _sass_runs_on(e: Entry, cc: int) -> bool:
    if e.variant == "a":
        return e.cc == cc
    return e.cc // 10 == cc // 10 and e.cc % 10 <= cc % 10


def _ptx_runs_on(e: Entry, cc: int) -> bool:
    if e.variant == "a":
        return e.cc == cc
    if e.variant == "f":
        return e.cc // 10 == cc // 10 and e.cc % 10 <= cc % 10
    return e.cc <= cc


def _cc(cc: int) -> str:
    return f"{cc // 10}.{cc % 10}"


def decide(fat: Fatbin, cc: int, driver: Driver, module: str = "module",
           toolkit_major: int | None = None) -> Decision:
    """What the driver will do with this fatbin on a GPU of compute capability cc."""
    first_cuda = GPU_FIRST_CUDA.get(cc)
    if first_cuda and driver.cuda < first_cuda:
        need = driver_for_cuda(first_cuda)
        return Decision(module, "incompatible", None,
                        f"driver {driver.label} does not support compute capability {_cc(cc)} "
                        f"(first supported by CUDA {first_cuda[0]}.{first_cuda[1]})",
                        f"upgrade the driver to >= {need}" if need else "upgrade the driver")

    sass = sorted((e for e in fat.entries if e.kind == "sass" and _sass_runs_on(e, cc)),
                  key=lambda e: (e.cc, e.variant != ""), reverse=True)
    refused = None
    for e in sass:
        major = _toolkit_major(e, toolkit_major)
        floor = MINOR_COMPAT_FLOOR.get(major) if major else None
        if floor and not driver.meets(floor):
            refused = (e, major, floor)
            continue
        return Decision(module, "native", e.arch, f"SASS {e.arch} runs natively on compute capability {_cc(cc)}")

    ptx = sorted((e for e in fat.entries if e.kind == "ptx" and _ptx_runs_on(e, cc)), key=lambda e: e.cc,
                 reverse=True)
    too_new = None
    for e in ptx:
        need = PTX_ISA_TO_CUDA.get(e.isa or "")
        if need is None or driver.cuda < need:
            too_new = (e, need)
            continue
        why = f"JIT-compiled at load from PTX {e.arch} (ISA {e.isa}, needs a CUDA {need[0]}.{need[1]}+ driver)"
        if not sass and any(s.kind == "sass" for s in fat.entries):
            why += "; no SASS for this GPU, so the first load is slower"
        return Decision(module, "jit", e.arch, why)

    have = ", ".join(e.arch for e in fat.entries) or "nothing"
    if refused:
        e, major, floor = refused
        return Decision(module, "incompatible", None,
                        f"SASS {e.arch} was built with CUDA {major}.x, which needs driver >= {floor}; "
                        f"this driver is {driver.label}",
                        f"upgrade the driver to >= {floor}, or rebuild with a CUDA {driver.cuda[0]}.x toolkit")
    if too_new:
        e, need = too_new
        need_txt = f"CUDA {need[0]}.{need[1]}" if need else f"a driver newer than Ingot knows (ISA {e.isa})"
        floor = driver_for_cuda(need) if need else None
        return Decision(module, "incompatible", None,
                        f"no SASS for compute capability {_cc(cc)}, and PTX {e.arch} (ISA {e.isa}) needs "
                        f"{need_txt} but the driver is {driver.label} (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
                        f"rebuild with `ingot build --arch sm_{cc},...` to add SASS for this GPU"
                        + (f", or upgrade the driver to >= {floor}" if floor else ""))
    return Decision(module, "incompatible", None,
                    f"no image for compute capability {_cc(cc)}: the module holds {have} "
                    "(CUDA_ERROR_NO_BINARY_FOR_GPU)",
                    f"rebuild with `ingot build --arch sm_{cc},...`, or add PTX of an arch <= sm_{cc}")


def modules_in(path: Path) -> list[Path]:
    """A fatbin, or every *.fatbin in a folder (a `dist/kernels` build or an unpacked bundle)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.fatbin")) or sorted(path.glob("kernels/*.fatbin"))
        if not found:
            raise UsageError(f"no .fatbin files in {path}", hint="run `ingot build` first, or pass a fatbin")
        return found
    if not path.exists():
        raise UsageError(f"{path}: no such file or folder")
    return [path]


def check_paths(paths: list[Path], cc: int, driver: Driver) -> list[Decision]:
    """One decision per fatbin; a bundle (.ingot) is verified and contributes each of its fatbins."""
    from .bundle import is_bundle, open_bundle
    from .fatbin import parse_fatbin

    decisions = []
    for p in paths:
        if is_bundle(p):
            for name, data in open_bundle(p).fatbins.items():
                fat = parse_fatbin(data, name=f"{p}:kernels/{name}.fatbin")
                decisions.append(decide(fat, cc, driver, module=f"{name}.fatbin"))
        else:
            decisions.append(decide(read_fatbin(p), cc, driver, module=p.name))
    return decisions
