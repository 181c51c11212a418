"""The kernels of the architecture features beyond Llama's block against numpy, on random inputs of odd sizes:
q/k head norms (fused into rope_kv and into decode attention), the post-norm residual add, GEGLU/SwiGLU with
fp16 and fp32 outputs, and both attention kernels with head_dim 256, sliding windows, a custom scale and
softcapping. The attention references are the CPU reference's own functions (runtime/model/reference.py), so the
window semantics checked are exactly the reference's: a query at p sees the keys at p - window + 1 .. p.

Outputs are poisoned (0xFF bytes: NaN for floats) before each launch, so an unwritten element fails. Tolerances:
fp32 elementwise work ~1e-5 relative (fast-math exp/rsqrt); anything through the fp16 KV cache or an fp16
output ~2e-3 (fp16's 2^-11 relative rounding, accumulated over a head's dot product), as test_gpu_kernels.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from numerics import rel_err

from ingot.runtime.gpu import constants as K
from ingot.runtime.model.reference import attention, gelu_tanh, rms_norm, rope, silu

EPS = 1e-6


class _Cfg:
    """The Config fields the attention/rope kernels read."""

    def __init__(self, H, Hkv, hd, neox=True):
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dim, self.rope_neox = H, Hkv, hd, hd, neox


def _rope_table(hd, n_pos, theta):
    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angle = np.arange(n_pos)[:, None] * inv_freq[None, :]
    return inv_freq, np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)


def _norm_rope(x, w, pos, inv_freq, neox=True):
    """The reference's q/k path: RMSNorm over each head (w [hd] or None), then RoPE. x [n, heads, hd]."""
    x = x.astype(np.float32)
    if w is not None:
        x = rms_norm(x, w, EPS)
    return rope(x, np.asarray(pos), inv_freq, neox)


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_kv_with_head_norms(gpu, rng, hd, qk_norm):
    H, Hkv, n, n_pages, max_pages = 6, 3, 9, 40, 8
    qkv = (rng.standard_normal((n, (H + 2 * Hkv) * hd)) * 3).astype(np.float32)
    slot = rng.choice(3 * max_pages * K.PAGE, size=n, replace=False)
    seq, pos = (slot // (max_pages * K.PAGE)).astype(np.int32), (slot % (max_pages * K.PAGE)).astype(np.int32)
    table = rng.permutation(n_pages)[: 3 * max_pages].reshape(3, max_pages).astype(np.int32)
    inv_freq, tab = _rope_table(hd, max_pages * K.PAGE, 10000.0)
    qn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    kn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    page_elems = K.PAGE * Hkv * hd
    kc, vc = gpu.empty(2 * n_pages * page_elems, 0), gpu.empty(2 * n_pages * page_elems, 0)
    dq = gpu.put(qkv)
    norms = {"q_norm": gpu.put(qn), "k_norm": gpu.put(kn), "eps": EPS} if qk_norm else {}
    gpu.run(
        gpu.k.rope_kv(
            dq.ptr,
            gpu.put(tab),
            gpu.put(seq).ptr,
            gpu.put(pos).ptr,
            gpu.put(table).ptr,
            max_pages,
            kc.ptr,
            vc.ptr,
            n,
            _Cfg(H, Hkv, hd),
            **norms,
        )
    )
    out = gpu.get(dq, np.float32, qkv.shape)
    q_ref = _norm_rope(qkv[:, : H * hd].reshape(n, H, hd), qn if qk_norm else None, pos, inv_freq).reshape(n, -1)
    k_ref = _norm_rope(qkv[:, H * hd : (H + Hkv) * hd].reshape(n, Hkv, hd), kn if qk_norm else None, pos, inv_freq)
    assert rel_err(out[:, : H * hd], q_ref) < 1e-5
    kcache = gpu.get(kc, np.float16, (n_pages, Hkv, K.PAGE, hd))
    vcache = gpu.get(vc, np.float16, (n_pages, Hkv, K.PAGE, hd))
    v_ref = qkv[:, (H + Hkv) * hd :].reshape(n, Hkv, hd)
    for i in range(n):
        page, s = table[seq[i], pos[i] // K.PAGE], pos[i] % K.PAGE
        assert rel_err(kcache[page, :, s], k_ref[i]) < 1e-3
        assert rel_err(vcache[page, :, s], v_ref[i]) < 1e-3


@pytest.mark.parametrize("n,dim", [(1, 640), (7, 96), (13, 1152)])
@pytest.mark.parametrize("then_norm", [False, True])
def test_add_rmsnorm(gpu, rng, n, dim, then_norm):
    """x += rmsnorm(o) * w; with then_norm also rmsnorm(new x) * w_next in all three forms (fp32, q8x2, fp16)."""
    x = rng.standard_normal((n, dim)).astype(np.float32)
    o = (rng.standard_normal((n, dim)) * 7).astype(np.float32)
    w = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    w_next = (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32)
    dx = gpu.put(x)
    y, yh = gpu.empty(4 * n * dim), gpu.empty(2 * n * dim)
    yq, yd = gpu.empty(2 * n * dim), gpu.empty(16 * n * dim // 32)
    outs = {"w_next": gpu.put(w_next), "y": y, "yq": yq, "yd": yd, "yh": yh} if then_norm else {}
    gpu.run(gpu.k.add_rmsnorm(dx.ptr, gpu.put(o).ptr, gpu.put(w), n, dim, EPS, **outs))
    new_x = x + rms_norm(o, w, EPS)
    assert rel_err(gpu.get(dx, np.float32, x.shape), new_x) < 1e-5
    if not then_norm:
        return
    ref = rms_norm(new_x, w_next, EPS)
    assert rel_err(gpu.get(y, np.float32, x.shape), ref) < 1e-5
    assert rel_err(gpu.get(yh, np.float16, x.shape), ref) < 1e-3
    q = gpu.get(yq, np.int8, (n * dim // 32, 64)).astype(np.float64)
    d = gpu.get(yd, np.float32, (n * dim // 32, 4)).astype(np.float64)
    deq = q[:, :32] * d[:, :1] + q[:, 32:] * d[:, 1:2]  # q8x2: coarse and fine int8 levels (common.cuh)
    assert rel_err(deq.reshape(n, dim), ref) < 1e-4


@pytest.mark.parametrize("activation,act", [("gelu_tanh", gelu_tanh), ("silu", silu)])
def test_gated_activations(gpu, rng, activation, act):
    n, F = 7, 97
    gu = (rng.standard_normal((n, 2 * F)) * 3).astype(np.float32)
    ref = act(gu[:, :F]) * gu[:, F:]
    hh, hf = gpu.empty(2 * n * F), gpu.empty(4 * n * F)
    gpu.run(gpu.k.gated_act(activation, gpu.put(gu).ptr, F, n, hh=hh.ptr, hf=hf.ptr))
    assert rel_err(gpu.get(hf, np.float32, (n, F)), ref) < 1e-5
    assert rel_err(gpu.get(hh, np.float16, (n, F)), ref) < 1e-3
    if activation == "gelu_tanh":  # the named launcher the GEMM paths' callers may use
        h = gpu.empty(2 * n * F)
        gpu.run(gpu.k.geglu(gpu.put(gu).ptr, h.ptr, F, n))
        assert rel_err(gpu.get(h, np.float16, (n, F)), ref) < 1e-3


def _random_cache(gpu, rng, n_pages, Hkv, hd):
    k = rng.standard_normal((n_pages, Hkv, K.PAGE, hd)).astype(np.float16)
    v = rng.standard_normal((n_pages, Hkv, K.PAGE, hd)).astype(np.float16)
    return k, v, gpu.put(k), gpu.put(v)


DECODE_CASES = [
    # hd, H, Hkv, window, scale, softcap, qk_norm
    (256, 4, 1, 512, 0.0625, 0.0, True),  # Gemma 3 270M's local layer
    (256, 8, 4, 40, 0.05, 0.0, True),
    (128, 8, 1, 0, 0.0, 0.0, True),  # Qwen 3: qk-norm, global
    (128, 6, 2, 7, 0.0, 30.0, False),  # a window inside one page, softcapped scores
    (64, 9, 3, 33, 0.1, 50.0, False),
]


@pytest.mark.parametrize("hd,H,Hkv,window,scale,softcap,qk_norm", DECODE_CASES)
@pytest.mark.parametrize("splits", [1, 7, 45])
def test_attention_decode_windows_and_norms(gpu, rng, hd, H, Hkv, window, scale, softcap, qk_norm, splits):
    """Fused decode attention of one new token per sequence, lengths inside, at and far past the window (2100
    keys: 33 active splits of 2 pages at 45, past one lane a split in the merge)."""
    lens = [1, 31, 33, 100, 513, 1000, 2100]
    _check_decode(gpu, rng, lens, hd, H, Hkv, window, scale, softcap, qk_norm, splits)


# Lengths around what the v8 kernel (cuda/attention_decode.cu) cuts: one key, the one-split direct output (up to
# 64 keys: ATT_ONE_SPLIT_PAGES), page boundaries +-1, many pages per split (600, 1500), and 5000 keys (157 pages:
# past 32 splits of one page, past v7's 32 splits x 4 pages; 53 active of v8's 64 splits); B = 1..5 sequences of
# mixed lengths.
DECODE_LENGTHS = [[1], [2, 32], [31, 33, 64], [65, 600, 1, 1500], [5000, 2, 97, 33, 1024]]
DECODE_SHAPES = [  # hd, H, Hkv: GQA 1, 4 and 8 over the three head sizes
    (64, 3, 3),
    (128, 32, 8),
    (128, 8, 1),
    (256, 4, 1),
    (256, 8, 1),
]


@pytest.mark.parametrize("version", ["v8", "v7"])
@pytest.mark.parametrize("hd,H,Hkv", DECODE_SHAPES)
@pytest.mark.parametrize("window", [0, 33, 512])
@pytest.mark.parametrize("lens", DECODE_LENGTHS, ids=lambda x: "-".join(map(str, x)))
def test_attention_decode_lengths(gpu, rng, monkeypatch, version, hd, H, Hkv, window, lens):
    """Every length the split geometry treats differently, for both kernel versions (INGOT_DECODE_ATTN), with a
    grid as wide as the kernel merges (MAX_SPLITS; v7 32) and a narrow one (3: several pages per split)."""
    monkeypatch.setenv("INGOT_DECODE_ATTN", version)
    softcap, qk_norm = (0.0, True) if hd == 256 else (20.0, False)  # Gemma's features at hd 256
    for splits in (K.MAX_SPLITS if version == "v8" else 32, 3):
        _check_decode(gpu, rng, lens, hd, H, Hkv, window, 0.0, softcap, qk_norm, splits)


def _check_decode(gpu, rng, lens, hd, H, Hkv, window, scale, softcap, qk_norm, splits):
    """One decode attention launch against the CPU reference: the new k, v in the cache, every output (fp32,
    fp16, q8x2), the counters back at zero, and a replay giving the same bits."""
    lens = np.array(lens, dtype=np.int32)
    B, max_pages = len(lens), -(-int(lens.max()) // K.PAGE) + 1
    n_pages = B * max_pages
    kh, vh, kc, vc = _random_cache(gpu, rng, n_pages, Hkv, hd)
    table = rng.permutation(n_pages).reshape(B, max_pages).astype(np.int32)
    qkv = (rng.standard_normal((B, (H + 2 * Hkv) * hd)) * 2).astype(np.float32)
    inv_freq, tab = _rope_table(hd, max_pages * K.PAGE, 10000.0)
    qn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    kn = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32) if qk_norm else None
    acc, ml = gpu.empty(4 * B * H * splits * hd), gpu.empty(8 * B * H * splits)
    counters = gpu.empty(4 * B * Hkv, 0)
    out, outh = gpu.empty(4 * B * H * hd), gpu.empty(2 * B * H * hd)
    outq, outd = gpu.empty(2 * B * H * hd), gpu.empty(16 * B * H * hd // 32)
    launch = gpu.k.attn_decode(
        gpu.put(qkv).ptr,
        gpu.put(tab),
        kc.ptr,
        vc.ptr,
        gpu.put(table).ptr,
        max_pages,
        gpu.put(lens - 1).ptr,
        acc.ptr,
        ml.ptr,
        counters.ptr,
        out.ptr,
        B,
        splits,
        _Cfg(H, Hkv, hd),
        outq=outq.ptr,
        outd=outd.ptr,
        outh=outh.ptr,
        scale=scale,
        window=window,
        softcap=softcap,
        q_norm=gpu.put(qn) if qk_norm else None,
        k_norm=gpu.put(kn) if qk_norm else None,
        eps=EPS,
    )
    gpu.run(launch)
    got = gpu.get(out, np.float32, (B, H * hd))
    assert not gpu.get(counters, np.int32, (B * Hkv,)).any()
    gpu.stream.memset(out.ptr, 0xFF, 4 * B * H * hd)
    gpu.run(launch)  # a replay (the graph's case): the same bits, from the counters the last block reset
    assert np.array_equal(gpu.get(out, np.float32, (B, H * hd)), got)
    kcache = gpu.get(kc, np.float16, kh.shape)
    for b, n in enumerate(lens):
        p = int(n) - 1
        q = _norm_rope(qkv[b, : H * hd].reshape(1, H, hd), qn, [p], inv_freq)
        k_new = _norm_rope(qkv[b, H * hd : (H + Hkv) * hd].reshape(1, Hkv, hd), kn, [p], inv_freq)[0]
        v_new = qkv[b, (H + Hkv) * hd :].reshape(Hkv, hd)
        page, s = table[b, p // K.PAGE], p % K.PAGE
        assert rel_err(kcache[page, :, s], k_new) < 1e-3  # the new key (normed, rotated) landed in its page
        kh[page, :, s], vh[page, :, s] = k_new, v_new
        pages = table[b, : (n + K.PAGE - 1) // K.PAGE]
        k = kh[pages].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:n].astype(np.float32)  # [n, Hkv, hd]
        v = vh[pages].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:n].astype(np.float32)
        ref = attention(q, k, v, p, scale=scale, window=window, softcap=softcap)[0]
        assert rel_err(got[b], ref) < 2e-3, (b, n)
    assert rel_err(gpu.get(outh, np.float16, got.shape), got) < 1e-3
    # q8x2: coarse and fine int8 levels (common.cuh), ~15 bits: 1e-4 as the rmsnorm test
    q8 = gpu.get(outq, np.int8, (B * H * hd // 32, 64)).astype(np.float64)
    d8 = gpu.get(outd, np.float32, (B * H * hd // 32, 4)).astype(np.float64)
    assert rel_err((q8[:, :32] * d8[:, :1] + q8[:, 32:] * d8[:, 1:2]).ravel(), got.ravel()) < 1e-4


@pytest.mark.parametrize("hd,H,Hkv", [(256, 4, 1), (256, 8, 2), (128, 6, 3)])
@pytest.mark.parametrize("window", [0, 40, 512])
@pytest.mark.parametrize("start,T", [(0, 1), (0, 37), (45, 100), (500, 40), (600, 130)])
def test_attention_prefill_windows_hd256(gpu, rng, hd, H, Hkv, window, start, T):
    total = start + T
    max_pages = (total + K.PAGE - 1) // K.PAGE
    kh, vh, kc, vc = _random_cache(gpu, rng, max_pages + 5, Hkv, hd)
    row = rng.permutation(max_pages + 5)[:max_pages].astype(np.int32)
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
    out = gpu.empty(2 * T * H * hd)
    scale, softcap = 0.07, 0.0 if window else 20.0
    gpu.run(
        gpu.k.attn_prefill(
            gpu.put(qkv).ptr,
            qkv.shape[1],
            kc.ptr,
            vc.ptr,
            gpu.put(row).ptr,
            gpu.put(np.arange(start, total, dtype=np.int32)).ptr,
            T,
            out.ptr,
            _Cfg(H, Hkv, hd),
            scale=scale,
            window=window,
            softcap=softcap,
        )
    )
    got = gpu.get(out, np.float16, (T, H * hd))
    k = kh[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)  # [total, Hkv, hd]
    v = vh[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)
    q = qkv[:, : H * hd].reshape(T, H, hd)
    ref = attention(q, k, v, start, scale=scale, window=window, softcap=softcap)
    for t in range(T):  # row by row: a failure names the query
        assert rel_err(got[t], ref[t]) < 2e-3, t
