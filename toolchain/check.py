"""`ingot check-compat` targets: a fatbin, a folder of fatbins (a `dist/kernels` build), or a bundle, each
decided by the runtime's compat rules (ingot.runtime.gpu.compat)."""

from __future__ import annotations

from pathlib import Path

from ingot.runtime.bundle.container import is_bundle
from ingot.runtime.bundle.open import open_bundle
from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.compat import Decision, Driver, decide
from ingot.runtime.gpu.fatbin import parse_fatbin, read_fatbin


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
    decisions = []
    for p in paths:
        if is_bundle(p):
            with open_bundle(p) as bundle:
                fatbins = bundle.fatbins
            for name, data in fatbins.items():
                fat = parse_fatbin(data, name=f"{p}:kernels/{name}.fatbin")
                decisions.append(decide(fat, cc, driver, module=f"{name}.fatbin"))
        else:
            decisions.append(decide(read_fatbin(p), cc, driver, module=p.name))
    return decisions
