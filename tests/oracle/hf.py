"""An independent fp32 reference for Ingot's engines: transformers' own Gemma 3 and Qwen 3 models, built from an
Ingot-loaded GGUF. A test helper only: the runtime never imports torch or transformers.

What is shared with Ingot and what is not:
  - hyperparameters come from Ingot's Config (what gguf.py read), turned into transformers' config fields here;
  - weights are dequantized with gguf-py's own `gguf.quants.dequantize` from the file's raw bytes (not with
    Ingot's quants.py), then renamed to transformers' parameter names;
  - the forward pass, masks, RoPE, norms and KV handling are all transformers' (eager attention, float32).

What llama.cpp's converter (convert_hf_to_gguf.py) did to these weights, and what is undone here:
  - Gemma3Model.modify_tensors adds 1 to every tensor whose name ends in "norm.weight" (Gemma3RMSNorm computes
    x_normed * (1 + w)); transformers' own GGUF loader undoes it the same way (Gemma2TensorProcessor, used for
    "gemma3": weights - 1). So GGUF norm weight - 1 = HF weight, for the q/k norms too.
  - q/k rows are permuted (LlamaModel.permute) for llama only; Qwen3Model (a Qwen2Model) and Gemma3Model
    (a TextModel) write q_proj / k_proj unpermuted, and both use NEOX rotate_half RoPE in transformers.
  - Gemma 3's token_embd may be cut to the tokenizer's size; the HF model is built with the GGUF's row count.

Careful with one name: transformers' `post_attention_layernorm` is the pre-FFN norm in Qwen 3 (GGUF ffn_norm)
but the norm of the attention output in Gemma 3 (GGUF post_attention_norm); Gemma 3's pre-FFN norm is
`pre_feedforward_layernorm`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from ingot.runtime.model.gguf import Config, Model
from ingot.runtime.sampling import SamplingParams

# GGUF tensor name (without "blk.N.") -> transformers name (without "model.layers.N."), per architecture.
_ATTN_MLP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BLOCK_NAMES = {
    "qwen3": _ATTN_MLP | {"ffn_norm.weight": "post_attention_layernorm.weight"},
    "gemma3": _ATTN_MLP
    | {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The converter's shift of norm weights (GGUF = HF + shift), per architecture.
NORM_SHIFT = {"qwen3": 0.0, "gemma3": 1.0}


def _rope(theta: float, scale: float) -> dict:
    """transformers' rope_parameters for one layer type: plain RoPE, or linear position scaling."""
    if scale == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "rope_theta": theta, "factor": scale}


def hf_config(c: Config, model: Model) -> Gemma3TextConfig | Qwen3Config:
    """transformers' config for Ingot's Config, every field taken from it (nothing from transformers' defaults
    that could differ from the GGUF)."""
    if c.rope_dim != c.head_dim or c.rope_freq_factors is not None:
        raise NotImplementedError("partial rotary or rope_freqs factors: not a Gemma 3 / Qwen 3 GGUF")
    v = model.vocab
    common = dict(
        vocab_size=c.n_vocab,
        hidden_size=c.dim,
        intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.n_ctx_train,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tied_embeddings,
        attention_bias=c.qkv_bias,
        bos_token_id=v.bos_id,
        eos_token_id=v.eos_id,
        pad_token_id=None,
    )
    if c.arch == "qwen3":
        # Qwen 3 scales q.k by head_dim^-0.5 (no config field) and has no sliding window in dense models.
        assert c.block.activation == "silu" and c.sliding_window == 0
        assert c.attn_scale == 0.0 or math.isclose(c.attn_scale, 1 / math.sqrt(c.head_dim), rel_tol=1e-6)
        cfg = Qwen3Config(
            **common,
            hidden_act="silu",
            rope_parameters=_rope(c.rope_theta, c.rope_scale),
            use_sliding_window=False,
        )
    elif c.arch == "gemma3":
        assert c.block.activation == "gelu_tanh"
        # layer i is "sliding_attention" when Ingot gives it a window (HF's sliding_window_pattern, written out)
        layer_types = ["sliding_attention" if c.layer_window(i) else "full_attention" for i in range(c.n_layers)]
        # transformers scales q.k by query_pre_attn_scalar^-0.5; Ingot's Config holds the factor itself
        scalar = 1.0 / (c.attn_scale or 1.0 / math.sqrt(c.head_dim)) ** 2
        assert abs(scalar - round(scalar)) < 1e-3 * scalar, scalar
        cfg = Gemma3TextConfig(
            **common,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=round(scalar),
            sliding_window=c.sliding_window or None,
            layer_types=layer_types,
            rope_parameters={
                # global layers: the GGUF's freq_base and linear scale; local ones: their own base, no scaling
                "full_attention": _rope(c.rope_theta, c.rope_scale),
                "sliding_attention": _rope(c.rope_theta_local or c.rope_theta, 1.0),
            },
            attn_logit_softcapping=c.attn_softcap or None,
            final_logit_softcapping=c.final_softcap or None,
            use_bidirectional_attention=False,
        )
    else:
        raise NotImplementedError(f"no transformers oracle for {c.arch}")
    cfg._attn_implementation = "eager"  # the plain softmax(q k^T) v, no fused kernel
    return cfg


