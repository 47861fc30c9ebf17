#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is lent. That machine has a driver, CUDA and a
# PyTorch virtualenv (with cuDNN) but no Rust toolchain, so the check has two halves:
#
#   scripts/gpu-check.sh bundle   # here: release-build every test/bench/example binary into
#                                 # .gpu-bundle/ (git-ignored; carry it to the GPU machine)
#   scripts/gpu-check.sh run      # there: run tier 4 (GPU tests), the GPU benches, the PyTorch
#                                 # side-by-side (benches/torch_cbr.py) and the
#                                 # device-properties dump, writing everything under $OUT
#                                 # (target/gpu-check/ when OUT is unset); stages run most
#                                 # valuable first within GPU_CHECK_BUDGET_S (540 s), which
#                                 # is about what an H200 needs, most of it cuDNN's runtime
#                                 # compilation and torch.compile
#   scripts/gpu-check.sh rehearse # here, without a GPU: the run half from a copy of the
#                                 # repository elsewhere (CI runs it after the bundle)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bundle=.gpu-bundle

case "${1:-}" in
bundle)
  rm -rf "$bundle" && mkdir -p "$bundle"
  # Test and bench binaries: cargo prints their paths as JSON; keep the executables. The whole
  # workspace is built (as the test command builds it), so that the features of shared
  # dependencies are the same and `cargo test --release` afterwards reuses every artifact;
  # the netcheck crate's CPU-only tests come along and take about a second there.
  cargo test --release --workspace --all-targets --no-run \
    --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["kind"][0], m["target"]["name"], m["executable"])
