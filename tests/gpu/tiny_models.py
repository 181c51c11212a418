"""Small random Llama-family GGUFs in shapes the GPU kernels take (head_dim 64/128), written with gguf's writer.

Each variant exercises a different path of the GPU engine: quant type of the matrices (dp4a matvec, F16
matvec, each GEMM tile loader), the embedding type, tied vs separate output head, GQA group size, and qwen2's
QKV bias with NEOX rope. A llama.cpp mix (Q4_K_M, ...) gives each tensor its own type as llama-quantize would
(synth.tensor_type): q,k,v then differ in some layers (a GpuStack on the GPU). Types gguf-py cannot quantize get
random blocks of the same spread (synth.random_blocks).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants

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
}


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
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = [f"<t{i}>" for i in range(V)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * V)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def put(name, data, qtype):
        _tensor(w, name, data, qtype, L, tied)

    def mat(rows, cols, scale=None):
        return rng.standard_normal((rows, cols)) * (scale or cols**-0.5)

    def vocab_rows(scale):
        # Row norms spread over a decade, as trained vocabularies have: the top logits then stand apart instead
        # of tying (Gaussian logits of a purely random head leave top-2 gaps within rounding noise).
        return mat(V, D, scale) * np.exp(rng.standard_normal((V, 1)) * 0.7)

    put("token_embd.weight", vocab_rows(1.0), eq)
    for i in range(L):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", 1 + 0.1 * rng.standard_normal(D), "F32")
        put(p + "attn_q.weight", mat(H * hd, D), mq)
        put(p + "attn_k.weight", mat(Hkv * hd, D), mq)
        put(p + "attn_v.weight", mat(Hkv * hd, D), mq)
        if arch == "qwen2":
            for n, rows in (("q", H * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                put(p + f"attn_{n}.bias", 0.1 * rng.standard_normal(rows), "F32")
        put(p + "attn_output.weight", mat(D, H * hd), mq)
        put(p + "ffn_norm.weight", 1 + 0.1 * rng.standard_normal(D), "F32")
        put(p + "ffn_gate.weight", mat(F, D), mq)
        put(p + "ffn_up.weight", mat(F, D), mq)
        put(p + "ffn_down.weight", mat(D, F), mq)
    put("output_norm.weight", 1 + 0.1 * rng.standard_normal(D), "F32")
    if not tied:
        put("output.weight", vocab_rows(D**-0.5), mq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
