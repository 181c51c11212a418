"""`ingot build` with the real nvcc: the default policy on the real kernels (once per module run), and the
cache, reproducibility and arch check on tiny kernels; plus the CMake/pip packaging path."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from bundle_fixtures import session_lock
from kernel_sources import ANON_PREFIX, PLAIN_KERNELS, nvcc_fatbin, require_nvcc, write_sources

from ingot.runtime.errors import BuildError, UsageError
from ingot.runtime.gpu.fatbin import read_fatbin
from ingot.toolchain import build as build_mod
from ingot.toolchain.archs import parse_arch_list
from ingot.toolchain.build import build

pytestmark = pytest.mark.nvcc

ROOT = Path(__file__).resolve().parents[1]
POLICY = json.loads((ROOT / "cuda" / "archs.json").read_text())
SMALL = "sm_80,sm_90,compute_90"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def forbid_nvcc(monkeypatch):
    """Make any nvcc run fail the test: a cache hit must not compile."""

    def no_run(*a, **k):
        raise AssertionError(f"nvcc ran: {a[0] if a else k}")

    monkeypatch.setattr(build_mod.subprocess, "run", no_run)


# --- the real kernels, default policy ------------------------------------------------------------------


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The default build of the real kernels, compiled by nvcc in this session (never a previous session's cache
    entries): into an empty private cache, once per session. The entries are then published into the kernel
    cache `ingot build` reads (INGOT_CACHE_DIR), so a build of the same sources after the tests (ci/quickstart.sh
    in CI) reuses these bytes instead of compiling them again. A second xdist worker that needs this fixture
    waits for the first and then builds from those published entries (all cache hits)."""
    require_nvcc()
    shared = build_mod.cache_dir()
    cache = tmp_path_factory.mktemp("real-cache")
    with session_lock(tmp_path_factory, "real-kernels") as root:
        done = root / "real-kernels.compiled"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("INGOT_CACHE_DIR", str(cache))
            private = build_mod.cache_dir()
            if done.exists():  # compiled this session by another worker: start from the entries it published
                private.mkdir(parents=True)
                for name in done.read_text().split():
                    shutil.copyfile(shared / name, private / name)
            result = build(out_dir=tmp_path_factory.mktemp("dist"))
        if not done.exists():
            assert not any(m.cached for m in result.modules)
            shared.mkdir(parents=True, exist_ok=True)
            names = sorted(p.name for p in private.iterdir())  # <key>.fatbin before <key>.json
            for name in names:
                shutil.copyfile(private / name, shared / f".{name}.tmp")
                os.replace(shared / f".{name}.tmp", shared / name)
            done.write_text("\n".join(names))
    return result, cache


def test_default_policy_file_gives_a_reason_for_each_arch():
    sass = [e["arch"] for e in POLICY["sass"]]
    assert sass == ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"]
    assert [e["arch"] for e in POLICY["ptx"]] == ["compute_120"]
    assert all(len(e["why"]) > 20 for e in POLICY["sass"] + POLICY["ptx"])
    assert not {"-G", "-lineinfo", "--generate-line-info", "--device-debug"} & set(POLICY["flags"])


def test_default_policy_builds_every_kernel_with_exactly_its_archs(real):
    result, _ = real
    sources = sorted(p.stem for p in (ROOT / "cuda").glob("*.cu"))
    assert [m.name for m in result.modules] == sources
    for m in result.modules:
        fat = read_fatbin(m.path)
        assert sorted(fat.sass) == sorted(e["arch"] for e in POLICY["sass"])
        assert fat.ptx == [e["arch"] for e in POLICY["ptx"]]
        assert len(fat.entries) == len(POLICY["sass"]) + len(POLICY["ptx"])
        assert sha256(m.path) == m.sha256
        assert fat.kernels and all(set(e.kernels) == set(fat.kernels) for e in fat.entries), m.name
        assert {a.arch for a in m.per_arch} == set(fat.sass) | set(fat.ptx)
        assert all(a.bytes > 0 and a.seconds > 0 for a in m.per_arch)
    recorded = json.loads((result.out_dir / "build.json").read_text())
    assert [f["sha256"] for f in recorded["fatbins"]] == [m.sha256 for m in result.modules]


