#!/usr/bin/env bash
# Builds the simulated CUDA device into OUT (default .deps/sim): libcudasim_rt.so (the
# fiber runtime), the translator, the primitive-test binary, the simulated NCCL's
# multi-rank check (nccl-check), the header folder the driver
# compiles kernels against, the driver (libcuda.so), NVRTC and NCCL (libnccl.so.2) stand-ins. Rebuilds only what is older than its sources.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-$here/../../.deps/sim}
mkdir -p "$out/include"
out=$(cd "$out" && pwd)
cxx=${CXX:-g++}
flags=(-std=c++17 -O2 -g0 -Wall -Wextra -ffp-contract=off -fno-strict-aliasing)
stale() { local t=$1; shift; [ ! -e "$t" ] || [ -n "$(find "$@" -newer "$t" 2>/dev/null)" ]; }

cp -p "$here"/include/*.h "$out/include/"
if stale "$out/libcudasim_rt.so" "$here/runtime.cc" "$here/include"; then
  "$cxx" "${flags[@]}" -fPIC -shared -o "$out/libcudasim_rt.so" "$here/runtime.cc"
fi
if stale "$out/cudasim-translate" "$here/translate.cc" "$here/translate.h"; then
  "$cxx" "${flags[@]}" -DCUDASIM_TRANSLATE_MAIN -o "$out/cudasim-translate" "$here/translate.cc"
fi
if stale "$out/primitives" "$here/tests/primitives.cu" "$here/include" "$out/libcudasim_rt.so" \
   "$out/cudasim-translate"; then
  "$out/cudasim-translate" primitives.cu < "$here/tests/primitives.cu" > "$out/primitives.cc"
  "$cxx" "${flags[@]}" -Wno-unknown-pragmas -Wno-unused-parameter -I"$out/include" \
    -include cuda_on_cpu.h -x c++ "$out/primitives.cc" -x none -o "$out/primitives" \
    -L"$out" -lcudasim_rt -Wl,-rpath,"$out"
fi
# The driver, NCCL and NVRTC stand-ins need the CUDA headers and the real NVRTC (test deps).
inc=${CUDNN_CBR_CUDA_INCLUDE:-$here/../../.deps/include}
lib=${CUDNN_CBR_LIB_DIR:-${CUDNN_LIB_DIR:-$here/../../.deps/lib}}
cp -p "$here/../../tests/fixtures/devprops/h200-sm90.json" "$out/devprops.json"
if stale "$out/libcuda.so" "$here/driver" "$here/translate.cc" "$here/translate.h" "$here/include"; then
  "$cxx" "${flags[@]}" -Wno-unused-parameter -fPIC -shared -fvisibility=hidden -I"$inc" \
    -o "$out/libcuda.so" "$here"/driver/*.cc "$here/translate.cc" -ldl \
    -Wl,-soname,libcudnn_cbr_sim_cuda.so
fi
if stale "$out/libnccl.so.2" "$here/nccl.cc"; then
  "$cxx" "${flags[@]}" -fPIC -shared -fvisibility=hidden -I"$inc" -o "$out/libnccl.so.2" \
    "$here/nccl.cc" -ldl -lpthread -Wl,-soname,libnccl.so.2
fi
if stale "$out/nccl-check" "$here/tests/nccl.cc"; then
  "$cxx" "${flags[@]}" -I"$inc" -o "$out/nccl-check" "$here/tests/nccl.cc" -ldl -lpthread
fi
if stale "$out/libnvrtc.so" "$here/nvrtc_shim.c"; then
  ${CC:-gcc} -O2 -Wall -fPIC -shared -o "$out/libnvrtc.so" "$here/nvrtc_shim.c" \
    -L"$lib" -Wl,--no-as-needed -l:libnvrtc.so.13 -Wl,--as-needed -ldl -lpthread -Wl,-soname,libnvrtc.so
fi
echo "[sim] built the simulated device in $out"
