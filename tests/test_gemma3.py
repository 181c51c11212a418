"""The real Gemma 3 270M (Q4_K_M mix) on the CPU reference engine: what its GGUF says, its K-quant tensors, its
SentencePiece tokenizer, greedy text and perplexity. Skipped unless `ingot model fetch gemma3-270m` has cached it
(or $INGOT_TEST_GEMMA3 points at it)."""

import heapq
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.generate import generate
from ingot.runtime.perplexity import perplexity

GPL3 = Path("/usr/share/common-licenses/GPL-3")
PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of France. It is "
    "located on the Seine river, in the north of the country. The city has been one of the world's major centres "
    "of finance, diplomacy, commerce, culture, fashion and gastronomy for centuries."
)


def test_gemma3_config_is_what_its_gguf_and_transformers_say(gemma3_model):
    c = gemma3_model.config
    # gemma3.* keys of the file; head_dim 256 != 640 / 4; no rope.dimension_count (all 256 dims rotate)
    assert (c.arch, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim) == (
        "gemma3",
        18,
        640,
        4,
        1,
        256,
        2048,
    )
    assert (c.n_vocab, c.n_ctx_train, c.rope_dim, c.sliding_window) == (262144, 32768, 256, 512)
    assert c.norm_eps == pytest.approx(1e-6) and c.tied_embeddings and not c.qkv_bias and c.rope_neox
    # 1/sqrt(query_pre_attn_scalar = 256); global layers 5, 11, 17 at base 1e6, the rest local at 1e4
    assert c.attn_scale == pytest.approx(1 / 16)
    assert [i for i in range(18) if c.layer_window(i) == 0] == [5, 11, 17]
    assert {c.layer_rope(i) for i in range(18)} == {(10000.0, 1.0), (1000000.0, 1.0)}
    assert (c.attn_softcap, c.final_softcap) == (0.0, 0.0)  # Gemma 3 has none (Gemma 2 had 50 / 30)
    assert gemma3_model.quant_types == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert gemma3_model.n_tensors == 2 + 13 * 18
    assert gemma3_model.vocab.chat_template is None  # the base model's GGUF has none: templates.py's Gemma one


def test_gemma3_k_quant_tensors_match_gguf_reference(gemma3_model):
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.2.ffn_down.weight", "blk.0.attn_q.weight"):
        t = gemma3_model.tensors[name]
        ref = gguf_dequantize(t.raw, GGMLQuantizationType[t.qtype]).reshape(t.shape)
        np.testing.assert_array_equal(t.dequantize(), ref)
    assert {gemma3_model.tensors[n].qtype for n in ("blk.0.ffn_down.weight", "blk.2.ffn_down.weight")} == {
        "Q6_K",
        "Q4_K",
    }


def test_gemma3_tokenizer_is_sentencepiece_with_byte_fallback(gemma3_tokenizer):
    tok = gemma3_tokenizer
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]  # <bos> The ▁capital ▁of ...
    assert tok.encode("Hello world", add_special=False) == [9259, 1902]
    text = "naïve café 東京 🙂\nline\n\n  two"
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text and 107 in ids and 108 in ids  # "\n", "\n\n" are user-defined tokens
    unknown = "\U000e0001\u0378"  # characters with no piece fall back to their UTF-8 bytes, <0xXX> tokens
    ids = tok.encode(unknown, add_special=False)
    assert all(tok.token_text(i).startswith("<0x") for i in ids) and tok.decode(ids) == unknown
    assert tok.eog_ids == {1, 106}  # <eos>, <end_of_turn>


@pytest.mark.slow
def test_gemma3_greedy_generation(gemma3_model, gemma3_tokenizer):
    engine = CpuEngine(gemma3_model, max_seqs=1, max_ctx=64)
    ids = gemma3_tokenizer.encode("The capital of France is")
    text = "".join(c.text for c in generate(engine, gemma3_tokenizer, ids, max_tokens=8))
    assert text == " the capital of the country of France."


class _WithoutPlusOne:
    """The engine's weights with 1 taken off every norm weight: transformers' raw Gemma3RMSNorm values."""

    def __init__(self, weights):
        self.weights = weights

    def __getitem__(self, name):
        w = self.weights[name]
        return w - 1 if name.endswith("norm.weight") else w

    def embed(self, tokens):
        return self.weights.embed(tokens)


