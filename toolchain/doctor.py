"""`ingot doctor`: what this machine can build and run, and why not where it cannot.

Never fails on a machine without nvcc, driver or GPU: each missing piece is reported with what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.archs import installed_kernel_dir
from ingot.runtime.gpu.compat import decide, driver_from_cuda_int
from ingot.runtime.gpu.fatbin import read_fatbin
from ingot.runtime.gpu.probe import probe
from ingot.toolchain.nvcc import cmake_version, find_toolkit, host_compiler


def report(kernel_dir: Path | None = None) -> dict:
    tk = find_toolkit()
    machine = probe()
    driver = driver_from_cuda_int(machine.driver_version, machine.driver_cuda) if machine.driver_cuda else None
    kdir = Path(kernel_dir) if kernel_dir else installed_kernel_dir()
    fatbins = sorted(kdir.glob("*.fatbin")) if kdir.is_dir() else []

    kernels: list[dict[str, Any]] = []
    advice: list[str] = []
    for path in fatbins:
        try:
            fat = read_fatbin(path)
        except UsageError as e:
            kernels.append({"module": path.name, "sass": [], "ptx": [], "on_gpus": [], "problem": str(e)})
            advice.append(f"{path.name} is unreadable ({e}); reinstall ingot-llm")
            continue
        on_gpus = (
            [{"gpu": g.index} | decide(fat, g.cc, driver, module=path.name).as_dict() for g in machine.gpus]
            if driver
            else []
        )
        kernels.append({"module": path.name, "sass": fat.sass, "ptx": fat.ptx, "on_gpus": on_gpus, "problem": None})

    if tk is None:
        advice.append(
            "no nvcc: kernels cannot be built here (install the CUDA toolkit or `pip install "
            "nvidia-cuda-nvcc`); prebuilt bundles still run"
        )
    if not fatbins:
        advice.append(
            f"no installed kernels in {kdir}: reinstall with nvcc present (`pip install -v .` shows "
            "why they were skipped), or build them with `ingot build`"
        )
    if machine.problem:
        advice.append(f"cannot run on a GPU here: {machine.problem}; CPU inference (--device cpu) still works")
    for k in kernels:
        for g in k["on_gpus"]:
            if g["verdict"] == "incompatible":
                advice.append(f"{k['module']} cannot run on GPU {g['gpu']}: {g['reason']}; fix: {g['fix']}")

    runnable = [g for k in kernels for g in k["on_gpus"]]
    return {
        "toolkit": tk.as_dict() if tk else None,
        "host_compiler": host_compiler(),
        "cmake": cmake_version(),
        "machine": machine.as_dict(),
        "kernel_dir": str(kdir),
        "kernels": kernels,
        "advice": advice,
        "ready": {
            "build": tk is not None,
            "gpu": bool(runnable)
            and all(k["problem"] is None for k in kernels)
            and all(g["verdict"] != "incompatible" for g in runnable),
        },
    }
