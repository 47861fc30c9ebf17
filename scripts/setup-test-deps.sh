#!/usr/bin/env bash
# Installs what the test tiers need on a machine without CUDA: the pinned cuDNN, cuBLASLt and
# NVRTC libraries and the CUDA headers (from PyPI wheels), and, where no real driver exists, a
# no-driver libcuda stand-in. Everything lands in a git-ignored folder ($CUDNN_CBR_DEPS_DIR,
# default .deps/ in the repository) and a complete folder is reused without downloading.
# Writes $DEPS/env.sh, which the test command sources.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=${CUDNN_CBR_DEPS_DIR:-$root/.deps}
python=${PYTHON:-python3}

# Pinned versions: change them together with docs/architecture.md (its requirements) and the
# checked-in bindings.
pins=(
  "nvidia-cudnn-cu13==9.28.1.4"
  "nvidia-cublas==13.10.0.20"
  "nvidia-cuda-nvrtc==13.5.37"
  "nvidia-cuda-runtime==13.5.37"
)
stamp_text=$(printf '%s\n' "${pins[@]}")

say() { echo "[test-deps] $*"; }
die() { echo "[test-deps] ERROR: $*" >&2; exit 1; }

mkdir -p "$deps"
if [ -f "$deps/COMPLETE" ] && [ "$(cat "$deps/COMPLETE")" = "$stamp_text" ] \
   && [ -f "$deps/lib/libcudnn.so.9" ] && [ -f "$deps/include/cudnn_graph.h" ]; then
  say "reusing complete cache in $deps ($(du -sh "$deps" | cut -f1))"
else
  rm -rf "$deps/lib" "$deps/include" "$deps/wheels" "$deps/COMPLETE"
  mkdir -p "$deps/wheels" "$deps/lib" "$deps/include"
  say "downloading ${pins[*]}"
  start=$(date +%s)
  "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$deps/wheels" "${pins[@]}" \
    || die "pip download failed (is the package registry reachable?)"
  bytes=$(du -sb "$deps/wheels" | cut -f1)
  say "downloaded $((bytes / 1048576)) MiB in $(( $(date +%s) - start )) s"
  # Unpack only the members we need, flattening their folders.
  "$python" - "$deps" <<'PY' || die "unpacking the wheels failed"
import fnmatch, os, shutil, sys, zipfile
deps = sys.argv[1]
wanted = {  # wheel-name prefix -> [(member glob, destination folder)]
    "nvidia_cudnn_cu13": [("nvidia/cudnn/lib/libcudnn*.so.9", "lib"),
                          ("nvidia/cudnn/include/cudnn*.h", "include")],
    "nvidia_cublas": [("nvidia/cu13/lib/libcublasLt.so.13", "lib")],
    "nvidia_cuda_nvrtc": [("nvidia/cu13/lib/libnvrtc*.so.*", "lib"),
                          ("nvidia/cu13/include/nvrtc.h", "include")],
    "nvidia_cuda_runtime": [("nvidia/cu13/include/*", "include")],
}
wheels = os.listdir(os.path.join(deps, "wheels"))
for prefix, rules in wanted.items():
    matches = [w for w in wheels if w.startswith(prefix + "-") and w.endswith(".whl")]
    if len(matches) != 1:
        sys.exit(f"expected one {prefix} wheel, found {matches}")
    with zipfile.ZipFile(os.path.join(deps, "wheels", matches[0])) as zf:
        for pattern, dest in rules:
            members = [m for m in zf.namelist() if fnmatch.fnmatch(m, pattern)]
            if not members:
                sys.exit(f"{matches[0]}: nothing matches {pattern}")
            for m in members:
                # Keep sub-folders below include/ (cooperative_groups/...); flatten the rest.
                rel = m.split("/include/", 1)[1] if dest == "include" else os.path.basename(m)
                out = os.path.join(deps, dest, rel)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with zf.open(m) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    print(f"[test-deps] unpacked {matches[0]}")
PY
  rm -rf "$deps/wheels"
  printf '%s\n' "$stamp_text" > "$deps/COMPLETE"
  say "unpacked into $deps ($(du -sh "$deps" | cut -f1))"
fi

# The no-driver libcuda stand-in: only where no real driver is installed.
stub_dir="$deps/nodriver"
real_driver=""
if command -v ldconfig >/dev/null 2>&1; then
  real_driver=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')
fi
if [ -z "$real_driver" ]; then
  for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib /usr/local/cuda/compat; do
    if [ -e "$d/libcuda.so.1" ]; then real_driver="$d/libcuda.so.1"; break; fi
  done
fi
if [ -n "$real_driver" ]; then
  say "real CUDA driver found at $real_driver: no stand-in built"
  rm -rf "$stub_dir"
else
  mkdir -p "$stub_dir"
  src="$root/scripts/nodriver/libcuda_stub.c"
  if [ ! -f "$stub_dir/libcuda.so.1" ] || [ "$src" -nt "$stub_dir/libcuda.so.1" ]; then
    ${CC:-cc} -shared -fPIC -O2 -Wall -Werror -o "$stub_dir/libcuda.so.1" "$src" \
      || die "building the no-driver libcuda stand-in failed"
    say "no CUDA driver: built the no-driver stand-in $stub_dir/libcuda.so.1"
  else
    say "no CUDA driver: reusing the no-driver stand-in $stub_dir/libcuda.so.1"
  fi
fi

# The simulated CUDA device (docs/simulator.md): built always (gcc/g++ only, a few seconds),
# selected only by scripts/sim-env.sh, so nothing here changes the default behaviour.
CUDNN_CBR_CUDA_INCLUDE="$deps/include" CUDNN_CBR_LIB_DIR="$deps/lib" \
  bash "$root/tools/sim/build.sh" "$deps/sim" \
  || say "WARNING: building the simulated device (tools/sim/build.sh) failed; the sim_* tests will fail"

ld_path="$deps/lib"
[ -d "$stub_dir" ] && ld_path="$stub_dir:$ld_path"
cat > "$deps/env.sh" <<ENV
# Written by scripts/setup-test-deps.sh; sourced by the test command.
export CUDNN_LIB_DIR="$deps/lib"
export CUDNN_CBR_CUDA_INCLUDE="$deps/include"
export CUDNN_CBR_SIM_DIR="$deps/sim"
export LD_LIBRARY_PATH="$ld_path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
ENV
say "wrote $deps/env.sh (CUDNN_LIB_DIR=$deps/lib)"
