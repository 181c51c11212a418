"""Under mutmut, make `ingot.toolchain` / `ingot.runtime` import the mutated copies in mutants/ingot/.

tests/mutation.sh runs mutmut 3 in a copy of the checkout laid out as the package (ingot/toolchain, ingot/runtime);
mutmut copies that to mutants/ and runs the tests there. But the editable install maps `ingot.*` to the checkout
through an import hook placed before sys.path, so the tests would import the unmutated files (and every mutant
would survive). tests/conftest.py installs this finder, ahead of that hook, when it runs from mutants/tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("toolchain", "runtime")


class MutantsFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        if parts[0] != "ingot" or len(parts) < 2 or parts[1] not in PACKAGES:
            return None
        base = self.root.joinpath(*parts)
        if (base / "__init__.py").is_file():
            # keep the installed package folder too: the fatbins `pip install` built live there
            installed = Path(sysconfig.get_paths()["purelib"]).joinpath("ingot", *parts[1:])
            locations = [str(base)] + ([str(installed)] if installed.is_dir() else [])
            return importlib.util.spec_from_file_location(
                fullname, base / "__init__.py", submodule_search_locations=locations
            )
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        return None


def install(root: Path) -> None:
    """Idempotent: mutmut runs pytest several times in one process (stats, clean run, then forked mutants)."""
    if any(isinstance(f, MutantsFinder) for f in sys.meta_path):
        return
    early = [
        m
        for m, mod in sys.modules.items()
        if m.startswith(("ingot.toolchain", "ingot.runtime"))
        and not str(getattr(mod, "__file__", "")).startswith(str(root))
    ]
    assert not early, f"imported from the checkout before the mutants finder was installed: {early[:3]}"
    sys.meta_path.insert(0, MutantsFinder(root))
