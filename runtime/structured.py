"""Constrained decoding: what a request asks the output to be (a JSON object, a JSON schema, a tool call) and
the token masks that keep a sequence inside it, computed by llguidance.

Two halves, split where the engine loop's process boundary runs:
  - `Constraint`: a serializable spec, kind + text (a JSON schema's text, a Lark grammar), built by the API
    dialects and carried by a job to the engine loop (a frozen dataclass of strings: it pickles and
    `to_json` round-trips).
  - `Grammars` (one per model: the llguidance tokenizer, built once from the GGUF vocabulary) and `Matcher`
    (one per constrained sequence, on the engine loop): `mask()` is the allowed-token bitmask for the next
    token, np.uint32 [ceil(V/32)] with bit (t % 32) of word t // 32 set when token t is allowed; `advance(t)`
    moves past a sampled token; `done` once the grammar is complete and nothing more may follow but the end
    of generation token.

Why llguidance (PERF.md, "Grammar engines"): an abi3 manylinux wheel with no dependencies (xgrammar's needs
torch, transformers and triton; it imports torch at import time), the fastest masks of the two we could
measure (a JSON schema compiles in 1 ms; outlines-core builds a whole-vocabulary index per schema: 0.3 s on
SmolLM2's 49,152 tokens, 4 s on Gemma's 262,144), and
JSON schemas plus Lark grammars (the tool-call formats) in one engine.

Token text for the engine is each token's bytes as the tokenizer spells them (tokenizer.token_bytes). Control
tokens (and user-defined ones that look like <...>, as llama.cpp treats them) are special: the grammar never
spells text with them, only names them (<tool_call> in a Lark grammar) or ends with the end-of-generation token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import llguidance
import numpy as np

from ingot.runtime.errors import UsageError
from ingot.runtime.model.tokenizer import CONTROL, END_OF_GENERATION_TEXTS, USER_DEFINED, Tokenizer

KINDS = ("json", "json_schema", "lark")  # json: any JSON object (OpenAI json_object, Ollama format "json")
SPECIAL_MARK = b"\xff"  # llguidance's prefix for a token that is never text

# llguidance's JSON compiler defaults: "whitespace_flexible": False keeps the output compact JSON (no runs of
# spaces a random-weight model could loop in until max_tokens); key order as the schema lists them.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "coerce_one_of": True}  # llguidance's JsonCompileOptions


@dataclass(frozen=True)
class Constraint:
    """What the output must be. kind "json": any JSON object; "json_schema": `text` is the schema's JSON;
    "lark": `text` is a Lark grammar (llguidance's dialect: %json {schema} embeds a JSON schema)."""

    kind: str
    text: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise UsageError(f"unknown constraint kind {self.kind!r}", hint=f"one of {', '.join(KINDS)}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Constraint:
        return cls(**json.loads(text))

    def grammar(self) -> str:
        """The llguidance grammar text."""
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.text, defaults=JSON_OPTIONS)
        return llguidance.LLMatcher.grammar_from_lark(self.text)


def json_schema(schema: dict) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))


def check(constraint: Constraint) -> str | None:
    """Why llguidance refuses the constraint (an unsupported schema keyword, a bad grammar), or None."""
    try:
        error = llguidance.LLMatcher.validate_grammar(constraint.grammar())
    except ValueError as e:  # grammar_from_json_schema: not a JSON object
        return str(e)
    return error or None


# --- tokens as bytes ------------------------------------------------------------------------------------


def grammar_tokens(tokenizer: Tokenizer) -> list[bytes]:
    """Each token's bytes as llguidance reads them: the text it spells (Tokenizer.token_bytes), or, for a
    control token and a user-defined one that looks like <...> (as llama.cpp treats them), SPECIAL_MARK + its
    name: the grammar never spells text with those."""
    out = []
    vocab = tokenizer.vocab
    for spelled, text, kind in zip(tokenizer.token_bytes, vocab.tokens, vocab.types, strict=True):
        special = kind == CONTROL or (kind == USER_DEFINED and text.startswith("<") and text.endswith(">"))
        out.append(SPECIAL_MARK + text.encode() if special else spelled)
    return out


