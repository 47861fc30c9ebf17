#!/usr/bin/env bash
# The GPU check, for the day a GPU machine is lent (docs/gpu-check.md). That machine has a
# driver, CUDA tools and a PyTorch virtualenv (with cuDNN, NVRTC and NCCL wheels) but no Rust
# toolchain and no network, so the check has two halves and a rehearsal:
#
#   scripts/gpu-check.sh bundle    # here: release-build the binaries that need a GPU into ONE
#                                  # archive, .gpu-bundle.tar.xz (git-ignored; carry it)
#   scripts/gpu-check.sh run       # there: unpack it and run the stages, most valuable first,
#                                  # within GPU_CHECK_BUDGET_S (330 s); at most 8 files in $OUT
#                                  # (target/gpu-check/ when OUT is unset)
#   scripts/gpu-check.sh rehearse  # here, without a GPU: `run` from a copy of the repository
#                                  # elsewhere, then assertions on what it wrote (CI runs it)
#   scripts/gpu-check.sh size      # the archive plus the tree that travels, against the limit
#   scripts/gpu-check.sh selftest  # the run's verdicts on made-up stages (the test command runs it)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
archive=.gpu-bundle.tar.xz
# A GPU machine is sent the working tree plus the archive, 64 MiB at most (docs/gpu-check.md);
# 48 MiB leaves room for whatever else travels with them.
limit_mib=${GPU_CHECK_LIMIT_MIB:-48}

# Bytes of what travels: tracked files and untracked ones git does not ignore, plus the archive.
travel_bytes() {
  local tree=0
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    tree=$(git ls-files -z --cached --others --exclude-standard \
      | python3 -c 'import os, sys
print(sum(os.lstat(p).st_size for p in sys.stdin.buffer.read().split(b"\0") if p and os.path.lexists(p)))')
  fi
  echo $(( tree + $(stat -c %s "$archive") ))
}

check_size() {
  [ -f "$archive" ] || { echo "no $archive: run 'scripts/gpu-check.sh bundle' first" >&2; return 1; }
  local a t
  a=$(stat -c %s "$archive"); t=$(travel_bytes)
  awk -v a="$a" -v t="$t" -v l="$limit_mib" -v n="$archive" 'BEGIN {
    printf "gpu-check size: %s %.1f MiB; with the tree that travels %.1f MiB (limit %d MiB)\n", n, a / 1048576, t / 1048576, l }'
  if [ "$t" -gt $(( limit_mib * 1048576 )) ]; then
    echo "gpu-check size: FAIL: over the limit of $limit_mib MiB (the GPU machine is sent 64 MiB at most)" >&2
    return 1
  fi
}

# Checks $1 against the limits on what comes back from a GPU machine: at most 8 files, 16 MiB each,
# 64 MiB in all, no more than 2 folders deep, names of letters, digits, '.', '_' and '-'.
check_out() {
  python3 - "$1" <<'EOF'
import os, re, sys
root = sys.argv[1]
bad, files, total = [], [], 0
for d, dirs, names in os.walk(root):
    for n in dirs + names:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", n):
            bad.append(f"name {os.path.join(d, n)!r} has characters that do not come back")
    for n in names:
        p = os.path.join(d, n)
        rel = os.path.relpath(p, root)
        files.append(rel)
        if rel.count(os.sep) > 2:
            bad.append(f"{rel} is more than 2 folders deep")
        if os.path.islink(p) or not os.path.isfile(p):
            bad.append(f"{rel} is not a plain file")
            continue
        size = os.path.getsize(p)
        total += size
        if size > 16 << 20:
            bad.append(f"{rel} is {size} bytes, over 16 MiB")
if len(files) > 8:
    bad.append(f"{len(files)} files, only 8 come back: {sorted(files)}")
if total > 64 << 20:
    bad.append(f"{total} bytes in all, over 64 MiB")
for b in bad:
    print(f"OUT CHECK FAILED: {b}")
sys.exit(1 if bad else 0)
EOF
}

