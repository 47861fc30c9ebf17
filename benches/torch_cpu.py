#!/usr/bin/env python3
"""PyTorch CPU side-by-side for the main job on the CPU executor: trains the same network
(crates/6-trainer/src, `--net mini`: a 3x3 stem to `width` channels, a basic block of `width`, a basic
block of 2*width with stride 2 and a 1x1 projection shortcut, global average pool, FC; or with
`--net resnet18|resnet34|resnet50` torchvision's ResNet v1.5 on 8 input channels, as
src/net/spec.rs builds them) on
`batch` images of hw x hw x 8 (8 classes) with SGD (lr, momentum 0.9, weight decay 5e-4) in
eager float32, channels_last, on `--threads` threads; then runs our main job
(`train_cbr --device cpu` with the same shapes, steps and thread count) and prints one table
with both throughputs and their ratio.

PyTorch trains on a fixed pool of random batches made before timing; the first `--warmup`
steps are not timed. Ours generates its synthetic batches inside its loop and reports images
per second over all its steps (its own summary line); its progress lines (`step a/N ... R
img/s`, each the throughput since its start) give the time of its steps after the first
`--warmup` too, and the ratio compares like with like: both sides after their warm-up steps
(the ratio with ours over all steps follows it; on short runs of big networks the first steps,
which touch every buffer for the first time, weigh on the second). Without PyTorch it prints one SKIP line
and exits 0; without the train_cbr binary it says how to build it and exits 0.

`--simd avx2` runs both sides as on a CPU without AVX-512: PyTorch with
`ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` (its own kernels and oneDNN's
convolutions), ours with `CUDNN_CBR_CPU_SIMD=avx2` (the same bits, AVX2 lanes).

`--runs N` alternates N runs of each side (PyTorch first) and prints every run's pair, then
the range and median of the ratios: on a shared machine either side moves by +-15% from run to
run. The header names the CPU model (`/proc/cpuinfo`), which the ratio depends on.

    python3 benches/torch_cpu.py [--net mini] [--steps 200] [--threads 2] [--batch 32]
        [--hw 16] [--width 16] [--simd avx512|avx2] [--runs 1]
        [--bin target/release/examples/train_cbr]
"""
import argparse
import os
import re
import subprocess
import sys
import time

DEFAULT_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "target",
                           "release", "examples", "train_cbr")
CHANNELS, CLASSES = 8, 8


def torch_net(torch, width, classes):
    nn = torch.nn

    def cbr(cin, cout, stride):
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(cout)]

    class Basic(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            c1, b1 = cbr(cin, cout, stride)
            c2, b2 = cbr(cout, cout, 1)
            self.conv1, self.bn1, self.conv2, self.bn2 = c1, b1, c2, b2
            self.short = None
            if cin != cout or stride != 1:
                self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                           nn.BatchNorm2d(cout))

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            s = x if self.short is None else self.short(x)
            return torch.relu(y + s)

    stem = cbr(CHANNELS, width, 1)
    return nn.Sequential(stem[0], stem[1], nn.ReLU(), Basic(width, width, 1),
                         Basic(width, 2 * width, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * width, classes))


RESNETS = {"resnet18": ([2, 2, 2, 2], False), "resnet34": ([3, 4, 6, 3], False),
           "resnet50": ([3, 4, 6, 3], True)}


