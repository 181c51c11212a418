"""Where a decode step's (or a prefill chunk's) time goes, kernel by kernel, on a real engine and model.

    python3 tests/gpu/step_profile.py MODEL.gguf [--batch B] [--prefill T]

The engine builds its launch list as it would for the CUDA graph; each launch is then captured alone, `reps`
times back to back, in a graph and timed with events (median of 5 replays): its device time without Python in
the way. The per-kernel sums are compared with the whole step's graph replay, so the gap between them (launch
latency between dependent kernels, which no single kernel shows) is visible too. Inputs are whatever the engine
holds after a short prefill; kernels run repeatedly on the same state (a residual add accumulates), which
changes no timing that matters here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from ingot.runtime.engines.cuda import CudaEngine
from ingot.runtime.gpu.driver import Copy, Memset
from ingot.runtime.model.gguf import load_model
from ingot.runtime.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from kernel_bench import graph_time_us  # noqa: E402  (the one graph-replay timer of the kernel lab)


def name_of(launch) -> str:
    if isinstance(launch, Memset | Copy):
        return type(launch).__name__.lower()
    return launch.kernel.name


def profile(eng: CudaEngine, launches: list, title: str, reps: int) -> None:
    per: dict[str, list[float]] = defaultdict(list)
    for launch in launches:
        per[name_of(launch)].append(graph_time_us(eng.stream, [launch], reps))
    whole = graph_time_us(eng.stream, launches, max(1, reps // 10))
    total = sum(sum(v) for v in per.values())
    print(f"\n{title}: {len(launches)} launches, graph replay {whole:,.1f} us, sum of kernels alone {total:,.1f} us")
    print(f"{'kernel':<28} {'n':>4} {'us total':>10} {'us each':>9} {'share':>6}")
    for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1])):
        print(f"{name:<28} {len(ts):>4} {sum(ts):>10,.1f} {statistics.fmean(ts):>9,.1f} {sum(ts) / whole:>6.1%}")


def engine_after_a_step(path: str, batch: int) -> CudaEngine:
    """A GPU engine on the model at `path` whose buffers hold a real decode step's state: `batch` sequences
    prefilled with the same 64 random tokens every run (seed 0), then one decode step built and run."""
    model = load_model(path)
    eng = CudaEngine(model, max_seqs=batch, max_ctx=2048)
    rng = np.random.default_rng(0)
    seqs = [eng.new_sequence(SamplingParams()) for _ in range(batch)]
    nxt = [eng.prefill(s, [int(t) for t in rng.integers(2, model.config.n_vocab, 64)]) for s in seqs]
    eng.decode(seqs, nxt)
    return eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0, help="also profile a prefill chunk of this many tokens")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    eng = engine_after_a_step(a.model, a.batch)
    profile(eng, eng._decode_launches(a.batch), f"decode step, batch {a.batch}", a.reps)
    if a.prefill:
        plan = eng._plan(((a.prefill, True),), False).launches
        profile(eng, plan, f"prefill chunk of {a.prefill} tokens", max(2, a.reps // 10))
    eng.close()


if __name__ == "__main__":
    main()
