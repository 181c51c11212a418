"""`ingot rebuild --check BUNDLE`: rebuild the bundle's kernels here and compare them byte for byte.

The bundle is verified first. Then every module is compiled from this installation's kernel sources
(the checkout's cuda/, or the copy shipped in the wheel) with the archs and flags recorded in the bundle's
provenance, by the local nvcc, without the kernel cache. A module that differs is explained by comparing
what was recorded with what is here: nvcc build, host compiler, source and header digests, command line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ingot.runtime.bundle.container import load_manifest, open_file, read_index, read_member
from ingot.runtime.bundle.manifest import PROVENANCE
from ingot.runtime.bundle.verify import check_members
from ingot.runtime.errors import BuildError
from ingot.runtime.gpu.archs import parse_arch
from ingot.toolchain.archs import kernel_source_dir
from ingot.toolchain.build import build_module
from ingot.toolchain.nvcc import host_compiler, require_toolkit
from ingot.toolchain.provenance import portable_command, recorded_build


def _differences(name: str, recorded: dict, rec_module: dict, local: dict) -> list[str]:
    """Why a rebuilt module may differ: every recorded input that is not the same here."""
    reasons = []
    if recorded["nvcc"]["build"] != local["nvcc"]["build"]:
        reasons.append(
            f"nvcc differs: recorded {recorded['nvcc']['version_text']!r}, here {local['nvcc']['version_text']!r}"
        )
    if recorded["host_compiler"] != local["host_compiler"]:
        reasons.append(
            f"host compiler differs: recorded {recorded['host_compiler']!r}, here {local['host_compiler']!r}"
        )
    want, have = rec_module["inputs"], local["inputs"]
    for f in sorted(set(want) | set(have)):
        if f not in have:
            reasons.append(f"input {f} is recorded but missing here")
        elif f not in want:
            reasons.append(f"input {f} is included here but was not in the recorded build")
        elif want[f] != have[f]:
            reasons.append(f"source digest of {f} differs: recorded {want[f][:12]}..., here {have[f][:12]}...")
    if rec_module["command"] != local["command"]:
        reasons.append(
            f"nvcc command differs: recorded {' '.join(rec_module['command'])!r}, here {' '.join(local['command'])!r}"
        )
    return reasons or ["all recorded inputs match, yet nvcc produced different bytes (a non-deterministic build?)"]


def rebuild_check(bundle: str | Path, *, on_module=None) -> dict:
    """Returns {"identical": bool, "modules": [...]}; on_module(name, n_done) before each module."""
    bundle = Path(bundle)
    with open_file(bundle) as f:
        index = read_index(f, os.fstat(f.fileno()).st_size)
        manifest = load_manifest(f, index)
        check_members(f, index, manifest)
        by_name = {m.name: m for m in index}
        recorded = recorded_build(json.loads(read_member(f, by_name[PROVENANCE], 16 << 20)))

    tk = require_toolkit()
    archs = [parse_arch(a) for a in recorded["archs"]]
    src_dir = kernel_source_dir()
    local_tools = {"nvcc": tk.as_dict(), "host_compiler": host_compiler().get("version")}
    modules = []
    with tempfile.TemporaryDirectory(prefix="ingot-rebuild-") as tmp:
        for i, k in enumerate(manifest["kernels"]):
            name = k["name"]
            if on_module:
                on_module(name, i)
            rec_module = recorded["modules"].get(name)
            src = src_dir / f"{name}.cu"
            row = {"module": name, "member": k["path"], "recorded_sha256": k["sha256"], "rebuilt_sha256": None}
            if rec_module is None:
                modules.append(row | {"identical": False, "reasons": ["the provenance does not record this module"]})
                continue
            if not src.is_file():
                modules.append(row | {"identical": False, "reasons": [f"source {name}.cu is not in {src_dir}"]})
                continue
            try:
                built = build_module(src, archs, recorded["flags"], tk, Path(tmp), use_cache=False)
            except BuildError as e:
                modules.append(row | {"identical": False, "reasons": [f"the local build failed: {e}"]})
                continue
            identical = built.sha256 == k["sha256"]
            local = local_tools | {"command": portable_command(built.command, name), "inputs": built.inputs}
            modules.append(
                row
                | {
                    "rebuilt_sha256": built.sha256,
                    "identical": identical,
                    "reasons": [] if identical else _differences(name, recorded, rec_module, local),
                }
            )
    return {
        "bundle": str(bundle),
        "identical": all(m["identical"] for m in modules),
        "recorded": {
            "nvcc": recorded["nvcc"]["version_text"],
            "host_compiler": recorded["host_compiler"],
            "archs": recorded["archs"],
            "flags": recorded["flags"],
        },
        "local": {"nvcc": tk.version_text, "host_compiler": local_tools["host_compiler"]},
        "modules": modules,
    }
