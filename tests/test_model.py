"""GGUF loading (config, tensors, windows inside bigger files, bad input) and the reference forward pass."""

import dataclasses
import tarfile

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from model_fixtures import rewrite_gguf

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.errors import ModelError, UsageError
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.quants import QUANT_TYPES
from ingot.runtime.sampling import SamplingParams

# --- loading ---------------------------------------------------------------------------------------


def test_real_model_config_matches_smollm2_135m(real_model):
    c = real_model.config
    # SmolLM2-135M per its model card: 30 layers of width 576, 9 heads sharing 3 KV heads, SwiGLU 1536,
    # 49152-token vocabulary, rope theta 100000, tied embeddings.
    assert (c.arch, c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim, c.n_vocab) == (
        "llama",
        576,
        30,
        9,
        3,
        1536,
        49152,
    )
    assert (c.head_dim, c.n_rep, c.rope_dim, c.rope_theta, c.n_ctx_train) == (64, 3, 64, 100000.0, 8192)
    assert c.tied_embeddings and not c.qkv_bias and not c.rope_neox and c.rope_freq_factors is None
    assert c.norm_eps == pytest.approx(1e-5)
    assert real_model.quant_types == ["F32", "Q4_1", "Q8_0"]
    assert real_model.n_tensors == 2 + 9 * 30
    assert c.as_dict()["n_rep"] == 3


def test_tensors_are_zero_copy_views_in_math_order(real_model, real_model_path):
    reader = GGUFReader(real_model_path)
    ref = {t.name: t for t in reader.tensors}
    k = real_model.tensors["blk.3.attn_k.weight"]
    assert k.shape == (192, 576)  # (rows = KV dim, cols = model dim)
    assert tuple(ref[k.name].shape) == (576, 192)  # GGUF lists ne0 (cols) first
    assert k.raw.dtype == np.uint8 and not k.raw.flags.owndata
    assert k.raw.tobytes() == ref[k.name].data.tobytes()
    assert real_model.tensors["blk.3.ffn_down.weight"].shape == (576, 1536)


def test_model_inside_a_bigger_file_maps_in_place(tiny_model_path, tmp_path):
    # A bundle stores the GGUF as an uncompressed tar member: load it where it lies.
    bundle = tmp_path / "model.tar"
    with tarfile.open(bundle, "w") as tar:
        tar.add(tiny_model_path, arcname="model.gguf")
        tar.add(tiny_model_path, arcname="again.gguf")
    with tarfile.open(bundle) as tar:
        member = tar.getmember("model.gguf")
    inner = load_model(bundle, offset=member.offset_data, size=member.size)
    whole = load_model(tiny_model_path)
    assert inner.config == whole.config and inner.vocab == whole.vocab
    assert inner.offset == member.offset_data and inner.size == member.size
    for name, t in whole.tensors.items():
        np.testing.assert_array_equal(inner.tensors[name].dequantize(), t.dequantize())


def test_mistral_architecture_runs_like_llama(tiny_model_path, tiny_model, tmp_path):
    mistral = load_model(rewrite_gguf(tiny_model_path, tmp_path / "m.gguf", arch="mistral"))
    assert mistral.config.arch == "mistral"
    tokens = [5, 9, 200, 3]
    np.testing.assert_array_equal(_all_logits(mistral, tokens), _all_logits(tiny_model, tokens))


def _all_logits(model, tokens):
    engine = CpuEngine(model)
    return engine.logits(engine.new_sequence(SamplingParams()), tokens)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(UsageError, match="not a file"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "empty"),
        (b"hello, I am a text file and not a model\n" * 10, "not a GGUF"),
        (b"GGUF", "truncated"),
    ],
)
def test_not_a_gguf_is_a_model_error(tmp_path, content, message):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ModelError, match=message):
        load_model(p)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_gguf_is_a_model_error(tiny_model_path, tmp_path, keep):
    data = tiny_model_path.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelError, match="truncated"):
        load_model(p)


def test_unsupported_architecture_is_a_model_error(tiny_model_path, tmp_path):
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(rewrite_gguf(tiny_model_path, tmp_path / "gpt2.gguf", arch="gpt2"))


