"""cuda/matmul.cu's pipelined GEMMs (matmul2_<type>_bm<TM>, and matmul2r_<type>_bm<TM> from the raw bytes into the
fragments) emulated in numpy, without a GPU.

The kernel's own index expressions drive lane-level models of ldmatrix and mma.m16n8k16 (tests/
test_attention_prefill.py's, from the PTX ISA's fragment layouts): every block of the grid, every warp, every K
step, through the same prologue, loop and epilogue, with the split-K slices finishing in random orders. Shared
memory is modelled buffer by buffer with the step whose data each holds, so the pipeline schedule is checked too:
a buffer read before its copy has landed (cp.async.wait_group counts), a read of the wrong step's data, a copy or
store into a buffer another warp may still read in the same phase (between two __syncthreads), or a copy still in
flight at exit fails. What stays for the GPU tests (tests/gpu/test_gpu_kernels.py): the real instructions, the
raw-byte copies and dequantization (tests/test_kernel_host.py runs the latter on the CPU), timing-dependent races
this model cannot see, and the memory fences.
"""

from __future__ import annotations

import numpy as np
import pytest
import soa_reference as soa
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from test_attention_prefill import LANE, _ldmatrix_x4, _mma

from ingot.runtime.gpu.constants import MATMUL2_BN as BN
from ingot.runtime.gpu.constants import MATMUL2_STAGES as STAGES
from ingot.runtime.gpu.constants import MATMUL2_THREADS as THREADS
from ingot.runtime.gpu.constants import MATMUL2R_STAGES, MODE_ADD, MODE_STORE, QK
from ingot.runtime.gpu.kernels import MATMUL2_LDS as LDS
from ingot.runtime.gpu.kernels import MATMUL2_TILE_ROWS, matmul2r_blocks, matmul2r_smem, matmul_geometry


class Smem:
    """One block's shared buffers (name, index) -> the K step whose data each holds, and the phase's accesses."""

    def __init__(self):
        self.step: dict[tuple, int] = {}
        self.inflight: dict[tuple, tuple[int, int]] = {}  # buffer -> (step, commit group) of a copy not yet waited for
        self.read_now: set[tuple] = set()
        self.written_now: set[tuple] = set()
        self.groups = 0  # commit groups so far

    def barrier(self) -> None:
        self.read_now, self.written_now = set(), set()

    def copy(self, buf: tuple, step: int) -> None:  # cp.async issued (lands any time until a wait covers it)
        assert buf not in self.read_now, f"copy into {buf} while another warp may still read it (same phase)"
        assert buf not in self.inflight, f"two copies in flight into {buf}"
        self.inflight[buf] = (step, self.groups)
        self.written_now.add(buf)

    def commit(self) -> None:
        self.groups += 1

    def wait(self, n: int) -> None:  # cp.async.wait_group n: all but the newest n groups have landed
        for buf, (step, group) in list(self.inflight.items()):
            if group < self.groups - n:
                self.step[buf] = step
                del self.inflight[buf]

    def store(self, buf: tuple, step: int) -> None:  # st.shared by the block's threads (the dequantized tile)
        assert buf not in self.read_now and buf not in self.inflight, f"store into {buf} while it is read/copied"
        self.step[buf] = step
        self.written_now.add(buf)

    def read(self, buf: tuple, step: int) -> None:
        assert buf not in self.inflight, f"{buf} read before its copy landed"
        assert buf not in self.written_now, f"{buf} read in the phase that writes it (no barrier between)"
        assert self.step.get(buf) == step, f"{buf} holds step {self.step.get(buf)}, read as step {step}"
        self.read_now.add(buf)


