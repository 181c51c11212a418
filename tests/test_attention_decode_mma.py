"""cuda/attention_decode.cu's tensor-core page (hd 64 / 128 from sm_80) emulated in numpy, without a GPU.

The kernel's own index expressions drive the lane-level ldmatrix and mma.m16n8k16 models of
tests/test_attention_prefill.py: the scores^T = K . q^T tiles of warps 0 and 1 (q's B fragments from the fp16 rows
sQh), the per-head online softmax into fp16 P rows, and out^T += V^T . P^T with V^T from the transposing ldmatrix,
page by page of one split, then the accumulators' rows (dims) and columns (heads) back to outputs. Against float64
attention over the same fp16 keys and values: a wrong lane offset, matrix order or rescale shows here before a
device run. What stays for the GPU tests (tests/gpu/test_gpu_arch_kernels.py): the real instructions, the staging,
the splits and the merge.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_attention_prefill import GRP, LANE, QUAD, _ldmatrix_x4, _mma

from ingot.runtime.gpu.constants import PAGE

GMAX, WARPS, NEG_BIG = 8, 4, -1e30  # attention.cuh GMAX, ATT_WARPS, NEG_BIG


def emulate_split(q, k, v, k_begin, k_end, softcap):
    """One block's pages [k_begin // PAGE, ceil(k_end / PAGE)) of one kv head: q [G, hd] fp32 (normed, rotated,
    scaled), k, v [keys, hd] fp16 (the cache rows). Returns the unnormalized out [G, hd] and the running (m, l)."""
    G, HD = q.shape
    ROW = QR = HD + 8
    PR, KS, MTW = PAGE + 8, HD // 16, HD // 16 // WARPS
    sQh = np.zeros(GMAX * QR, np.float16)
    for g in range(G):
        sQh[g * QR : g * QR + HD] = q[g]
    sPh = np.zeros(GMAX * PR, np.float16)
    scorr = np.ones(GMAX, np.float32)
    m, lsum = np.full(GMAX, NEG_BIG, np.float32), np.zeros(GMAX, np.float32)

    def pair(buf, at):  # the two halfs a lane's 32-bit load takes from buf at element at[lane]
        return np.stack([buf[at], buf[at + 1]], 1)

    qf = [(pair(sQh, GRP * QR + ks * 16 + 2 * QUAD), pair(sQh, GRP * QR + ks * 16 + 2 * QUAD + 8)) for ks in range(KS)]
    o = np.zeros((WARPS, MTW, 32, 4), np.float32)
    for pg in range(k_begin // PAGE, -(-k_end // PAGE)):
        sK, sV = np.zeros(PAGE * ROW, np.float16), np.zeros(PAGE * ROW, np.float16)
        for r in range(PAGE):
            key = pg * PAGE + r
            if k_begin <= key < k_end:  # the kernel's fetch zero-fills the rest
                sK[r * ROW : r * ROW + HD], sV[r * ROW : r * ROW + HD] = k[key], v[key]
        sp = np.zeros((GMAX, PAGE), np.float32)
        for warp in range(2):
            sc = np.zeros((32, 4), np.float32)
            ka = (16 * warp + LANE % 16) * ROW + (LANE // 16) * 8
            for ks in range(KS):
                _mma(sc, _ldmatrix_x4(sK, ka + ks * 16), *qf[ks])
            for j in range(4):
                kin, h = 16 * warp + GRP + (j >> 1) * 8, 2 * QUAD + (j & 1)
                val = sc[:, j]
                if softcap > 0:
                    val = softcap * np.tanh(val / softcap)
                key = pg * PAGE + kin
                val = np.where((key >= k_begin) & (key < k_end), val, -np.inf)
                sp[h[h < G], kin[h < G]] = val[h < G]
        for g in range(G):
            m_new = max(m[g], sp[g].max())
            pr = np.exp(sp[g] - m_new).astype(np.float32)
            scorr[g] = np.exp(m[g] - m_new)
            lsum[g] = lsum[g] * scorr[g] + pr.sum()
            m[g] = m_new
            sPh[g * PR : g * PR + PAGE] = pr
        for warp in range(WARPS):
            o[warp] *= np.stack([scorr[2 * QUAD], scorr[2 * QUAD + 1]] * 2, 1)[None]
            for kk in range(2):
                b0 = pair(sPh, GRP * PR + kk * 16 + 2 * QUAD)
                b1 = pair(sPh, GRP * PR + kk * 16 + 2 * QUAD + 8)
                for mt in range(MTW):
                    d0 = (warp * MTW + mt) * 16
                    addr = (kk * 16 + LANE % 8 + (LANE // 16) * 8) * ROW + d0 + ((LANE // 8) & 1) * 8
                    _mma(o[warp, mt], _ldmatrix_x4(sV, addr, trans=True), b0, b1)
    out = np.full((G, HD), np.nan, np.float32)
    for warp in range(WARPS):
        for mt in range(MTW):
            for j in range(4):
                h, d = 2 * QUAD + (j & 1), (warp * MTW + mt) * 16 + GRP + (j >> 1) * 8
                out[h[h < G], d[h < G]] = o[warp, mt, h < G, j]
    return out, m[:G], lsum[:G]


@pytest.mark.parametrize(
    "hd,G,k_begin,k_end,softcap",
    [
        (128, 4, 0, 1, 0.0),  # one key: the new token alone
        (128, 4, 0, 64, 0.0),  # the 8B's group, two whole pages
        (128, 8, 40, 130, 30.0),  # 8 heads (n8 full), a split starting mid-page, softcapped
        (64, 3, 7, 97, 0.0),  # SmolLM2's group at hd 64 (one m16 tile of dims a warp)
        (64, 1, 0, 33, 50.0),  # one head: seven zero columns
    ],
)
def test_tensor_core_page_matches_attention(hd, G, k_begin, k_end, softcap):
    """The emulated split's normalized output is float64 attention over the same keys (fp16 q and P: within 2e-3,
    the GPU test's bound), and its running max is the scores' max."""
    rng = np.random.default_rng(hd * 100 + G + k_end)
    n = -(-k_end // PAGE) * PAGE
    k = rng.standard_normal((n, hd)).astype(np.float16)
    v = rng.standard_normal((n, hd)).astype(np.float16)
    q = (rng.standard_normal((G, hd)) * 2 / np.sqrt(hd)).astype(np.float32)
    out, m, lsum = emulate_split(q, k, v, k_begin, k_end, softcap)
    kf, vf = k[k_begin:k_end].astype(np.float64), v[k_begin:k_end].astype(np.float64)
    s = q.astype(np.float64) @ kf.T
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ vf
    got = out / lsum[:, None]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3
    assert np.allclose(m, s.max(1), rtol=1e-2, atol=1e-2)  # fp16 q: the max within its rounding