def test_unsupported_quant_type_names_the_tensor(tiny_model_path, tmp_path):
    # IQ2_XXS: 66 bytes per 256 weights
    iq2 = ("IQ2_XXS", (512, 256), bytes(512 * 66))
    p = rewrite_gguf(tiny_model_path, tmp_path / "k.gguf", replace={"token_embd.weight": iq2})
    with pytest.raises(ModelError, match="tensor token_embd.weight has unsupported type IQ2_XXS"):
        load_model(p)


def test_mixed_type_model_loads_and_runs(tiny_model_path, tmp_path):
    """Every tensor its own type (the K-quant mixes are covered by the synthetic Q4_K_M models)."""
    rng = np.random.default_rng(5)

    def blocks(qtype, rows, cols, f16_offsets):
        t = QUANT_TYPES[qtype]
        raw = rng.integers(0, 256, (rows * cols // t.block, t.block_bytes), dtype=np.uint8)
        for off in f16_offsets:  # small finite scales
            raw[:, off : off + 2] = np.array([0x1400], dtype=np.float16).view(np.uint8)
        return qtype, (rows, cols), raw.tobytes()

    replace = {
        "blk.0.attn_k.weight": blocks("Q5_1", 32, 64, [0, 2]),
        "blk.0.attn_v.weight": blocks("Q5_0", 32, 64, [0]),
        "blk.1.ffn_up.weight": blocks("IQ4_NL", 192, 64, [0]),
    }
    model = load_model(rewrite_gguf(tiny_model_path, tmp_path / "mixed.gguf", replace=replace))
    assert model.quant_types == ["F32", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1"]
    assert np.isfinite(_all_logits(model, [1, 2, 3])).all()


def test_missing_tensor_is_a_model_error(tiny_model_path, tmp_path):
    p = rewrite_gguf(tiny_model_path, tmp_path / "drop.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ModelError, match="missing tensor blk.1.ffn_up.weight"):
        load_model(p)


def test_wrong_tensor_shape_is_a_model_error(tiny_model_path, tmp_path):
    wrong = ("F32", (64, 32), bytes(64 * 32 * 4))  # attn_k should be (2 KV heads * 16, 64) = (32, 64)
    p = rewrite_gguf(tiny_model_path, tmp_path / "shape.gguf", replace={"blk.0.attn_k.weight": wrong})
    with pytest.raises(ModelError, match="blk.0.attn_k.weight has shape"):
        load_model(p)


def test_model_without_metadata_is_a_model_error(tmp_path):
    p = tmp_path / "bare.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="missing metadata key llama.embedding_length"):
        load_model(p)


# --- the forward pass against an independent float64 reference -------------------------------------


# What each architecture adds to Llama, written here from the model code (transformers' modeling_gemma3.py and
# modeling_qwen3.py), independently of runtime/model/architectures.py.
_GEMMA3 = {
    "qk_norm": True,
    "post_norms": True,
    "gelu": True,
    "embed_scale": True,
    # HF layer_types: "sliding_attention" if (i + 1) % sliding_window_pattern else "full_attention"
    "sliding": lambda i: (i + 1) % 6 != 0,
    "local_theta": 10000.0,
}
_NAIVE_ARCH = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"qk_norm": True}, "gemma3": _GEMMA3}


def _naive_logits(model, tokens):
    """The model written out position by position and head by head in float64: rope as complex multiplication
    (Meta's reference) for adjacent pairs, rotate-half (HF) for NEOX; HF's Gemma 3 / Qwen 3 blocks."""
    c, W = model.config, (lambda n: model.tensors[n].dequantize().astype(np.float64))
    arch = _NAIVE_ARCH[c.arch]
    rd = c.rope_dim

    def rotate(v, pos, theta, scale=1.0):  # v [heads, hd]; linear scaling: positions / scale
        pos = pos / scale
        freqs = theta ** (-np.arange(0, rd, 2) / rd)
        if c.rope_freq_factors:
            freqs = freqs / np.array(c.rope_freq_factors)
        v = v.copy()
        if c.rope_neox:
            cos, sin = np.cos(pos * np.concatenate([freqs, freqs])), np.sin(pos * np.concatenate([freqs, freqs]))
            half = np.concatenate([-v[:, rd // 2 : rd], v[:, : rd // 2]], axis=1)
            v[:, :rd] = v[:, :rd] * cos + half * sin
        else:
            z = (v[:, 0:rd:2] + 1j * v[:, 1:rd:2]) * np.exp(1j * pos * freqs)
            v[:, 0:rd:2], v[:, 1:rd:2] = z.real, z.imag
        return v

    def norm(v, w):  # over the last axis (a vector, or [heads, hd] with a [hd] weight)
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + c.norm_eps) * w

    def act(g):
        if arch.get("gelu"):  # tanh approximation
            return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        return g / (1 + np.exp(-g))

    x = [W("token_embd.weight")[t] * (np.sqrt(c.dim) if arch.get("embed_scale") else 1.0) for t in tokens]
    for layer in range(c.n_layers):
        b = f"blk.{layer}."
        sliding = arch.get("sliding", lambda i: False)(layer) and c.sliding_window > 0
        theta = arch["local_theta"] if sliding else c.rope_theta
        scale = 1.0 if sliding else c.rope_scale  # HF: rope_scaling applies to the full-attention layers only
        keys, values = [], []
        for i in range(len(tokens)):
            h = norm(x[i], W(b + "attn_norm.weight"))
            q, k, v = W(b + "attn_q.weight") @ h, W(b + "attn_k.weight") @ h, W(b + "attn_v.weight") @ h
            if c.qkv_bias:
                q, k, v = q + W(b + "attn_q.bias"), k + W(b + "attn_k.bias"), v + W(b + "attn_v.bias")
            q, k = q.reshape(c.n_heads, c.head_dim), k.reshape(c.n_kv_heads, c.head_dim)
            if arch.get("qk_norm"):
                q, k = norm(q, W(b + "attn_q_norm.weight")), norm(k, W(b + "attn_k_norm.weight"))
            q = rotate(q, i, theta, scale)
            keys.append(rotate(k, i, theta, scale))
            values.append(v.reshape(c.n_kv_heads, c.head_dim))
            seen = [j for j in range(i + 1) if not sliding or j > i - c.sliding_window]  # HF's sliding overlay
            out = []
            for head in range(c.n_heads):
                g = head // (c.n_heads // c.n_kv_heads)
                s = np.array([q[head] @ keys[j][g] for j in seen]) / np.sqrt(c.head_dim)  # query_pre_attn_scalar
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                out.append(sum(p[n] * values[j][g] for n, j in enumerate(seen)))
            o = W(b + "attn_output.weight") @ np.concatenate(out)
            x[i] = x[i] + (norm(o, W(b + "post_attention_norm.weight")) if arch.get("post_norms") else o)
            h = norm(x[i], W(b + "ffn_norm.weight"))
            f = W(b + "ffn_down.weight") @ (act(W(b + "ffn_gate.weight") @ h) * (W(b + "ffn_up.weight") @ h))
            x[i] = x[i] + (norm(f, W(b + "post_ffw_norm.weight")) if arch.get("post_norms") else f)
    head = W("token_embd.weight" if c.tied_embeddings else "output.weight")
    return np.stack([head @ norm(v, W("output_norm.weight")) for v in x])


@pytest.mark.parametrize(
    "shape, qtype",
    [
        ("tiny", "Q4_1"),
        ("tiny", "Q8_0"),
        ("tiny-qwen2", "Q4_0"),
        ("tiny-llama3", "BF16"),
        ("tiny-llama3", "F16"),
        ("tiny-k", "Q4_K_M"),
        ("tiny-k", "Q2_K"),
        ("tiny-k", "Q3_K"),
        ("tiny-k", "IQ4_XS"),
        ("tiny-qwen3", "Q4_K_M"),
        ("tiny-qwen3", "Q5_K_M"),
        ("tiny-gemma3", "Q4_K_M"),
        ("tiny-gemma3", "Q5_0"),
    ],
)
def test_forward_matches_naive_float64_reference(synth_model, shape, qtype):
    model = load_model(synth_model(shape, qtype))
    tokens = [1, 300, 17, 42, 42, 511, 0, 256, 99, 7, 123]
    np.testing.assert_allclose(_all_logits(model, tokens), _naive_logits(model, tokens), atol=2e-4, rtol=1e-4)


def test_tiny_gemma3_is_a_gemma3_block(synth_model):
    """The synthetic Gemma 3 has what the real one has (layer 5 global, window of 4, head_dim != dim/heads), and the
    window matters: with it widened, the logits past the window change."""
    model = load_model(synth_model("tiny-gemma3", "Q4_K_M"))
    c = model.config
    assert [c.layer_window(i) for i in range(7)] == [4, 4, 4, 4, 4, 0, 4]
    assert [c.layer_rope(i)[0] for i in (0, 5)] == [10000.0, 1000000.0]
    assert (c.head_dim, c.dim // c.n_heads) == (128, 64) and c.attn_scale == pytest.approx(128**-0.5)
    assert {"Q4_K", "Q6_K"} <= set(model.quant_types)
    tokens = [1, 300, 17, 42, 42, 511, 0, 256]
    windowed = _all_logits(model, tokens)
    wide = dataclasses.replace(model, config=dataclasses.replace(c, sliding_window=64))
    full = _all_logits(wide, tokens)
    np.testing.assert_allclose(windowed[:4], full[:4], atol=1e-5)  # within the window: the same
    assert np.abs(windowed[4:] - full[4:]).max() > 1e-3


def test_linear_rope_scaling_applies_to_the_global_layers(synth_model, tmp_path):
    """Gemma 3 4B+ GGUFs carry rope.scaling.type linear, factor 8: global layers' positions / 8, local ones as is."""
    extra = {
        "gemma3.rope.scaling.type": ("linear", GGUFValueType.STRING),
        "gemma3.rope.scaling.factor": (8.0, GGUFValueType.FLOAT32),
    }
    model = load_model(rewrite_gguf(synth_model("tiny-gemma3", "Q5_0"), tmp_path / "scaled.gguf", extra=extra))
    c = model.config
    assert c.rope_scale == 8.0 and (c.layer_rope(5), c.layer_rope(0)) == ((1000000.0, 8.0), (10000.0, 1.0))
    tokens = [1, 300, 17, 42, 42, 511, 0]
    np.testing.assert_allclose(_all_logits(model, tokens), _naive_logits(model, tokens), atol=2e-4, rtol=1e-4)
    extra["gemma3.rope.scaling.type"] = ("yarn", GGUFValueType.STRING)
    with pytest.raises(ModelError, match="rope scaling 'yarn'"):
        load_model(rewrite_gguf(synth_model("tiny-gemma3", "Q5_0"), tmp_path / "yarn.gguf", extra=extra))


def test_softcapping_caps_scores_and_logits(synth_model):
    """Gemma 2-style tanh softcapping, when a GGUF sets it (Gemma 3 does not): cap * tanh(x / cap)."""
    model = load_model(synth_model("tiny-gemma3", "Q5_0"))

    def capped(**caps):
        return dataclasses.replace(model, config=dataclasses.replace(model.config, **caps))

    tokens = [1, 300, 17, 42]
    plain = _all_logits(model, tokens)
    np.testing.assert_allclose(_all_logits(capped(final_softcap=0.5), tokens), 0.5 * np.tanh(plain / 0.5), atol=1e-6)
    assert np.abs(_all_logits(capped(attn_softcap=0.01), tokens) - plain).max() > 1e-3


@pytest.mark.parametrize("shape, qtype", [("tiny", "Q4_1"), ("tiny-gemma3", "Q4_K_M"), ("tiny-qwen3", "Q4_K_M")])
def test_decoding_token_by_token_equals_prefill(synth_model, shape, qtype):
    model = load_model(synth_model(shape, qtype))
    tokens = [3, 77, 300, 12, 12, 5, 480, 64]  # twice tiny-gemma3's window
    whole = _all_logits(model, tokens)
    engine = CpuEngine(model)
    seq = engine.new_sequence(SamplingParams())
    steps = np.concatenate([engine.logits(seq, [t]) for t in tokens[:3]] + [engine.logits(seq, tokens[3:])])
    # The same fp32 sums in another order (numpy's matrix-vector kernels for one token, matrix-matrix for eight;
    # which ones depends on the CPU): tens of ulps of logits up to ~7 (an ulp there is 4.8e-7). 1e-5 held on one
    # CI machine and not on another (1.35e-5 on tiny-gemma3); 5e-5 is ~100 ulps, while on tiny-gemma3 a window one
    # too wide or positions shifted by one move logits by ~4.
    np.testing.assert_allclose(steps, whole, atol=5e-5)
    assert engine.seq_len(seq) == len(tokens)


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-qwen3"])
def test_greedy_generation_is_stable(synth_model, shape):
    """Greedy decoding past the sliding window gives the same tokens every time, batched or alone."""
    model = load_model(synth_model(shape, "Q4_K_M"))

    def greedy(engine, seq, prompt, n=12):
        out = [engine.prefill(seq, prompt)]
        for _ in range(n - 1):
            out += engine.decode([seq], [out[-1]])
        return out

    engine = CpuEngine(model, max_seqs=2)
    first = greedy(engine, engine.new_sequence(SamplingParams()), [1, 300, 17])
    again = greedy(engine, engine.new_sequence(SamplingParams()), [1, 300, 17])
    assert first == again and len(first) == 12
    # two sequences decoded in one batch (one further along than the other) give their solo tokens
    engine = CpuEngine(model, max_seqs=2)
    a, b = engine.new_sequence(SamplingParams()), engine.new_sequence(SamplingParams())
    ta, tb = [engine.prefill(a, [1, 300, 17])], [engine.prefill(b, [5, 6, 7, 8, 9, 10])]
    for _ in range(8):
        na, nb = engine.decode([a, b], [ta[-1], tb[-1]])
        ta.append(na)
        tb.append(nb)
    assert ta == first[:9]
    solo = CpuEngine(model)
    assert greedy(solo, solo.new_sequence(SamplingParams()), [5, 6, 7, 8, 9, 10], 9) == tb


def test_batched_decode_equals_separate_sequences(tiny_model):
    engine = CpuEngine(tiny_model, max_seqs=3)
    a, b = engine.new_sequence(SamplingParams()), engine.new_sequence(SamplingParams())
    next_a, next_b = engine.prefill(a, [5, 6, 7]), engine.prefill(b, [300, 301])
    batched = engine.decode([a, b], [next_a, next_b])
    for prompt, first, expect in (([5, 6, 7], next_a, batched[0]), ([300, 301], next_b, batched[1])):
        solo = CpuEngine(tiny_model)
        s = solo.new_sequence(SamplingParams())
        assert solo.prefill(s, prompt) == first
        assert solo.decode([s], [first]) == [expect]


def test_weights_dequantized_on_use_give_the_same_logits(tiny_model):
    tokens = [10, 20, 30, 40]
    cached = CpuEngine(tiny_model)
    streaming = CpuEngine(tiny_model, weight_cache_bytes=0)
    np.testing.assert_array_equal(
        streaming.logits(streaming.new_sequence(SamplingParams()), tokens),
        cached.logits(cached.new_sequence(SamplingParams()), tokens),
    )
    assert cached.weights.keep_all and not streaming.weights.keep_all
    assert all(w.ndim == 1 for w in streaming.weights._cache.values())


def test_engine_refuses_what_does_not_fit(tiny_model):
    engine = CpuEngine(tiny_model, max_seqs=1, max_ctx=8)
    seq = engine.new_sequence(SamplingParams())
    with pytest.raises(UsageError, match="do not fit the context of 8"):
        engine.prefill(seq, list(range(9)))
    assert engine.seq_len(seq) == 0  # refused before any work
    with pytest.raises(UsageError, match="out of range"):
        engine.prefill(seq, [512])
    with pytest.raises(Exception, match="all 1 sequences are in use"):
        engine.new_sequence(SamplingParams())
    engine.release(seq)
    engine.new_sequence(SamplingParams())


def test_unsupported_architecture_is_refused_by_name(tiny_model_path, tmp_path):
    p = rewrite_gguf(tiny_model_path, tmp_path / "phi3.gguf", arch="phi3")
    with pytest.raises(ModelError, match="unsupported architecture 'phi3'.*gemma3") as e:
        load_model(p)
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
