#!/usr/bin/env bash
# Runs a command on the simulated CUDA device (docs/simulator.md):
#   scripts/sim-env.sh cargo test --release -p cudnn-cbr-amp --test gpu_step
# Sources the test dependencies, builds the simulator if needed, puts its folder first on
# the loader path (so cudarc's "libcuda.so" and "libnvrtc.so" are the simulator's, while
# cuDNN's "libcuda.so.1" stays the no-driver stand-in, and amp's NCCL is the simulated
# libnccl.so.2) and selects it.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=${CUDNN_CBR_DEPS_DIR:-$root/.deps}
# The caller's simulator folder wins over the one env.sh names (a worktree building its own).
callers_sim=${CUDNN_CBR_SIM_DIR:-}
# shellcheck source=/dev/null
source "$deps/env.sh"
sim=${callers_sim:-${CUDNN_CBR_SIM_DIR:-$deps/sim}}
bash "$root/tools/sim/build.sh" "$sim" >&2
export CUDNN_CBR_SIM_DIR="$sim"
export CUDNN_CBR_DEVICE=sim
export LD_LIBRARY_PATH="$sim:$LD_LIBRARY_PATH"
# amp opens NCCL from $NCCL_LIB_DIR first: the simulated NCCL, not a real one found elsewhere.
export NCCL_LIB_DIR="$sim"
# Machine code compiled under the simulator carries its program text: keep it apart from a
# real GPU's kernel cache.
export CUDNN_CBR_KERNEL_CACHE="${CUDNN_CBR_SIM_KERNEL_CACHE:-$sim/kernel-cache}"
export CUDNN_CBR_SIM_CACHE="${CUDNN_CBR_SIM_CACHE:-$sim/host-cache}"
exec "$@"
