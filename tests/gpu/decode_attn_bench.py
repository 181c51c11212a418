"""Kernel lab for issues 10 and 11: decode attention v8 vs v7 by context length, and the sampler's prep path.

    python3 tests/gpu/decode_attn_bench.py       # needs a GPU; INGOT_KERNELS may point at a build of cuda/

Per line: µs per launch (kernel_bench.graph_time_us: a graph of back-to-back launches, so the launch gaps of a
decode graph are counted), for one sequence (B=1) with the engine's split count S (Kernels.attn_decode_splits on
this GPU; INGOT_DECODE_SPLITS forces one). The shapes are Gemma 3 270M's (4 q heads over 1 kv head, hd 256; local
layers see 512 keys) and the 8B's (32 over 8, hd 128). The sampler lines time greedy and top-k-40 sampling over
one row of V logits, the single-block path against sample_prep_f32 + sample_f32.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Gpu  # noqa: E402
from kernel_bench import graph_time_us  # noqa: E402

from ingot.runtime.gpu import constants as C  # noqa: E402
from ingot.runtime.gpu.kernels import sample_chunk_bytes  # noqa: E402

DEPTHS = (1, 33, 64, 128, 512, 4096, 16384)


def attention(gpu, rng, name, H, Hkv, hd, window, version):
    os.environ["INGOT_DECODE_ATTN"] = version  # read when the launch is built (settings.DECODE_ATTN)

    class Cfg:
        n_heads, n_kv_heads, head_dim, rope_dim, rope_neox = H, Hkv, hd, hd, True

    pages = max(DEPTHS) // C.PAGE + 1
    kc = gpu.put((rng.standard_normal(pages * Hkv * C.PAGE * hd) * 0.1).astype(np.float16))
    vc = gpu.put((rng.standard_normal(pages * Hkv * C.PAGE * hd) * 0.1).astype(np.float16))
    qkv = gpu.put(rng.standard_normal((H + 2 * Hkv) * hd).astype(np.float32))
    angle = np.arange(pages * C.PAGE)[:, None] * (10000.0 ** (-np.arange(0, hd, 2) / hd))[None, :]
    rope = gpu.put(np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32))
    splits = gpu.k.attn_decode_splits(1, Cfg)
    table = gpu.put(np.arange(pages, dtype=np.int32))
    acc, ml = gpu.empty(4 * H * C.MAX_SPLITS * hd), gpu.empty(8 * H * C.MAX_SPLITS)
    counters, out = gpu.empty(4 * Hkv, 0), gpu.empty(4 * H * hd)
    xq, xd = gpu.empty(2 * H * hd), gpu.empty(16 * H * hd // 32)
    row = []
    for depth in DEPTHS:
        pos = gpu.put(np.array([depth - 1], np.int32))
        launch = gpu.k.attn_decode(
            qkv.ptr, rope, kc.ptr, vc.ptr, table.ptr, pages, pos.ptr, acc.ptr, ml.ptr, counters.ptr, out.ptr, 1,
            splits, Cfg, outq=xq.ptr, outd=xd.ptr, window=window,
        )  # fmt: skip
        row.append(graph_time_us(gpu.stream, [launch], 20))
    times = "  ".join(f"{d}:{us:7.1f}" for d, us in zip(DEPTHS, row, strict=True))
    print(f"{name:<28} {version} S={splits:<3} {times}")


def sampler(gpu, rng, V):
    logits = gpu.put((rng.standard_normal(V) * 3).astype(np.float32))
    one = lambda v, dt: gpu.put(np.array([v], dt)).ptr  # noqa: E731
    for label, temperature, top_k in (("greedy", 0.0, 0), ("top-k 40, T 0.8", 0.8, 40)):
        p = {
            "temperature": one(temperature, np.float32),
            "top_k": one(top_k, np.int32),
            "top_p": one(1.0, np.float32),
            "min_p": one(0.0, np.float32),
            "penalty": one(1.0, np.float32),
            "hist": one(0, np.int32),
            "hist_len": one(0, np.int32),
            "hist_cap": 1,
            "seed": one(7, np.uint64),
            "counter": one(0, np.int32),
        }
        single = graph_time_us(gpu.stream, gpu.k.sample(logits.ptr, V, V, 1, p, gpu.empty(4).ptr), 20)
        p["chunks"] = gpu.empty(sample_chunk_bytes(V, 1)).ptr
        prep = graph_time_us(gpu.stream, gpu.k.sample(logits.ptr, V, V, 1, p, gpu.empty(4).ptr), 20)
        print(f"sample V={V:<7} {label:<16} one block {single:7.1f} us   prep + final {prep:7.1f} us")


def main():
    gpu = Gpu()
    rng = np.random.default_rng(0)
    print("decode attention, µs per launch at depth (keys):")
    for version in ("v7", "v8"):
        attention(gpu, rng, "Gemma 3 270M global", 4, 1, 256, 0, version)
        attention(gpu, rng, "Gemma 3 270M local (512)", 4, 1, 256, 512, version)
        attention(gpu, rng, "8B (32 q / 8 kv, hd 128)", 32, 8, 128, 0, version)
        attention(gpu, rng, "SmolLM2 (9 q / 3 kv, hd 64)", 9, 3, 64, 0, version)
    for V in (262144, 128256):
        sampler(gpu, rng, V)
    gpu.close()


if __name__ == "__main__":
    main()