def test_recorded_command_reproduces_the_bytes(real, tmp_path):
    result, _ = real
    m = min(result.modules, key=lambda m: m.size)
    cmd = list(m.command)
    assert Path(cmd[0]).name == "nvcc" and cmd[-1] == f"{m.name}.cu"
    assert not {"-G", "-lineinfo"} & set(cmd)
    for e in POLICY["sass"]:
        n = e["arch"][3:]
        assert cmd.count(f"-gencode=arch=compute_{n},code=sm_{n}") == 1
    cmd[cmd.index("-o") + 1] = str(tmp_path / "again.fatbin")
    cmd[cmd.index("--time") + 1] = str(tmp_path / "time.csv")
    subprocess.run(cmd, cwd=m.cwd, check=True, capture_output=True)
    assert sha256(tmp_path / "again.fatbin") == m.sha256


def test_real_kernel_rebuilds_identically_from_another_folder(real, tmp_path):
    result, _ = real
    m = min(result.modules, key=lambda m: m.size)
    copy = tmp_path / "elsewhere" / "cuda"
    shutil.copytree(ROOT / "cuda", copy)
    again = build(out_dir=tmp_path / "out", sources=[copy / f"{m.name}.cu"], use_cache=False, threads=1)
    assert again.modules[0].sha256 == m.sha256


def test_unchanged_real_kernels_come_from_the_cache(real, tmp_path, monkeypatch):
    result, cache = real
    monkeypatch.setenv("INGOT_CACHE_DIR", str(cache))
    forbid_nvcc(monkeypatch)
    again = build(out_dir=tmp_path / "out")
    assert all(m.cached for m in again.modules)
    assert [m.sha256 for m in again.modules] == [m.sha256 for m in result.modules]


# --- tiny kernels: reproducibility, cache, arch check --------------------------------------------------


def test_reproducible_across_folders_and_thread_counts(tmp_path):
    a = write_sources(tmp_path / "a")
    b = write_sources(tmp_path / "some" / "other" / "place")
    one = build(parse_arch_list(SMALL), tmp_path / "out1", sources=[a], use_cache=False, threads=1)
    two = build(parse_arch_list(SMALL), tmp_path / "out2", sources=[b], use_cache=False, threads=2)
    assert one.modules[0].sha256 == two.modules[0].sha256 == sha256(tmp_path / "out2" / "k.fatbin")
    kernels = one.modules[0].kernels
    assert set(kernels) >= PLAIN_KERNELS and any(k.startswith(ANON_PREFIX) for k in kernels)


def test_plain_nvcc_is_not_path_independent(tmp_path):
    """Why the build pins the source name: plain nvcc hashes the source folder into anonymous-namespace names."""
    a, b = write_sources(tmp_path / "a"), write_sources(tmp_path / "b")
    opts = ["-gencode=arch=compute_80,code=sm_80"]
    assert nvcc_fatbin(a, tmp_path / "a.fatbin", *opts) != nvcc_fatbin(b, tmp_path / "b.fatbin", *opts)


def test_hidden_nvcc_environment_does_not_leak_in(tmp_path, monkeypatch):
    src = write_sources(tmp_path / "src")
    opts = "-gencode=arch=compute_80,code=sm_80"
    clean = build(parse_arch_list("sm_80"), tmp_path / "clean", sources=[src], use_cache=False)
    plain = nvcc_fatbin(src, tmp_path / "plain.fatbin", opts)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-lineinfo")
    assert nvcc_fatbin(src, tmp_path / "plain-lineinfo.fatbin", opts) != plain  # the variable does reach nvcc
    dirty = build(parse_arch_list("sm_80"), tmp_path / "dirty", sources=[src], use_cache=False)
    assert dirty.modules[0].sha256 == clean.modules[0].sha256


def test_cache_hit_then_miss_after_header_edit(tmp_path, monkeypatch, private_cache):
    src = write_sources(tmp_path / "src")
    archs = parse_arch_list(SMALL)
    first = build(archs, tmp_path / "o1", sources=[src])
    assert not first.modules[0].cached and len(list(private_cache.glob("*.fatbin"))) == 1

    with monkeypatch.context() as mp:
        forbid_nvcc(mp)
        hit = build(archs, tmp_path / "o2", sources=[src])
    assert hit.modules[0].cached and hit.modules[0].sha256 == first.modules[0].sha256
    assert sha256(tmp_path / "o2" / "k.fatbin") == first.modules[0].sha256

    (src.parent / "scale.cuh").write_text("#pragma once\n#define SCALE 4.0f\n")
    edited = build(archs, tmp_path / "o3", sources=[src])
    assert not edited.modules[0].cached and edited.modules[0].sha256 != first.modules[0].sha256

    other_archs = build(parse_arch_list("sm_80,compute_90"), tmp_path / "o4", sources=[src])
    assert not other_archs.modules[0].cached


