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