class _Wrapper:
    """What llguidance.TokenizerWrapper reads: tokens as bytes, EOS/BOS, and an encoder (llguidance uses it
    only to tokenize grammar-forced text, which the engine loop does not do)."""

    def __init__(self, tokens: list[bytes], eos: int, bos: int | None, encode):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, bos
        self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(SPECIAL_MARK)]
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        return self._encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


def end_token(tokenizer: Tokenizer) -> int:
    """The token a complete constrained output ends with: the end-of-turn token the model's turns end with
    (<|im_end|>, <end_of_turn>, <|eot_id|>: the first of llama.cpp's list the vocabulary has), else its EOS."""
    vocab = tokenizer.vocab
    if vocab.eot_id is not None:
        return vocab.eot_id
    ends = {vocab.tokens[i]: i for i in tokenizer.eog_ids if i is not None}
    for text in END_OF_GENERATION_TEXTS:
        if text in ends:
            return ends[text]
    eos = tokenizer.eos_id
    if eos is None:
        raise UsageError("the model names no end-of-generation token, so its output cannot be constrained")
    return eos


class Grammars:
    """The model's llguidance tokenizer (built once: 0.4 s for SmolLM2's 49,152 tokens, 3 s for Gemma's
    262,144, on a loaded 2-core machine) and the matchers made with it. n_vocab is the logits width (the
    model's, which may exceed the vocabulary's: padded embedding rows are never allowed)."""

    def __init__(self, tokenizer: Tokenizer, n_vocab: int):
        vocab = tokenizer.vocab
        eos = end_token(tokenizer)
        tokens = grammar_tokens(tokenizer)
        tokens += [SPECIAL_MARK + f"<[pad {i}]>".encode() for i in range(len(tokens), n_vocab)]

        def encode(text: str) -> list[int]:  # grammar-forced text: no BOS, control-token names stay text
            return tokenizer.encode(text, add_special=False, parse_special=False)

        wrapper = llguidance.TokenizerWrapper(_Wrapper(tokens, eos, vocab.bos_id, encode))
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=n_vocab)
        self.n_vocab, self.eos = n_vocab, eos
        self.special = {t[1:].decode(errors="replace") for t in tokens if t.startswith(SPECIAL_MARK)}

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self, constraint)


class Matcher:
    """One constrained sequence's grammar state (lives on the engine loop, never crosses a process)."""

    def __init__(self, grammars: Grammars, constraint: Constraint):
        self._m = llguidance.LLMatcher(grammars.tokenizer, constraint.grammar(), log_level=0)
        if self._m.is_error():
            raise UsageError(f"the output constraint does not compile: {self._m.get_error()}")
        self.words = (grammars.n_vocab + 31) // 32
        self.eos = grammars.eos

    def mask(self) -> np.ndarray:
        """uint32 [ceil(V/32)]: the tokens allowed next (only EOS once the grammar is complete)."""
        out = np.zeros(self.words, dtype=np.uint32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def advance(self, token: int) -> None:
        """Move past a sampled token; a token the mask did not allow is a bug in the sampler."""
        if token == self.eos and self._m.is_accepting():
            self._m.consume_token(token)
            return
        if not self._m.consume_token(token):
            raise RuntimeError(f"token {token} is not allowed by the output constraint: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        return self._m.is_stopped()


def mask_of(tokens: Sequence[int], n_vocab: int) -> np.ndarray:
    """A bitmask row allowing exactly `tokens` (tests, forced tokens)."""
    bits = np.zeros(((n_vocab + 31) // 32) * 32, dtype=np.uint8)
    bits[list(tokens)] = 1
    return np.packbits(bits, bitorder="little").view(np.uint32)
