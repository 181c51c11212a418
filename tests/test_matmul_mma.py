"""cuda/matmul.cu's pipelined GEMM (matmul2_<type>_bm<TM>) emulated in numpy, without a GPU.

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
from test_attention_prefill import LANE, _ldmatrix_x4, _mma

from ingot.runtime.gpu.constants import MATMUL2_BN as BN
from ingot.runtime.gpu.constants import MATMUL2_STAGES as STAGES
from ingot.runtime.gpu.constants import MATMUL2_THREADS as THREADS
from ingot.runtime.gpu.constants import MODE_ADD, MODE_STORE, QK
from ingot.runtime.gpu.kernels import MATMUL2_LDS as LDS
from ingot.runtime.gpu.kernels import MATMUL2_TILE_ROWS, matmul_geometry


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
                continue
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
    assert not any(counters.values()), "a tile counter left non-zero"
    return writes


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
