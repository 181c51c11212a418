#!/usr/bin/env bash
# The H200 acceptance runs of issues 10-12 as device calls, planned for the `device` tool's limits: 64 MiB of
# working tree + carried paths per call, the machine given back 30 s after a call ends (so the calls go back to
# back), at most 10 minutes a call and 30 minutes of device time a session.
#
# Here (the CPU machine), once:
#     bash tests/gpu/acceptance.sh prepare
# downloads into .whl/ the wheels the device image lacks (its package list: the device README's KINDS.md) and
# splits the cached Gemma 3 270M (`ingot model fetch gemma3-270m`) into .m/ parts that fit a call beside .whl/.
# It prints the calls to make, in order; each is `run` with command `bash tests/gpu/acceptance.sh N` and the
# carry list it names. Parts accumulate in /tmp/m on the device while the machine stays warm; a call that
# finds a fresh machine (a gap over 30 s) must start again from stage 1.
#
# On the device, stage by stage (logs under $OUT):
#   1  wheels + build (device_env.sh); every tests/gpu test on the synthetic models (xdist, 6 workers)
#   2  synthetic llama3-8b Q4_0 and Q4_K_M: ingot bench (batch 1,4,16,64 for Q4_0), and with INGOT_PDL=0
#   3  tests/gpu/test_gpu_serve_load.py: HTTP vs engine figures, TTFT, interference, prefix cache, hot swap
#   4  (a model part only)
#   5  Gemma 3 complete, sha256 checked: the engine and precision tests on it (INGOT_TEST_MODELS), and its
#      prefill/decode tests again with INGOT_ATTN_PREFILL=scalar (the A/B of the prefill attention)
#   6  Gemma 3: ingot bench (pp512/tg128, depth 0 and 4096) with each prefill attention kernel; pack, verify
#      --device, run
#   7  Gemma 3: the transformers oracle (INGOT_TEST_ORACLE_LONG=1)
#
# The short chain (three calls, SmolLM2 instead of Gemma 3, for a session whose device time is spent in part):
#   s1  [".whl", ".m/smol.a"]  wheels + build; every tests/gpu test on the synthetic models (8 workers)
#   s2  [".m/smol.b"]          SmolLM2 complete, sha256 checked: the engine and precision tests on it, pack +
#                              verify --device + run; the 8B benches (stage 2's, pp2048, PDL off, the PDL
#                              trigger A/B, the GEMM kernels A/B)
#   s3  []                     stage 3 (the serving load test)
#   s23 [".m/smol.b"]          instead of s2 and s3 when the 8B figures are not needed: SmolLM2's tests, pack +
#                              verify --device, its bench (pp512, tg128 at batch 1, 16, 64), then stage 3
# The GEMM kernels (v17's matmul2r_*, v10's matmul2_*, v9's WMMA; carry .whl/ only, any order after prepare):
#   gemm        build; the GEMM kernel tests (every family, tests/test_pdl.py's PTX check); kernel_bench --gemm
#   gemm-bench  synthetic llama3-8b Q4_0: ingot bench pp512 and batch 16,32,64, INGOT_MATMUL=mma and =mma-tile
#               alternated twice (v17's fragment-dequantizing matmul2r_* against v16's matmul2_*)
set -o pipefail
cd "$(dirname "$0")/../.."
GEMMA_SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # runtime/model/fetch.py
FIRST_PART=36000000  # bytes of the model part that travels with .whl/ (~27 MB) and the tree in the first call
PART=54278256        # the other four: (253,113,024 - FIRST_PART) / 4
WHEELS="gguf==0.19.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 zstandard==0.25.0 lz4==4.4.5 rfc8785==0.1.4
msgspec==0.23.0 pyzmq==27.3.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
llguidance==1.6.1 starlette==1.10.0 uvicorn==0.54.0 sse-starlette==3.7.0 httptools==0.7.1 uvloop==0.23.0 typing_extensions==4.16.0
openai==3.57.0 sniffio==1.3.1 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"
PLATFORMS="--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
--platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
--platform manylinux1_x86_64"

