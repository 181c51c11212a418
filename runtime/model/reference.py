"""The reference forward pass every Ingot engine computes, in numpy, written like the math (llama2.c /
gpt-fast style). The CPU engine runs it; the GPU engine is tested against it. What a block computes beyond
Llama's (q/k norms, post-norms, GELU, embedding scale, sliding windows, per-layer RoPE bases, softcapping) is
read from the architecture's description (architectures.py, via Config.block), not special-cased by name."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ingot.runtime.model.gguf import Config

# --- the forward pass -----------------------------------------------------------------------------
#
# Shapes: T tokens in a batch, D = dim, H = n_heads, KV = n_kv_heads, hd = head_dim, V = n_vocab.
# Float32 throughout, with float64 for the two reductions where rounding matters (RMSNorm's mean of squares
# and softmax's sum). Matrices are [out, in], so a layer is x @ W.T (`linear`), like torch.nn.Linear.


class Weights(Protocol):
    """Where the forward pass gets float32 weights from (the CPU engine caches them, or dequantizes on use)."""

    def __getitem__(self, name: str) -> np.ndarray: ...

    def embed(self, tokens: np.ndarray) -> np.ndarray: ...  # [T] -> [T, D]


@dataclass
class KVCache:
    """One sequence's keys and values: [n_layers, capacity, KV, hd] each, and how many positions are filled."""

    k: np.ndarray
    v: np.ndarray
    n: int = 0

    @classmethod
    def empty(cls, c: Config, capacity: int) -> KVCache:
        shape = (c.n_layers, capacity, c.n_kv_heads, c.head_dim)
        # np.zeros maps fresh zero pages lazily: a long capacity costs memory only where it is written.
        return cls(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x * w / sqrt(mean(x^2) + eps) over the last axis."""
    ms = np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True)
    return x * (1.0 / np.sqrt(ms + eps)).astype(np.float32) * w


def rope_inv_freq(c: Config, layer: int = 0) -> np.ndarray:
    """[rope_dim/2] float64 for `layer`: theta_i = base^(-2i/rope_dim) with the layer's base, divided by the
    linear scale and by the freq factors when the model has them."""
    base, scale = c.layer_rope(layer)
    inv = base ** (-np.arange(0, c.rope_dim, 2, dtype=np.float64) / c.rope_dim) / scale
    return inv if c.rope_freq_factors is None else inv / np.asarray(c.rope_freq_factors, dtype=np.float64)


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    """Rotate x [T, heads, hd] by angle pos * theta_i, pair i being (x[2i], x[2i+1]) (llama.cpp "normal" rope,
    what GGUF's permuted llama q/k weights expect) or (x[i], x[i + rope_dim/2]) (NEOX). Dims past rope_dim pass."""
    angle = pos[:, None].astype(np.float64) * inv_freq[None, :]  # [T, rope_dim/2]
    cos = np.cos(angle).astype(np.float32)[:, None, :]  # [T, 1, rope_dim/2]
    sin = np.sin(angle).astype(np.float32)[:, None, :]
    rd = 2 * inv_freq.shape[0]
    out = x.copy()
    if neox:
        a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2] = a * cos - b * sin
        out[..., rd // 2 : rd] = a * sin + b * cos
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = a * cos - b * sin
        out[..., 1:rd:2] = a * sin + b * cos
    return out


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    *,
    scale: float = 0.0,
    window: int = 0,
    softcap: float = 0.0,
    k_start: int = 0,
) -> np.ndarray:
    """Causal grouped-query attention of t new queries at positions start.. over n cached keys at positions
    k_start.. (k_start + n = start + t). q [t, H, hd], k/v [n, KV, hd] -> [t, H*hd]. Query head h reads KV head
    h // (H/KV). scale: on q.k (0: 1/sqrt(hd)); window > 0: a query at p sees only keys at p - window + 1 .. p;
    softcap > 0: scores -> softcap * tanh(scores / softcap)."""
    t, n_heads, hd = q.shape
    n, n_kv, _ = k.shape
    rep = n_heads // n_kv
    key_pos, query_pos = k_start + np.arange(n)[None, :], start + np.arange(t)[:, None]
    masked = key_pos > query_pos  # [t, n]: key after the query
    if window:
        masked |= key_pos <= query_pos - window  # key outside the query's window
    scale = np.float32(scale or 1.0 / math.sqrt(hd))
    out = np.empty((t, n_heads, hd), dtype=np.float32)
    # One plain 2-D matmul per KV head and its `rep` query heads (numpy's broadcast batched matmul skips BLAS).
    for g in range(n_kv):
        heads = slice(g * rep, (g + 1) * rep)
        qg = q[:, heads].transpose(1, 0, 2).reshape(rep * t, hd)  # [rep*t, hd]
        scores = (qg @ k[:, g].T).reshape(rep, t, n) * scale  # [rep, t, n]
        if softcap:
            scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
        scores = np.where(masked, -np.inf, scores)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True, dtype=np.float64).astype(np.float32)  # softmax, summed in float64
        out[:, heads] = (p.reshape(rep * t, n) @ v[:, g]).reshape(rep, t, hd).transpose(1, 0, 2)
    return out.reshape(t, n_heads * hd)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, in] @ w.T for w [out, in] -> [T, out]. Written as (w @ x.T).T: for one token that is a BLAS gemv,
    which is ~8x faster than the M=1 gemm that x @ w.T becomes."""
    return (w @ x.T).T


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) overflows to inf for x < -88: silu is then -0, as it should be
        return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (PyTorch's gelu(approximate="tanh"), ggml_gelu)."""
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu_tanh": gelu_tanh}


