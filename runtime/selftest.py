"""The bundle self-test, recorded and checked here and nowhere else.

At pack time (`record`) the CPU reference engine computes the logits of a fixed prompt's last position and
the manifest keeps them ("selftest": the 32 largest logits with their ids, the argmax and the log-sum-exp).
`ingot verify --device` (`run_selftest`) runs the same tokens on the GPU engine with the bundle's own kernels
and must agree: same argmax, top logits within a relative L2 error of 1e-2 (the tolerance the GPU engine's
tests hold it to), log-sum-exp within 0.05. A GPU that loads the kernels but computes wrong numbers (a bad
driver JIT, a miscompiled arch) fails here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ingot.runtime.bundle.open import open_bundle
from ingot.runtime.engines.cpu import CpuEngine
from ingot.runtime.errors import ModelError, UsageError, VerificationError
from ingot.runtime.model.gguf import load_model
from ingot.runtime.model.tokenizer import Tokenizer
from ingot.runtime.sampling import SamplingParams

PROMPT = "The capital of France is"
TOP_K = 32
# Logits are rounded so BLAS summation-order noise across machines does not change the bundle's bytes;
# the GPU self-test's tolerance is far looser than this.
DECIMALS = 4
TOLERANCE = 1e-2
LSE_TOLERANCE = 0.05


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of a float64 row, computed stably."""
    peak = logits.max()
    return float(peak + np.log(np.exp(logits - peak).sum()))


def record(path: Path) -> dict:
    """The CPU reference's logits at the last position of PROMPT, for the manifest's "selftest"."""
    try:
        model = load_model(path)
        ids = [int(t) for t in Tokenizer.from_model(model).encode(PROMPT)]
        engine = CpuEngine(model)
        seq = engine.new_sequence(SamplingParams())
        try:
            logits = np.asarray(engine.logits(seq, ids), dtype=np.float64)[-1]  # [n_vocab]
        finally:
            engine.release(seq)
    except ModelError as e:
        raise ModelError(
            f"self-test: {e.message}", hint="pass --no-selftest to pack a model the CPU engine cannot run"
        ) from None
    if not np.isfinite(logits).all():
        raise ModelError(
            f"self-test: {path} gives NaN or infinite logits (its weights hold NaN/inf values)",
            hint="re-convert the model; pass --no-selftest to pack it anyway",
        )
    top = np.lexsort((np.arange(len(logits)), -logits))[:TOP_K]  # by value, ties by id
    return {
        "prompt": PROMPT,
        "tokens": ids,
        "position": len(ids) - 1,
        "n_vocab": len(logits),
        "engine": "cpu",
        "decimals": DECIMALS,
        "argmax": int(top[0]),
        "top_ids": [int(i) for i in top],
        "top_logits": [round(float(logits[i]), DECIMALS) for i in top],
        "logsumexp": round(logsumexp(logits), DECIMALS),
    }


def run_selftest(bundle_path: Path, *, gpu: int = 0, pubkey: Path | None = None) -> dict:
    """Verify the bundle, run its recorded prompt on this GPU with its own kernels, compare; VerificationError
    (exit 4) naming every disagreement."""
    # deferred: cuda-bindings is heavy, and `record` (pack, on a machine without a GPU) must not need it
    from ingot.runtime.engines.cuda import CudaEngine

    bundle = open_bundle(bundle_path, pubkey=pubkey)
    expected = bundle.manifest.get("selftest")
    if not expected:
        raise UsageError(
            f"{bundle_path} has no self-test record (packed with --no-selftest)",
            hint="repack without --no-selftest to use `ingot verify --device`",
        )
    with bundle:  # mapped from the verified descriptor, never by path again
        model = load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size, file=bundle.file)
    tokens = [int(t) for t in expected["tokens"]]
    with CudaEngine(model, kernels=bundle.fatbins, gpu=gpu, max_seqs=1, max_ctx=len(tokens) + 8) as engine:
        seq = engine.new_sequence(SamplingParams())
        logits = engine.logits(seq, tokens)[-1].astype(np.float64)
        device = engine.dev.info.name
    ids = np.asarray(expected["top_ids"], dtype=np.int64)
    ref = np.asarray(expected["top_logits"], dtype=np.float64)
    err = float(np.linalg.norm(logits[ids] - ref) / np.linalg.norm(ref))
    lse = logsumexp(logits)
    report = {
        "device": device,
        "tokens": len(tokens),
        "argmax": int(np.argmax(logits)),
        "expected_argmax": int(expected["argmax"]),
        "top_rel_err": err,
        "logsumexp": lse,
        "expected_logsumexp": float(expected["logsumexp"]),
    }
    problems = []
    if report["argmax"] != report["expected_argmax"]:
        problems.append(f"argmax {report['argmax']} != {report['expected_argmax']} recorded by the CPU reference")
    if err >= TOLERANCE:
        problems.append(f"top-{len(ids)} logits differ by {err:.2e} (relative L2), more than {TOLERANCE}")
    if abs(lse - report["expected_logsumexp"]) >= LSE_TOLERANCE:
        problems.append(f"log-sum-exp {lse:.4f} vs {report['expected_logsumexp']:.4f}")
    if problems:
        raise VerificationError(
            f"on-GPU self-test failed on {device}: {'; '.join(problems)}",
            hint="run `ingot check-compat` and `ingot doctor`; rebuild the kernels for this GPU",
        )
    return report
