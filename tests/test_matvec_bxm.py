"""cuda/matvec.cu's matvec_<type>_bxm (matvec_cols_mma: bxs's 2..4 columns with the integer products on
mma.m16n8k32) emulated in numpy, without a GPU, against an emulation of the order in which bxs and the any-column
kernel sum a row (lane kb % 32 takes block kb, in the order of kb; then warp_sum).

The kernel's own index expressions drive a lane-level model: stage_x_frag's fragment-order copy of the columns,
each block's tiles (tiles blockIdx.x, + gridDim.x, ...), each warp's ring of MVB_AHEAD loaded steps against the
steps it computes (the load side and the compute side keep separate counters: a drift between them reads one
step's words for another), the A / B / C fragments of mma.m16n8k32 (mma.cuh's layout), the tile's 32 sums an
output in the padded shared array and their warp_sum. fp32 operations are the kernel's (FMUL, FFMA with one
rounding, emulated in float64 then rounded: exact for these operands' products) and the same function serves
both orders, so the comparison is of the orders and the mappings, bit for bit. What stays for the GPU test
(tests/gpu/test_gpu_kernels.py, the staged-columns bits test): the real instructions and their rounding, the
barriers, the Q4_1 / Q4_K scale loads.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

LANE = np.arange(32)
GRP, QUAD = LANE // 4, LANE % 4  # lane (g, t)
WARPS = 16  # MVS_WARPS: warp w keeps bxs's lanes 2w, 2w + 1
BIAS = 0x4B400000  # I2F_BIAS: i2f_exact's, the mma's accumulator input
AHEAD = int(re.search(r"#define MVB_AHEAD (\d+)", (Path(__file__).parents[1] / "cuda" / "matvec.cu").read_text())[1])
f32 = np.float32


def fmul(a, b):
    return (np.asarray(a, f32) * np.asarray(b, f32)).astype(f32)


def ffma(a, b, c):
    """a * b + c rounded once (float32 products are exact in float64; the sum rounds twice only where float64's
    53 bits do not hold it, and both orders below go through this one function)."""
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(f32)


def block_term(x, c1, c2):
    """Q4_0W::scaled's d1 c1 + d2 c2 - 8 s (levels(), then the sum term), as the SASS orders it: FMUL d2 c2, FFMA
    d1 c1 + that, FFMA -8 s + that. The caller's FFMA d x term + the sum completes the block."""
    fd = ffma(x[..., 0], f32(c1), fmul(x[..., 1], f32(c2)))
    return ffma(-8, x[..., 2], fd)


def warp_sum(v):
    """common.cuh's butterfly over 32 lanes (v[..., lane]); every lane ends with the same sum."""
    v = np.asarray(v, f32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., LANE ^ o]).astype(f32)
    return v[..., 0]


def q4_0(rng, rows, nb):
    """Random Q4_0 rows: quants [rows, nb, 16] (byte j = w[j] | w[j + 16] << 4), fp16 scales, the codes."""
    codes = rng.integers(0, 16, (rows, nb, 32), dtype=np.uint8)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    d = (rng.standard_normal((rows, nb)) * 0.02).astype(np.float16)
    return qs, d, codes


def columns(rng, ncols, nb):
    """ncols columns' q8x2 as the kernels get them: xq int8 [ncols, nb, 64] (coarse, fine), xd [ncols, nb, 4]."""
    xq = rng.integers(-127, 128, (ncols, nb, 64), dtype=np.int8)
    d1 = rng.uniform(0.01, 0.1, (ncols, nb)).astype(f32)
    xd = np.stack([d1, d1 / f32(254), rng.standard_normal((ncols, nb)).astype(f32), np.zeros_like(d1)], -1)
    return xq, xd.astype(f32)


def reference(qs_codes, d, xq, xd, row, seq):
    """bxs's sum of one row and column: lane l adds blocks l, l + 32, ... in order; then warp_sum."""
    nb = d.shape[1]
    acc = np.zeros(32, f32)
    for kb in range(nb):
        w = qs_codes[row, kb].astype(np.int64)
        c1, c2 = int(w @ xq[seq, kb, :32].astype(np.int64)), int(w @ xq[seq, kb, 32:].astype(np.int64))
        acc[kb % 32] = ffma(f32(d[row, kb]), block_term(xd[seq, kb], c1, c2), acc[kb % 32])
    return warp_sum(acc)


