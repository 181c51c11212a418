"""The GPU engine: the model's forward pass as kernel launches on one CUDA stream, driven from Python.

The block is written once (CudaEngine._forward) in terms of five primitives — norm, linear, attention,
residual, ffn — and each path supplies them (_Ops below): batch decode with matrix-vector products
(_MatvecOps), wide-batch decode with tensor-core GEMMs (_GemmDecodeOps) and prefill with GEMMs and flash
attention (_PrefillOps). What an architecture adds to Llama's block comes from its description
(architectures.py via Config.block and the weights it brings): q/k head norms, the layer's sliding window and
RoPE table, post-norms, the FFN activation, the embedding scale. Per layer, for x [n, D] fp32 (the residual
stream), with the optional steps in brackets:

    h         = rmsnorm(x) * attn_norm                     (q8x2, fp32 or fp16: what the next product reads)
    qkv       = Wqkv · h (+ bqkv)                          [n, (H + 2 Hkv) hd]
    att       = attention([rmsnorm] rope(q), cache + [rmsnorm] rope(k), v; the layer's window)   [n, H hd]
    x        += [rmsnorm](Wo · att)
    h         = rmsnorm(x) * ffn_norm
    f         = act(Wgate · h) * (Wup · h)                 act: silu or gelu_tanh   [n, F]
    x        += [rmsnorm](Wdown · f)
then logits = Whead · rmsnorm(x) * out_norm and a token per sequence is sampled on the GPU.

Decode (one token for each of B sequences) is the hot path: its launches (8 per layer for Llama, 6 at B=1) are captured
once per batch size B into a CUDA graph and replayed with one cuGraphLaunch per step. Everything that changes
between steps — token ids, positions, block tables, sampling parameters — lives in device memory written by one
host->device copy before the replay, so no graph node is ever patched; the only readback is the B sampled
token ids. Prefill runs up to PREFILL_CHUNK tokens per pass, of one sequence or of several (prefill_many: the
server admits several prompts in a step): the GEMMs take all their tokens at once, the cache write finds each
token's block-table row, and the flash attention is launched per sequence on its rows. A pass's launch list is
built once per shape (its sequences' token counts, which of them sample) and replayed.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np

from ingot.runtime import settings
from ingot.runtime.engines.base import FROM_DEVICE, PrefillChunk
from ingot.runtime.engines.cuda_weights import LayerWeights, upload_weights
from ingot.runtime.engines.kvcache import PagePool, PrefixChain
from ingot.runtime.errors import IncompatibleError, IngotError, UsageError
from ingot.runtime.gpu.constants import (
    MATVEC_NORM_MAX,
    MODE_ADD,
    MODE_GEGLU,
    MODE_STORE,
    MODE_SWIGLU,
    PAGE,
    WEIGHT_LAYOUT,
)
from ingot.runtime.gpu.driver import (
    Copy,
    Device,
    DeviceBuffer,
    DevicePool,
    Event,
    Graph,
    Launch,
    PinnedBuffer,
    Stream,
)
from ingot.runtime.gpu.kernels import (
    ACTIVATION_KERNELS,
    GQA_MAX,
    HEAD_DIMS,
    Kernels,
    NormedQ8,
    SplitK,
    decode_gemm_min_batch,
    kernel_images,
    narrow_mma_model,
    norm_fusable,
    sample_chunk_bytes,
    staged_gpu,
)
from ingot.runtime.model.architectures import ARCHITECTURES
from ingot.runtime.model.gguf import Model
from ingot.runtime.model.reference import rope_inv_freq
from ingot.runtime.sampling import SamplingParams

# The matvec epilogue that fuses each FFN activation (architectures.ACTIVATIONS) into the gate/up product.
ACTIVATION_MODES = {"silu": MODE_SWIGLU, "gelu_tanh": MODE_GEGLU}
PREFILL_CHUNK = 512  # tokens per prefill pass: bounds the prefill buffers (a 1000-token prompt = 2 passes)
DEFAULT_MAX_CTX = 8192
HIST_CAP = 256  # repetition-penalty window kept on the device (repeat_last_n is clamped to it)
PLANS_KEPT = 64  # prefill launch lists kept, by pass shape

PassShape: TypeAlias = tuple[tuple[int, bool], ...]  # a prefill pass: (tokens, samples) of each sequence, in order
Work: TypeAlias = Launch | Copy  # what a launch list holds


@dataclass
class _Seq:
    params: SamplingParams
    seed: int
    pos: int = 0  # tokens in the cache
    pages: list[int] = field(default_factory=list)
    recent: list[int] = field(default_factory=list)  # last `window` tokens (prompt included)
    chain: PrefixChain = field(default_factory=PrefixChain)  # hashes of its full pages (the prefix cache)
    window: int = field(init=False)  # repetition-penalty window kept (0: no penalty, nothing kept)
    # Its last sampled token (what a FROM_DEVICE decode token means): on the host once its step is collected,
    # until then the step that samples it and its row in that step's output
    token: int | None = None
    sampler: tuple[_Launched, int] | None = None

    def __post_init__(self) -> None:
        p = self.params
        self.window = min(p.repeat_last_n, HIST_CAP) if p.repetition_penalty != 1.0 else 0


@dataclass(eq=False)
class _Launched:
    """A step queued by launch() and not collected yet: what collect() reads back and books."""

    slot: _Slot
    B: int = 0  # decode rows: the output's first B rows, then a row per chunk that samples
    rows: list[tuple[int, _Seq]] = field(default_factory=list)  # (sequence id, state) of each output row
    # the decode rows whose token the previous step samples: (sequence id, state, its row in that step's output)
    fed: list[tuple[int, _Seq, int]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # the chunks that sample, in row order (rows B..)
    chunks: int = 0
    side: bool = False  # work was queued on the side stream (slot.side_done is recorded after it)

    def samples(self, q: int, st: _Seq) -> None:
        """The output's next row is sequence q's next token: FROM_DEVICE means that row until collect()."""
        st.token, st.sampler = None, (self, len(self.rows))
        self.rows.append((q, st))


@dataclass
class _Slot:
    """What each of the two steps that may be in flight at once owns (they alternate): its sampled tokens (the
    decode's B rows, then its prefills' sampled rows) on the host and on the device (the next step copies the
    tokens it feeds from there), and the events that order and finish it."""

    out_host: PinnedBuffer  # [2 max_seqs] int32
    out_dev: int  # [2 max_seqs] int32, device
    decoded: Event  # main stream, after the decode's readback
    finished: Event  # main stream, after all of the step's work there
    side_done: Event  # side stream, after all of the step's work there

    def close(self) -> None:
        for x in (self.out_host, self.decoded, self.finished, self.side_done):
            x.close()


@dataclass(frozen=True)
class _PassPlan:
    """A prefill pass's launches: its layers (the pass's own buffers only) and its head (norm, logits and
    sampling of the sampled rows, through the decode step's buffers)."""

    body: list[Work]
    head: list[Work]

    @property
    def launches(self) -> list[Work]:
        """Both, in order (one stream)."""
        return [*self.body, *self.head]


@dataclass
class _Pass:
    """A prefill pass being filled (CudaEngine._launch_prefill): up to PREFILL_CHUNK tokens of several sequences."""

    shape: list[tuple[int, bool]] = field(default_factory=list)  # (tokens, samples) of each sequence, in row order
    written: list[tuple[_Seq, list[int]]] = field(default_factory=list)  # each sequence's tokens, for pages.append
    sampled: list[int] = field(default_factory=list)  # the chunks it samples, in sampling-row order
    tokens: int = 0
    masked: bool = False  # a sampling row has an allowed-token mask (its upload then includes the masks)
    pending: set[bytes] = field(default_factory=set)  # hashes of the KV pages it will register (prefix cache)


class _HostDevice:
    """Named arrays mirrored in pinned host memory and one device buffer, uploaded with one copy.

    The copy from pinned memory is truly asynchronous: it runs when the stream reaches it, possibly after the
    host has moved on. So the host must not rewrite the arrays until the last upload has executed
    (wait_copied), or that upload sends the new values: a prefill of three or more chunks, whose third chunk's
    tokens were written while the second's copy still queued behind the first chunk's kernels, did exactly that.
    """

    def __init__(self, pool: DevicePool, spec: list[tuple[str, type, int]]):
        offsets, off = {}, 0
        for name, dtype, count in spec:
            off = (off + 15) & ~15
            offsets[name] = (off, dtype, count)
            off += np.dtype(dtype).itemsize * count
        self.nbytes = off
        self.pinned = PinnedBuffer(off)
        self.dev = pool.alloc(off, "step inputs")
        self.host = {n: self.pinned.view(dt, o, c) for n, (o, dt, c) in offsets.items()}
        self.ptr = {n: self.dev.ptr + o for n, (o, dt, c) in offsets.items()}
        self._offsets = offsets
        self._copied = Event()  # recorded after each upload
        self._pending = False

    def upload(self, stream: Stream, first: str | None = None, last: str | None = None) -> None:
        """Copy the fields from `first` through `last` (in declaration order; default: all) in one transfer."""
        lo = self._offsets[first][0] if first else 0
        if last:
            o, dt, c = self._offsets[last]
            hi = o + np.dtype(dt).itemsize * c
        else:
            hi = self.nbytes
        stream.upload(self.dev.ptr + lo, self.pinned.array[lo:hi])
        self._copied.record(stream)
        self._pending = True

    def wait_copied(self) -> None:
        """Block until the last upload has read the host arrays, so they may be rewritten."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def close(self) -> None:
        self._copied.close()
        self.pinned.close()


class _Ops:
    """The primitives CudaEngine._forward writes the model in, launched for n rows (tokens) of one path. Each
    appends its launches to L; norm/attention/ffn return the activation the next matrix product reads (a
    pointer, or the (xq, xd) pair of q8x2 activations)."""

    qkv: int  # where the q, k, v product goes: [n, (H + 2 Hkv) hd] fp32
    o: int  # where a projection goes before its post-norm add: [n, D] fp32

    def __init__(self, e: CudaEngine, n: int, xbuf: DeviceBuffer, tokens: int, x: int | None = None):
        """xbuf: the residual stream [n, D] fp32 (x: where its rows start, if not at the buffer's start)."""
        self.e, self.k, self.c, self.n, self.tokens = e, e.k, e.config, n, tokens
        self.xbuf, self.x = xbuf, xbuf.ptr if x is None else x
        self.L: list[Launch] = []

    def embed(self, scale: float) -> None:
        self.L.append(self.k.embed(self.e.w.embed, self.tokens, self.xbuf, self.n, scale=scale))

    def norm_outs(self, W) -> tuple[dict, Act]:
        """Where a normalized activation goes for a product with W: rmsnorm's output arguments, and the
        activation as W's product reads it."""
        raise NotImplementedError

    def norm(self, x: int, w: DeviceBuffer, W) -> Act:
        """rmsnorm(x[n, D]) * w, for a product with W."""
        c = self.c
        outs, act = self.norm_outs(W)
        self.L.append(self.k.rmsnorm(x, w, self.n, c.dim, c.norm_eps, **outs))
        return act

    def linear(self, W, xin: Act, out: int, ld: int, bias: DeviceBuffer | None = None) -> None:
        raise NotImplementedError

    def attention(self, layer: int, lw: LayerWeights) -> Act:
        raise NotImplementedError

    def project(self, W, xin: Act, mode: int) -> None:
        """x (MODE_ADD) or o (MODE_STORE) [n, D] = W · xin."""
        raise NotImplementedError

    def residual(self, W, xin: Act, post_norm: DeviceBuffer | None, then: Norm | None) -> Act | None:
        """x += W · xin, or x += rmsnorm(W · xin) * post_norm (post-norm architectures); then the norm `then`
        (weights, and the matrix the result feeds) of the new x, fused into the post-norm add when there is one.
        Returns that normalized activation (None without `then`)."""
        c = self.c
        if post_norm is None:
            self.project(W, xin, MODE_ADD)
            return self.norm(self.x, *then) if then else None
        self.project(W, xin, MODE_STORE)
        outs, act = self.norm_outs(then[1]) if then else ({}, None)
        w_next = then[0] if then else None
        self.L.append(self.k.add_rmsnorm(self.x, self.o, post_norm, self.n, c.dim, c.norm_eps, w_next=w_next, **outs))
        return act

    def ffn(self, wgu, xin: Act, activation: str, wdown) -> Act:
        raise NotImplementedError

    def _decode_attention(self, layer: int, lw: LayerWeights, splits: int, **outs) -> Launch:
        """The fused decode attention of one new token per sequence (cuda/attention.cu)."""
        e, c, s = self.e, self.c, self.e.step
        return self.k.attn_decode(
            e.qkv.ptr,
            e.rope_table(layer),
            e.k_cache[layer].ptr,
            e.v_cache[layer].ptr,
            s.ptr["block_table"],
            e.max_pages,
            s.ptr["pos"],
            e.part_acc.ptr,
            e.part_ml.ptr,
            e.counters.ptr,
            e.att.ptr,
            self.n,
            splits,
            c,
            scale=c.attn_scale,
            window=c.layer_window(layer),
            softcap=c.attn_softcap,
            q_norm=lw.q_norm,
            k_norm=lw.k_norm,
            eps=c.norm_eps,
            **outs,
        )


# an activation as a matrix product reads it: fp32/fp16 pointer, q8x2 (xq, xd), or q8x2 with its norm's scale to come
Act = int | tuple[int, int] | NormedQ8
Norm = tuple[DeviceBuffer, Any]  # an RMSNorm's weights, and the matrix its output feeds


class _MatvecOps(_Ops):
    """Batch decode (up to gemm_min_batch - 1 sequences): matrix-vector products on q8x2 (quantized weights) or
    fp32 (F16 weights) activations, SwiGLU/GEGLU fused into the gate/up product; the whole step is captured in
    a CUDA graph. Llama: 8 launches per layer; 6 for one sequence, whose pre-norms are fused into the residual
    projection before each (matvec_<type>_b1n, residual below)."""

    def __init__(self, e: CudaEngine, n: int, *, splits: int = 1, x: int | None = None):
        super().__init__(e, n, e.x, e.step.ptr["tokens"], x)
        self.splits, self.qkv, self.o = splits, e.qkv.ptr, e.o.ptr

    def _q8(self) -> tuple[int, int]:
        return (self.e.xq.ptr, self.e.xd.ptr)

    def norm_outs(self, W) -> tuple[dict, Act]:
        e = self.e
        return ({"yq": e.xq, "yd": e.xd}, self._q8()) if W.quantized else ({"y": e.xf}, e.xf.ptr)

    def _matvec(self, W, xin: Act, out: int, ld: int, **kw) -> None:
        """W · xin for this batch into out (row stride ld), as the model allows (narrow_mma: matvec_<type>_mma)."""
        self.L += self.k.matvec(W, xin, out, self.n, ldy=ld, narrow=self.e.narrow_mma, **kw)

    def linear(self, W, xin: Act, out: int, ld: int, bias: DeviceBuffer | None = None) -> None:
        self._matvec(W, xin, out, ld, bias=bias)

    def attention(self, layer: int, lw: LayerWeights) -> Act:
        q8 = lw.wo.quantized  # the merge also writes the q8x2 form the output projection reads
        e = self.e
        self.L.append(
            self._decode_attention(layer, lw, self.splits, outq=e.xq.ptr if q8 else None, outd=e.xd.ptr if q8 else None)
        )
        return self._q8() if q8 else e.att.ptr

    def project(self, W, xin: Act, mode: int) -> None:
        self._matvec(W, xin, self.x if mode == MODE_ADD else self.o, self.c.dim, mode=mode)

    def residual(self, W, xin: Act, post_norm: DeviceBuffer | None, then: Norm | None) -> Act | None:
        """One sequence, pre-norm: x += W · xin with the next norm in the same launch (matvec_<type>_b1n); the
        product reading it applies the norm's scale (NormedQ8). Otherwise as _Ops."""
        if post_norm is None and then is not None and norm_fusable(W, then[1], self.n):
            e = self.e
            out = NormedQ8(e.nq.ptr, e.nd.ptr, e.nss.ptr, self.c.norm_eps)
            self.L.append(self.k.matvec_norm(W, xin, self.x, then[0], out))
            return out
        return super().residual(W, xin, post_norm, then)

    def ffn(self, wgu, xin: Act, activation: str, wdown) -> Act:
        e, F = self.e, self.c.ffn_dim
        if wgu.uniform:
            self._matvec(wgu, xin, e.h.ptr, F, mode=ACTIVATION_MODES[activation])
        else:  # gate and up in different quant types: no fused epilogue pairs their rows
            self._matvec(wgu, xin, e.gu.ptr, 2 * F)
            self.L.append(self.k.gated_act(activation, e.gu.ptr, F, self.n, hf=e.h.ptr))
        if not wdown.quantized:
            return e.h.ptr
        self.L.append(self.k.quantize(e.h.ptr, e.xq.ptr, e.xd.ptr, self.n * F))
        return self._q8()


class _GemmOps(_Ops):
    """Tensor-core GEMMs on fp16 activations (xh), fp32 outputs; the FFN activation is its own kernel."""

    def __init__(
        self,
        e: CudaEngine,
        n: int,
        x: DeviceBuffer,
        tokens: int,
        *,
        xh: int,
        qkv: int,
        gu: int,
        o: int,
        split_k: SplitK | None,
        slice_rows: int | None = None,
    ):
        super().__init__(e, n, x, tokens)
        self.xh, self.qkv, self.gu, self.o, self.split_k = xh, qkv, gu, o, split_k
        self.slice_rows = slice_rows  # K sliced as for this many rows, whatever n (Kernels.matmul)

    def norm_outs(self, W) -> tuple[dict, Act]:
        return {"yh": self.xh}, self.xh

    def linear(self, W, xin: Act, out: int, ld: int, bias: DeviceBuffer | None = None) -> None:
        assert isinstance(xin, int)
        self.L += self.k.matmul(
            W, xin, out, self.n, ldc=ld, bias=bias, split_k=self.split_k, slice_rows=self.slice_rows
        )

    def project(self, W, xin: Act, mode: int) -> None:
        assert isinstance(xin, int)
        out = self.x if mode == MODE_ADD else self.o
        self.L += self.k.matmul(
            W, xin, out, self.n, ldc=self.c.dim, mode=mode, split_k=self.split_k, slice_rows=self.slice_rows
        )

    def ffn(self, wgu, xin: Act, activation: str, wdown) -> Act:
        F = self.c.ffn_dim
        self.linear(wgu, xin, self.gu, 2 * F)
        self.L.append(self.k.gated_act(activation, self.gu, F, self.n, hh=self.xh))
        return self.xh


class _GemmDecodeOps(_GemmOps):
    """Decode for wide batches (>= gemm_min_batch sequences): weights read once for all of them, split-K for
    parallelism; the attention is the fused decode kernel, writing fp16 for the output projection."""

    def __init__(self, e: CudaEngine, n: int, *, splits: int):
        super().__init__(
            e, n, e.x, e.step.ptr["tokens"], xh=e.xh.ptr, qkv=e.qkv.ptr, gu=e.gu.ptr, o=e.o.ptr, split_k=e.split_k
        )
        self.splits = splits

    def attention(self, layer: int, lw: LayerWeights) -> Act:
        self.L.append(self._decode_attention(layer, lw, self.splits, outh=self.xh))
        return self.xh


class _PrefillOps(_GemmOps):
    """A prefill pass: up to PREFILL_CHUNK tokens of one or more sequences, `lengths[r]` consecutive rows of
    sequence r (block-table row r of the prefill inputs). [q/k norms,] rope and the cache write for all tokens
    (pre.slots names each token's row), then flash attention on each sequence's rows (one launch for all of them
    with the tensor-core kernel: pre.starts holds where each sequence's rows start). GEMMs split K as for a
    full pass of PREFILL_CHUNK rows whatever the pass's rows (INGOT_PREFILL_SPLIT_K; their own scratch, as the
    pass runs beside the decode step): a row's result does not depend on the pass it was in."""

    def __init__(self, e: CudaEngine, lengths: tuple[int, ...]):
        super().__init__(
            e,
            sum(lengths),
            e.px,
            e.pre.ptr["tokens"],
            xh=e.pxh.ptr,
            qkv=e.pqkv.ptr,
            gu=e.pgu.ptr,
            o=e.po.ptr,
            split_k=e.prefill_split_k,
            slice_rows=PREFILL_CHUNK,
        )
        self.lengths = lengths

    def attention(self, layer: int, lw: LayerWeights) -> Act:
        e, c, k, p = self.e, self.c, self.k, self.e.pre
        kc, vc = e.k_cache[layer].ptr, e.v_cache[layer].ptr
        rope = e.rope_table(layer)
        self.L.append(
            k.rope_kv(
                self.qkv,
                rope,
                p.ptr["slots"],
                p.ptr["pos"],
                p.ptr["block_table"],
                e.max_pages,
                kc,
                vc,
                self.n,
                c,
                q_norm=lw.q_norm,
                k_norm=lw.k_norm,
                eps=c.norm_eps,
            )
        )
        if k.prefill_mma:
            self.L.append(
                k.attn_prefill_varlen(
                    self.qkv,
                    e.qkv_dim,
                    kc,
                    vc,
                    p.ptr["block_table"],
                    e.max_pages,
                    p.ptr["pos"],
                    p.ptr["starts"],
                    self.lengths,
                    self.xh,
                    c,
                    scale=c.attn_scale,
                    window=c.layer_window(layer),
                    softcap=c.attn_softcap,
                )
            )
            return self.xh
        start = 0
        for r, n in enumerate(self.lengths):  # rows [start, start + n): sequence r's tokens, in position order
            self.L.append(
                k.attn_prefill(
                    self.qkv + 4 * start * e.qkv_dim,
                    e.qkv_dim,
                    kc,
                    vc,
                    p.ptr["block_table"] + 4 * r * e.max_pages,
                    p.ptr["pos"] + 4 * start,
                    n,
                    self.xh + 2 * start * c.n_heads * c.head_dim,
                    c,
                    scale=c.attn_scale,
                    window=c.layer_window(layer),
                    softcap=c.attn_softcap,
                )
            )
            start += n
        return self.xh


# The architectures whose block the GPU engine runs: all that architectures.py describes, since every feature an
# Architecture can have is a primitive of _Ops (driven by Config.block) — a new Llama-like architecture is an
# entry there, nothing here. What the kernels lack is refused by name in CudaEngine.__init__ (an activation
# without a kernel, final-logit softcapping).
GPU_ARCHITECTURES = tuple(ARCHITECTURES)


def layer_matrix_bytes(model: Model) -> dict[str, int]:
    """A decoder layer's matrix bytes by quant type, averaged over the layers (mixes such as Q4_K_M give some
    layers' matrices more bits): what decides whether decode is launch- or bandwidth-bound, and which GEMM serves it."""
    by_type: dict[str, int] = {}
    for t in model.tensors.values():
        if t.name.startswith("blk.") and len(t.shape) == 2:
            by_type[t.qtype] = by_type.get(t.qtype, 0) + t.nbytes
    return {q: n // model.config.n_layers for q, n in by_type.items()}


class CudaEngine:
    name = "cuda"
    kv_page_size = PAGE

    def __init__(
        self,
        model: Model,
        *,
        kernels: dict[str, bytes] | None = None,
        gpu: int = 0,
        max_seqs: int = 4,
        max_ctx: int | None = None,
        kv_pages: int | None = None,
        prefix_cache: bool | None = None,
    ):
        c = self.config = model.config
        self.model = model
        if c.arch not in ARCHITECTURES:
            raise IncompatibleError(
                f"architecture {c.arch} is not supported by the GPU engine yet",
                hint=f"it runs {', '.join(GPU_ARCHITECTURES)}; use --device cpu",
            )
        if c.block.activation not in ACTIVATION_KERNELS:
            raise IncompatibleError(
                f"the {c.block.activation} FFN activation of {c.arch} has no GPU kernel yet", hint="use --device cpu"
            )
        if c.final_softcap:
            raise IncompatibleError(
                "final logit softcapping is not implemented by the GPU engine yet", hint="use --device cpu"
            )
        if c.n_heads % c.n_kv_heads or c.n_heads // c.n_kv_heads > GQA_MAX:
            raise IncompatibleError(
                f"{c.n_heads} query heads over {c.n_kv_heads} kv heads: the GPU attention kernels take groups of "
                f"up to {GQA_MAX}",
                hint="use --device cpu",
            )
        if c.head_dim not in HEAD_DIMS:
            raise IncompatibleError(
                f"head_dim {c.head_dim} is not supported by the GPU attention kernels",
                hint=f"supported: {HEAD_DIMS}; use --device cpu",
            )
        if c.dim % 32 or c.ffn_dim % 32:
            raise IncompatibleError("model dims must be multiples of 32 for the GPU kernels", hint="use --device cpu")
        self.max_seqs = max_seqs
        gemm_min_batch = settings.DECODE_GEMM_MIN_BATCH.get()  # None: chosen for the model once its kernels load
        self.qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # width of the stacked q,k,v rows
        self.max_ctx = max_ctx or min(c.n_ctx_train, DEFAULT_MAX_CTX)
        self.max_pages = (self.max_ctx + PAGE - 1) // PAGE
        self.prefix_cache = settings.PREFIX_CACHE.get() if prefix_cache is None else prefix_cache

        self.dev = Device(gpu)
        self.stream = Stream()
        # Prefill passes run on a stream of their own, beside the decode graph: their layers touch only the
        # pass's buffers; their head (x, logits, out_tokens, the sampler's scratch: the decode's) waits for
        # the decode step's readback (`_Slot.decoded`), and so do their layers when a prompt adopts a cached page the
        # decode completes (`_decode_filled`: it writes the page's last slot). INGOT_PREFILL_STREAM=0: one
        # stream, the passes behind the step.
        self.side = Stream() if settings.PREFILL_STREAM.get() else self.stream
        self._decode_queued = False  # this step's decode is queued and the side stream has not waited for it
        self._decode_filled: set[int] = set()  # the pages this step's decode completes (registered at launch)
        self._layers_after_decode = False  # a prompt of this step adopted one of them
        self.pool = DevicePool()
        try:
            self.k = Kernels(self.dev, kernels if kernels is not None else kernel_images())
            if c.head_dim not in self.k.prefill_head_dims:
                raise IncompatibleError(
                    f"head_dim {c.head_dim} needs {self.k.prefill_bytes(c.head_dim) // 1024} KiB of shared memory per "
                    f"block for prefill attention; {self.dev.info.name} allows "
                    f"{self.dev.info.max_smem_optin // 1024} KiB",
                    hint="use --device cpu, or a GPU of compute capability 8.0 or newer",
                )
            # Decode batches at least this wide use the tensor-core GEMMs (weights read once for all sequences,
            # split-K for parallelism) instead of the dp4a matrix-vector kernels (up to 4 sequences per pass).
            layer_bytes = layer_matrix_bytes(model)
            self.gemm_min_batch = gemm_min_batch or decode_gemm_min_batch(
                layer_bytes, self.k.matmul_mma, self.k.matmul_frag, staged_gpu(self.dev.info.cc)
            )
            # ... and narrower ones of small models, MATVEC_MMA_TYPES on the integer tensor cores (matvec_<type>_mma)
            self.narrow_mma = narrow_mma_model(layer_bytes)
            self.w = upload_weights(model, self.pool, self.stream, self.k)
            self._alloc_cache(kv_pages)
            self._alloc_buffers()
        except BaseException:
            self.close()
            raise
        self.layout = WEIGHT_LAYOUT
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._graphs: dict[int, Graph] = {}
        self._prefill_plans: dict[tuple[PassShape, bool], _PassPlan] = {}
        self._bt_signature: tuple | None = None
        self._row_of: list[_Seq | None] = [None] * self.max_seqs  # whose sampling fields each decode row holds
        self._flight: list[_Launched] = []  # launched, not collected (at most 2), oldest first
        self._slot = self._slots[0]  # the slot of the step being launched

    # --- memory ----------------------------------------------------------------------------------

    def _alloc_cache(self, kv_pages: int | None) -> None:
        c = self.config
        page_bytes = PAGE * c.n_kv_heads * c.head_dim * 2  # one page of K (or V) of one layer, fp16
        if kv_pages is None:
            want = self.max_seqs * self.max_pages
            free, _ = self.dev.memory()
            per_page = 2 * c.n_layers * page_bytes  # k and v of every layer
            one_seq = self.max_pages * per_page
            if one_seq > free:  # (refused before any allocation: the OOM would come layers in, after seconds)
                raise UsageError(
                    f"a {self.max_ctx:,}-token context needs {one_seq / 2**30:,.1f} GiB of KV cache a sequence on "
                    f"the GPU, more than the {free / 2**30:,.1f} GiB free on {self.dev.info.name}",
                    hint="ask for fewer tokens of context",
                )
            budget = int(settings.KV_FRACTION.get() * free)
            kv_pages = max(self.max_pages, min(want, budget // per_page))
        self.pages = PagePool(kv_pages, PAGE, prefix_cache=self.prefix_cache)
        self.kv_pages_total = kv_pages
        self.k_cache = [self.pool.alloc(kv_pages * page_bytes, f"k cache {i}") for i in range(c.n_layers)]
        self.v_cache = [self.pool.alloc(kv_pages * page_bytes, f"v cache {i}") for i in range(c.n_layers)]
        # rope[pos, i] = (cos, sin)(pos * theta_i), computed in float64 exactly as the CPU reference does: one
        # table per distinct (base, linear scale) of the layers (Gemma 3: local and global), shared by its layers
        self.rope_tables: dict[tuple[float, float], DeviceBuffer] = {}
        tables = []
        for layer in range(c.n_layers):
            key = c.layer_rope(layer)
            if key not in self.rope_tables:
                angle = np.arange(self.max_ctx, dtype=np.float64)[:, None] * rope_inv_freq(c, layer)[None, :]
                tables.append(np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32))
                self.rope_tables[key] = self.pool.alloc(tables[-1].nbytes, f"rope table {key[0]:g}")
                self.stream.upload(self.rope_tables[key].ptr, tables[-1])
        self.stream.synchronize()

    def rope_table(self, layer: int) -> DeviceBuffer:
        """The (cos, sin) table [max_ctx, rope_dim/2] of the layer's RoPE base."""
        return self.rope_tables[self.config.layer_rope(layer)]

    def _alloc_buffers(self) -> None:
        c, B, T = self.config, self.max_seqs, PREFILL_CHUNK
        D, F, V = c.dim, c.ffn_dim, c.n_vocab
        self.mask_words = (V + 31) // 32  # an allowed-token bitmask row
        Dq, Dqkv = c.n_heads * c.head_dim, self.qkv_dim
        widest = max(D, Dq, F)
        a = self.pool.alloc
        # decode, for up to B sequences
        self.step = _HostDevice(self.pool, self._input_fields(B))
        self.step.host["slots"][:] = np.arange(B)
        self.out_tokens = a(4 * B, "sampled tokens")
        out_dev = a(2 * 4 * 2 * B, "sampled tokens of the last two steps")
        self._slots = [
            _Slot(PinnedBuffer(4 * 2 * B), out_dev.ptr + i * 4 * 2 * B, *(Event(timing=False) for _ in range(3)))
            for i in range(2)
        ]
        self.x = a(4 * B * D, "x")
        self.xf = a(4 * B * widest, "x fp32 normed")
        self.xq = a(2 * B * widest, "x q8x2")  # two int8 levels per value
        self.xd = a(16 * B * widest // 32, "x q8x2 scales")  # float4 per 32 values
        self.qkv = a(4 * B * Dqkv, "qkv")
        self.att = a(4 * B * Dq, "attention out")
        self.h = a(4 * B * F, "ffn hidden")
        self.xh = a(2 * B * widest, "x fp16 (wide-batch decode)")
        self.gu = a(4 * B * 2 * F, "gate/up (wide-batch decode; batch decode of unevenly quantized gate/up)")
        self.o = a(4 * B * D, "projection out (post-norm architectures)")
        # single-sequence decode's fused norms (matvec_<type>_b1n): their q8x2 output, apart from xq/xd, which the
        # projection writing it reads; the partial sums zero past D/32 (the reader loads whole float4s)
        self.nq, self.nd = a(2 * D, "fused norm q8x2"), a(16 * D // 32, "fused norm q8x2 scales")
        self.nss = a(4 * max(D, MATVEC_NORM_MAX) // 32, "fused norm partial sums of squares")
        self.stream.memset(self.nss.ptr, 0, self.nss.nbytes)
        self.logits_buf = a(4 * B * V, "logits")
        self.split_room = self.k.attn_decode_split_room(B, c)  # partials [b, H, splits(b), hd] for any b <= B
        self.part_acc = a(4 * self.split_room * c.n_heads * c.head_dim, "attention partials")
        self.part_ml = a(8 * self.split_room * c.n_heads, "attention partial m,l")
        self.counters = a(4 * B * c.n_kv_heads, "attention split counters")  # zero between launches
        self.split_k = self.k.split_k(self.pool, self.stream)  # wide-batch decode's GEMM scratch
        # the prefill passes' own (they run on the side stream, beside the decode graph): None, no split-K
        self.prefill_split_k = (
            self.k.split_k(self.pool, self.stream, self.w.shapes(), PREFILL_CHUNK)
            if settings.PREFILL_SPLIT_K.get()
            else None
        )
        # sample_prep_f32's per-chunk results (decode's B rows; prefill's one row reuses row 0, stream-ordered)
        self.sample_chunks = a(sample_chunk_bytes(V, B), "sampler chunk results")
        self.stream.memset(self.counters.ptr, 0, self.counters.nbytes)
        # prefill, for up to T tokens of up to B sequences per pass: token i belongs to block-table row slots[i];
        # the sampling fields have a row per sequence that samples (its prompt's last token is in the pass)
        self.pre = _HostDevice(self.pool, self._input_fields(T))
        self.px = a(4 * T * D, "prefill x")
        self.pxh = a(2 * T * widest, "prefill x fp16")
        self.pqkv = a(4 * T * Dqkv, "prefill qkv")
        self.pgu = a(4 * T * 2 * F, "prefill gate/up")
        self.po = a(4 * T * D, "prefill projection out (post-norm architectures)")
        # Every row's logits (logits(): perplexity, tests), [T, V] fp32: allocated on first use, as it is large for
        # big vocabularies (512 x 262,144 x 4 bytes = 512 MiB for Gemma 3) and serving never needs it.
        self._all_logits: DeviceBuffer | None = None
        # The memsets above (split-K counters) ran on the main stream; the prefill's are first used on the side
        # stream, which waits on nothing before a server's first step.
        self.stream.synchronize()

    def _input_fields(self, rows: int) -> list[tuple[str, type, int]]:
        """The inputs of a decode step (rows = B sequences) or a prefill pass (rows = T tokens): per row its token,
        position and block-table row (slots); per sampling row (up to B) its sampling parameters, penalty window
        and allowed-token mask; B block-table rows. In this order: an upload sends a prefix of them (_HostDevice),
        the penalty window, block tables and masks only when needed."""
        B = self.max_seqs
        return [
            ("tokens", np.int32, rows),
            ("pos", np.int32, rows),
            ("slots", np.int32, rows),
            ("starts", np.int32, B + 1),  # prefill: where each sequence's rows start, then the pass's rows
            ("top_k", np.int32, B),
            ("hist_len", np.int32, B),
            ("counter", np.int32, B),
            ("masked", np.int32, B),  # constrained decoding: row b's mask applies (runtime/structured.py)
            ("temperature", np.float32, B),
            ("top_p", np.float32, B),
            ("min_p", np.float32, B),
            ("penalty", np.float32, B),
            ("seed", np.uint64, B),
            ("hist", np.int32, B * HIST_CAP),
            ("block_table", np.int32, B * self.max_pages),
            ("mask", np.uint32, B * self.mask_words),  # uploaded only with a masked row
        ]

    def close(self) -> None:
        """Free everything on the GPU. Safe to call twice."""
        for g in getattr(self, "_graphs", {}).values():
            g.close()
        self._graphs = {}
        for name in ("step", "pre"):
            if hasattr(self, name):
                getattr(self, name).close()
        for slot in getattr(self, "_slots", []):
            slot.close()
        self._slots = []
        if hasattr(self, "side") and self.side is not self.stream:
            self.side.close()
        for name in ("k", "pool", "stream"):
            if hasattr(self, name):
                getattr(self, name).close()
        if hasattr(self, "dev"):
            self.dev.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the forward pass as launch lists --------------------------------------------------------

    def _forward(self, ops: _Ops, head: Norm | None) -> Act | None:
        """The model's blocks, written once: `ops` launches each primitive for one path (matrix-vector decode,
        GEMM decode, GEMM prefill). What a block adds to Llama's is read from the architecture's description
        (Config.block, architectures.py) and the weights it brings (LayerWeights): q/k head norms and the
        layer's sliding window and RoPE table inside ops.attention, post-norms in ops.residual, the FFN
        activation in ops.ffn, the embedding scale here. Each residual add is followed by the norm that reads
        its result (one launch with a post-norm); the last one by `head` (the output norm and the matrix it
        feeds), whose output is returned (None: the caller norms what it needs)."""
        c, a, layers = self.config, self.config.block, self.w.layers
        ops.embed(math.sqrt(c.dim) if a.embed_scale_sqrt_dim else 1.0)
        h: Act | None = ops.norm(ops.x, layers[0].attn_norm, layers[0].wqkv)
        for i, lw in enumerate(layers):
            assert h is not None  # every residual but the last is followed by a norm
            ops.linear(lw.wqkv, h, ops.qkv, self.qkv_dim, bias=lw.bqkv)
            att = ops.attention(i, lw)  # [q, k = rmsnorm per head;] rope; cache write; attention
            h = ops.residual(lw.wo, att, lw.post_attn_norm, then=(lw.ffn_norm, lw.wgu))  # x += [rmsnorm](Wo att)
            assert h is not None
            f = ops.ffn(lw.wgu, h, a.activation, lw.wdown)  # act(gate h) * (up h)
            nxt = (layers[i + 1].attn_norm, layers[i + 1].wqkv) if i + 1 < len(layers) else head
            h = ops.residual(lw.wdown, f, lw.post_ffn_norm, then=nxt)  # x += [rmsnorm](Wdown f)
        return h

    def _decode_launches(self, B: int) -> list[Launch]:
        c, s = self.config, self.step
        # (within the partials' room: INGOT_DECODE_SPLITS or INGOT_DECODE_ATTN set after the engine started
        # may ask for more; fewer splits give the same attention)
        splits = min(self.k.attn_decode_splits(B, c), self.split_room // B)
        ops: _Ops = (
            _GemmDecodeOps(self, B, splits=splits) if B >= self.gemm_min_batch else _MatvecOps(self, B, splits=splits)
        )
        h = self._forward(ops, head=(self.w.out_norm, self.w.head))
        assert h is not None
        ops.linear(self.w.head, h, self.logits_buf.ptr, c.n_vocab)
        ops.L += self.k.sample(self.logits_buf.ptr, c.n_vocab, c.n_vocab, B, self._sample_args(s), self.out_tokens.ptr)
        return ops.L

    def _sample_args(self, io: _HostDevice) -> dict:
        names: tuple[str, ...] = ("temperature", "top_k", "top_p", "min_p", "penalty", "hist", "hist_len", "seed")
        names += ("counter", "masked", "mask")  # masked, mask: constrained decoding
        extra = {"hist_cap": HIST_CAP, "mask_words": self.mask_words, "chunks": self.sample_chunks.ptr}
        return {n: io.ptr[n] for n in names} | extra

    def _prefill_launches(self, shape: PassShape, all_logits: bool) -> _PassPlan:
        """The layers over one prefill pass: shape[r] = (tokens of sequence r, whether it samples), their rows
        consecutive in that order at positions pre.pos. Ends with the logits of every row (all_logits: one
        sequence) or with a token for each sampling sequence, sampled from its last row (the j-th of them in
        out_tokens[j], with the j-th row of pre's sampling fields)."""
        c, p = self.config, self.pre
        ops = _PrefillOps(self, tuple(n for n, _ in shape))
        h = self._forward(ops, head=(self.w.out_norm, self.w.head) if all_logits else None)
        if h is not None:
            ops.linear(self.w.head, h, self.all_logits.ptr, c.n_vocab)
            return _PassPlan(list(ops.L), [])
        ends = itertools.accumulate(n for n, _ in shape)
        rows = [end - 1 for end, (_, samples) in zip(ends, shape, strict=True) if samples]
        if not rows:  # chunks of prompts that go on in a later step: their sampled tokens would be discarded
            return _PassPlan(list(ops.L), [])
        # The sampled rows alone through the decode path's matrix-vector products (no GEMM tiles spent on the
        # rows nobody samples): read in place when it is the pass's last row, else gathered into x [S, D].
        row = 4 * c.dim
        gather: list[Work] = []
        if rows == [ops.n - 1]:
            x = self.px.ptr + row * rows[0]
        else:
            x = self.x.ptr
            gather = [Copy(x + row * j, self.px.ptr + row * r, row) for j, r in enumerate(rows)]
        last = _MatvecOps(self, len(rows), x=x)
        h = last.norm(last.x, self.w.out_norm, self.w.head)
        last.linear(self.w.head, h, self.logits_buf.ptr, c.n_vocab)
        V = c.n_vocab
        sample = self.k.sample(self.logits_buf.ptr, V, V, len(rows), self._sample_args(p), self.out_tokens.ptr)
        return _PassPlan(list(ops.L), [*gather, *last.L, *sample])

    # --- sequences -------------------------------------------------------------------------------

    def new_sequence(self, params: SamplingParams) -> int:
        if len(self._seqs) >= self.max_seqs:
            raise IngotError(f"all {self.max_seqs} sequences are in use", hint="release one first")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = _Seq(params=params, seed=seed & (2**64 - 1))
        return sid

    def release(self, seq: int) -> None:
        st = self._seqs.pop(seq, None)
        if st is not None:
            self.pages.release(st.pages)

    def seq_len(self, seq: int) -> int:
        return self._seq(seq).pos

    def _seq(self, seq: int) -> _Seq:
        try:
            return self._seqs[seq]
        except KeyError:
            raise IngotError(f"unknown sequence {seq}") from None

    def _reserve(self, st: _Seq, n_new: int) -> bool:
        self._check_room(st, n_new)
        return self.pages.grow(st.pages, st.pos + n_new)

    def _check_room(self, st: _Seq, n_new: int) -> None:
        if st.pos + n_new > self.max_ctx:
            raise UsageError(
                f"sequence would grow to {st.pos + n_new} tokens, past the context of {self.max_ctx}",
                hint="shorten the prompt or lower max tokens",
            )

    def _adopt(self, st: _Seq, tokens: list[int], *, sample: bool) -> int:
        """Prefix cache: append the cached pages that hold the prompt's leading full pages to the sequence's
        block table (kvcache.py decides which: PagePool.adopt); returns how many tokens they hold, which prefill
        skips."""
        n = self.pages.adopt(st.pages, st.chain, tokens, sample=sample)
        self._remember(st, tokens[:n])
        st.pos += n
        return n

    def _remember(self, st: _Seq, tokens: Sequence[int]) -> None:
        """Keep the repetition-penalty window (only a sequence with a penalty needs one)."""
        if st.window:
            st.recent = (st.recent + list(tokens))[-st.window :]

    def _fill_sampling(self, io: _HostDevice, row: int, st: _Seq) -> None:
        h, p = io.host, st.params
        h["temperature"][row] = p.temperature
        h["top_k"][row] = p.top_k
        h["top_p"][row] = p.top_p
        h["min_p"][row] = p.min_p
        h["penalty"][row] = p.repetition_penalty
        h["seed"][row] = st.seed
        h["counter"][row] = st.pos
        h["hist_len"][row] = len(st.recent)
        if st.recent:
            h["hist"][row * HIST_CAP : row * HIST_CAP + len(st.recent)] = st.recent

    # --- the Engine interface ----------------------------------------------------------------------

    def prefill(self, seq: int, tokens: Sequence[int], mask: np.ndarray | None = None) -> int:
        token = self.prefill_many([PrefillChunk(seq, tokens, True, mask)])[0]
        assert token is not None  # a last chunk samples
        return token

    def prefill_many(self, chunks: Sequence[PrefillChunk]) -> list[int | None]:
        return self.decode_and_prefill([], [], None, chunks)[1]

    def decode_and_prefill(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> tuple[list[int], list[int | None]]:
        """decode(seqs, tokens, masks) and prefill_many(chunks) with one wait: the decode step's graph is launched,
        then the prefill passes are queued on the side stream while it runs (their launches cost host time; their
        layers run beside the graph, their heads after its readback: _flush), and the tokens of both are read back
        at once."""
        self._none_in_flight()
        return self.collect(self.launch(seqs, tokens, masks, chunks))

    def _none_in_flight(self) -> None:
        """The calls that wait for their own work (decode_and_prefill and the calls made of it, logits) run with
        no launched step uncollected: theirs would be collected out of order, and logits() reuses the prefill
        buffers a pass in flight may still read."""
        if self._flight:
            raise RuntimeError("a launched step is not collected yet: collect it first")

    def launch(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        chunks: Sequence[PrefillChunk],
    ) -> _Launched:
        """Queue a step (decode_and_prefill without the wait). With a step n still in flight, this step n + 1 is
        ordered behind it stream by stream: its decode after step n's prefill heads (they use the decode's
        buffers, and sampled tokens this step may feed), its prefill passes after step n's decode (a page that
        decode completes may be adopted now). A FROM_DEVICE token of a sequence step n samples is copied on the
        device from step n's output (_launch_decode); the pages it completes are registered when step n is
        collected, once the token is known."""
        if len(self._flight) >= 2:
            raise RuntimeError("two steps are in flight: collect the older one first")
        states = self._check(chunks, seqs)  # the whole step checked before any work
        prev = self._flight[-1] if self._flight else None
        slot = self._slot = self._slots[1] if prev is not None and prev.slot is self._slots[0] else self._slots[0]
        if prev is not None:
            if prev.side:
                self.stream.wait(prev.slot.side_done)
            if prev.B and self.side is not self.stream:
                self.side.wait(prev.slot.decoded)
        self._decode_filled.clear()
        self._layers_after_decode = False
        h = _Launched(slot)
        try:
            B = self._launch_decode(seqs, tokens, masks, h, prev) if seqs else 0
            if B:
                slot.decoded.record(self.stream)  # after its readback: the prefill heads may use its buffers
            self._decode_queued = bool(B)
            h.sampled = self._launch_prefill(chunks, states, first=B)
        except BaseException:
            with contextlib.suppress(Exception):  # (the error raised is the first one)
                self.stream.synchronize()
                self.side.synchronize()  # nothing queued may outlive the call (its sequences' pages go back)
            raise
        h.chunks = len(chunks)
        for i in h.sampled:
            h.samples(chunks[i].seq, states[i])
        slot.finished.record(self.stream)
        if self.side is not self.stream and chunks:
            slot.side_done.record(self.side)
            h.side = True
        self._flight.append(h)
        return h

    def collect(self, launched: _Launched) -> tuple[list[int], list[int | None]]:
        """Wait for the oldest launched step; its decode's tokens and each chunk's sampled token (None for a chunk
        that samples none). The books it settles: each sampling sequence's token, and the prefix-cache pages that
        the next launched step's device-fed tokens complete."""
        h = launched
        if not self._flight or h is not self._flight[0]:
            raise RuntimeError("steps are collected in the order they were launched")
        self._flight.pop(0)
        h.slot.finished.synchronize()
        if h.side:
            h.slot.side_done.synchronize()
        B, got = h.B, h.slot.out_host.view(np.int32, 0, len(h.rows)).tolist()
        for (_, st), token in zip(h.rows, got, strict=True):
            if st.sampler is not None and st.sampler[0] is h:
                st.token, st.sampler = token, None
        nxt = self._flight[0] if self._flight else None
        if nxt is not None:
            for q, st, row in nxt.fed:
                if self._seqs.get(q) is st:  # (not released since)
                    self.pages.append(st.pages, st.chain, (got[row],))  # written by nxt's decode, which runs first
        out: list[int | None] = [None] * h.chunks
        for i, token in zip(h.sampled, got[B:], strict=True):
            out[i] = token
        return got[:B], out

    def _launch_prefill(self, chunks: Sequence[PrefillChunk], states: list[_Seq], first: int) -> list[int]:
        """Queue the chunks' tokens in passes of up to PREFILL_CHUNK tokens, several sequences per pass (a chunk
        that does not fit what is left of a pass goes on in the next one); each last chunk's token is sampled in
        the pass that holds its last token and read back into out_host[first + k] for the k-th. Returns the
        chunks that sample, in that order.

        Prefix cache: each chunk adopts the cached pages it can just before it is placed. A chunk whose next page
        is one that the pass being filled will compute (two prompts of one step sharing a system prompt) starts
        a new pass instead, so that it adopts those pages once the pass has registered them, as it would have
        had the two prompts come one after the other."""
        p, P = self.pre, self.kv_page_size
        sampled: list[int] = []
        ps = _Pass()
        for i, (c, st) in enumerate(zip(chunks, states, strict=True)):
            tokens = [int(t) for t in c.tokens]
            if ps.pending and not st.chain.tail and set(self.pages.page_hashes(st.chain, tokens[:P])) & ps.pending:
                sampled += self._flush(ps, first + len(sampled))
                ps = _Pass()
            held = len(st.pages)
            rest = tokens[self._adopt(st, tokens, sample=c.last) :]  # a last chunk always computes its last token
            if self._decode_filled and not self._decode_filled.isdisjoint(st.pages[held:]):
                self._layers_after_decode = True  # this pass and the later ones read a page the decode completes
            if not rest:
                continue
            self._reserve(st, len(rest))
            if self.pages.prefix_cache:
                ps.pending.update(self.pages.page_hashes(st.chain, rest))
            done = 0
            while done < len(rest):
                if ps.tokens == PREFILL_CHUNK:
                    sampled += self._flush(ps, first + len(sampled))
                    ps = _Pass()
                if not ps.tokens:
                    p.wait_copied()  # the previous pass's upload has read the host arrays (see _HostDevice)
                piece = rest[done : done + PREFILL_CHUNK - ps.tokens]
                done += len(piece)
                self._place(ps, st, piece, i, samples=done == len(rest) and c.last, mask=c.mask)
        if ps.tokens:
            sampled += self._flush(ps, first + len(sampled))
        return sampled

    def _place(self, ps: _Pass, st: _Seq, piece: list[int], chunk: int, samples: bool, mask: np.ndarray | None):
        """Write a sequence's next tokens into the pass's inputs: rows ps.tokens.., block-table row r (its
        sequence's place in the pass) and, when its last token samples, sampling row j (its place among those)."""
        p, M, W = self.pre, self.max_pages, self.mask_words
        T, n, r = ps.tokens, len(piece), len(ps.shape)
        p.host["tokens"][T : T + n] = piece
        p.host["pos"][T : T + n] = np.arange(st.pos, st.pos + n)
        p.host["slots"][T : T + n] = r
        p.host["starts"][r : r + 2] = (T, T + n)
        p.host["block_table"][r * M : r * M + len(st.pages)] = st.pages
        self._remember(st, piece)
        st.pos += n
        if samples:
            j = len(ps.sampled)
            st.pos -= 1  # the sampled token's counter is the last prompt position, as in decode
            self._fill_sampling(p, j, st)
            st.pos += 1
            p.host["masked"][j] = mask is not None
            if mask is not None:
                p.host["mask"][j * W : (j + 1) * W] = mask
                ps.masked = True
            ps.sampled.append(chunk)
        ps.shape.append((n, samples))
        ps.written.append((st, piece))
        ps.tokens += n

    def _flush(self, ps: _Pass, row: int) -> list[int]:
        """Queue the pass: its inputs' upload, its launch list (built once per shape), the registration of the
        pages it fills, and the readback of its sampled tokens into out_host[row..]. Returns ps.sampled."""
        side = self.side
        if self._layers_after_decode:
            self._behind_decode()
        self.pre.upload(side, "tokens", "mask" if ps.masked else "block_table")
        plan = self._plan(tuple(ps.shape), all_logits=False)
        for launch in plan.body:
            launch(side)
        if plan.head:
            self._behind_decode()  # the head uses the decode step's buffers
            for launch in plan.head:
                launch(side)
        for st, piece in ps.written:
            self.pages.append(st.pages, st.chain, piece)  # registers the pages it filled (side-stream ordered)
        if ps.sampled:
            self._read_back(side, row, len(ps.sampled))
        return ps.sampled

    def _read_back(self, stream: Stream, row: int, n: int) -> None:
        """The n tokens a sampler just wrote (out_tokens) into rows row.. of this step's output: on the device
        (a later step may feed them, _copy_runs) and, from there, on the host (collect)."""
        slot = self._slot
        stream.copy(slot.out_dev + 4 * row, self.out_tokens.ptr, 4 * n)
        stream.download(slot.out_host.view(np.int32, 4 * row, n), slot.out_dev + 4 * row)

    def _behind_decode(self) -> None:
        """Order what is queued next on the side stream after this step's decode and its readback (a wait once
        a step: later side work is behind it too)."""
        if self._decode_queued:
            self.side.wait(self._slot.decoded)
            self._decode_queued = False

    def _check(self, chunks: Sequence[PrefillChunk], decoding: Sequence[int] = ()) -> list[_Seq]:
        """Every chunk's sequence, after checking the whole step before any work, so that a refused step changed
        nothing: known sequences, each in one chunk or decoded (not both), token ids in the vocabulary, room
        in the context, and KV pages for all of it (counted as if nothing were adopted from the prefix cache)."""
        if len(chunks) > self.max_seqs:
            raise UsageError(f"prefill of {len(chunks)} chunks at once (max {self.max_seqs})")
        if len({c.seq for c in chunks} | set(decoding)) != len(chunks) + len(decoding):
            raise UsageError("a step names a sequence twice (two chunks, or a chunk and a decode)")
        states, pages = [], 0
        for c in chunks:
            st = self._seq(c.seq)
            self._check_room(st, len(c.tokens))
            pages += self.pages.needed(st.pages, st.pos + len(c.tokens))
            states.append(st)
        # The decoded sequences, inlined (this runs for every sequence at every step): one token each, which
        # needs a page when it starts one.
        seqs, P, cap = self._seqs, self.kv_page_size, self.max_ctx
        for q in decoding:
            st = seqs[q] if q in seqs else self._seq(q)
            if st.pos >= cap:
                self._check_room(st, 1)
            pages += st.pos >= len(st.pages) * P
        for c in chunks:
            if not len(c.tokens):
                raise UsageError("prefill needs at least one token")
            if min(c.tokens) < 0 or max(c.tokens) >= self.config.n_vocab:
                raise UsageError(f"token id out of range for a vocabulary of {self.config.n_vocab}")
        self.pages.require(pages)
        return states

    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        """Every row's logits: one sequence, passes of PREFILL_CHUNK tokens, each read back."""
        self._none_in_flight()
        (st,) = self._check([PrefillChunk(seq, tokens, False)])
        tokens = [int(t) for t in tokens]
        self._reserve(st, len(tokens))
        p, out = self.pre, []
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            T = len(chunk)
            p.wait_copied()  # a prefill pass queued before (nothing waited for it) may still be reading them
            p.host["block_table"][: len(st.pages)] = st.pages
            p.host["tokens"][:T] = chunk
            p.host["pos"][:T] = np.arange(st.pos, st.pos + T)
            p.host["slots"][:T] = 0
            p.host["starts"][:2] = (0, T)
            self._remember(st, chunk)
            st.pos += T
            p.upload(self.stream, "tokens", "block_table")
            for launch in self._plan(((T, False),), all_logits=True).launches:
                launch(self.stream)
            self.pages.append(st.pages, st.chain, chunk)
            rows = np.empty((T, self.config.n_vocab), dtype=np.float32)
            self.stream.download(rows, self.all_logits.ptr)
            self.stream.synchronize()
            out.append(rows)
        return np.concatenate(out)

    @property
    def all_logits(self) -> DeviceBuffer:
        if self._all_logits is None:
            self._all_logits = self.pool.alloc(4 * PREFILL_CHUNK * self.config.n_vocab, "prefill logits (all rows)")
        return self._all_logits

    def _plan(self, shape: PassShape, all_logits: bool) -> _PassPlan:
        """The launch list of a pass of this shape, built on first use; the most recently used PLANS_KEPT are kept
        (a server sees a few shapes again and again: one prompt's chunks, a few new prompts of similar length)."""
        key = (shape, all_logits)
        plan = self._prefill_plans.pop(key, None)
        if plan is None:
            plan = self._prefill_launches(shape, all_logits)
            if len(self._prefill_plans) >= PLANS_KEPT:
                del self._prefill_plans[next(iter(self._prefill_plans))]  # the least recently used
        self._prefill_plans[key] = plan  # (re)inserted last: the dict's order is the order of use
        return plan

    def decode(
        self, seqs: Sequence[int], tokens: Sequence[int], masks: Sequence[np.ndarray | None] | None = None
    ) -> list[int]:
        return self.decode_and_prefill(seqs, tokens, masks, [])[0]

    def _launch_decode(
        self,
        seqs: Sequence[int],
        tokens: Sequence[int],
        masks: Sequence[np.ndarray | None] | None,
        h: _Launched,
        prev: _Launched | None,
    ) -> int:
        """Queue one decode step of B = len(seqs) sequences (its graph, captured on first use per B) and the
        readback of its tokens into the slot's out_host[:B] and out_dev[:B]; returns B. The sequences' books
        (positions, pages) are updated here: nothing reads them before the step's tokens are waited for. A
        FROM_DEVICE token that `prev` (the step in flight) samples is copied from prev's out_dev into this step's
        inputs after their upload, and its page registration waits for collect(prev)."""
        B = len(seqs)
        self.step.wait_copied()  # the last step's upload has read the host arrays (an exception may have cut it)
        if B > self.max_seqs or len(tokens) != B:
            raise UsageError(f"decode of {B} sequences with {len(tokens)} tokens (max {self.max_seqs})")
        states = [self._seqs[q] for q in seqs]
        fed: list[tuple[int, int]] = []  # (row here, row in prev's output) of the tokens prev samples
        if FROM_DEVICE in tokens:
            tokens = list(tokens)
            for b, (st, tok) in enumerate(zip(states, tokens, strict=True)):
                if tok != FROM_DEVICE:
                    continue
                if st.token is not None:
                    tokens[b] = st.token
                elif st.sampler is None or st.sampler[0] is not prev:
                    raise UsageError(f"sequence {seqs[b]} has no sampled token to feed")
                elif st.window:
                    raise UsageError("a sequence with a repetition penalty needs its last token on the host")
                else:
                    fed.append((b, st.sampler[1]))
                    tokens[b] = 0  # a placeholder the copy overwrites
        # What runs here runs for every sequence at every step before the GPU starts it (~10 us a sequence
        # written plainly, 640 us of a 3 ms step at B = 64 on the H200): the rows' sampling fields are written
        # only when a sequence takes a row, positions and tokens as vectors, a page taken only when the token
        # starts one. _check has seen the room in the context and the pages.
        s, host, P, rows = self.step, self.step.host, self.kv_page_size, self._row_of
        grew, penalized = False, False
        for b, (st, tok) in enumerate(zip(states, tokens, strict=True)):
            if st.pos >= len(st.pages) * P:
                grew |= self.pages.grow(st.pages, st.pos + 1)
            if st.window:
                self._remember(st, [tok])
                penalized = True
            if rows[b] is not st or st.window:
                self._fill_sampling(s, b, st)
                rows[b] = st
        positions = [st.pos for st in states]
        host["tokens"][:B] = tokens
        host["pos"][:B] = positions
        host["counter"][:B] = positions  # the sampler's counter: the position of the token it samples after
        # One copy per step: the small per-sequence fields, then the penalty window and the block tables only
        # when they are needed (fields are laid out in this order, see _alloc_buffers).
        last = "hist" if penalized else "seed"
        signature = tuple((q, len(st.pages)) for q, st in zip(seqs, states, strict=True))
        if grew or signature != self._bt_signature:
            for b, st in enumerate(states):
                host["block_table"][b * self.max_pages : b * self.max_pages + len(st.pages)] = st.pages
            last = "block_table"
            self._bt_signature = signature
        host["masked"][:B] = [m is not None for m in masks] if masks is not None else 0
        if masks is not None and any(m is not None for m in masks):
            W = self.mask_words
            for b, m in enumerate(masks):
                if m is not None:
                    host["mask"][b * W : (b + 1) * W] = m
            last = "mask"  # the block tables ride along (their host copy is current)
        s.upload(self.stream, "tokens", last)
        if fed:
            assert prev is not None
            self._copy_runs(s.ptr["tokens"], prev.slot.out_dev, fed)
        self._graph(B).launch(self.stream)
        self._read_back(self.stream, 0, B)
        append, filled = self.pages.append, self._decode_filled
        deferred = {b for b, _ in fed}
        h.B = B
        for b, (q, st, tok) in enumerate(zip(seqs, states, tokens, strict=True)):
            st.pos += 1
            h.samples(q, st)
            if b in deferred:
                continue
            registered = append(st.pages, st.chain, (tok,))
            if registered:  # a page this step completes: cached now, written when the graph runs (_flush)
                filled.update(page for _, page in registered)
        h.fed = [(seqs[b], states[b], row) for b, row in fed]
        return B

    def _copy_runs(self, dst: int, src: int, rows: list[tuple[int, int]]) -> None:
        """dst[i] = src[j] (int32) for each (i, j), one device copy per run of consecutive pairs: a batch that
        keeps its order is one copy, a sequence leaving it adds one."""
        start = 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k] != (rows[k - 1][0] + 1, rows[k - 1][1] + 1):
                (i, j), n = rows[start], k - start
                self.stream.copy(dst + 4 * i, src + 4 * j, 4 * n)
                start = k

    def _graph(self, B: int) -> Graph:
        """The decode step's CUDA graph for B sequences, captured on first use."""
        graph = self._graphs.get(B)
        if graph is None:
            launches = self._decode_launches(B)
            graph = self._graphs[B] = Graph(self.stream, lambda: self._launch_all(launches))
        return graph

    def warm(self) -> None:
        """Capture the decode graph of every batch size up to max_seqs now (capture only: nothing runs). A
        server's batch passes through every width as requests come and go, and each first use captured its graph
        inside a step: on the H200 the load test's first run after its warm-up had a TTFT p95 of 245 ms, 92 ms
        once every width had been seen (SmolLM2, 64 clients)."""
        for B in range(1, self.max_seqs + 1):
            self._graph(B)

    def decode_logits(self, seqs: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """One decode step like decode(), also returning the logits [B, n_vocab] it sampled from (tests)."""
        self.decode(seqs, tokens)
        out = np.empty((len(seqs), self.config.n_vocab), dtype=np.float32)
        self.stream.download(out, self.logits_buf.ptr)
        self.stream.synchronize()
        return out

    # --- introspection -----------------------------------------------------------------------------

    def _launch_all(self, launches: list[Launch]) -> None:
        for launch in launches:
            launch(self.stream)

    def kv_pages_used(self) -> int:
        return self.pages.used  # held by live sequences; evictable cached pages count as free

    def prefix_stats(self) -> dict:
        return self.pages.prefix_stats()

    def memory_report(self) -> dict:
        free, total = self.dev.memory()
        return {
            "device": self.dev.info.name,
            "compute_capability": self.dev.info.cc,
            "weights_bytes": self.w.nbytes,
            "engine_bytes": self.pool.allocated,
            "kv_pages": self.pages.n_pages,
            "kv_pages_free": self.pages.free,
            "free": free,
            "total": total,
        }
