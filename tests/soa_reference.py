"""numpy model of the GPU's soa-v2 weight layout (cuda/common.cuh), for tests on either side of the GPU.

pack(): GGUF blocks -> the arrays cuda/repack.cu writes, byte for byte (what the GPU test compares the device
arrays with). dequantize(): those arrays -> fp32 weights by the formulas of cuda/weights.cuh, in the same fp32
order (the CPU test checks them against gguf's dequantization, bit for bit). random_blocks(): GGUF bytes of any
type with random quants and chosen scales (gguf-py quantizes only some types; random bytes reach every bit).
q8x2(): the GPU's quantized activations (common.cuh warp_quantize_q8x2), emulated exactly.
"""

from __future__ import annotations

import numpy as np

from ingot.runtime.model.quants import KVALUES_IQ4NL, QUANT_TYPES

# f16 fields of each GGUF block: (byte offset of d, byte offset of dmin/m or None)
SCALE_FIELDS = {
    "Q8_0": (0, None),
    "Q4_0": (0, None),
    "Q4_1": (0, 2),
    "Q5_0": (0, None),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108, None),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
    "IQ4_NL": (0, None),
    "IQ4_XS": (0, None),
}


def random_blocks(rng, qtype: str, rows: int, cols: int, odd: bool = False) -> np.ndarray:
    """uint8 [rows, row_bytes]: random quant bits; f16 scales ~N(0, 0.01) (half of them negative, as the
    quantizers' d for Q4_0-style types can be). odd: also all-zero blocks, zero/subnormal/large scales."""
    t = QUANT_TYPES[qtype]
    n = rows * cols // t.block
    b = rng.integers(0, 256, size=(n, t.block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        if off is None:
            continue
        s = (rng.standard_normal(n) * 0.01).astype(np.float16)
        if odd:
            pick = rng.integers(0, 5, size=n)
            s = np.where(pick == 0, np.float16(0), s)
            s = np.where(pick == 1, np.float16(3e-7), s)  # f16 subnormal
            s = np.where(pick == 2, np.float16(-700.0), s)
        b[:, off : off + 2] = s.view(np.uint8).reshape(n, 2)
    if odd:
        b[rng.integers(0, n, size=max(1, n // 7))] = 0  # whole blocks of zeros: d = 0 and every code 0
    return b.reshape(rows, cols // t.block * t.block_bytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).reshape(-1)


def _nibble_bytes(u: np.ndarray) -> np.ndarray:
    """codes [n, 32] -> [n, 16] bytes, byte j = u[j] | u[j+16] << 4 (low 4 bits of each)."""
    return ((u[:, :16] & 15) | ((u[:, 16:] & 15) << 4)).astype(np.uint8)


def _bit_plane(u: np.ndarray, bit: int) -> np.ndarray:
    """codes [n, 32] -> u32 [n]: bit k of byte b is bit `bit` of code 4k+b."""
    i = np.arange(32)
    pos = (8 * (i % 4) + i // 4).astype(np.uint64)
    return (((u.astype(np.uint64) >> np.uint64(bit)) & np.uint64(1)) << pos).sum(axis=1).astype(np.uint32)


def _crumb_plane(u: np.ndarray, bit: int) -> np.ndarray:
    """codes [n, 32] -> u32 [n, 2]: per half of 16, bits 2k..2k+1 of byte b are bits bit..bit+1 of code 4k+b."""
    j = np.arange(16)
    pos = (8 * (j % 4) + 2 * (j // 4)).astype(np.uint64)
    h = u.reshape(-1, 2, 16).astype(np.uint64)
    return (((h >> np.uint64(bit)) & np.uint64(3)) << pos).sum(axis=2).astype(np.uint32)


def _codes(qtype: str, b: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """GGUF blocks -> (codes [n32, 32] uint8 per 32-weight block, the scale arrays in soa-v2 form)."""
    n = b.shape[0]
    if qtype in ("Q5_0", "Q5_1"):
        h0 = 2 if qtype == "Q5_0" else 4
        qs = b[:, h0 + 4 : h0 + 20]
        nib = np.concatenate([qs & 15, qs >> 4], axis=1)
        bits = np.unpackbits(b[:, h0 : h0 + 4], axis=1, bitorder="little")
        s = {"d": _f16(b[:, 0:2])}
        if qtype == "Q5_1":
            s["m"] = _f16(b[:, 2:4])
        return nib | (bits << 4), s
    # K-quants: per super-block 8 sub-blocks of 32 -> codes [n, 8, 32]
    if qtype in ("Q4_K", "Q5_K"):
        q = b[:, 48:176] if qtype == "Q5_K" else b[:, 16:144]
        q = q.reshape(n, 4, 1, 32)
        codes = np.concatenate([q & 15, q >> 4], axis=2).reshape(n, 8, 32)
        if qtype == "Q5_K":
            codes = codes | (np.unpackbits(b[:, 16:48].reshape(n, 1, 32), axis=1, bitorder="little") << 4)
        return codes.reshape(-1, 32), {"sc": b[:, 0:16].reshape(-1).copy()}  # the header as it is
    if qtype == "Q6_K":
        ql = b[:, 0:128].reshape(n, 2, 1, 2, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
        codes = (low | (high << 4)).reshape(-1, 32)
        return codes, {"sc": b[:, 192:208].reshape(-1).copy(), "d": _f16(b[:, 208:210])}
    # Q2_K, Q3_K: two low bits of weight 128h + 32j + l at bits 2j of qs[32h + l]
    off = 16 if qtype == "Q2_K" else 32
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = ((b[:, off : off + 64].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    if qtype == "Q2_K":
        return codes.reshape(-1, 32), {
            "sc": b[:, 0:16].reshape(-1).copy(),
            "d": _f16(b[:, 80:82]),
            "m": _f16(b[:, 82:84]),
        }
    hbits = np.unpackbits(b[:, 0:32].reshape(n, 1, 32), axis=1, bitorder="little")  # [n, 8 = 4h + j, 32]
    codes = codes | (hbits << 2)
    k6 = b[:, 96:108]
    low = np.concatenate([k6[:, 0:8] & 15, k6[:, 0:8] >> 4], axis=1)
    hs = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    high = ((k6[:, 8:12].reshape(-1, 1, 4) >> hs) & 3).reshape(-1, 16)
    sc = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
    return codes.reshape(-1, 32), {"sc": sc.reshape(-1), "d": _f16(b[:, 108:110])}


def pack(qtype: str, raw: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    """GGUF bytes of a [rows, cols] matrix -> its soa-v2 arrays as raw bytes (uint8), keyed by GpuMatrix field."""
    t = QUANT_TYPES[qtype]
    b = np.ascontiguousarray(raw).reshape(-1, t.block_bytes)
    if qtype == "IQ4_XS":
        n = b.shape[0]
        high = (b[:, 2:4].view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
        low = np.stack([b[:, 4:8] & 15, b[:, 4:8] >> 4], axis=2).reshape(n, 8)
        sc = ((low.astype(np.int16) | (high.astype(np.int16) << 4)) - 32).astype(np.int8)
        return {
            "qs": b[:, 8:136].reshape(-1).copy(),
            "sc": sc.view(np.uint8).reshape(-1),
            "d": _f16(b[:, 0:2]).view(np.uint8),
        }
    if qtype in ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL"):
        s = {"d": _f16(b[:, 0:2])} | ({"m": _f16(b[:, 2:4])} if qtype == "Q4_1" else {})
        qs = b[:, 4:] if qtype == "Q4_1" else b[:, 2:]
        return {"qs": qs.reshape(-1).copy()} | {k: v.view(np.uint8) for k, v in s.items()}
    codes, s = _codes(qtype, b)
    out: dict[str, np.ndarray] = {}
    if qtype in ("Q2_K", "Q3_K"):
        out["qs"] = _crumb_plane(codes, 0).view(np.uint8).reshape(-1)
    else:
        out["qs"] = _nibble_bytes(codes).reshape(-1)
    if qtype in ("Q5_0", "Q5_1", "Q5_K"):
        out["qh"] = _bit_plane(codes, 4).view(np.uint8)
    elif qtype == "Q3_K":
        out["qh"] = _bit_plane(codes, 2).view(np.uint8)
    elif qtype == "Q6_K":
        out["qh"] = _crumb_plane(codes, 4).view(np.uint8).reshape(-1)
    for k, v in s.items():
        out[k] = np.ascontiguousarray(v).view(np.uint8).reshape(-1)
    return out


def dequantize(qtype: str, arrays: dict[str, np.ndarray], rows: int, cols: int) -> np.ndarray:
    """soa-v2 arrays -> float32 [rows, cols], by cuda/weights.cuh's formulas (fp32, each product rounded)."""
    nb = rows * cols // 32
    a = arrays
    f32 = np.float32
    if qtype in ("IQ4_NL", "IQ4_XS"):
        qs = a["qs"].reshape(nb, 16)
        kv = KVALUES_IQ4NL[np.concatenate([qs & 15, qs >> 4], axis=1)]
        if qtype == "IQ4_NL":
            return (kv * a["d"].view(np.float16).astype(f32)[:, None]).reshape(rows, cols)
        d = np.repeat(a["d"].view(np.float16).astype(f32), 8)[:, None]
        return ((d * a["sc"].view(np.int8).astype(f32)[:, None]) * kv).reshape(rows, cols)
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        d = a["d"].view(np.float16).astype(f32)[:, None]
        if qtype == "Q8_0":
            return (a["qs"].view(np.int8).reshape(nb, 32).astype(f32) * d).reshape(rows, cols)
        qs = a["qs"].reshape(nb, 16)
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(f32)
        if qtype == "Q4_0":
            return ((q - f32(8)) * d).reshape(rows, cols)
        return (q * d + a["m"].view(np.float16).astype(f32)[:, None]).reshape(rows, cols)
    # unpack the codes the way the kernels do: nibbles, then the high-bit planes
    i = np.arange(32)
    if qtype in ("Q2_K", "Q3_K"):
        P = a["qs"].view(np.uint32).reshape(nb, 2)[:, i // 16]  # [nb, 32]
        j = i % 16
        codes = (P >> (8 * (j % 4) + 2 * (j // 4)).astype(np.uint32)) & 3
    else:
        qs = a["qs"].reshape(nb, 16)
        codes = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.uint32)
    if qtype in ("Q5_0", "Q5_1", "Q5_K", "Q3_K"):
        H = a["qh"].view(np.uint32)[:, None]
        bit = (H >> (8 * (i % 4) + i // 4).astype(np.uint32)) & 1
        codes = codes | (bit << (2 if qtype == "Q3_K" else 4))
    if qtype == "Q6_K":
        P = a["qh"].view(np.uint32).reshape(nb, 2)[:, i // 16]
        j = i % 16
        codes = codes | (((P >> (8 * (j % 4) + 2 * (j // 4)).astype(np.uint32)) & 3) << 4)
    q = codes.astype(f32)
    half = i // 16  # which 16-weight sub-block (Q2_K, Q3_K, Q6_K)
    if qtype in ("Q5_0", "Q5_1"):
        d = a["d"].view(np.float16).astype(f32)[:, None]
        if qtype == "Q5_0":
            return ((q - f32(16)) * d).reshape(rows, cols)
        return (q * d + a["m"].view(np.float16).astype(f32)[:, None]).reshape(rows, cols)
    if qtype in ("Q4_K", "Q5_K"):  # header per super-block: d, dmin, 12 bytes of 6-bit scales and mins
        h = a["sc"].reshape(-1, 16)
        k = h[:, 4:16]
        sc = np.concatenate([k[:, 0:4] & 63, (k[:, 8:12] & 15) | ((k[:, 0:4] >> 6) << 4)], axis=1).reshape(nb, 1)
        mn = np.concatenate([k[:, 4:8] & 63, (k[:, 8:12] >> 4) | ((k[:, 4:8] >> 6) << 4)], axis=1).reshape(nb, 1)
        d = np.repeat(_f16(h[:, 0:2]).astype(f32), 8)[:, None]
        dmin = np.repeat(_f16(h[:, 2:4]).astype(f32), 8)[:, None]
        return (d * sc.astype(f32) * q - dmin * mn.astype(f32)).reshape(rows, cols)
    d = np.repeat(a["d"].view(np.float16).astype(f32), 8)[:, None]  # per super-block -> per 32-block
    if qtype == "Q2_K":
        sc = a["sc"].reshape(nb, 2)[:, half]
        dmin = np.repeat(a["m"].view(np.float16).astype(f32), 8)[:, None]
        return (d * (sc & 15).astype(f32) * q - dmin * (sc >> 4).astype(f32)).reshape(rows, cols)
    sc = a["sc"].view(np.int8).reshape(nb, 2)[:, half].astype(f32)
    offset = f32(32) if qtype == "Q6_K" else f32(4)
    return ((d * sc) * (q - offset)).reshape(rows, cols)


def q8x2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy emulation of the GPU's q8x2 (warp_quantize_q8x2 in cuda/common.cuh), operation for operation so the
    int8 codes match exactly: per 32 values d1 = amax/127, d2 = d1/254, q1 = rint(x * rcp(d1)),
    q2 = rint(fma(-q1, d1, x) * rcp(d2)) clipped to +-127, where rcp is the correctly rounded float32
    reciprocal (__frcp_rn) and fma rounds once: -q1*d1 + x is exact in float64 (a 7-bit integer times a 24-bit
    significand, then a difference smaller than d1), so one rounding to float32 is fmaf's.
    Returns (xq int8 [blocks, 64], xd float32 [blocks, 4] = (d1, d2, sum, sum of values 0..15))."""
    b = x.reshape(-1, 32).astype(np.float32)
    d1 = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float32)
    d2 = (d1 / np.float32(254)).astype(np.float32)
    safe1, safe2 = np.where(d1 > 0, d1, 1)[:, None], np.where(d2 > 0, d2, 1)[:, None]
    r1, r2 = np.float32(1) / safe1, np.float32(1) / safe2  # float32 division: the correctly rounded reciprocal
    q1 = np.where(d1[:, None] > 0, np.rint(b * r1), 0).astype(np.float32)
    resid = (b.astype(np.float64) - q1.astype(np.float64) * d1[:, None].astype(np.float64)).astype(np.float32)
    q2 = np.where(d1[:, None] > 0, np.clip(np.rint(resid * r2), -127, 127), 0).astype(np.float32)
    s = d1 * q1.sum(axis=1) + d2 * q2.sum(axis=1)
    s_lo = d1 * q1[:, :16].sum(axis=1) + d2 * q2[:, :16].sum(axis=1)  # values 0..15: the K-quants' half sums
    xq = np.concatenate([q1, q2], axis=1).astype(np.int8)
    return xq, np.stack([d1, d2, s, s_lo], axis=1).astype(np.float32)


def dequant_q8x2(xq: np.ndarray, xd: np.ndarray) -> np.ndarray:
    xq, xd = xq.reshape(-1, 64).astype(np.float64), xd.reshape(-1, 4).astype(np.float64)
    return xq[:, :32] * xd[:, :1] + xq[:, 32:] * xd[:, 1:2]


def bits_equal(out: np.ndarray, ref: np.ndarray) -> bool:
    """fp32 arrays equal bit for bit (the same values and signs of zero)."""
    out, ref = np.ascontiguousarray(out, np.float32), np.ascontiguousarray(ref, np.float32)
    return bool(np.array_equal(out.view(np.uint32), ref.view(np.uint32)))
