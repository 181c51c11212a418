"""Dequantization of the GGML block formats Ingot runs: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the
K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and the non-linear IQ4_NL, IQ4_XS.

Every format stores a row of `cols` weights as `cols / block` blocks of `block_bytes` bytes; a row never
shares a block with the next one. The layouts (ggml-common.h), with x the dequantized weights of a block:

  F32   4 bytes/weight                       x = float32
  F16   2 bytes/weight                       x = float16
  BF16  2 bytes/weight                       x = the top 16 bits of a float32
  Q8_0  34 bytes/32 weights: f16 d, i8 q[32]           x[j] = d * q[j]
  Q4_0  18 bytes/32 weights: f16 d, u8 qs[16]          x[j] = d * ((qs[j] & 15) - 8),  x[j+16] = d * ((qs[j] >> 4) - 8)
  Q4_1  20 bytes/32 weights: f16 d, f16 m, u8 qs[16]   x[j] = d * (qs[j] & 15) + m,    x[j+16] = d * (qs[j] >> 4) + m
  Q5_0  22 bytes/32 weights: f16 d, u32 qh, u8 qs[16]  q = nibble | (bit j of qh) << 4,  x[j] = d * (q - 16)
  Q5_1  24 bytes/32 weights: f16 d, f16 m, u32 qh, qs  as Q5_0 with x[j] = d * q + m
  IQ4_NL 18 bytes/32 weights: f16 d, u8 qs[16]         as Q4_0 with x[j] = d * KVALUES_IQ4NL[nibble]

The K-quants have 256-weight super-blocks of 16 or 8 sub-blocks, each with its own small integer scale (and
min) that multiplies the super-block's f16 d (and dmin):

  Q2_K  84 bytes: u8 scales[16] (lo: scale, hi: min), u8 qs[64] (2 bits), f16 d, f16 dmin
                  x = (d * sc) * q - (dmin * m), 16 sub-blocks of 16
  Q3_K  110 bytes: u8 hmask[32], u8 qs[64] (2 low bits), u8 scales[12] (16 x 6-bit, minus 32), f16 d
                  x = (d * sc) * (q - 4 * !hbit), 16 sub-blocks of 16
  Q4_K  144 bytes: f16 d, f16 dmin, u8 scales[12] (8 x 6-bit scale + 8 x 6-bit min), u8 qs[128]
                  x = (d * sc) * q - (dmin * m), 8 sub-blocks of 32
  Q5_K  176 bytes: as Q4_K plus u8 qh[32] (the fifth bit) before qs
  Q6_K  210 bytes: u8 ql[128] (4 low bits), u8 qh[64] (2 high bits), i8 scales[16], f16 d
                  x = (d * sc) * (q - 32), 16 sub-blocks of 16
  IQ4_XS 136 bytes: f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]: 8 sub-blocks of 32 with 6-bit scales
                  (minus 32), x = (d * sc) * KVALUES_IQ4NL[nibble]

Bit positions follow ggml-quants.c's dequantize_row_* exactly, and so does the order of the float32 operations
(which product is rounded first), so the results are bit-identical to ggml's and gguf-py's.

The GPU kernels implement the same formulas; tests/test_quants.py checks these against gguf's own
reference dequantizer (gguf.quants.dequantize) for every type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantType:
    name: str
    block: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


QUANT_TYPES = {
    t.name: t
    for t in (
        QuantType("F32", 1, 4),
        QuantType("F16", 1, 2),
        QuantType("BF16", 1, 2),
        QuantType("Q8_0", 32, 34),
        QuantType("Q4_0", 32, 18),
        QuantType("Q4_1", 32, 20),
        QuantType("Q5_0", 32, 22),
        QuantType("Q5_1", 32, 24),
        QuantType("Q2_K", 256, 84),
        QuantType("Q3_K", 256, 110),
        QuantType("Q4_K", 256, 144),
        QuantType("Q5_K", 256, 176),
        QuantType("Q6_K", 256, 210),
        QuantType("IQ4_NL", 32, 18),
        QuantType("IQ4_XS", 256, 136),
    )
}

# Dequantize this many weights at a time, so a 2 GiB embedding matrix needs no 6 GiB of temporaries.
_CHUNK_WEIGHTS = 1 << 23


def dequantize(raw: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    """raw: uint8 [rows, row_bytes] (or [row_bytes]) -> float32 [rows, cols] (or [cols])."""
    t = QUANT_TYPES[qtype]
    rows = raw.reshape(-1, t.row_bytes(cols))
    out = np.empty((rows.shape[0], cols), dtype=np.float32)
    step = max(1, _CHUNK_WEIGHTS // cols)
    for r in range(0, rows.shape[0], step):
        blocks = np.ascontiguousarray(rows[r : r + step]).reshape(-1, t.block_bytes)
        out[r : r + step] = _DEQUANT[qtype](blocks).reshape(-1, cols)
    return out.reshape(*raw.shape[:-1], cols)


def _f32(b: np.ndarray) -> np.ndarray:
    return b.view(np.float32)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])  # [n, 1]
    q = b[:, 2:34].view(np.int8).astype(np.float32)  # [n, 32]
    return q * d


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values 0..15: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).astype(np.float32) - 8.0
    return q * d


def _q4_1(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return q * d + m


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] its bits 0..31, each 0 or 16 (the fifth bit of weight j)."""
    bits = np.unpackbits(qh, axis=1, bitorder="little")  # byte 0 bit 0 first: bit j of the u32 is column j
    return bits << np.uint8(4)


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    q = (_nibbles(b[:, 6:22]) | _fifth_bits(b[:, 2:6])).astype(np.float32) - 16.0
    return q * d


