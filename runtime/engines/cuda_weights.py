"""Model weights on the GPU: GGUF tensors uploaded once and repacked into the soa-v2 layout (cuda/common.cuh).

Matrices that are multiplied by the same input are stacked so one kernel reads them all: q, k and v -> wqkv
[(H + 2 Hkv) hd, D]; gate and up -> wgu [2F, D] (the decode kernel fuses the gated activation over the two
halves). When the tensors share a GGUF type, stacking raw GGUF rows is plain concatenation, so the stacked
bytes go to the GPU in one staging buffer and one repack kernel splits them into one GpuMatrix. When they do
not (llama.cpp's mixes quantize v or gate/up differently), each is its own GpuMatrix and the stack a GpuStack:
one kernel per part, the same output rows (stack_plan decides). F32/BF16 matrices become F16; norms and biases
stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingot.runtime.errors import IncompatibleError
from ingot.runtime.gpu.driver import DeviceBuffer, DevicePool, Stream
from ingot.runtime.gpu.kernels import GPU_QTYPES, GpuMatrix, GpuStack, Kernels, layout_bytes
from ingot.runtime.model.gguf import Model, QTensor

# GGUF types the GPU takes as they are (repacked) and those converted to F16 at upload
_CONVERTED = ("F32", "BF16")


@dataclass
class LayerWeights:
    attn_norm: DeviceBuffer
    wqkv: GpuMatrix | GpuStack
    bqkv: DeviceBuffer | None
    wo: GpuMatrix
    ffn_norm: DeviceBuffer
    wgu: GpuMatrix | GpuStack
    wdown: GpuMatrix
    # What the architecture adds (Config.block, architectures.py); None where it has none:
    q_norm: DeviceBuffer | None = None  # fp32 [head_dim], RMSNorm weight of every q head (qk_norm)
    k_norm: DeviceBuffer | None = None  # fp32 [head_dim], of every k head (qk_norm)
    post_attn_norm: DeviceBuffer | None = None  # fp32 [dim], on the attention output before the residual add
    post_ffn_norm: DeviceBuffer | None = None  # fp32 [dim], on the FFN output before the residual add


@dataclass
class GpuWeights:
    embed: GpuMatrix
    layers: list[LayerWeights]
    out_norm: DeviceBuffer
    head: GpuMatrix
    nbytes: int

    def shapes(self) -> set[tuple[int, int]]:
        """(rows, cols) of every matrix a forward pass multiplies: what the prefill's split-K scratch is sized for."""
        mats = [W for lw in self.layers for W in (lw.wqkv, lw.wo, lw.wgu, lw.wdown)] + [self.head]
        return {(W.rows, W.cols) for W in mats}


def _alloc_matrix(pool: DevicePool, qtype: str, rows: int, cols: int, name: str) -> GpuMatrix:
    """A [rows, cols] matrix's soa-v2 arrays (F32/BF16 sources get the F16 layout they are converted to)."""
    gpu_type = "F16" if qtype in _CONVERTED else qtype
    arrays = {field: pool.alloc(n, name) for field, n in layout_bytes(gpu_type, rows, cols).items()}
    return GpuMatrix(gpu_type, rows, cols, **arrays)


def stack_plan(names: list[str], qtypes: list[str]) -> bool:
    """Whether tensors `names` (of GGUF types `qtypes`) stacked by rows become one GpuMatrix (True: one type, the
    raw rows concatenate) or a GpuStack of one matrix per tensor (False). Raises IncompatibleError for a type
    the GPU lacks, and for F16 mixed with quantized tensors (they read different activations)."""
    for name, q in zip(names, qtypes, strict=True):
        if q not in GPU_QTYPES + _CONVERTED:
            raise IncompatibleError(
                f"{name}: quant type {q} is not supported on the GPU yet",
                hint=f"requantize to one of {', '.join(GPU_QTYPES)}, or run on the CPU (--engine cpu)",
            )
    if len(set(qtypes)) == 1:
        return True
    if len({q in GPU_QTYPES and q != "F16" for q in qtypes}) != 1:
        raise IncompatibleError(
            f"{', '.join(names)} mix float and quantized types {sorted(set(qtypes))}",
            hint="the GPU engine multiplies these by one activation; requantize them all (e.g. llama-quantize)",
        )
    return False