def test_nested_header_is_part_of_the_key(tmp_path):
    src = write_sources(tmp_path / "src", header='#pragma once\n#include "sub/inner.cuh"\n')
    (src.parent / "sub").mkdir()
    (src.parent / "sub" / "inner.cuh").write_text("#define SCALE 3.0f\n")
    archs = parse_arch_list("sm_80")
    first = build(archs, tmp_path / "o1", sources=[src])
    assert set(first.modules[0].inputs) == {"k.cu", "scale.cuh", "sub/inner.cuh"}
    (src.parent / "sub" / "inner.cuh").write_text("#define SCALE 5.0f\n")
    second = build(archs, tmp_path / "o2", sources=[src])
    assert not second.modules[0].cached and second.modules[0].sha256 != first.modules[0].sha256


def test_corrupt_cache_entry_is_recompiled(tmp_path, private_cache):
    src = write_sources(tmp_path / "src")
    archs = parse_arch_list("sm_80")
    first = build(archs, tmp_path / "o1", sources=[src])
    cached = next(private_cache.glob("*.fatbin"))
    cached.write_bytes(b"garbage")
    again = build(archs, tmp_path / "o2", sources=[src])
    assert not again.modules[0].cached and again.modules[0].sha256 == first.modules[0].sha256


def test_arch_check_fails_when_nvcc_output_lacks_an_arch(tmp_path, monkeypatch, private_cache):
    src = write_sources(tmp_path / "src")
    only_sm80 = nvcc_fatbin(src, tmp_path / "one.fatbin", "-gencode=arch=compute_80,code=sm_80")
    monkeypatch.setattr(build_mod, "_compile", lambda *a, **k: (only_sm80, {}, ["nvcc"]))
    with pytest.raises(BuildError, match=r"missing \['sm_90'\]") as exc:
        build(parse_arch_list("sm_80,sm_90"), tmp_path / "out", sources=[src])
    assert exc.value.exit_code == 6 and "\n" not in str(exc.value)
    assert not (tmp_path / "out" / "k.fatbin").exists()
    assert not list(private_cache.glob("*"))


def test_arch_check_rejects_a_duplicated_image(tmp_path, monkeypatch):
    src = write_sources(tmp_path / "src")
    one = nvcc_fatbin(src, tmp_path / "one.fatbin", "-gencode=arch=compute_80,code=sm_80")
    monkeypatch.setattr(build_mod, "_compile", lambda *a, **k: (one + one, {}, ["nvcc"]))
    with pytest.raises(BuildError, match=r"unexpected \['sm_80'\]"):
        build(parse_arch_list("sm_80"), tmp_path / "out", sources=[src])


def test_compile_error_is_a_one_line_build_error(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text("__global__ void k(float* x) { x[0] = undefined_thing; }\n")
    with pytest.raises(BuildError) as exc:
        build(parse_arch_list("sm_80"), tmp_path / "out", sources=[bad])
    assert "bad.cu" in str(exc.value) and "undefined_thing" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    "text", ["native", "sm_80,native", "all", "all-major", "", "sm_80,sm_80", "sm80", "compute_90x"]
)
def test_arch_list_refuses(text):
    with pytest.raises(UsageError):
        parse_arch_list(text)


def test_arch_list_order_and_variants():
    archs = parse_arch_list("compute_120, sm_100f,sm_90a ,sm_80")
    assert [a.name for a in archs] == ["sm_80", "sm_90a", "sm_100f", "compute_120"]
    assert archs[2].gencode() == "arch=compute_100f,code=sm_100f"
    assert archs[3].gencode() == "arch=compute_120,code=compute_120"


def test_arch_the_toolkit_cannot_target_is_a_usage_error(tmp_path):
    tk = require_nvcc()
    old = next(cc for cc in (50, 52, 60, 61, 70, 72) if cc not in tk.targets)
    with pytest.raises(UsageError, match=f"sm_{old}"):
        build(parse_arch_list(f"sm_{old}"), tmp_path / "out", sources=[write_sources(tmp_path / "src")])