@pytest.mark.slow
def test_gemma3_perplexity_on_a_short_text(gemma3_model, gemma3_tokenizer):
    """llama.cpp's converter stores Gemma's norm weights as (1 + w), the factor transformers' Gemma3RMSNorm
    applies, so they are used as stored: that scores a plain English paragraph well; without the +1 it is noise."""
    tokens = gemma3_tokenizer.encode(PARAGRAPH)  # 64 tokens: two chunks of 32, each second half scored
    engine = CpuEngine(gemma3_model, max_seqs=1, max_ctx=32)
    r = perplexity(engine, tokens, n_ctx=32, bos_id=2)
    assert r.n_chunks == 2 and 3 < r.ppl < 30
    engine.weights = _WithoutPlusOne(engine.weights)
    assert perplexity(engine, tokens, n_ctx=32, bos_id=2).ppl > 1000


def _llama_cpp_spm(vocab, specials: list[str], ids: dict[str, int], text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm), written out from its algorithm: first the
    special-token partition (user-defined tokens always, control tokens too since specials are parsed; longest
    first), then each fragment by _spm_fragment."""
    fragments = [(False, text)]
    for sp in specials:  # longest first
        if sp not in text:
            continue
        split = []
        for special, f in fragments:
            if special or sp not in f:
                split.append((special, f))
                continue
            for j, part in enumerate(f.split(sp)):
                split += ([(True, sp)] if j else []) + ([(False, part)] if part else [])
        fragments = split
    out: list[int] = []
    for special, frag in fragments:
        out += [ids[frag]] if special else _spm_fragment(vocab.scores, ids, frag)
    return out


def _spm_fragment(scores, ids: dict[str, int], frag: str) -> list[int]:
    """Spaces -> U+2581 (no prefix: Gemma's add_space_prefix is false), one symbol per character, repeatedly merge
    the adjacent pair whose joined text is the best-scored piece (leftmost on ties), then resegment each symbol:
    a piece, else the two parts it was merged from, else its UTF-8 bytes as <0xXX> tokens."""
    sym = list(frag.replace(" ", "\u2581"))
    nxt, prv = [*range(1, len(sym)), -1], list(range(-1, len(sym) - 1))
    heap: list = []
    parts: dict[str, tuple[str, str]] = {}

    def bigram(left, right):
        if left != -1 and right != -1 and (sym[left] + sym[right]) in ids:
            joined = sym[left] + sym[right]
            heapq.heappush(heap, (-scores[ids[joined]], left, joined, right))
            parts[joined] = (sym[left], sym[right])

    for i in range(1, len(sym)):
        bigram(i - 1, i)
    while heap:
        _, left, joined, right = heapq.heappop(heap)
        if nxt[left] != right or sym[left] + sym[right] != joined or not sym[left] or not sym[right]:
            continue  # stale: one side has merged since
        sym[left], sym[right] = joined, ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])

    out: list[int] = []

    def resegment(piece):
        if piece in ids:
            out.append(ids[piece])
        elif piece in parts:
            resegment(parts[piece][0])
            resegment(parts[piece][1])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in piece.encode())

    i = 0 if sym else -1
    while i != -1:
        resegment(sym[i])
        i = nxt[i]
    return out


@pytest.mark.skipif(not GPL3.is_file(), reason="needs /usr/share/common-licenses/GPL-3")
def test_gemma3_tokenizer_agrees_with_llama_cpps_spm_algorithm(gemma3_model, gemma3_tokenizer):
    paragraphs = [p for p in GPL3.read_text().split("\n\n") if p.strip()]
    samples = paragraphs + [
        "naïve café 東京 🙂\nline\n\n  two",
        "\U000e0001\u0378 x",
        "   leading spaces",
        "tabs\tand\t\ttabs",
        "<start_of_turn>user\nHi<end_of_turn>\n",
        "1234567890 3.14159",
        "don't can't won't",
        "Hello, World! HELLO world.",
    ]
    v = gemma3_model.vocab
    ids: dict[str, int] = {}
    for i, t in enumerate(v.tokens):
        ids.setdefault(t, i)
    specials = sorted((t for t, kind in zip(v.tokens, v.types, strict=True) if kind in (3, 4)), key=len, reverse=True)
    for text in samples:
        assert gemma3_tokenizer.encode(text, add_special=False) == _llama_cpp_spm(v, specials, ids, text), text
