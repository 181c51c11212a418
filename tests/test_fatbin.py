"""The pure-Python fatbin reader, on fatbins nvcc builds here with several -gencode and compression choices.

Expected entries are written from the nvcc options each fatbin was built with; the PTX ISA version is taken
from `nvcc -ptx` output, an independent oracle."""

from __future__ import annotations

import random
import re
import subprocess
from collections import Counter

import pytest
from kernel_sources import ANON_PREFIX, PLAIN_KERNELS, nvcc_fatbin, require_nvcc, write_sources

from ingot.runtime.errors import UsageError
from ingot.runtime.gpu.fatbin import parse_fatbin, read_fatbin

# name -> (nvcc options, expected entries as (kind, arch, variant, compression))
CASES = {
    "default": (
        ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_80,code=compute_80"],
        [("sass", "sm_80", "", "none"), ("ptx", "compute_80", "", "zstd")],
    ),
    "size_a_f": (
        ["--compress-mode=size", "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100f,code=sm_100f"],
        [("sass", "sm_90a", "a", "zstd"), ("sass", "sm_100f", "f", "zstd")],
    ),
    "ptx_variants_raw": (
        [
            "--compress-mode=none",
            "-gencode=arch=compute_90a,code=compute_90a",
            "-gencode=arch=compute_100f,code=compute_100f",
        ],
        [("ptx", "compute_90a", "a", "none"), ("ptx", "compute_100f", "f", "none")],
    ),
    "ptx_only": (["-gencode=arch=compute_75,code=compute_75"], [("ptx", "compute_75", "", "zstd")]),
    "speed_lz4": (
        ["--compress-mode=speed", "-gencode=arch=compute_86,code=sm_86", "-gencode=arch=compute_86,code=compute_86"],
        [("sass", "sm_86", "", "none"), ("ptx", "compute_86", "", "lz4")],
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, bytes]:
    require_nvcc()
    src = write_sources(tmp_path_factory.mktemp("src"))
    return {
        name: nvcc_fatbin(src, src.parent / f"{name}.fatbin", "--threads", "2", *opts)
        for name, (opts, _) in CASES.items()
    }


@pytest.fixture(scope="module")
def ptx_isa(tmp_path_factory) -> str:
    """The PTX ISA this nvcc writes, read from its own -ptx output."""
    tk = require_nvcc()
    src = write_sources(tmp_path_factory.mktemp("ptx"))
    text = subprocess.run(
        [str(tk.nvcc), "-ptx", "-arch=compute_80", "-o", "-", src.name],
        cwd=src.parent,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return re.search(r"^\.version (\d+\.\d+)", text, re.M).group(1)


@pytest.mark.nvcc
@pytest.mark.parametrize("case", CASES)
def test_reader_lists_every_entry_as_built(case, built, ptx_isa):
    fat = parse_fatbin(built[case], name=f"{case}.fatbin")
    expected = CASES[case][1]
    assert Counter((e.kind, e.arch, e.variant, e.compression) for e in fat.entries) == Counter(expected)
    tk = require_nvcc()
    for e in fat.entries:
        assert set(e.kernels) >= PLAIN_KERNELS
        assert sum(k.startswith(ANON_PREFIX) for k in e.kernels) == 1
        assert e.cc == int(re.search(r"\d+", e.arch).group())
        if e.kind == "ptx":
            assert e.isa == ptx_isa
            assert e.toolkit is None
        else:
            assert e.isa is None
            assert e.toolkit == tk.version  # from the cubin's tool notes
        if e.compression == "none":
            assert e.stored_size == e.size
        else:
            assert e.stored_size < e.size
    assert fat.containers == 1
    assert set(fat.kernels) >= PLAIN_KERNELS


@pytest.mark.nvcc
def test_concatenated_containers_with_zero_padding(built):
    a, b = built["default"], built["speed_lz4"]
    joined = a + b"\0" * 8 + b + b"\0" * 16
    fat = parse_fatbin(joined)
    first, second = parse_fatbin(a), parse_fatbin(b)
    assert fat.containers == 2
    assert [e.arch for e in fat.entries] == [e.arch for e in first.entries] + [e.arch for e in second.entries]
    assert [e.container for e in fat.entries] == [0] * len(first.entries) + [1] * len(second.entries)
    assert [e.offset for e in fat.entries[len(first.entries) :]] == [e.offset + len(a) + 8 for e in second.entries]
    assert fat.sass == ["sm_80", "sm_86"]
    assert fat.ptx == ["compute_80", "compute_86"]


def _one_line_usage_error(data: bytes) -> str:
    with pytest.raises(UsageError) as exc:
        parse_fatbin(data, name="x.fatbin")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("x.fatbin")
    return msg


@pytest.mark.nvcc
@pytest.mark.parametrize("case", ["default", "size_a_f", "speed_lz4"])
def test_every_truncation_is_a_usage_error(case, built):
    data = built[case]
    boundaries = {e.offset for e in parse_fatbin(data).entries} | {e.offset + 64 for e in parse_fatbin(data).entries}
    cuts = sorted(set(range(0, len(data), max(1, len(data) // 60))) | boundaries | {len(data) - 1})
    for cut in cuts:
        _one_line_usage_error(data[:cut])


@pytest.mark.nvcc
def test_corrupted_headers_never_escape_as_other_errors(built):
    data = built["default"] + built["size_a_f"]
    fat = parse_fatbin(data)
    header_bytes = [p for e in fat.entries for p in range(e.offset, e.offset + 64)] + list(range(16))
    rng = random.Random(1234)
    outcomes = Counter()
    for _ in range(400):
        mutated = bytearray(data)
        for pos in rng.sample(header_bytes, 3) + [rng.randrange(len(data))]:
            mutated[pos] = rng.randrange(256)
        try:
            parse_fatbin(bytes(mutated))
            outcomes["parsed"] += 1
        except UsageError as e:
            assert "\n" not in str(e)
            outcomes["usage error"] += 1
    assert outcomes["usage error"] > 0


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "not a CUDA fatbin"),
        (b"\x7fELF\x02\x01\x01" + b"\0" * 100, "not a CUDA fatbin"),
        (b"// PTX text\n.version 9.0\n", "not a CUDA fatbin"),
        (bytes.fromhex("50ed55ba") + b"\x01\x00\x10\x00" + b"\0" * 8, "empty fatbin"),
    ],
)
def test_non_fatbins_are_usage_errors(data, words):
    assert words in _one_line_usage_error(data)


def test_read_fatbin_missing_or_directory(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        read_fatbin(tmp_path / "nope.fatbin")
    with pytest.raises(UsageError, match="is a directory"):
        read_fatbin(tmp_path)
