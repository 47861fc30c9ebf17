#!/usr/bin/env bash
# The project's test command (README: "Run all tests"; .ci/run calls exactly this).
# Installs the test dependencies, then: formatting, clippy, the bindings check, and every test
# of the workspace. Works on a machine with no GPU and no CUDA.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }

step "test dependencies"
./scripts/setup-test-deps.sh
# shellcheck source=/dev/null
source "${CUDNN_CBR_DEPS_DIR:-.deps}/env.sh"

# The bindings check needs libclang itself (libclang.so or libclang-N.so, not libclang-cpp,
# which some machines have without it). In CI a check that cannot run is a failure, so CI
# installs it from the distribution and stops when it cannot; elsewhere the check prints a SKIP
# line naming why.
if [ -n "${CI:-}" ] && ! ldconfig -p 2>/dev/null | grep -Eq 'libclang(-[0-9.]+)?\.so' \
   && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  step "installing libclang for the bindings check"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends libclang1-14 libclang-common-14-dev >/dev/null; } \
    || { echo "could not install libclang, which CI's bindings check needs" >&2; exit 1; }
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
# (--release: its proc macros and build scripts are the ones the release build below reuses.)
cargo clippy --release --workspace --all-targets --locked -- -D warnings

step "bindings reproduce byte for byte"
cargo xtask gen-bindings --check

step "GPU-check scripts: syntax, the run's verdicts on made-up stages, and their no-GPU paths"
bash -n scripts/gpu-check.sh
./scripts/gpu-check.sh selftest
python3 -m py_compile benches/torch_cbr.py
python3 benches/torch_cbr.py --out target/bench
python3 -m py_compile benches/torch_cpu.py
python3 benches/torch_cpu.py --selftest
python3 benches/torch_cpu.py

if [ -n "${CI:-}" ]; then
  # The CPU half of the GPU check (docs/gpu-check.md): release-build the workspace and pack the
  # binaries a GPU machine runs into one archive (skipped outside CI to keep local runs quick).
  step "gpu-check bundle (release build of the workspace; the GPU binaries in one archive)"
  ./scripts/gpu-check.sh bundle
  step "gpu-check size (the archive and the tree that travel, against the limit)"
  ./scripts/gpu-check.sh size
  step "gpu-check rehearsal (its run half without a GPU, from a copy elsewhere, then assertions)"
  ./scripts/gpu-check.sh rehearse
fi

# Release profile: CI's gpu-check bundle has just built these same binaries, so this reuses
# them instead of a second (debug) build of the workspace; our own crates keep overflow checks
# and debug assertions in release (Cargo.toml), so tests lose no checks.
step "examples (the bad-input table runs them; in CI the bundle has built them already)"
cargo build --release --workspace --examples --locked

step "cargo test (release): every test binary of the workspace, one per core at a time"
# The binaries `cargo test --release --workspace --all-targets` builds and runs, run by
# scripts/run-tests.py several at a time (cargo runs them one after another, and many leave a
# core idle for long stretches); each as cargo runs it, in its package's folder.
python3 scripts/run-tests.py --locked

step "cargo doc (no broken or private intra-doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc --release --workspace --no-deps --locked

step "doc examples (the README tour among them)"
# (The same package selection as above, so the release artifacts are reused as they are.)
cargo test --release --workspace --doc --locked

step "done in $(( $(date +%s) - start )) s"
