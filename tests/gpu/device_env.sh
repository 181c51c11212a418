# Source this on the device machine (the GPU box the `device` tool lends) from the repo root:
#   . tests/gpu/device_env.sh
# It installs the carried wheels (.whl/, for packages that machine lacks), puts the checkout on PYTHONPATH (it
# runs uninstalled: see ingot/__init__.py), and builds the kernels for the local GPU into /tmp/kernels
# (INGOT_KERNELS).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
# Bytecode, as a pip install leaves it: without it every `ingot run` spawned by the cold-start benchmark compiled
# ~280 modules again (0.31 s of its 0.87 s in cProfile on the H200; the interpreter there writes no .pyc itself).
python3 -m compileall -q -j 0 /tmp/site "$PWD/ingot" "$PWD/runtime" "$PWD/toolchain" >/dev/null || true
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
arch="sm_${cc}"; [ "$cc" = 90 ] && arch=sm_90a   # the release policy's Hopper image (cuda/archs.json): wgmma
python3 -m ingot build --arch "$arch" --out /tmp/kernels --json > /tmp/kernels.json || return 1
export INGOT_KERNELS=/tmp/kernels