prepare() {
    local gemma="${INGOT_CACHE_DIR:-$HOME/.cache/ingot}/models/gemma-3-270m-q4_k_m.gguf"
    [ -f "$gemma" ] || { echo "error: $gemma not found; run: ingot model fetch gemma3-270m" >&2; return 2; }
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
    grep -qx '/.m/' .git/info/exclude 2>/dev/null || echo /.m/ >>.git/info/exclude
    mkdir -p .whl .m
    # shellcheck disable=SC2086  # word splitting of the lists is the point
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        $PLATFORMS -d .whl $WHEELS || return 1
    rm -f .m/gemma.*
    head -c "$FIRST_PART" "$gemma" >.m/gemma.a
    tail -c +"$((FIRST_PART + 1))" "$gemma" | split -b "$PART" -d -a 1 - .m/gemma.b
    [ "$(cat .m/gemma.a .m/gemma.b0 .m/gemma.b1 .m/gemma.b2 .m/gemma.b3 | sha256sum | cut -d' ' -f1)" = "$GEMMA_SHA" ] ||
        { echo "error: the parts do not add up to the Gemma file" >&2; return 1; }
    local smol="${INGOT_CACHE_DIR:-$HOME/.cache/ingot}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ -f "$smol" ]; then
        rm -f .m/smol.*
        head -c "$FIRST_PART" "$smol" >.m/smol.a
        tail -c +"$((FIRST_PART + 1))" "$smol" >.m/smol.b
        echo "short chain: s1 [\".whl\", \".m/smol.a\"]   s2 [\".m/smol.b\"]   s3 []"
    fi
    echo "calls, back to back: run 'bash tests/gpu/acceptance.sh N' with carry"
    echo "  1: [\".whl\", \".m/gemma.a\"]   2: [\".m/gemma.b0\"]   3: [\".m/gemma.b1\"]   4: [\".m/gemma.b2\"]"
    echo "  5: [\".m/gemma.b3\"]   6: []   7: []"
}

# --- on the device ---------------------------------------------------------------------------------------
M=/tmp/m
SMOL=$M/SmolLM2-135M-Instruct.Q4_1.gguf  # the test ids name real models by file stem (-k SmolLM2)
append() {
    [ -f ".m/$1" ] || { echo "error: .m/$1 did not travel: carry it (see prepare's list)"; exit 2; }
    cat ".m/$1" >>$M/gemma.part && echo "model part $1: $(stat -c %s $M/gemma.part) bytes so far"
}
smol_up() {  # the second SmolLM2 part, the environment, the whole file checked
    [ -f .m/smol.b ] && cat .m/smol.b >>$M/smol.part || { echo "error: .m/smol.b did not travel"; exit 2; }
    env_up
    mv $M/smol.part $SMOL
    [ "$(sha256sum $SMOL | cut -d' ' -f1)" = "$SMOL_SHA" ] || { echo "error: SmolLM2 sha256 differs"; exit 1; }
}
smol_checks() {  # SmolLM2's engine and precision tests, pack + verify --device + run, its bench (extra args: ingot bench's)
    INGOT_TEST_MODELS=$SMOL OPENBLAS_NUM_THREADS=2 timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE -s -n 8 -k SmolLM2 \
        tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_precision.py 2>&1 | tee "$OUT/s2_smol.log" |
        grep -E "rel err|decode:|wide|prefill [0-9]|passed|failed|Error|assert" | tail -30
    python3 -m ingot pack --model $SMOL --kernels /tmp/kernels --out /tmp/smol.ingot >/dev/null &&
        python3 -m ingot verify /tmp/smol.ingot --device 2>&1 | tail -3
    timeout 60 python3 -m ingot run /tmp/smol.ingot -p "The capital of France is" -n 16 --device cuda 2>&1 | tail -2
    timeout 120 python3 -m ingot bench /tmp/smol.ingot -p 512 -r 5 "$@" 2>&1 | tee "$OUT/s2_smol_bench.log" |
        grep -E "pp|tg|cold"
}
env_up() {
    export INGOT_CACHE_DIR=/tmp/icache PYTHONUNBUFFERED=1
    if [ -d /tmp/kernels ] && [ -d /tmp/site ]; then  # the machine is still the one stage 1 set up
        export PYTHONPATH="$PWD:/tmp/site" INGOT_KERNELS=/tmp/kernels
    else
        # shellcheck disable=SC1091
        . tests/gpu/device_env.sh
    fi
}

