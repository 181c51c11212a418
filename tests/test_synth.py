"""`ingot model synth`: K-quant mixes as llama-quantize makes them, and files other GGUF readers (llama.cpp) load.

llama.cpp's source is not available here; the loader rules checked below are the ones its llama-model-loader,
llama-model (load_hparams / load_tensors) and llama-vocab apply, as known from that code:
  - `tokenizer.ggml.pre` must be a pre-tokenizer name it knows ("gpt2" is not: it calls GPT-2's "gpt-2"),
    else "error loading model vocabulary: unknown pre-tokenizer type";
  - a "gpt2" (byte-level BPE) vocabulary needs `tokenizer.ggml.merges`, and every one of the 256 GPT-2 byte
    symbols as a token (byte_to_token looks each up with .at(); the linefeed id is "Ċ");
  - one token_type per token; BOS/EOS ids inside the vocabulary; token_embd (and output) rows = the vocabulary;
  - the hyperparameters it reads without a default: <arch>.context_length, embedding_length, block_count,
    feed_forward_length, attention.head_count, attention.layer_norm_rms_epsilon, and for gemma3
    attention.sliding_window; attention.key_length/value_length when head_dim != dim / n_heads (its default);
  - exactly the tensors the architecture has ("wrong number of tensors" otherwise), each row a whole number of
    blocks of its type.
"""

import dataclasses

import gguf
import numpy as np
import pytest

from ingot.runtime.model.gguf import expected_shapes, load_model
from ingot.runtime.model.quants import QUANT_TYPES
from ingot.runtime.model.synth import SHAPES, _byte_symbols, config_of, tensor_type

# llama.cpp's pre-tokenizer names for byte-level BPE vocabularies (llama-vocab.cpp, load_pre), the ones it has had
# for a long time.
LLAMA_CPP_PRE = {
    "default", "llama3", "llama-v3", "llama-bpe", "deepseek-llm", "deepseek-coder", "falcon", "mpt", "starcoder",
    "gpt-2", "phi-2", "jina-es", "jina-de", "refact", "command-r", "qwen2", "stablelm2", "olmo", "dbrx", "smaug-bpe",
    "poro-chat", "chatglm-bpe", "viking", "jais", "tekken", "smollm", "codeshell", "bloom", "gpt3-finnish", "exaone",
    "chameleon", "minerva-7b", "megrez", "gpt-4o",
}  # fmt: skip
LLAMA_CPP_REQUIRED = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.layer_norm_rms_epsilon",
)
# The per-layer tensors llama.cpp's load_tensors creates for each architecture (biases optional for llama/qwen2).
LLAMA_CPP_BLOCK = {
    "llama": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
}
LLAMA_CPP_BLOCK["qwen2"] = LLAMA_CPP_BLOCK["llama"]
LLAMA_CPP_BLOCK["qwen3"] = LLAMA_CPP_BLOCK["llama"] + ["attn_q_norm", "attn_k_norm"]
LLAMA_CPP_BLOCK["gemma3"] = LLAMA_CPP_BLOCK["qwen3"] + ["post_attention_norm", "post_ffw_norm"]


def _value(r: gguf.GGUFReader, key: str):
    f = r.fields.get(key)
    return None if f is None else f.contents()


