"""Where a decode step's critical path goes: each kernel's start and end inside the replayed step, from CUPTI.

    python3 tests/gpu/step_timeline.py MODEL.gguf [--batch B] [--steps N] [--window FIRST COUNT]

step_profile.py times each kernel alone; this one times them where they run, in one CUDA graph of N decode steps
back to back (the engine's own launch list, PDL edges and all), traced by PyTorch's profiler (CUPTI's kernel
records; PyTorch is a tool on the device machine here, never part of the runtime). For each kernel of a step:
  span  its own start to end (first block placed to last block done),
  gap   its start after the end of the kernel before it (negative: placed early under PDL, overlapping it),
  adds  its end after the end of the kernel before it: what it adds to the step's critical path.
The adds of a step sum to the step. Per kernel name the means over the middle steps are printed, then launch by
launch for a window of the step (`--window FIRST COUNT`: at batch 1 a Llama-style layer is six launches from
#2, the embedding and the first norm before). CUPTI's own cost per record is in these figures, so the traced
step is printed beside the untraced replay of the same graph (on an H100 they agreed within 0.4%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from ingot.runtime.engines.cuda import CudaEngine
from ingot.runtime.gpu.driver import Copy, Event, Graph, Memset

sys.path.insert(0, str(Path(__file__).parent))
from step_profile import engine_after_a_step  # noqa: E402  (the same engine state step_profile.py times)


def kernel_records(trace: Path) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every kernel in a Chrome trace written by torch.profiler, by start."""
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    return sorted(((e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels), key=lambda k: k[1])


def timeline(eng: CudaEngine, launches: list, steps: int, title: str, window: tuple[int, int] = (0, 0)) -> None:
    kernels = [launch for launch in launches if not isinstance(launch, Memset | Copy)]
    names = [launch.kernel.name for launch in kernels]
    graph = Graph(eng.stream, lambda: [launch(eng.stream) for _ in range(steps) for launch in launches])
    graph.launch(eng.stream)
    eng.stream.synchronize()
    start, end = Event(), Event()
    start.record(eng.stream)
    graph.launch(eng.stream)
    end.record(eng.stream)
    end.synchronize()
    untraced = end.elapsed_ms(start) * 1000 / steps
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            graph.launch(eng.stream)
            eng.stream.synchronize()
        prof.export_chrome_trace(str(trace))
        records = kernel_records(trace)
    graph.close()
    n = len(names)
    if len(records) != n * steps or [r[0] for r in records[:n]] != names:
        sys.exit(f"{title}: the trace holds {len(records)} kernels, not {steps} steps of the {n} launched")
    # rows[i]: (span, gap, adds) of launch i in each middle step (the first and last quarter left out: ramp, drain)
    rows: list[list[tuple[float, float, float]]] = [[] for _ in range(n)]
    totals = []
    middle = range(max(1, steps // 4), steps - max(1, steps // 4))
    for s in middle:
        prev_end = records[s * n - 1][2]
        totals.append(records[(s + 1) * n - 1][2] - prev_end)
        for i, (_, t0, t1) in enumerate(records[s * n : (s + 1) * n]):
            rows[i].append((t1 - t0, t0 - prev_end, t1 - prev_end))
            prev_end = t1
    total = statistics.fmean(totals)
    print(f"\n{title}: {n} kernels a step; traced step {total:,.1f} us (untraced replay {untraced:,.1f} us)")
    print(f"{'kernel':<28} {'n':>4} {'span':>7} {'gap':>7} {'adds':>7} {'adds total':>11} {'share':>6}")
    by_name: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for name, r in zip(names, rows, strict=True):
        by_name[name] += r
    k = len(middle)
    for name, r in sorted(by_name.items(), key=lambda kv: -sum(a for _, _, a in kv[1])):
        span, gap, adds = (statistics.fmean(col) for col in zip(*r, strict=True))
        print(f"{name:<28} {len(r) // k:>4} {span:>7.2f} {gap:>7.2f} {adds:>7.2f} {adds * len(r) / k:>11,.1f} ", end="")
        print(f"{adds * len(r) / k / total:>6.1%}")
    for i in range(window[0], min(n, window[0] + window[1])):
        g, (span, _, adds) = kernels[i].grid, (statistics.fmean(col) for col in zip(*rows[i], strict=True))
        print(f"  #{i:<4} {names[i]:<26} grid {g[0]}x{g[1]}x{g[2]:<4} span {span:7.2f} adds {adds:7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--window", type=int, nargs=2, default=(8, 6), metavar=("FIRST", "COUNT"))
    a = ap.parse_args()
    torch.cuda.init()  # CUPTI traces the kernels of every context of the process; the engine's is the primary one
    eng = engine_after_a_step(a.model, a.batch)
    timeline(eng, eng._decode_launches(a.batch), a.steps, f"decode step, batch {a.batch}", tuple(a.window))
    eng.close()


if __name__ == "__main__":
    main()
