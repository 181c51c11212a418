"""Prefill attention (cuda/attention_prefill.cu, tensor cores; attention.cu's scalar kernel as the fallback)
against the CPU reference's attention (runtime/model/reference.py) on random odd sizes: chunks of T new tokens
after a cached prefix (chunked prefill, prefix-cache hits), head_dim 64/128/256, GQA groups 1/3/4, sliding
window 512 with sequences crossing it, softcap on/off. The cache pages are a random permutation, and the slots
past the chunk's last position hold NaN/Inf: a kernel that reads them (instead of zero-filling) fails.

Tolerance, relative L2 over one token's row (all heads), 2e-3 as the other attention tests. The tensor-core
kernel adds two fp16 roundings to the scalar kernel's fp32 math: q*scale (2^-11 relative per element, so a score
moves by at most 2^-11 * scale * sum_i |q_i k_i|: ~2e-4 typical for these N(0,1) inputs, whose rounding errors
have random signs) and the softmax weights p in [0, 1] before the P.V product (each term off by at most
2^-11 p |v|, so the output by at most 2^-11 max|v|, ~5e-4 relative for a row of averaged N(0,1) values); the fp16
output adds 2^-12. An indexing bug (wrong key, head, mask or fragment lane) gives errors of order 1.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from numerics import rel_err

from ingot.runtime.gpu import constants as K
from ingot.runtime.model.reference import attention

TOL = 2e-3


class _Cfg:
    def __init__(self, H, Hkv, hd):
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, hd


@contextlib.contextmanager
def _kernel(gpu, mma: bool):
    """Launch the tensor-core (mma) or the scalar prefill kernel, whichever Kernels chose at load."""
    if mma and gpu.dev.info.cc < 80:
        pytest.skip("the tensor-core prefill kernel needs compute capability 8.0")
    saved = gpu.k.prefill_mma
    gpu.k.prefill_mma = mma
    try:
        yield
    finally:
        gpu.k.prefill_mma = saved


def _prefill(gpu, rng, hd, H, Hkv, start, T, *, window=0, softcap=0.0, scale=0.0, mma=True):
    """Run prefill attention of T tokens at positions start.. over a random paged cache; returns (got, ref)
    [T, H*hd]."""
    total = start + T
    n_pages = (total + K.PAGE - 1) // K.PAGE
    kh = rng.standard_normal((n_pages + 3, Hkv, K.PAGE, hd)).astype(np.float16)
    vh = rng.standard_normal((n_pages + 3, Hkv, K.PAGE, hd)).astype(np.float16)
    row = rng.permutation(n_pages + 3)[:n_pages].astype(np.int32)
    last, used = row[-1], (total - 1) % K.PAGE + 1
    kh[last, :, used:], vh[last, :, used:] = np.nan, np.inf  # stale slots past the chunk: never to be read
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
    out = gpu.empty(2 * T * H * hd)
    with _kernel(gpu, mma):
        launch = gpu.k.attn_prefill(
            gpu.put(qkv).ptr,
            qkv.shape[1],
            gpu.put(kh).ptr,
            gpu.put(vh).ptr,
            gpu.put(row).ptr,
            gpu.put(np.arange(start, total, dtype=np.int32)).ptr,
            T,
            out.ptr,
            _Cfg(H, Hkv, hd),
            scale=scale,
            window=window,
            softcap=softcap,
        )
        if not mma:  # the scalar kernel's shared-memory opt-in (Kernels made only the chosen kernel's)
            launch.kernel.allow_dynamic_smem(gpu.k.prefill_smem(hd))
    gpu.run(launch)
    got = gpu.get(out, np.float16, (T, H * hd))
    k = kh[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)  # [total, Hkv, hd]
    v = vh[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)
    q = qkv[:, : H * hd].reshape(T, H, hd)
    return got, attention(q, k, v, start, scale=scale, window=window, softcap=softcap)


HEADS = [(64, 9, 3), (64, 3, 1), (128, 8, 8), (128, 12, 3), (256, 4, 1), (256, 2, 2)]  # (hd, H, Hkv): G 3,3,1,4,4,1


@pytest.mark.parametrize("hd,H,Hkv", HEADS)
@pytest.mark.parametrize("start", [0, 37, 700])
@pytest.mark.parametrize("T", [1, 7, 63, 65, 200, 600])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (512, 30.0)])
def test_prefill_attention_mma(gpu, rng, hd, H, Hkv, start, T, window, softcap):
    got, ref = _prefill(gpu, rng, hd, H, Hkv, start, T, window=window, softcap=softcap)
    for t in range(T):  # row by row: a failure names the query
        assert rel_err(got[t], ref[t]) < TOL, t


@pytest.mark.parametrize("hd,H,Hkv", [(64, 9, 3), (256, 4, 1)])
@pytest.mark.parametrize("window,softcap,scale", [(512, 0.0, 0.0), (0, 20.0, 0.07), (40, 0.0, 0.07)])
def test_prefill_attention_mma_window_softcap_scale(gpu, rng, hd, H, Hkv, window, softcap, scale):
    """The other window/softcap combinations, Gemma's custom scale, and a window shorter than a key tile."""
    got, ref = _prefill(gpu, rng, hd, H, Hkv, 700, 130, window=window, softcap=softcap, scale=scale)
    for t in range(130):
        assert rel_err(got[t], ref[t]) < TOL, t