' | while read -r kind name exe; do
      # The CPU benches (plan_build, reference) are measured here, not there.
      case "$kind-$name" in
        test-*|bench-cbr_layers|bench-range_ops|bench-allreduce) cp "$exe" "$bundle/$kind-$name" ;;
      esac
    done
  # The examples as programs (`cargo test` builds them as test harnesses); the same package
  # selection, so the dependencies built above are reused.
  cargo build --release --workspace --examples
  for ex in device_props deviceless_smoke train_cbr custom_trainer deviceless_plans fuzz_graphs; do
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
  # The GPU machine's libraries: a Python that has torch (its virtualenv carries the cuDNN,
  # cuBLAS and NVRTC wheels), every nvidia/*/lib folder of it on the loader path (cuDNN loads
  # cuBLASLt and NVRTC by name), and the CUDA toolkit's when there is one. An explicit
  # PYTHON, CUDNN_LIB_DIR or LD_LIBRARY_PATH still wins.
  py=${PYTHON:-}
  if [ -z "$py" ]; then
    for c in /opt/torch/.venv/bin/python3 /opt/*/.venv/bin/python3 /opt/*/venv/bin/python3 python3; do
      if command -v "$c" >/dev/null && "$c" -c 'import torch' 2>/dev/null; then py=$c; break; fi
    done
  fi
  py=${py:-python3}
  libdirs=""
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
  if [ -n "$site" ] && [ -d "$site/nvidia" ]; then
    for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && libdirs="$libdirs:$d"; done
  fi
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libdirs="$libdirs:$d"
  done
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH}${libdirs}"
  LD_LIBRARY_PATH=${LD_LIBRARY_PATH#:}
  if [ -z "${CUDNN_LIB_DIR:-}" ] && [ -n "$site" ] && [ -e "$site/nvidia/cudnn/lib/libcudnn.so.9" ]; then
    export CUDNN_LIB_DIR="$site/nvidia/cudnn/lib"
  fi
  if [ -z "${CUDNN_CBR_CUDA_INCLUDE:-}" ]; then
    for d in /usr/local/cuda/include "$site/nvidia/cu13/include" "$site/nvidia/cuda_runtime/include"; do
      if [ -e "$d/cuda_fp16.h" ]; then export CUDNN_CBR_CUDA_INCLUDE="$d"; break; fi
    done
  fi
  {
    date -u
    nvidia-smi || true
    echo "python: $py"
    "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())' || true
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "CUDNN_LIB_DIR=${CUDNN_LIB_DIR:-}"
    echo "CUDNN_CBR_CUDA_INCLUDE=${CUDNN_CBR_CUDA_INCLUDE:-}"
    ls "${CUDNN_LIB_DIR:-/nonexistent}"/libcudnn.so.* 2>/dev/null || true
    "$py" -m pip show nvidia-cudnn-cu13 nvidia-cuda-nvrtc nvidia-cublas 2>/dev/null \
      | grep -E '^(Name|Version)' || true
    ls -l /usr/local/cuda/lib64/libnvrtc.so* 2>/dev/null || true
  } > "$out/machine.txt" 2>&1
  cat "$out/machine.txt"
  status=0
  t0=$(date +%s)
  budget=${GPU_CHECK_BUDGET_S:-540}
  rehearsal=${GPU_CHECK_REHEARSAL:-}
  : > "$out/summary.txt"
  say() { echo "$*" | tee -a "$out/summary.txt"; }
  # Stages run most valuable first; one that would start past the budget is skipped by name,
  # so a run cut short still brings back what matters (the device tool returns $OUT).
  left() { echo $(( budget - ($(date +%s) - t0) )); }
  cap() { local l; l=$(left); echo $(( l < $1 ? l : $1 )); } # a stage's timeout
  stage() { # name, seconds it needs at least
    if [ "$(left)" -lt "$2" ]; then
      say "== $1: NOT RUN (needs ~$2 s, $(left) s of the budget left)"; status=1; return 1
    fi
    say "== $1 ($(( $(date +%s) - t0 )) s)"
  }
  # On the GPU machine a SKIP is a failure (tier 4 is what this run is for), except the few
  # that skip *because* there is a GPU, or for lack of libclang. In a rehearsal (no GPU) the
  # GPU stages may only fail or skip for want of a device (or of PyTorch).
  skip_args=()
  expected_skip='this machine has CUDA device|CUDA is usable here|libclang'
  no_gpu='(no|no usable) CUDA device|PyTorch is not installed|no CUDA GPU'
  check() { # exit code, log, name
    local rc=$1 log=$2 name=$3 bad
    bad=$(grep -E "(^|\.\.\. )SKIP " "$log" | grep -Ev "$expected_skip" || true)
    if [ -n "$rehearsal" ]; then
      bad=$(echo "$bad" | grep -Ev "$no_gpu" || true)
      if [ "$rc" != 0 ] && grep -Eq "$no_gpu" "$log" && ! grep -q "panicked" "$log"; then rc=0; fi
    fi
    if [ "$rc" != 0 ]; then status=1; say "FAILED: $name (exit $rc, see $(basename "$log"))"; fi
    if [ -n "$bad" ]; then status=1; say "UNEXPECTED SKIP: $name"; fi
  }
  run_tests() { # test binaries
    local t name rc
    for t in "$@"; do
      [ -e "$t" ] || continue
      name=$(basename "$t")
      stage "$name" 20 || continue
      rc=0; timeout -k 10 "$(cap 240)" "$t" --nocapture --test-threads=1 "${skip_args[@]}" \
        > "$out/$name.log" 2>&1 || rc=$?
      grep -E "SKIP|test result|FAILED|panicked" "$out/$name.log" | tee -a "$out/summary.txt" || true
      check "$rc" "$out/$name.log" "$name"
    done
  }
  step() { # name, log name, timeout, command... (output to the terminal and to $out/log)
    local name=$1 log=$out/$2 limit=$3 rc; shift 3
    set +e
    timeout -k 10 "$(cap "$limit")" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    check "$rc" "$log" "$name"
  }

  if stage "device properties" 10; then
    step device_props device-props.txt 60 "$bundle/example-device_props" "$out/device-props.json" \
      "$bundle/fixtures/devprops/h200-sm90.json"
  fi
  # Tier 4 (the GPU tests), the main job on the GPU, the GPU benches, PyTorch side by side.
  run_tests "$bundle"/test-gpu_* "$bundle"/test-nvrtc_compile
  if stage "train_cbr --device cuda (whole-step CUDA graph after warm-up)" 30; then
    step train_cbr train_cbr_cuda.txt 180 "$bundle/example-train_cbr" --device cuda
  fi
  # The worked example of linking the library (CudaClassifier on a GPU; the CPU without one).
  if stage "custom_trainer (the worked example)" 20; then
    step custom_trainer custom_trainer.txt 120 "$bundle/example-custom_trainer" --steps 60
  fi
  for name in cbr_layers range_ops allreduce; do
    if stage "bench $name" 30; then
      OUT="$out" step "$name" "bench-$name.txt" 240 "$bundle/bench-$name" --bench
    fi
  done
  if stage "torch_cbr (PyTorch side-by-side)" 60; then
    OUT="$out" PYTHONUNBUFFERED=1 step torch_cbr torch_cbr.txt 180 "$py" benches/torch_cbr.py --out "$out"
  fi
  # Then what also runs without a GPU, here against this machine's cuDNN: planning with the
  # real device's properties, and every other test binary.
  props=$out/device-props.json
  # A rehearsal has no device to read: the H200 fixture stands in.
  [ -n "$rehearsal" ] && [ ! -s "$props" ] && props=$bundle/fixtures/devprops/h200-sm90.json
  if [ -s "$props" ] && stage "deviceless_plans with the real properties" 60; then
    step deviceless_plans deviceless_plans_live_props.txt 120 "$bundle/example-deviceless_plans" \
      --props "$props" --batch 256 --cache "$out/plan-cache" > /dev/null
    grep -E "^supported" "$out/deviceless_plans_live_props.txt" | tee -a "$out/summary.txt" || true
  fi
  others=()
  for t in "$bundle"/test-*; do
    # (fuzz_graphs is deviceless CPU work that `cargo test` runs; no GPU minutes for it.)
    case "$(basename "$t")" in test-gpu_*|test-nvrtc_compile|test-fuzz_graphs) ;; *) others+=("$t") ;; esac
  done
  if [ -n "$rehearsal" ]; then
    # `cargo test` runs these right after the rehearsal, so here each one only lists its
    # tests from the copy: it starts (links, loads) away from where it was built. Running
    # them twice cost CI about two minutes.
    for t in "${others[@]}"; do
      name=$(basename "$t")
      rc=0; "$t" --list > "$out/$name.log" 2>&1 || rc=$?
      check "$rc" "$out/$name.log" "$name (--list)"
    done
    say "== ${#others[@]} other test binaries start from the copy (run by cargo test)"
  else
    run_tests "${others[@]}"
  fi
  say "== done in $(( $(date +%s) - t0 )) s, status $status${rehearsal:+ (rehearsal without a GPU)}"
  exit $status
  ;;
rehearse)
  # The run half without a GPU, from a copy of the repository at another path (as on the GPU
  # machine): checks this script and that no binary depends on where it was built. GPU stages
  # may only skip or fail for want of a device.
  [ -d "$bundle" ] || { echo "no $bundle: run 'scripts/gpu-check.sh bundle' first" >&2; exit 1; }
  copy=$(mktemp -d)
  trap 'rm -rf "$copy"' EXIT
  # What the device tool carries: tracked files and untracked ones git does not ignore.
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
      | xargs -0 cp --parents --no-dereference -t "$copy"
  else
    tar --exclude=./target --exclude=./.deps --exclude="./$bundle" -cf - . | tar -xf - -C "$copy"
  fi
  cp -r "$bundle" "$copy/"
  out=$(pwd)/target/gpu-check-rehearsal
  rm -rf "$out"
  (cd "$copy" && GPU_CHECK_REHEARSAL=1 OUT="$out" bash scripts/gpu-check.sh run)
  ;;
*)
  echo "usage: scripts/gpu-check.sh bundle|run|rehearse" >&2
  exit 2
  ;;
esac
