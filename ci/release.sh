#!/usr/bin/env bash
# Ingot's release pipeline, for your CI: build the kernels once, then for every model pack a bundle, verify
# it, check it runs on every target GPU/driver, sign it, verify the signature, and prove the kernels rebuild
# byte for byte. Any failing step stops the release with that step's exit code (see the README).
#
# Variables:
#   MODELS      GGUF files, space-separated; each becomes OUT/<file name without .gguf>.ingot   (required)
#   KEY         Ed25519 private key from `ingot keygen --out PREFIX` (PREFIX.key)               (required)
#   PUBKEY      public key to verify the signatures with              (default: KEY with .key -> .pub)
#   TARGETS     GPU:DRIVER pairs every bundle must run on  (default: "sm_80:580.65.06 sm_90:580.65.06")
#   OUT         output folder: kernels/, the bundles, SHA256SUMS                (default: dist/release)
#   ARCHS       kernel archs, e.g. sm_80,sm_90,compute_90     (default: the policy in cuda/archs.json)
#   PACK_FLAGS  extra `ingot pack` flags, e.g. --no-selftest for models too big for the CPU engine
#   SOURCE_DATE_EPOCH  mtime of every bundle member (default: the last commit's time, else 0)
#   INGOT       the ingot command                                                 (default: ingot)
set -euo pipefail

: "${MODELS:?set MODELS to the GGUF files to release, e.g. MODELS=\"models/a.gguf models/b.gguf\"}"
: "${KEY:?set KEY to the signing key (PREFIX.key from ingot keygen)}"
PUBKEY="${PUBKEY:-${KEY%.key}.pub}"
TARGETS="${TARGETS:-sm_80:580.65.06 sm_90:580.65.06}"
OUT="${OUT:-dist/release}"
ARCHS="${ARCHS:-}"
PACK_FLAGS="${PACK_FLAGS:-}"
INGOT="${INGOT:-ingot}"
root="$(cd "$(dirname "$0")/.." && pwd)"
SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$root" log -1 --format=%ct 2>/dev/null || echo 0)}"
export SOURCE_DATE_EPOCH

for f in "$KEY" "$PUBKEY"; do
  [[ -f "$f" ]] || { echo "release: $f not found (create keys with: $INGOT keygen --out PREFIX)" >&2; exit 2; }
done
for model in $MODELS; do
  [[ -f "$model" ]] || { echo "release: model $model not found" >&2; exit 2; }
done

step() { echo "== $*" >&2; }

mkdir -p "$OUT"
step "build kernels -> $OUT/kernels"
"$INGOT" build --out "$OUT/kernels" ${ARCHS:+--arch "$ARCHS"} >/dev/null

bundles=()
for model in $MODELS; do
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
  bundles+=("$bundle")
done

# Every bundle carries the same kernels, so one rebuild proves them all.
step "rebuild --check ${bundles[0]}"
"$INGOT" rebuild --check "${bundles[0]}"

(cd "$OUT" && sha256sum -- *.ingot > SHA256SUMS)
step "released ${#bundles[@]} bundle(s) into $OUT (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH):"
cat "$OUT/SHA256SUMS" >&2
