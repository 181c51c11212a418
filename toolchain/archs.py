"""GPU architecture names, the default release policy, and where kernel sources and fatbins live.

An arch is written the way nvcc writes it: "sm_90" (SASS), "sm_90a" (arch-specific SASS, runs only on
exactly 9.0), "sm_100f" (family SASS, runs on 10.x with x >= 0), "compute_120" (PTX). The default policy
and the reason for each entry live in cuda/archs.json, shared with CMakeLists.txt.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from .errors import UsageError

_ARCH_RE = re.compile(r"^(sm|compute)_(\d{2,3})([af]?)$")


@dataclass(frozen=True, order=True)
class Arch:
    cc: int          # 90 for 9.0, 120 for 12.0
    variant: str     # "", "a" or "f"
    ptx: bool        # True for compute_XY (PTX), False for sm_XY (SASS)

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
        raise UsageError(f"unknown arch {text!r}",
                         hint="write SASS as sm_XY (sm_90, sm_90a, sm_100f) and PTX as compute_XY")
    kind, cc, variant = m.group(1), int(m.group(2)), m.group(3)
    return Arch(cc=cc, variant=variant, ptx=(kind == "compute"))


def parse_arch_list(text: str) -> list[Arch]:
    """"sm_80,sm_90,compute_90" -> archs, refusing `native` (a release must not depend on the build host)."""
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise UsageError("empty --arch list", hint="e.g. --arch sm_80,sm_90,compute_90")
    if any(t in ("native", "all", "all-major") for t in items):
        raise UsageError(f"--arch {text!r} depends on the build machine's GPU or nvcc's defaults",
                         hint="name the archs explicitly for a release build, e.g. --arch sm_80,sm_90")
    archs = [parse_arch(t) for t in items]
    if len(set(archs)) != len(archs):
        raise UsageError(f"--arch {text!r} names an arch twice")
    return sorted(archs, key=lambda a: (a.ptx, a.cc, a.variant))


def gpu_arch(text: str) -> int:
    """A GPU named as sm_XY, XY or X.Y -> its compute capability as an int (90)."""
    t = text.strip().lower()
    m = re.match(r"^(?:sm_)?(\d{2,3})$", t) or re.match(r"^(\d{1,2})\.(\d)$", t)
    if not m:
        raise UsageError(f"unknown GPU {text!r}", hint="name a GPU by compute capability: sm_80, 8.0 or 80")
    return int(m.group(1)) if m.lastindex == 1 else int(m.group(1)) * 10 + int(m.group(2))


# --- the default policy ------------------------------------------------------------------------

def project_root() -> Path | None:
    """The source checkout this package runs from (editable install), or None for an installed wheel."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "cuda" / "archs.json").is_file() and (root / "CMakeLists.txt").is_file() else None


def kernel_source_dir() -> Path:
    """cuda/ of the checkout, or the copy of it shipped inside the wheel."""
    root = project_root()
    if root is not None:
        return root / "cuda"
    shipped = Path(__file__).resolve().parent / "cuda"
    if (shipped / "archs.json").is_file():
        return shipped
    raise UsageError("kernel sources not found", hint="reinstall ingot-llm, or run from a source checkout")


def installed_kernel_dir() -> Path:
    """Where `pip install` put the fatbins it built: ingot/runtime/fatbins (in site-packages; an editable
    install lists that folder in ingot.runtime.__path__ beside the source tree)."""
    import ingot.runtime
    for base in ingot.runtime.__path__:
        d = Path(base) / "fatbins"
        if any(d.glob("*.fatbin")):
            return d
    return Path(ingot.runtime.__path__[0]) / "fatbins"


@dataclass(frozen=True)
class Policy:
    archs: tuple[Arch, ...]
    reasons: dict
    flags: tuple[str, ...]


@cache
def default_policy() -> Policy:
    data = json.loads((kernel_source_dir() / "archs.json").read_text())
    archs = [parse_arch(e["arch"]) for e in data["sass"]] + [parse_arch(e["arch"]) for e in data["ptx"]]
    reasons = {e["arch"]: e["why"] for e in data["sass"] + data["ptx"]}
    return Policy(archs=tuple(archs), reasons=reasons, flags=tuple(data["flags"]))