case "${1:-}" in
prepare) prepare ;;
1)
    mkdir -p $M && rm -f $M/gemma.part && append gemma.a
    t0=$(date +%s)
    env_up || { echo "error: device_env.sh failed (wheels or kernel build)"; exit 1; }
    echo "wheels + kernels: $(($(date +%s) - t0)) s"
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
    timeout 480 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 tests/gpu --ignore tests/gpu/test_gpu_serve_load.py \
        2>&1 | tee "$OUT/1_tests.log" | tail -40
    ;;
2)
    append gemma.b0
    env_up
    for q in Q4_0 Q4_K_M; do python3 -m ingot model synth --shape llama3-8b --quant $q --out /tmp/l8_$q.gguf >/dev/null; done
    timeout 200 python3 -m ingot bench /tmp/l8_Q4_0.gguf -r 3 --batch 1,4,16,64 --no-cold-start 2>&1 | tee "$OUT/2_q4_0.log" | tail -10
    timeout 120 python3 -m ingot bench /tmp/l8_Q4_K_M.gguf -r 3 --no-cold-start 2>&1 | tee "$OUT/2_q4_k_m.log" | tail -6
    for q in Q4_0 Q4_K_M; do
        echo "INGOT_PDL=0 $q:"
        INGOT_PDL=0 timeout 100 python3 -m ingot bench /tmp/l8_$q.gguf -p 0 -r 3 --no-cold-start 2>&1 | tail -3
    done
    ;;
3)
    append gemma.b1
    env_up
    timeout 540 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/gpu/test_gpu_serve_load.py 2>&1 |
        tee "$OUT/3_serve.log" | tail -60
    ;;
4)
    append gemma.b2
    ;;
5)
    append gemma.b3
    env_up
    mv $M/gemma.part $M/gemma.gguf
    [ "$(sha256sum $M/gemma.gguf | cut -d' ' -f1)" = "$GEMMA_SHA" ] || { echo "error: Gemma sha256 differs: start again"; exit 1; }
    INGOT_TEST_MODELS=$M/gemma.gguf timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE -s -n 4 -k gemma \
        tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_precision.py 2>&1 | tee "$OUT/5_gemma.log" |
        grep -E "rel err|decode:|prefill [0-9]|wide|passed|failed|Error|assert" | tail -60
    echo "the decode-after-prefill tests again with the scalar prefill attention (the default is mma):"
    INGOT_ATTN_PREFILL=scalar INGOT_TEST_MODELS=$M/gemma.gguf timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -s \
        -k "gemma and (decode_steps or prefill_logits)" tests/gpu/test_gpu_engine.py 2>&1 | tee "$OUT/5_gemma_scalar.log" |
        grep -E "decode:|prefill [0-9]|passed|failed|assert" | tail -20
    ;;
6)
    env_up
    for a in mma scalar; do
        echo "INGOT_ATTN_PREFILL=$a:"
        INGOT_ATTN_PREFILL=$a timeout 150 python3 -m ingot bench $M/gemma.gguf -r 3 -d 0,4096 --no-cold-start 2>&1 |
            tee "$OUT/6_bench_$a.log" | tail -8
    done
    python3 -m ingot pack --model $M/gemma.gguf --kernels /tmp/kernels --out /tmp/gemma.ingot >/dev/null &&
        python3 -m ingot verify /tmp/gemma.ingot --device 2>&1 | tail -6
    timeout 60 python3 -m ingot run /tmp/gemma.ingot -p "The capital of France is" -n 16 --device cuda 2>&1 | tail -3
    ;;
7)
    env_up
    INGOT_TEST_GEMMA3=$M/gemma.gguf INGOT_TEST_ORACLE_LONG=1 timeout 560 python3 -m pytest -q -p no:cacheprovider -rfE \
        -s -n 4 tests/oracle 2>&1 | tee "$OUT/7_oracle.log" | grep -E "rel|perplex|passed|failed|Error" | tail -40
    ;;