class WeightUploader:
    """Uploads tensors through one device staging buffer (stream-ordered, so no host waits between tensors).
    The staging buffer comes from a pool of its own, freed by finish(): it is as large as the largest group of
    raw tensors (Gemma 3 270M's Q8_0 embedding: 178 MB) and the engine never needs it again."""

    def __init__(self, model: Model, pool: DevicePool, stream: Stream, kernels: Kernels):
        self.model, self.pool, self.stream, self.k = model, pool, stream, kernels
        self.staging: DeviceBuffer | None = None
        self._staging_pool = type(pool)()  # a pool of the same kind (tests plan uploads with a pool of numbers)
        self._keep: list[np.ndarray] = []  # host arrays whose async copies may still be in flight

    def matrix(self, names: list[str]) -> GpuMatrix | GpuStack:
        """Tensors `names` stacked by rows: one GpuMatrix when their types agree, else a GpuStack."""
        ts: list[QTensor] = [self.model.tensors[n] for n in names]
        if stack_plan(names, [t.qtype for t in ts]):
            return self._upload(names[0], ts)
        return GpuStack([self._upload(n, [t]) for n, t in zip(names, ts, strict=True)])

    def _upload(self, name: str, ts: list[QTensor]) -> GpuMatrix:
        """Tensors of one GGUF type, concatenated by rows, as one matrix."""
        qtype = ts[0].qtype
        rows, cols = sum(t.shape[0] for t in ts), ts[0].shape[1]
        W = _alloc_matrix(self.pool, qtype, rows, cols, name)
        if qtype == "F16":
            assert W.w is not None  # _alloc_matrix gives F16 matrices their w array
            offset = 0
            for t in ts:
                self.stream.upload(W.w.at(offset), t.raw)
                offset += t.raw.nbytes
            return W
        raw = sum(t.raw.nbytes for t in ts)
        if self.staging is None or self.staging.nbytes < raw:
            self.stream.synchronize()  # the old staging buffer may still feed a repack
            self.staging = self._staging_pool.alloc(self._largest_stack(), "staging")
        offset = 0
        for t in ts:
            self.stream.upload(self.staging.at(offset), t.raw)
            offset += t.raw.nbytes
        self.k.repack(qtype, self.staging.ptr, W)(self.stream)
        return W

    def single(self, name: str) -> GpuMatrix:
        t = self.model.tensors[name]
        stack_plan([name], [t.qtype])  # refuses a type the GPU lacks
        return self._upload(name, [t])

    def vector(self, name: str) -> DeviceBuffer:
        v = np.ascontiguousarray(self.model.tensors[name].dequantize().astype(np.float32).ravel())
        buf = self.pool.alloc(v.nbytes, name)
        self._keep.append(v)
        self.stream.upload(buf.ptr, v)
        return buf

    def vectors(self, names: list[str]) -> DeviceBuffer:
        v = np.concatenate([self.model.tensors[n].dequantize().astype(np.float32).ravel() for n in names])
        buf = self.pool.alloc(v.nbytes, names[0])
        self._keep.append(v)
        self.stream.upload(buf.ptr, v)
        return buf

    def _largest_stack(self) -> int:
        """Staging size: the largest group of raw tensors uploaded together."""
        t = self.model.tensors
        c = self.model.config
        sizes = [t["token_embd.weight"].raw.nbytes]
        if "output.weight" in t:
            sizes.append(t["output.weight"].raw.nbytes)
        for i in range(c.n_layers):
            p = f"blk.{i}."
            sizes.append(sum(t[p + n].raw.nbytes for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")))
            sizes.append(t[p + "ffn_gate.weight"].raw.nbytes + t[p + "ffn_up.weight"].raw.nbytes)
            sizes += [t[p + "attn_output.weight"].raw.nbytes, t[p + "ffn_down.weight"].raw.nbytes]
        return max(sizes)

    def finish(self) -> None:
        self.stream.synchronize()
        self._keep.clear()
        self.staging = None
        self._staging_pool.close()


def upload_weights(model: Model, pool: DevicePool, stream: Stream, kernels: Kernels) -> GpuWeights:
    c = model.config
    up = WeightUploader(model, pool, stream, kernels)
    before = pool.allocated
    try:
        embed = up.single("token_embd.weight")
        a = c.block
        layers = []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            layers.append(
                LayerWeights(
                    attn_norm=up.vector(p + "attn_norm.weight"),
                    wqkv=up.matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                    bqkv=up.vectors([p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]) if c.qkv_bias else None,
                    wo=up.single(p + "attn_output.weight"),
                    ffn_norm=up.vector(p + "ffn_norm.weight"),
                    wgu=up.matrix([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    wdown=up.single(p + "ffn_down.weight"),
                    q_norm=up.vector(p + "attn_q_norm.weight") if a.qk_norm else None,
                    k_norm=up.vector(p + "attn_k_norm.weight") if a.qk_norm else None,
                    post_attn_norm=up.vector(p + "post_attention_norm.weight") if a.post_norms else None,
                    post_ffn_norm=up.vector(p + "post_ffw_norm.weight") if a.post_norms else None,
                )
            )
        out_norm = up.vector("output_norm.weight")
        head = embed if c.tied_embeddings else up.single("output.weight")
    finally:
        up.finish()  # also on failure: the staging pool is freed either way
    return GpuWeights(embed=embed, layers=layers, out_norm=out_norm, head=head, nbytes=pool.allocated - before)