# The run's stages and their verdicts (used by `run` and `selftest`). Globals: summary, logs, out,
# py, budget, t0, rehearsal; they set status (1 once anything failed) and failed (stages to rerun).
say() { echo "$*" | tee -a "$summary"; }
left() { echo $(( budget - ($(date +%s) - t0) )); }
cap() { local l; l=$(( $(left) - 5 )); echo $(( l < $1 ? l : $1 )); } # 5 s kept to pack logs
line() { # status seconds name [detail]
  printf '%-7s %4d s  %s%s\n' "$1" "$2" "$3" "${4:+  ($4)}" | tee -a "$summary"
}
first_lines() { # log: the failure's first lines, else the log's last ones
  local l
  l=$(grep -E 'panicked at|^Error|error(\[|:)|ERROR|Invalid |FAILED|failed|too old|older than' "$1" \
    | grep -Ev '^test result|^failures:$' | head -3 || true)
  [ -n "$l" ] || l=$(grep -v '^\s*$' "$1" | tail -3 || true)
  [ -z "$l" ] || echo "$l" | cut -c1-200 | sed 's/^/        | /' | tee -a "$summary"
}
# Why a stage skipped or failed: want of a device (fine in a rehearsal, a failure on the GPU
# machine), a test a single GPU cannot run (fine on either), or anything else (a failure).
no_device='no CUDA device|no usable CUDA device|CUDA_ERROR_NO_DEVICE|no CUDA-capable device|PyTorch is not installed|no CUDA GPU|custom_trainer: no GPU \(|no-driver stand-in'
one_gpu='one GPU|single GPU|second GPU|[0-9]+ GPUs|two GPUs|more than one'
expected_skip='this machine has CUDA device|CUDA is usable here'
judge() { # rc log name seconds [limit note]: writes the stage's line; sets $verdict
  local rc=$1 log=$2 name=$3 secs=$4 note=${5:-} skips nodev other
  skips=$(grep -E '(^|\.\.\. )SKIP ' "$log" | grep -Ev "$expected_skip" | sed 's/^test .* \.\.\. //' || true)
  nodev=$(grep -Em1 "$no_device" "$log" | sed 's/^test .* \.\.\. //' | cut -c1-140 || true)
  if [ -n "$rehearsal" ]; then
    other=$(echo "$skips" | grep -Ev "$no_device" | grep . || true)
  else
    other=$(echo "$skips" | grep -Ev "$one_gpu" | grep . || true)
  fi
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    verdict=FAIL; line FAIL "$secs" "$name" "timed out after $secs s$note"; first_lines "$log"
  elif [ -n "$rehearsal" ] && [ "$rc" != 0 ] && [ -n "$nodev" ] && [ -z "$other" ] \
       && ! grep -q 'panicked' "$log"; then
    verdict=SKIP; line SKIP "$secs" "$name" "no device: $nodev"
  elif [ "$rc" != 0 ]; then
    verdict=FAIL; line FAIL "$secs" "$name" "exit $rc"; first_lines "$log"
  elif [ -n "$nodev" ] && [ -z "$rehearsal" ]; then
    verdict=FAIL; line FAIL "$secs" "$name" "no device on the GPU machine: $nodev"
  elif [ -n "$other" ]; then
    verdict=FAIL; line FAIL "$secs" "$name" "unexpected SKIP"
    echo "$other" | head -3 | cut -c1-200 | sed 's/^/        | /' | tee -a "$summary"
  elif [ -n "$nodev" ]; then
    verdict=SKIP; line SKIP "$secs" "$name" "no device: $nodev"
  elif [ -n "$skips" ]; then
    verdict=SKIP; line SKIP "$secs" "$name" "$(echo "$skips" | head -1 | cut -c1-160)"
  else
    verdict=PASS; line PASS "$secs" "$name"
  fi
  [ "$verdict" != FAIL ] || status=1
}
# stage name needs_s max_s command...: run it with a timeout, its output in $logs/name.log.
# One that would start with less than needs_s of the budget left is NOT RUN, by name, so a
# run cut short still brings back what matters most.
stage() {
  local name=$1 need=$2 max=$3 rc s lim note=""; shift 3
  if [ "$(left)" -lt $(( need + 5 )) ]; then
    line "NOT RUN" 0 "$name" "needs ~$need s, $(left) s of the budget left"; not_run=$((not_run + 1)); return 0
  fi
  s=$(date +%s); rc=0 lim=$(cap "$max")
  [ "$lim" -ge "$max" ] || note=", its limit of $max s cut to $lim s by the budget"
  timeout -k 5 "$lim" "$@" >"$logs/$name.log" 2>&1 || rc=$?
  judge "$rc" "$logs/$name.log" "$name" $(( $(date +%s) - s )) "$note"
  if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$rc" != 137 ]; then failed+=("$name|$(printf '%q ' "$@")"); fi
  pack
}
# Once per failing stage, while the budget allows: again with cuDNN's own log (API calls,
# statuses, engine choices). A test binary reruns only the tests that failed.
rerun_failed() {
  local f name cmd tests rc s
  for f in "${failed[@]+"${failed[@]}"}"; do
    name=${f%%|*}; cmd=${f#*|}
    if [ "$(left)" -lt 20 ]; then line "NOT RUN" 0 "rerun-$name" "$(left) s of the budget left"; not_run=$((not_run + 1)); continue; fi
    tests=$(sed -n 's/^test \(.*\) \.\.\. FAILED$/\1/p' "$logs/$name.log" | tr '\n' ' ')
    s=$(date +%s); rc=0
    # (cmd is the stage's command, quoted by printf %q; test names are Rust paths.)
    (
      export CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG="$logs/rerun-$name.cudnn.log"
      eval "timeout -k 5 $(cap 60) $cmd ${tests:+--exact $tests}"
    ) >"$logs/rerun-$name.log" 2>&1 || rc=$?
    judge "$rc" "$logs/rerun-$name.log" "rerun-$name" $(( $(date +%s) - s ))
    pack
  done
  failed=()
}
# Every log, the plan caches' JSON (the engines chosen), CSVs and charts: one archive.
pack() {
  "$py" - "$logs" "$out/logs.tar.gz" <<'EOF' || echo "gpu-check: packing the logs failed" >&2
import io, os, sys, tarfile
logs, dest = sys.argv[1], sys.argv[2]
members = []
for d, _, names in os.walk(logs):
  members += [os.path.join(d, n) for n in sorted(names)]
# Where the trainer, the examples and the tests keep plans, and deviceless planning here.
for d in ("target/plan-cache", "target/plan-cache-deviceless"):
  for r, _, names in os.walk(d):
      members += [os.path.join(r, n) for n in sorted(names) if n.endswith(".json")]
cut = {}  # path -> bytes kept from each end, for logs too big to bring back
for _ in range(40):
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
      for p in members:
          arc = os.path.join("logs", os.path.relpath(p, logs)) if p.startswith(logs) else p.replace("target/", "", 1)
          if p in cut:
              data = open(p, "rb").read()
              keep = cut[p]
              data = data[:keep] + b"\n[... cut by gpu-check to fit 16 MiB ...]\n" + data[-keep:]
              info = tarfile.TarInfo(arc); info.size = len(data)
              tar.addfile(info, io.BytesIO(data))
          else:
              tar.add(p, arcname=arc)
  # Files of 16 MiB at most come back: halve the largest log until it fits.
  if buf.tell() <= 15 << 20 or not members:
      break
  big = max(members, key=lambda p: cut.get(p, os.path.getsize(p) // 2))
  cut[big] = cut.get(big, os.path.getsize(big) // 2) // 2
with open(dest + ".tmp", "wb") as f:
  f.write(buf.getvalue())
os.replace(dest + ".tmp", dest)
EOF
}

# The versions found, against what the bundle needs: cuDNN's minimum is the loader's ($1,
# crates/2-cudnn-fe-sys/src/loader.rs), the driver's and NVRTC's the CUDA version cudarc binds ($2,
# Cargo.toml's cuda-NNNNN feature). Writes $logs/versions.log, the summary's lines, and sets
# cudnn_version.
versions_stage() {
  local s rc=0
  s=$(date +%s)
  "$py" - "$1" "$2" >"$logs/versions.log" 2>&1 <<'EOF' || rc=$?
import ctypes, os, re, subprocess, sys
fails, nodev, parts = [], [], []
def const(name):
    m = re.search(rf"pub const {name}: usize = ([0-9_]+);", open(sys.argv[1]).read())
    if not m:
        sys.exit(f"FAIL cannot read {name} from {sys.argv[1]}")
    return int(m.group(1).replace("_", ""))
def dotted(v, base=100):
    return f"{v // (base * base)}.{v // base % base}.{v % base}"
need, deviceless = const("MIN_VERSION"), const("DEVICELESS_MIN_VERSION")
cuda = int(re.search(r'"cuda-(\d+)"', open(sys.argv[2]).read()).group(1))
def load(names):
    for n in names:
        try:
            return ctypes.CDLL(n), n
        except OSError:
            pass
    return None, None
d = os.environ.get("CUDNN_LIB_DIR")
lib, path = load(([os.path.join(d, "libcudnn.so.9")] if d else []) + ["libcudnn.so.9"])
if lib:
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    v = lib.cudnnGetVersion()
    parts.append(f"cuDNN {dotted(v)} ({path})")
    if v < need:
        fails.append(f"cuDNN {dotted(v)} at {path} is older than {dotted(need)}, the oldest our graphs need (MIN_VERSION, {sys.argv[1]})")
    elif v < deviceless:
        parts.append(f"deviceless planning needs {dotted(deviceless)}")
    print(f"cudnn_version {v}")
else:
    parts.append("cuDNN not found")
    fails.append(f"no libcudnn.so.9 (CUDNN_LIB_DIR={d})")
lib, path = load(["libnvrtc.so.13", "libnvrtc.so"])
if lib:
    a, b = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    parts.append(f"NVRTC {a.value}.{b.value}")
    if a.value * 1000 + b.value * 10 < cuda:
        fails.append(f"NVRTC {a.value}.{b.value} is older than CUDA {cuda // 1000}.{cuda % 1000 // 10}, which the bundle binds (Cargo.toml)")
else:
    parts.append("NVRTC not found"); fails.append("no libnvrtc.so.13 on the loader path")
lib, path = load(["libnccl.so.2", "libnccl.so"])
if lib:
    v = ctypes.c_int(); lib.ncclGetVersion(ctypes.byref(v))
    parts.append(f"NCCL {v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}")
else:
    parts.append("NCCL not found")
lib, path = load(["libcuda.so.1"])
v = ctypes.c_int()
if lib and lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value > 0:
    drv = ""
    try:
        drv = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.SubprocessError):
        pass
    parts.append(f"driver CUDA {v.value // 1000}.{v.value % 1000 // 10} ({drv or 'nvidia-smi gave nothing'})")
    if v.value < cuda:
        fails.append(f"the driver supports CUDA {v.value // 1000}.{v.value % 1000 // 10}, older than CUDA {cuda // 1000}.{cuda % 1000 // 10}, which the bundle binds (Cargo.toml)")
else:
    parts.append("no driver"); nodev.append("no usable CUDA driver (libcuda.so.1)")
try:
    from importlib.metadata import version, PackageNotFoundError
    try:
        parts.append(f"torch {version('torch')}")
    except PackageNotFoundError:
        parts.append("torch not installed")
except ImportError:
    pass
print("versions: " + " | ".join(parts))
for f in fails: print("FAIL " + f)
for n in nodev: print("NODEVICE " + n)
EOF
  grep '^versions: ' "$logs/versions.log" | tee -a "$summary" || true
  if [ "$rc" != 0 ] || grep -q '^FAIL ' "$logs/versions.log"; then
    status=1; line FAIL $(( $(date +%s) - s )) versions "$(grep -m1 '^FAIL ' "$logs/versions.log" | cut -c6- || true)"
    grep '^FAIL ' "$logs/versions.log" | tail -n +2 | cut -c6- | sed 's/^/        | /' | tee -a "$summary" || true
  elif grep -q '^NODEVICE ' "$logs/versions.log"; then
    if [ -n "$rehearsal" ]; then
      line SKIP $(( $(date +%s) - s )) versions "no device: $(grep -m1 '^NODEVICE ' "$logs/versions.log" | cut -c10-)"
    else
      status=1; line FAIL $(( $(date +%s) - s )) versions "$(grep -m1 '^NODEVICE ' "$logs/versions.log" | cut -c10-)"
    fi
  else
    line PASS $(( $(date +%s) - s )) versions
  fi
  cudnn_version=$(sed -n 's/^cudnn_version //p' "$logs/versions.log")
}

case "${1:-}" in
bundle)
  stage_dir=target/gpu-bundle-build
  rm -rf "$stage_dir" && mkdir -p "$stage_dir/gpu-bundle"
  # The whole workspace is built, as the test command builds it, so that the features of shared
  # dependencies are the same and `cargo test --release` afterwards reuses every artifact; only
  # what runs on a GPU is kept (CI runs every other test).
  cargo test --release --workspace --all-targets --no-run --locked --message-format=json \
    >"$stage_dir/cargo.json"
  python3 - "$stage_dir/cargo.json" >"$stage_dir/selected.txt" <<'EOF'
import json, re, sys
keep = []
for line in open(sys.argv[1]):
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind, name = m["target"]["kind"][0], m["target"]["name"]
    # GPU tests (tests/gpu_*, crates/3-amp/tests/gpu_*, crates/4-netops/tests/gpu_head.rs, crates/6-trainer/tests/gpu_train.rs) and the GPU benches;
    # nvrtc_compile needs no GPU (CI runs it), nor do the CPU benches.
    if (kind == "test" and name.startswith("gpu_")) or \
       (kind == "bench" and name in ("cbr_layers", "range_ops", "allreduce")):
        keep.append((f"{kind}-{name}", m["executable"]))
names = [k for k, _ in keep]
dupes = sorted({n for n in names if names.count(n) > 1})
if dupes:
    # Two binaries of one name would overwrite each other in the bundle.
    sys.exit("gpu-check bundle: binaries with the same name: " + ", ".join(
        f"{n} ({', '.join(e for k, e in keep if k == n)})" for n in dupes))
for k, e in sorted(keep):
    print(k, e)
EOF
  # The examples as programs (`cargo test` builds them as test harnesses); the same package
  # selection, so the dependencies built above are reused.
  cargo build --release --workspace --examples --locked
  while read -r name exe; do cp "$exe" "$stage_dir/gpu-bundle/$name"; done <"$stage_dir/selected.txt"
  for ex in train_cbr custom_trainer device_props deviceless_plans; do
    cp "target/release/examples/$ex" "$stage_dir/gpu-bundle/example-$ex"
  done
  # Debug info goes (it is most of each file); the symbol table stays, so a backtrace
  # (RUST_BACKTRACE=1) still names functions: 44 MB instead of 33 MB uncompressed, both
  # under 7 MB in the archive.
  strip --strip-debug "$stage_dir"/gpu-bundle/*
  # The CPU executor's bits on this machine (the weights hash of a short CPU run), for the
  # run half's cpu_bits stage to compare on the GPU machine's CPU: the same bits on every CPU
  # with FMA (crates/3-fusion/src/reference/direct.rs), whatever its vector width.
  cpu_hash=$(target/release/examples/train_cbr --device cpu --steps 20 |
    sed -n 's/.*weights hash \([0-9a-f]*\).*/\1/p')
  [ -n "$cpu_hash" ] || { echo "gpu-check bundle: the CPU run printed no weights hash" >&2; exit 1; }
  # And of a ResNet-18, whose reductions run over 512 deep: blocked as the gemm crate does for
  # a 32 KiB 8-way L1 cache on every CPU, whatever its own L1 (direct.rs).
  cpu_hash_resnet=$(target/release/examples/train_cbr --device cpu --net resnet18 --batch 4 \
    --hw 32 --steps 3 | sed -n 's/.*weights hash \([0-9a-f]*\).*/\1/p')
  [ -n "$cpu_hash_resnet" ] || { echo "gpu-check bundle: the ResNet-18 CPU run printed no weights hash" >&2; exit 1; }
  {
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m)"
    echo "cpu_bits $cpu_hash $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
    echo "cpu_bits_resnet18 $cpu_hash_resnet"
    (cd "$stage_dir/gpu-bundle" && ls -1 | grep -v '^MANIFEST$' | sed 's/^/binary /')
  } >"$stage_dir/gpu-bundle/MANIFEST"
  tar -C "$stage_dir" -cf - gpu-bundle | xz -T0 -6 >"$archive.tmp"
  mv "$archive.tmp" "$archive"
  echo "gpu-check bundle: $(grep -c '^binary ' "$stage_dir/gpu-bundle/MANIFEST") binaries," \
    "$(du -sb "$stage_dir/gpu-bundle" | cut -f1) bytes unpacked, $(stat -c %s "$archive") bytes in $archive"
  check_size
  echo "carry '$archive' and run: bash scripts/gpu-check.sh run"
  ;;

size)
  check_size
  ;;

