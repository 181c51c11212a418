"""GPU architecture names, and where the installed fatbins live.

An arch is written the way nvcc writes it: "sm_90" (SASS), "sm_90a" (arch-specific SASS, runs only on
exactly 9.0), "sm_100f" (family SASS, runs on 10.x with x >= 0), "compute_120" (PTX). Which archs a release
builds is the toolchain's policy (toolchain/archs.py, cuda/archs.json).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import ingot.runtime
from ingot.runtime.errors import UsageError

_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")


@dataclass(frozen=True, order=True)
class Arch:
    cc: int  # 90 for 9.0, 120 for 12.0
    variant: str  # "", "a" or "f"
    ptx: bool  # True for compute_XY (PTX), False for sm_XY (SASS)

    @property
    def major(self) -> int:
        return self.cc // 10

    @property
    def minor(self) -> int:
        return self.cc % 10

    @property
    def name(self) -> str:
        return f"{'compute' if self.ptx else 'sm'}_{self.cc}{self.variant}"

    def gencode(self) -> str:
        """The nvcc -gencode value that produces exactly this image."""
        virtual = f"compute_{self.cc}{self.variant}"
        return f"arch={virtual},code={virtual if self.ptx else f'sm_{self.cc}{self.variant}'}"

    def __str__(self) -> str:
        return self.name


def parse_arch(text: str) -> Arch:
    text = text.strip()
    m = _ARCH_RE.match(text)
    if not m:
        raise UsageError(
            f"unknown arch {text!r}", hint="write SASS as sm_XY (sm_90, sm_90a, sm_100f) and PTX as compute_XY"
        )
    kind, cc, variant = m.group(1), int(m.group(2)), m.group(3)
    return Arch(cc=cc, variant=variant, ptx=(kind == "compute"))


def gpu_arch(text: str) -> int:
    """A GPU named as sm_XY, XY or X.Y -> its compute capability as an int (90)."""
    t = text.strip().lower()
    m = re.match(r"^(?:sm_)?(\d{2,3})$", t) or re.match(r"^(\d{1,2})\.(\d)$", t)
    if not m:
        raise UsageError(f"unknown GPU {text!r}", hint="name a GPU by compute capability: sm_80, 8.0 or 80")
    return int(m.group(1)) if m.lastindex == 1 else int(m.group(1)) * 10 + int(m.group(2))


def installed_kernel_dir() -> Path:
    """Where `pip install` put the fatbins it built: ingot/runtime/fatbins (in site-packages; an editable
    install lists that folder in ingot.runtime.__path__ beside the source tree)."""
    for base in ingot.runtime.__path__:
        d = Path(base) / "fatbins"
        if any(d.glob("*.fatbin")):
            return d
    return Path(ingot.runtime.__path__[0]) / "fatbins"
