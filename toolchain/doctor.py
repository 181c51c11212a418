"""`ingot doctor`: what this machine can build and run, and why not where it cannot."""
from __future__ import annotations

from pathlib import Path

from .archs import installed_kernel_dir
from .compat import decide, driver_from_cuda_int
from .fatbin import read_fatbin
from .nvcc import cmake_version, find_toolkit, host_compiler
from .probe import probe


def report(kernel_dir: Path | None = None) -> dict:
    tk = find_toolkit()
    machine = probe()
    kdir = Path(kernel_dir) if kernel_dir else installed_kernel_dir()
    fatbins = sorted(kdir.glob("*.fatbin")) if kdir.is_dir() else []

    kernels = []
    for path in fatbins:
        fat = read_fatbin(path)
        entry = {"module": path.name, "sass": fat.sass, "ptx": fat.ptx, "on_gpus": []}
        if machine.driver_cuda:
            driver = driver_from_cuda_int(machine.driver_version, machine.driver_cuda)
            for gpu in machine.gpus:
                d = decide(fat, gpu.cc, driver, module=path.name)
                entry["on_gpus"].append({"gpu": gpu.index} | d.as_dict())
        kernels.append(entry)

    advice = []
    if tk is None:
        advice.append("no nvcc: kernels cannot be built here (install the CUDA toolkit or `pip install "
                      "nvidia-cuda-nvcc`); prebuilt bundles still run")
    if not fatbins:
        advice.append(f"no installed kernels in {kdir}: reinstall with nvcc present, or use `ingot build`")
    if machine.problem:
        advice.append(f"cannot run on a GPU here: {machine.problem}; CPU inference (--device cpu) still works")
    for k in kernels:
        for g in k["on_gpus"]:
            if g["verdict"] == "incompatible":
                advice.append(f"{k['module']} cannot run on GPU {g['gpu']}: {g['reason']}; fix: {g['fix']}")

    return {
        "toolkit": tk.as_dict() if tk else None,
        "host_compiler": host_compiler(),
        "cmake": cmake_version(),
        "machine": machine.as_dict(),
        "kernel_dir": str(kdir),
        "kernels": kernels,
        "advice": advice,
        "ready": {"build": tk is not None,
                  "gpu": bool(machine.gpus) and bool(kernels)
                  and all(g["verdict"] != "incompatible" for k in kernels for g in k["on_gpus"])},
    }