run)
  t0=$(date +%s)
  budget=${GPU_CHECK_BUDGET_S:-330}
  rehearsal=${GPU_CHECK_REHEARSAL:-}
  bench_batch=${GPU_CHECK_BENCH_BATCH:-32}
  out=${OUT:-target/gpu-check}
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  summary=$out/summary.txt
  # The summary is the first file written, and grows line by line: a run cut short by the
  # time limit still brings back every stage that finished.
  : >"$summary"
  logs=target/gpu-check-logs
  rm -rf "$logs" target/plan-cache target/plan-cache-deviceless && mkdir -p "$logs"
  logs=$(cd "$logs" && pwd)
  bin=target/gpu-bundle

  if [ -f "$archive" ]; then
    rm -rf "$bin" && mkdir -p target
    if command -v xz >/dev/null; then
      tar -C target -xJf "$archive"
    else
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$archive" target
    fi
  fi
  [ -f "$bin/MANIFEST" ] || { say "FAIL: no $archive: run 'scripts/gpu-check.sh bundle' where Rust is, then carry it"; exit 1; }
  cp "$bin/MANIFEST" "$logs/MANIFEST"

  # The GPU machine's libraries: a Python that has torch (its virtualenv carries the cuDNN,
  # cuBLAS, NVRTC and NCCL wheels), every nvidia/*/lib folder of it on the loader path (cuDNN
  # loads cuBLASLt and NVRTC by name), and the CUDA toolkit's when there is one. An explicit
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
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"
  LD_LIBRARY_PATH=${LD_LIBRARY_PATH#:}
  if [ -z "${CUDNN_LIB_DIR:-}" ] && [ -n "$site" ] && [ -e "$site/nvidia/cudnn/lib/libcudnn.so.9" ]; then
    export CUDNN_LIB_DIR="$site/nvidia/cudnn/lib"
  fi
  if [ -z "${CUDNN_CBR_CUDA_INCLUDE:-}" ]; then
    for d in /usr/local/cuda/include "$site/nvidia/cu13/include" "$site/nvidia/cuda_runtime/include"; do
      if [ -e "$d/cuda_fp16.h" ]; then export CUDNN_CBR_CUDA_INCLUDE="$d"; break; fi
    done
  fi
  export RUST_BACKTRACE=1
  sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1 || true)

  {
    date -u
    nvidia-smi || true
    echo "python: $py"
    # The CPU model and its SIMD features, for the torch_cpu stage's figures.
    grep -m1 '^model name' /proc/cpuinfo || true
    grep -m1 '^flags' /proc/cpuinfo | grep -Eo 'avx512f|avx2|fma|f16c' | sort -u | tr '\n' ' ' || true
    echo
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "CUDNN_LIB_DIR=${CUDNN_LIB_DIR:-}"
    echo "CUDNN_CBR_CUDA_INCLUDE=${CUDNN_CBR_CUDA_INCLUDE:-}"
    echo "compute-sanitizer: ${sanitizer:-not found}"
    ls -l "${CUDNN_LIB_DIR:-/nonexistent}"/libcudnn*.so* 2>/dev/null || true
    "$py" -m pip list 2>/dev/null | grep -Ei '^(torch|nvidia-)' || true
  } >"$logs/machine.log" 2>&1

  status=0 not_run=0
  failed=()   # stages to rerun with cuDNN's log: "name|command"
  commit=$(sed -n 's/^commit //p' "$bin/MANIFEST")
  say "gpu-check run $(date -u +%Y-%m-%dT%H:%M:%SZ), bundle of commit $commit, budget $budget s${rehearsal:+, rehearsal without a GPU}"


  # 1. The versions found, against what the bundle needs.
  versions_stage crates/2-cudnn-fe-sys/src/loader.rs Cargo.toml
  # 2. The device's properties (the one file besides the summary and the logs).
  stage device_props 5 60 "$bin/example-device_props" "$out/device-props.json" \
    tests/fixtures/devprops/h200-sm90.json
  # 3. The classifier (the main job's trainer) and the worked example, on CUDA.
  stage train_cbr 15 90 "$bin/example-train_cbr" --device cuda
  ct_device=auto # `auto` falls back to the CPU with a "no GPU (...)" line, judged a failure here
  if "$bin/example-custom_trainer" --help 2>/dev/null | grep -q '\bcuda\b'; then ct_device=cuda; fi
  stage custom_trainer 10 60 "$bin/example-custom_trainer" --device "$ct_device" --steps 60
  # 4. Every GPU test, before any bench: the fundamental ones first, then any new one.
  order="gpu_conv gpu_own_kernels gpu_cbr_parity gpu_head gpu_range_kernels gpu_step gpu_nccl gpu_network gpu_train"
  tests=()
  for t in $order; do [ -x "$bin/test-$t" ] && tests+=("test-$t"); done
  for t in "$bin"/test-gpu_*; do
    t=$(basename "$t"); case " ${tests[*]} " in *" $t "*) ;; *) tests+=("$t") ;; esac
  done
  for t in "${tests[@]}"; do
    stage "$t" 10 120 "$bin/$t" --nocapture --test-threads=1
  done
  # 5. What failed so far, again with cuDNN's log: worth more than any bench number.
  rerun_failed
  # 6. Our own kernels under compute-sanitizer's memcheck (works on Firecracker machines).
  for t in test-gpu_own_kernels test-gpu_head test-gpu_range_kernels test-gpu_step; do
    [ -x "$bin/$t" ] || continue
    if [ -z "$sanitizer" ]; then
      line SKIP 0 "memcheck-$t" "compute-sanitizer not found"; continue
    fi
    stage "memcheck-$t" 20 60 "$sanitizer" --tool memcheck --error-exitcode 86 --print-limit 20 \
      "$bin/$t" --nocapture --test-threads=1
  done
  failed=() # a memcheck failure is its own report; rerunning it with cuDNN's log adds nothing
  # 7. The benches at a batch that fits the budget, PyTorch side by side at the same batch.
  export CBR_BENCH_BATCH=$bench_batch
  stage bench-cbr_layers 20 90 env OUT="$logs" "$bin/bench-cbr_layers" --bench
  stage torch_cbr 20 90 env OUT="$logs" PYTHONUNBUFFERED=1 "$py" benches/torch_cbr.py \
    --batch "$bench_batch" --compile-layers 1 --iters 10 --out "$logs"
  stage bench-range_ops 10 45 env OUT="$logs" "$bin/bench-range_ops" --bench
  stage bench-allreduce 10 45 env OUT="$logs" "$bin/bench-allreduce" --bench
  # 8. Deviceless planning (CPU work) with the real device's properties; a rehearsal has no
  # device to read, so the H200 fixture stands in.
  props=$out/device-props.json
  [ -n "$rehearsal" ] && [ ! -s "$props" ] && props=tests/fixtures/devprops/h200-sm90.json
  min_deviceless=$(sed -n 's/^pub const DEVICELESS_MIN_VERSION: usize = \([0-9_]*\);/\1/p' crates/2-cudnn-fe-sys/src/loader.rs | tr -d _)
  if [ ! -s "$props" ]; then
    status=1; line FAIL 0 deviceless_plans "no device properties (device_props failed)"
  elif [ -n "$cudnn_version" ] && [ -n "$min_deviceless" ] && [ "$cudnn_version" -lt "$min_deviceless" ]; then
    line SKIP 0 deviceless_plans "cuDNN $cudnn_version found is older than $min_deviceless, which deviceless planning needs"
  else
    stage deviceless_plans 10 60 "$bin/example-deviceless_plans" --props "$props" --batch 256 \
      --cache target/plan-cache-deviceless
    grep -E '^supported' "$logs/deviceless_plans.log" | sed 's/^/        | /' | tee -a "$summary" || true
  fi
  # 9. The CPU executor against PyTorch on this machine's CPU (model and features in
  # machine.log): our SIMD paths are chosen at run time, so the bundle's baseline build runs the
  # widest this CPU has.
  # Three alternating runs of each side, 600 steps: either side moves by +-15% run to run.
  stage torch_cpu 40 120 env PYTHONUNBUFFERED=1 "$py" benches/torch_cpu.py --threads 2 \
    --steps 600 --runs 3 --bin "$bin/example-train_cbr"
  grep -E '^(torch |ratio )' "$logs/torch_cpu.log" | sed 's/^/        | /' | tee -a "$summary" || true
  # 10. The same bits on this CPU as on the machine that built the bundle (MANIFEST's cpu_bits):
  # the main job, and a ResNet-18 (reductions over 512 deep, whatever this CPU's L1 cache).
  want_bits=$(sed -n 's/^cpu_bits \([0-9a-f]*\).*/\1/p' "$bin/MANIFEST")
  want_bits_resnet=$(sed -n 's/^cpu_bits_resnet18 \([0-9a-f]*\).*/\1/p' "$bin/MANIFEST")
  stage cpu_bits 5 45 sh -c 'hash() { sed -n "s/.*weights hash \([0-9a-f]*\).*/\1/p"; }
    got=$("$1" --device cpu --steps 20 | hash)
    got_resnet=$("$1" --device cpu --net resnet18 --batch 4 --hw 32 --steps 3 | hash)
    echo "CPU executor weights hash here $got, on the bundle machine ${2:-(none recorded)}"
    echo "ResNet-18 weights hash here $got_resnet, on the bundle machine ${3:-(none recorded)}"
    [ -n "$got" ] && [ "$got" = "$2" ] && [ -n "$got_resnet" ] && [ "$got_resnet" = "$3" ]' \
    cpu_bits "$bin/example-train_cbr" "$want_bits" "$want_bits_resnet"
  rerun_failed

  # The summary says what came back; the files are checked against the limits on what comes back.
  pack
  cp "$summary" "$logs/summary.txt"
  pack
  oc=$(check_out "$out") || status=1
  if [ -n "$oc" ]; then echo "$oc" | tee -a "$summary"; fi
  # Exit 0: every stage ran and none failed; 1: something failed; 3: nothing failed, but the
  # budget left stages NOT RUN (raise GPU_CHECK_BUDGET_S).
  if [ "$status" = 0 ] && [ "$not_run" -gt 0 ]; then status=3; fi
  say "done in $(( $(date +%s) - t0 )) s, status $status, $not_run NOT RUN; files: $(cd "$out" && find . -type f | sed 's|^\./||' | sort | tr '\n' ' ')"
  exit $status
  ;;