def stage_x_frag(xq, xd, nb, ncols):
    """The kernel's copy: X[e] (e = kb * 32 + g * 4 + t) = words (g % 2) * 8 + t and + 4 of sequence g / 2's block
    kb; XD[e] (e = kb * 4 + seq) = its scales; sequences from ncols on zeros."""
    words = xq.view(np.uint32).reshape(xq.shape[0], nb, 16)
    X = np.zeros((32 * nb, 2), np.uint32)
    for e in range(32 * nb):
        kb, g, t = e // 32, (e % 32) // 4, e % 4
        if g // 2 < ncols:
            word = (g % 2) * 8 + t
            X[e] = words[g // 2, kb, word], words[g // 2, kb, word + 4]
    XD = np.zeros((4 * nb, 4), f32)
    for e in range(4 * nb):
        if e % 4 < ncols:
            XD[e] = xd[e % 4, e // 4]
    return X, XD


def mma_u8s8(a, b0, b1):
    """mma.m16n8k32.row.col.s32.u8.s8 with the accumulator BIAS, on per-lane registers (mma.cuh's layout): a
    [4, 32] u32 (a0 row g k 4t.., a1 row g+8, a2 row g k 16+4t.., a3 row g+8), b0, b1 [32] (k 4t.., 16+4t.. of
    column g). Returns [4, 32]: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)."""
    A, B = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64)
    for i in range(4):
        for r0, k0, reg in ((0, 0, a[0]), (8, 0, a[1]), (0, 16, a[2]), (8, 16, a[3])):
            A[GRP + r0, k0 + 4 * QUAD + i] = (reg >> (8 * i)) & 0xFF
        for k0, reg in ((0, b0), (16, b1)):
            B[k0 + 4 * QUAD + i, GRP] = ((reg >> (8 * i)) & 0xFF).astype(np.uint8).view(np.int8)
    C = A @ B + BIAS
    return np.stack([C[GRP, 2 * QUAD], C[GRP, 2 * QUAD + 1], C[GRP + 8, 2 * QUAD], C[GRP + 8, 2 * QUAD + 1]])


def emulate(qs, d, xq, xd, rows, ncols, gate, grid):
    """matvec_cols_mma on every block of a grid of `grid` blocks: the sums it hands to write_out's operations,
    {(seq, row): sum} (gated: row = the output's gate row o, its up row o + rows)."""
    nb = d.shape[1]
    X, XD = stage_x_frag(xq, xd, nb, ncols)
    words = qs.view(np.uint32).reshape(qs.shape[0], nb, 4)  # word t of block kb
    d16 = d.view(np.uint16)
    tiles = (rows + 7) // 8 if gate else (rows + 15) // 16
    J = (nb + 31) // 32
    out = {}
    for bid in range(grid):
        mine = (tiles - bid + grid - 1) // grid if bid < tiles else 0
        total = mine * J
        for w in range(WARPS):
            lk = lj = 0
            ring = {}

            def load(lk, lj, w=w, bid=bid):
                T = bid + lk * grid
                if gate:
                    r0 = np.minimum(8 * T + GRP, rows - 1)
                    r = (r0, r0 + rows)
                else:
                    r = (np.minimum(16 * T + GRP, rows - 1), np.minimum(16 * T + GRP + 8, rows - 1))
                kb = min(32 * lj + 2 * w, nb - 2)
                q = [[words[r[h], kb + b, QUAD] for b in range(2)] for h in range(2)]
                sc = [d16[r[h], kb].astype(np.uint32) | (d16[r[h], kb + 1].astype(np.uint32) << 16) for h in range(2)]
                return {"q": q, "d": sc, "T": T, "kb": kb, "rows": r}

            for p in range(min(AHEAD, total)):
                ring[p] = load(lk, lj)
                lj += 1
                if lj == J:
                    lj, lk = 0, lk + 1
            acc = np.zeros((2, 2, 32), f32)  # [row h][bxs lane 2w + b][lane]
            k = j = 0
            for n in range(total):
                s = ring[n % AHEAD]
                kb = 32 * j + 2 * w
                if kb < nb:
                    assert s["kb"] == kb and s["T"] == bid + k * grid, "a ring slot holds another step"
                    for b in range(2):
                        a = [s["q"][0][b] & 0x0F0F0F0F, s["q"][1][b] & 0x0F0F0F0F]
                        a += [(s["q"][0][b] >> 4) & 0x0F0F0F0F, (s["q"][1][b] >> 4) & 0x0F0F0F0F]
                        xb = X[(kb + b) * 32 + LANE]
                        c = mma_u8s8(a, xb[:, 0], xb[:, 1])
                        xs = XD[(kb + b) * 4 + QUAD]
                        for h in range(2):
                            half = (s["d"][h] >> (16 * b)) & 0xFFFF
                            dw = half.astype(np.uint16).view(np.float16).astype(f32)
                            v = block_term(xs, c[2 * h] - BIAS, c[2 * h + 1] - BIAS)
                            acc[h, b] = ffma(dw, v, acc[h, b])
                if n + AHEAD < total:
                    ring[n % AHEAD] = load(lk, lj)
                    lj += 1
                    if lj == J:
                        lj, lk = 0, lk + 1
                j += 1
                if j == J:  # this warp's sums of tile k: R[(g + 8h) * 4 + t][2w + b]
                    T = bid + k * grid
                    for h in range(2):
                        for b in range(2):
                            for lane in range(32):
                                key = (T, (GRP[lane] + 8 * h) * 4 + QUAD[lane], 2 * w + b)
                                assert key not in out, f"{key} written twice"
                                out[key] = acc[h, b, lane]
                    acc[:] = 0
                    j, k = 0, k + 1
    sums = {}
    for T in range(tiles):  # mvb_write: warp_sum over the 32 lanes' sums of each output
        for o in range(64):
            i, seq = o // 4, o % 4
            row = (8 * T + i % 8 + (rows if i >= 8 else 0)) if gate else 16 * T + i
            if seq < ncols and (8 * T + i % 8 if gate else row) < rows:
                sums[seq, row] = warp_sum(np.array([out[T, o, lane] for lane in range(32)], f32))
    return sums


@pytest.mark.parametrize(
    "rows,nb,ncols,gate,grid",
    [
        (37, 8, 4, False, 2),  # 3 tiles (the last part-filled), warps 4-15 with nothing in their only step
        (21, 40, 3, True, 2),  # gated: 3 tiles of 8 outputs; 40 blocks: a last step past the row's end
        (16, 72, 2, False, 3),  # one tile; blocks 1, 2 with none; 3 steps a tile
        (50, 34, 4, True, 3),  # several tiles a block, steps across a tile boundary in the ring
    ],
)
def test_bxm_sums_what_bxs_sums_in_its_order(rows, nb, ncols, gate, grid):
    rng = np.random.default_rng(rows * 1000 + nb)
    nrows = 2 * rows if gate else rows
    qs, d, codes = q4_0(rng, nrows, nb)
    xq, xd = columns(rng, ncols, nb)
    got = emulate(qs, d, xq, xd, rows, ncols, gate, grid)
    expected_rows = range(nrows)
    assert set(got) == {(seq, r) for seq in range(ncols) for r in expected_rows}
    for (seq, row), v in got.items():
        want = reference(codes, d, xq, xd, row, seq)
        assert np.float32(v).view(np.uint32) == np.float32(want).view(np.uint32), (seq, row, v, want)


def test_the_scale_shuffle_gives_each_lane_its_rows_blocks():
    """MvbScales<Q4_KW>: lane t of each group of 4 decodes (row t / 2, block t % 2); value(b, r) reads lane
    (lane & ~3) | (2r + b), which must hold row r, block b for every lane."""
    mine = np.stack([QUAD // 2, QUAD % 2], 1)  # (row, block) each lane decodes
    for r in range(2):
        for b in range(2):
            src = (LANE & ~3) | (2 * r + b)
            assert (mine[src] == (r, b)).all()