def _q5_1(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    q = (_nibbles(b[:, 8:24]) | _fifth_bits(b[:, 4:8])).astype(np.float32)
    return q * d + m


# The 4-bit codebook of IQ4_NL and IQ4_XS (kvalues_iq4nl in ggml-common.h).
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_nl(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])
    return KVALUES_IQ4NL[_nibbles(b[:, 2:18])] * d


def _crumbs(qs: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K low bits: [n, 64] bytes -> [n, 256] values 0..3. Weight 128*h + 32*j + l (h < 2, j < 4,
    l < 32) is bits 2j..2j+1 of byte 32*h + l."""
    n = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 256)


def _q2_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    scales = b[:, 0:16]
    d = _f16(b[:, 80:82])
    dmin = _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    q = _crumbs(b[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """[n, 12] -> [n, 16] float32 signed scales: sub-block j has its low 4 bits in the low (j < 8) or high
    (j >= 8) nibble of s[j % 8], its high 2 bits in bits 2*(j // 4) of s[8 + j % 4]; then minus 32."""
    low = np.concatenate([s[:, 0:8] & 0xF, s[:, 0:8] >> 4], axis=1)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((s[:, 8:12].reshape(-1, 1, 4) >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).astype(np.int8).astype(np.float32) - 32.0


def _q3_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 108:110])
    dl = (d * _q3_k_scales(b[:, 96:108])).reshape(n, 16, 1)
    # The high bit of weight 128*h + 32*j + l is bit 4*h + j of hmask[l]; a clear bit subtracts 4.
    hbits = np.unpackbits(b[:, 0:32].reshape(n, 1, 32), axis=1, bitorder="little")  # [n, 8 bits, 32 l]
    q = _crumbs(b[:, 32:96]).astype(np.int8) - ((1 - hbits.reshape(n, 256)) << 2).astype(np.int8)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: [n, 12] -> ([n, 8], [n, 8]) 6-bit scales and mins (get_scale_min_k4): sub-blocks 0..3 are the
    low 6 bits of s[j] and s[j+4]; 4..7 are a nibble of s[j+4] plus the top 2 bits of s[j-4] and s[j]."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return sc.astype(np.float32), m.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: [n, 128] -> [n, 256]: weights 64*c .. 64*c+31 are the low nibbles of qs[32*c : 32*c+32], the
    next 32 their high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32)
    return np.concatenate([q & 0xF, q >> 4], axis=2).reshape(n, 256)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K block header -> per-sub-block scale and min, [n, 8, 1] each: d * sc and dmin * m."""
    n = b.shape[0]
    sc, m = _k_scale_min(b[:, 4:16])
    return (_f16(b[:, 0:2]) * sc).reshape(n, 8, 1), (_f16(b[:, 2:4]) * m).reshape(n, 8, 1)


def _q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    q = _k_nibbles(b[:, 16:144]).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    dl, ml = _k_scales(b)
    # The fifth bit of weight 32*s + l (sub-block s) is bit s of qh[l].
    high = np.unpackbits(b[:, 16:48].reshape(n, 1, 32), axis=1, bitorder="little").reshape(n, 256) << 4
    q = (_k_nibbles(b[:, 48:176]) | high).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    # Weight 128*h + 32*j + l (h < 2, j < 4, l < 32): low 4 bits from ql[64*h + l + 32*(j & 1)] (low nibble
    # for j < 2, high for j >= 2), high 2 bits from bits 2j..2j+1 of qh[32*h + l].
    ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)
    low = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(n, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    dl = (d * scales).reshape(n, 16, 1)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)


def _iq4_xs(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d = _f16(b[:, 0:2])
    scales_h = b[:, 2:4].view(np.uint16)  # [n, 1]
    scales_l = b[:, 4:8]
    low = np.stack([scales_l & 0xF, scales_l >> 4], axis=2).reshape(n, 8)  # sub-block s: nibble s % 2 of byte s // 2
    high = (scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # bits 2s..2s+1 of scales_h
    ls = (low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32
    dl = (d * ls.astype(np.float32)).reshape(n, 8, 1)
    q = KVALUES_IQ4NL[_nibbles(b[:, 8:136].reshape(n * 8, 16))].reshape(n, 8, 32)
    return (dl * q).reshape(n, 256)


_DEQUANT = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _bf16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
}
