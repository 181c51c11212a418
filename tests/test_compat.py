"""The compatibility rules, case by case, written from NVIDIA's rules (not from the code's output):

SASS sm_XY runs on X.Z with Z >= Y; sm_XYa only on X.Y; sm_XYf on the family X.Z, Z >= Y. A 12.x cubin needs
a driver >= 525.60.13, a 13.x cubin >= 580.65.06. PTX compute_XY JITs on any CC >= X.Y if the driver knows its
ISA (9.0 -> CUDA 13.0, 9.5 -> 13.5). Driver versions map to CUDA versions by the release notes' table."""

from __future__ import annotations

import re
import subprocess

import pytest

from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.compat import (
    DRIVER_FOR_CUDA,
    PTX_ISA_TO_CUDA,
    decide,
    driver_for_cuda,
    driver_from_cuda_int,
    parse_driver,
)
from ingot.runtime.gpu.fatbin import Entry, Fatbin
from ingot.toolchain.check import modules_in


def _entry(arch: str, isa: str | None = None, toolkit: str | None = None) -> Entry:
    kind, cc, variant = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch).groups()
    ptx = kind == "compute"
    return Entry(
        "ptx" if ptx else "sass",
        arch,
        int(cc),
        variant,
        isa if ptx else None,
        "none",
        100,
        100,
        ("k",),
        0,
        toolkit=None if ptx else toolkit,
    )


def sass(arch: str, toolkit: str = "13.0") -> Entry:
    return _entry(arch, toolkit=toolkit)


def ptx(arch: str, isa: str = "9.0") -> Entry:
    return _entry(arch, isa=isa)