selftest)
  # The verdicts, reruns, packing and output checks of `run` on made-up stages, as the GPU
  # machine would judge them (a rehearsal cannot reach those branches). No bundle needed.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  summary=$tmp/summary.txt logs=$tmp/logs out=$tmp/out py=python3 rehearsal="" status=0 not_run=0
  failed=() t0=$(date +%s) budget=120
  mkdir -p "$logs" "$out"
  : >"$summary"
  errors=0
  expect() { # description, extended regex the summary must hold
    if grep -Eq "$2" "$summary"; then echo "ok: $1"; else echo "SELFTEST FAILED: $1 (no /$2/ in the summary)"; errors=$((errors + 1)); fi
  }
  stage pass 1 10 sh -c 'echo "test a ... ok"'
  stage nodev 1 10 sh -c 'echo "test a ... SKIP a: no CUDA device: CUDA device 0 cannot be opened"'
  stage onegpu 1 10 sh -c 'echo "test b ... SKIP b: one GPU cannot test a two-rank sum"'
  stage otherskip 1 10 sh -c 'echo "SKIP c: cuDNN not loadable"'
  stage fallback 1 10 sh -c 'echo "custom_trainer: no GPU (no CUDA device); the CPU executor trains"'
  stage panic 1 10 sh -c 'echo "thread main panicked at src/x.rs:1:2: boom"; exit 101'
  stage slow 1 1 sh -c 'sleep 10'
  stage late 1000 10 true
  budget=$(( $(date +%s) - t0 + 8 )) # 8 s left: a 60 s stage gets 3 (2 when a second ticks by)
  stage cut 1 60 sh -c 'sleep 10'
  budget=120
  # A test binary whose tests a and b fail: the rerun must name them and carry cuDNN's log.
  printf '#!/bin/sh\necho "$* | $CUDNN_LOGLEVEL_DBG $CUDNN_LOGDEST_DBG" >>%s/args\n%s\n' "$tmp" \
    'echo "test a ... FAILED"; echo "test b ... FAILED"; echo "test c ... ok"; exit 101' >"$tmp/fake"
  chmod +x "$tmp/fake"
  stage tests 1 10 "$tmp/fake" --nocapture
  rerun_failed
  expect "a clean stage passes" '^PASS +[0-9]+ s  pass$'
  expect "a SKIP for want of a device fails on the GPU machine" '^FAIL +[0-9]+ s  nodev  \(no device on the GPU machine'
  expect "a test one GPU cannot run skips" '^SKIP +[0-9]+ s  onegpu  \(SKIP b: one GPU'
  expect "any other SKIP fails" '^FAIL +[0-9]+ s  otherskip  \(unexpected SKIP\)'
  expect "a CPU fallback fails on the GPU machine" '^FAIL +[0-9]+ s  fallback  \(no device on the GPU machine'
  expect "a panic fails with its first lines" '^        \| thread main panicked at src/x.rs'
  expect "a stage past its time fails" '^FAIL +[0-9]+ s  slow  \(timed out'
  expect "a stage the budget cuts short says so" '^FAIL +[0-9]+ s  cut  \(timed out after [0-9]+ s, its limit of 60 s cut to [23] s by the budget\)'
  expect "a stage past the budget is NOT RUN" '^NOT RUN +0 s  late  \(needs ~1000 s'
  expect "a failing stage reruns" '^FAIL +[0-9]+ s  rerun-tests'
  expect "a rerun runs the same command" '^FAIL +[0-9]+ s  rerun-panic  \(exit 101\)'
  if grep -Eq -- "^--nocapture --exact a b \| 3 $logs/rerun-tests.cudnn.log$" "$tmp/args"; then
    echo "ok: the rerun runs only the failed tests, with cuDNN's log"
  else
    echo "SELFTEST FAILED: the rerun's arguments were: $(tail -1 "$tmp/args")"; errors=$((errors + 1))
  fi
  [ "$status" = 1 ] || { echo "SELFTEST FAILED: status $status after failures"; errors=$((errors + 1)); }
  [ "$not_run" = 1 ] || { echo "SELFTEST FAILED: $not_run stages NOT RUN, not 1"; errors=$((errors + 1)); }
  # In a rehearsal, a failure for want of a device is a SKIP; a panic stays a failure.
  rehearsal=1
  stage r-nodev 1 10 sh -c 'echo "train_cbr: no usable CUDA device: CUDA_ERROR_NO_DEVICE"; exit 1'
  stage r-panic 1 10 sh -c 'echo "no CUDA device"; echo "thread main panicked at x"; exit 101'
  expect "a rehearsal skips for want of a device" '^SKIP +[0-9]+ s  r-nodev  \(no device: '
  expect "a rehearsal still fails a panic" '^FAIL +[0-9]+ s  r-panic  \(exit 101\)'
  # The versions: a cuDNN older than the loader's minimum fails with one line naming both; a
  # loader whose minimum cannot be read fails too. (Needs cuDNN: source .deps/env.sh, as the test
  # command does.)
  printf 'pub const MIN_VERSION: usize = 99_00_00;\npub const DEVICELESS_MIN_VERSION: usize = 99_08_00;\n' >"$tmp/old.rs"
  versions_stage "$tmp/old.rs" Cargo.toml
  if grep -q '^versions: cuDNN not found' "$logs/versions.log"; then
    echo "SELFTEST FAILED: no cuDNN to check the versions stage with (source .deps/env.sh first)"
    errors=$((errors + 1))
  fi
  expect "a cuDNN older than the minimum fails, naming both" '^FAIL +[0-9]+ s  versions  \(cuDNN [0-9.]+ at .* is older than 99\.0\.0, the oldest'
  : >"$tmp/none.rs"
  versions_stage "$tmp/none.rs" Cargo.toml
  expect "an unreadable minimum fails" '^FAIL +[0-9]+ s  versions  \(cannot read MIN_VERSION'
  # A log too big to come back is cut to fit; the archive stays one file under 16 MiB.
  head -c $((40 << 20)) /dev/urandom >"$logs/huge.cudnn.log"
  pack
  size=$(stat -c %s "$out/logs.tar.gz")
  tar -xzOf "$out/logs.tar.gz" logs/huge.cudnn.log >"$tmp/huge.back"
  if [ "$size" -le $((16 << 20)) ] && grep -aq 'cut by gpu-check' "$tmp/huge.back"; then
    echo "ok: a 40 MiB log is cut to fit ($size bytes packed)"
  else
    echo "SELFTEST FAILED: packing a 40 MiB log gave $size bytes"; errors=$((errors + 1))
  fi
  # What comes back is checked: 9 files, a folder 3 deep, a name with a space each fail.
  check_out "$out" >/dev/null || { echo "SELFTEST FAILED: a valid \$OUT is refused"; errors=$((errors + 1)); }
  for bad in nine deep name; do
    rm -rf "$tmp/bad" && mkdir -p "$tmp/bad"
    case $bad in
      nine) for i in 1 2 3 4 5 6 7 8 9; do : >"$tmp/bad/f$i"; done ;;
      deep) mkdir -p "$tmp/bad/a/b/c" && : >"$tmp/bad/a/b/c/f" ;;
      name) : >"$tmp/bad/a b" ;;
    esac
    if check_out "$tmp/bad" >/dev/null; then
      echo "SELFTEST FAILED: check_out accepts $bad"; errors=$((errors + 1))
    else
      echo "ok: check_out refuses $bad"
    fi
  done
  [ "$errors" = 0 ] || { echo "selftest: $errors failed; the summary it wrote:"; cat "$summary"; exit 1; }
  echo "selftest: all passed"
  ;;

