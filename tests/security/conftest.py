"""Fixtures for the hardening tests (issue #13): the smallest signed bundle, and a CLI runner that measures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def one_kernel_dir(tmp_path_factory, kernel_dir) -> Path:
    """The build folder cut down to its smallest module (rope), so a bundle is ~45 KB instead of ~800 KB."""
    record = json.loads((kernel_dir / "build.json").read_text())
    record["fatbins"] = [b for b in record["fatbins"] if b["name"] == "rope"]
    out = tmp_path_factory.mktemp("one-kernel")
    shutil.copyfile(kernel_dir / "rope.fatbin", out / "rope.fatbin")
    (out / "build.json").write_text(json.dumps(record))
    return out


@pytest.fixture(scope="session")
def small_signed_bundle(tmp_path_factory, one_kernel_dir, toy_model, keys) -> Path:
    from ingot.toolchain.pack import pack
    from ingot.toolchain.sign import sign_bundle

    d = tmp_path_factory.mktemp("small")
    pack(toy_model, kernels=one_kernel_dir, out=d / "small.ingot", selftest=False)
    sign_bundle(d / "small.ingot", keys["a"]["key"], d / "small-signed.ingot")
    return d / "small-signed.ingot"