# (id, images, GPU compute capability, driver, expected verdict, expected image)
CASES = [
    ("sm80 runs on 8.6", [sass("sm_80")], 86, "580.65.06", "native", "sm_80"),
    ("sm86 not on 8.0", [sass("sm_86")], 80, "580.65.06", "incompatible", None),
    ("sm80 not on 9.0 (other major)", [sass("sm_80")], 90, "580.65.06", "incompatible", None),
    ("closest SASS wins", [sass("sm_80"), sass("sm_86")], 89, "580.65.06", "native", "sm_86"),
    ("sm90a on 9.0", [sass("sm_90a")], 90, "580.65.06", "native", "sm_90a"),
    ("sm90a not on 10.0", [sass("sm_90a")], 100, "580.65.06", "incompatible", None),
    # arch-specific SASS runs on exactly its own CC, not on a later minor of the same major (unlike plain/family)
    ("sm100a on 10.0", [sass("sm_100a")], 100, "580.65.06", "native", "sm_100a"),
    ("sm100a not on 10.3", [sass("sm_100a")], 103, "580.65.06", "incompatible", None),
    ("sm120a not on 12.1", [sass("sm_120a")], 121, "580.65.06", "incompatible", None),
    ("sm100a skipped for sm100 on 10.3", [sass("sm_100a"), sass("sm_100")], 103, "580.65.06", "native", "sm_100"),
    ("sm100a on 10.3 falls back to PTX", [sass("sm_100a"), ptx("compute_100")], 103, "13.0", "jit", "compute_100"),
    ("sm100f on 10.3", [sass("sm_100f")], 103, "580.65.06", "native", "sm_100f"),
    ("sm100f not on 12.0 (other family)", [sass("sm_100f")], 120, "580.65.06", "incompatible", None),
    ("sm103f not on 10.0", [sass("sm_103f")], 100, "580.65.06", "incompatible", None),
    ("sm100 on 10.3", [sass("sm_100")], 103, "580.65.06", "native", "sm_100"),
    ("SASS before PTX", [sass("sm_80"), ptx("compute_80")], 86, "13.0", "native", "sm_80"),
    ("compute_120 9.0 JITs on 12.1 with 13.0", [ptx("compute_120", "9.0")], 121, "13.0", "jit", "compute_120"),
    ("compute_120 9.0 on 12.1 with 12.8: GPU unknown", [ptx("compute_120", "9.0")], 121, "12.8", "incompatible", None),
    ("compute_120 9.0 on 12.0 with 570.26", [ptx("compute_120", "9.0")], 120, "570.26", "incompatible", None),
    ("compute_120 9.0 on 12.1 with 575.51.03", [ptx("compute_120", "9.0")], 121, "575.51.03", "incompatible", None),
    ("PTX JITs across majors", [ptx("compute_80")], 90, "13.0", "jit", "compute_80"),
    ("PTX not below its arch", [ptx("compute_80")], 75, "13.0", "incompatible", None),
    (
        "highest usable PTX",
        [ptx("compute_75"), ptx("compute_90"), ptx("compute_120")],
        100,
        "13.0",
        "jit",
        "compute_90",
    ),
    ("compute_90a only on 9.0", [ptx("compute_90a")], 90, "13.0", "jit", "compute_90a"),
    ("compute_90a not on 10.0", [ptx("compute_90a")], 100, "13.0", "incompatible", None),
    ("compute_100a not on 10.3", [ptx("compute_100a")], 103, "13.0", "incompatible", None),
    ("compute_100f on 10.3", [ptx("compute_100f")], 103, "13.0", "jit", "compute_100f"),
    ("compute_100f not on 11.0", [ptx("compute_100f")], 110, "13.0", "incompatible", None),
    ("compute_100f on 10.0", [ptx("compute_100f")], 100, "13.0", "jit", "compute_100f"),
    ("compute_103f on 10.3", [ptx("compute_103f")], 103, "13.0", "jit", "compute_103f"),
    ("compute_103f not on 10.0", [ptx("compute_103f")], 100, "13.0", "incompatible", None),
    ("compute_101f not on 10.0", [ptx("compute_101f")], 100, "13.0", "incompatible", None),
    ("sm90a preferred to sm90 on 9.0", [sass("sm_90"), sass("sm_90a")], 90, "580.65.06", "native", "sm_90a"),
    (
        "refused SASS, next SASS runs",
        [sass("sm_86", "13.0"), sass("sm_80", "12.8")],
        86,
        "575.51.03",
        "native",
        "sm_80",
    ),
    (
        "too-new PTX, next PTX JITs",
        [ptx("compute_90", "9.5"), ptx("compute_80", "8.7")],
        90,
        "13.0",
        "jit",
        "compute_80",
    ),
    ("no image at all", [sass("sm_75"), ptx("compute_120")], 80, "13.0", "incompatible", None),
    ("13.x SASS on 575: minor-version floor", [sass("sm_80", "13.0")], 80, "575.51.03", "incompatible", None),
    ("13.x SASS on 580.65.06", [sass("sm_80", "13.0")], 80, "580.65.06", "native", "sm_80"),
    ("12.8 SASS on 575", [sass("sm_80", "12.8")], 80, "575.51.03", "native", "sm_80"),
    ("12.x SASS on 525.60.13", [sass("sm_80", "12.9")], 80, "525.60.13", "native", "sm_80"),
    ("12.x SASS on an 11.8 driver", [sass("sm_80", "12.0")], 80, "520.61.05", "incompatible", None),
    ("12.x SASS on a 13.x driver", [sass("sm_90", "12.4")], 90, "580.159.04", "native", "sm_90"),
    ("13.x SASS on 535.104.05", [sass("sm_80", "13.0")], 80, "535.104.05", "incompatible", None),
    (
        "refused SASS falls back to PTX",
        [sass("sm_80", "13.0"), ptx("compute_80", "8.7")],
        80,
        "575.51.03",
        "jit",
        "compute_80",
    ),
    ("driver too old for Blackwell", [sass("sm_100", "12.8")], 100, "560.28.03", "incompatible", None),
    # nvcc 13.5 from the nvidia-cuda-nvcc wheel: SASS runs on a 13.0 driver, its PTX (ISA 9.5) does not JIT there.
    (
        "13.5 wheel: SASS on 13.0 driver",
        [sass("sm_90", "13.5"), ptx("compute_90", "9.5")],
        90,
        "580.65.06",
        "native",
        "sm_90",
    ),
    (
        "13.5 wheel: PTX on 13.0 driver",
        [sass("sm_90", "13.5"), ptx("compute_90", "9.5")],
        100,
        "580.159.04",
        "incompatible",
        None,
    ),
    (
        "13.5 wheel: PTX on 13.5 driver",
        [sass("sm_90", "13.5"), ptx("compute_90", "9.5")],
        100,
        "13.5",
        "jit",
        "compute_90",
    ),
    ("13.5 wheel: PTX-only on 13.0", [ptx("compute_90", "9.5")], 90, "13.0", "incompatible", None),
    ("unknown future ISA", [ptx("compute_90", "9.9")], 90, "13.5", "incompatible", None),
    ("driver newer than the table, known ISA", [ptx("compute_90", "9.3")], 90, "616.56", "jit", "compute_90"),
    ("driver newer than the table, newer ISA", [ptx("compute_90", "9.5")], 90, "616.56", "incompatible", None),
]