rehearse)
  # The run half without a GPU, from a copy of the repository at another path (as on the GPU
  # machine), then assertions on what it wrote; any failed assertion fails CI.
  started=$(date +%s)
  check_size
  copy=$(mktemp -d)
  trap 'rm -rf "$copy"' EXIT
  # What travels to a GPU machine: tracked files and untracked ones git does not ignore.
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard \
      | while IFS= read -r -d '' f; do if [ -e "$f" ]; then printf '%s\0' "$f"; fi; done \
      | xargs -0 cp --parents --no-dereference -t "$copy"
  else
    tar --exclude=./target --exclude=./.deps --exclude="./$archive" -cf - . | tar -xf - -C "$copy"
  fi
  cp "$archive" "$copy/"
  out=$(pwd)/target/gpu-check-rehearsal
  rm -rf "$out"
  rc=0
  (cd "$copy" && GPU_CHECK_REHEARSAL=1 OUT="$out" bash scripts/gpu-check.sh run) || rc=$?
  [ -f "$copy/target/gpu-bundle/MANIFEST" ] && cp "$copy/target/gpu-bundle/MANIFEST" "$out.MANIFEST"
  echo
  echo "== rehearsal: $(( $(date +%s) - started )) s; run exited $rc; files in $out:"
  (cd "$out" && find . -type f -printf '%P %s bytes\n' | sort)
  outcheck=0
  check_out "$out" || outcheck=1
  python3 - "$out" "$rc" "$out.MANIFEST" "$outcheck" <<'EOF'
