#!/usr/bin/env python3
"""Runs every test binary of the workspace, as `cargo test --release --workspace --all-targets`
runs them, but several at a time.

`cargo test` runs its binaries one after another, and many spend long stretches on one core (a
single long test, cuDNN's single-threaded deviceless planning, a child process): on a two-core
machine the other core idles. This runner asks cargo for the same binaries (`--no-run`, so the
selection and the features are exactly the test command's and nothing is rebuilt), then runs
them JOBS at a time (`CUDNN_CBR_TEST_JOBS`, default: the number of cores), each as cargo would:
no arguments, in its package's folder, with its package's variables. Each binary's output is
printed whole when it ends; the run fails when any binary fails, and names them.

Usage: scripts/run-tests.py [extra cargo arguments, e.g. --locked]
"""

import json
import os
import subprocess
import sys
import threading
import time

# Order hint only: the binaries that take longest start first, so that the last to finish is a
# short one. Every binary runs whether it is named here or not.
LONG_FIRST = [
    "sim_gpu_fusion",
    "sim_train",
    "fuzz_graphs",
    "inference_plans",
    "network_plans",
    "sim_cifar",
    "planned_gpu_shapes",
    "shared_arena",
    "bf16_canary",
]


def binaries(cargo_args):
    """(label, executable, package folder, package name) of every test binary, in cargo's order."""
    cmd = ["cargo", "test", "--release", "--workspace", "--all-targets", "--no-run",
           "--message-format=json-render-diagnostics", *cargo_args]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=False)
    if out.returncode != 0:
        sys.exit(f"run-tests: building the test binaries failed ({' '.join(cmd)})")
    found = []
    for line in out.stdout.decode().splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        if not m["profile"]["test"]:
            continue
        folder = os.path.dirname(m["manifest_path"])
        src = os.path.relpath(m["target"]["src_path"], folder)
        kind = m["target"]["kind"][0]
        label = f"unittests {src}" if kind in ("lib", "bin", "example") else src
        # "path+file:///dir#name@1.0", or "path+file:///name#1.0" when the folder is the name.
        url, _, frag = m["package_id"].partition("#")
        package = frag.split("@")[0] if "@" in frag else url.rstrip("/").split("/")[-1]
        found.append((label, m["target"]["name"], m["executable"], folder, package))
    return found


def main():
    cargo_args = sys.argv[1:]
    found = binaries(cargo_args)
    if not found:
        sys.exit("run-tests: cargo listed no test binaries")
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    queue = sorted(found, key=lambda b: rank.get(b[1], len(LONG_FIRST)))
    jobs = int(os.environ.get("CUDNN_CBR_TEST_JOBS") or os.cpu_count() or 2)
    root = os.getcwd()
    deps = os.path.join(root, "target", "release", "deps")
    lock = threading.Lock()
    failed = []
    start = time.time()
    done = [0]

    def run(b):
        label, _, exe, folder, package = b
        env = dict(os.environ)
        env["CARGO_MANIFEST_DIR"] = folder
        env["CARGO_PKG_NAME"] = package
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (deps, env.get("LD_LIBRARY_PATH", "")) if p)
        t = time.time()
        p = subprocess.run([exe], cwd=folder, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, check=False)
        took = time.time() - t
        with lock:
            done[0] += 1
            rel = os.path.relpath(exe, root)
            print(f"     Running {label} ({rel}) [{package}]")
            sys.stdout.write(p.stdout.decode(errors="replace"))
            verdict = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode})"
            print(f"[tests] {done[0]}/{len(queue)} {label} [{package}]: {verdict} in "
                  f"{took:.1f} s ({time.time() - start:.0f} s since the start)\n", flush=True)
            if p.returncode != 0:
                failed.append(f"{label} [{package}]")

    pending = list(queue)

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                b = pending.pop(0)
            run(b)

    print(f"[tests] {len(queue)} test binaries, {jobs} at a time", flush=True)
    threads = [threading.Thread(target=worker) for _ in range(max(1, jobs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(f"[tests] {len(queue)} binaries in {time.time() - start:.0f} s; "
          f"{len(failed)} failed", flush=True)
    if failed:
        print("failed:\n  " + "\n  ".join(failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
