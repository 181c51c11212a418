"""Prefill attention lab: device time and TFLOP/s of the tensor-core kernel (cuda/attention_prefill.cu) and the
scalar one (attention.cu) at T = 512 and 2048 new tokens, no cached prefix, for head_dim 64/128/256.

    python3 tests/gpu/attn_prefill_bench.py      # needs a GPU; INGOT_KERNELS may point at a build of cuda/

FLOPs count only the causal half that a query can see: 4 * hd * H * T(T+1)/2 (2 for Q K^T, 2 for P V, per
visible query-key pair and head). "share" is that rate over PEAK_TFLOPS, the dense bf16/fp16 tensor-core rate
measured on the H200 with wgmma (PERF.md); mma.sync, which these kernels use to stay on plain sm_80..sm_120, tops
out below it, so 100% is not reachable.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Gpu  # noqa: E402
from kernel_bench import timed  # noqa: E402

from ingot.runtime.gpu import constants as C  # noqa: E402

PEAK_TFLOPS = 790.0

# (name, n_heads, n_kv_heads, head_dim): the real small models, and wide ones that fill the GPU at each hd
SHAPES = [
    ("SmolLM2-135M", 9, 3, 64),
    ("hd64 32/8", 32, 8, 64),
    ("Llama-3-8B", 32, 8, 128),
    ("Gemma3-270M", 4, 1, 256),
    ("Gemma3-12B", 16, 8, 256),
]


class _Cfg:
    def __init__(self, H, Hkv, hd):
        self.n_heads, self.n_kv_heads, self.head_dim = H, Hkv, hd


def bench(gpu: Gpu, rng, name: str, H: int, Hkv: int, hd: int, T: int, window: int = 0) -> None:
    pages = (T + C.PAGE - 1) // C.PAGE
    k = gpu.put((rng.standard_normal((pages, Hkv, C.PAGE, hd))).astype(np.float16))
    v = gpu.put((rng.standard_normal((pages, Hkv, C.PAGE, hd))).astype(np.float16))
    row = gpu.put(np.arange(pages, dtype=np.int32))
    pos = gpu.put(np.arange(T, dtype=np.int32))
    qkv = gpu.put(rng.standard_normal((T, (H + 2 * Hkv) * hd)).astype(np.float32))
    out = gpu.empty(2 * T * H * hd, 0)
    pairs = sum(min(t + 1, window or t + 1) for t in range(T))
    flop = 4 * hd * H * pairs
    line = f"{name:<14} hd {hd:<3} H {H:>2}/{Hkv:<2} T {T:<5}" + (f" window {window}" if window else "")
    saved = gpu.k.prefill_mma
    for mma in (True, False):
        if mma and gpu.dev.info.cc < 80:
            continue
        gpu.k.prefill_mma = mma
        ld = (H + 2 * Hkv) * hd
        launch = gpu.k.attn_prefill(qkv.ptr, ld, k.ptr, v.ptr, row.ptr, pos.ptr, T, out.ptr, _Cfg(H, Hkv, hd))
        if gpu.k.prefill_bytes(hd) > gpu.dev.info.max_smem_optin:
            continue
        launch.kernel.allow_dynamic_smem(gpu.k.prefill_bytes(hd))
        us = timed(gpu, launch, reps=5)
        tflops = flop / (us * 1e-6) / 1e12
        share = 100 * tflops / PEAK_TFLOPS
        line += f" | {'mma' if mma else 'scalar'} {us:9.1f} us {tflops:6.1f} TFLOP/s ({share:4.1f}%)"
    gpu.k.prefill_mma = saved
    print(line)


def main():
    gpu = Gpu()
    rng = np.random.default_rng(0)
    print(f"prefill attention on {gpu.dev.info.name} (share of {PEAK_TFLOPS:.0f} TFLOP/s dense fp16):")
    for name, H, Hkv, hd in SHAPES:
        for T in (512, 2048):
            bench(gpu, rng, name, H, Hkv, hd, T)
    bench(gpu, rng, "Gemma3-270M", 4, 1, 256, 2048, window=512)  # the local layers' sliding window
    gpu.close()


if __name__ == "__main__":
    main()
