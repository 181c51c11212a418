"""Tokenizers built from GGUF vocabularies: SmolLM2's byte-level BPE against an HF reference pipeline, the
pre-tokenizer table, special tokens, and SentencePiece-style vocabularies against llama.cpp's algorithm."""

import dataclasses

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from ingot.runtime.errors import ModelError
from ingot.runtime.model.gguf import Vocab
from ingot.runtime.model.synth import vocabulary
from ingot.runtime.model.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "  Two  spaces,\ttabs\nand\n\n\nnewlines   at the end   ",
    "Numbers: 3.14159, 2024-06-01, 1,000,000 and x^2+y^2=z^2!",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, Ελληνικά, emoji 🎉🤖 and ZWJ 👩‍💻.",
    "I'm sure they'll say we've done it, isn't it? DON'T SHOUT.",
    "def f(x):\n    return {'a': [1, 2]}  # code\n",
]


# --- SmolLM2 (real vocabulary) ---------------------------------------------------------------------


def _hf_reference(vocab: Vocab) -> HFTokenizer:
    """How SmolLM2's own tokenizer.json is built: Digits(individual) then ByteLevel with GPT-2's regex."""
    tok = HFTokenizer(
        models.BPE({t: i for i, t in enumerate(vocab.tokens)}, [tuple(m.split(" ", 1)) for m in vocab.merges])
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return tok


def test_smollm2_matches_hf_reference_pipeline(real_model, real_tokenizer):
    ref = _hf_reference(real_model.vocab)
    gpl = "\n".join(TEXTS) * 3
    for text in TEXTS + [gpl]:
        assert real_tokenizer.encode(text, parse_special=False) == ref.encode(text).ids, text


def test_smollm2_round_trips_text(real_tokenizer):
    for text in TEXTS:
        assert real_tokenizer.decode(real_tokenizer.encode(text)) == text


def test_smollm2_special_tokens(real_model, real_tokenizer):
    tok = real_tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    plain = tok.encode("<|im_start|>", parse_special=False)
    assert 1 not in plain and len(plain) > 1 and tok.decode(plain) == "<|im_start|>"
    assert tok.decode([1, 2, 0]) == ""  # control tokens are never printed
    assert not real_model.vocab.add_bos  # SmolLM2 adds no BOS ...
    assert tok.encode("Hello")[0] != tok.bos_id  # ... so none is added
    assert {0, 2} <= tok.eog_ids and 1 not in tok.eog_ids


def test_smollm2_splits_digits_one_by_one(real_tokenizer):
    ids = real_tokenizer.encode("12345")
    assert [real_tokenizer.token_text(i) for i in ids] == ["1", "2", "3", "4", "5"]


# --- the pre-tokenizer table (synthetic byte-level vocabulary) ---------------------------------------


def _byte_vocab(pre: str) -> Vocab:
    tokens, types, merges = vocabulary(512)
    return Vocab(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        types=types,
        scores=None,
        merges=merges,
        bos_id=1,
        eos_id=2,
        eot_id=None,
        eom_id=None,
        unk_id=None,
        add_bos=False,
        add_eos=False,
        add_space_prefix=False,
        chat_template=None,
    )


@pytest.mark.parametrize(
    "pre, text, pieces",
    [
        # llama.cpp's smollm: every digit alone, then GPT-2's regex
        ("smollm", "I'm 25 years", ["I", "'m", "Ġ", "2", "5", "Ġyears"]),
        # gpt2: digit runs stay together with their leading space
        ("gpt2", "I'm 25 years", ["I", "'m", "Ġ25", "Ġyears"]),
        # Llama 3: digits in groups of up to three, a letter run takes one leading non-letter
        ("llama-bpe", "I'm 12345 ok", ["I", "'m", "Ġ", "123", "45", "Ġok"]),
        # Qwen2: like Llama 3 with single digits
        ("qwen2", "I'm 123 ok", ["I", "'m", "Ġ", "1", "2", "3", "Ġok"]),
        # llama.cpp's default: punctuation runs isolated first
        ("default", "I'm 25", ["I", "'", "m", "Ġ", "25"]),
    ],
)
def test_pre_tokenizer_splits_like_llama_cpp(pre, text, pieces):
    tok = Tokenizer(_byte_vocab(pre))
    assert [p for p, _ in tok._hf.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tok.decode(tok.encode(text)) == text


def test_synthetic_vocabulary_spells_words(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello world, the capital of France")
    assert [tiny_tokenizer.token_text(i) for i in ids][-6:] == ["Ġworld", ",", "Ġthe", "Ġcapital", "Ġof", "ĠFrance"]


def test_unsupported_tokenizers_are_model_errors():
    with pytest.raises(ModelError, match="unsupported pre-tokenizer 'tekken'"):
        Tokenizer(_byte_vocab("tekken"))
    with pytest.raises(ModelError, match="unsupported tokenizer model 'bert'"):
        Tokenizer(dataclasses.replace(_byte_vocab("gpt2"), model="bert"))


# --- SentencePiece-style ("llama") vocabularies -----------------------------------------------------

WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "and", "hat", "that", "at", "he", "lo"]


def _spm_vocab(seed: int) -> Vocab:
    # Like a real SentencePiece model, every character of every piece is itself a piece.
    pieces = set("\u2581" + "".join(WORDS))
    for w in WORDS:
        for word in ("\u2581" + w, w):
            pieces.update(word[:i] for i in range(1, len(word) + 1))
    pieces = sorted(pieces)
    scores = np.random.default_rng(seed).permutation(len(pieces)).astype(float) * -1.0  # distinct scores
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return Vocab(
        model="llama",
        pre="default",
        tokens=tokens,
        types=types,
        scores=[0.0] * 259 + list(scores),
        merges=None,
        bos_id=1,
        eos_id=2,
        eot_id=None,
        eom_id=None,
        unk_id=0,
        add_bos=True,
        add_eos=False,
        add_space_prefix=True,
        chat_template=None,
    )


def _llama_cpp_spm(vocab: Vocab, text: str) -> list[int]:
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm_session): add BOS; split at special tokens; prefix each text
    fragment with a space; repeatedly merge the adjacent pair whose joined text is the highest-scored token
    (leftmost on ties); spell symbols that are not tokens as <0xXX> byte tokens."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    out = [vocab.bos_id]
    fragments = text.split("<s>")
    for n, fragment in enumerate(fragments):
        if fragment:
            symbols = list((" " + fragment).replace(" ", "\u2581"))
            while True:
                adjacent = zip(symbols, symbols[1:], strict=False)
                pairs = [(vocab.scores[ids[a + b]], -i) for i, (a, b) in enumerate(adjacent) if a + b in ids]
                if not pairs:
                    break
                i = -max(pairs)[1]
                symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
            for s in symbols:
                out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
        if n < len(fragments) - 1:
            out.append(vocab.bos_id)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sentencepiece_vocabulary_tokenizes_like_llama_cpp(seed):
    vocab = _spm_vocab(seed)
    tok = Tokenizer(vocab)
    for text in [
        "the cat sat on the mat",
        "hello world",
        "thatcat  hat",
        "héllo\nwörld 🎉",
        "at<s>the mat",
        "lo lo lo helo",
    ]:
        assert tok.encode(text) == _llama_cpp_spm(vocab, text), text


def test_sentencepiece_vocabulary_round_trips():
    tok = Tokenizer(_spm_vocab(0))
    for text in ["the cat sat", "héllo\nwörld 🎉", "  two leading spaces"]:
        ids = tok.encode(text)
        assert ids[0] == 1 and tok.decode(ids) == text
