"""Dequantization of the GGML block formats Ingot runs: F32, F16, BF16, Q8_0, Q4_0, Q4_1.

Every format stores a row of `cols` weights as `cols / block` blocks of `block_bytes` bytes; a row never
shares a block with the next one. The layouts (ggml-common.h), with x the dequantized weights of a block:

  F32   4 bytes/weight                       x = float32
  F16   2 bytes/weight                       x = float16
  BF16  2 bytes/weight                       x = the top 16 bits of a float32
  Q8_0  34 bytes/32 weights: f16 d, i8 q[32]           x[j] = d * q[j]
  Q4_0  18 bytes/32 weights: f16 d, u8 qs[16]          x[j] = d * ((qs[j] & 15) - 8),  x[j+16] = d * ((qs[j] >> 4) - 8)
  Q4_1  20 bytes/32 weights: f16 d, f16 m, u8 qs[16]   x[j] = d * (qs[j] & 15) + m,    x[j+16] = d * (qs[j] >> 4) + m

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
    d = b[:, 0:2].view(np.float16).astype(np.float32)  # [n, 1]
    q = b[:, 2:34].view(np.int8).astype(np.float32)  # [n, 32]
    return q * d


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] values 0..15: low nibbles are weights 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    q = _nibbles(b[:, 2:18]).astype(np.float32) - 8.0
    return q * d


def _q4_1(b: np.ndarray) -> np.ndarray:
    d = b[:, 0:2].view(np.float16).astype(np.float32)
    m = b[:, 2:4].view(np.float16).astype(np.float32)
    q = _nibbles(b[:, 4:20]).astype(np.float32)
    return q * d + m


_DEQUANT = {"F32": _f32, "F16": _f16, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}
