"""Model weights on the GPU: GGUF tensors uploaded once and repacked into the soa-v1 layout (cuda/common.cuh).

Matrices that are multiplied by the same input are stacked into one matrix so one kernel reads them all:
q, k and v -> wqkv [(H + 2 Hkv) hd, D]; gate and up -> wgu [2F, D] (the decode kernel fuses SwiGLU over the
two halves). Stacking raw GGUF rows is plain concatenation, so the stacked bytes go to the GPU in one staging
buffer and one repack kernel splits them. F32/BF16 matrices become F16; norms and biases stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ingot.runtime.errors import IncompatibleError
from ingot.runtime.gpu.driver import DeviceBuffer, DevicePool, Stream
from ingot.runtime.gpu.kernels import GPU_QTYPES, GpuMatrix, Kernels
from ingot.runtime.model.gguf import Model, QTensor

_QUANT_BYTES_PER_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass
class LayerWeights:
    attn_norm: DeviceBuffer
    wqkv: GpuMatrix
    bqkv: DeviceBuffer | None
    wo: GpuMatrix
    ffn_norm: DeviceBuffer
    wgu: GpuMatrix
    wdown: GpuMatrix
    # what the architecture's block adds (Config.block): fp32 [head_dim] q/k head norms (qk_norm), fp32 [dim]
    # norms of the attention and FFN outputs before their residual adds (post_norms); None where it has none
    q_norm: DeviceBuffer | None = None
    k_norm: DeviceBuffer | None = None
    post_attn_norm: DeviceBuffer | None = None
    post_ffn_norm: DeviceBuffer | None = None


@dataclass
class GpuWeights:
    embed: GpuMatrix
    layers: list[LayerWeights]
    out_norm: DeviceBuffer
    head: GpuMatrix
    nbytes: int


def _alloc_matrix(pool: DevicePool, qtype: str, rows: int, cols: int, name: str) -> GpuMatrix:
    n, nb = rows * cols, rows * cols // 32
    if qtype in ("Q4_0", "Q4_1"):
        return GpuMatrix(
            qtype,
            rows,
            cols,
            qs=pool.alloc(n // 2, name),
            d=pool.alloc(2 * nb, name),
            m=pool.alloc(2 * nb, name) if qtype == "Q4_1" else None,
        )
    if qtype == "Q8_0":
        return GpuMatrix(qtype, rows, cols, qs=pool.alloc(n, name), d=pool.alloc(2 * nb, name))
    return GpuMatrix("F16", rows, cols, w=pool.alloc(2 * n, name))


class WeightUploader:
    """Uploads tensors through one device staging buffer (stream-ordered, so no host waits between tensors)."""

    def __init__(self, model: Model, pool: DevicePool, stream: Stream, kernels: Kernels):
        self.model, self.pool, self.stream, self.k = model, pool, stream, kernels
        self.staging: DeviceBuffer | None = None
        self._keep: list[np.ndarray] = []  # host arrays whose async copies may still be in flight

    def matrix(self, names: list[str]) -> GpuMatrix:
        ts: list[QTensor] = [self.model.tensors[n] for n in names]
        qtypes = {t.qtype for t in ts}
        if len(qtypes) != 1:
            raise IncompatibleError(
                f"{', '.join(names)} mix quant types {sorted(qtypes)}",
                hint="the GPU engine stacks these matrices; requantize them to one type",
            )
        qtype = qtypes.pop()
        if qtype not in GPU_QTYPES + ("F32", "BF16"):
            raise IncompatibleError(f"{names[0]}: quant type {qtype} is not supported on the GPU yet")
        rows, cols = sum(t.shape[0] for t in ts), ts[0].shape[1]
        W = _alloc_matrix(self.pool, qtype, rows, cols, names[0])
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
            self.staging = self.pool.alloc(self._largest_stack(), "staging")
        offset = 0
        for t in ts:
            self.stream.upload(self.staging.at(offset), t.raw)
            offset += t.raw.nbytes
        self.k.repack(qtype, self.staging.ptr, W)(self.stream)
        return W

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


def upload_weights(model: Model, pool: DevicePool, stream: Stream, kernels: Kernels) -> GpuWeights:
    c, a = model.config, model.config.block
    up = WeightUploader(model, pool, stream, kernels)
    before = pool.allocated
    embed = up.matrix(["token_embd.weight"])
    if embed.qtype not in ("Q4_0", "Q4_1", "Q8_0", "F16"):
        raise IncompatibleError(f"token_embd.weight: {embed.qtype} embeddings are not supported on the GPU")
    layers = []
    for i in range(c.n_layers):
        p = f"blk.{i}."
        layers.append(
            LayerWeights(
                attn_norm=up.vector(p + "attn_norm.weight"),
                wqkv=up.matrix([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
                bqkv=up.vectors([p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]) if c.qkv_bias else None,
                wo=up.matrix([p + "attn_output.weight"]),
                ffn_norm=up.vector(p + "ffn_norm.weight"),
                wgu=up.matrix([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                wdown=up.matrix([p + "ffn_down.weight"]),
                q_norm=up.vector(p + "attn_q_norm.weight") if a.qk_norm else None,
                k_norm=up.vector(p + "attn_k_norm.weight") if a.qk_norm else None,
                post_attn_norm=up.vector(p + "post_attention_norm.weight") if a.post_norms else None,
                post_ffn_norm=up.vector(p + "post_ffw_norm.weight") if a.post_norms else None,
            )
        )
    out_norm = up.vector("output_norm.weight")
    head = embed if c.tied_embeddings else up.matrix(["output.weight"])
    up.finish()
    return GpuWeights(embed=embed, layers=layers, out_norm=out_norm, head=head, nbytes=pool.allocated - before)
