"""Prefill attention's host side and its fragment arithmetic, without a GPU.

1. Which kernel runs (tensor cores from compute capability 8.0 unless INGOT_ATTN_PREFILL=scalar), its grid (the
   packed (token, query head) rows of one kv head per block cover every row once) and its shared memory (within
   every supported arch's opt-in limit: 99 KiB on sm_86/89/120 for hd 256).
2. An emulation of cuda/attention_prefill.cu's per-warp math in numpy: ldmatrix (plain and .trans) and
   mma.m16n8k16 modelled lane by lane from the PTX ISA's fragment layouts, driven by the kernel's own index
   expressions (row/column of each lane's ldmatrix address, the S accumulators reused as P's A fragments, the
   causal/window mask of each accumulator element, the quad reductions), against the CPU reference's attention.
   It checks the index arithmetic the kernel was written with; the GPU tests (tests/gpu/
   test_gpu_attention_prefill.py) check the kernel itself. Tolerance 2e-3 as there (fp16 q and P: see that file).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ingot.runtime.gpu.constants import PAGE, PREFILL_MMA_ROWS, PREFILL_QUERIES
from ingot.runtime.gpu.kernels import HEAD_DIMS, Kernels, prefill_uses_mma
from ingot.runtime.model.reference import attention

OPTIN_MIN_SM80_PLUS = 101376  # bytes: sm_86/89/120's per-block opt-in (the smallest of the archs >= 8.0)


def _kernels(mma: bool) -> Kernels:
    k = object.__new__(Kernels)  # the launch-geometry methods only: no device, no modules
    k.prefill_mma = mma
    return k


def test_the_tensor_core_kernel_needs_sm80_and_yields_to_the_switch(monkeypatch):
    monkeypatch.delenv("INGOT_ATTN_PREFILL", raising=False)
    assert prefill_uses_mma(90) and prefill_uses_mma(80) and not prefill_uses_mma(75)  # the default: mma
    monkeypatch.setenv("INGOT_ATTN_PREFILL", "mma")
    assert prefill_uses_mma(90) and prefill_uses_mma(80) and not prefill_uses_mma(75)
    monkeypatch.setenv("INGOT_ATTN_PREFILL", "scalar")
    assert not prefill_uses_mma(90)
    monkeypatch.setenv("INGOT_ATTN_PREFILL", "wmma")
    with pytest.raises(Exception, match="INGOT_ATTN_PREFILL"):
        prefill_uses_mma(90)


@pytest.mark.parametrize("T", [1, 7, 63, 65, 600])
@pytest.mark.parametrize("H,Hkv", [(9, 3), (4, 1), (8, 8), (32, 8)])
def test_prefill_grid_covers_every_row(T, H, Hkv):
    cfg = SimpleNamespace(n_heads=H, n_kv_heads=Hkv, head_dim=128)
    bx, by = _kernels(True).prefill_grid(T, cfg)
    rows = T * (H // Hkv)  # packed rows (token, query head of the kv head)
    assert by == Hkv and (bx - 1) * PREFILL_MMA_ROWS < rows <= bx * PREFILL_MMA_ROWS
    sx, sy = _kernels(False).prefill_grid(T, cfg)
    assert sy == H and (sx - 1) * PREFILL_QUERIES < T <= sx * PREFILL_QUERIES


def test_prefill_shared_memory_fits_every_arch_from_sm80():
    k = _kernels(True)
    sizes = {hd: k.prefill_bytes(hd) for hd in HEAD_DIMS}
    # sQ [64][hd+8] + sK, sV [2][32][hd+8], fp16
    assert sizes == {hd: (64 + 4 * PAGE) * (hd + 8) * 2 for hd in HEAD_DIMS}
    assert max(sizes.values()) <= OPTIN_MIN_SM80_PLUS
    assert _kernels(False).prefill_bytes(256) == Kernels.prefill_smem(256)


# --- the emulation -------------------------------------------------------------------------------------------

LANE = np.arange(32)
GRP, QUAD = LANE // 4, LANE % 4  # g = lane/4 (fragment row), c = lane%4 (fragment column pair)


def _ldmatrix_x4(smem: np.ndarray, addr: np.ndarray, trans: bool = False) -> np.ndarray:
    """ldmatrix.m8n8.x4(.trans): lane l gives the row address of matrix l/8, row l%8 (8 halfs from addr[l]);
    register i of lane t = matrix i's (row t/4, cols 2(t%4), +1), or with .trans (rows 2(t%4), +1, col t/4).
    Returns [4 regs, 32 lanes, 2 halfs]."""
    r = np.empty((4, 32, 2), np.float16)
    for i in range(4):
        M = np.stack([smem[a : a + 8] for a in addr[8 * i : 8 * i + 8]])
        if trans:
            r[i] = np.stack([M[2 * QUAD, GRP], M[2 * QUAD + 1, GRP]], 1)
        else:
            r[i] = np.stack([M[GRP, 2 * QUAD], M[GRP, 2 * QUAD + 1]], 1)
    return r


def _mma(d: np.ndarray, a, b0, b1) -> None:
    """mma.m16n8k16.row.col f32.f16.f16.f32 on per-lane fragments (layouts in attention_prefill.cu)."""
    A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
    for i, (r0, k0) in enumerate([(0, 0), (8, 0), (0, 8), (8, 8)]):
        A[GRP + r0, 2 * QUAD + k0], A[GRP + r0, 2 * QUAD + k0 + 1] = a[i][:, 0], a[i][:, 1]
    for b, k0 in ((b0, 0), (b1, 8)):
        B[2 * QUAD + k0, GRP], B[2 * QUAD + k0 + 1, GRP] = b[:, 0], b[:, 1]
    D = A @ B
    d += np.stack([D[GRP, 2 * QUAD], D[GRP, 2 * QUAD + 1], D[GRP + 8, 2 * QUAD], D[GRP + 8, 2 * QUAD + 1]], 1)


def _emulate(qkv, kc, vc, block_row, start, T, H, Hkv, HD, scale, window, softcap):
    """attn_prefill_mma<HD> for every block and warp; the loads are done at once (no pipelining to emulate)."""
    BQ, LD, NT, DT, KS, G = PREFILL_MMA_ROWS, HD + 8, PAGE // 8, HD // 8, HD // 16, H // Hkv
    rows, out = T * G, np.full((T, H * HD), np.nan, np.float32)
    for kvh in range(Hkv):
        for R0 in range(0, rows, BQ):
            t_lo, t_hi = min(R0 // G, T - 1), min((R0 + BQ - 1) // G, T - 1)
            last_key = start + t_hi
            tile0 = (max(0, start + t_lo - window + 1) if window > 0 else 0) // PAGE
            sQ = np.zeros(BQ * LD, np.float16)
            for r in range(min(BQ, rows - R0)):
                R = R0 + r
                h = kvh * G + R % G
                sQ[r * LD : r * LD + HD] = qkv[R // G, h * HD : (h + 1) * HD] * scale
            for warp in range(BQ // 16):
                Rw = R0 + warp * 16
                if Rw >= rows:
                    continue
                qpos = [start + np.minimum((Rw + GRP + 8 * r) // G, T - 1) for r in (0, 1)]
                warp_lo, warp_last = start + min(Rw // G, T - 1), start + min((Rw + 15) // G, T - 1)
                warp_first = warp_lo - window + 1 if window > 0 else 0
                q_lane = (warp * 16 + LANE % 16) * LD + (LANE // 16) * 8
                k_lane = ((LANE % 8) + (LANE // 16) * 8) * LD + ((LANE // 8) % 2) * 8
                v_lane = ((LANE % 8) + ((LANE // 8) % 2) * 8) * LD + (LANE // 16) * 8
                o = np.zeros((DT, 32, 4), np.float32)
                m, lsum = np.full((2, 32), -1e30, np.float32), np.zeros((2, 32), np.float32)
                for tile in range(tile0, last_key // PAGE + 1):
                    k0 = tile * PAGE
                    if not (k0 <= warp_last and k0 + PAGE - 1 >= warp_first):
                        continue
                    sK, sV = np.zeros(PAGE * LD, np.float16), np.zeros(PAGE * LD, np.float16)
                    for key in range(min(PAGE, last_key - k0 + 1)):  # the rest zero-filled
                        sK[key * LD : key * LD + HD] = kc[block_row[tile], kvh, key]
                        sV[key * LD : key * LD + HD] = vc[block_row[tile], kvh, key]
                    s = np.zeros((NT, 32, 4), np.float32)
                    for ks in range(KS):
                        a = _ldmatrix_x4(sQ, q_lane + ks * 16)
                        for p in range(NT // 2):
                            b = _ldmatrix_x4(sK, k_lane + p * 16 * LD + ks * 16)
                            _mma(s[2 * p], a, b[0], b[1])
                            _mma(s[2 * p + 1], a, b[2], b[3])
                    whole = k0 + PAGE - 1 <= warp_lo and (window <= 0 or k0 > warp_last - window)
                    mx = m.copy()
                    for j in range(NT):
                        for e in range(4):
                            kp, qp = k0 + j * 8 + 2 * QUAD + (e & 1), qpos[e // 2]
                            v = (softcap * np.tanh(s[j, :, e] / softcap) if softcap > 0 else s[j, :, e]) * np.log2(np.e)
                            seen = whole | ((kp <= qp) & ((window <= 0) | (kp > qp - window)))
                            s[j, :, e] = np.where(seen, v, -np.inf)
                            mx[e // 2] = np.maximum(mx[e // 2], s[j, :, e])
                    mx = np.repeat(mx.reshape(2, 8, 4).max(2), 4, axis=1)  # the quad's shuffles
                    corr, m = np.exp2(m - mx), mx
                    s = np.exp2(s - np.stack([m[0], m[0], m[1], m[1]], 1)[None])
                    lsum = lsum * corr + np.stack([s[:, :, :2].sum((0, 2)), s[:, :, 2:].sum((0, 2))])
                    o *= np.stack([corr[0], corr[0], corr[1], corr[1]], 1)[None]
                    for kk in range(PAGE // 16):
                        pa = [s[2 * kk + i // 2][:, 2 * (i % 2) : 2 * (i % 2) + 2].astype(np.float16) for i in range(4)]
                        for dp in range(DT // 2):
                            b = _ldmatrix_x4(sV, v_lane + kk * 16 * LD + dp * 16, trans=True)
                            _mma(o[2 * dp], pa, b[0], b[1])
                            _mma(o[2 * dp + 1], pa, b[2], b[3])
                L = np.repeat(lsum.reshape(2, 8, 4).sum(2), 4, axis=1)
                for r in (0, 1):
                    for ln in range(32):
                        R = Rw + GRP[ln] + 8 * r
                        if R < rows:
                            col = (kvh * G + R % G) * HD + 2 * QUAD[ln] + 8 * np.arange(DT)
                            out[R // G, col] = o[:, ln, 2 * r] / L[r, ln]
                            out[R // G, col + 1] = o[:, ln, 2 * r + 1] / L[r, ln]
    return out


@pytest.mark.parametrize(
    "hd,H,Hkv,start,T,window,softcap",
    [
        (64, 9, 3, 37, 23, 0, 0.0),
        (64, 4, 1, 700, 9, 512, 20.0),
        (128, 2, 2, 0, 1, 0, 0.0),
        (64, 1, 1, 64, 70, 40, 0.0),
        (256, 4, 1, 30, 5, 0, 0.0),
    ],
)
def test_emulated_fragment_math_matches_the_reference(hd, H, Hkv, start, T, window, softcap):
    rng = np.random.default_rng(hd + T)
    total = start + T
    n_pages = (total + PAGE - 1) // PAGE
    kc = rng.standard_normal((n_pages + 2, Hkv, PAGE, hd)).astype(np.float16)
    vc = rng.standard_normal((n_pages + 2, Hkv, PAGE, hd)).astype(np.float16)
    row = rng.permutation(n_pages + 2)[:n_pages]
    kc[row[-1], :, (total - 1) % PAGE + 1 :] = np.nan  # past the chunk: must be zero-filled, never read
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32)
    scale = hd**-0.5
    got = _emulate(qkv, kc, vc, row, start, T, H, Hkv, hd, scale, window, softcap)
    k = kc[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)
    v = vc[row].transpose(0, 2, 1, 3).reshape(-1, Hkv, hd)[:total].astype(np.float32)
    ref = attention(qkv[:, : H * hd].reshape(T, H, hd), k, v, start, scale=scale, window=window, softcap=softcap)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 2e-3