@pytest.mark.parametrize("images, cc, driver, verdict, image", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision(images, cc, driver, verdict, image):
    d = decide(Fatbin(entries=tuple(images), size=0, kernels=("k",)), cc, parse_driver(driver), module="m.fatbin")
    assert (d.verdict, d.image) == (verdict, image), d.reason
    assert d.module == "m.fatbin"
    assert (
        re.search(rf"compute capability {cc // 10}\.{cc % 10}(?![\d.])", d.reason)
        or "minor-version compatibility" in d.reason
    )
    assert d.as_dict() == {"module": "m.fatbin", "verdict": verdict, "image": image, "reason": d.reason, "fix": d.fix}
    assert "\n" not in d.reason
    if verdict == "incompatible":
        assert d.fix and "\n" not in d.fix
    else:
        assert d.fix is None


def test_reasons_name_the_cause():
    fat = Fatbin(entries=(ptx("compute_120", "9.0"),), size=0)
    assert "UNSUPPORTED_PTX_VERSION" in decide(fat, 121, parse_driver("575.51.03")).reason
    assert "does not support compute capability 12.1" in decide(fat, 121, parse_driver("12.8")).reason
    fat = Fatbin(entries=(sass("sm_80", "13.0"),), size=0)
    d = decide(fat, 80, parse_driver("575.51.03"))
    assert "580.65.06" in d.reason and "580.65.06" in d.fix
    assert "NO_BINARY_FOR_GPU" in decide(fat, 90, parse_driver("13.0")).reason
    d = decide(Fatbin(entries=(ptx("compute_90", "9.5"),), size=0), 90, parse_driver("616.56"))
    assert "cannot tell" in d.reason and "--driver" in d.fix
    d = decide(Fatbin(entries=(ptx("compute_90", "9.5"),), size=0), 90, parse_driver("13.0"))
    assert "CUDA 13.5" in d.reason and d.fix.endswith("upgrade the driver to one that supports CUDA 13.5")
    d = decide(Fatbin(entries=(ptx("compute_90", "9.1"),), size=0), 90, parse_driver("13.0"))
    assert d.fix.endswith("upgrade the driver to >= 590.44.01")
    d = decide(Fatbin(entries=(ptx("compute_90", "9.5"),), size=0), 90, parse_driver("616.56"))
    assert f"(last: {DRIVER_FOR_CUDA[-1][1]})" in d.reason and "e.g. --driver 13.5" in d.fix
    assert d.fix == (
        "pass --driver as the CUDA version that `nvidia-smi` shows for it (e.g. --driver 13.5), "
        "or run `ingot check-compat` on that machine"
    )
    assert decide(Fatbin(entries=(), size=0), 90, parse_driver("13.0")).module == "module"  # the default label
    d = decide(Fatbin(entries=(sass("sm_100", "12.8"),), size=0), 100, parse_driver("560.28.03"))
    assert d.fix == "upgrade the driver to >= 570.26"
    d = decide(Fatbin(entries=(sass("sm_80", "13.0"),), size=0), 80, parse_driver("575.51.03"))
    assert d.fix.endswith("rebuild with a CUDA 12.x toolkit")
    d = decide(Fatbin(entries=(sass("sm_75"), ptx("compute_120")), size=0), 80, parse_driver("13.0"))
    assert "the module holds sm_75, compute_120 (CUDA_ERROR_NO_BINARY_FOR_GPU)" in d.reason


def test_driver_lookups():
    assert driver_for_cuda((12, 8)) == "570.26" and driver_for_cuda((12, 7)) == "570.26"
    assert driver_for_cuda((13, 9)) is None
    d = driver_from_cuda_int("580.65.06", 13000)
    assert (d.version, d.cuda, d.cuda_is_lower_bound) == ("580.65.06", (13, 0), False)
    assert driver_from_cuda_int(None, 12080).cuda == (12, 8) and driver_from_cuda_int(None, 12080).label == "CUDA 12.8"
    assert parse_driver("535.104.05").version == "535.104.05" and parse_driver("12.2").version is None
    assert not parse_driver("610.50").cuda_is_lower_bound  # the newest branch in the table is known
    with pytest.raises(UsageError, match="driver 440.33 is older than CUDA 11.0") as e:
        parse_driver("440.33")
    assert e.value.hint == "Ingot needs a CUDA 12.0+ driver"
    with pytest.raises(UsageError, match="cannot read driver version 'banana'") as e:
        parse_driver("banana")
    assert e.value.hint == "pass a driver version like 535.104.05 or the CUDA version it supports, like 12.2"


# Linux driver of each toolkit GA, from the CUDA release notes (Table 3), and what a driver between them means.
@pytest.mark.parametrize(
    "text, cuda",
    [
        ("450.80.02", (11, 0)),
        ("520.61.05", (11, 8)),
        ("525.60.13", (12, 0)),
        ("525.85.12", (12, 0)),
        ("535.104.05", (12, 2)),
        ("570.26", (12, 8)),
        ("570.124.06", (12, 8)),
        ("575.57.08", (12, 9)),
        ("580.65.06", (13, 0)),
        ("580.159.04", (13, 0)),
        ("590.44.01", (13, 1)),
        ("595.45.04", (13, 2)),
        ("12.2", (12, 2)),
        ("13.0", (13, 0)),
    ],
)
def test_parse_driver(text, cuda):
    assert parse_driver(text).cuda == cuda


def test_driver_beyond_the_table_is_a_lower_bound():
    d = parse_driver("616.56")
    assert d.cuda_is_lower_bound and d.cuda == DRIVER_FOR_CUDA[-1][0]
    assert ">=" in d.label
    assert not parse_driver("580.65.06").cuda_is_lower_bound


@pytest.mark.parametrize("text", ["banana", "5.0.1", "13", "440.33", "13.0.0.1", ""])
def test_parse_driver_rejects(text):
    with pytest.raises(UsageError):
        parse_driver(text)


def test_driver_table_is_ordered():
    cudas = [c for c, _ in DRIVER_FOR_CUDA]
    drivers = [tuple(map(int, v.split("."))) for _, v in DRIVER_FOR_CUDA]
    assert cudas == sorted(cudas) and len(set(cudas)) == len(cudas)
    assert drivers == sorted(drivers) and len(set(drivers)) == len(drivers)


def test_ptx_isa_table_agrees_with_cuda_bindings():
    utils = pytest.importorskip("cuda.bindings.utils")
    for isa, (major, minor) in PTX_ISA_TO_CUDA.items():
        assert utils.get_minimal_required_cuda_ver_from_ptx_ver(isa) == 1000 * major + 10 * minor, isa


def test_modules_in(tmp_path):
    with pytest.raises(UsageError, match="no .fatbin files"):
        modules_in(tmp_path)
    with pytest.raises(UsageError, match="no such file"):
        modules_in(tmp_path / "missing.fatbin")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "a.fatbin").write_bytes(b"")
    assert [p.name for p in modules_in(tmp_path)] == ["a.fatbin"]
    (tmp_path / "b.fatbin").write_bytes(b"")  # a build folder: its own fatbins come first
    (tmp_path / "c.fatbin").write_bytes(b"")
    assert [p.name for p in modules_in(tmp_path)] == ["b.fatbin", "c.fatbin"]
    assert modules_in(tmp_path / "c.fatbin") == [tmp_path / "c.fatbin"]
    with pytest.raises(UsageError) as e:
        modules_in(tmp_path / "kernels" / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError) as e:
        modules_in(tmp_path / "empty")
    assert e.value.hint == "run `ingot build` first, or pass a fatbin"


