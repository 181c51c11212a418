"""Text <-> token ids, built from the vocabulary embedded in the GGUF with the HF `tokenizers` library, so that
it splits text the way llama.cpp does for the same file.

Two kinds of vocabulary:
  - "gpt2": byte-level BPE. The GGUF's `tokenizer.ggml.pre` names the pre-tokenizer; its regexes (copied from
    llama.cpp's llm_tokenizer_bpe, src/llama-vocab.cpp) run in sequence, each splitting the pieces of the one
    before, matches and the gaps between them both becoming pieces (HF's Split "isolated" behaviour, which is
    also what llama.cpp does). Then the GPT-2 byte-to-unicode mapping and the BPE merges.
  - "llama": SentencePiece-style, scored pieces. llama.cpp merges, left to right, the adjacent pair whose
    joined text is the highest-scored piece; that is BPE whose merge ranks follow the joined piece's score
    (how HF converts these vocabularies too). Unknown bytes fall back to <0xXX> tokens; a space is
    prepended to each run of text (also after a special token, as llama.cpp does) when add_space_prefix.

Control tokens (token_type 3) are special: recognized in text only with parse_special, never printed.
User-defined tokens (type 4) are always recognized.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ingot.runtime.errors import ModelError
from ingot.runtime.model.gguf import Model, Vocab

CONTROL, USER_DEFINED, BYTE = 3, 4, 6  # gguf.TokenType values

# llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre` name.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt2": [_GPT2],  # what Ingot's synthetic models were written with before they said "smollm"
    "gpt-2": [_GPT2],  # llama.cpp's name for it
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "stablelm2": [_QWEN2],
}
IGNORE_MERGES = ("llama-bpe", "llama3")  # Llama 3 takes a whole piece that is in the vocabulary as one token

# Tokens that end a turn or a text even when the GGUF does not name them as EOS/EOT (llama.cpp's list).
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
)


class Tokenizer:
    def __init__(self, vocab: Vocab):
        try:
            self._build(vocab)
        except ModelError:
            raise
        except Exception as e:  # tokenizers raises its own exception types on an unusable vocabulary
            raise ModelError(f"the model's tokenizer vocabulary is unusable ({type(e).__name__}: {e})") from None

    def _build(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.n_vocab = len(vocab.tokens)
        self.bos_id, self.eos_id = vocab.bos_id, vocab.eos_id
        if vocab.model == "gpt2":
            self._hf = _byte_level_bpe(vocab)
        elif vocab.model == "llama":
            self._hf = _sentencepiece_bpe(vocab)
        else:
            raise ModelError(f"unsupported tokenizer model {vocab.model!r}", hint="supported: gpt2, llama")
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.types, strict=False)
            if kind == CONTROL
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(vocab.tokens, vocab.types, strict=False)
            if kind == USER_DEFINED
        ]
        self._hf.add_special_tokens(control)
        self._hf.add_tokens(user)
        named = {vocab.eos_id, vocab.eot_id, vocab.eom_id} - {None}
        self.eog_ids = frozenset(named | {i for i, t in enumerate(vocab.tokens) if t in END_OF_GENERATION_TEXTS})
        self._lock = threading.Lock()  # encode flips a flag on the shared HF tokenizer (the server has threads)

    @classmethod
    def from_model(cls, model: Model) -> Tokenizer:
        return cls(model.vocab)

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """add_special: add BOS/EOS as the model's add_bos/add_eos flags say. parse_special: control-token text
        such as "<|im_start|>" in `text` becomes that token (off: it is tokenized as plain text)."""
        with self._lock:
            self._hf.encode_special_tokens = not parse_special
            ids = self._hf.encode(text, add_special_tokens=False).ids
        if add_special and self.vocab.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_special and self.vocab.add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of the ids, control tokens left out. A UTF-8 character cut at the end shows as U+FFFD."""
        return self._hf.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """The vocabulary entry, as stored (e.g. "Ġthe" for byte-level BPE)."""
        return self.vocab.tokens[token]

    @functools.cached_property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes as generated text (the module's token_bytes of the vocabulary), built on first use:
        ~50 ms for SmolLM2's 49,152 tokens, ~0.3 s for Gemma 3's 262,144 (a server builds it when it loads)."""
        return token_bytes(self.vocab)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: printable bytes stand for themselves, the rest are shifted to
    256 + n in the order they appear."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def token_bytes(vocab: Vocab) -> list[bytes]:
    """Each token's bytes in generated text, as decode() spells a run of tokens (the way llama.cpp spells
    them): byte-level BPE through GPT-2's byte-to-unicode map, SentencePiece "▁" as a space and <0xXX> pieces as
    bytes, user-defined tokens as their text; control tokens are never printed (b""). decode(ids) is the UTF-8
    text of the joined bytes (invalid sequences as U+FFFD), except that a SentencePiece decode drops the
    space its first token starts with (IncrementalDecoder never decodes from a text's start)."""
    decoder = _byte_decoder()
    out = []
    for text, kind in zip(vocab.tokens, vocab.types, strict=True):
        if kind == CONTROL:
            out.append(b"")
        elif kind == USER_DEFINED:
            out.append(text.encode())
        elif vocab.model == "gpt2":
            out.append(bytes(decoder[c] for c in text) if all(c in decoder for c in text) else text.encode())
        elif kind == BYTE and len(text) == 6 and text.startswith("<0x"):
            out.append(bytes([int(text[3:5], 16)]))
        else:
            out.append(text.replace("\u2581", " ").encode())
    return out


def _vocab_ids(vocab: Vocab) -> dict[str, int]:
    ids: dict[str, int] = {}
    for i, t in enumerate(vocab.tokens):
        ids.setdefault(t, i)  # a few vocabularies repeat a string; the first id wins, as in llama.cpp
    return ids


def _byte_level_bpe(vocab: Vocab) -> HFTokenizer:
    regexes = PRE_TOKENIZERS.get(vocab.pre)
    if regexes is None:
        raise ModelError(
            f"unsupported pre-tokenizer {vocab.pre!r} (tokenizer.ggml.pre)",
            hint=f"supported: {', '.join(PRE_TOKENIZERS)}",
        )
    if not vocab.merges:
        raise ModelError("byte-level BPE vocabulary without merges (tokenizer.ggml.merges)")
    pairs = [m.split(" ", 1) for m in vocab.merges]
    bad = next((m for m in pairs if len(m) != 2 or not all(m)), None)
    if bad is not None:
        raise ModelError(f"tokenizer.ggml.merges holds {' '.join(bad)[:40]!r}, not 'left right'")
    merges = [(a, b) for a, b in pairs]
    tok = HFTokenizer(models.BPE(_vocab_ids(vocab), merges, ignore_merges=vocab.pre in IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(vocab: Vocab) -> HFTokenizer:
    if vocab.scores is None:
        raise ModelError("SentencePiece vocabulary without scores (tokenizer.ggml.scores)")
    ids = _vocab_ids(vocab)
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    tok = HFTokenizer(
        models.BPE(ids, _merges_from_scores(ids, vocab.scores), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    spaces = [normalizers.Replace(" ", "\u2581")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if vocab.add_space_prefix else []) + spaces)
    strip = [decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()] + strip)
    return tok


def _merges_from_scores(ids: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces is a merge, ranked by the joined piece's score (best first)."""
    merges = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in ids and right in ids:
                merges.append((-scores[i], ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]