@pytest.mark.parametrize("hd,H,Hkv", [(128, 8, 2), (256, 4, 1)])
def test_prefill_attention_scalar_and_mma_agree(gpu, rng, hd, H, Hkv):
    """INGOT_ATTN_PREFILL=scalar's kernel still works where the tensor-core one runs (the A/B switch)."""
    seed = int(rng.integers(1 << 30))
    a, ref = _prefill(gpu, np.random.default_rng(seed), hd, H, Hkv, 37, 100, window=512, softcap=30.0, mma=True)
    b, _ = _prefill(gpu, np.random.default_rng(seed), hd, H, Hkv, 37, 100, window=512, softcap=30.0, mma=False)
    assert rel_err(a, ref) < TOL and rel_err(b, ref) < TOL
    assert rel_err(a, b) < 2 * TOL


@pytest.mark.parametrize("hd,H,Hkv", [(64, 9, 3), (128, 12, 3), (256, 4, 1)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (512, 30.0)])
def test_prefill_attention_varlen_gives_the_bits_of_a_launch_per_sequence(gpu, rng, hd, H, Hkv, window, softcap):
    """One launch for a pass's three sequences (after cached prefixes of 0, 37 and 700 tokens, chunks of 7, 130
    and 65 rows, each with its own pages and stale NaN/Inf slots past its last position): every sequence's rows
    are bit-identical to a launch of its own, and within TOL of the reference."""
    if gpu.dev.info.cc < 80:
        pytest.skip("the tensor-core prefill kernel needs compute capability 8.0")
    seqs = [(0, 7), (37, 130), (700, 65)]  # (cached tokens before the chunk, the chunk's rows)
    cfg, ld = _Cfg(H, Hkv, hd), (H + 2 * Hkv) * hd
    max_pages = max(-(-(s + T) // K.PAGE) for s, T in seqs)
    n_pages = sum(-(-(s + T) // K.PAGE) for s, T in seqs) + 5
    kh = rng.standard_normal((n_pages, Hkv, K.PAGE, hd)).astype(np.float16)
    vh = rng.standard_normal((n_pages, Hkv, K.PAGE, hd)).astype(np.float16)
    pages = iter(rng.permutation(n_pages).tolist())
    table = np.full((len(seqs), max_pages), -1, np.int32)
    for z, (s, T) in enumerate(seqs):
        n = -(-(s + T) // K.PAGE)
        table[z, :n] = [next(pages) for _ in range(n)]
        last, used = table[z, n - 1], (s + T - 1) % K.PAGE + 1
        kh[last, :, used:], vh[last, :, used:] = np.nan, np.inf
    rows = sum(T for _, T in seqs)
    qkv = rng.standard_normal((rows, ld)).astype(np.float32)
    pos = np.concatenate([np.arange(s, s + T) for s, T in seqs]).astype(np.int32)
    starts = np.cumsum([0] + [T for _, T in seqs]).astype(np.int32)
    dq, dk, dv, dt, dp = gpu.put(qkv), gpu.put(kh), gpu.put(vh), gpu.put(table), gpu.put(pos)
    kw = {"scale": 0.0, "window": window, "softcap": softcap}
    together, apart = gpu.empty(2 * rows * H * hd), gpu.empty(2 * rows * H * hd)
    with _kernel(gpu, True):
        gpu.run(
            gpu.k.attn_prefill_varlen(
                dq.ptr,
                ld,
                dk.ptr,
                dv.ptr,
                dt.ptr,
                max_pages,
                dp.ptr,
                gpu.put(starts).ptr,
                [T for _, T in seqs],
                together.ptr,
                cfg,
                **kw,
            )
        )
        for z, (_, T) in enumerate(seqs):
            r0 = int(starts[z])
            gpu.run(
                gpu.k.attn_prefill(
                    dq.ptr + 4 * r0 * ld,
                    ld,
                    dk.ptr,
                    dv.ptr,
                    dt.ptr + 4 * z * max_pages,
                    dp.ptr + 4 * r0,
                    T,
                    apart.ptr + 2 * r0 * H * hd,
                    cfg,
                    **kw,
                )
            )
    got = gpu.get(together, np.float16, (rows, H * hd))
    assert np.array_equal(got, gpu.get(apart, np.float16, (rows, H * hd)))
    for z, (s, T) in enumerate(seqs):
        n = -(-(s + T) // K.PAGE)
        k = kh[table[z, :n]].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[: s + T].astype(np.float32)
        v = vh[table[z, :n]].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[: s + T].astype(np.float32)
        q = qkv[starts[z] : starts[z + 1], : H * hd].reshape(T, H, hd)
        ref = attention(q, k, v, s, window=window, softcap=softcap)
        mine = got[starts[z] : starts[z + 1]]
        assert all(rel_err(mine[t], ref[t]) < TOL for t in range(T)), z
