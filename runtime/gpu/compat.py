"""The compatibility rules: will this kernel module run on that GPU with that driver, and how?

For a GPU of compute capability X.Y the driver uses, in this order:
  1. SASS it can run: sm_XZ with the same major X and Z <= Y (the closest), sm_XYa only on exactly X.Y,
     sm_XZf on the same family (major X, Z <= Y). SASS also needs a driver that accepts the toolkit that built
     it: minor-version compatibility runs a 12.x cubin on any driver >= 525.60.13 and a 13.x cubin on any
     driver >= 580.65.06 (a 13.x cubin never runs on an R525-R575 driver).
  2. Else PTX compute_XZ with XZ <= X.Y (compute_XYa only on X.Y, compute_XZf on the family), JIT-compiled at
     load, but only if the driver knows that PTX ISA (ISA 9.0 needs a CUDA 13.0 driver): this is how the PTX
     from a newer nvcc (13.5, ISA 9.5) fails on a 13.0 driver while that nvcc's SASS runs there.
  3. Else nothing: CUDA_ERROR_NO_BINARY_FOR_GPU (209) or CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222).
A driver must also know the GPU itself (Blackwell needs a CUDA 12.8+ driver).
Step 1 before 2 is the driver's choice when a module is loaded with CU_JIT_FALLBACK_STRATEGY=CU_PREFER_BINARY;
the default, CU_PREFER_PTX, JITs a runnable PTX instead of a SASS that is compatible but not an exact match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.fatbin import Entry, Fatbin

# The Linux driver of each CUDA release's GA ("Table 3: CUDA Toolkit and Corresponding Driver Versions").
# Source: CUDA 13.2 Update 2 release notes, docs.nvidia.com/cuda/archive/13.2.2/cuda-toolkit-release-notes/
# (11.0 is its "11.0.2 GA" row; 11.1 is listed as 455.23). 13.3: docs.nvidia.com/cuda/archive/13.3.0/
# cuda-toolkit-release-notes/ (610.43.02). From 13.4 on the toolkit no longer bundles a Linux driver and the
# notes list none, so a driver from a newer branch than the last row is only known to support CUDA >= 13.3.
DRIVER_FOR_CUDA: list[tuple[tuple[int, int], str]] = [
    ((11, 0), "450.51.05"),
    ((11, 1), "455.23"),
    ((11, 2), "460.27.03"),
    ((11, 3), "465.19.01"),
    ((11, 4), "470.42.01"),
    ((11, 5), "495.29.05"),
    ((11, 6), "510.39.01"),
    ((11, 7), "515.43.04"),
    ((11, 8), "520.61.05"),
    ((12, 0), "525.60.13"),
    ((12, 1), "530.30.02"),
    ((12, 2), "535.54.03"),
    ((12, 3), "545.23.06"),
    ((12, 4), "550.54.14"),
    ((12, 5), "555.42.02"),
    ((12, 6), "560.28.03"),
    ((12, 8), "570.26"),
    ((12, 9), "575.51.03"),
    ((13, 0), "580.65.06"),
    ((13, 1), "590.44.01"),
    ((13, 2), "595.45.04"),
    ((13, 3), "610.43.02"),
]

# Minor-version compatibility: the lowest driver that runs SASS built by any toolkit of this major (same
# release notes, Table 2 ">= 450 / >= 525 / >= 580", with the first GA driver of each branch; 11.x needs
# 450.80.02 per its footnote).
MINOR_COMPAT_FLOOR = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# PTX ISA -> the CUDA release that introduced it (PTX ISA release history; cuda.bindings.utils carries the same
# table as get_minimal_required_cuda_ver_from_ptx_ver, and tests/test_compat.py checks they agree).
PTX_ISA_TO_CUDA = {
    "7.0": (11, 0),
    "7.1": (11, 1),
    "7.2": (11, 2),
    "7.3": (11, 3),
    "7.4": (11, 4),
    "7.5": (11, 5),
    "7.6": (11, 6),
    "7.7": (11, 7),
    "7.8": (11, 8),
    "8.0": (12, 0),
    "8.1": (12, 1),
    "8.2": (12, 2),
    "8.3": (12, 3),
    "8.4": (12, 4),
    "8.5": (12, 5),
    "8.6": (12, 7),
    "8.7": (12, 8),
    "8.8": (12, 9),
    "9.0": (13, 0),
    "9.1": (13, 1),
    "9.2": (13, 2),
    "9.3": (13, 3),
    "9.4": (13, 4),
    "9.5": (13, 5),
}

# The first CUDA release that supports each GPU generation (a driver older than this does not know the GPU).
GPU_FIRST_CUDA = {
    75: (10, 0),
    80: (11, 0),
    86: (11, 1),
    87: (11, 4),
    88: (13, 0),
    89: (11, 8),
    90: (11, 8),
    100: (12, 8),
    101: (12, 8),
    103: (12, 9),
    110: (13, 0),
    120: (12, 8),
    121: (12, 9),
}


def _vtuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


@dataclass(frozen=True)
class Driver:
    """A driver, known by its version string (580.159.04) and/or the CUDA version it supports (13.0)."""

    version: str | None
    cuda: tuple[int, int]
    cuda_is_lower_bound: bool = False  # a driver newer than DRIVER_FOR_CUDA: it supports at least `cuda`

    @property
    def label(self) -> str:
        cuda = f"CUDA {'>= ' if self.cuda_is_lower_bound else ''}{self.cuda[0]}.{self.cuda[1]}"
        return f"{self.version} ({cuda})" if self.version else cuda

    def meets(self, floor: str) -> bool:
        """At least this driver version? (A CUDA-version-only driver meets the floor of its own release.)"""
        if self.version:
            return _vtuple(self.version) >= _vtuple(floor)
        return self.cuda >= cuda_of_driver(floor)


def cuda_of_driver(version: str) -> tuple[int, int]:
    """The newest CUDA release a driver version is known to support ((0, 0) if older than CUDA 11.0)."""
    best = (0, 0)
    for cuda, floor in DRIVER_FOR_CUDA:
        if _vtuple(version) >= _vtuple(floor):
            best = cuda
    return best


def driver_for_cuda(cuda: tuple[int, int]) -> str | None:
    """The first driver that supports this CUDA release (None if newer than the table)."""
    for c, floor in DRIVER_FOR_CUDA:
        if c >= cuda:
            return floor
    return None


def parse_driver(text: str) -> Driver:
    """'535.104.05' (driver) or '12.2' / '13.0' (the CUDA version the driver supports, as nvidia-smi shows)."""
    t = text.strip()
    if re.fullmatch(r"\d{3}(\.\d+){1,2}", t):
        cuda = cuda_of_driver(t)
        if cuda == (0, 0):
            raise UsageError(f"driver {t} is older than CUDA 11.0", hint="Ingot needs a CUDA 12.0+ driver")
        newest_branch = _vtuple(DRIVER_FOR_CUDA[-1][1])[0]
        return Driver(version=t, cuda=cuda, cuda_is_lower_bound=_vtuple(t)[0] > newest_branch)
    if re.fullmatch(r"\d{1,2}\.\d", t):
        major, minor = map(int, t.split("."))
        return Driver(version=None, cuda=(major, minor))
    raise UsageError(
        f"cannot read driver version {text!r}",
        hint="pass a driver version like 535.104.05 or the CUDA version it supports, like 12.2",
    )


def driver_from_cuda_int(version: str | None, cuda_int: int) -> Driver:
    """From NVML's driver string and cuDriverGetVersion's 1000*major + 10*minor (exact, not from the table)."""
    return Driver(version=version, cuda=(cuda_int // 1000, (cuda_int % 1000) // 10))


@dataclass(frozen=True)
class Decision:
    module: str
    verdict: str  # "native", "jit" or "incompatible"
    image: str | None  # the SASS or PTX arch the driver will load
    reason: str
    fix: str | None = None

    def as_dict(self) -> dict:
        return {
            "module": self.module,
            "verdict": self.verdict,
            "image": self.image,
            "reason": self.reason,
            "fix": self.fix,
        }


def sass_runs_on(e: Entry, cc: int) -> bool:
    if e.variant == "a":
        return e.cc == cc
    return e.cc // 10 == cc // 10 and e.cc % 10 <= cc % 10  # plain and family ('f') alike


def ptx_runs_on(e: Entry, cc: int) -> bool:
    if e.variant == "a":
        return e.cc == cc
    if e.variant == "f":
        return e.cc // 10 == cc // 10 and e.cc % 10 <= cc % 10
    return e.cc <= cc


def _cc(cc: int) -> str:
    return f"{cc // 10}.{cc % 10}"


def _cuda(v: tuple[int, int]) -> str:
    return f"CUDA {v[0]}.{v[1]}"


def decide(fat: Fatbin, cc: int, driver: Driver, module: str = "module") -> Decision:
    """What the driver will do with this fatbin on a GPU of compute capability cc."""
    first_cuda = GPU_FIRST_CUDA.get(cc)
    if first_cuda and driver.cuda < first_cuda:
        driver_needed = driver_for_cuda(first_cuda)
        return Decision(
            module,
            "incompatible",
            None,
            f"driver {driver.label} does not support compute capability {_cc(cc)} "
            f"(first supported by {_cuda(first_cuda)})",
            f"upgrade the driver to >= {driver_needed}" if driver_needed else "upgrade the driver",
        )

    sass = sorted(
        (e for e in fat.entries if e.kind == "sass" and sass_runs_on(e, cc)),
        key=lambda e: (e.cc, e.variant != ""),
        reverse=True,
    )
    refused = None
    for e in sass:
        floor = MINOR_COMPAT_FLOOR.get(e.toolkit_major) if e.toolkit_major else None
        if floor and not driver.meets(floor):
            refused = (e, floor)
            continue
        return Decision(module, "native", e.arch, f"SASS {e.arch} runs natively on compute capability {_cc(cc)}")

    ptx = sorted((e for e in fat.entries if e.kind == "ptx" and ptx_runs_on(e, cc)), key=lambda e: e.cc, reverse=True)
    too_new = None
    for e in ptx:
        need = PTX_ISA_TO_CUDA.get(e.isa or "")
        if need is None or driver.cuda < need:
            too_new = (e, need)
            continue
        return Decision(
            module,
            "jit",
            e.arch,
            f"no SASS for compute capability {_cc(cc)}: JIT-compiled at load from PTX {e.arch} "
            f"(ISA {e.isa}, needs a {_cuda(need)}+ driver); the first load is slower",
        )

    if refused:
        e, floor = refused
        return Decision(
            module,
            "incompatible",
            None,
            f"SASS {e.arch} was built with CUDA {e.toolkit}, which needs driver >= {floor} "
            f"(minor-version compatibility); this driver is {driver.label}",
            f"upgrade the driver to >= {floor}, or rebuild with a CUDA {driver.cuda[0]}.x toolkit",
        )
    if too_new:
        e, need = too_new
        need_txt = _cuda(need) if need else f"a CUDA release newer than Ingot knows (ISA {e.isa})"
        if driver.cuda_is_lower_bound:
            return Decision(
                module,
                "incompatible",
                None,
                f"no SASS for compute capability {_cc(cc)}; PTX {e.arch} (ISA {e.isa}) needs "
                f"{need_txt}, and driver {driver.version} is newer than Ingot's driver table "
                f"(last: {DRIVER_FOR_CUDA[-1][1]}), so Ingot cannot tell whether it supports that",
                "pass --driver as the CUDA version that `nvidia-smi` shows for it (e.g. --driver 13.5), "
                "or run `ingot check-compat` on that machine",
            )
        floor = driver_for_cuda(need) if need else None
        return Decision(
            module,
            "incompatible",
            None,
            f"no SASS for compute capability {_cc(cc)}, and PTX {e.arch} (ISA {e.isa}) needs "
            f"{need_txt} but the driver is {driver.label} (CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
            f"rebuild with `ingot build --arch sm_{cc},...` to add SASS for this GPU, or upgrade the "
            f"driver to " + (f">= {floor}" if floor else f"one that supports {need_txt}"),
        )
    have = ", ".join(e.arch for e in fat.entries)
    return Decision(
        module,
        "incompatible",
        None,
        f"no image for compute capability {_cc(cc)}: the module holds {have} (CUDA_ERROR_NO_BINARY_FOR_GPU)",
        f"rebuild with `ingot build --arch sm_{cc},...`, or add PTX of an arch <= sm_{cc}",
    )
