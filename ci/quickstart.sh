#!/usr/bin/env bash
# Ingot's main job, end to end, on the default model (SmolLM2-135M-Instruct Q4_1):
#   fetch the model -> build the kernels for every supported GPU (no GPU needed) -> pack a verifiable bundle
#   -> verify it -> check which GPUs/drivers it runs on -> generate text from it (on the GPU when one is
#   present, else on the CPU reference engine).
# Outputs go to $OUT (default dist/). Exit status: the first failing step's (see README, "Exit codes").
# Creates and fills ./.venv first when no environment is active (ci/env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/env.sh
OUT=${OUT:-dist}

model=$(ingot model fetch smollm2)
ingot build --out "$OUT/kernels"
ingot pack --model "$model" --kernels "$OUT/kernels" --name smollm2 --out "$OUT/smollm2.ingot"
ingot verify "$OUT/smollm2.ingot"
ingot check-compat "$OUT/smollm2.ingot" --gpu sm_80,sm_89,sm_90,sm_120 --driver 580.65.06
ingot run "$OUT/smollm2.ingot" -p "The capital of France is" -n 16
ingot run "$OUT/smollm2.ingot" --chat -p "What is 2+2?" -n 48
