"""Deliverable 4 of issue #13: property-based fuzzing of every parser of untrusted bytes.

GGUF reader, bundle reader (every mutation must be refused), manifest/signature/JSON parsing, fatbin reader,
and the HTTP request parsers of the three API dialects. Each may only return or raise its documented error
type (ModelError/UsageError, VerificationError, UsageError, ApiError or UsageError -> 400); anything else is
a crash to turn into a regression test in tests/security/test_hostile_inputs.py.

Profiles: "ci" (default; small max_examples, derandomized so CI is reproducible, ~60 s in all) and "long"
(INGOT_FUZZ=long: many more examples, random seeds, no deadline).
"""

from __future__ import annotations

import os
import struct
import tempfile
from pathlib import Path

import pytest
from hostile import fat_entry, fatbin, small_llama

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ingot.runtime.errors import ModelError, UsageError, VerificationError  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("long" if os.environ.get("INGOT_FUZZ") == "long" else "ci")


@pytest.fixture(scope="module", autouse=True)
def private_cache():
    old = os.environ.get("INGOT_CACHE_DIR")
    with tempfile.TemporaryDirectory() as d:
        os.environ["INGOT_CACHE_DIR"] = d
        yield
    if old is None:
        os.environ.pop("INGOT_CACHE_DIR", None)
    else:
        os.environ["INGOT_CACHE_DIR"] = old


def patches(size: int):
    """1-6 (offset, byte) overwrites of a buffer of `size` bytes, biased to its first 1 KiB (the headers)."""
    offset = st.one_of(st.integers(0, min(size, 1024) - 1), st.integers(0, size - 1))
    return st.lists(st.tuples(offset, st.integers(0, 255)), min_size=1, max_size=6)


def apply(data: bytes, edits) -> bytes:
    b = bytearray(data)
    for i, v in edits:
        b[i] = v
    return bytes(b)


def u64_at(data: bytes, edits) -> bytes:
    """Overwrite 8-byte little-endian words (counts, lengths, offsets) with hostile values."""
    b = bytearray(data)
    for i, v in edits:
        if i + 8 <= len(b):
            struct.pack_into("<Q", b, i, v)
    return bytes(b)


HOSTILE_U64 = st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1, 10**7])

# --- GGUF -------------------------------------------------------------------------------------------------

GGUF = small_llama()


def _load(data: bytes) -> None:
    from ingot.runtime.model.gguf import load_model

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(data)
        f.flush()
        try:
            load_model(f.name)
        except (ModelError, UsageError):
            pass


@given(patches(len(GGUF)))
def test_fuzz_gguf_bytes(edits):
    _load(apply(GGUF, edits))


@given(st.lists(st.tuples(st.integers(0, len(GGUF) - 8), HOSTILE_U64), min_size=1, max_size=3))
def test_fuzz_gguf_words(edits):
    _load(u64_at(GGUF, edits))


@given(st.binary(max_size=512))
def test_fuzz_gguf_random_after_magic(tail):
    _load(b"GGUF\x03\0\0\0" + tail)


# --- bundles: every mutation is refused ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle_bytes(small_signed_bundle) -> bytes:
    return small_signed_bundle.read_bytes()


def _verify(data: bytes) -> bool:
    from ingot.runtime.bundle.verify import verify_bundle

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b.ingot"
        path.write_bytes(data)
        try:
            verify_bundle(path)
            return True
        except VerificationError:
            return False


@given(data=st.data())
def test_fuzz_bundle_mutations_are_refused(bundle_bytes, data):
    edits = data.draw(patches(len(bundle_bytes)))
    mutated = apply(bundle_bytes, edits)
    if mutated != bundle_bytes:
        assert not _verify(mutated)


@given(data=st.data())
def test_fuzz_bundle_cut_or_extended_is_refused(bundle_bytes, data):
    cut = data.draw(st.integers(1, len(bundle_bytes)))
    extra = data.draw(st.binary(min_size=0, max_size=600))
    assert not _verify(bundle_bytes[:-cut] + extra if extra != bundle_bytes[-cut:] else bundle_bytes[:-cut])


# --- manifest, signature, bounded JSON ----------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=30,
)


@given(st.one_of(st.binary(max_size=300), JSON.map(lambda v: __import__("json").dumps(v).encode())))
def test_fuzz_manifest_parser(data):
    from ingot.runtime.bundle.manifest import parse_manifest

    with pytest.raises(VerificationError):
        parse_manifest(data)


@given(st.integers(1, 5000), st.sampled_from([b"[", b'{"a":', b'[{"x":']))
def test_fuzz_json_nesting(depth, opener):
    from ingot.runtime.limits import bounded_json_loads

    try:
        bounded_json_loads(opener * depth, what="x", max_size=1 << 20)
    except VerificationError:
        pass


@given(st.one_of(st.binary(max_size=300), JSON.map(lambda v: __import__("json").dumps(v).encode())))
def test_fuzz_signature_parser(bundle_bytes, data):
    from ingot.runtime.bundle.container import load_manifest, open_file, read_index
    from ingot.runtime.bundle.verify import check_signature_member

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "b.ingot"
        path.write_bytes(bundle_bytes)
        with open_file(path) as f:
            manifest = load_manifest(f, read_index(f, len(bundle_bytes)))
    with pytest.raises(VerificationError):
        check_signature_member(data, manifest, None)


# --- fatbins ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_fatbin(one_kernel_dir) -> bytes:
    return (one_kernel_dir / "rope.fatbin").read_bytes()


def _fatbin(data: bytes) -> None:
    from ingot.runtime.gpu.fatbin import parse_fatbin

    try:
        parse_fatbin(data)
    except UsageError:
        pass


@given(data=st.data())
def test_fuzz_fatbin_bytes(real_fatbin, data):
    _fatbin(apply(real_fatbin, data.draw(patches(len(real_fatbin)))))


@given(data=st.data())
def test_fuzz_fatbin_words(real_fatbin, data):
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(real_fatbin) - 8), HOSTILE_U64), min_size=1, max_size=3))
    _fatbin(u64_at(real_fatbin, edits))


@given(st.lists(st.tuples(st.sampled_from([1, 2, 3]), st.binary(max_size=200)), max_size=5))
def test_fuzz_fatbin_synthetic(entries):
    _fatbin(fatbin([fat_entry(kind, payload) for kind, payload in entries]))


# --- HTTP request parsers ---------------------------------------------------------------------------------------

FIELDS = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "stop",
        "seed",
        "system",
        "options",
        "role",
        "content",
        "stream_options",
        "logprobs",
        "echo",
        "raw",
        "format",
        "num_predict",
        "text",
        "type",
        "tools",  # tool calling and structured output: the grammar engine sees fuzzed schemas too
        "tool_choice",
        "response_format",
        "json_schema",
        "schema",
        "function",
        "name",
        "parameters",
        "input_schema",
        "properties",
    ]
)
REQUEST = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELDS, inner, max_size=6),
    max_leaves=25,
)


@given(st.dictionaries(FIELDS, REQUEST, max_size=8))
def test_fuzz_request_parsers(body):
    pytest.importorskip("starlette", reason="needs the serve extra")
    from ingot.runtime.server import anthropic, ollama, openai
    from ingot.runtime.server.request import ApiError

    for parse in (
        openai.parse_chat,
        openai.parse_completion,
        anthropic.parse_messages,
        ollama.parse_chat,
        ollama.parse_generate,
    ):
        try:
            parse(body)
        except ApiError as e:
            assert 400 <= e.status < 500 and e.message
        except UsageError as e:  # e.g. SamplingParams' range checks: the app answers these with a 400 too
            assert e.message