@pytest.mark.parametrize(
    "shape, quant",
    [
        ("tiny", "Q4_1"),
        ("tiny-qwen2", "Q8_0"),
        ("tiny-llama3", "F16"),
        ("tiny-qwen3", "Q4_K_M"),
        ("tiny-gemma3", "Q4_K_M"),
    ],
)
def test_synthetic_gguf_has_what_llama_cpp_requires(synth_model, shape, quant):
    r = gguf.GGUFReader(synth_model(shape, quant))
    arch = _value(r, "general.architecture")
    assert arch == SHAPES[shape].arch
    assert _value(r, "tokenizer.ggml.model") == "gpt2"
    assert _value(r, "tokenizer.ggml.pre") in LLAMA_CPP_PRE
    tokens = _value(r, "tokenizer.ggml.tokens")
    assert len(_value(r, "tokenizer.ggml.token_type")) == len(tokens) == _value(r, f"{arch}.vocab_size")
    assert set(_byte_symbols()) <= set(tokens) and "Ċ" in tokens
    known = set(tokens)
    for merge in _value(r, "tokenizer.ggml.merges"):
        left, right = merge.split(" ")
        assert left in known and right in known and left + right in known
    assert all(0 <= _value(r, f"tokenizer.ggml.{k}_token_id") < len(tokens) for k in ("bos", "eos"))
    for key in LLAMA_CPP_REQUIRED:
        assert _value(r, f"{arch}.{key}") is not None, key
    dim, heads = _value(r, f"{arch}.embedding_length"), _value(r, f"{arch}.attention.head_count")
    head_dim = _value(r, f"{arch}.attention.key_length") or dim // heads
    assert _value(r, f"{arch}.attention.value_length") in (None, head_dim)
    if arch == "gemma3":
        assert _value(r, f"{arch}.attention.sliding_window") == SHAPES[shape].sliding_window
    names = {t.name for t in r.tensors}
    expect = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not SHAPES[shape].tied else set())
    expect |= {"rope_freqs.weight"} if SHAPES[shape].llama3_rope_scaling else set()
    n_layers = _value(r, f"{arch}.block_count")
    expect |= {f"blk.{i}.{t}.weight" for i in range(n_layers) for t in LLAMA_CPP_BLOCK[arch]}
    expect |= {f"blk.{i}.attn_{x}.bias" for i in range(n_layers) for x in "qkv"} if SHAPES[shape].qkv_bias else set()
    assert names == expect
    for t in r.tensors:
        assert int(t.shape[0]) % QUANT_TYPES[t.tensor_type.name].block == 0, t.name  # ne0: whole blocks
        if t.name in ("token_embd.weight", "output.weight"):
            assert int(t.shape[1]) == len(tokens)


def test_q4_k_m_mix_of_llama3_8b_is_llama_quantizes():
    c = config_of(SHAPES["llama3-8b"])
    types = {n: tensor_type("Q4_K_M", n, s, c.n_layers, c.tied_embeddings) for n, s in expected_shapes(c).items()}
    more_bits = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # n/8 = 4: i < 4, i >= 28, (i - 4) % 3 == 2
    assert [i for i in range(32) if types[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more_bits
    assert [i for i in range(32) if types[f"blk.{i}.ffn_down.weight"] == "Q6_K"] == more_bits
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert {types[f"blk.7.{t}.weight"] for t in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")} == {"Q4_K"}
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_q4_k_m_mix_of_gemma3_270m_is_the_real_files(gemma3_model):
    """The synthetic gemma3-270m Q4_K_M has, tensor for tensor, the types of the real Q4_K_M file (640-wide rows
    fall back from Q4_K to Q5_0 and from Q6_K to Q8_0, as llama-quantize does)."""
    c = config_of(SHAPES["gemma3-270m"])
    real = gemma3_model.config
    assert dataclasses.replace(c, norm_eps=real.norm_eps) == real and c.norm_eps == pytest.approx(real.norm_eps)
    synth = {n: tensor_type("Q4_K_M", n, s, c.n_layers, c.tied_embeddings) for n, s in expected_shapes(c).items()}
    assert synth == {n: t.qtype for n, t in gemma3_model.tensors.items()}


def test_synth_cli_writes_a_k_quant_mix(ingot, tmp_path):
    out = tmp_path / "g.gguf"
    code, stdout, err = ingot("model", "synth", "--shape", "tiny-gemma3", "--quant", "Q4_K_M", "--out", out)
    assert code == 0, err
    model = load_model(out)
    assert model.config.arch == "gemma3" and model.quant_types == ["F32", "Q4_K", "Q6_K"]
    code, _, err = ingot("model", "synth", "--shape", "tiny", "--quant", "Q7_K", "--out", out)
    assert code == 2


def test_k_quant_weights_have_the_intended_scale(synth_model):
    model = load_model(synth_model("tiny-k", "Q4_K_M"))
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight"):
        w = model.tensors[name].dequantize()
        assert abs(w.std() * np.sqrt(w.shape[1]) - 1) < 0.15 and abs(w.mean()) < 0.1 * w.std(), name