def torch_resnet(torch, blocks, bottleneck, classes):
    """torchvision's ResNet v1.5 (the stride in the 3x3 of a bottleneck), written out."""
    nn = torch.nn
    expansion = 4 if bottleneck else 1

    def conv_bn(cin, cout, k, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
                             nn.BatchNorm2d(cout))

    class Block(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            out = width * expansion
            if bottleneck:
                convs = [conv_bn(cin, width, 1, 1), conv_bn(width, width, 3, stride),
                         conv_bn(width, out, 1, 1)]
            else:
                convs = [conv_bn(cin, width, 3, stride), conv_bn(width, out, 3, 1)]
            self.convs = nn.ModuleList(convs)
            self.short = None
            if stride != 1 or cin != out:
                self.short = conv_bn(cin, out, 1, stride)

        def forward(self, x):
            y = x
            for i, c in enumerate(self.convs):
                y = c(y)
                if i + 1 < len(self.convs):
                    y = torch.relu(y)
            return torch.relu(y + (x if self.short is None else self.short(x)))

    layers = [conv_bn(CHANNELS, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
    cin = 64
    for i, n in enumerate(blocks):
        for j in range(n):
            layers.append(Block(cin, 64 << i, 2 if i > 0 and j == 0 else 1))
            cin = (64 << i) * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def run_torch(torch, args):
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    if args.net == "mini":
        model = torch_net(torch, args.width, CLASSES)
    else:
        model = torch_resnet(torch, *RESNETS[args.net], CLASSES)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    pool = [(torch.randn(args.batch, CHANNELS, args.hw, args.hw)
             .contiguous(memory_format=torch.channels_last),
             torch.randint(0, CLASSES, (args.batch,))) for _ in range(8)]

    def step(i):
        x, y = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for i in range(args.warmup):
        step(i)
    start = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    loss.item()
    return args.steps * args.batch / (time.perf_counter() - start)


def run_ours(args):
    cmd = [args.bin, "--device", "cpu", "--net", args.net, "--steps", str(args.steps),
           "--batch", str(args.batch),
           "--hw", str(args.hw), "--width", str(args.width), "--lr", str(args.lr)]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    if args.simd:
        env["CUDNN_CBR_CPU_SIMD"] = args.simd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"torch_cpu: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    # Its first line names the SIMD paths the executor chose on this CPU.
    print(out.stdout.splitlines()[0] if out.stdout else "train_cbr printed nothing")
    m = re.search(r"train_cbr summary:.* ([0-9.]+) img/s on cpu", out.stdout)
    if not m:
        sys.exit(f"torch_cpu: no summary line in the output of {' '.join(cmd)}:\n{out.stdout}")
    overall = float(m.group(1))
    return after_warmup(out.stdout, args.warmup, args.batch, overall), overall


def after_warmup(stdout, warmup, batch, overall):
    """Our images per second after the first progress line at or past step `warmup`, from
    the progress lines' running throughputs (each since the run's start): a line at step a
    reading R took a*batch/R seconds. The throughput over all steps where no line falls
    between the warm-up and the last step."""
    lines = [(int(a), int(n), float(r)) for a, n, r in
             re.findall(r"^step +(\d+)/(\d+) .*\| +([0-9.]+) img/s$", stdout, re.M)]
    lines = [(a, r) for a, n, r in lines if r > 0]
    first = next(((a, r) for a, r in lines if a >= warmup), None)
    if not lines or first is None or first[0] >= lines[-1][0]:
        return overall
    (a, ra), (b, rb) = first, lines[-1]
    seconds = b * batch / rb - a * batch / ra
    return (b - a) * batch / seconds if seconds > 0 else overall


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", choices=["mini", *RESNETS], default="mini",
                    help="the network (mini: the main job's; --width is mini's only)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--hw", type=int, default=16)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--bin", default=DEFAULT_BIN, help="our train_cbr example binary")
    ap.add_argument("--selftest", action="store_true",
                    help="check the progress-line arithmetic on made-up output, then exit")
    ap.add_argument("--runs", type=int, default=1,
                    help="alternating runs of each side (at least 1)")
    ap.add_argument("--simd", choices=["avx512", "avx2"],
                    help="cap both sides' SIMD (default: the widest this CPU has)")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, got {args.runs}")
    if args.simd:
        # Read by PyTorch when it is imported, so set before the import below.
        os.environ["ATEN_CPU_CAPABILITY"] = "avx512" if args.simd == "avx512" else "avx2"
        if args.simd == "avx2":
            os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    try:
        import torch
    except ImportError as e:
        print(f"SKIP torch_cpu: PyTorch is not installed ({e})")
        return 0
    if not os.path.exists(args.bin):
        print(f"SKIP torch_cpu: no train_cbr binary at {args.bin}; build it with "
              "`cargo build --release -p cudnn-cbr-trainer --example train_cbr` "
              "or pass --bin")
        return 0
    net = f"mini net width {args.width}" if args.net == "mini" else args.net
    print(f"torch {torch.__version__}; {net}, {args.hw}x{args.hw}x"
          f"{CHANNELS} inputs, {CLASSES} classes, batch {args.batch}, {args.steps} steps, "
          f"{args.threads} threads; CPU capability {torch.backends.cpu.get_cpu_capability()}; "
          f"CPU {cpu_model()}")
    runs = [(run_torch(torch, args), *run_ours(args)) for _ in range(args.runs)]
    after = f"after {args.warmup} warm-up steps"
    if args.runs == 1:
        theirs, ours, overall = runs[0]
        print(f"{'executor (img/s ' + after + ')':<44} {'img/s':>8}")
        print(f"{'PyTorch eager fp32 channels_last':<44} {theirs:>8.0f}")
        print(f"{'cudnn-cbr CPU executor (FP16 storage)':<44} {ours:>8.0f}"
              f"   ({overall:.0f} over all its steps)")
        print(f"{'ratio (ours / PyTorch)':<44} {ours / theirs:>8.2f}x"
              f"   ({overall / theirs:.2f}x with ours over all its steps)")
        return 0
    print(f"img/s {after}; ours over all its steps in the last two columns")
    print(f"{'run':>4} {'PyTorch':>8} {'ours':>8} {'ratio':>7} {'ours all':>9} {'ratio':>7}")
    for i, (theirs, ours, overall) in enumerate(runs, 1):
        print(f"{i:>4} {theirs:>8.0f} {ours:>8.0f} {ours / theirs:>6.2f}x {overall:>9.0f} "
              f"{overall / theirs:>6.2f}x")
    print(f"ratio (ours / PyTorch) over {args.runs} runs: {spread([o / t for t, o, _ in runs])}"
          f" (ours over all its steps: {spread([a / t for t, _, a in runs])})")
    return 0


def selftest():
    """`after_warmup` on made-up progress lines (batch 10), against the arithmetic done by
    hand; exit status 1 on a mismatch."""
    out = ("train_cbr: device cpu\n"
           "step     3/9 | loss 2.0 | acc  10.0% | scale   8192 | skipped 0 | 30 img/s\n"
           "step     6/9 | loss 2.0 | acc  10.0% | scale   8192 | skipped 0 | 30 img/s\n"
           "step     9/9 | loss 2.0 | acc  10.0% | scale   8192 | skipped 0 | 30 img/s\n"
           "train_cbr summary: ... 30 img/s on cpu, weights hash 0\n")
    # Lines at 1 s, 2 s, 3 s: 30 images per second throughout.
    checks = [(after_warmup(out, 5, 10, 30.0), 30.0)]
    # Step 6 at 2 s (30 img/s), step 9 at 2.5 s (36 img/s): 30 images in 0.5 s.
    out2 = out.replace("step     9/9 | loss 2.0 | acc  10.0% | scale   8192 | skipped 0 | 30",
                       "step     9/9 | loss 2.0 | acc  10.0% | scale   8192 | skipped 0 | 36")
    checks.append((after_warmup(out2, 5, 10, 36.0), 60.0))
    # No line between the warm-up and the last step, or none at all: the overall figure.
    checks.append((after_warmup(out2, 9, 10, 36.0), 36.0))
    checks.append((after_warmup("no progress lines", 5, 10, 12.0), 12.0))
    bad = [(got, want) for got, want in checks if abs(got - want) > 1e-9 * want]
    for got, want in bad:
        print(f"torch_cpu selftest FAILED: got {got}, want {want}")
    if not bad:
        print(f"torch_cpu selftest: {len(checks)} checks passed")
    return 1 if bad else 0


def spread(ratios):
    """`lo-hi x, median m x` of a list of ratios."""
    ratios = sorted(ratios)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}x, median {median:.2f}x"


def cpu_model():
    """The CPU's model name as /proc/cpuinfo gives it ("unknown" elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
