"""Random-weight GGUFs of named shapes (any architecture in architectures.py), for tests and benchmarks
(`ingot model synth`).

Quantized weights are generated directly as blocks (random nibbles or int8 values plus fp16 scales chosen so
the dequantized weights have std ~ 1/sqrt(fan_in)), not by quantizing floats: an 8B model takes seconds to
generate, the rest is disk speed. Norm weights are ~1.0. Tensors are written one at a time (GGUFWriter's
header / KV / tensor-info / data steps), so memory stays at one tensor, and the file appears atomically.

The matrices are all of one type (`--quant Q4_K`) or follow llama.cpp's mixes (llama_tensor_get_type in
llama-quant.cpp): Q4_K_M / Q5_K_M are Q4_K / Q5_K with Q6_K for the output head (token_embd when tied) and for
attn_v and ffn_down in the "more bits" layers (the first and last eighth, and every third between). A
K-quant needs rows of a multiple of 256 weights; other rows fall back as llama-quantize does (Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0, IQ4_XS -> IQ4_NL).

Each model carries a small byte-level BPE tokenizer (the 256 byte tokens, merges that spell a few hundred
common English words, ChatML special tokens, reserved control tokens up to the vocabulary size) and a ChatML
chat template, so `ingot run` and the server work on it like on a real model. Its `tokenizer.ggml.pre` is
"smollm": the vocabulary is laid out like SmolLM2's (ChatML specials at ids 0-2) and llama.cpp's smollm
pre-tokenizer (digits isolated, then GPT-2's regex) splits it exactly as Ingot's does, so llama.cpp loads the
file (it refuses names it does not know, e.g. "gpt2"; its GPT-2 pre-tokenizer is called "gpt-2").
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ingot.runtime.errors import UsageError

if TYPE_CHECKING:
    from gguf import GGUFWriter

from ingot.runtime.model.architectures import ARCHITECTURES
from ingot.runtime.model.gguf import Config, expected_shapes
from ingot.runtime.model.quants import QUANT_TYPES, dequantize
from ingot.runtime.model.templates import TOOL_TEMPLATES


@dataclass(frozen=True)
class Shape:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    n_vocab: int
    n_ctx: int
    rope_theta: float
    tied: bool
    qkv_bias: bool = False
    llama3_rope_scaling: bool = False  # write a rope_freqs.weight tensor as Llama 3.1 GGUFs have
    head_dim: int = 0  # 0: dim // n_heads
    sliding_window: int = 0  # for architectures with local layers (gemma3)
    norm_eps: float = 1e-5


SHAPES = {
    "tiny": Shape("llama", 64, 2, 4, 2, 192, 512, 256, 10000.0, tied=True),
    # tiny with a 4,096-token context: a tool list rendered by a tool-calling template fits its prompt
    "tiny-4k": Shape("llama", 64, 2, 4, 2, 192, 512, 4096, 10000.0, tied=True),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 192, 512, 256, 1000000.0, tied=False, qkv_bias=True),
    "tiny-llama3": Shape("llama", 64, 2, 4, 1, 192, 512, 256, 500000.0, tied=False, llama3_rope_scaling=True),
    # K-quant-sized tiny shapes (rows of 256 or 512 weights); head_dim != dim / n_heads as in the real ones.
    "tiny-k": Shape("llama", 256, 2, 4, 2, 512, 512, 256, 10000.0, tied=False),
    "tiny-qwen3": Shape("qwen3", 256, 2, 4, 2, 512, 512, 256, 1000000.0, tied=False, head_dim=128, norm_eps=1e-6),
    # 7 layers: 0-4 local, 5 global, 6 local; a window of 4 positions
    "tiny-gemma3": Shape(
        "gemma3", 256, 7, 4, 1, 512, 512, 256, 1000000.0, tied=True, head_dim=128, sliding_window=4, norm_eps=1e-6
    ),
    "smollm2-135m": Shape("llama", 576, 30, 9, 3, 1536, 49152, 8192, 100000.0, tied=True),
    "gemma3-270m": Shape(
        "gemma3",
        640,
        18,
        4,
        1,
        2048,
        262144,
        32768,
        1000000.0,
        tied=True,
        head_dim=256,
        sliding_window=512,
        norm_eps=1e-6,
    ),
    "qwen3-0.6b": Shape(
        "qwen3", 1024, 28, 16, 8, 3072, 151936, 40960, 1000000.0, tied=True, head_dim=128, norm_eps=1e-6
    ),
    "llama3-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, 8192, 500000.0, tied=False),
}

# llama.cpp's K-quant mixes: base type, and the type of the output head and of the "more bits" attn_v/ffn_down.
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K")}
# What llama-quantize writes instead of a K-quant for rows that are not a multiple of 256 weights.
K_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
QUANTS = (*QUANT_TYPES, *MIXES)  # what --quant accepts


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(quant: str, name: str, shape: tuple[int, ...], n_layers: int, tied: bool) -> str:
    """The type a tensor gets under `quant` (a type or a mix): vectors stay F32."""
    if len(shape) == 1:
        return "F32"
    qtype = quant
    if quant in MIXES:
        base, more = MIXES[quant]
        head = "token_embd.weight" if tied else "output.weight"
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        more_bits = name.endswith(("attn_v.weight", "ffn_down.weight")) and _more_bits(layer, n_layers)
        qtype = more if name == head or more_bits else base
    if shape[-1] % QUANT_TYPES[qtype].block:
        qtype = K_FALLBACK.get(qtype, "F16")
    return qtype


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (BOS), 2 (EOS), as in SmolLM2
WORDS = """the of and to in is that it for was on are as with be at by this have from or an they which one you had
not but what all were when we there can your said each she do how their if will up other about out many then them
these so some her would make like him into time has look two more write go see number no way could people my than
first water been call who oil its now find long down day did get come made may part capital France Paris answer
hello world model token text question four five six seven eight nine ten yes name city country language""".split()


def config_of(shape: Shape) -> Config:
    a = ARCHITECTURES[shape.arch]
    head_dim = shape.head_dim or shape.dim // shape.n_heads
    window = shape.sliding_window if a.swa_pattern else 0
    return Config(
        arch=shape.arch,
        n_vocab=shape.n_vocab,
        n_ctx_train=shape.n_ctx,
        dim=shape.dim,
        n_layers=shape.n_layers,
        n_heads=shape.n_heads,
        n_kv_heads=shape.n_kv_heads,
        head_dim=head_dim,
        ffn_dim=shape.ffn_dim,
        norm_eps=shape.norm_eps,
        rope_theta=shape.rope_theta,
        rope_dim=head_dim,
        rope_neox=a.rope_neox,
        rope_freq_factors=llama3_freq_factors(head_dim, shape.rope_theta) if shape.llama3_rope_scaling else None,
        qkv_bias=shape.qkv_bias,
        tied_embeddings=shape.tied,
        attn_scale=a.attn_scale(shape.n_layers, shape.dim, shape.n_heads, head_dim),
        sliding_window=window,
        rope_theta_local=(a.local_rope_theta or 0.0) if window else 0.0,
    )


def llama3_freq_factors(
    rope_dim: int, theta: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0, original_ctx: int = 8192
) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as its GGUF converter writes it: long wavelengths slowed by `factor`, short
    ones kept, a smooth blend between."""
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rope_dim)
        if wavelen < original_ctx / high:
            out.append(1.0)
        elif wavelen > original_ctx / low:
            out.append(factor)
        else:
            smooth = (original_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return tuple(out)


# --- the tokenizer ---------------------------------------------------------------------------------


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable unicode character mapping, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def vocabulary(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the synthetic byte-level BPE vocabulary."""
    sym = _byte_symbols()
    tokens = list(SPECIAL_TOKENS) + sym
    known, merges = set(tokens), list[str]()
    budget = n_vocab - len(tokens)
    for word in WORDS:
        # Spell " word" left to right: "Ġ w" -> "Ġw", "Ġw o" -> "Ġwo", ...
        chars = [sym[b] for b in (" " + word).encode()]
        piece = chars[0]
        for c in chars[1:]:
            if len(merges) == budget:
                break
            if piece + c not in known:
                merges.append(f"{piece} {c}")
                tokens.append(piece + c)
                known.add(piece + c)
            piece += c
    tokens += [f"<|reserved_{i}|>" for i in range(n_vocab - len(tokens))]
    types = [3 if t in SPECIAL_TOKENS or t.startswith("<|reserved_") else 1 for t in tokens]
    return tokens, types, merges


# --- weights ---------------------------------------------------------------------------------------


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, row_bytes] uint8 of `qtype` whose dequantized values have std ~`std` and mean ~0 (Q4_0's
    x = d * (q - 8) keeps a small offset of -d/2: its nibbles cannot be centred)."""
    t = QUANT_TYPES[qtype]
    if qtype in _SCALE_FIELDS:
        return _random_blocks_measured(rng, qtype, rows, cols, std)
    if t.block == 1:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)
        if qtype == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.astype(np.float16 if qtype == "F16" else np.float32).view(np.uint8)
    n_blocks = rows * cols // t.block
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * t.block_bytes)), dtype=np.uint8).reshape(n_blocks, -1)
    # uniform int8 has std 73.9, uniform nibbles 4.61; scales vary +-50% between blocks, like real ones
    spread = 73.9 if qtype == "Q8_0" else 4.61
    d = (std / spread * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == "Q4_1":  # x = d*q + m with q in 0..15: m = -7.5 d centres it
        blocks[:, 2:4] = (-7.5 * d.astype(np.float32)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, t.row_bytes(cols))


# Where the f16 super-scales of the other block types are: (byte offset of d, byte offset of the second scale or
# None, that scale as a multiple of d). The second scale centres the weights: Q5_1 adds m = -15.5 d to q in
# 0..31; Q2_K/Q4_K/Q5_K subtract dmin * (a random min of 0..15 or 0..63) from d * scale * q.
_SCALE_FIELDS = {
    "Q5_0": (0, None, 0.0),
    "Q5_1": (0, 2, -15.5),
    "IQ4_NL": (0, None, 0.0),
    "IQ4_XS": (0, None, 0.0),
    "Q2_K": (80, 82, 1.5),
    "Q3_K": (108, None, 0.0),
    "Q4_K": (0, 2, 7.5),
    "Q5_K": (0, 2, 15.5),
    "Q6_K": (208, None, 0.0),
}


def _random_blocks_measured(rng: np.random.Generator, qtype: str, rows: int, cols: int, std: float) -> np.ndarray:
    """Random blocks whose super-scales are set so the weights have std ~`std`: the std at d = 1 is measured on
    a sample of the blocks (our dequantizer), then d (and the second scale, in proportion) set from it, +-50%."""
    t = QUANT_TYPES[qtype]
    d_at, second_at, ratio = _SCALE_FIELDS[qtype]
    n_blocks = rows * cols // t.block
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * t.block_bytes)), dtype=np.uint8).reshape(n_blocks, -1)

    def put(d: np.ndarray) -> None:
        blocks[: len(d), d_at : d_at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        if second_at is not None:
            second = (ratio * d.astype(np.float16).astype(np.float32)).astype(np.float16)
            blocks[: len(d), second_at : second_at + 2] = second.view(np.uint8).reshape(-1, 2)

    sample = min(n_blocks, 256)
    put(np.ones(sample, dtype=np.float32))
    unit_std = float(dequantize(blocks[:sample].reshape(-1), qtype, sample * t.block).std()) or 1.0
    put((std / unit_std * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float32))
    return blocks.reshape(rows, t.row_bytes(cols))


def _tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], qtype: str, freq_factors) -> np.ndarray:
    if name == "rope_freqs.weight":
        return np.asarray(freq_factors, dtype=np.float32)
    if len(shape) == 1:
        base = 1.0 if name.endswith("norm.weight") else 0.0  # norms ~1, biases ~0
        return (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)
    rows, cols = shape
    return random_blocks(rng, qtype, rows, cols, std=1 / math.sqrt(cols))


