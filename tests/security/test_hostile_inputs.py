"""Deliverables 3 and 4 of issue #13: every hostile input from the issue, built from code, run through the
CLI in a fresh process: the documented exit code, one line on stderr (no traceback, no "internal error"),
peak RSS under 300 MB and under 5 s."""

from __future__ import annotations

import os
import struct
import tarfile

import numpy as np
import pytest
from bundle_fixtures import craft_tar
from hostile import (
    ARR,
    F32,
    I32,
    STR,
    U8,
    U32,
    elf_with_section_offset,
    fat_entry,
    fatbin,
    gguf,
    gstr,
    kv,
    kv_array,
    llama_kvs,
    rewrite_gguf,
    small_llama,
    tar_with_pax_size,
    tensor_info,
)
from measure import one_line, run_measured

from ingot.runtime.bundle.manifest import MANIFEST, SIGNATURE

# --- GGUF headers, metadata and tensor tables (`ingot model info`) ----------------------------------------

GGUF_CASES = {
    "block_count 10^7 (154 KB file)": lambda: small_llama(llama__block_count=(U32, 10**7)) + bytes(150_000),
    "block_count -1": lambda: small_llama(llama__block_count=(I32, -1)),
    "head_count 0": lambda: small_llama(llama__attention__head_count=(U32, 0)),
    "rope dims 1000": lambda: small_llama(llama__rope__dimension_count=(U32, 1000)),
    "rope dims odd": lambda: small_llama(llama__rope__dimension_count=(U32, 3)),
    "norm eps NaN": lambda: small_llama(llama__attention__layer_norm_rms_epsilon=(F32, float("nan"))),
    "head_count as a string": lambda: small_llama(llama__attention__head_count=(STR, "two")),
    "3.8 MiB uint8 metadata array": lambda: gguf(llama_kvs() + [kv_array("x.big", U8, bytes(4_000_000))], []),
    "500k empty metadata strings": lambda: gguf(llama_kvs() + [kv_array("x.s", STR, [""] * 500_000)], []),
    "array length 2^64-1": lambda: gguf([kv_array("x.a", U32, b"\0" * 16, n=2**64 - 1)], []),
    "string array length 2^63": lambda: gguf([kv_array("x.a", STR, [], n=2**63)], []),
    "nested arrays": lambda: gguf([gstr("x.n") + struct.pack("<IIQ", ARR, ARR, 1) + struct.pack("<IQ", U8, 0)], []),
    "string length 2^64-1": lambda: gguf([gstr("k") + struct.pack("<I", STR) + struct.pack("<Q", 2**64 - 1)], []),
    "kv_count 2^63": lambda: gguf([], [], n_kv=2**63),
    "tensor_count 2^40": lambda: gguf([], [], n_tensors=2**40),
    "tensor offset 2^64-1 (wraps into the header)": lambda: gguf(
        llama_kvs(), [tensor_info("token_embd.weight", (8, 4), 0, 2**64 - 1)], bytes(128)
    ),
    "tensor with 2^32-1 dimensions": lambda: gguf([], [tensor_info("t", (4,), 0, 0, n_dims=2**32 - 1)]),
    "tensor of 2^64 elements": lambda: gguf([], [tensor_info("t", (2**32, 2**32), 0, 0)], bytes(64)),
    "tensor of unknown type": lambda: gguf([], [tensor_info("t", (4,), 1000, 0)], bytes(64)),
    "unsupported dims vs data (too short)": lambda: gguf(llama_kvs(), [tensor_info("token_embd.weight", (8, 4096))]),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_hostile_gguf(tmp_path, case):
    path = tmp_path / "hostile.gguf"
    path.write_bytes(GGUF_CASES[case]())
    r = run_measured("model", "info", path, env={"INGOT_CACHE_DIR": str(tmp_path / "cache")})
    size = path.stat().st_size
    print(f"{case}: exit {r.code}, {r.seconds:.2f} s wall, {r.cpu_s:.2f} s CPU, {r.rss_mb:.0f} MB, {size:,} bytes")
    assert r.code == 5, r.err
    one_line(r.err)
    assert r.within_budget(), r


# --- runnable-model metadata: tokenizer, chat template, weights (`ingot run`, `ingot pack`) ---------------


def _tiny_with(tmp_path, tiny_llama, **kw):
    return rewrite_gguf(tiny_llama, tmp_path / "hostile.gguf", **kw)


def _nan_norm(data, reader):
    t = next(t for t in reader.tensors if t.name == "output_norm.weight")
    start = t.data_offset - reader.data_offset
    data[start : start + t.n_bytes] = np.full(t.n_bytes // 4, np.nan, dtype=np.float32).tobytes()


LOOP = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"


def _template(text: str) -> dict:
    return {"tokenizer.chat_template": kv("tokenizer.chat_template", STR, text)}


RUN_CASES = {
    "a chat template that loops": (_template(LOOP), ["--chat"]),
    "a chat template building a 10^10-char string": (_template("{{ 'x' * 10000000000 }}"), ["--chat"]),
    "a chat template doubling a string": (_template(DOUBLING), ["--chat"]),
    "numeric token strings": ({"tokenizer.ggml.tokens": kv_array("tokenizer.ggml.tokens", U32, bytes(4 * 300))}, []),
    "bad merges": ({"tokenizer.ggml.merges": kv_array("tokenizer.ggml.merges", STR, ["nospace"] * 3)}, []),
    "bos id out of range": ({"tokenizer.ggml.bos_token_id": kv("tokenizer.ggml.bos_token_id", U32, 10**6)}, []),
    "token types of another length": (
        {"tokenizer.ggml.token_type": kv_array("tokenizer.ggml.token_type", I32, bytes(4 * 3))},
        [],
    ),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_hostile_runnable_model(tmp_path, tiny_llama, case):
    replace, extra = RUN_CASES[case]
    path = _tiny_with(tmp_path, tiny_llama, replace=replace)
    r = run_measured(
        "run", path, "-p", "hi", "-n", "1", "--device", "cpu", *extra, env={"INGOT_CACHE_DIR": str(tmp_path / "c")}
    )
    print(f"{case}: exit {r.code}, {r.seconds:.2f} s wall, {r.cpu_s:.2f} s CPU, {r.rss_mb:.0f} MB")
    assert r.code == 5, r.err
    one_line(r.err)
    assert r.within_budget(), r


def test_nan_weights_in_pack_are_a_model_error(tmp_path, tiny_llama, kernel_dir):
    path = _tiny_with(tmp_path, tiny_llama, tensor_data=_nan_norm)
    r = run_measured(
        "pack",
        "--model",
        path,
        "--kernels",
        kernel_dir,
        "--out",
        tmp_path / "x.ingot",
        env={"INGOT_CACHE_DIR": str(tmp_path / "c")},
    )
    assert r.code == 5 and "NaN" in one_line(r.err), r.err
    assert not list(tmp_path.glob(".x.ingot*"))  # nothing left behind


# --- fatbins (`ingot inspect`) ---------------------------------------------------------------------------

FATBIN_CASES = {
    "ELF section offset 2^63": lambda: fatbin([fat_entry(2, elf_with_section_offset(2**63))]),
    "ELF section table past the end": lambda: fatbin([fat_entry(2, elf_with_section_offset(10**6))]),
    "100k PTX entries": lambda: fatbin([fat_entry(1, b"")] * 100_000),
    "zstd entry claiming 2^40 bytes": lambda: _compressed_claim(2**40),
}


def _compressed_claim(size: int) -> bytes:
    e = bytearray(fat_entry(2, b"\x28\xb5\x2f\xfd" + bytes(12)))
    struct.pack_into("<I", e, 16, 16)
    struct.pack_into("<Q", e, 40, 0x8000)
    struct.pack_into("<Q", e, 56, size)
    return fatbin([bytes(e)])


@pytest.mark.parametrize("case", list(FATBIN_CASES))
def test_hostile_fatbin(tmp_path, case):
    path = tmp_path / "hostile.fatbin"
    path.write_bytes(FATBIN_CASES[case]())
    r = run_measured("inspect", path)
    print(f"{case}: exit {r.code}, {r.seconds:.2f} s wall, {r.cpu_s:.2f} s CPU, {r.rss_mb:.0f} MB")
    assert r.code == 2, r.err
    one_line(r.err)
    assert r.within_budget(), r


# --- bundles (`ingot verify`) -------------------------------------------------------------------------------


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def _bundle_case(case, tmp_path, toy_bundle, signed_bundle):
    out = tmp_path / "hostile.ingot"
    if case == "pax header size 2^62":
        out.write_bytes(tar_with_pax_size(2**62))
    elif case == "pax size record 2^62":
        info = tarfile.TarInfo("zzz")
        info.pax_headers = {"size": str(2**62)}
        craft_tar(toy_bundle, out, extra=[(info, b"")])
    elif case == "manifest nested 100k deep":
        craft_tar(toy_bundle, out, replace={MANIFEST: _deep(100_000)})
    elif case == "signature nested 100k deep":
        craft_tar(signed_bundle, out, replace={SIGNATURE: _deep(100_000)})
    elif case == "end-of-archive truncated":
        out.write_bytes(toy_bundle.read_bytes()[:-1024])
    elif case == "500 kB smuggled into a pax header":
        with tarfile.open(toy_bundle) as tin, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tout:
            for m in tin.getmembers():
                if m.name == MANIFEST:
                    m.pax_headers = {"comment": "x" * 500_000}
                tout.addfile(m, tin.extractfile(m))
    elif case == "a named pipe":
        os.mkfifo(out)
    return out


BUNDLE_CASES = {
    "pax header size 2^62": 4,
    "pax size record 2^62": 4,
    "manifest nested 100k deep": 4,
    "signature nested 100k deep": 4,
    "end-of-archive truncated": 4,
    "500 kB smuggled into a pax header": 4,
    "a named pipe": 2,
}


@pytest.mark.parametrize("case", list(BUNDLE_CASES))
def test_hostile_bundle(tmp_path, toy_bundle, signed_bundle, case):
    path = _bundle_case(case, tmp_path, toy_bundle, signed_bundle)
    r = run_measured("verify", path, env={"INGOT_CACHE_DIR": str(tmp_path / "c")}, timeout=30)
    print(f"{case}: exit {r.code}, {r.seconds:.2f} s wall, {r.cpu_s:.2f} s CPU, {r.rss_mb:.0f} MB")
    assert r.code == BUNDLE_CASES[case], r.err
    one_line(r.err)
    assert r.within_budget(), r


def test_the_limits_are_documented():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Limits", 1)[1].split("\n## ", 1)[0]
    for name in ("MAX_JSON_DEPTH", "MAX_TAR_HEADER", "MAX_GGUF_STRINGS", "MAX_FATBIN_ENTRIES", "TEMPLATE_TIME_S"):
        assert name in section
