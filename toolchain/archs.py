"""The release arch policy (which archs `ingot build` compiles), and where the kernel sources live.

The default policy and the reason for each entry live in cuda/archs.json, shared with CMakeLists.txt. Arch
names themselves (sm_90, sm_90a, compute_120) are parsed by the runtime (ingot.runtime.gpu.archs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.archs import Arch, parse_arch


def parse_arch_list(text: str) -> list[Arch]:
    """ "sm_80,sm_90,compute_90" -> archs, refusing `native` (a release must not depend on the build host)."""
    items = [t for t in (s.strip() for s in text.split(",")) if t]
    if not items:
        raise UsageError("empty --arch list", hint="e.g. --arch sm_80,sm_90,compute_90")
    if any(t in ("native", "all", "all-major") for t in items):
        raise UsageError(
            f"--arch {text!r} depends on the build machine's GPU or nvcc's defaults",
            hint="name the archs explicitly for a release build, e.g. --arch sm_80,sm_90",
        )
    archs = [parse_arch(t) for t in items]
    if len(set(archs)) != len(archs):
        raise UsageError(f"--arch {text!r} names an arch twice")
    return sorted(archs, key=lambda a: (a.ptx, a.cc, a.variant))


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
