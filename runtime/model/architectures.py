"""What each supported architecture's transformer block computes, described once.

The reference forward pass (reference.py) is driven by these descriptions, the GGUF config reader (gguf.py)
takes the per-architecture constants from them, and the list of expected tensors follows from them too. A new
Llama-like architecture is one entry here; anything not listed is refused by name.

Every block is, in order (optional steps in brackets):

    h = rms_norm(x, attn_norm)
    q, k, v = h @ Wq, h @ Wk, h @ Wv                         [+ biases]
    [q, k = rms_norm per head (attn_q_norm, attn_k_norm)]    qk_norm
    q, k = rope(q, k; base = the layer's, pairs adjacent or NEOX halves)
    a = softmax(q k^T * attn_scale [softcapped], causal [and within the layer's sliding window]) v
    a = a @ Wo                                               [a = rms_norm(a, post_attention_norm)]  post_norms
    x = x + a
    h = rms_norm(x, ffn_norm)
    f = (act(h @ Wgate) * (h @ Wup)) @ Wdown                 act: silu or gelu_tanh
                                                             [f = rms_norm(f, post_ffw_norm)]  post_norms
    x = x + f

before the blocks x = token_embd[tokens] [* sqrt(dim)], after them rms_norm(x, output_norm) @ output (or
token_embd when tied) [softcapped]. Norms are x * w / sqrt(mean(x^2) + eps) with the GGUF's w as stored:
Gemma's RMSNorm multiplies by (1 + w) in transformers, and llama.cpp's converter bakes the +1 into the GGUF
norm weights (convert_hf_to_gguf.py, Gemma*Model.modify_tensors), so no architecture adds it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Architecture:
    name: str  # general.architecture
    family: str  # which models these are, in a few words
    rope_neox: bool  # rotate (x[i], x[i + rope_dim/2]) (NEOX, HF's rotate_half); else (x[2i], x[2i+1])
    qkv_bias: bool | None = None  # True: q/k/v biases required; False: none; None: used when the file has them
    qk_norm: bool = False  # RMSNorm over each head of q and k ([head_dim] weights), before RoPE
    post_norms: bool = False  # RMSNorm of the attention and of the FFN output before each residual add
    activation: str = "silu"  # the FFN gate's: down(act(gate(h)) * up(h))
    embed_scale_sqrt_dim: bool = False  # token embeddings multiplied by sqrt(dim)
    # Sliding-window attention: layer i is local (attends to the last `window` positions, itself included) when
    # i % swa_pattern < swa_pattern - 1, global otherwise (llama.cpp's set_swa_pattern, HF's layer_types); 0: none.
    swa_pattern: int = 0
    local_rope_theta: float | None = None  # RoPE base of the local layers (None: the model's rope.freq_base)
    # query_pre_attn_scalar = dim / n_heads instead of head_dim for models of this many layers (Gemma 3 27B:
    # llama.cpp decides by model size, the GGUF carries no key for it).
    attn_scale_dim_per_head_layers: tuple[int, ...] = ()
    # The GGUF's `<arch>.attn_logit_softcapping` / `final_logit_softcapping` keys are read (0 when absent).
    softcapping: bool = False

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends within a sliding window."""
        return self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    def attn_scale(self, n_layers: int, dim: int, n_heads: int, head_dim: int) -> float:
        """The factor on q.k before softmax: 1/sqrt(query_pre_attn_scalar)."""
        return 1.0 / math.sqrt(dim / n_heads if n_layers in self.attn_scale_dim_per_head_layers else head_dim)


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("llama", "Llama (SmolLM2, TinyLlama, Llama 2/3)", rope_neox=False),
        Architecture("mistral", "Mistral", rope_neox=False),
        Architecture("qwen2", "Qwen 2 / 2.5", rope_neox=True),
        Architecture("qwen3", "Qwen 3 (dense)", rope_neox=True, qkv_bias=False, qk_norm=True),
        Architecture(
            "gemma3",
            "Gemma 3 (text)",
            rope_neox=True,
            qkv_bias=False,
            qk_norm=True,
            post_norms=True,
            activation="gelu_tanh",
            embed_scale_sqrt_dim=True,
            swa_pattern=6,
            local_rope_theta=10000.0,
            attn_scale_dim_per_head_layers=(62,),
            softcapping=True,
        ),
    )
}


def block_tensors(a: Architecture, qkv_bias: bool) -> dict[str, str]:
    """The per-layer tensors an architecture's block reads, by GGUF name (without `blk.N.`), each with its shape
    in terms of the symbols D (dim), Q (n_heads * head_dim), KV (n_kv_heads * head_dim), F (ffn_dim), HD
    (head_dim): "D" a vector, "Q,D" a matrix of Q rows and D columns."""
    t = {
        "attn_norm.weight": "D",
        "attn_q.weight": "Q,D",
        "attn_k.weight": "KV,D",
        "attn_v.weight": "KV,D",
        "attn_output.weight": "D,Q",
        "ffn_norm.weight": "D",
        "ffn_gate.weight": "F,D",
        "ffn_up.weight": "F,D",
        "ffn_down.weight": "D,F",
    }
    if qkv_bias:
        t |= {"attn_q.bias": "Q", "attn_k.bias": "KV", "attn_v.bias": "KV"}
    if a.qk_norm:
        t |= {"attn_q_norm.weight": "HD", "attn_k_norm.weight": "HD"}
    if a.post_norms:
        t |= {"post_attention_norm.weight": "D", "post_ffw_norm.weight": "D"}
    return t