def gguf_weights(model: Model) -> dict[str, np.ndarray]:
    """Every tensor of the GGUF as float32 in math-order shape, dequantized by gguf-py from the raw bytes."""
    out = {}
    for name, t in model.tensors.items():
        w = dequantize(np.asarray(t.raw), GGMLQuantizationType[t.qtype])
        out[name] = np.ascontiguousarray(w.reshape(t.shape), dtype=np.float32)
    return out


def hf_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """The GGUF's weights under transformers' names, the converter's changes undone (see the module doc)."""
    c = model.config
    names, shift = BLOCK_NAMES[c.arch], NORM_SHIFT[c.arch]
    sd = {}
    for name, w in gguf_weights(model).items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = f"model.layers.{layer}.{names[rest]}"
        else:
            hf = TOP_NAMES[name]
        if name.endswith("norm.weight"):
            w = w - np.float32(shift)
        sd[hf] = torch.from_numpy(w)
    return sd


def build(model: Model, device: str = "cpu") -> PreTrainedModel:
    """transformers' Gemma3ForCausalLM / Qwen3ForCausalLM with the GGUF's weights, float32, eval mode."""
    torch.set_float32_matmul_precision("highest")  # float32 GEMMs on the GPU, not TF32
    cfg = hf_config(model.config, model)
    cls = Gemma3ForCausalLM if model.config.arch == "gemma3" else Qwen3ForCausalLM
    torch.manual_seed(0)  # the random init is overwritten below; seeded so a missed tensor is at least repeatable
    hf = cls(cfg).to(torch.float32)
    sd = hf_state_dict(model)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    tied = {"lm_head.weight"} if model.config.tied_embeddings else set()
    if set(missing) != tied or unexpected:
        raise AssertionError(f"weight mapping: missing {missing}, unexpected {unexpected}")
    if model.config.tied_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr(), "lm_head is not tied"
    return hf.to(device).eval()


# --- running it ------------------------------------------------------------------------------------


@torch.inference_mode()
def last_logits(hf: PreTrainedModel, tokens: Sequence[int]) -> np.ndarray:
    """[V] float32 logits at the last of `tokens` (one full forward pass from an empty cache)."""
    ids = torch.tensor([list(tokens)], device=hf.device)
    return hf(ids, logits_to_keep=1, use_cache=False).logits[0, -1].float().cpu().numpy()


@torch.inference_mode()
def greedy(hf: PreTrainedModel, prompt: Sequence[int], n: int) -> list[int]:
    """n greedy tokens after `prompt`, end-of-generation tokens included (the comparison is of ids, not text).
    Each step is a fresh full forward pass (no KV cache): slower, but nothing but transformers' masks and
    attention decides the result."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(last_logits(hf, ids))))
    return ids[len(prompt) :]


class HFEngine:
    """The part of Ingot's Engine interface that runtime/perplexity.py uses, over a transformers model, so the
    oracle's perplexity runs through exactly the same protocol code as the engines'. logits(seq, tokens) runs
    the whole sequence so far from scratch and returns the rows of the new tokens."""

    name = "transformers"

    def __init__(self, hf: PreTrainedModel, config: Config, max_ctx: int):
        self.hf, self.config, self.max_ctx = hf, config, max_ctx
        self._seqs: dict[int, list[int]] = {}
        self._next = 0

    def new_sequence(self, params: SamplingParams) -> int:
        self._next += 1
        self._seqs[self._next] = []
        return self._next

    @torch.inference_mode()
    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        ids = self._seqs[seq]
        ids.extend(int(t) for t in tokens)
        x = torch.tensor([ids], device=self.hf.device)
        return self.hf(x, logits_to_keep=len(tokens), use_cache=False).logits[0].float().cpu().numpy()

    def release(self, seq: int) -> None:
        self._seqs.pop(seq, None)