def test_check_paths_reads_a_bundles_own_fatbins_and_plain_fatbins(toy_bundle, kernel_dir, stamp_cache):
    from ingot.toolchain.check import check_paths

    decisions = check_paths([toy_bundle], 90, parse_driver("580.65.06"))
    names = sorted(p.name for p in kernel_dir.glob("*.fatbin"))
    assert sorted(d.module for d in decisions) == names
    assert {(d.verdict, d.image) for d in decisions} == {("native", "sm_90")}
    decisions = check_paths(sorted(kernel_dir.glob("*.fatbin")), 100, parse_driver("13.0"))  # sm_90 + compute_90
    assert [d.module for d in decisions] == names and {(d.verdict, d.image) for d in decisions} == {
        ("jit", "compute_90")
    }


# --- on a real GPU: the driver must agree with decide() ---------------------------------------------------


@pytest.mark.gpu
@pytest.mark.nvcc
def test_the_driver_agrees(tmp_path):
    """Load fatbins of several kinds on this machine's GPU and check each load succeeds exactly when decide()
    says the module runs (209/222 otherwise)."""
    from ingot.runtime.gpu.compat import driver_from_cuda_int
    from ingot.runtime.gpu.fatbin import parse_fatbin
    from ingot.runtime.gpu.probe import probe

    machine = probe()
    if not machine.gpus:
        pytest.skip(f"needs an NVIDIA GPU ({machine.problem})")
    from cuda.bindings import driver as cu
    from kernel_sources import nvcc_fatbin, require_nvcc, write_sources

    tk = require_nvcc()
    src = write_sources(tmp_path)
    cc = machine.gpus[0].cc
    other = next(t for t in tk.targets if t // 10 != cc // 10)
    variants = {
        "exact": [f"-gencode=arch=compute_{cc},code=sm_{cc}"],
        "other_major": [f"-gencode=arch=compute_{other},code=sm_{other}"],
        "ptx_oldest": [f"-gencode=arch=compute_{tk.targets[0]},code=compute_{tk.targets[0]}"],
    }
    # PTX whose ISA is newer than any driver knows: nvcc embeds a PTX file as it is.
    ptx_text = subprocess.run(
        [str(tk.nvcc), "-ptx", f"-arch=compute_{tk.targets[0]}", "-o", "-", src.name],
        cwd=src.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    (tmp_path / "future.ptx").write_text(re.sub(r"^\.version \d+\.\d+", ".version 9.9", ptx_text, flags=re.M))
    driver = driver_from_cuda_int(machine.driver_version, machine.driver_cuda)
    assert cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS
    _, dev = cu.cuDeviceGet(0)
    _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
    cu.cuCtxSetCurrent(ctx)
    try:
        images = {name: nvcc_fatbin(src, tmp_path / f"{name}.fatbin", *opts) for name, opts in variants.items()}
        images["future_ptx"] = nvcc_fatbin(
            tmp_path / "future.ptx",
            tmp_path / "future.fatbin",
            f"-arch=compute_{tk.targets[0]}",
            f"-code=compute_{tk.targets[0]}",
        )
        for name, image in images.items():
            d = decide(parse_fatbin(image), cc, driver, name)
            err, mod = cu.cuModuleLoadData(image)
            loaded = err == cu.CUresult.CUDA_SUCCESS
            if loaded:
                cu.cuModuleUnload(mod)
            assert loaded == (d.verdict != "incompatible"), (name, err, d)
    finally:
        cu.cuDevicePrimaryCtxRelease(dev)