def forward(c: Config, w: Weights, batch: Sequence[tuple[KVCache, Sequence[int]]]) -> np.ndarray:
    """Run tokens through the model, appending their keys/values to each sequence's cache.

    batch: (cache, tokens) per sequence; the tokens go at positions cache.n, cache.n + 1, ... Every matrix
    multiply covers all tokens of all sequences at once; only attention is per sequence.
    Returns the final-normed hidden states [T, D] of all tokens, in batch order (see `logits`).
    """
    a = c.block
    tokens = np.concatenate([np.asarray(t, dtype=np.int64) for _, t in batch])
    pos = np.concatenate([np.arange(cache.n, cache.n + len(t)) for cache, t in batch])
    spans = np.cumsum([0] + [len(t) for _, t in batch])
    act = ACTIVATIONS[a.activation]
    T = len(tokens)

    x = w.embed(tokens)  # [T, D]
    if a.embed_scale_sqrt_dim:
        x = x * np.float32(math.sqrt(c.dim))
    for layer in range(c.n_layers):
        b = f"blk.{layer}."
        inv_freq, window = rope_inv_freq(c, layer), c.layer_window(layer)
        h = rms_norm(x, w[b + "attn_norm.weight"], c.norm_eps)
        q = linear(h, w[b + "attn_q.weight"])  # [T, H*hd]
        k = linear(h, w[b + "attn_k.weight"])  # [T, KV*hd]
        v = linear(h, w[b + "attn_v.weight"])
        if c.qkv_bias:
            q, k, v = q + w[b + "attn_q.bias"], k + w[b + "attn_k.bias"], v + w[b + "attn_v.bias"]
        q, k = q.reshape(T, c.n_heads, c.head_dim), k.reshape(T, c.n_kv_heads, c.head_dim)
        if a.qk_norm:
            q, k = (
                rms_norm(q, w[b + "attn_q_norm.weight"], c.norm_eps),
                rms_norm(k, w[b + "attn_k_norm.weight"], c.norm_eps),
            )
        q, k = rope(q, pos, inv_freq, c.rope_neox), rope(k, pos, inv_freq, c.rope_neox)
        v = v.reshape(T, c.n_kv_heads, c.head_dim)

        att = np.empty((T, c.n_heads * c.head_dim), dtype=np.float32)
        for (cache, _), s, e in zip(batch, spans[:-1], spans[1:], strict=False):
            start, end = cache.n, cache.n + e - s
            cache.k[layer, start:end] = k[s:e]
            cache.v[layer, start:end] = v[s:e]
            lo = max(0, start - window + 1) if window else 0  # a local layer reads only its window of the cache
            att[s:e] = attention(
                q[s:e],
                cache.k[layer, lo:end],
                cache.v[layer, lo:end],
                start,
                scale=c.attn_scale,
                window=window,
                softcap=c.attn_softcap,
                k_start=lo,
            )
        o = linear(att, w[b + "attn_output.weight"])
        if a.post_norms:
            o = rms_norm(o, w[b + "post_attention_norm.weight"], c.norm_eps)
        x = x + o

        h = rms_norm(x, w[b + "ffn_norm.weight"], c.norm_eps)
        f = linear(
            act(linear(h, w[b + "ffn_gate.weight"])) * linear(h, w[b + "ffn_up.weight"]), w[b + "ffn_down.weight"]
        )
        if a.post_norms:
            f = rms_norm(f, w[b + "post_ffw_norm.weight"], c.norm_eps)
        x = x + f

    for cache, t in batch:
        cache.n += len(t)
    return rms_norm(x, w["output_norm.weight"], c.norm_eps)


def logits(c: Config, w: Weights, hidden: np.ndarray) -> np.ndarray:
    """[T, D] final hidden states -> [T, V] float32 logits (output head, or token_embd when tied)."""
    out = np.ascontiguousarray(linear(hidden, w["token_embd.weight" if c.tied_embeddings else "output.weight"]))
    if c.final_softcap:
        out = np.float32(c.final_softcap) * np.tanh(out / np.float32(c.final_softcap))
    return out