def emulate(A, Wh, bias, C, M, N, K, ldc, mode, tm, slices, direct, q4, rng):
    """matmul2<TM> on A [M, K] fp16 and the dequantized weights Wh [N, K] fp16 (what the raw stage becomes), into the
    flat fp32 C (row stride ldc). direct: F16 (the raw stage is the tile); q4: the Q4 thread mapping of dequant."""
    WM = 4 if tm == 128 else 1 if tm == 16 else 2
    WN = 8 // WM
    MT, NT = tm // WM // 16, BN // WN // 8
    nb = K // QK
    per = -(-nb // slices)
    grid = (-(-M // tm), -(-N // BN), slices)
    ws: dict[tuple[int, int], np.ndarray] = {}
    counters: dict[int, int] = {}
    order = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    rng.shuffle(order)  # blocks finish in any order: the last slice of a tile is any of them
    writes = np.zeros(C.shape, np.int32)
    for bx, by, bz in order:
        m0, n0 = bx * tm, by * BN
        kb0 = bz * per
        steps = max(0, min(nb, kb0 + per) - kb0)
        sm = Smem()
        sA = np.zeros((STAGES, tm * LDS), np.float16)
        sB = np.zeros((2, BN * LDS), np.float16)
        raw = np.zeros((STAGES, BN, QK), np.float16)  # the raw stage's weights (non-direct kinds), per row
        rawd = np.zeros((STAGES, BN * LDS), np.float16)  # F16's raw stage: the tile itself

        def load_stage(s, m0=m0, n0=n0, kb0=kb0, sA=sA, raw=raw, rawd=rawd, sm=sm):  # bound: this block's
            kb = kb0 + s
            for tid in range(THREADS):
                for j in range(-(-tm * 4 // THREADS)):
                    e = tid + j * THREADS
                    if e >= tm * 4:
                        continue
                    row, c = e // 4, (e % 4) * 8
                    mrow = m0 + row
                    v = A[mrow, kb * QK + c : kb * QK + c + 8] if mrow < M else 0
                    sA[s % STAGES, row * LDS + c : row * LDS + c + 8] = v
            sm.copy(("A", s % STAGES), s)
            if direct:
                for tid in range(THREADS):
                    row, c = tid // 2, (tid % 2) * 16
                    n = n0 + row
                    for cc in (c, c + 8):
                        v = Wh[n, kb * QK + cc : kb * QK + cc + 8] if n < N else 0
                        rawd[s % STAGES, row * LDS + cc : row * LDS + cc + 8] = v
            else:
                for row in range(BN):
                    n = n0 + row
                    raw[s % STAGES, row] = Wh[n, kb * QK : kb * QK + QK] if n < N else 0
            sm.copy(("raw", s % STAGES), s)

        def dequant(s, raw=raw, sB=sB, sm=sm):  # stage s (raw) -> sB[s % 2], the kernel's thread mapping
            sm.read(("raw", s % STAGES), s)
            for tid in range(THREADS):
                row, h = tid // 2, tid % 2
                w = raw[s % STAGES, row]
                base = row * LDS
                if q4:  # weights 8h.. and 16+8h.. (the two nibbles of bytes 8h..8h+7)
                    sB[s % 2, base + 8 * h : base + 8 * h + 8] = w[8 * h : 8 * h + 8]
                    sB[s % 2, base + 16 + 8 * h : base + 24 + 8 * h] = w[16 + 8 * h : 24 + 8 * h]
                else:
                    sB[s % 2, base + 16 * h : base + 16 * h + 16] = w[16 * h : 16 * h + 16]
            sm.store(("B", s % 2), s)

        acc = np.zeros((8, MT, NT, 32, 4), np.float32)
        for s in range(STAGES - 1):
            if s < steps:
                load_stage(s)
            sm.commit()
        sm.wait(STAGES - 2)
        sm.barrier()
        if steps > 0 and not direct:
            dequant(0)
        for i in range(steps):
            sm.wait(STAGES - 3)
            sm.barrier()
            if i + STAGES - 1 < steps:
                load_stage(i + STAGES - 1)
            sm.commit()
            if i + 1 < steps and not direct:
                dequant(i + 1)
            sm.read(("A", i % STAGES), i)
            if direct:
                sm.read(("raw", i % STAGES), i)
                bsrc = rawd[i % STAGES]
            else:
                sm.read(("B", i % 2), i)
                bsrc = sB[i % 2]
            for warp in range(8):
                wm, wn = warp // WN, warp % WN
                a_lane = (wm * (tm // WM) + LANE % 16) * LDS + (LANE // 16) * 8
                b_lane = (wn * (NT * 8) + LANE % 8 + (LANE // 16) * 8) * LDS + ((LANE // 8) % 2) * 8
                for ks in range(QK // 16):
                    a = [_ldmatrix_x4(sA[i % STAGES], a_lane + mt * 16 * LDS + ks * 16) for mt in range(MT)]
                    for p in range(NT // 2):
                        b = _ldmatrix_x4(bsrc, b_lane + p * 16 * LDS + ks * 16)
                        for mt in range(MT):
                            _mma(acc[warp, mt, 2 * p], a[mt], b[0], b[1])
                            _mma(acc[warp, mt, 2 * p + 1], a[mt], b[2], b[3])
        sm.wait(0)
        assert not sm.inflight

        _finish(acc, WM, WN, MT, NT, tm, bx, by, bz, grid, slices, ws, counters, bias, C, M, N, ldc, mode, writes)
    assert not any(counters.values()), "a tile counter left non-zero"
    return writes


def _finish(acc, WM, WN, MT, NT, tm, bx, by, bz, grid, slices, ws, counters, bias, C, M, N, ldc, mode, writes):
    """mm2_store on one block's accumulators: split-K partials through ws (the tile's last slice sums them in slice
    order), then the epilogue into C, counting the writes per element."""
    m0, n0 = bx * tm, by * BN
    # acc[warp, mt, nt, lane, e] = element e of thread warp*32 + lane
    if slices > 1:
        tile = by * grid[0] + bx
        mine = np.zeros(tm * BN, np.float32)
        for warp in range(8):
            tid = warp * 32 + LANE
            for mt in range(MT):
                for nt in range(NT):
                    for e in range(4):
                        mine[((mt * NT + nt) * 4 + e) * THREADS + tid] = acc[warp, mt, nt, :, e]
        ws[tile, bz] = mine
        counters[tile] = counters.get(tile, 0) + 1
        if counters[tile] != slices:
            return
        counters[tile] = 0
        acc[:] = 0
        for z in range(slices):
            for warp in range(8):
                tid = warp * 32 + LANE
                for mt in range(MT):
                    for nt in range(NT):
                        for e in range(4):
                            acc[warp, mt, nt, :, e] += ws[tile, z][((mt * NT + nt) * 4 + e) * THREADS + tid]
    for warp in range(8):
        wm, wn = warp // WN, warp % WN
        r0 = m0 + wm * (tm // WM) + LANE // 4
        c0 = n0 + wn * (NT * 8) + 2 * (LANE % 4)
        for nt in range(NT):
            for e2 in range(2):
                for mt in range(MT):
                    for h in range(2):
                        for lane in range(32):
                            gr, gc = r0[lane] + mt * 16 + 8 * h, c0[lane] + nt * 8 + e2
                            if gr >= M or gc >= N:
                                continue
                            v = acc[warp, mt, nt, lane, 2 * h + e2] + (bias[gc] if bias is not None else 0)
                            C[gr * ldc + gc] = C[gr * ldc + gc] + v if mode == MODE_ADD else v
                            writes[gr * ldc + gc] += 1


@pytest.mark.parametrize(
    "M,N,K,split,kind",
    [
        (1, 70, 64, True, "q4"),  # one token, height 16 (1 x 8 warps); 2 K steps in 2 slices (one step each)
        (16, 200, 288, True, "q8"),  # height 16, 9 steps in slices
        (37, 130, 576, True, "q8"),  # tile height 64, 2 feature tiles, 18 steps in slices
        (37, 130, 576, False, "direct"),  # F16: the raw stage multiplied in place
        (200, 150, 96, False, "q4"),  # height 32 (prefill on few tiles): 7 row tiles, 3 steps
        (130, 64, 160, True, "q8"),  # height 128 (4 x 2 warps), 2 row tiles, 5 steps in slices
        (129, 129, 256, True, "direct"),  # height 128 for F16, 2 slices
    ],
)
def test_matmul2_emulation_matches_numpy(M, N, K, split, kind):
    rng = np.random.default_rng(M * 1000 + N + K)
    t = matmul_geometry(M, N, K, 132 if not split else 4, mma=True, split=split)
    A = rng.standard_normal((M, K)).astype(np.float16)
    Wh = (rng.standard_normal((N, K)) * 0.1).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float32)
    ldc = N + 3
    ref = A.astype(np.float64) @ Wh.astype(np.float64).T + bias
    runs = []
    for _ in range(2 if t.slices > 1 else 1):  # two completion orders of the slices: the same bits
        C = np.full(M * ldc, np.nan, np.float32)
        writes = emulate(A, Wh, bias, C, M, N, K, ldc, MODE_STORE, t.tm, t.slices, kind == "direct", kind == "q4", rng)
        got = C.reshape(M, ldc)
        assert (writes.reshape(M, ldc)[:, :N] == 1).all() and not writes.reshape(M, ldc)[:, N:].any()
        assert np.isnan(got[:, N:]).all()
        assert np.abs(got[:, :N] - ref).max() <= 1e-4 * np.abs(ref).max()
        runs.append(got.copy())
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    # MODE_ADD: C += A W^T + bias
    resid = rng.standard_normal(M * ldc).astype(np.float32)
    C = resid.copy()
    emulate(A, Wh, bias, C, M, N, K, ldc, MODE_ADD, t.tm, t.slices, kind == "direct", kind == "q4", rng)
    want = resid.reshape(M, ldc).astype(np.float64)
    want[:, :N] += ref
    assert np.abs(C.reshape(M, ldc) - want).max() <= 1e-4 * np.abs(want).max()


def test_the_emulation_covers_every_tile_height_and_split_k():
    """The cases above reach every kernel's height, with and without slices (small SM counts force them)."""
    cases = test_matmul2_emulation_matches_numpy.pytestmark[0].args[1]
    seen = {(matmul_geometry(M, N, K, 4 if s else 132, mma=True, split=s).tm, s) for M, N, K, s, _ in cases}
    assert set(MATMUL2_TILE_ROWS) <= {tm for tm, _ in seen}
    slices = [matmul_geometry(M, N, K, 4, mma=True, split=True).slices for M, N, K, s, _ in cases if s]
    assert all(s > 1 for s in slices)


# --- matmul2r_<type>_bm<TM>: the weights' raw bytes into the mma fragments -------------------------------------------


def q4_weights(qs: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """The fp16 weights [N, K] of Q4_0 / Q4_1 blocks (qs [N, nb, 16] bytes: w[j] low nibble of byte j, w[j + 16] its
    high nibble; d, m [N, nb] fp16), each the exact d*(q - 8) or d*q + m rounded to fp16 once (matmul_tiles.cuh)."""
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).astype(np.float64)  # [N, nb, 32]
    dd = d.astype(np.float64)[..., None]
    w = dd * q + m.astype(np.float64)[..., None] if m is not None else dd * (q - 8)
    return w.reshape(qs.shape[0], -1).astype(np.float16)


def q4_k_scales(header: np.ndarray, sub: int) -> tuple[np.float32, np.float32]:
    """(dl, ml) of sub-block `sub` from a Q4_K super-block header (16 bytes: f16 d, f16 dmin, 12 bytes of 6-bit
    scales and mins, gguf's get_scale_min_k4), each the fp32 product weights.cuh k_header makes."""
    d, dmin = header[0:4].view(np.float16).astype(np.float32)
    k = header[4:16].astype(np.int64)
    if sub < 4:
        sc, mn = k[sub] & 63, k[sub + 4] & 63
    else:
        sc = (k[sub + 4] & 15) | ((k[sub - 4] >> 6) << 4)
        mn = (k[sub + 4] >> 4) | ((k[sub] >> 6) << 4)
    return d * np.float32(sc), dmin * np.float32(mn)


def _deq_frag(w0: np.ndarray, w1: np.ndarray, c: np.ndarray, d: np.ndarray, m, k=None) -> list[np.ndarray]:
    """deq_q4_frag per lane: words w0, w1 (uint32 [32]) -> b0, b1 of chunk 0, then of chunk 1 ([32, 2] fp16 each).
    k: Q4_K's (dl, ml) per lane (deq_q4k_frag: fma(dl, q, -ml) in fp32, dl*q exact, then fp16)."""
    out = []
    for shift in (0, 4):
        for w in (w0, w1):
            lo = (w >> (16 * (c & 1))) & 0xFF  # byte 2c of the block (the half c%2 of its word)
            hi = (w >> (16 * (c & 1) + 8)) & 0xFF  # byte 2c + 1
            q = np.stack([(lo >> shift) & 0xF, (hi >> shift) & 0xF], 1).astype(np.float64)
            if k is not None:
                dl, ml = (x.astype(np.float64)[:, None] for x in k)
                out.append((dl * q - ml).astype(np.float32).astype(np.float16))  # the exact value, rounded once
                continue
            dd = d.astype(np.float64)[:, None]
            v = dd * q + m.astype(np.float64)[:, None] if m is not None else dd * (q - 8)
            out.append(v.astype(np.float16))
    return out


def _deq_q6k_frag(w0, w1, hx, hy, c, dl0, dl1) -> list[np.ndarray]:
    """deq_q6k_frag per lane: the quant words w0, w1 and high-bit words hx, hy (uint32 [32]) -> b0, b1 of chunk 0,
    then of chunk 1 ([32, 2] fp16 each), each fp32 dl * (q - 32) (exact) rounded to fp16 once."""
    out = []
    for chunk, (h, dl) in enumerate(((hx, dl0), (hy, dl1))):
        for w, up in ((w0, 0), (w1, 4)):  # weights 2c, 2c+1 (word w0) and 2c+8, 2c+9 (word w1)
            codes = []
            for j in (0, 1):  # byte 2(c%2) + j of the words
                byte = 2 * (c & 1) + j
                lo = ((w >> (8 * byte)) >> (4 * chunk)) & 0xF
                hi = ((h >> (8 * byte)) >> (2 * (c >> 1) + up)) & 3
                codes.append(lo | hi << 4)
            q = np.stack(codes, 1).astype(np.float64) - 32
            out.append((dl.astype(np.float64)[:, None] * q).astype(np.float16))
    return out


def emulate_frag(A, qs, d, m, dbase, bias, C, M, N, K, ldc, mode, tm, slices, rng, headers=None, q6=None):
    """matmul2r<TM> byte for byte: each stage a flat shared-memory image in the kernel's layout (quant bytes
    [128][QROW], scale chunks [128][32 bytes] of d (and m), the A tile [tm][LDA] fp16), filled by the kernel's
    copies and read at its lane addresses; d and m start dbase elements past a 16-byte boundary (the scale windows'
    offsets). headers (Q4_K, [N, nb/8, 16] bytes; d and m None, dbase 0): the super-block headers passed as d, one
    16-byte chunk per 8 blocks. q6 (Q6_K: qh [N, nb, 8] bytes, sc [N, nb, 2] int8, its super-blocks' d [N, nb/8] fp16,
    and that array's element offset past a 4-byte boundary; d, m None): sc in d's windows (at dbase), d's two 4-byte
    words a row, the high bits' region. Returns the writes per C element; the pipeline's waits and barriers are
    checked as emulate()'s."""
    WM = 1  # Mm2Warps<TM, 1>: a warp owns all tm rows x 16 columns at every height
    WN = 8 // WM
    MT, NT = tm // WM // 16, BN // WN // 8
    KB, S = matmul2r_blocks(tm), MATMUL2R_STAGES
    QROW, SROW, LDA = 16 * KB + (16 if KB % 2 == 0 else 0), 32, QK * KB + 8
    HROW, DROW = 8 * KB + 8, 8
    S_OFF = BN * QROW
    M_OFF = S_OFF + BN * SROW
    H_OFF = M_OFF + (BN * SROW if m is not None else BN * DROW if q6 is not None else 0)
    A_OFF = H_OFF + (BN * HROW if q6 is not None else 0)
    STAGE = A_OFF + tm * LDA * 2
    qtype = "Q4_1" if m is not None else "Q4_K" if headers is not None else "Q6_K" if q6 is not None else "Q4_0"
    assert S * STAGE == matmul2r_smem(qtype, tm)
    nb = K // QK
    if headers is not None:  # the header array read as fp16: element b (the block index) is byte 2b of it
        assert dbase == 0 and nb % 8 == 0
        d = headers.reshape(N, nb, 2).view(np.float16).reshape(N, nb)
    if q6 is not None:  # the sub-block scales (a char2 a block) in d's place, read as fp16 elements
        qh6, sc6, dsb, ddbase = q6
        assert nb % 8 == 0
        d = np.ascontiguousarray(sc6).view(np.float16).reshape(N, nb)
        gdd = np.zeros(ddbase + N * nb // 8 + 4, np.float16)  # d's elements at ddbase, padded to whole words
        gdd[ddbase : ddbase + N * nb // 8] = dsb.ravel()
    per = -(-nb // slices)
    grid = (-(-M // tm), -(-N // BN), slices)
    # the scales as the kernel's global memory: element dbase of a 16-byte aligned buffer, padded to whole chunks
    pad = -(-(dbase + N * nb) // 8) * 8 + 8
    gd = np.zeros(pad, np.float16)
    gd[dbase : dbase + N * nb] = d.ravel()
    gm = np.zeros(pad, np.float16)
    if m is not None:
        gm[dbase : dbase + N * nb] = m.ravel()
    ws: dict[tuple[int, int], np.ndarray] = {}
    counters: dict[int, int] = {}
    order = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    rng.shuffle(order)
    writes = np.zeros(C.shape, np.int32)
    for bx, by, bz in order:
        m0, n0 = bx * tm, by * BN
        kb0 = bz * per
        steps = max(0, min(nb, kb0 + per) - kb0)
        stages = -(-steps // KB)
        sm = Smem()
        smem = np.full((S, STAGE), 0xCD, np.uint8)  # stale bytes: a read of an uncopied byte shows

        def load_stage(s, m0=m0, n0=n0, kb0=kb0, smem=smem, sm=sm, steps=steps):
            st = smem[s % S]
            valid = min(KB, steps - s * KB)
            for row in range(BN):
                n = n0 + row
                nc = min(n, N - 1)
                for blk in range(valid):
                    st[row * QROW + blk * 16 : row * QROW + blk * 16 + 16] = qs[nc, kb0 + s * KB + blk] if n < N else 0
                for region, g in ((S_OFF, gd), (M_OFF, gm)) if m is not None else ((S_OFF, gd),):
                    p = dbase + nc * nb + kb0 + s * KB  # the element of block kb0 + s*KB of the row
                    for chunk in range(2):
                        if chunk == 0 or p % 8 + valid > 8:
                            src = (
                                g[(p // 8 + chunk) * 8 : (p // 8 + chunk) * 8 + 8] if n < N else np.zeros(8, np.float16)
                            )
                            st[region + row * SROW + 16 * chunk : region + row * SROW + 16 * chunk + 16] = src.view(
                                np.uint8
                            )
                if q6 is not None:
                    e0 = (nc * nb + kb0 + s * KB) >> 3
                    e1 = (nc * nb + kb0 + s * KB + valid - 1) >> 3
                    p = ddbase + e0  # the element's index in the 4-byte aligned array
                    for word in range(2):
                        if word == 0 or p % 2 + (e1 - e0) > 1:
                            at = (p // 2 + word) * 2
                            src = gdd[at : at + 2] if n < N else np.zeros(2, np.float16)
                            st[M_OFF + row * DROW + 4 * word : M_OFF + row * DROW + 4 * word + 4] = src.view(np.uint8)
                    for blk in range(valid):
                        at = H_OFF + row * HROW + blk * 8
                        st[at : at + 8] = qh6[nc, kb0 + s * KB + blk] if n < N else 0
            a = st[A_OFF:].view(np.float16)
            for row in range(tm):
                mrow = m0 + row
                for blk in range(valid):
                    k = (kb0 + s * KB + blk) * QK
                    a[row * LDA + blk * QK : row * LDA + blk * QK + QK] = A[mrow, k : k + QK] if mrow < M else 0
            sm.copy(("stage", s % S), s)

        acc = np.zeros((8, MT, NT, 32, 4), np.float32)
        for s in range(S - 1):
            if s < stages:
                load_stage(s)
            sm.commit()
        for s in range(stages):
            sm.wait(S - 2)
            sm.barrier()
            if s + S - 1 < stages:
                load_stage(s + S - 1)
            sm.commit()
            sm.read(("stage", s % S), s)
            st = smem[s % S]
            sa = st[A_OFF:].view(np.float16)
            sd = st[S_OFF : S_OFF + BN * SROW].view(np.float16)
            smn = st[M_OFF : M_OFF + BN * SROW].view(np.float16) if m is not None else None
            valid = min(KB, steps - s * KB)
            for warp in range(8):
                wm, wn = warp // WN, warp % WN
                g, c = LANE // 4, LANE % 4
                o0 = (dbase + (n0 + wn * NT * 8 + g) * nb + kb0) & 7
                a_lane = (wm * (tm // WM) + LANE % 16) * LDA + (LANE // 16) * 8
                for kk in range(valid):
                    o = ((o0 + s * KB) & 7) + kk
                    a = [
                        [_ldmatrix_x4(sa, a_lane + mt * 16 * LDA + kk * QK + ks * 16) for mt in range(MT)]
                        for ks in (0, 1)
                    ]
                    for nt in range(NT):
                        r = wn * NT * 8 + nt * 8 + g
                        q = r * QROW + kk * 16 + 4 * (c >> 1)
                        w0 = np.array([int.from_bytes(st[x : x + 4].tobytes(), "little") for x in q], np.int64)
                        w1 = np.array([int.from_bytes(st[x + 8 : x + 12].tobytes(), "little") for x in q], np.int64)
                        dd = sd[r * (SROW // 2) + o]
                        mm = smn[r * (SROW // 2) + o] if smn is not None else None
                        k = None
                        if headers is not None:  # sub-block o % 8 of the window's chunk o / 8, per lane
                            hdr = st[S_OFF : S_OFF + BN * SROW].reshape(BN, SROW)
                            pairs = [
                                q4_k_scales(hdr[ri, 16 * (oi >> 3) : 16 * (oi >> 3) + 16], oi & 7)
                                for ri, oi in zip(r, o, strict=True)
                            ]
                            k = (np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs]))
                        if q6 is not None:
                            hw = [
                                np.array([int.from_bytes(st[x : x + 4].tobytes(), "little") for x in hq], np.int64)
                                for hq in (H_OFF + r * HROW + kk * 8, H_OFF + r * HROW + kk * 8 + 4)
                            ]
                            scb = st[S_OFF : S_OFF + BN * SROW].reshape(BN, SROW)
                            kbs = kb0 + s * KB
                            od0 = (ddbase + (n0 + wn * NT * 8 + g) * (nb // 8)) & 1
                            od = ((od0 + (kbs >> 3)) & 1) + (((kbs & 7) + kk) >> 3)
                            dw = st[M_OFF : M_OFF + BN * DROW].reshape(BN, DROW // 2, 2).view(np.float16)[..., 0]
                            dlane = dw[r, od].astype(np.float32)
                            s0 = scb[r, 2 * o].view(np.int8).astype(np.float32)
                            s1 = scb[r, 2 * o + 1].view(np.int8).astype(np.float32)
                            b = _deq_q6k_frag(w0, w1, hw[0], hw[1], c, dlane * s0, dlane * s1)
                        else:
                            b = _deq_frag(w0, w1, c, dd, mm, k)
                        for mt in range(MT):
                            _mma(acc[warp, mt, nt], a[0][mt], b[0], b[1])
                            _mma(acc[warp, mt, nt], a[1][mt], b[2], b[3])
        sm.wait(0)
        assert not sm.inflight
        _finish(acc, WM, WN, MT, NT, tm, bx, by, bz, grid, slices, ws, counters, bias, C, M, N, ldc, mode, writes)
    assert not any(counters.values()), "a tile counter left non-zero"
    return writes


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(
    "M,N,nb,slices,dbase",
    [
        (1, 150, 13, 3, 3),  # height 16: stages of 4 blocks, slices of 5, 5, 3 (part-full stages), windows over chunks
        (13, 130, 9, 1, 7),  # height 16 unsplit: 9 blocks = 4 + 4 + 1
        (29, 150, 11, 2, 0),  # height 32: slices of 6 and 5
        (37, 140, 7, 3, 5),  # height 64 (stages of 2 blocks): slices of 3, 3, 1
        (64, 129, 6, 1, 1),  # height 64 unsplit, a 1-column second tile
        (100, 131, 5, 2, 6),  # height 128 (8 m16 tiles a warp): slices of 3 and 2 blocks
    ],
)
def test_fragment_gemm_emulation_gives_the_bits_of_the_tile_gemm(qtype, M, N, nb, slices, dbase):
    """matmul2r (emulate_frag, from the raw bytes) and matmul2 (emulate, from the same weights dequantized) give the
    same bits, and numpy's product: the copies, scale windows, fragment dequantization and mma order agree."""
    rng = np.random.default_rng(M * 1000 + N + nb)
    K = nb * QK
    tm = next(t for t in MATMUL2_TILE_ROWS if t >= M)
    qs = rng.integers(0, 256, (N, nb, 16), dtype=np.uint8)
    d = (rng.standard_normal((N, nb)) * 0.02).astype(np.float16)
    m = (rng.standard_normal((N, nb)) * 0.05).astype(np.float16) if qtype == "Q4_1" else None
    A = rng.standard_normal((M, K)).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float32)
    ldc = N + 3
    Wh = q4_weights(qs, d, m)
    for mode in (MODE_STORE, MODE_ADD):
        resid = rng.standard_normal(M * ldc).astype(np.float32)
        frag, tile = resid.copy(), resid.copy()
        writes = emulate_frag(A, qs, d, m, dbase, bias, frag, M, N, K, ldc, mode, tm, slices, rng)
        emulate(A, Wh, bias, tile, M, N, K, ldc, mode, tm, slices, False, True, rng)
        assert np.array_equal(frag.view(np.uint32), tile.view(np.uint32))
        assert (writes.reshape(M, ldc)[:, :N] == 1).all() and not writes.reshape(M, ldc)[:, N:].any()
        want = A.astype(np.float64) @ Wh.astype(np.float64).T + bias
        if mode == MODE_ADD:
            want += resid.reshape(M, ldc)[:, :N]
        got = frag.reshape(M, ldc)[:, :N]
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def _k_quant_frag_gives_the_tile_bits(qtype, raw, M, N, nb, slices, rng, dbase=0, **frag):
    """emulate_frag on a K-quant's packed arrays (qs, and frag: Q4_K's headers= or Q6_K's q6=) and emulate (matmul2,
    from gguf's dequantization of raw rounded to fp16), MODE_ADD onto a residual with a bias: the same bits, each
    output written once, and numpy's product."""
    K = nb * QK
    tm = next(t for t in MATMUL2_TILE_ROWS if t >= M)
    qs = np.ascontiguousarray(soa.pack(qtype, raw, N, K)["qs"]).view(np.uint8).reshape(N, nb, 16)
    with np.errstate(over="ignore"):
        Wh = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(N, K).astype(np.float16)
    A = rng.standard_normal((M, K)).astype(np.float16)
    bias = rng.standard_normal(N).astype(np.float32)
    ldc = N + 3
    resid = rng.standard_normal(M * ldc).astype(np.float32)
    frag_out, tile = resid.copy(), resid.copy()
    writes = emulate_frag(A, qs, None, None, dbase, bias, frag_out, M, N, K, ldc, MODE_ADD, tm, slices, rng, **frag)
    emulate(A, Wh, bias, tile, M, N, K, ldc, MODE_ADD, tm, slices, False, True, rng)
    assert np.array_equal(frag_out.view(np.uint32), tile.view(np.uint32))
    assert (writes.reshape(M, ldc)[:, :N] == 1).all() and not writes.reshape(M, ldc)[:, N:].any()
    want = A.astype(np.float64) @ Wh.astype(np.float64).T + bias + resid.reshape(M, ldc)[:, :N]
    got = frag_out.reshape(M, ldc)[:, :N]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize(
    "M,N,nb,slices",
    [
        (1, 150, 24, 5),  # height 16 (stages of 4 blocks): slices of 5, starting at sub-blocks 0, 5, 2, 7, 4
        (29, 130, 16, 3),  # height 32: slices of 6, 6, 4 (sub-blocks 0, 6, 4: windows across two headers)
        (37, 140, 24, 5),  # height 64 (stages of 2 blocks): slices of 5, stages ending at sub-block 7 + 1
        (100, 131, 16, 3),  # height 128: slices of 6, 6, 4
    ],
)
def test_fragment_gemm_emulation_reads_q4_k_headers_as_scale_windows(M, N, nb, slices):
    """matmul2r on Q4_K (emulate_frag with the super-block headers passed as d: one 16-byte header per 8 blocks, as a
    chunk of fp16 scales) and matmul2 give the same bits, and numpy's product: slices that start mid-super-block, so a
    stage's window runs into the next header at both stage sizes."""
    rng = np.random.default_rng(M * 1000 + N + nb)
    raw = soa.random_blocks(rng, "Q4_K", N, nb * QK)
    headers = np.ascontiguousarray(soa.pack("Q4_K", raw, N, nb * QK)["sc"]).view(np.uint8).reshape(N, nb // 8, 16)
    _k_quant_frag_gives_the_tile_bits("Q4_K", raw, M, N, nb, slices, rng, headers=headers)


@pytest.mark.parametrize(
    "M,N,nb,slices,dbase,ddbase",
    [
        (1, 150, 24, 5, 0, 0),  # height 16 (stages of 4 blocks): slices of 5 from blocks 0, 5, 10, 15, 20
        (13, 130, 56, 3, 3, 1),  # height 16: slices of 19 (d's second word where a stage crosses an odd super-block)
        (29, 150, 16, 3, 5, 0),  # height 32: slices of 6, 6, 4
        (37, 140, 24, 5, 7, 1),  # height 64 (stages of 2 blocks): slices of 5, stages ending at sub-block 7 + 1
        (100, 131, 56, 3, 0, 1),  # height 128: slices of 19
    ],
)
def test_fragment_gemm_emulation_reads_q6_k_from_its_four_arrays(M, N, nb, slices, dbase, ddbase):
    """matmul2r on Q6_K (emulate_frag with its sub-block scales as d's windows, the super-blocks' d as two 4-byte words
    a row and the high bits in their own region) and matmul2 give the same bits, and numpy's product: slices that
    start mid-super-block, scales and d at other offsets in their chunks and words."""
    rng = np.random.default_rng(M * 1000 + N + nb + 7)
    raw = soa.random_blocks(rng, "Q6_K", N, nb * QK)
    arrays = {f: np.ascontiguousarray(a) for f, a in soa.pack("Q6_K", raw, N, nb * QK).items()}
    qh = arrays["qh"].view(np.uint8).reshape(N, nb, 8)
    sc = arrays["sc"].view(np.int8).reshape(N, nb, 2)
    dsb = arrays["d"].view(np.float16).reshape(N, nb // 8)
    _k_quant_frag_gives_the_tile_bits("Q6_K", raw, M, N, nb, slices, rng, dbase, q6=(qh, sc, dsb, ddbase))
