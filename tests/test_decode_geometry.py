"""Host-side geometry of the v8 decode attention and of the large-vocabulary sampler, without a GPU.

decode_split_ranges mirrors what cuda/attention_decode.cu derives from pos[b] on the device; these tests pin the
properties the kernel relies on (the active splits partition the visible keys [lo, pos], each holds at least one
key, there are never more than the grid's splits, the last one holds pos and so writes the new k, v), and
replay the kernel's arithmetic — per-page online softmax, P.V key groups, per-split partials, the merge's
running fold — in float64 numpy against a direct softmax, so an algebra slip shows here before it reaches a device.
"""

from __future__ import annotations

import numpy as np
import pytest

from ingot.runtime.gpu.constants import ATT_ONE_SPLIT_PAGES, MAX_SPLITS, MERGE_U, PAGE
from ingot.runtime.gpu.kernels import (
    SAMPLE_CHUNK,
    SAMPLE_PREP_MIN_V,
    decode_split_ranges,
    decode_splits,
    norm_splits,
    sample_chunk_bytes,
    sample_chunks,
)

POSITIONS = [0, 1, 30, 31, 32, 33, 63, 64, 255, 256, 257, 599, 1023, 1024, 1025, 1499, 4999, 16383, 131071]


@pytest.mark.parametrize("window", [0, 1, 7, 33, 512, 4096])
@pytest.mark.parametrize("splits", [1, 2, 7, 32])
def test_active_splits_partition_the_visible_keys(window, splits):
    for pos in POSITIONS:
        ranges = decode_split_ranges(pos, window, splits)
        lo = max(0, pos - window + 1) if window else 0
        assert 1 <= len(ranges) <= splits
        assert ranges[0][0] == lo and ranges[-1][1] == pos + 1  # the last split holds the new position
        for (_, e0), (b1, _) in zip(ranges, ranges[1:], strict=False):
            assert e0 == b1 and b1 % PAGE == 0  # contiguous, cut at page boundaries
        assert all(e > b for b, e in ranges)  # no active split is empty
        npages = pos // PAGE - lo // PAGE + 1
        per_split = npages if npages <= ATT_ONE_SPLIT_PAGES else -(-npages // splits)
        assert all(-(-e // PAGE) - b // PAGE <= per_split for b, e in ranges)  # pages per split, as the kernel


def test_short_context_uses_one_block_per_page():
    """tg128 from an empty context: one split (direct output, no merge) while the keys fit ATT_ONE_SPLIT_PAGES (2)
    pages, up to position 63, then one per page."""
    assert ATT_ONE_SPLIT_PAGES == 2
    assert decode_split_ranges(0, 0, 32) == [(0, 1)]
    assert decode_split_ranges(31, 0, 32) == [(0, 32)]
    assert decode_split_ranges(63, 0, 32) == [(0, 64)]
    assert decode_split_ranges(64, 0, 32) == [(0, 32), (32, 64), (64, 65)]
    assert decode_split_ranges(127, 0, 32) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert len(decode_split_ranges(16383, 0, 32)) == 32  # long context: every split, 16 pages each
    assert len(decode_split_ranges(16400, 512, 32)) == 17  # a local layer: 512 keys over 17 pages (unaligned)
    assert len(decode_split_ranges(16383, 512, 32)) == 16  # ... or 16 when they start on a page


def test_decode_splits_fill_one_round_of_resident_blocks_and_stay_within_the_merge():
    assert MAX_SPLITS == 64
    assert decode_splits(132, 1, 1, 3) == MAX_SPLITS  # Gemma 3 270M: one kv head (hd 256: 3 blocks an SM)
    assert decode_splits(132, 1, 8, 4) == MAX_SPLITS  # 8B on sm_90 (4 blocks an SM): 66, capped
    assert decode_splits(132, 1, 8, 3) == 50  # 8B where the kernel fits 3 an SM
    assert decode_splits(132, 1, 8, 4, cap=32) == 32  # v7's merge: one split a lane
    assert decode_splits(132, 4, 8, 4) == 17
    assert decode_splits(132, 64, 8, 4) == 2
    assert decode_splits(132, 128, 8, 4) == 1


def test_a_decode_norm_spreads_its_row_while_the_rows_are_few():
    assert norm_splits(1, 4096, 1024, 132) == 4  # 8B decode: each warp quantizes one of its four blocks
    assert norm_splits(8, 4096, 1024, 132) == 4  # 32 blocks: a quarter of the SMs
    assert norm_splits(9, 4096, 1024, 132) == 1
    assert norm_splits(64, 4096, 1024, 132) == 1  # batched decode and prefill: the rows fill the GPU
    assert norm_splits(1, 576, 576, 132) == 1  # SmolLM2: one block per warp already
    assert norm_splits(1, 16384, 1024, 132) == 16  # the loop form: one trip each


def test_sampler_chunks():
    assert sample_chunks(49152) == 0  # SmolLM2: one block
    assert sample_chunks(SAMPLE_PREP_MIN_V) == SAMPLE_PREP_MIN_V // SAMPLE_CHUNK
    assert sample_chunks(262144) == 128 and sample_chunks(128256) == 63
    assert sample_chunk_bytes(262144, 4) == 16 * 4 * 128 and sample_chunk_bytes(1000, 4) == 64


def _kernel_math(q, k, v, ranges, hd):
    """cuda/attention_decode.cu's arithmetic in float64: q [G, hd] (scaled), k/v [n, hd] -> out [G, hd]."""
    G, KG = len(q), 256 // hd
    partials = []
    for k_begin, k_end in ranges:
        m, lsum, acc = np.full(G, -1e30), np.zeros(G), np.zeros((KG, G, hd))
        for page in range(k_begin // PAGE, -(-k_end // PAGE)):
            keys = np.arange(page * PAGE, (page + 1) * PAGE)
            valid = (keys >= k_begin) & (keys < k_end)
            kp = np.where(valid[:, None], k[np.minimum(keys, len(k) - 1)], 0.0)
            vp = np.where(valid[:, None], v[np.minimum(keys, len(v) - 1)], 0.0)
            s = np.where(valid[None, :], q @ kp.T, -np.inf)  # [G, PAGE]: warp g, lane = key
            m_new = np.maximum(m, s.max(axis=1))
            p, corr = np.exp(s - m_new[:, None]), np.exp(m - m_new)
            lsum = lsum * corr + p.sum(axis=1)
            acc *= corr[None, :, None]
            for kg in range(KG):  # thread group kg takes keys kg, kg + KG, ...
                acc[kg] += p[:, kg::KG] @ vp[kg::KG]
            m = m_new
        partials.append((m, lsum, acc.sum(axis=0)))
    if len(partials) == 1:
        _, lsum, a = partials[0]
        return a / lsum[:, None]
    # the merge: rounds of MERGE_U splits, each rescaling the running sums once to the round's max, then adding
    # its terms (slots past the last split repeat it with weight 0: they change nothing and are left out here)
    M, L, out = np.full(G, -1e30), np.zeros(G), np.zeros((G, hd))
    for r in range(0, len(partials), MERGE_U):
        round_ = partials[r : r + MERGE_U]
        M_round = np.max([M, *(m for m, _, _ in round_)], axis=0)
        c = np.exp(M - M_round)
        out, L = out * c[:, None], L * c
        for m, ls, a in round_:
            e = np.exp(m - M_round)
            out, L = out + e[:, None] * a, L + e * ls
        M = M_round
    return out / L[:, None]


@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize("window", [0, 40])
def test_kernel_arithmetic_equals_softmax_attention(hd, window):
    rng = np.random.default_rng(hd + window)
    G = 4
    for pos in [0, 31, 32, 100, 600, 1500]:
        q = rng.standard_normal((G, hd)) / np.sqrt(hd)
        k, v = rng.standard_normal((pos + 1, hd)), rng.standard_normal((pos + 1, hd))
        lo = max(0, pos - window + 1) if window else 0
        s = q @ k[lo:].T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref = (p / p.sum(axis=1, keepdims=True)) @ v[lo:]
        for splits in (1, 7, 32):
            got = _kernel_math(q, k, v, decode_split_ranges(pos, window, splits), hd)
            assert np.allclose(got, ref, rtol=1e-12, atol=1e-12), (pos, splits)
