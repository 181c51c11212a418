"""Dequantization agrees bit for bit with gguf's own reference dequantizer, on random blocks and real tensors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ingot.runtime.model import quants
from ingot.runtime.model.quants import QUANT_TYPES, dequantize


def _reference(raw: np.ndarray, qtype: str) -> np.ndarray:
    t = GGMLQuantizationType[qtype]
    if qtype == "F32":
        return gguf_dequantize(raw.view(np.float32), t)
    if qtype == "F16":
        return gguf_dequantize(raw.view(np.float16), t)
    return gguf_dequantize(raw, t)


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_random_blocks_match_gguf_reference(qtype):
    # Random bytes: every bit pattern of scales and values, NaN/inf scales included (compared as equal).
    rows, cols = 7, 512  # a multiple of every block size (256 for the K-quants and IQ4_XS)
    raw = np.random.default_rng(1).integers(0, 256, (rows, QUANT_TYPES[qtype].row_bytes(cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        ours, ref = dequantize(raw, qtype, cols), _reference(raw, qtype)
    assert ours.shape == (rows, cols) and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", [t for t in QUANT_TYPES if QUANT_TYPES[t].block > 1])
def test_zero_saturated_and_small_scales_match_gguf_reference(qtype):
    """Blocks with all-zero bytes (zero scales), all-ones bytes (NaN f16 scales, every bit set), and random values
    under a small odd f16 super-scale (1 ulp subnormal up to 65504, negative too) in every f16 field."""
    t = QUANT_TYPES[qtype]
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (64, t.block_bytes), dtype=np.uint8)
    blocks[0] = 0
    blocks[1] = 255
    f16_fields = {  # byte offsets of the f16 scales (d, dmin/m) in each block layout
        "Q8_0": [0],
        "Q4_0": [0],
        "Q4_1": [0, 2],
        "Q5_0": [0],
        "Q5_1": [0, 2],
        "IQ4_NL": [0],
        "IQ4_XS": [0],
        "Q2_K": [80, 82],
        "Q3_K": [108],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q6_K": [208],
    }[qtype]
    odd = np.array([1, 3, 0x3C01, 0x7BFF, 0x8001, 0xBC00, 0x0400, 0x3555], dtype=np.uint16)  # f16 bit patterns
    for i in range(2, 64):
        for off in f16_fields:
            k = (i + off) % len(odd)
            blocks[i, off : off + 2] = odd[k : k + 1].view(np.uint8) if i % 3 else 0
    raw = blocks.reshape(8, -1)
    cols = raw.shape[1] // t.block_bytes * t.block
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(dequantize(raw, qtype, cols), _reference(raw, qtype))


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_chunked_dequantization_matches_whole(qtype, monkeypatch):
    rows, cols = 9, 256
    raw = np.random.default_rng(2).integers(0, 256, (rows, QUANT_TYPES[qtype].row_bytes(cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        whole = dequantize(raw, qtype, cols)
        monkeypatch.setattr(quants, "_CHUNK_WEIGHTS", 2 * cols)  # two rows at a time, last chunk short
        np.testing.assert_array_equal(dequantize(raw, qtype, cols), whole)


def test_real_model_tensors_match_gguf_reference(real_model):
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
        t = real_model.tensors[name]
        ours = t.dequantize()
        assert ours.shape == t.shape
        np.testing.assert_array_equal(ours, _reference(t.raw, t.qtype).reshape(t.shape))


def test_dequantize_rows_picks_rows(real_model):
    t = real_model.tensors["token_embd.weight"]
    ids = [5, 0, 49151, 5]
    np.testing.assert_array_equal(t.dequantize_rows(ids), t.dequantize()[ids])


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_chunked_dequantization_of_a_tall_matrix(qtype, monkeypatch):
    """More rows than bytes per row, in chunks of two rows: every chunk is written (the loop runs over rows)."""
    rows, cols = 200, max(32, QUANT_TYPES[qtype].block)  # one block per row (K-quant blocks hold 256 weights)
    raw = np.random.default_rng(3).integers(0, 256, (rows, QUANT_TYPES[qtype].row_bytes(cols)), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        whole = dequantize(raw, qtype, cols)
        np.testing.assert_array_equal(whole, _reference(raw, qtype).reshape(rows, cols))
        monkeypatch.setattr(quants, "_CHUNK_WEIGHTS", 2 * cols)
        np.testing.assert_array_equal(dequantize(raw, qtype, cols), whole)
