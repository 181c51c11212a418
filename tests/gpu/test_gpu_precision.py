"""Where the GPU engine's rounding error comes from, and tolerances that follow from it.

The GPU has two kinds of decode path. Batches narrower than DECODE_GEMM_MIN_BATCH run the dp4a matrix-vector
kernels on q8x2 activations (two int8 levels: ~15 bits, products exact in integers), so their logits match the
fp32 CPU reference to ~1e-3. Wider batches (and prefill) run the tensor-core GEMMs, which read every weight and
every activation as fp16 (11 significant bits) with fp32 accumulation; the KV cache is fp16 on every path.
Those roundings are the design, not a bug, and how much they move the logits depends on the model: on SmolLM2
the wide path was seen at rel err 0.0113 against fp32 (issue 11), past the 1e-2 the fp32 comparison uses.

So the GEMM paths are checked against what their roundings cost: the CPU reference run again with every matmul
operand rounded to fp16 (accumulation in fp32) and the KV cache stored as fp16 gives, per step and sequence, the
distance d16 that fp16 operands alone put between a result and fp32. The GPU may be that far from fp32 twice
over (its rounding points are not exactly the emulation's: e.g. the activations it rounds come from its own
fp32 arithmetic) plus the 1e-3 the q8x2 paths are held to; a GEMM path further away than that loses precision
somewhere the design does not account for. Measured on the H200 with SmolLM2 (2026-12-01): fp16 emulation vs
fp32 up to 2.8e-3 (prefill of 7 tokens), the GPU's GEMM paths within the same range.

Decode over several steps is chaotic on real models: a value near an fp16 rounding boundary rounds one way on
the GPU and the other in the emulation, and the difference is carried on. So the wide-batch decode is judged on
its run, not sample by sample against the emulation's sample (numerics.fp16_run_failure), and against the
GPU's own q8x2 path from the same prefill, so that what it measures is the wide path's roundings and not the
prefill's (the tensor-core prefill attention rounds Q and P to fp16, which the emulation does not). On Gemma 3 the
split-K GEMM's atomic sums alone made two identical GPU runs differ by up to 1e-2 (v9): its partial sums are now
added in a fixed order, so a run is repeatable and what is left is the rounding, not the schedule.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from numerics import fp16_operands, fp16_run_failure, rel_err, within_fp16_budget
from tiny_models import write_model

from ingot.runtime import settings
from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.gpu.kernels import DECODE_GEMM_MIN_BATCH_SMALL
from ingot.runtime.model.gguf import load_model
from ingot.runtime.sampling import SamplingParams

STEPS = 8


def _models() -> list:
    params = [pytest.param(("tiny", "q4_1-gqa3"), id="q4_1-gqa3")]
    for p in filter(None, (settings.TEST_MODELS.get() or "").split(":")):
        params.append(pytest.param(("file", p), id=Path(p).stem))
    return params


@pytest.fixture(scope="module", params=_models())
def model(request, tmp_path_factory):
    kind, what = request.param
    path = write_model(tmp_path_factory.mktemp("m") / f"{what}.gguf", what) if kind == "tiny" else Path(what)
    return load_model(path)


def test_wide_batch_decode_is_within_its_fp16_budget(model, monkeypatch):
    """The wide path's own roundings, isolated: the same prompts prefilled by two GPU engines (identical kernels and
    inputs: bit-identical KV caches), then decoded by one through the tensor-core GEMMs (B >= GEMM_MIN_BATCH) and
    by the other through the q8x2 matrix-vector kernels; their distance, step by step, is judged against what fp16
    operands cost the CPU reference on the same samples (numerics.fp16_run_failure).

    Why not the wide path against fp32 directly (issue 11's failure, 9.94e-3 on SmolLM2 at step 3 of the sequence
    of 65 tokens): on the H200 (2026-12-02) that sample is as far from fp32 on the q8x2 path, 7.02e-3, which holds
    no fp16 GEMM at all; it is the prefill's tensor-core attention (fp16 Q and P) whose roundings this one
    sensitive sample amplifies (with INGOT_ATTN_PREFILL=scalar the q8x2 path is at 3.99e-3 there), and the fp16
    emulation has no such rounding. The wide path's distance from the q8x2 path there is 3.27e-3, within the
    budget of that sample's d16 (1.96e-3). The prefill attention is held to its own budget below."""
    from ingot.runtime.engines.cuda import CudaEngine

    wide = CudaEngine(
        model, max_seqs=max(DECODE_GEMM_MIN_BATCH_SMALL, settings.DECODE_GEMM_MIN_BATCH.get() or 0), max_ctx=512
    )
    B = wide.gemm_min_batch  # the narrowest batch this model's decode runs through the GEMMs
    prompts = [
        [int(t) for t in np.random.default_rng(300 + i).integers(2, model.config.n_vocab, 2 + 9 * i)] for i in range(B)
    ]
    monkeypatch.setenv("INGOT_DECODE_GEMM_MIN_BATCH", str(B + 1))
    narrow = CudaEngine(model, max_seqs=B, max_ctx=512)  # the same batch through the matrix-vector kernels
    monkeypatch.undo()
    ref32 = CpuEngine(model, max_seqs=B, max_ctx=512)
    ref16 = CpuEngine(model, max_seqs=B, max_ctx=512)
    try:
        ws = [wide.new_sequence(SamplingParams()) for _ in range(B)]
        ns = [narrow.new_sequence(SamplingParams()) for _ in range(B)]
        cs = [ref32.new_sequence(SamplingParams()) for _ in range(B)]
        es = [ref16.new_sequence(SamplingParams()) for _ in range(B)]
        nxt = [int(np.argmax(ref32.logits(c, p)[-1])) for c, p in zip(cs, prompts, strict=True)]
        with fp16_operands():
            for e, p in zip(es, prompts, strict=True):
                ref16.logits(e, p)
        for w, n, p in zip(ws, ns, prompts, strict=True):
            wide.prefill(w, p)
            narrow.prefill(n, p)
        keys = ("wide-narrow", "wide-fp32", "narrow-fp32", "fp16emu-fp32")
        worst = dict.fromkeys(keys, 0.0)
        gaps, d16s = [], []
        for _ in range(STEPS):
            out, base = wide.decode_logits(ws, nxt), narrow.decode_logits(ns, nxt)
            for b in range(B):
                r32 = ref32.logits(cs[b], [nxt[b]])[-1]
                with fp16_operands():
                    r16 = ref16.logits(es[b], [nxt[b]])[-1]
                errs = dict(zip(keys, (rel_err(out[b], base[b]), rel_err(out[b], r32), rel_err(base[b], r32),
                                       rel_err(r16, r32)), strict=True))  # fmt: skip
                worst = {k: max(worst[k], v) for k, v in errs.items()}
                gaps.append(errs["wide-narrow"])
                d16s.append(errs["fp16emu-fp32"])
                nxt[b] = int(np.argmax(r32))
        print(
            f"wide-batch decode (B={B}, {STEPS} steps), worst rel err: "
            + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
            + f"; mean wide-narrow {np.mean(gaps):.2e}, fp16emu-fp32 {np.mean(d16s):.2e}"
        )
        failure = fp16_run_failure(gaps, d16s)
        assert failure is None, f"{failure} (samples in step-major order, {B} sequences a step)"
    finally:
        wide.close()
        narrow.close()


@pytest.mark.parametrize("n", (7, 128))
def test_prefill_logits_are_within_their_fp16_budget(model, n):
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
    assert within_fp16_budget(errs), errs
