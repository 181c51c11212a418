"""Where the GPU engine's rounding error comes from, and tolerances that follow from it.

The GPU has two kinds of decode path. Batches narrower than DECODE_GEMM_MIN_BATCH run the dp4a matrix-vector
kernels on q8x2 activations (two int8 levels: ~15 bits, products exact in integers), so their logits match the
fp32 CPU reference to ~1e-3. Wider batches (and prefill) run the tensor-core GEMMs, which read every weight and
every activation as fp16 (11 significant bits) with fp32 accumulation; the KV cache is fp16 on every path.
Those roundings are the design, not a bug, and how much they move the logits depends on the model: on SmolLM2
the wide path was seen at rel err 0.0113 against fp32 (issue 11), past the 1e-2 the fp32 comparison uses.

So the wide path is checked against what it should compute: the CPU reference with the same roundings applied
(every matmul operand rounded to fp16, accumulation in fp32, the KV cache stored as fp16). The GPU must match
that emulation far more closely than either matches fp32: the only differences left are accumulation order and
the rare element whose fp32 value lands on the other side of an fp16 rounding boundary. The fp32 distance of the
emulation itself is printed: it is the error the fp16 design costs on this model, which bounds what a fp32
comparison of the wide path can demand.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from tiny_models import write_model

from ingot.runtime import settings
from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.model import reference
from ingot.runtime.model.gguf import load_model
from ingot.runtime.sampling import SamplingParams

STEPS = 8
# GPU vs its fp16 emulation: fp32 accumulation in a different order (~1e-6 relative per dot product) plus
# elements rounded to the neighbouring fp16 value where GPU and CPU fp32 results straddle a rounding boundary
# (a fraction ~1e-3 of them, each off by one fp16 ulp = 2^-11 relative): well under 1e-3 after 30 layers.
TOL_EMULATED = 2e-3


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@contextmanager
def fp16_operands():
    """The CPU reference with the GPU GEMM path's roundings: matmul operands fp16, KV cache fp16."""
    rounded: dict[int, np.ndarray] = {}
    plain_linear, plain_empty = reference.linear, reference.KVCache.empty

    def linear(x, w):
        if id(w) not in rounded:
            rounded[id(w)] = w.astype(np.float16).astype(np.float32)
        return plain_linear(x.astype(np.float16).astype(np.float32), rounded[id(w)])

    def empty(c, capacity):
        shape = (c.n_layers, capacity, c.n_kv_heads, c.head_dim)
        return reference.KVCache(np.zeros(shape, np.float16), np.zeros(shape, np.float16))

    reference.linear, reference.KVCache.empty = linear, empty  # type: ignore[method-assign]
    try:
        yield
    finally:
        reference.linear, reference.KVCache.empty = plain_linear, plain_empty  # type: ignore[method-assign]


def _models() -> list:
    params = [pytest.param(("tiny", "llama"), id="tiny-llama")]
    for p in filter(None, (settings.TEST_MODELS.get() or "").split(":")):
        params.append(pytest.param(("file", p), id=Path(p).stem))
    return params


@pytest.fixture(scope="module", params=_models())
def model(request, tmp_path_factory):
    kind, what = request.param
    path = write_model(tmp_path_factory.mktemp("m") / f"{what}.gguf", what) if kind == "tiny" else Path(what)
    return load_model(path)


def test_wide_batch_decode_matches_its_fp16_emulation(model):
    from ingot.runtime.engines.cuda import CudaEngine

    B = settings.DECODE_GEMM_MIN_BATCH.get()
    prompts = [
        [int(t) for t in np.random.default_rng(300 + i).integers(2, model.config.n_vocab, 2 + 9 * i)] for i in range(B)
    ]
    gpu = CudaEngine(model, max_seqs=B, max_ctx=512)
    ref32 = CpuEngine(model, max_seqs=B, max_ctx=512)
    ref16 = CpuEngine(model, max_seqs=B, max_ctx=512)
    try:
        gs = [gpu.new_sequence(SamplingParams()) for _ in range(B)]
        cs = [ref32.new_sequence(SamplingParams()) for _ in range(B)]
        es = [ref16.new_sequence(SamplingParams()) for _ in range(B)]
        nxt = [int(np.argmax(ref32.logits(c, p)[-1])) for c, p in zip(cs, prompts, strict=True)]
        with fp16_operands():
            for e, p in zip(es, prompts, strict=True):
                ref16.logits(e, p)
        for g, p in zip(gs, prompts, strict=True):
            gpu.prefill(g, p)
        worst = {"gpu-fp16emu": 0.0, "gpu-fp32": 0.0, "fp16emu-fp32": 0.0}
        for step in range(STEPS):
            out = gpu.decode_logits(gs, nxt)
            for b in range(B):
                r32 = ref32.logits(cs[b], [nxt[b]])[-1]
                with fp16_operands():
                    r16 = ref16.logits(es[b], [nxt[b]])[-1]
                errs = {"gpu-fp16emu": rel_err(out[b], r16), "gpu-fp32": rel_err(out[b], r32),
                        "fp16emu-fp32": rel_err(r16, r32)}  # fmt: skip
                worst = {k: max(worst[k], v) for k, v in errs.items()}
                assert errs["gpu-fp16emu"] < TOL_EMULATED, f"step {step}, sequence {b}: {errs}"
                nxt[b] = int(np.argmax(r32))
        print(
            f"wide-batch decode (B={B}, {STEPS} steps), worst rel err: "
            + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
        )
    finally:
        gpu.close()


@pytest.mark.parametrize("n", (7, 128))
def test_prefill_logits_match_their_fp16_emulation(model, n):
    """Prefill runs the same fp16-operand GEMMs (without split-K), all rows' logits through the GEMM head."""
    from ingot.runtime.engines.cuda import CudaEngine

    tokens = [int(t) for t in np.random.default_rng(n).integers(2, model.config.n_vocab, n)]
    gpu = CudaEngine(model, max_seqs=1, max_ctx=512)
    try:
        out = gpu.logits(gpu.new_sequence(SamplingParams()), tokens)[-1]
    finally:
        gpu.close()
    r32 = CpuEngine(model, max_seqs=1, max_ctx=512)
    ref32 = r32.logits(r32.new_sequence(SamplingParams()), tokens)[-1]
    r16 = CpuEngine(model, max_seqs=1, max_ctx=512)
    with fp16_operands():
        ref16 = r16.logits(r16.new_sequence(SamplingParams()), tokens)[-1]
    errs = {"gpu-fp16emu": rel_err(out, ref16), "gpu-fp32": rel_err(out, ref32), "fp16emu-fp32": rel_err(ref16, ref32)}
    print(f"prefill {n}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert errs["gpu-fp16emu"] < TOL_EMULATED, errs
