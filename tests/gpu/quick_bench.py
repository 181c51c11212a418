"""Device-session helper: engine benchmarks on one GGUF without the CLI (python3 tests/gpu/quick_bench.py M.gguf)."""

import json
import sys
import time

from ingot.runtime.bench import run_benchmarks
from ingot.runtime.engines.cuda import CudaEngine
from ingot.runtime.model.gguf import load_model

path = sys.argv[1]
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,4,16,64").split(",")]
t0 = time.perf_counter()
model = load_model(path)
eng = CudaEngine(model, max_seqs=max(batches), max_ctx=1024)
print(f"engine up in {time.perf_counter() - t0:.2f} s", flush=True)
rep = run_benchmarks(eng, n_prompts=(512,), n_gen=128, reps=3, batches=batches)
for r in rep["results"]:
    print(f"{r['test']:>14}: {r['tok_s_mean']:10.1f} ± {r['tok_s_std']:7.1f} tok/s  ({r['ms_mean']:.2f} ms/rep)")
print(json.dumps(rep.get("gpu")))
eng.close()
