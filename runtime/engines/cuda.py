"""The GPU engine: the model's forward pass as kernel launches on one CUDA stream, driven from Python.

Decode (one token for each of B sequences) is the hot path: its 8 launches per layer are captured once per
batch size B into a CUDA graph and replayed with one cuGraphLaunch per step. Everything that changes between
steps — token ids, positions, block tables, sampling parameters — lives in device memory written by one
host->device copy before the replay, so no graph node is ever patched; the only readback is the B sampled
token ids. Per layer, for x [B, D] fp32 (the residual stream):

    xq        = q8x2(rmsnorm(x) * attn_norm)               (int8 activations, two levels: kernels' common.cuh)
    qkv       = Wqkv · xq (+ bqkv)                         [B, (H + 2 Hkv) hd]
    att       = attention(rope(q), cache + [rope(k), v])  [B, H hd]   (one fused launch, cuda/attention.cu)
    x        += Wo · q8x2(att)
    xq        = q8x2(rmsnorm(x) * ffn_norm)
    h         = silu(Wgate · xq) * (Wup · xq)              [B, F]
    x        += Wdown · q8x2(h)
then logits = Whead · q8x2(rmsnorm(x) * out_norm) and a token per sequence is sampled on the GPU.

Prefill runs the same layers on up to PREFILL_CHUNK tokens of one sequence with tensor-core GEMMs (fp16
activations) and flash attention; its launch list is built once per chunk length and replayed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ingot.runtime import settings
from ingot.runtime.engines.cuda_weights import upload_weights
from ingot.runtime.engines.kvcache import PagePool, PrefixChain
from ingot.runtime.errors import IncompatibleError, IngotError, UsageError
from ingot.runtime.gpu.constants import MAX_SPLITS, MODE_ADD, MODE_SWIGLU, PAGE, WEIGHT_LAYOUT
from ingot.runtime.gpu.driver import Device, DeviceBuffer, DevicePool, Graph, Launch, PinnedBuffer, Stream
from ingot.runtime.gpu.kernels import HEAD_DIMS, Kernels, kernel_images
from ingot.runtime.model.gguf import Model
from ingot.runtime.model.reference import rope_inv_freq
from ingot.runtime.sampling import SamplingParams

PREFILL_CHUNK = 512  # tokens per prefill pass: bounds the prefill buffers (a 1000-token prompt = 2 passes)
DEFAULT_MAX_CTX = 8192
HIST_CAP = 256  # repetition-penalty window kept on the device (repeat_last_n is clamped to it)


@dataclass
class _Seq:
    params: SamplingParams
    seed: int
    pos: int = 0  # tokens in the cache
    pages: list[int] = field(default_factory=list)
    recent: list[int] = field(default_factory=list)  # last repeat_last_n tokens (prompt included)
    chain: PrefixChain = field(default_factory=PrefixChain)  # hashes of its full pages (the prefix cache)


class _HostDevice:
    """Named arrays mirrored in pinned host memory and one device buffer, uploaded with one copy."""

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

    def upload(self, stream: Stream, first: str | None = None, last: str | None = None) -> None:
        """Copy the fields from `first` through `last` (in declaration order; default: all) in one transfer."""
        lo = self._offsets[first][0] if first else 0
        if last:
            o, dt, c = self._offsets[last]
            hi = o + np.dtype(dt).itemsize * c
        else:
            hi = self.nbytes
        stream.upload(self.dev.ptr + lo, self.pinned.array[lo:hi])

    def close(self) -> None:
        self.pinned.close()


# The architectures whose block the GPU kernels implement (Llama's: no q/k norms, post-norms, GELU, sliding
# windows or softcapping); the others in architectures.py run on the CPU engine only.
GPU_ARCHITECTURES = ("llama", "mistral", "qwen2")


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
        if c.arch not in GPU_ARCHITECTURES:
            raise IncompatibleError(
                f"architecture {c.arch} is not supported by the GPU engine yet",
                hint=f"it runs {', '.join(GPU_ARCHITECTURES)}; use --device cpu",
            )
        if c.rope_scale != 1.0 or (c.attn_scale and abs(c.attn_scale * math.sqrt(c.head_dim) - 1.0) > 1e-6):
            raise IncompatibleError(
                "linear RoPE scaling and a custom attention scale are not implemented by the GPU engine yet",
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
        # Decode batches at least this wide use the tensor-core GEMMs (weights read once for all sequences,
        # split-K for parallelism) instead of the dp4a matrix-vector kernels (up to 4 sequences per pass).
        self.gemm_min_batch = settings.DECODE_GEMM_MIN_BATCH.get()
        self.qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim  # width of the stacked q,k,v rows
        self.max_ctx = max_ctx or min(c.n_ctx_train, DEFAULT_MAX_CTX)
        self.max_pages = (self.max_ctx + PAGE - 1) // PAGE
        self.prefix_cache = settings.PREFIX_CACHE.get() if prefix_cache is None else prefix_cache

        self.dev = Device(gpu)
        self.stream = Stream()
        self.pool = DevicePool()
        try:
            self.k = Kernels(self.dev, kernels if kernels is not None else kernel_images())
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
        self._prefill_plans: dict[tuple[int, bool], list[Launch]] = {}
        self._bt_signature: tuple | None = None

    # --- memory ----------------------------------------------------------------------------------

    def _alloc_cache(self, kv_pages: int | None) -> None:
        c = self.config
        page_bytes = PAGE * c.n_kv_heads * c.head_dim * 2  # one page of K (or V) of one layer, fp16
        if kv_pages is None:
            want = self.max_seqs * self.max_pages
            free, _ = self.dev.memory()
            budget = int(settings.KV_FRACTION.get() * free)
            kv_pages = max(self.max_pages, min(want, budget // (2 * c.n_layers * page_bytes)))
        self.pages = PagePool(kv_pages, PAGE, prefix_cache=self.prefix_cache)
        self.kv_pages_total = kv_pages
        self.k_cache = [self.pool.alloc(kv_pages * page_bytes, f"k cache {i}") for i in range(c.n_layers)]
        self.v_cache = [self.pool.alloc(kv_pages * page_bytes, f"v cache {i}") for i in range(c.n_layers)]
        # rope[pos, i] = (cos, sin)(pos * theta_i), computed in float64 exactly as the CPU reference does
        angle = np.arange(self.max_ctx, dtype=np.float64)[:, None] * rope_inv_freq(c)[None, :]
        table = np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)
        self.rope = self.pool.alloc(table.nbytes, "rope table")
        self.stream.upload(self.rope.ptr, table)
        self.stream.synchronize()

    def _alloc_buffers(self) -> None:
        c, B, T = self.config, self.max_seqs, PREFILL_CHUNK
        D, F, V = c.dim, c.ffn_dim, c.n_vocab
        Dq, Dqkv = c.n_heads * c.head_dim, self.qkv_dim
        widest = max(D, Dq, F)
        a = self.pool.alloc
        # decode, for up to B sequences
        self.step = _HostDevice(
            self.pool,
            [
                ("tokens", np.int32, B),
                ("pos", np.int32, B),
                ("slots", np.int32, B),
                ("top_k", np.int32, B),
                ("hist_len", np.int32, B),
                ("counter", np.int32, B),
                ("temperature", np.float32, B),
                ("top_p", np.float32, B),
                ("min_p", np.float32, B),
                ("penalty", np.float32, B),
                ("seed", np.uint64, B),
                ("hist", np.int32, B * HIST_CAP),
                ("block_table", np.int32, B * self.max_pages),
            ],
        )
        self.step.host["slots"][:] = np.arange(B)
        self.out_tokens = a(4 * B, "sampled tokens")
        self.out_host = PinnedBuffer(4 * B)
        self.x = a(4 * B * D, "x")
        self.xf = a(4 * B * widest, "x fp32 normed")
        self.xq = a(2 * B * widest, "x q8x2")  # two int8 levels per value
        self.xd = a(16 * B * widest // 32, "x q8x2 scales")  # float4 per 32 values
        self.qkv = a(4 * B * Dqkv, "qkv")
        self.att = a(4 * B * Dq, "attention out")
        self.h = a(4 * B * F, "ffn hidden")
        self.xh = a(2 * B * widest, "x fp16 (wide-batch decode)")
        self.gu = a(4 * B * 2 * F, "gate/up (wide-batch decode)")
        self.logits_buf = a(4 * B * V, "logits")
        self.part_acc = a(4 * B * c.n_heads * MAX_SPLITS * c.head_dim, "attention partials")
        self.part_ml = a(8 * B * c.n_heads * MAX_SPLITS, "attention partial m,l")
        self.counters = a(4 * B * c.n_kv_heads, "attention split counters")  # zero between launches
        self.stream.memset(self.counters.ptr, 0, self.counters.nbytes)
        # prefill, for up to T tokens of one sequence (block-table row 0 of its own table)
        self.pre = _HostDevice(
            self.pool,
            [
                ("tokens", np.int32, T),
                ("pos", np.int32, T),
                ("slots", np.int32, T),
                ("block_table", np.int32, self.max_pages),
                ("top_k", np.int32, 1),
                ("hist_len", np.int32, 1),
                ("counter", np.int32, 1),
                ("temperature", np.float32, 1),
                ("top_p", np.float32, 1),
                ("min_p", np.float32, 1),
                ("penalty", np.float32, 1),
                ("seed", np.uint64, 1),
                ("hist", np.int32, HIST_CAP),
            ],
        )
        self.pre.host["slots"][:] = 0
        self.px = a(4 * T * D, "prefill x")
        self.pxh = a(2 * T * widest, "prefill x fp16")
        self.pqkv = a(4 * T * Dqkv, "prefill qkv")
        self.pgu = a(4 * T * 2 * F, "prefill gate/up")
        self.plogits = a(4 * T * V, "prefill logits")

    def close(self) -> None:
        """Free everything on the GPU. Safe to call twice."""
        for g in getattr(self, "_graphs", {}).values():
            g.close()
        self._graphs = {}
        for name in ("step", "pre", "out_host"):
            if hasattr(self, name):
                getattr(self, name).close()
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

    def _quant_input(self, W, x_f32: int, n_values: int, launches: list) -> tuple | int:
        """The activation a matvec with W reads: q8x2 (quantized from x_f32 here) or fp32 as is."""
        if not W.quantized:
            return x_f32
        launches.append(self.k.quantize(x_f32, self.xq.ptr, self.xd.ptr, n_values))
        return (self.xq.ptr, self.xd.ptr)

    def _norm_input(self, W, x: int, w: DeviceBuffer, n: int, launches: list) -> tuple | int:
        """rmsnorm(x) in the form W's matvec reads."""
        c = self.config
        if W.quantized:
            launches.append(self.k.rmsnorm(x, w, n, c.dim, c.norm_eps, yq=self.xq, yd=self.xd))
            return (self.xq.ptr, self.xd.ptr)
        launches.append(self.k.rmsnorm(x, w, n, c.dim, c.norm_eps, y=self.xf))
        return self.xf.ptr

    def _attention(self, layer: int, B: int, splits: int, **outs) -> Launch:
        s = self.step
        return self.k.attn_decode(
            self.qkv.ptr,
            self.rope,
            self.k_cache[layer].ptr,
            self.v_cache[layer].ptr,
            s.ptr["block_table"],
            self.max_pages,
            s.ptr["pos"],
            self.part_acc.ptr,
            self.part_ml.ptr,
            self.counters.ptr,
            self.att.ptr,
            B,
            splits,
            self.config,
            **outs,
        )

    def _decode_launches(self, B: int) -> list[Launch]:
        c, k, s = self.config, self.k, self.step
        Dqkv, F = self.qkv_dim, c.ffn_dim
        splits = max(1, min(MAX_SPLITS, -(-2 * self.dev.info.sm_count // (B * c.n_kv_heads))))
        if B >= self.gemm_min_batch:
            return self._decode_launches_gemm(B, splits)
        L: list[Launch] = [k.embed(self.w.embed, s.ptr["tokens"], self.x, B)]
        for i, lw in enumerate(self.w.layers):
            xin = self._norm_input(lw.wqkv, self.x.ptr, lw.attn_norm, B, L)
            L.append(k.matvec(lw.wqkv, xin, self.qkv.ptr, B, ldy=Dqkv, bias=lw.bqkv))
            q8 = lw.wo.quantized
            L.append(self._attention(i, B, splits, outq=self.xq.ptr if q8 else None, outd=self.xd.ptr if q8 else None))
            L.append(
                k.matvec(
                    lw.wo, (self.xq.ptr, self.xd.ptr) if q8 else self.att.ptr, self.x.ptr, B, ldy=c.dim, mode=MODE_ADD
                )
            )
            xin = self._norm_input(lw.wgu, self.x.ptr, lw.ffn_norm, B, L)
            L.append(k.matvec(lw.wgu, xin, self.h.ptr, B, ldy=F, mode=MODE_SWIGLU))
            hin = self._quant_input(lw.wdown, self.h.ptr, B * F, L)
            L.append(k.matvec(lw.wdown, hin, self.x.ptr, B, ldy=c.dim, mode=MODE_ADD))
        xin = self._norm_input(self.w.head, self.x.ptr, self.w.out_norm, B, L)
        L.append(k.matvec(self.w.head, xin, self.logits_buf.ptr, B, ldy=c.n_vocab))
        L.append(k.sample(self.logits_buf.ptr, c.n_vocab, c.n_vocab, B, self._sample_args(s), self.out_tokens.ptr))
        return L

    def _decode_launches_gemm(self, B: int, splits: int) -> list[Launch]:
        """Decode for wide batches: the prefill layer structure (fp16 activations, tensor-core GEMMs)."""
        c, k, s = self.config, self.k, self.step
        Dqkv, F = self.qkv_dim, c.ffn_dim
        L: list[Launch] = [k.embed(self.w.embed, s.ptr["tokens"], self.x, B)]
        for i, lw in enumerate(self.w.layers):
            L.append(k.rmsnorm(self.x.ptr, lw.attn_norm, B, c.dim, c.norm_eps, yh=self.xh))
            L += k.matmul(lw.wqkv, self.xh.ptr, self.qkv.ptr, B, ldc=Dqkv, bias=lw.bqkv, split_k=True)
            L.append(self._attention(i, B, splits, outh=self.xh.ptr))
            L += k.matmul(lw.wo, self.xh.ptr, self.x.ptr, B, ldc=c.dim, mode=MODE_ADD, split_k=True)
            L.append(k.rmsnorm(self.x.ptr, lw.ffn_norm, B, c.dim, c.norm_eps, yh=self.xh))
            L += k.matmul(lw.wgu, self.xh.ptr, self.gu.ptr, B, ldc=2 * F, split_k=True)
            L.append(k.swiglu(self.gu.ptr, self.xh.ptr, F, B))
            L += k.matmul(lw.wdown, self.xh.ptr, self.x.ptr, B, ldc=c.dim, mode=MODE_ADD, split_k=True)
        L.append(k.rmsnorm(self.x.ptr, self.w.out_norm, B, c.dim, c.norm_eps, yh=self.xh))
        L += k.matmul(self.w.head, self.xh.ptr, self.logits_buf.ptr, B, ldc=c.n_vocab, split_k=True)
        L.append(k.sample(self.logits_buf.ptr, c.n_vocab, c.n_vocab, B, self._sample_args(s), self.out_tokens.ptr))
        return L

    @staticmethod
    def _sample_args(io: _HostDevice) -> dict:
        names = ("temperature", "top_k", "top_p", "min_p", "penalty", "hist", "hist_len", "seed", "counter")
        return {n: io.ptr[n] for n in names} | {"hist_cap": HIST_CAP}

    def _prefill_launches(self, T: int, all_logits: bool) -> list[Launch]:
        """The layers over T tokens of one sequence at positions pre.pos[0..T). Ends with logits of every row
        (all_logits) or with the last row's logits and a sampled token."""
        c, k, p = self.config, self.k, self.pre
        Dqkv, F = self.qkv_dim, c.ffn_dim
        L: list[Launch] = [k.embed(self.w.embed, p.ptr["tokens"], self.px, T)]
        for i, lw in enumerate(self.w.layers):
            L.append(k.rmsnorm(self.px.ptr, lw.attn_norm, T, c.dim, c.norm_eps, yh=self.pxh))
            L += k.matmul(lw.wqkv, self.pxh.ptr, self.pqkv.ptr, T, ldc=Dqkv, bias=lw.bqkv)
            L.append(
                k.rope_kv(
                    self.pqkv.ptr,
                    self.rope,
                    p.ptr["slots"],
                    p.ptr["pos"],
                    p.ptr["block_table"],
                    self.max_pages,
                    self.k_cache[i].ptr,
                    self.v_cache[i].ptr,
                    T,
                    c,
                )
            )
            L.append(
                k.attn_prefill(
                    self.pqkv.ptr,
                    Dqkv,
                    self.k_cache[i].ptr,
                    self.v_cache[i].ptr,
                    p.ptr["block_table"],
                    p.ptr["pos"],
                    T,
                    self.pxh.ptr,
                    c,
                )
            )
            L += k.matmul(lw.wo, self.pxh.ptr, self.px.ptr, T, ldc=c.dim, mode=MODE_ADD)
            L.append(k.rmsnorm(self.px.ptr, lw.ffn_norm, T, c.dim, c.norm_eps, yh=self.pxh))
            L += k.matmul(lw.wgu, self.pxh.ptr, self.pgu.ptr, T, ldc=2 * F)
            L.append(k.swiglu(self.pgu.ptr, self.pxh.ptr, F, T))
            L += k.matmul(lw.wdown, self.pxh.ptr, self.px.ptr, T, ldc=c.dim, mode=MODE_ADD)
        if all_logits:
            L.append(k.rmsnorm(self.px.ptr, self.w.out_norm, T, c.dim, c.norm_eps, yh=self.pxh))
            L += k.matmul(self.w.head, self.pxh.ptr, self.plogits.ptr, T, ldc=c.n_vocab)
            return L
        last = self.px.ptr + 4 * (T - 1) * c.dim
        xin = self._norm_input(self.w.head, last, self.w.out_norm, 1, L)
        L.append(k.matvec(self.w.head, xin, self.plogits.ptr, 1, ldy=c.n_vocab))
        L.append(k.sample(self.plogits.ptr, c.n_vocab, c.n_vocab, 1, self._sample_args(p), self.out_tokens.ptr))
        return L

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
        if st.pos + n_new > self.max_ctx:
            raise UsageError(
                f"sequence would grow to {st.pos + n_new} tokens, past the context of {self.max_ctx}",
                hint="shorten the prompt or lower max tokens",
            )
        return self.pages.grow(st.pages, st.pos + n_new)

    def _adopt(self, st: _Seq, tokens: list[int]) -> int:
        """Prefix cache: append the cached pages that hold the prompt's leading full pages to the sequence's
        block table (kvcache.py decides which); returns how many tokens they hold, which prefill skips."""
        if st.pos + len(tokens) > self.max_ctx:
            return 0  # _reserve refuses it
        n = self.pages.adopt(st.pages, st.chain, tokens)
        self._remember(st, tokens[:n])
        st.pos += n
        return n

    def _remember(self, st: _Seq, tokens: Sequence[int]) -> None:
        """Keep the repetition-penalty window (only a sequence with a penalty needs one)."""
        n = min(st.params.repeat_last_n, HIST_CAP)
        if n and st.params.repetition_penalty != 1.0:
            st.recent = (st.recent + list(tokens))[-n:]

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

    def prefill(self, seq: int, tokens: Sequence[int]) -> int:
        self._run_prefill(seq, tokens, all_logits=False)
        self.stream.download(self.out_host.view(np.int32, 0, 1), self.out_tokens.ptr)
        self.stream.synchronize()
        return int(self.out_host.view(np.int32, 0, 1)[0])

    def logits(self, seq: int, tokens: Sequence[int]) -> np.ndarray:
        rows = self._run_prefill(seq, tokens, all_logits=True)
        assert rows is not None  # all_logits=True returns them
        return rows

    def _run_prefill(self, seq: int, tokens: Sequence[int], all_logits: bool) -> np.ndarray | None:
        st = self._seq(seq)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise UsageError("prefill needs at least one token")
        if any(t < 0 or t >= self.config.n_vocab for t in tokens):
            raise UsageError(f"token id out of range for a vocabulary of {self.config.n_vocab}")
        if not all_logits:  # logits() returns a row per token, so it computes them all
            tokens = tokens[self._adopt(st, tokens) :]  # never empty: the last token is always computed
        self._reserve(st, len(tokens))
        out = []
        p = self.pre
        p.host["block_table"][: len(st.pages)] = st.pages
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            T = len(chunk)
            last = start + T == len(tokens)
            p.host["tokens"][:T] = chunk
            p.host["pos"][:T] = np.arange(st.pos, st.pos + T)
            self._remember(st, chunk)
            st.pos += T
            if last and not all_logits:
                st.pos -= 1  # the sampled token's counter is the last prompt position, as in decode
                self._fill_sampling(p, 0, st)
                st.pos += 1
            p.upload(self.stream)
            for launch in self._plan(T, all_logits):
                launch(self.stream)
            self.pages.append(st.pages, st.chain, chunk)  # registers the pages it filled (stream-ordered)
            if all_logits:
                rows = np.empty((T, self.config.n_vocab), dtype=np.float32)
                self.stream.download(rows, self.plogits.ptr)
                self.stream.synchronize()
                out.append(rows)
        return np.concatenate(out) if all_logits else None

    def _plan(self, T: int, all_logits: bool) -> list[Launch]:
        key = (T, all_logits)
        plan = self._prefill_plans.get(key)
        if plan is None:
            if len(self._prefill_plans) > 16:
                self._prefill_plans.clear()
            plan = self._prefill_plans[key] = self._prefill_launches(T, all_logits)
        return plan

    def decode(self, seqs: Sequence[int], tokens: Sequence[int]) -> list[int]:
        B = len(seqs)
        if B == 0:
            return []
        if B > self.max_seqs or len(tokens) != B:
            raise UsageError(f"decode of {B} sequences with {len(tokens)} tokens (max {self.max_seqs})")
        s = self.step
        grew = False
        states = [self._seq(q) for q in seqs]
        for b, (st, tok) in enumerate(zip(states, tokens, strict=False)):
            grew |= self._reserve(st, 1)
            s.host["tokens"][b] = tok
            s.host["pos"][b] = st.pos
            self._remember(st, [tok])
            self._fill_sampling(s, b, st)
        # One copy per step: the small per-sequence fields, then the penalty window and the block tables only
        # when they are needed (fields are laid out in this order, see _alloc_buffers).
        last = "seed"
        if any(st.params.repetition_penalty != 1.0 for st in states):
            last = "hist"
        signature = tuple((q, len(st.pages)) for q, st in zip(seqs, states, strict=False))
        if grew or signature != self._bt_signature:
            for b, st in enumerate(states):
                s.host["block_table"][b * self.max_pages : b * self.max_pages + len(st.pages)] = st.pages
            last = "block_table"
            self._bt_signature = signature
        s.upload(self.stream, "tokens", last)
        graph = self._graphs.get(B)
        if graph is None:
            launches = self._decode_launches(B)
            graph = self._graphs[B] = Graph(self.stream, lambda: self._launch_all(launches))
        graph.launch(self.stream)
        out = self.out_host.view(np.int32, 0, B)
        self.stream.download(out, self.out_tokens.ptr)
        self.stream.synchronize()
        for st, tok in zip(states, tokens, strict=False):
            st.pos += 1
            self.pages.append(st.pages, st.chain, [tok])
        return [int(t) for t in out]

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
