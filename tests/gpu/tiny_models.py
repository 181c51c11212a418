"""Small random GGUFs of every GPU architecture, in shapes the GPU kernels take (head_dim 64/128/256), written
with gguf's writer. The tensors each block reads come from its architecture's description
(architectures.block_tensors), so a new architecture needs only a row here.

Each variant exercises a different path of the GPU engine: quant type of the matrices (dp4a matvec, F16
matvec, each GEMM tile loader), the embedding type, tied vs separate output head, GQA group size, qwen2's
QKV bias with NEOX rope, qwen3's q/k norms, and Gemma 3's whole block (q/k norms, post-norms, GELU, embedding
scale, sliding windows with their own RoPE base, head_dim 256, a custom attention scale). A llama.cpp mix
(Q4_K_M, ...) gives each tensor its own type as llama-quantize would (synth.tensor_type): q,k,v then differ in
some layers (a GpuStack on the GPU). Types gguf-py cannot quantize get random blocks of the same spread
(synth.random_blocks).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

from ingot.runtime.model.architectures import ARCHITECTURES, block_tensors
from ingot.runtime.model.synth import MIXES, random_blocks, tensor_type

VARIANTS = {
    #  name:          (arch,   matrices, embed,  D,   L, H, Hkv, hd,  F,   V,    tied)
    "q4_0-tied": ("llama", "Q4_0", "Q8_0", 256, 2, 4, 2, 64, 512, 1000, True),
    "q4_1-gqa3": ("llama", "Q4_1", "Q4_1", 576, 2, 9, 3, 64, 1536, 777, True),
    "q8_0-untied": ("llama", "Q8_0", "Q4_0", 256, 3, 2, 1, 128, 384, 513, False),
    "f16-mha": ("llama", "F16", "F16", 256, 2, 4, 4, 64, 320, 600, False),
    "qwen2-bias": ("qwen2", "Q8_0", "Q8_0", 256, 2, 4, 2, 64, 512, 700, True),
    "q4_k_m-untied": ("llama", "Q4_K_M", "Q4_K", 256, 2, 4, 2, 64, 512, 1000, False),
    "q5_k_m-tied": ("llama", "Q5_K_M", "Q6_K", 512, 2, 8, 2, 64, 768, 900, True),
    "q5_0-q3_k-gqa4": ("llama", "Q5_0", "Q3_K", 256, 2, 8, 2, 64, 512, 600, True),
    "q2_k-iq4": ("llama", "Q2_K", "IQ4_XS", 256, 2, 4, 1, 64, 512, 500, False),
    "qwen3-qknorm": ("qwen3", "Q8_0", "Q8_0", 256, 2, 4, 2, 128, 512, 700, False),
    # 7 layers: 0-4 local, 5 global, 6 local (swa_pattern 6)
    "gemma3-hd256": ("gemma3", "Q8_0", "Q8_0", 256, 7, 4, 1, 256, 512, 900, True),
    "gemma3-f16": ("gemma3", "F16", "F16", 256, 6, 4, 2, 128, 384, 600, True),
    "gemma3-q4_1": ("gemma3", "Q4_1", "Q4_0", 512, 6, 8, 1, 64, 1024, 800, True),
    # the real Gemma 3 270M's dimensions (its 262,144-token vocabulary: the logits buffers and the sampler)
    "gemma3-270m": ("gemma3", "Q8_0", "Q8_0", 640, 18, 4, 1, 256, 2048, 262144, True),
}
# Sliding windows (positions a local layer sees, itself included): not multiples of the 32-token page, so the
# window's first page is partial; 512 is Gemma 3 270M's.
WINDOWS = {"gemma3-hd256": 40, "gemma3-f16": 100, "gemma3-q4_1": 77, "gemma3-270m": 512}
# A query_pre_attn_scalar other than head_dim (the attention scale is 1/sqrt of it; Gemma 3 27B has one).
ATTENTION_SCALES = {"gemma3-f16": 0.06}


# The order tensors are drawn from the random stream in (the Llama variants' models stay the ones their tests
# were written against): a block's reading order.
ORDER = [
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
    "post_attention_norm.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "post_ffw_norm.weight",
]


def _tensor(w: GGUFWriter, name: str, data: np.ndarray, qtype: str, n_layers: int = 0, tied: bool = True) -> None:
    if qtype in MIXES:
        qtype = tensor_type(qtype, name, data.shape, n_layers, tied)
    if qtype == "F32":
        w.add_tensor(name, data.astype(np.float32))
    elif qtype == "F16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        t = GGMLQuantizationType[qtype]
        try:
            raw = quants.quantize(data.astype(np.float32), t)
        except NotImplementedError:  # gguf-py quantizes no K-quant nor IQ4_XS: random blocks of the same spread
            rng = np.random.default_rng(zlib.crc32(name.encode()))
            raw = random_blocks(rng, qtype, data.shape[0], data.shape[1], float(data.std()))
        w.add_tensor(name, raw, raw_dtype=t)


def write_model(path: Path, variant: str, seed: int = 0) -> Path:
    arch, mq, eq, D, L, H, Hkv, hd, F, V, tied = VARIANTS[variant]
    a = ARCHITECTURES[arch]
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(4096)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(1000000.0 if a.swa_pattern else 10000.0)  # global layers' base; local ones: 10k
    w.add_layer_norm_rms_eps(1e-6 if a.qk_norm else 1e-5)
    if variant in WINDOWS:
        w.add_sliding_window(WINDOWS[variant])
    if variant in ATTENTION_SCALES:
        w.add_float32(f"{arch}.attention.scale", ATTENTION_SCALES[variant])
    tokens = [f"<t{i}>" for i in range(V)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * V)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def mat(rows, cols, scale=None):
        return rng.standard_normal((rows, cols)) * (scale or cols**-0.5)

    def vocab_rows(scale):
        # Row norms spread over a decade, as trained vocabularies have: the top logits then stand apart instead
        # of tying (Gaussian logits of a purely random head leave top-2 gaps within rounding noise).
        return mat(V, D, scale) * np.exp(rng.standard_normal((V, 1)) * 0.7)

    # Gemma multiplies the embeddings by sqrt(D): rows of norm ~1 keep the residual stream at unit scale.
    _tensor(w, "token_embd.weight", vocab_rows(D**-0.5 if a.embed_scale_sqrt_dim else 1.0), eq, L, tied)
    sizes = {"D": D, "Q": H * hd, "KV": Hkv * hd, "F": F, "HD": hd}
    for i in range(L):
        block = block_tensors(a, qkv_bias=arch == "qwen2")
        for name in sorted(block, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
            dims = block[name]
            shape = tuple(sizes[s] for s in dims.split(","))
            full = f"blk.{i}.{name}"
            if name.endswith("norm.weight"):  # RMSNorm weights near 1
                _tensor(w, full, 1 + 0.1 * rng.standard_normal(shape), "F32")
            elif name.endswith(".bias"):
                _tensor(w, full, 0.1 * rng.standard_normal(shape), "F32")
            else:
                _tensor(w, full, mat(*shape), mq, L, tied)
    _tensor(w, "output_norm.weight", 1 + 0.1 * rng.standard_normal(D), "F32")
    if not tied:
        _tensor(w, "output.weight", vocab_rows(D**-0.5), mq, L, tied)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
