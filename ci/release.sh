#!/usr/bin/env bash
# Ingot's release pipeline, for your CI: build the wheel and sdist (twine-checked) and install the wheel into a
# fresh venv from the hash-pinned ci/requirements.lock; build the kernels once; then for every model pack a
# bundle, verify it, check it runs on every target GPU/driver, sign it, verify the signature, write its AI-BOM
# (CycloneDX); finally prove the kernels rebuild byte for byte. Any failing step stops the release with that
# step's exit code (see the README).
#
# Variables:
#   MODELS      GGUF files or `ingot model fetch` names (e.g. smollm2), space-separated; each becomes
#               OUT/<file name without .gguf>.ingot                                              (required)
#   KEY         private key from `ingot keygen --out PREFIX` (PREFIX.key; P-256 or Ed25519)      (required)
#   PUBKEY      public key to verify the signatures with              (default: KEY with .key -> .pub)
#   TARGETS     GPU:DRIVER pairs every bundle must run on  (default: "sm_80:580.65.06 sm_90:580.65.06")
#   OUT         output folder: dist/ (wheel, sdist), kernels/, the bundles and their .cdx.json AI-BOMs,
#               SHA256SUMS                                                       (default: dist/release)
#   ARCHS       kernel archs, e.g. sm_80,sm_90,compute_90     (default: the policy in cuda/archs.json)
#   PACK_FLAGS  extra `ingot pack` flags, e.g. --no-selftest for models too big for the CPU engine
#   SOURCE_DATE_EPOCH  mtime of every bundle member (default: the last commit's time, else 0)
#   WHEEL       1: build the wheel and sdist into OUT/dist and `twine check` them (needs the release extra:
#               `pip install --require-hashes -r ci/requirements.lock`); 0: skip                (default: 1)
#   INSTALL     1: install that wheel into OUT/venv from ci/requirements.lock (hash-checked) and release with
#               its `ingot`; 0: use INGOT as found (needs WHEEL=1 to be 1)                      (default: WHEEL)
#   PYTHON      the Python that builds the wheel and creates OUT/venv                    (default: python3)
#   INGOT       the ingot command when INSTALL=0                                  (default: ingot)
set -euo pipefail

: "${MODELS:?set MODELS to the GGUF files to release, e.g. MODELS=\"models/a.gguf models/b.gguf\"}"
: "${KEY:?set KEY to the signing key (PREFIX.key from ingot keygen)}"
PUBKEY="${PUBKEY:-${KEY%.key}.pub}"
TARGETS="${TARGETS:-sm_80:580.65.06 sm_90:580.65.06}"
OUT="${OUT:-dist/release}"
ARCHS="${ARCHS:-}"
PACK_FLAGS="${PACK_FLAGS:-}"
INGOT="${INGOT:-ingot}"
WHEEL="${WHEEL:-1}"
INSTALL="${INSTALL:-$WHEEL}"
PYTHON="${PYTHON:-python3}"
root="$(cd "$(dirname "$0")/.." && pwd)"
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}"
export SOURCE_DATE_EPOCH

for f in "$KEY" "$PUBKEY"; do
  [[ -f "$f" ]] || { echo "release: $f not found (create keys with: $INGOT keygen --out PREFIX)" >&2; exit 2; }
done
for model in $MODELS; do
  if [[ "$model" == *.gguf || "$model" == */* ]]; then
    [[ -f "$model" ]] || { echo "release: model $model not found" >&2; exit 2; }
  fi
done

step() { echo "== $*" >&2; }

mkdir -p "$OUT"
if [[ "$WHEEL" == 1 ]]; then
  step "build the wheel and sdist -> $OUT/dist"
  rm -rf "$OUT/dist"
  "$PYTHON" -m build --sdist --wheel --outdir "$OUT/dist" "$root" >&2
  step "twine check $OUT/dist"
  "$PYTHON" -m twine check --strict "$OUT"/dist/*
fi
if [[ "$INSTALL" == 1 ]]; then
  wheels=("$OUT"/dist/ingot_llm-*.whl)
  [[ -f "${wheels[0]}" ]] || { echo "release: INSTALL=1 needs the wheel (WHEEL=1)" >&2; exit 2; }
  step "install ${wheels[0]##*/} into $OUT/venv from ci/requirements.lock (hash-checked)"
  rm -rf "$OUT/venv"
  "$PYTHON" -m venv "$OUT/venv"
  "$OUT/venv/bin/python" -m pip install -q --require-hashes -r "$root/ci/requirements.lock"
  "$OUT/venv/bin/python" -m pip install -q --no-deps "${wheels[0]}"
  INGOT="$OUT/venv/bin/ingot"
fi

models=()
for model in $MODELS; do
  if [[ -f "$model" ]]; then
    models+=("$model")
  else
    step "fetch model $model"
    models+=("$("$INGOT" model fetch "$model")")
  fi
done

step "build kernels -> $OUT/kernels"
"$INGOT" build --out "$OUT/kernels" ${ARCHS:+--arch "$ARCHS"} >/dev/null

bundles=()
for model in "${models[@]}"; do
  name="$(basename "$model" .gguf)"
  bundle="$OUT/$name.ingot"
  step "pack $model -> $bundle"
  # shellcheck disable=SC2086  # PACK_FLAGS is a list of flags
  "$INGOT" pack --model "$model" --kernels "$OUT/kernels" --name "$name" --out "$bundle" $PACK_FLAGS
  step "verify $bundle"
  "$INGOT" verify "$bundle"
  for target in $TARGETS; do
    step "check-compat $bundle on ${target%%:*} with driver ${target#*:}"
    "$INGOT" check-compat "$bundle" --gpu "${target%%:*}" --driver "${target#*:}"
  done
  step "sign $bundle"
  "$INGOT" sign "$bundle" --key "$KEY"
  step "verify the signature of $bundle"
  "$INGOT" verify "$bundle" --pubkey "$PUBKEY"
  step "sbom $bundle -> $OUT/$name.cdx.json"
  "$INGOT" sbom "$bundle" --out "$OUT/$name.cdx.json" >/dev/null
  bundles+=("$bundle")
done

# Every bundle carries the same kernels, so one rebuild proves them all.
step "rebuild --check ${bundles[0]}"
"$INGOT" rebuild --check "${bundles[0]}"

(
  cd "$OUT"
  files=(*.ingot *.cdx.json)
  if [[ "$WHEEL" == 1 ]]; then files+=(dist/*); fi
  sha256sum -- "${files[@]}" > SHA256SUMS
)
step "released ${#bundles[@]} bundle(s) into $OUT (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH):"
cat "$OUT/SHA256SUMS" >&2