import os, re, sys, tarfile
out, rc, manifest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
errors = []
def expect(ok, what):
    if not ok:
        errors.append(what)
expect(sys.argv[4] == "0", "the files in $OUT break the limits on what comes back (above)")
files = sorted(os.listdir(out))
expect("summary.txt" in files, "no summary.txt")
lines = open(os.path.join(out, "summary.txt")).read().splitlines()
expect(lines and lines[0].startswith("gpu-check run "), "summary.txt does not begin with its header")
expect(any(l.startswith("versions: ") for l in lines), "no versions line")
stages = []
for l in lines:
    m = re.match(r"^(PASS|FAIL|SKIP|NOT RUN) +(\d+) s  (\S+)(?:  \((.*)\))?$", l)
    if m:
        stages.append(m.groups())
names = [s[2] for s in stages]
for st, secs, name, detail in stages:
    # Without a GPU a stage passes, or skips or fails for want of a device (the run reports
    # that as SKIP "no device: ..."); the sanitizer is the GPU machine's tool.
    ok = st == "PASS" or (st == "SKIP" and detail is not None and (
        detail.startswith("no device: ") or detail == "compute-sanitizer not found"))
    expect(ok, f"stage {name}: {st} ({detail}) is neither a pass nor for want of a device")
expect(names[:4] == ["versions", "device_props", "train_cbr", "custom_trainer"],
       f"the first stages are {names[:4]}, not versions, device_props, train_cbr, custom_trainer")
