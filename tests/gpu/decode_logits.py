"""The logits of a few greedy decode steps, saved or compared: the bit-for-bit check of a kernel change on a real
engine and model (cuda/PERF.md: "logits identical").

    python3 tests/gpu/decode_logits.py save MODEL.gguf OUT.npy [--batch B] [--steps N]
    python3 tests/gpu/decode_logits.py compare A.npy B.npy

`save` prefills B sequences with the same random prompts every run (48 tokens, seed 0), then decodes N steps,
each sequence taking its own argmax, and writes the logits [N, B, n_vocab] fp32. Run it twice with the setting or
the build under test flipped (INGOT_KERNELS, INGOT_MATVEC_STAGED, ...), then `compare`: exit 0 when identical,
1 when not (the largest difference and whether every step's argmax agrees are printed either way).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ingot.runtime.engines.cuda import CudaEngine
from ingot.runtime.model.gguf import load_model
from ingot.runtime.sampling import SamplingParams

PROMPT = 48


def save(model_path: str, out: str, batch: int, steps: int) -> None:
    model = load_model(model_path)
    eng = CudaEngine(model, max_seqs=batch, max_ctx=PROMPT + steps + 16)
    try:
        rng = np.random.default_rng(0)
        seqs = [eng.new_sequence(SamplingParams()) for _ in range(batch)]
        nxt = [eng.prefill(s, [int(t) for t in rng.integers(2, model.config.n_vocab, PROMPT)]) for s in seqs]
        rows = []
        for _ in range(steps):
            logits = eng.decode_logits(seqs, nxt)
            rows.append(logits)
            nxt = [int(t) for t in logits.argmax(axis=1)]
    finally:
        eng.close()
    logits = np.stack(rows)
    np.save(out, logits)
    print(f"saved {out}: {logits.shape}")


def compare(a_path: str, b_path: str) -> int:
    a, b = np.load(a_path), np.load(b_path)
    if a.shape != b.shape:
        print(f"{a_path} {a.shape} and {b_path} {b.shape}: different shapes")
        return 1
    same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
    diff = float(np.abs(a - b).max())
    argmax = np.array_equal(a.argmax(-1), b.argmax(-1))
    print(f"{a_path} vs {b_path}: identical={same} max |diff|={diff:.3g} argmax equal={argmax}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("model")
    s.add_argument("out")
    s.add_argument("--batch", type=int, default=1)
    s.add_argument("--steps", type=int, default=6)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.model, args.out, args.batch, args.steps)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
