#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is lent. That machine has a driver, CUDA and a
# PyTorch virtualenv (with cuDNN) but no Rust toolchain, so the check has two halves:
#
#   scripts/gpu-check.sh bundle   # here: release-build every test/bench/example binary into
#                                 # .gpu-bundle/ (git-ignored; carry it to the GPU machine)
#   scripts/gpu-check.sh run      # there: run tier 4 (GPU tests), the GPU benches, the PyTorch
#                                 # side-by-side (benches/torch_cbr.py) and the
#                                 # device-properties dump, writing everything under $OUT
#                                 # (target/gpu-check/ when OUT is unset); about 6 minutes on
#                                 # an H200, most of it cuDNN's runtime compilation and
#                                 # torch.compile
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bundle=.gpu-bundle

case "${1:-}" in
bundle)
  rm -rf "$bundle" && mkdir -p "$bundle"
  # Test and bench binaries: cargo prints their paths as JSON; keep the executables.
  cargo test --release --workspace --all-targets --no-run --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
' | while read -r kind name exe; do
      case "$kind" in test|bench) cp "$exe" "$bundle/$kind-$name" ;; esac
    done
  cargo build --release --examples
  for ex in device_props deviceless_smoke train_cbr deviceless_plans; do
    cp "target/release/examples/$ex" "$bundle/example-$ex"
  done
  strip "$bundle"/* 2>/dev/null || true
  cp -r tests/fixtures "$bundle/fixtures"
  du -sh "$bundle"
  echo "carry '$bundle' and run: bash scripts/gpu-check.sh run"
  ;;
run)
  out=${OUT:-target/gpu-check}
  mkdir -p "$out"
  [ -d "$bundle" ] || { echo "no $bundle: run 'scripts/gpu-check.sh bundle' here first" >&2; exit 1; }
  {
    date -u
    nvidia-smi || true
    python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' || true
  } > "$out/machine.txt" 2>&1
  status=0
  # Tier 4: every test binary (GPU tests run; the rest re-check deviceless behaviour).
  for t in "$bundle"/test-*; do
    name=$(basename "$t")
    echo "== $name"
    if ! "$t" --nocapture --test-threads=1 > "$out/$name.log" 2>&1; then
      status=1; echo "FAILED: $name (see $out/$name.log)"
    fi
    grep -E "SKIP|test result|FAILED|panicked" "$out/$name.log" || true
  done | tee "$out/summary.txt"
  "$bundle/example-device_props" "$out/device-props.json" "$bundle/fixtures/devprops/h200-sm90.json" \
    2>&1 | tee "$out/device-props.txt" || status=1
  echo "== train_cbr on the GPU (the main job; whole-step CUDA graph after warm-up)"
  timeout 300 "$bundle/example-train_cbr" --device cuda 2>&1 | tee "$out/train_cbr_cuda.txt" || status=1
  echo "== deviceless_plans against the real device's properties"
  if [ -s "$out/device-props.json" ]; then
    timeout 300 "$bundle/example-deviceless_plans" --props "$out/device-props.json" --batch 256 \
      --cache "$out/plan-cache" > "$out/deviceless_plans_live_props.txt" 2>&1 || status=1
    tail -1 "$out/deviceless_plans_live_props.txt"
  fi
  for b in "$bundle"/bench-*; do
    [ -e "$b" ] || continue
    name=$(basename "$b")
    echo "== $name"
    OUT="$out" timeout 240 "$b" --bench 2>&1 | tee "$out/$name.txt" || status=1
  done
  echo "== torch_cbr (PyTorch side-by-side)"
  OUT="$out" PYTHONUNBUFFERED=1 timeout 180 python3 benches/torch_cbr.py --out "$out" 2>&1 \
    | tee "$out/torch_cbr.txt" || status=1
  exit $status
  ;;
*)
  echo "usage: scripts/gpu-check.sh bundle|run" >&2
  exit 2
  ;;
esac
