"""Kernel lab: device time of each decode-step kernel at real model shapes, against the bytes it must move.

    python3 tests/gpu/kernel_bench.py            # needs a GPU; INGOT_KERNELS may point at a build of cuda/
    python3 tests/gpu/kernel_bench.py --pdl [M.gguf]   # decode step with INGOT_PDL=0 vs 1 (default: a random
                                                       # SmolLM2-135M-shaped Q4_1 model)
    python3 tests/gpu/kernel_bench.py --gemm     # only the GEMM rows (both kernel families, 8B shapes)

Each kernel is captured in a CUDA graph of `reps` back-to-back launches and timed with events (median of 5
graph replays), so launch gaps of the real decode graph are included but Python overhead is not. Inputs are
random; weight matrices are generated directly in the GPU layout (the repack kernels are tested elsewhere).
GB/s counts the weight bytes each launch must read once; the decode step is bound by this number.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from conftest import Gpu  # noqa: E402

from ingot.runtime.engines.cuda_weights import _alloc_matrix  # noqa: E402
from ingot.runtime.gpu import constants as C  # noqa: E402
from ingot.runtime.gpu.driver import Event, Graph  # noqa: E402
from ingot.runtime.gpu.kernels import LAYOUTS  # noqa: E402

# bytes each weight costs in the soa-v2 layout (what a decode step must read)
BYTES_PER_WEIGHT = {q: sum(n for _, n in fields) / 256 for q, fields in LAYOUTS.items()}


def graph_time_us(stream, work: list, reps: int) -> float:
    """Median microseconds of one repetition of `work` (launches), from 5 replays of a graph of `reps` of them."""
    graph = Graph(stream, lambda: [launch(stream) for _ in range(reps) for launch in work])
    graph.launch(stream)
    start, end = Event(), Event()
    times = []
    for _ in range(5):
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(end.elapsed_ms(start) * 1000 / reps)
    graph.close()
    return statistics.median(times)


def timed(gpu: Gpu, launch, reps: int = 20) -> float:
    """Median microseconds per launch (or per list of launches: the sampler's are one or two)."""
    return graph_time_us(gpu.stream, launch if isinstance(launch, list) else [launch], reps)


def random_matrix(gpu: Gpu, rng, qtype: str, rows: int, cols: int):
    W = _alloc_matrix(gpu.pool, qtype, rows, cols, "w")
    for buf in W.args():
        if buf is not None:
            raw = rng.integers(0, 256, size=buf.nbytes, dtype=np.uint8)
            if buf is W.d or buf is W.m or buf is W.w:
                raw = (rng.standard_normal(buf.nbytes // 2) * 0.01).astype(np.float16).view(np.uint8)
            gpu.stream.upload(buf.ptr, raw)
    gpu.stream.synchronize()
    return W


def matvec_row(gpu, rng, name, qtype, rows, cols, B=1, mode=C.MODE_STORE, b1=True):
    """b1=False: at B=1, the any-column kernel instead of matvec_<type>_b1 (INGOT_MATVEC_B1=0)."""
    os.environ["INGOT_MATVEC_B1"] = "1" if b1 else "0"
    W = random_matrix(gpu, rng, qtype, rows, cols)
    out_rows = rows // 2 if mode == C.MODE_SWIGLU else rows
    y = gpu.empty(4 * B * out_rows, 0)
    if W.quantized:
        x = (
            gpu.empty(2 * B * cols, 1).ptr,
            gpu.put(np.tile([0.01, 0.0001, 0.0, 0.0], B * cols // 32).astype(np.float32)).ptr,
        )
    else:
        x = gpu.put(rng.standard_normal(B * cols).astype(np.float32)).ptr
    launches = gpu.k.matvec(W, x, y.ptr, B, ldy=out_rows, mode=mode)
    us = timed(gpu, lambda stream: [launch(stream) for launch in launches])
    gb = rows * cols * BYTES_PER_WEIGHT[qtype] / 1e9
    kernel = launches[0].kernel.name
    print(f"{name:<34} {qtype:<5} B={B:<3} {us:9.1f} us  {gb / (us * 1e-6):7.0f} GB/s  {kernel}")
    os.environ.pop("INGOT_MATVEC_B1")
    return us


def matmul_row(gpu, rng, name, qtype, rows, cols, M, kind="mma"):
    """kind: "mma" (the pipelined kernels, compute capability >= 8.0: Q4_0/Q4_1 matmul2r_*, else matmul2_*),
    "mma-tile" (matmul2_* for every type) or "wmma" (v9's matmul_*), as INGOT_MATMUL picks them; split-K at
    M <= 64 as the engine's wide decode (prefill runs without)."""
    saved = gpu.k.matmul_mma, gpu.k.matmul_frag
    gpu.k.matmul_mma = kind != "wmma" and gpu.dev.info.cc >= 80
    gpu.k.matmul_frag = kind == "mma"
    W = random_matrix(gpu, rng, qtype, rows, cols)
    A = gpu.put((rng.standard_normal(M * cols) * 0.1).astype(np.float16))
    C = gpu.empty(4 * M * rows, 0)
    steps = gpu.k.matmul(W, A.ptr, C.ptr, M, ldc=rows, split_k=gpu.split_k if M <= 64 else None)
    gpu.k.matmul_mma, gpu.k.matmul_frag = saved
    us = timed(gpu, lambda stream: [step(stream) for step in steps], reps=5)
    tflops = 2 * M * rows * cols / (us * 1e-6) / 1e12
    gb = rows * cols * BYTES_PER_WEIGHT[qtype] / 1e9
    grid = "x".join(str(g) for g in steps[0].grid)
    print(
        f"{name:<34} {qtype:<5} M={M:<3} {us:9.1f} us  {gb / (us * 1e-6):7.0f} GB/s {tflops:6.1f} TFLOP/s  "
        f"{steps[0].kernel.name} grid {grid}"
    )
    return us


def small_kernels(gpu, rng, name, D, H, Hkv, hd, V, ctx):
    """The per-token kernels that are not weight-bound: norm, attention at `ctx`, quantize, greedy sampling."""

    class Cfg:
        n_heads, n_kv_heads, head_dim, rope_dim, rope_neox = H, Hkv, hd, hd, False

    x, w = gpu.put(rng.standard_normal(D).astype(np.float32)), gpu.put(np.ones(D, np.float32))
    xq, xd = gpu.empty(2 * 8192), gpu.empty(16 * 8192 // 32)
    norm = timed(gpu, gpu.k.rmsnorm(x.ptr, w, 1, D, 1e-5, yq=xq, yd=xd))
    pages = (ctx + C.PAGE) // C.PAGE
    kc = gpu.put((rng.standard_normal(pages * Hkv * C.PAGE * hd) * 0.1).astype(np.float16))
    vc = gpu.put((rng.standard_normal(pages * Hkv * C.PAGE * hd) * 0.1).astype(np.float16))
    qkv = gpu.put(rng.standard_normal((H + 2 * Hkv) * hd).astype(np.float32))
    angle = np.arange(ctx + 1)[:, None] * (10000.0 ** (-np.arange(0, hd, 2) / hd))[None, :]
    rope = gpu.put(np.stack([np.cos(angle), np.sin(angle)], -1).astype(np.float32))
    splits = gpu.k.attn_decode_splits(1, Cfg)
    att = gpu.k.attn_decode(
        qkv.ptr,
        rope,
        kc.ptr,
        vc.ptr,
        gpu.put(np.arange(pages, dtype=np.int32)).ptr,
        pages,
        gpu.put(np.array([ctx], np.int32)).ptr,
        gpu.empty(4 * H * splits * hd).ptr,
        gpu.empty(8 * H * splits).ptr,
        gpu.empty(4 * Hkv, 0).ptr,
        gpu.empty(4 * H * hd).ptr,
        1,
        splits,
        Cfg,
        outq=xq.ptr,
        outd=xd.ptr,
    )
    attn = timed(gpu, att)
    quant = timed(gpu, gpu.k.quantize(gpu.empty(4 * 8192, 0).ptr, xq.ptr, xd.ptr, 8192))
    logits = gpu.put(rng.standard_normal(V).astype(np.float32))
    zeros = lambda dt: gpu.put(np.zeros(1, dt)).ptr  # noqa: E731
    p = {
        "temperature": zeros(np.float32),
        "top_k": zeros(np.int32),
        "top_p": gpu.put(np.ones(1, np.float32)).ptr,
        "min_p": zeros(np.float32),
        "penalty": gpu.put(np.ones(1, np.float32)).ptr,
        "hist": zeros(np.int32),
        "hist_len": zeros(np.int32),
        "hist_cap": 1,
        "seed": zeros(np.uint64),
        "counter": zeros(np.int32),
    }
    samp = timed(gpu, gpu.k.sample(logits.ptr, V, V, 1, p, gpu.empty(4).ptr))
    print(
        f"{name}: rmsnorm {norm:.1f} us, attention@{ctx} ({splits} splits) {attn:.1f} us, quantize {quant:.1f} us, "
        f"greedy sample {samp:.1f} us"
    )


def engine_step(path: str) -> tuple[float, int]:
    """Device time of one whole decode-step graph (B=1) vs the wall time of engine.decode: the host's share."""
    import time

    from ingot.runtime.engines.cuda import CudaEngine
    from ingot.runtime.model.gguf import load_model
    from ingot.runtime.sampling import SamplingParams

    eng = CudaEngine(load_model(path), max_seqs=1, max_ctx=512)
    s = eng.new_sequence(SamplingParams())
    tok = eng.prefill(s, [1, 2, 3])
    for _ in range(3):
        tok = eng.decode([s], [tok])[0]
    graph = eng._graphs[1]
    start, end = Event(), Event()
    start.record(eng.stream)
    for _ in range(50):
        graph.launch(eng.stream)
    end.record(eng.stream)
    end.synchronize()
    gpu_ms = end.elapsed_ms(start) / 50
    t0 = time.perf_counter()
    for _ in range(50):
        tok = eng.decode([s], [tok])[0]
    wall_ms = (time.perf_counter() - t0) * 1000 / 50
    n = len(eng._decode_launches(1))
    pdl = "on" if eng.k.k["rmsnorm_f32"].pdl else "off"
    print(
        f"{Path(path).name}: decode step B=1 (PDL {pdl}): device {gpu_ms:.3f} ms, engine.decode wall {wall_ms:.3f} ms "
        f"({n} kernels)"
    )
    eng.close()
    return gpu_ms * 1000, n


def pdl_ab(path: str | None) -> None:
    """The whole decode step (B=1) with programmatic dependent launch off and on: device time of the graph replay
    and engine.decode's wall time, so one device call reads the gain per step and per kernel boundary."""
    import os
    import tempfile

    from ingot.runtime.model.synth import synthesize

    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            path = str(synthesize("smollm2-135m", "Q4_1", Path(tmp) / "smollm2-shape.gguf"))
        rows = {}
        for flag in ("0", "1"):
            os.environ["INGOT_PDL"] = flag  # read when the engine loads its kernels (runtime/gpu/kernels.py)
            rows[flag] = engine_step(path)
        os.environ.pop("INGOT_PDL")
    (off, n), (on, _) = rows["0"], rows["1"]
    print(f"PDL: {off:.1f} -> {on:.1f} us per step ({off - on:+.1f}), {(off - on) / max(n - 1, 1):.2f} us per boundary")


def gemm_rows(gpu, rng):
    print("GEMMs (prefill and wide decode), each family (INGOT_MATMUL=mma: v17's; mma-tile: v16's; wmma: v9's):")
    for M in (16, 64, 512):
        for kind in ("mma", "mma-tile", "wmma"):
            matmul_row(gpu, rng, "8B qkv 6144x4096", "Q4_0", 6144, 4096, M, kind)
            matmul_row(gpu, rng, "8B o 4096x4096", "Q4_0", 4096, 4096, M, kind)
            matmul_row(gpu, rng, "8B gate+up 28672x4096", "Q4_0", 28672, 4096, M, kind)
            matmul_row(gpu, rng, "8B down 4096x14336", "Q4_0", 4096, 14336, M, kind)
            matmul_row(gpu, rng, "8B gate+up 28672x4096", "Q4_K", 28672, 4096, M, kind)
            matmul_row(gpu, rng, "8B down 4096x14336", "Q6_K", 4096, 14336, M, kind)
            matmul_row(gpu, rng, "8B gate+up 28672x4096", "Q8_0", 28672, 4096, M, kind)
            matmul_row(gpu, rng, "8B gate+up 28672x4096", "F16", 28672, 4096, M, kind)
    for M in (16, 64):
        for kind in ("mma", "mma-tile", "wmma"):
            matmul_row(gpu, rng, "smol gate+up 3072x576", "Q4_1", 3072, 576, M, kind)


def main():
    if sys.argv[1:2] == ["--pdl"]:
        pdl_ab(sys.argv[2] if len(sys.argv) > 2 else None)
        return
    gemm_only = sys.argv[1:2] == ["--gemm"]
    if len(sys.argv) > 1 and not gemm_only:
        for path in sys.argv[1:]:
            engine_step(path)
    gpu = Gpu()
    rng = np.random.default_rng(0)
    if gemm_only:
        gemm_rows(gpu, rng)
        gpu.close()
        return
    small_kernels(gpu, rng, "8B", 4096, 32, 8, 128, 128256, 128)
    small_kernels(gpu, rng, "SmolLM2", 576, 9, 3, 64, 49152, 128)
    print("8B-shaped decode (Q4_0), per layer x32:")
    matvec_row(gpu, rng, "qkv 6144x4096", "Q4_0", 6144, 4096)
    matvec_row(gpu, rng, "o 4096x4096", "Q4_0", 4096, 4096)
    matvec_row(gpu, rng, "gate+up 28672x4096 (swiglu)", "Q4_0", 28672, 4096, mode=C.MODE_SWIGLU)
    matvec_row(gpu, rng, "down 4096x14336", "Q4_0", 4096, 14336)
    matvec_row(gpu, rng, "head 128256x4096", "Q4_0", 128256, 4096)
    matvec_row(gpu, rng, "gate+up B=4", "Q4_0", 28672, 4096, B=4, mode=C.MODE_SWIGLU)
    print("8B-shaped decode, the Q4_K_M types (Q4_K, Q6_K for half of down and of v) vs Q4_0 above:")
    matvec_row(gpu, rng, "qkv 6144x4096", "Q4_K", 6144, 4096)
    matvec_row(gpu, rng, "o 4096x4096", "Q4_K", 4096, 4096)
    matvec_row(gpu, rng, "gate+up 28672x4096 (swiglu)", "Q4_K", 28672, 4096, mode=C.MODE_SWIGLU)
    matvec_row(gpu, rng, "down 4096x14336", "Q4_K", 4096, 14336)
    matvec_row(gpu, rng, "down 4096x14336", "Q6_K", 4096, 14336)
    matvec_row(gpu, rng, "head 128256x4096", "Q6_K", 128256, 4096)
    print("the same at B=1 with the any-column kernels (INGOT_MATVEC_B1=0: v7's occupancy):")
    for qtype, rows, cols, mode in (
        ("Q4_0", 28672, 4096, C.MODE_SWIGLU),
        ("Q4_K", 28672, 4096, C.MODE_SWIGLU),
        ("Q4_K", 6144, 4096, C.MODE_STORE),
        ("Q6_K", 4096, 14336, C.MODE_STORE),
        ("Q6_K", 128256, 4096, C.MODE_STORE),
        ("Q5_0", 28672, 4096, C.MODE_SWIGLU),
    ):
        matvec_row(gpu, rng, f"{rows}x{cols}", qtype, rows, cols, mode=mode, b1=False)
    for qtype in ("Q5_0", "Q5_1", "Q5_K", "Q3_K", "Q2_K"):
        matvec_row(gpu, rng, "gate+up 28672x4096 (swiglu)", qtype, 28672, 4096, mode=C.MODE_SWIGLU)
    print("SmolLM2-shaped decode (Q4_1), per layer x30:")
    matvec_row(gpu, rng, "qkv 960x576", "Q4_1", 960, 576)
    matvec_row(gpu, rng, "o 576x576", "Q4_1", 576, 576)
    matvec_row(gpu, rng, "gate+up 3072x576 (swiglu)", "Q4_1", 3072, 576, mode=C.MODE_SWIGLU)
    matvec_row(gpu, rng, "down 576x1536", "Q4_1", 576, 1536)
    matvec_row(gpu, rng, "head 49152x576 (Q8_0 tied)", "Q8_0", 49152, 576)
    gemm_rows(gpu, rng)
    gpu.close()


if __name__ == "__main__":
    main()
