"""The model index cache: a second open of an unchanged GGUF skips the parse and maps the same tensors."""

from __future__ import annotations

import os
import shutil

import numpy as np

from ingot.runtime.model import gguf as model_mod
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.synth import synthesize


def test_second_open_uses_index_and_gives_the_same_model(tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    path = synthesize("tiny", "Q4_0", tmp_path / "m.gguf", seed=3)
    first = load_model(path)
    calls = []
    real = model_mod._parse_model
    monkeypatch.setattr(model_mod, "_parse_model", lambda *a: calls.append(a) or real(*a))
    second = load_model(path)
    assert calls == []  # served from the index
    assert second.config == first.config and second.vocab == first.vocab and second.name == first.name
    assert second.tensors.keys() == first.tensors.keys()
    for name, t in first.tensors.items():
        u = second.tensors[name]
        assert (u.qtype, u.shape) == (t.qtype, t.shape)
        assert np.array_equal(u.raw, t.raw)


def test_changed_file_is_parsed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))
    path = synthesize("tiny", "Q8_0", tmp_path / "m.gguf", seed=1)
    load_model(path)
    replacement = synthesize("tiny", "Q8_0", tmp_path / "other.gguf", seed=2)
    shutil.copyfile(replacement, path)  # new bytes, same path
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    calls = []
    real = model_mod._parse_model
    monkeypatch.setattr(model_mod, "_parse_model", lambda *a: calls.append(a) or real(*a))
    reopened = load_model(path)
    assert len(calls) == 1
    assert np.array_equal(
        reopened.tensors["blk.0.attn_q.weight"].raw, load_model(replacement).tensors["blk.0.attn_q.weight"].raw
    )


def test_unwritable_cache_does_not_fail_the_load(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("INGOT_CACHE_DIR", str(blocker))
    path = synthesize("tiny", "Q4_1", tmp_path / "m.gguf")
    assert load_model(path).config.n_layers == 2