tests = [i for i, n in enumerate(names) if n.startswith("test-gpu_")]
benches = [i for i, n in enumerate(names) if n.startswith("bench-") or n.startswith("torch_")]
expect(tests and benches and max(tests) < min(benches), "a bench runs before a GPU test")
bundled = [l.split()[1] for l in open(manifest) if l.startswith("binary ")]
for b in bundled:
    expect(b in names or b.replace("example-", "") in names, f"{b} is bundled but no stage runs it")
for n in ("test-gpu_own_kernels", "bench-cbr_layers", "example-train_cbr"):
    expect(n in bundled, f"{n} is not in the bundle")
done = [l for l in lines if l.startswith("done in ")]
expect(done and ", status 0, 0 NOT RUN;" in done[-1], f"the run's status is not 0: {done}")
expect(rc == 0, f"the run exited {rc}")
expect("logs.tar.gz" in files, "no logs.tar.gz")
if "logs.tar.gz" in files:
    members = tarfile.open(os.path.join(out, "logs.tar.gz")).getnames()
    for st, secs, name, detail in stages:
        if detail != "compute-sanitizer not found":
            expect(f"logs/{name}.log" in members, f"no logs/{name}.log in logs.tar.gz")
    expect(any(m.startswith("plan-cache") and m.endswith(".json") for m in members),
           "no plan-cache JSON in logs.tar.gz")
    expect("logs/summary.txt" in members and "logs/MANIFEST" in members,
           "no summary or MANIFEST in logs.tar.gz")
    expect(any(n.startswith("rerun-") for n in names), "no stage was rerun with cuDNN's log")
for e in errors:
    print("REHEARSAL ASSERTION FAILED: " + e)
print(f"rehearsal: {len(stages)} stages, {len(files)} files back ({', '.join(files)}), "
      f"{len(errors)} failed assertions")
sys.exit(1 if errors else 0)
EOF
  ;;
*)
  echo "usage: scripts/gpu-check.sh bundle|run|rehearse|size|selftest" >&2
  exit 2
  ;;
esac
