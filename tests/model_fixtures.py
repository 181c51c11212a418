"""Fixtures for the model runtime tests (model, quants, tokenizer, chat, sampling, generation, perplexity, CLI).

The real SmolLM2-135M-Instruct GGUF is looked up where `ingot model fetch smollm2` caches it (CI fetches it
first), then at $INGOT_TEST_MODEL and /tmp/model/model.gguf; the real Gemma 3 270M where `ingot model fetch
gemma3-270m` caches it, then at $INGOT_TEST_GEMMA3. Tests that need one skip when it is absent.
Synthetic models (runtime/synth.py) are written once per session.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ingot.runtime import settings
from ingot.runtime.model.fetch import model_path
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.synth import synthesize
from ingot.runtime.model.tokenizer import Tokenizer


def _real_file(name: str, setting: settings.Setting, what: str, *extra: Path) -> Path:
    """A real model: where `ingot model fetch NAME` caches it, at $SETTING, or at the extra paths; else skip."""
    env = setting.get()
    for p in (model_path(name), *([Path(env)] if env else []), *extra):
        if p.is_file():
            return p
    pytest.skip(f"the real {what} GGUF is absent: run `ingot model fetch {name}` (or set {setting.name})")


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    return _real_file("smollm2", settings.TEST_MODEL, "SmolLM2", Path("/tmp/model/model.gguf"))


@pytest.fixture(scope="session")
def real_model(real_model_path):
    return load_model(real_model_path)


@pytest.fixture(scope="session")
def real_tokenizer(real_model):
    return Tokenizer.from_model(real_model)


@pytest.fixture(scope="session")
def gemma3_model_path() -> Path:
    """The real Gemma 3 270M Q4_K_M (F32, Q5_0, Q8_0, Q4_K, Q6_K tensors), where `ingot model fetch gemma3-270m`
    caches it or at $INGOT_TEST_GEMMA3; tests that need it skip when it is absent."""
    return _real_file("gemma3-270m", settings.TEST_GEMMA3, "Gemma 3 270M")


@pytest.fixture(scope="session")
def gemma3_model(gemma3_model_path):
    return load_model(gemma3_model_path)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_model):
    return Tokenizer.from_model(gemma3_model)


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory):
    """synth_model(shape, qtype, template) -> path of a synthetic GGUF, written once per session."""
    made: dict[tuple[str, str, str], Path] = {}
    folder = tmp_path_factory.mktemp("synth")

    def make(shape: str = "tiny", qtype: str = "Q4_1", template: str = "chatml") -> Path:
        if (shape, qtype, template) not in made:
            name = f"{shape}-{qtype}.gguf" if template == "chatml" else f"{shape}-{qtype}-{template}.gguf"
            made[shape, qtype, template] = synthesize(shape, qtype, folder / name, seed=7, template=template)
        return made[shape, qtype, template]

    return make


@pytest.fixture(scope="session")
def tiny_model_path(synth_model) -> Path:
    return synth_model("tiny", "Q4_1")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    return load_model(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    return Tokenizer.from_model(tiny_model)


def rewrite_gguf(
    src: Path,
    dst: Path,
    *,
    arch: str | None = None,
    drop: tuple[str, ...] = (),
    replace: dict[str, tuple[str, tuple[int, ...], bytes]] | None = None,
    extra: dict[str, tuple[object, gguf.GGUFValueType]] | None = None,
) -> Path:
    """Copy a GGUF, optionally renaming its architecture (and its `arch.*` keys), dropping tensors,
    replacing tensors with (qtype, math-order shape, raw bytes), or adding metadata keys (value, type)."""
    r = gguf.GGUFReader(src)
    old = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch or old)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if arch and key.startswith(old + "."):
            key = arch + key[len(old) :]
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in (extra or {}).items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        if replace and t.name in replace:
            qtype, shape, raw = replace[t.name]
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
            data = np.frombuffer(raw, dtype=np.uint8).reshape(*shape[:-1], shape[-1] // block * size)
            w.add_tensor(t.name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture
def ingot(monkeypatch, capsys):
    """ingot(*args) -> (exit code, stdout, stderr), running `ingot ARGS` through main() (the real exit codes)."""
    from bundle_fixtures import run_cli

    return lambda *args: run_cli(monkeypatch, capsys, *args)