def synthesize(
    shape_name: str,
    qtype: str,
    out: str | Path,
    *,
    seed: int = 0,
    on_tensor: Callable[[int, int], None] | None = None,
    template: str = "chatml",
) -> Path:
    """Write a random model of the named shape with its matrices in `qtype`; returns the path.
    on_tensor(done, total) is called after each tensor. `template` names its chat template (TOOL_TEMPLATES:
    plain ChatML, or one that renders tools: "hermes", "llama3.1")."""
    if shape_name not in SHAPES:
        raise UsageError(f"unknown shape {shape_name!r}", hint=f"known: {', '.join(SHAPES)}")
    if qtype not in QUANTS:
        raise UsageError(f"unknown quant type {qtype!r}", hint=f"use one of {', '.join(QUANTS)}")
    if template not in TOOL_TEMPLATES:
        raise UsageError(f"unknown chat template {template!r}", hint=f"use one of {', '.join(TOOL_TEMPLATES)}")
    shape, out = SHAPES[shape_name], Path(out)
    c = config_of(shape)
    specs = expected_shapes(c)
    if c.rope_freq_factors:
        specs = {"rope_freqs.weight": (c.rope_dim // 2,)} | specs
    rng = np.random.default_rng(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.part"
    try:
        from gguf import GGMLQuantizationType, GGUFWriter  # deferred: only when writing (keeps CLI start-up light)

        w = GGUFWriter(tmp, shape.arch)
        _write_metadata(w, shape_name, shape, c, TOOL_TEMPLATES[template])
        types = {name: tensor_type(qtype, name, s, c.n_layers, c.tied_embeddings) for name, s in specs.items()}
        for name, s in specs.items():
            q = types[name]
            nbytes = QUANT_TYPES[q].row_bytes(s[-1]) * (s[0] if len(s) == 2 else 1)
            byte_shape = (*s[:-1], QUANT_TYPES[q].row_bytes(s[-1]))
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=GGMLQuantizationType[q])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, (name, s) in enumerate(specs.items()):
            data = _tensor(rng, name, s, types[name], c.rope_freq_factors)
            w.write_tensor_data(data.view(np.uint8).reshape(*s[:-1], -1))
            if on_tensor:
                on_tensor(i + 1, len(specs))
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _write_metadata(w: GGUFWriter, shape_name: str, shape: Shape, c: Config, template: str) -> None:
    w.add_name(f"ingot synthetic {shape_name}")
    w.add_context_length(c.n_ctx_train)
    w.add_embedding_length(c.dim)
    w.add_block_count(c.n_layers)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.rope_dim)
    w.add_vocab_size(c.n_vocab)
    tokens, types, merges = vocabulary(c.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(template)
