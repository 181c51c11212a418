"""`ingot verify --device`: the bundle's on-GPU self-test.

At pack time the CPU reference engine recorded the logits of a fixed prompt's last position (manifest
"selftest": the 32 largest logits with their ids, the argmax and the log-sum-exp). Here the GPU engine runs
the same tokens with the bundle's own kernels on this GPU and must agree: same argmax, top logits within a
relative L2 error of 1e-2 (the tolerance the GPU engine's tests hold it to), log-sum-exp within 0.05.
A GPU that loads the kernels but computes wrong numbers (a bad driver JIT, a miscompiled arch) fails here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ingot.toolchain.errors import UsageError, VerificationError

TOLERANCE = 1e-2
LSE_TOLERANCE = 0.05


def run_selftest(bundle_path: Path, *, gpu: int = 0, pubkey: Path | None = None) -> dict:
    from ingot.toolchain.bundle import open_bundle

    from .engines.cuda import CudaEngine
    from .model import load_model
    from .sampling import SamplingParams

    bundle = open_bundle(bundle_path, pubkey=pubkey)
    expected = bundle.manifest.get("selftest")
    if not expected:
        raise UsageError(f"{bundle_path} has no self-test record (packed with --no-selftest)",
                         hint="repack without --no-selftest to use `ingot verify --device`")
    model = load_model(bundle.model_path, offset=bundle.model_offset, size=bundle.model_size)
    tokens = [int(t) for t in expected["tokens"]]
    with CudaEngine(model, kernels=bundle.fatbins, gpu=gpu, max_seqs=1, max_ctx=len(tokens) + 8) as engine:
        seq = engine.new_sequence(SamplingParams())
        logits = engine.logits(seq, tokens)[-1].astype(np.float64)
        device = engine.dev.info.name
    ids = np.asarray(expected["top_ids"], dtype=np.int64)
    ref = np.asarray(expected["top_logits"], dtype=np.float64)
    err = float(np.linalg.norm(logits[ids] - ref) / np.linalg.norm(ref))
    peak = logits.max()
    lse = float(peak + np.log(np.exp(logits - peak).sum()))
    report = {"device": device, "tokens": len(tokens), "argmax": int(np.argmax(logits)),
              "expected_argmax": int(expected["argmax"]), "top_rel_err": err, "logsumexp": lse,
              "expected_logsumexp": float(expected["logsumexp"])}
    problems = []
    if report["argmax"] != report["expected_argmax"]:
        problems.append(f"argmax {report['argmax']} != {report['expected_argmax']} recorded by the CPU reference")
    if err >= TOLERANCE:
        problems.append(f"top-{len(ids)} logits differ by {err:.2e} (relative L2), more than {TOLERANCE}")
    if abs(lse - report["expected_logsumexp"]) >= LSE_TOLERANCE:
        problems.append(f"log-sum-exp {lse:.4f} vs {report['expected_logsumexp']:.4f}")
    if problems:
        raise VerificationError(f"on-GPU self-test failed on {device}: {'; '.join(problems)}",
                                hint="run `ingot check-compat` and `ingot doctor`; rebuild the kernels for this GPU")
    return report
