"""The GPU engine's launch lists, built without a GPU: the block is described once (CudaEngine._forward) and each
path (batch decode, wide-batch decode, prefill) supplies its primitives, so for every architecture the launches
per layer, the layer's sliding window and RoPE table, the q/k norms, post-norms and the FFN activation can be
checked here against Config (the CPU reference's source of truth). Kernels are fakes with the real launch
geometry code (runtime/gpu/kernels.py); buffers are DeviceBuffers at made-up addresses, never dereferenced.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ingot.runtime.engines.cuda import GPU_ARCHITECTURES, PREFILL_CHUNK, CudaEngine, _PassPlan, layer_matrix_bytes
from ingot.runtime.engines.cuda_weights import GpuWeights, LayerWeights
from ingot.runtime.errors import IncompatibleError, UsageError
from ingot.runtime.gpu import kernels as kernels_module
from ingot.runtime.gpu.constants import MODE_ADD, MODE_GEGLU, MODE_STORE, MODE_SWIGLU
from ingot.runtime.gpu.driver import Copy, DeviceBuffer, Kernel, Launch
from ingot.runtime.gpu.kernels import (
    MODULES,
    GpuMatrix,
    Kernels,
    NormedQ8,
    SplitK,
    decode_gemm_min_batch,
    kernel_images,
    mark_pdl,
    narrow_mma_model,
)
from ingot.runtime.model.architectures import ARCHITECTURES, Architecture
from ingot.runtime.model.gguf import Model, QTensor, expected_shapes
from ingot.runtime.model.quants import QUANT_TYPES
from ingot.runtime.model.synth import SHAPES, config_of, tensor_type

GEMM_MIN_BATCH = 8


class _Pool:
    """Made-up, distinct device addresses."""

    def __init__(self):
        self.next = 1 << 20

    def alloc(self, nbytes: int, name: str = "") -> DeviceBuffer:
        b = DeviceBuffer(self.next, nbytes, name)
        self.next += (nbytes + 511) // 256 * 256
        return b


class _Recorder(Kernels):
    """The real launch geometry, with fake kernels, recording the arguments of the ops the block is made of."""

    def __init__(self):
        # max_smem_optin 0: no room for matvec_<type>_b1s, so one-column products stay matvec_<type>_b1 here
        # (test_gpu_layouts.py covers where the staged kernel is chosen)
        self.device = SimpleNamespace(info=SimpleNamespace(sm_count=132, cc=90, max_smem_optin=0))
        self.k = _FakeKernels()
        self.sample_smem_limit = 0  # the sampler's global-memory path: no smem opt-in to fake
        self.prefill_mma = True  # a GPU of compute capability >= 8.0: the tensor-core prefill attention
        self.matmul_mma = True  # ... and the pipelined mma.sync GEMMs (matmul2_*)
        self.matmul_frag = True  # ... Q4_0 / Q4_1 into the mma fragments (matmul2r_*)
        self.matmul_wgmma = True  # ... and in 128-row tiles on Hopper's wgmma (matmul2w_*: an sm_90a image)
        self.split_k_cluster = True  # ... on sm_90+: split-K slices summed in thread-block clusters
        self.norm_smem = dict.fromkeys(QUANT_TYPES, 0)  # matvec_<type>_b1n's dynamic shared memory
        self.calls: list[tuple[str, tuple, dict]] = []

    def _record(name):  # noqa: N805 - a decorator factory used in the class body
        def wrap(self, *args, **kw):
            self.calls.append((name, args, kw))
            return getattr(Kernels, name)(self, *args, **kw)

        return wrap

    embed = _record("embed")
    matvec = _record("matvec")
    matvec_norm = _record("matvec_norm")
    matmul = _record("matmul")
    attn_decode = _record("attn_decode")
    attn_prefill = _record("attn_prefill")
    attn_prefill_varlen = _record("attn_prefill_varlen")
    rope_kv = _record("rope_kv")
    gated_act = _record("gated_act")
    add_rmsnorm = _record("add_rmsnorm")
    del _record

    def of(self, name: str) -> list[tuple[tuple, dict]]:
        return [(a, kw) for n, a, kw in self.calls if n == name]


class _FakeKernel(Kernel):
    def blocks_per_sm(self, threads: int, smem: int) -> int:
        return 4  # what the driver says of the decode attention tile kernel on sm_90 (its launch bound)


class _FakeKernels(dict):
    def __missing__(self, name: str) -> Kernel:
        self[name] = _FakeKernel(None, name)
        return self[name]


class _Uneven(GpuMatrix):
    """A gate/up stack whose parts are in different quant types (helper A's GpuStack has uniform False)."""

    @property
    def uniform(self) -> bool:
        return False


def _matrix(pool: _Pool, qtype: str, rows: int, cols: int, cls=GpuMatrix) -> GpuMatrix:
    if qtype == "F16":
        return cls(qtype, rows, cols, w=pool.alloc(2 * rows * cols))
    return cls(qtype, rows, cols, qs=pool.alloc(rows * cols), d=pool.alloc(rows * cols // 16))


BUFFERS = (
    "x xf xq xd nq nd nss qkv att h xh gu o logits_buf part_acc part_ml counters sample_chunks out_tokens"
    " px pxh pqkv pgu po"
).split()


def plan_engine(c, qtype: str = "Q8_0", uneven_gu: bool = False) -> CudaEngine:
    """A CudaEngine with everything the launch lists read, and no device."""
    pool, a = _Pool(), c.block
    e = object.__new__(CudaEngine)
    e.config, e.k = c, _Recorder()
    e.qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    e.gemm_min_batch, e.max_pages = GEMM_MIN_BATCH, 64
    e.narrow_mma = False
    e.split_room = e.k.attn_decode_split_room(64, c)
    e.mask_words = (c.n_vocab + 31) // 32
    e.dev = SimpleNamespace(info=SimpleNamespace(sm_count=132, cc=90))
    for name in BUFFERS:  # addresses only: room for every offset the launch lists take into them
        setattr(e, name, pool.alloc(1 << 20, name))
    e._all_logits = pool.alloc(4096, "all logits")
    e.step = SimpleNamespace(ptr={n: pool.alloc(64).ptr for n in _STEP_FIELDS})
    e.pre = SimpleNamespace(ptr={n: pool.alloc(64).ptr for n in _STEP_FIELDS})
    e.split_k = SplitK(pool.alloc(4096, "split-K partial tiles"), pool.alloc(4096, "split-K tile counters"))
    e.k_cache = [pool.alloc(64) for _ in range(c.n_layers)]
    e.v_cache = [pool.alloc(64) for _ in range(c.n_layers)]
    e.rope_tables = {c.layer_rope(i): pool.alloc(64, f"rope {c.layer_rope(i)}") for i in range(c.n_layers)}
    D, F, HD = c.dim, c.ffn_dim, c.head_dim

    def vec(n):
        return pool.alloc(4 * n)

    layers = [
        LayerWeights(
            attn_norm=vec(D),
            wqkv=_matrix(pool, qtype, e.qkv_dim, D),
            bqkv=vec(e.qkv_dim) if c.qkv_bias else None,
            wo=_matrix(pool, qtype, D, c.n_heads * HD),
            ffn_norm=vec(D),
            wgu=_matrix(pool, qtype, 2 * F, D, _Uneven if uneven_gu else GpuMatrix),
            wdown=_matrix(pool, qtype, D, F),
            q_norm=vec(HD) if a.qk_norm else None,
            k_norm=vec(HD) if a.qk_norm else None,
            post_attn_norm=vec(D) if a.post_norms else None,
            post_ffn_norm=vec(D) if a.post_norms else None,
        )
        for _ in range(c.n_layers)
    ]
    embed = _matrix(pool, qtype, c.n_vocab, D)
    head = embed if c.tied_embeddings else _matrix(pool, qtype, c.n_vocab, D)
    e.w = GpuWeights(embed=embed, layers=layers, out_norm=vec(D), head=head, nbytes=0)
    floats, tiles = e.k.split_k_size(e.w.shapes(), PREFILL_CHUNK)  # as CudaEngine sizes the passes' scratch
    e.prefill_split_k = SplitK(pool.alloc(4 * floats, "prefill split-K partials"), pool.alloc(4 * tiles, "counters"))
    return e


_STEP_FIELDS = (
    "tokens pos slots starts top_k hist_len counter temperature top_p min_p penalty seed hist block_table masked mask"
).split()


def kernel_names(steps) -> list[str]:
    return [s.kernel.name for s in steps if isinstance(s, Launch)]


SHAPE_OF = {"llama": "tiny-k", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3", "gemma3": "tiny-gemma3"}


def test_every_described_architecture_runs_on_the_gpu():
    assert set(GPU_ARCHITECTURES) == set(ARCHITECTURES)


def test_a_new_architecture_is_an_entry_in_architectures_py(monkeypatch):
    """A Llama-like architecture that mixes the features differently (NEOX rope, q/k norms, post-norms, GELU,
    windows of 3 local layers per global one) is planned from its description alone."""
    new = Architecture(
        "newarch",
        "test",
        rope_neox=True,
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        swa_pattern=4,
        local_rope_theta=5000.0,
    )
    monkeypatch.setitem(ARCHITECTURES, "newarch", new)
    c = dataclasses.replace(
        config_of(SHAPES["tiny-qwen3"]), arch="newarch", n_layers=8, sliding_window=64, rope_theta_local=5000.0
    )
    e = plan_engine(c)
    names = kernel_names(e._decode_launches(1))
    assert names.count("add_rmsnorm_f32") == 2 * c.n_layers
    attn = e.k.of("attn_decode")
    assert [kw["window"] for _, kw in attn] == [0 if i % 4 == 3 else 64 for i in range(8)]
    assert all(kw["q_norm"] is not None for _, kw in attn) and len(e.rope_tables) == 2
    assert [kw["mode"] for _, kw in e.k.of("matvec") if kw.get("mode") == MODE_GEGLU] == [MODE_GEGLU] * 8


def test_llama_launch_counts_are_unchanged():
    """Llama's launches per layer: 8 in batch decode (the CUDA graph the tg128 speed depends on), 8 kernels in
    wide-batch decode, 9 in prefill (rope/KV write and flash attention are two); plus embed, norm, head, sample."""
    c = config_of(SHAPES["tiny-k"])
    e = plan_engine(c)
    decode = kernel_names(e._decode_launches(2))
    layer = ["rmsnorm_f32", "matvec_q8_0", "attn_decode_tile_f16", "matvec_q8_0"]
    layer += ["rmsnorm_f32", "matvec_q8_0", "quantize_q8x2", "matvec_q8_0"]
    assert decode == ["embed_q8_0", *layer * c.n_layers, "rmsnorm_f32", "matvec_q8_0", "sample_f32"]
    wide = kernel_names(e._decode_launches(GEMM_MIN_BATCH))
    assert len(wide) == 1 + 8 * c.n_layers + 3 and wide.count("swiglu_f16") == c.n_layers
    prefill = kernel_names(e._prefill_launches(((7, True),), all_logits=False).launches)
    assert len(prefill) == 1 + 9 * c.n_layers + 3
    # the head over 7 rows without split-K: the 16-row tile covers them
    assert kernel_names(e._prefill_launches(((7, False),), all_logits=True).launches)[-2:] == [
        "rmsnorm_f32",
        "matmul2_q8_0_bm16",
    ]


def test_one_sequence_fuses_each_pre_norm_into_the_residual_projection_before_it(monkeypatch):
    """Single-stream decode (cuda/matvec.cu, the fused norm): every residual projection but none of the others is a
    matvec_<type>_b1n carrying the next norm's weights (the next layer's attn_norm, the layer's ffn_norm, the
    output norm), and the products after them (qkv, gate/up, head) read its NormedQ8: 6 launches a layer instead
    of 8, one rmsnorm_f32 left (after the embedding). INGOT_FUSED_NORM=0 gives back the 8."""
    c = config_of(SHAPES["tiny-k"])
    e = plan_engine(c)
    names = kernel_names(e._decode_launches(1))
    layer = ["matvec_q8_0_b1", "attn_decode_tile_f16", "matvec_q8_0_b1n", "matvec_q8_0_b1", "quantize_q8x2"]
    layer += ["matvec_q8_0_b1n"]
    assert names == ["embed_q8_0", "rmsnorm_f32", *layer * c.n_layers, "matvec_q8_0_b1", "sample_f32"]
    L = e.w.layers
    fused = e.k.of("matvec_norm")
    assert [args[0] for args, _ in fused] == [W for lw in L for W in (lw.wo, lw.wdown)]
    following = [w for i, lw in enumerate(L) for w in (lw.ffn_norm, L[i + 1].attn_norm if i + 1 < len(L) else None)]
    following[-1] = e.w.out_norm
    assert [args[3] for args, _ in fused] == following
    out = NormedQ8(e.nq.ptr, e.nd.ptr, e.nss.ptr, c.norm_eps)
    assert all(args[2] == e.x.ptr and args[4] == out for args, _ in fused)
    readers = [args[1] for args, _ in e.k.of("matvec") if isinstance(args[1], NormedQ8)]
    assert readers == [out] * (2 * c.n_layers)  # gate/up of every layer, qkv of every layer but the first, head
    monkeypatch.setenv("INGOT_FUSED_NORM", "0")
    assert kernel_names(e._decode_launches(1)).count("rmsnorm_f32") == 2 * c.n_layers + 1


@pytest.mark.parametrize(
    "shape,qtype,why",
    [("tiny-gemma3", "Q8_0", "post-norms"), ("tiny-qwen3", "F16", "F16 weights")],
)
def test_no_fused_norm_where_it_does_not_apply(shape, qtype, why):
    """Post-norm blocks add through add_rmsnorm_f32 (the norm's input is the projection, not x); F16 matrices read
    fp32 activations; neither has a matvec_<type>_b1n. (Wider than MV_NORM_MAX: norm_fusable, test_gpu_layouts.)"""
    c = config_of(SHAPES[shape])
    e = plan_engine(c, qtype=qtype)
    names = kernel_names(e._decode_launches(1))
    assert not [n for n in names if n.endswith("_b1n")], why


@pytest.mark.parametrize("arch", sorted(SHAPE_OF))
@pytest.mark.parametrize("path", ["decode", "wide", "prefill"])
def test_block_follows_the_architecture(arch, path):
    """Each layer's attention gets the layer's window, RoPE table, scale and q/k norms from Config; the FFN the
    architecture's activation; post-norm architectures store the projections and add them normed."""
    c = config_of(SHAPES[SHAPE_OF[arch]])
    a = c.block
    e = plan_engine(c)
    k = e.k
    if path == "prefill":
        steps = e._prefill_launches(((5, True),), all_logits=False).launches
        attn = k.of("attn_prefill_varlen")
        for i, (args, kw) in enumerate(k.of("rope_kv")):
            assert args[1] is e.rope_tables[c.layer_rope(i)]
            assert kw["q_norm"] is e.w.layers[i].q_norm and kw["k_norm"] is e.w.layers[i].k_norm
    else:
        B = 3 if path == "decode" else GEMM_MIN_BATCH
        steps = e._decode_launches(B)
        attn = k.of("attn_decode")
        for i, (args, kw) in enumerate(attn):
            assert args[1] is e.rope_tables[c.layer_rope(i)]
            assert kw["q_norm"] is e.w.layers[i].q_norm and kw["k_norm"] is e.w.layers[i].k_norm
    assert len(attn) == c.n_layers
    for i, (_, kw) in enumerate(attn):
        assert kw["window"] == c.layer_window(i) and kw["scale"] == c.attn_scale and kw["softcap"] == c.attn_softcap
    assert (kw_q := [kw["q_norm"] for _, kw in k.of("rope_kv" if path == "prefill" else "attn_decode")])
    assert all(q is not None for q in kw_q) == a.qk_norm

    (args, kw), *_ = k.of("embed")
    assert kw["scale"] == pytest.approx(math.sqrt(c.dim) if a.embed_scale_sqrt_dim else 1.0)

    names = kernel_names(steps)
    post = k.of("add_rmsnorm")
    assert len(post) == (2 * c.n_layers if a.post_norms else 0)
    if a.post_norms:
        norms = [(lw.post_attn_norm, lw.post_ffn_norm) for lw in e.w.layers]
        assert [args[2] for args, _ in post] == [w for pair in norms for w in pair]
    products = k.of("matvec" if path == "decode" else "matmul")
    residual = [W for lw in e.w.layers for W in (lw.wo, lw.wdown)]
    residual_modes = [kw.get("mode", MODE_STORE) for args, kw in products if any(args[0] is W for W in residual)]
    assert residual_modes == [MODE_STORE if a.post_norms else MODE_ADD] * 2 * c.n_layers
    if path == "decode":  # the activation fused into the gate/up product
        gated = [kw["mode"] for _, kw in products if kw.get("mode") in (MODE_SWIGLU, MODE_GEGLU)]
        assert gated == [MODE_GEGLU if a.activation == "gelu_tanh" else MODE_SWIGLU] * c.n_layers
    else:
        assert [args[0] for args, _ in k.of("gated_act")] == [a.activation] * c.n_layers
    # Llama's counts for every architecture: a post-norm add carries the norm after it, except the last one
    # before prefill's last-row head (which norms that row alone)
    per_layer = 8 if path != "prefill" else 9
    assert len(names) == 1 + per_layer * c.n_layers + 3 + (a.post_norms and path == "prefill")
    if a.post_norms:
        L = e.w.layers
        head = None if path == "prefill" else e.w.out_norm
        following = [(lw.ffn_norm, L[i + 1].attn_norm if i + 1 < len(L) else head) for i, lw in enumerate(L)]
        assert [kw["w_next"] for _, kw in post] == [w for pair in following for w in pair]


@pytest.mark.parametrize("mma", [True, False])
def test_a_prefill_pass_of_several_sequences(mma):
    """A pass of three sequences (5 rows that sample nothing, then 7 and 3 that sample): one GEMM per product over
    all 15 rows, the cache write over all of them, flash attention on each sequence's own rows, positions,
    block-table row and output rows (the tensor-core kernel: one launch per layer, a grid plane per sequence; the
    scalar one: a launch per sequence); the two sampled rows (11 and 14) gathered into x for the head and the
    sampler over 2 rows."""
    c = config_of(SHAPES["tiny-k"])
    e = plan_engine(c)
    e.k.prefill_mma = mma
    steps = e._prefill_launches(((5, False), (7, True), (3, True)), all_logits=False).launches
    assert {args[3] for args, _ in e.k.of("matmul")} == {15}  # M: every row at once
    assert [(args[2], args[8]) for args, _ in e.k.of("rope_kv")] == [(e.pre.ptr["slots"], 15)] * c.n_layers
    pre, H = e.pre.ptr, c.n_heads * c.head_dim
    if mma:
        attn = e.k.of("attn_prefill_varlen")
        assert not e.k.of("attn_prefill") and len(attn) == c.n_layers
        for args, _ in attn:
            qkv, ld, _, _, table, max_pages, pos, starts, lengths, out, _ = args
            assert (qkv, ld, out) == (e.pqkv.ptr, e.qkv_dim, e.pxh.ptr) and lengths == (5, 7, 3)
            assert (table, max_pages, pos, starts) == (pre["block_table"], e.max_pages, pre["pos"], pre["starts"])
        G = c.n_heads // c.n_kv_heads
        varlen = [s for s in steps if isinstance(s, Launch) and s.kernel.name == "attn_prefill_mma_varlen_f16"]
        assert {s.grid for s in varlen} == {(-(-7 * G // 64), c.n_kv_heads, 3)}  # the longest sequence's tiles
    else:
        attn = e.k.of("attn_prefill")
        assert len(attn) == 3 * c.n_layers
        for (args, _), (r, start, n) in zip(attn, [(0, 0, 5), (1, 5, 7), (2, 12, 3)] * c.n_layers, strict=True):
            qkv, ld, _, _, block_row, pos, T, out, _ = args
            assert qkv == e.pqkv.ptr + 4 * start * e.qkv_dim and ld == e.qkv_dim
            assert block_row == pre["block_table"] + 4 * r * e.max_pages and pos == pre["pos"] + 4 * start
            assert T == n and out == e.pxh.ptr + 2 * start * H
    copies = [s for s in steps if isinstance(s, Copy)]
    assert [(s.dst, s.src, s.nbytes) for s in copies] == [
        (e.x.ptr + 4 * c.dim * j, e.px.ptr + 4 * c.dim * row, 4 * c.dim) for j, row in enumerate((11, 14))
    ]
    assert steps[-1].kernel.name == "sample_f32" and steps[-1].grid == (2, 1, 1)
    # one sampling sequence whose last row ends the pass is read in place; none: no head at all
    alone = plan_engine(c)._prefill_launches(((4, False), (6, True)), all_logits=False).launches
    assert not any(isinstance(s, Copy) for s in alone) and alone[-1].grid == (1, 1, 1)
    silent = kernel_names(plan_engine(c)._prefill_launches(((9, False),), all_logits=False).launches)
    assert "sample_f32" not in silent and silent.count("attn_prefill_mma_varlen_f16") == c.n_layers


def _pointers(work) -> set[int]:
    """The device addresses a launch or copy is given."""
    if isinstance(work, Copy):
        return {work.dst, work.src}
    return {int(h) for h in work._held if h.dtype == np.uint64}


# What the decode step owns: a prefill pass's layers run on a second stream beside the decode graph
# (INGOT_PREFILL_STREAM), so they may touch none of it; its head waits for the decode's readback.
DECODE_OWNED = (
    "x xf xq xd nq nd nss qkv att h xh gu o logits_buf part_acc part_ml counters sample_chunks out_tokens".split()
)


@pytest.mark.parametrize("shape", ["tiny-k", "tiny-gemma3", "tiny-qwen3"])
def test_a_prefill_pass_body_touches_nothing_the_decode_step_owns(shape):
    """The pass's layers read and write only its own buffers (px, pxh, pqkv, pgu, po, pre's inputs and split-K
    scratch; the weights and KV cache), so they may run concurrently with a decode step; the decode's buffers
    appear only in the head (the gather into x, the LM head, the sampler)."""
    c = config_of(SHAPES[shape])
    e = plan_engine(c)
    owned = {name: getattr(e, name) for name in DECODE_OWNED}
    owned["split-K scratch"], owned["split-K counters"] = e.split_k.ws, e.split_k.counters
    owned |= {f"step {n}": DeviceBuffer(p, 64, n) for n, p in e.step.ptr.items()}

    def touched(works) -> set[str]:
        ptrs = set().union(*(_pointers(w) for w in works))
        return {name for name, b in owned.items() for p in ptrs if b.ptr <= p < b.ptr + b.nbytes}

    plan = e._prefill_launches(((5, False), (7, True), (3, True)), all_logits=False)
    assert plan.body and not touched(plan.body)
    assert {"x", "logits_buf", "out_tokens"} <= touched(plan.head)
    assert not touched(e._prefill_launches(((9, False),), all_logits=False).launches)  # samples nothing: no head


def test_a_full_prefill_pass_of_smollm2_splits_k_in_the_prefill_scratch():
    """SmolLM2's 512-row pass: its GEMMs' tiles fill about one block per SM, so they split K, in the prefill's own
    scratch (the decode's would race the decode graph beside it), with the same slices as a pass of fewer rows
    (whose small grids sum them in clusters instead)."""
    c = config_of(SHAPES["smollm2-135m"])
    e = plan_engine(c)
    scratch = {e.prefill_split_k.ws.ptr, e.prefill_split_k.counters.ptr}

    def gemms(rows: int) -> list:
        return [w for w in e._prefill_launches(((rows, True),), all_logits=False).body if "matmul" in w.kernel.name]

    full = gemms(512)
    assert all(w.grid[2] > 1 and scratch <= _pointers(w) for w in full[:4])  # a layer's four
    for rows in (7, 130, 300):
        assert [w.grid[2] for w in gemms(rows)] == [w.grid[2] for w in full], rows


def test_gemma3_layers_get_their_window_and_rope_base():
    """gemma3-270m's pattern: five local layers (window 512, base 10k) then a global one (base 1M), repeated."""
    c = config_of(SHAPES["gemma3-270m"])
    e = plan_engine(c)
    names = kernel_names(e._decode_launches(1))
    assert names.count("attn_decode_tile_f16_hd256") == c.n_layers  # head_dim 256: its own kernel
    assert names[-2:] == ["sample_prep_f32", "sample_f32"]  # 262,144 logits: the multi-block sampler pass
    assert (
        kernel_names(e._prefill_launches(((3, True),), all_logits=False).launches).count(
            "attn_prefill_mma_varlen_f16_hd256"
        )
        == c.n_layers
    )
    got = [(kw["window"], args[1]) for args, kw in e.k.of("attn_decode")]
    local, glob = e.rope_tables[(10000.0, 1.0)], e.rope_tables[(1000000.0, 1.0)]
    assert len(e.rope_tables) == 2
    assert got == [(0, glob) if i % 6 == 5 else (512, local) for i in range(c.n_layers)]


def test_unevenly_quantized_gate_up_goes_through_a_store_and_the_activation_kernel():
    c = config_of(SHAPES["tiny-gemma3"])
    e = plan_engine(c, uneven_gu=True)
    e._decode_launches(2)
    modes = [kw.get("mode", MODE_STORE) for args, kw in e.k.of("matvec") if isinstance(args[0], _Uneven)]
    assert modes == [MODE_STORE] * c.n_layers
    acts = e.k.of("gated_act")
    assert [a[0] for a, _ in acts] == ["gelu_tanh"] * c.n_layers and all(kw["hf"] == e.h.ptr for _, kw in acts)


def test_f16_weights_read_fp32_activations():
    c = config_of(SHAPES["tiny-qwen3"])
    e = plan_engine(c, qtype="F16")
    names = kernel_names(e._decode_launches(1))
    assert "quantize_q8x2" not in names and names.count("matvec_f16_b1") == 4 * c.n_layers + 1  # one sequence


def _refused(config) -> IncompatibleError:
    model = SimpleNamespace(config=config)
    with pytest.raises(IncompatibleError) as e:
        CudaEngine(model)  # type: ignore[arg-type]
    assert e.value.exit_code == 3 and "--device cpu" in str(e.value)
    return e.value


def test_refusals_name_what_is_missing():
    gemma = config_of(SHAPES["tiny-gemma3"])
    assert "architecture phi3 is not supported" in str(_refused(dataclasses.replace(gemma, arch="phi3")))
    assert "final logit softcapping" in str(_refused(dataclasses.replace(gemma, final_softcap=30.0)))
    assert "groups of up to 8" in str(_refused(dataclasses.replace(gemma, n_heads=16, n_kv_heads=1)))
    assert "head_dim 96" in str(_refused(dataclasses.replace(gemma, head_dim=96, rope_dim=96)))


def test_an_activation_without_a_kernel_is_refused(monkeypatch):
    monkeypatch.setitem(
        ARCHITECTURES, "relu2arch", Architecture("relu2arch", "test", rope_neox=False, activation="relu2")
    )
    e = _refused(dataclasses.replace(config_of(SHAPES["tiny-k"]), arch="relu2arch"))
    assert "relu2 FFN activation of relu2arch has no GPU kernel" in str(e)


def test_rope_tables_follow_the_reference():
    """One table per distinct (base, scale); each is the CPU reference's angles (rope_inv_freq), so linear RoPE
    scaling of the global layers needs no refusal."""
    from ingot.runtime.model.reference import rope_inv_freq

    c = dataclasses.replace(config_of(SHAPES["tiny-gemma3"]), rope_scale=8.0)
    keys = {c.layer_rope(i) for i in range(c.n_layers)}
    assert keys == {(c.rope_theta_local, 1.0), (c.rope_theta, 8.0)}
    glob = next(i for i in range(c.n_layers) if not c.layer_window(i))
    assert np.allclose(rope_inv_freq(c, glob) * 8.0, c.rope_theta ** (-np.arange(0, c.rope_dim, 2) / c.rope_dim))


def test_decode_attention_version_switch(monkeypatch):
    """INGOT_DECODE_ATTN=v7 brings back the previous decode kernels (same arguments, their own shared memory),
    so a v8 failure on a device costs a flag, not a revert."""
    c = config_of(SHAPES["gemma3-270m"])
    v8 = [s for s in plan_engine(c)._decode_launches(1) if "attn_decode" in s.kernel.name]
    monkeypatch.setenv("INGOT_DECODE_ATTN", "v7")
    v7 = [s for s in plan_engine(c)._decode_launches(1) if "attn_decode" in s.kernel.name]
    assert {s.kernel.name for s in v8} == {"attn_decode_tile_f16_hd256"}
    assert {s.kernel.name for s in v7} == {"attn_decode_f16_hd256"}
    assert all(a.grid[1:] == b.grid[1:] and a.smem != b.smem for a, b in zip(v8, v7, strict=True))
    # one kv head: the grid is as wide as each kernel's merge takes (v8 MAX_SPLITS = 64, v7 a split a lane)
    assert {s.grid[0] for s in v8} == {64} and {s.grid[0] for s in v7} == {32}
    assert max(s.smem for s in v8) <= 48 * 1024  # under the default: no opt-in needed on any arch


def test_decode_attention_grids_fill_the_resident_blocks_within_the_partials_room(monkeypatch):
    """The splits come from the kernel's occupancy (the fake driver says 4 blocks an SM, as sm_90's does for
    the 8B's head size) over 132 SMs and 8 kv heads, capped at the merge's 64; every grid of up to 64 sequences
    fits the partials allocated for them, even when a forced count (set after the engine started) asks more."""
    e = plan_engine(config_of(SHAPES["llama3-8b"]), "Q4_0")
    assert e.split_room == 128  # 64 sequences x 2 splits is the widest

    def grid(B):
        return {s.grid for s in e._decode_launches(B) if "attn_decode" in s.kernel.name}

    assert grid(1) == {(64, 8, 1)} and grid(4) == {(17, 8, 4)} and grid(64) == {(2, 8, 64)}
    monkeypatch.setenv("INGOT_DECODE_SPLITS", "64")
    assert grid(1) == {(64, 8, 1)} and grid(4) == {(32, 8, 4)}  # cut to the room: 128 // 4
    monkeypatch.setenv("INGOT_DECODE_SPLITS", "5")
    assert grid(1) == {(5, 8, 1)}


def test_the_sampler_splits_large_vocabularies_only():
    """sample_prep_f32 runs over the vocabulary's chunks before sample_f32 from 65,536 logits on (decode and
    prefill's last row), and sample_f32 gets the chunk buffer and count; a small vocabulary keeps one launch."""
    gemma = plan_engine(config_of(SHAPES["gemma3-270m"]))
    prefill = gemma._prefill_launches(((5, True),), all_logits=False).launches
    for steps, B in ((gemma._decode_launches(3), 3), (prefill, 1)):
        prep, final = steps[-2:]
        assert prep.kernel.name == "sample_prep_f32" and prep.grid == (128, B, 1) and final.grid == (B, 1, 1)
    small = plan_engine(config_of(SHAPES["tiny-k"]))
    assert kernel_names(small._decode_launches(2))[-2:] == ["matvec_q8_0", "sample_f32"]


@pytest.mark.parametrize("arch", sorted(SHAPE_OF))
@pytest.mark.parametrize("cc", [89, 90])
def test_every_decode_and_prefill_launch_may_use_pdl_on_sm90(arch, cc, monkeypatch):
    """With PDL on (sm_90, INGOT_PDL unset) every launch of the decode step and of a prefill chunk is of a kernel
    that waits on its predecessor (kernels.PDL_KERNELS): the whole step's kernel boundaries overlap. Below sm_90
    none is. Memsets (split-K) carry no flag; the launch after one is serialized by the stream (driver.Launch)."""
    monkeypatch.delenv("INGOT_PDL", raising=False)
    e = plan_engine(config_of(SHAPES[SHAPE_OF[arch]]))
    prefill = e._prefill_launches(((5, True),), all_logits=False).launches
    steps = e._decode_launches(2) + e._decode_launches(GEMM_MIN_BATCH) + prefill
    mark_pdl(e.k.k, cc)
    launches = [s for s in steps if isinstance(s, Launch)]
    assert len(launches) == len(steps), [type(s).__name__ for s in steps if not isinstance(s, Launch)]
    assert len(launches) > 8 * e.config.n_layers
    assert all(s.pdl == (cc >= 90) for s in launches), [s.kernel.name for s in launches if s.pdl != (cc >= 90)]


# --- a prefill call's host side: passes, rows, sampling rows, readback offsets (no device) ---------------------


class _Inputs:
    """The prefill inputs' host arrays (CudaEngine.pre's fields); each upload keeps a copy of them as sent."""

    def __init__(self, B: int, T: int, max_pages: int, mask_words: int):
        ints = ("tokens", "pos", "slots", "top_k", "hist_len", "counter", "masked")
        self.host = {"starts": np.zeros(B + 1, np.int32)}
        self.host |= {n: np.zeros(T if n in ("tokens", "pos", "slots") else B, np.int32) for n in ints}
        self.host |= {n: np.zeros(B, np.float32) for n in ("temperature", "top_p", "min_p", "penalty")}
        self.host |= {"seed": np.zeros(B, np.uint64), "hist": np.zeros(B * 256, np.int32)}
        self.host |= {"block_table": np.full(B * max_pages, -1, np.int32), "mask": np.zeros(B * mask_words, np.uint32)}
        self.sent: list[tuple[str, dict]] = []

    def upload(self, stream, first, last):
        self.sent.append((last, {n: a.copy() for n, a in self.host.items()}))

    def wait_copied(self):
        pass


class _Readback:
    """out_host and the stream's downloads: which byte offsets of it each pass's sampled tokens go to."""

    def __init__(self):
        self.views: list[tuple[int, int]] = []

    def view(self, dtype, offset, count):
        self.views.append((offset, count))
        return np.zeros(count, dtype)

    def download(self, dst, src):
        pass

    def copy(self, dst, src, nbytes):
        pass


def host_engine(prefix_cache: bool = False):
    from ingot.runtime.engines.kvcache import PagePool

    c = config_of(SHAPES["tiny-k"])
    e = plan_engine(c)
    e.max_seqs, e.max_ctx, e._seqs, e._next_id = 8, 1024, {}, 0
    e.pre = _Inputs(8, 512, e.max_pages, e.mask_words)
    e.pages = PagePool(256, 16, prefix_cache=prefix_cache)
    e.stream = e.side = _Readback()
    e._slot = SimpleNamespace(out_host=_Readback(), out_dev=0)
    e._decode_queued, e._decode_filled, e._layers_after_decode = False, set(), False
    e.shapes = []
    e._plan = lambda shape, all_logits: e.shapes.append(shape) or _PassPlan([], [])
    return e


def test_a_prefill_call_fills_passes_rows_and_sampling_rows():
    """Four chunks of 40 (its prompt goes on: no sample), 300 (masked), 250 and 5 (masked) tokens, behind a decode
    of 3 sequences: pass 1 holds 40 + 300 + the first 172 of the 250, pass 2 the other 78 and the 5. Each
    sequence's tokens name its block-table row (slots), each sampling sequence its sampling row (counter = its last
    prompt position, its mask in its row), and the sampled tokens are read back after the decode's three."""
    from ingot.runtime.engines.base import PrefillChunk
    from ingot.runtime.sampling import SamplingParams

    e = host_engine()
    W = e.mask_words
    seqs = [e.new_sequence(SamplingParams(temperature=0.5 + i)) for i in range(4)]
    lengths, masks = (40, 300, 250, 5), [None, np.full(W, 7, np.uint32), None, np.full(W, 9, np.uint32)]
    chunks = [
        PrefillChunk(q, list(range(1, n + 1)), last=i > 0, mask=masks[i])
        for i, (q, n) in enumerate(zip(seqs, lengths, strict=True))
    ]
    sampled = e._launch_prefill(chunks, e._check(chunks), first=3)
    assert sampled == [1, 2, 3]
    assert e.shapes == [((40, False), (300, True), (172, False)), ((78, True), (5, True))]
    assert e._slot.out_host.views == [(4 * 3, 1), (4 * 4, 2)]  # bytes: after the decode's 3 tokens, then the next 2
    (last1, one), (last2, two) = e.pre.sent
    assert last1 == last2 == "mask"  # a masked row in each pass: the masks travel
    assert one["slots"][:512].tolist() == [0] * 40 + [1] * 300 + [2] * 172
    assert two["slots"][:83].tolist() == [0] * 78 + [1] * 5
    assert one["starts"][:4].tolist() == [0, 40, 340, 512] and two["starts"][:3].tolist() == [0, 78, 83]
    assert one["pos"][340:512].tolist() == list(range(172)) and two["pos"][:78].tolist() == list(range(172, 250))
    M = e.max_pages
    for sent, rows in ((one, seqs[:3]), (two, seqs[2:])):
        for r, q in enumerate(rows):
            pages = e._seqs[q].pages
            assert sent["block_table"][r * M : r * M + len(pages)].tolist() == pages
    # sampling rows: pass 1 samples sequence 1 (row 0), pass 2 sequences 2 and 3 (rows 0, 1)
    assert one["counter"][0] == 299 and one["temperature"][0] == 1.5 and one["masked"][0] == 1
    assert (one["mask"][:W] == 7).all()
    assert two["counter"][:2].tolist() == [249, 4] and two["temperature"][:2].tolist() == [2.5, 3.5]
    assert two["masked"][:2].tolist() == [0, 1] and (two["mask"][W : 2 * W] == 9).all()
    assert [e._seqs[q].pos for q in seqs] == list(lengths)


def test_a_prompt_sharing_pages_with_one_in_the_pass_waits_for_them():
    """Two prompts of one call with the same first 48 tokens (3 pages): the second starts a new pass, adopts the
    3 pages the first pass registered, and computes only its 20 others."""
    from ingot.runtime.engines.base import PrefillChunk
    from ingot.runtime.sampling import SamplingParams

    e = host_engine(prefix_cache=True)
    shared = list(range(100, 148))
    a, b = e.new_sequence(SamplingParams()), e.new_sequence(SamplingParams())
    chunks = [PrefillChunk(a, shared + [1] * 10), PrefillChunk(b, shared + [2] * 20)]
    assert e._launch_prefill(chunks, e._check(chunks), first=0) == [0, 1]
    assert e.shapes == [((58, True),), ((20, True),)]
    assert e.pages.prefix_stats()["hit_tokens"] == 48 and e._seqs[b].pages[:3] == e._seqs[a].pages[:3]


class _LogStream(_Readback):
    """A stream that logs what is queued on it (waits, downloads, synchronizations) into a shared list."""

    def __init__(self, name: str, log: list):
        super().__init__()
        self.name, self.log = name, log

    def wait(self, event) -> None:
        self.log.append(("wait", self.name))

    def download(self, dst, src) -> None:
        self.log.append(("download", self.name))

    def synchronize(self) -> None:
        self.log.append(("sync", self.name))

    def copy(self, dst, src, nbytes) -> None:
        self.log.append(("copy", self.name, dst, src, nbytes))


class _LogEvent:
    """An event that logs its records, and its synchronizations as a sync of the stream it was recorded on."""

    def __init__(self, log: list):
        self.log, self.stream = log, "none"

    def record(self, stream) -> None:
        self.log.append(("record", stream.name))
        self.stream = stream.name

    def synchronize(self) -> None:
        self.log.append(("sync", self.stream))


def stream_engine():
    """host_engine with the prefix cache, the decode path's inputs, and a log of what each stream is given: the
    decode graph, the event after its readback, and each prefill pass's layers ("body") and head."""
    e = host_engine(prefix_cache=True)
    log: list[tuple[str, str]] = []
    e.stream, e.side = _LogStream("main", log), _LogStream("side", log)
    e._slots = [
        SimpleNamespace(
            out_host=_Readback(), out_dev=0, decoded=_LogEvent(log), finished=_LogEvent(log), side_done=_LogEvent(log)
        )
        for _ in range(2)
    ]
    e._flight = []
    e.step = _Inputs(e.max_seqs, 512, e.max_pages, e.mask_words)
    e._row_of, e._bt_signature = [None] * e.max_seqs, None
    e._graph = lambda B: SimpleNamespace(launch=lambda stream: log.append(("decode", stream.name)))
    e._plan = lambda shape, all_logits: _PassPlan(
        [lambda stream: log.append(("body", stream.name))], [lambda stream: log.append(("head", stream.name))]
    )
    return e, log


@pytest.mark.parametrize("adopts_the_decoded_page", [False, True])
def test_prefill_layers_wait_for_the_decode_only_for_a_page_it_completes(adopts_the_decoded_page):
    """Sequence a holds 31 tokens (pages of 16: one full page, cached); this step decodes its 32nd, which completes
    its second page, cached when the step is launched but written when the graph runs. A prompt of the same step
    that adopts that page must have its pass's layers wait for the decode (the side stream waits on the event
    after the decode's readback); one that adopts only the first page runs its layers beside the decode, and only
    its head (the decode's buffers) waits. Both streams are waited for before the call returns."""
    from ingot.runtime.engines.base import PrefillChunk
    from ingot.runtime.sampling import SamplingParams

    e, log = stream_engine()
    prompt = list(range(100, 131))
    a = e.new_sequence(SamplingParams())
    e.decode_and_prefill([], [], None, [PrefillChunk(a, prompt)])
    b = e.new_sequence(SamplingParams())
    shared = prompt + [7] if adopts_the_decoded_page else prompt[:16]
    log.clear()
    e.decode_and_prefill([a], [7], None, [PrefillChunk(b, shared + [1, 2])])
    assert e._seqs[b].pages[: len(shared) // 16] == e._seqs[a].pages[: len(shared) // 16]  # adopted
    assert e.pages.prefix_stats()["hit_tokens"] == len(shared)
    assert log.index(("decode", "main")) < log.index(("record", "main"))
    wait, body, head = log.index(("wait", "side")), log.index(("body", "side")), log.index(("head", "side"))
    assert (wait < body < head) if adopts_the_decoded_page else (body < wait < head)
    assert log.count(("wait", "side")) == 1 and {("sync", "main"), ("sync", "side")} <= set(log[head:])


def test_a_step_launched_ahead_copies_its_tokens_on_the_device_and_registers_their_pages_once_read():
    """Step 2 is launched while step 1 is in flight, feeding both sequences the tokens step 1 samples
    (FROM_DEVICE), in the other order: each is copied on the device from step 1's output row into its own input
    row (two runs: the rows are not consecutive in the same order), after the upload and before the decode
    graph, and the side stream first waits for step 1's decode. Sequence a's token completes its second KV page:
    that page is hashed and cached only when step 1 is collected and the token is known."""
    from ingot.runtime.engines.base import FROM_DEVICE, PrefillChunk
    from ingot.runtime.errors import UsageError
    from ingot.runtime.sampling import SamplingParams

    e, log = stream_engine()
    e.step.ptr = {"tokens": 1000}
    e._slots[0].out_dev, e._slots[1].out_dev = 5000, 6000
    a, b, c = (e.new_sequence(SamplingParams()) for _ in range(3))
    e.decode_and_prefill([], [], None, [PrefillChunk(a, list(range(100, 130))), PrefillChunk(b, [5] * 40)])
    one = e.launch([a, b], [7, 8], None, [])  # a: position 30 -> 31
    log.clear()
    two = e.launch([b, a], [FROM_DEVICE, FROM_DEVICE], None, [])  # a's token at position 31 fills page 2
    copies = [x for x in log if x[0] == "copy"]
    assert copies[:2] == [("copy", "main", 1000, 5004, 4), ("copy", "main", 1004, 5000, 4)]
    assert log[0] == ("wait", "side") and log.index(copies[1]) < log.index(("decode", "main"))
    assert copies[2] == ("copy", "main", 6000, e.out_tokens.ptr, 8)  # step 2's tokens, for a step 3
    assert len(e._seqs[a].chain.hashes) == 1 and e._seqs[a].pos == 32
    with pytest.raises(RuntimeError, match="in flight"):
        e.launch([a], [FROM_DEVICE], None, [])
    with pytest.raises(RuntimeError, match="order"):
        e.collect(two)
    with pytest.raises(RuntimeError, match="not collected"):  # a call that waits for its own step
        e.decode_and_prefill([c], [1], None, [])
    e.collect(one)
    assert len(e._seqs[a].chain.hashes) == 2  # registered with the token step 1 sampled
    e.collect(two)
    with pytest.raises(UsageError, match="no sampled token"):
        e.launch([c], [FROM_DEVICE], None, [])  # c never sampled


def test_copy_runs_are_one_copy_per_run_of_consecutive_rows():
    e, log = stream_engine()
    e._copy_runs(100, 200, [(0, 0), (1, 1), (2, 3), (3, 4), (5, 5)])
    assert log == [("copy", "main", 100, 200, 8), ("copy", "main", 108, 212, 8), ("copy", "main", 120, 220, 4)]


def test_a_failed_prefill_launch_leaves_nothing_queued_on_the_side_stream():
    """An error while the passes are being queued (here the second pass's plan) waits for what the side stream
    was given before it propagates: the next step's decode on the main stream must not run beside it."""
    from ingot.runtime.engines.base import PrefillChunk
    from ingot.runtime.sampling import SamplingParams

    e, log = stream_engine()
    plans = iter([_PassPlan([lambda stream: log.append(("body", stream.name))], [])])
    e._plan = lambda shape, all_logits: next(plans)  # the second pass raises StopIteration
    a, b = e.new_sequence(SamplingParams()), e.new_sequence(SamplingParams())
    with pytest.raises(StopIteration):
        e.decode_and_prefill([], [], None, [PrefillChunk(a, [1] * 500), PrefillChunk(b, [2] * 40)])
    assert ("body", "side") in log and log[-1] == ("sync", "side")
    assert not e._flight  # nothing to collect


def test_a_step_is_checked_whole_before_any_work():
    """A chunk of a sequence that the same step decodes, and a step whose pages do not fit, are refused before
    anything changed."""
    from ingot.runtime.engines.base import PrefillChunk
    from ingot.runtime.engines.kvcache import CacheFullError
    from ingot.runtime.errors import UsageError
    from ingot.runtime.sampling import SamplingParams

    e = host_engine()
    e.max_ctx = 4096
    a, b = e.new_sequence(SamplingParams()), e.new_sequence(SamplingParams())
    with pytest.raises(UsageError, match="twice"):
        e._check([PrefillChunk(a, [1, 2])], decoding=[a])
    with pytest.raises(CacheFullError):
        e._check([PrefillChunk(a, [1] * 1000), PrefillChunk(b, [1] * 3200)])  # 63 + 200 pages of 16 > 256
    assert e.pages.free == 256 and e._seqs[a].pos == e._seqs[b].pos == 0


def _model_of(shape_name: str, quant: str) -> Model:
    """A synthetic model's tensors with their real types and sizes, and no bytes (broadcast views)."""
    shape = SHAPES[shape_name]
    c = config_of(shape)
    tensors = {}
    for name, dims in expected_shapes(c).items():
        q = tensor_type(quant, name, dims, c.n_layers, shape.tied)
        size = (dims[0], QUANT_TYPES[q].row_bytes(dims[1])) if len(dims) == 2 else (4 * dims[0],)
        tensors[name] = QTensor(name, q, dims, np.broadcast_to(np.uint8(0), size))
    return Model(Path(shape_name), 0, 0, shape_name, c, None, tensors)  # type: ignore[arg-type]


def test_layer_matrix_bytes_average_a_layer_by_type():
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336  # q, k, v; o; gate, up, down
    assert layer_matrix_bytes(_model_of("llama3-8b", "Q4_0")) == {"Q4_0": per_layer // 32 * 18}
    mix = layer_matrix_bytes(_model_of("llama3-8b", "Q4_K_M"))
    assert set(mix) == {"Q4_K", "Q6_K"} and mix["Q4_K"] > 4 * mix["Q6_K"] > 0  # v and down in a third of the layers


@pytest.mark.parametrize(
    "shape, quant, mma, frag, want",
    [
        ("llama3-8b", "Q4_0", True, True, 3),  # fragment GEMMs: b3 757 tok/s against the matvecs' 637 (b2 516 / 566)
        ("llama3-8b", "Q4_0", True, False, 8),  # INGOT_MATMUL=mma-tile: matmul2 for every type
        ("llama3-8b", "Q4_0", False, True, 16),  # no mma GEMM (sm_75, INGOT_MATMUL=wmma)
        # K-quants: b4 matvec 632 tok/s against matmul2's 420, b8 684 / 829; Q4_K and Q6_K on the fragment GEMMs
        # (PERF.md v26): b3 591 / 496, b4 625 / 652, b8 672 / 1,282
        ("llama3-8b", "Q4_K_M", True, True, 4),
        ("llama3-8b", "Q4_K_M", True, False, 8),  # INGOT_MATMUL=mma-tile
        ("llama3-8b", "Q5_K_M", True, True, 8),  # Q5_K and Q6_K: most bytes in matmul2's types
        ("smollm2-135m", "Q4_1", True, True, 16),  # launch-bound: matvec b8 7,694 tok/s against 7,444
        ("qwen3-0.6b", "Q4_0", True, True, 16),
        ("gemma3-270m", "Q4_K_M", True, True, 16),
    ],
)
def test_decode_gemm_min_batch_per_model(shape, quant, mma, frag, want):
    assert decode_gemm_min_batch(layer_matrix_bytes(_model_of(shape, quant)), mma, frag) == want


@pytest.mark.parametrize(
    "shape, quant, want",
    [
        # matvec_<type>_bxs (H100, PERF.md v39): Q4_0 b3 1,109 tok/s against the fragment GEMM's 773, b4 1,265 /
        # 1,020; Q4_K_M b4 1,134 / 666
        ("llama3-8b", "Q4_0", 5),
        ("llama3-8b", "Q4_K_M", 5),
        ("llama3-8b", "Q5_K_M", 8),  # most bytes in Q5_K, which bxs does not serve
        ("smollm2-135m", "Q4_1", 16),  # launch-bound layers keep theirs
    ],
)
def test_decode_gemm_min_batch_with_staged_columns(shape, quant, want):
    """On a GPU that runs matvec_<type>_bxs, a layer mostly in its types takes the matvecs up to MATVEC_COLS."""
    layer = layer_matrix_bytes(_model_of(shape, quant))
    assert decode_gemm_min_batch(layer, True, True, cols_staged=True) == want
    assert decode_gemm_min_batch(layer, True, True, cols_staged=False) <= want


@pytest.mark.parametrize(
    "shape, quant, want",
    [
        ("smollm2-135m", "Q4_1", True),  # 2.2 MB layers: the real model b4 +14%, b8 +8% on an H100 (PERF.md v22)
        ("qwen3-0.6b", "Q4_0", True),
        ("llama3-8b", "Q4_0", False),  # 123 MB layers: 0.8-1.1 TB/s, slower than the GEMM from 3 and dp4a at 2
    ],
)
def test_narrow_mma_matvec_per_model(shape, quant, want):
    assert narrow_mma_model(layer_matrix_bytes(_model_of(shape, quant))) is want


def test_a_small_model_runs_three_to_eight_sequences_through_the_tensor_core_matvec():
    """The engine hands its narrow_mma (narrow_mma_model: layers under 64 MiB) to every matvec of a batch decode:
    SmolLM2's Q4_1 matrices, the head included, run matvec_q4_1_mma at 3-8 sequences; 2 sequences, and a model not
    marked, keep the dp4a kernel. The launch list is otherwise the same."""
    c = config_of(SHAPES["smollm2-135m"])
    e = plan_engine(c, "Q4_1")
    e.gemm_min_batch = 16  # decode_gemm_min_batch's for SmolLM2: 8 sequences still take the matvecs
    plain = {B: kernel_names(e._decode_launches(B)) for B in (2, 4, 8)}
    e.narrow_mma = True
    assert kernel_names(e._decode_launches(2)) == plain[2]
    for B in (4, 8):
        narrow = kernel_names(e._decode_launches(B))
        assert narrow.count("matvec_q4_1_mma") == 4 * c.n_layers + 1 == plain[B].count("matvec_q4_1")
        assert [n.replace("matvec_q4_1_mma", "matvec_q4_1") for n in narrow] == plain[B]


def test_a_kernel_folder_named_in_INGOT_KERNELS_must_exist_and_be_whole(tmp_path, monkeypatch):
    """--device auto falls back to the CPU engine on an IncompatibleError (an install built without nvcc), so a
    folder named in INGOT_KERNELS that is absent or incomplete is a usage error (exit 2) instead: a mistyped
    INGOT_KERNELS turned `ingot bench` on an H100 into a silent CPU run (58 tok/s, PERF.md v33)."""
    monkeypatch.setenv("INGOT_KERNELS", str(tmp_path / "nope"))
    with pytest.raises(UsageError, match=r"^INGOT_KERNELS \S*nope: no such folder"):
        kernel_images()
    part = tmp_path / "part"
    part.mkdir()
    (part / "matvec.fatbin").write_bytes(b"\0")
    monkeypatch.setenv("INGOT_KERNELS", str(part))
    with pytest.raises(UsageError, match=r"^INGOT_KERNELS \S*part lacks .*norm\.fatbin") as e:
        kernel_images()
    assert "matvec.fatbin" not in str(e.value) and "ingot build --out" in e.value.hint
    whole = tmp_path / "whole"
    whole.mkdir()
    for m in MODULES:
        (whole / f"{m}.fatbin").write_bytes(m.encode())
    monkeypatch.setenv("INGOT_KERNELS", str(whole))
    assert kernel_images() == {m: m.encode() for m in MODULES}
    # unnamed, an install without fatbins stays an IncompatibleError: what --device auto falls back on
    monkeypatch.delenv("INGOT_KERNELS")
    monkeypatch.setattr(kernels_module, "installed_kernel_dir", lambda: part)
    with pytest.raises(IncompatibleError, match="GPU kernels missing from"):
        kernel_images()