s1)
    mkdir -p $M && rm -f $M/smol.part
    [ -f .m/smol.a ] && cat .m/smol.a >$M/smol.part || { echo "error: .m/smol.a did not travel"; exit 2; }
    t0=$(date +%s)
    env_up || { echo "error: device_env.sh failed (wheels or kernel build)"; exit 1; }
    echo "wheels + kernels: $(($(date +%s) - t0)) s"
    nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader
    python3 -m ingot model synth --shape llama3-8b --quant Q4_0 --out /tmp/l8_Q4_0.gguf >/dev/null &
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 timeout 500 python3 -m pytest -q -p no:cacheprovider -rfE -n 12 tests/gpu \
        --ignore tests/gpu/test_gpu_serve_load.py --durations=8 2>&1 | tee "$OUT/s1_tests.log" | tail -40
    wait
    ;;
s2)
    smol_up
    python3 -m ingot model synth --shape llama3-8b --quant Q4_K_M --out /tmp/l8_Q4_K_M.gguf >/dev/null &
    smol_checks
    wait
    timeout 200 python3 -m ingot bench /tmp/l8_Q4_0.gguf -p 512 -r 3 --batch 1,4,16,64 --no-cold-start 2>&1 |
        tee "$OUT/s2_q4_0.log" | grep -E "pp|tg"
    timeout 60 python3 -m ingot bench /tmp/l8_Q4_0.gguf -p 2048 -n 0 -r 2 --no-cold-start 2>&1 | grep -E "pp"
    timeout 100 python3 -m ingot bench /tmp/l8_Q4_K_M.gguf -p 0 -r 3 --no-cold-start 2>&1 | tee "$OUT/s2_q4_k_m.log" |
        grep -E "tg"
    echo "INGOT_PDL=0, Q4_0:"
    INGOT_PDL=0 timeout 100 python3 -m ingot bench /tmp/l8_Q4_0.gguf -p 0 -r 3 --batch 1,64 --no-cold-start 2>&1 |
        grep -E "tg"
    for t in early late; do
        echo "INGOT_PDL_TRIGGER=$t: 8B Q4_0, SmolLM2"
        INGOT_PDL_TRIGGER=$t timeout 60 python3 -m ingot bench /tmp/l8_Q4_0.gguf -p 0 -r 3 --no-cold-start 2>&1 | grep -E "tg"
        INGOT_PDL_TRIGGER=$t timeout 60 python3 -m ingot bench /tmp/smol.ingot -p 0 -r 5 --no-cold-start 2>&1 | grep -E "tg"
    done
    echo "INGOT_MATMUL=wmma (the previous GEMM), Q4_0:"
    INGOT_MATMUL=wmma timeout 100 python3 -m ingot bench /tmp/l8_Q4_0.gguf -p 512 -r 2 --batch 16,64 --no-cold-start \
        2>&1 | grep -E "pp|tg"
    ;;
s23)
    smol_up
    smol_checks --batch 1,16,64
    INGOT_TEST_MODEL=$SMOL timeout 400 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/gpu/test_gpu_serve_load.py \
        2>&1 | tee "$OUT/s3_serve.log" | tail -40
    ;;
s3)
    env_up
    INGOT_TEST_MODEL=$SMOL timeout 540 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/gpu/test_gpu_serve_load.py \
        2>&1 | tee "$OUT/s3_serve.log" | tail -60
    ;;
gemm)
    env_up
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -n 6 -k "matmul or gemm or split_k" tests/gpu/test_gpu_kernels.py 2>&1 |
        tee "$OUT/gemm_tests.log" | tail -30
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_pdl.py 2>&1 | tail -5
    timeout 150 python3 tests/gpu/kernel_bench.py --gemm 2>&1 | tee "$OUT/gemm_bench.log"
    ;;
gemm-bench)
    env_up
    [ -f /tmp/l8_Q4_0.gguf ] || python3 -m ingot model synth --shape llama3-8b --quant Q4_0 --out /tmp/l8_Q4_0.gguf >/dev/null
    for m in mma mma-tile mma mma-tile; do
        echo "INGOT_MATMUL=$m:"
        INGOT_MATMUL=$m timeout 240 python3 -m ingot bench /tmp/l8_Q4_0.gguf -r 3 --batch 16,32,64 --no-cold-start 2>&1 |
            tee "$OUT/gemm_bench_$m.log" | tail -8
    done
    ;;
*)
    echo "usage: bash tests/gpu/acceptance.sh prepare|1..7|s1..s3|gemm|gemm-bench (see the header)" >&2
    exit 2
    ;;
esac