def test_two_sources_with_one_name_are_refused(tmp_path):
    a, b = write_sources(tmp_path / "a"), write_sources(tmp_path / "b")
    with pytest.raises(UsageError, match="k.fatbin"):
        build(parse_arch_list("sm_80"), tmp_path / "out", sources=[a, b])


# --- packaging: CMake (what `pip install .` runs) ------------------------------------------------------


def _cmake() -> str:
    cmake = shutil.which("cmake")
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout if cmake else ""
    m = re.search(r"(\d+)\.(\d+)", out)
    if not m or (int(m.group(1)), int(m.group(2))) < (3, 27):
        pytest.skip("needs CMake >= 3.27")
    return cmake


def _project_copy(dest: Path) -> Path:
    """CMakeLists.txt and the real arch policy, with the tiny kernel as the only source."""
    (dest / "cuda").mkdir(parents=True)
    shutil.copy(ROOT / "CMakeLists.txt", dest)
    shutil.copy(ROOT / "cuda" / "archs.json", dest / "cuda")
    write_sources(dest / "cuda")
    return dest


def _no_nvcc_env() -> dict:
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvcc").exists()]
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "CUDAHOSTCXX")}
    return env | {"PATH": os.pathsep.join(path), "CUDACXX": "/nonexistent/nvcc"}


def _cmake_install(cmake: str, src: Path, tmp: Path, env: dict) -> tuple[str, Path]:
    gen = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
    conf = subprocess.run([cmake, "-S", src, "-B", tmp / "b", *gen], env=env, capture_output=True, text=True)
    assert conf.returncode == 0, conf.stderr
    subprocess.run([cmake, "--build", tmp / "b"], env=env, check=True, capture_output=True)
    subprocess.run([cmake, "--install", tmp / "b", "--prefix", tmp / "inst"], env=env, check=True, capture_output=True)
    return conf.stdout + conf.stderr, tmp / "inst" / "ingot"


def test_cmake_without_nvcc_installs_cpu_only_with_a_warning(tmp_path):
    cmake = _cmake()
    log, inst = _cmake_install(cmake, _project_copy(tmp_path / "proj"), tmp_path, _no_nvcc_env())
    assert "no CUDA compiler (nvcc) found: installing CPU-only" in log
    assert (inst / "toolchain" / "cuda" / "archs.json").is_file() and (inst / "toolchain" / "cuda" / "k.cu").is_file()
    assert not list(inst.rglob("*.fatbin"))


def test_cmake_fatbins_are_byte_identical_to_ingot_build(tmp_path):
    cmake = _cmake()
    src = _project_copy(tmp_path / "proj")
    log, inst = _cmake_install(cmake, src, tmp_path, dict(os.environ))
    installed = list(inst.rglob("*.fatbin"))
    assert [p.relative_to(inst).as_posix() for p in installed] == ["runtime/fatbins/k.fatbin"]
    ours = build(out_dir=tmp_path / "ours", sources=[src / "cuda" / "k.cu"], use_cache=False)
    assert sha256(installed[0]) == ours.modules[0].sha256


def test_pip_wheel_without_nvcc_is_cpu_only(tmp_path):
    pytest.importorskip("scikit_build_core", reason="pip wheel --no-build-isolation needs scikit-build-core")
    _cmake()
    proj = tmp_path / "proj"
    proj.mkdir()
    for item in ("pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE", "cuda", "toolchain", "runtime"):
        if (ROOT / item).is_dir():
            shutil.copytree(ROOT / item, proj / item, ignore=shutil.ignore_patterns("__pycache__", "*.fatbin"))
        else:
            shutil.copy(ROOT / item, proj)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-build-isolation",
            "--no-deps",
            "-w",
            tmp_path / "dist",
            proj,
        ],
        env=_no_nvcc_env(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "installing CPU-only" in run.stdout + run.stderr
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist()
    assert "ingot/toolchain/cuda/archs.json" in names
    assert {f"ingot/toolchain/cuda/{p.name}" for p in (ROOT / "cuda").glob("*.cu")} <= set(names)
    assert not [n for n in names if n.endswith(".fatbin")]
