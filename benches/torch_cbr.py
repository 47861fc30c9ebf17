#!/usr/bin/env python3
"""PyTorch side-by-side for benches/cbr_layers.rs: the same ResNet-50 conv layer table run as
Conv2d -> BatchNorm2d -> ReLU in channels_last with AMP (FP16) and cudnn.benchmark, eager and
torch.compile, forward and forward+backward, timed with CUDA events (median after warm-up).

Run by scripts/gpu-check.sh on the GPU machine (PyTorch is there). Without PyTorch or CUDA it
prints one SKIP line and exits 0.

    python3 benches/torch_cbr.py [--batch 256] [--out DIR] [--compile-layers N]
"""
import argparse
import csv
import os
import statistics
import sys

# (label, C, HW, K, RS, pad, stride): the same layers as crates/3-fusion/src/cbr/resnet50.rs.
LAYERS = [("stem", 3, 224, 64, 7, 3, 2)]
for name, width, cin, hw, stride in [("l1", 64, 64, 56, 1), ("l2", 128, 256, 56, 2),
                                     ("l3", 256, 512, 28, 2), ("l4", 512, 1024, 14, 2)]:
    out_hw = hw // stride
    cands = [
        (f"{name}.conv1", cin, hw, width, 1, 0, 1),
        (f"{name}.conv2", width, hw, width, 3, 1, stride),
        (f"{name}.conv3", width, out_hw, 4 * width, 1, 0, 1),
        (f"{name}.down", cin, hw, 4 * width, 1, 0, stride),
        (f"{name}.b1.conv1", 4 * width, out_hw, width, 1, 0, 1),
        (f"{name}.b1.conv2", width, out_hw, width, 3, 1, 1),
    ]
    for c in cands:
        if c[1:] not in [l[1:] for l in LAYERS] or c[0].endswith("down"):
            LAYERS.append(c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "target/bench"))
    ap.add_argument("--compile-layers", type=int, default=4,
                    help="how many layers also run under torch.compile (compiling is slow)")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        print(f"SKIP torch_cbr: PyTorch is not installed ({e})")
        return 0
    if not torch.cuda.is_available():
        print("SKIP torch_cbr: PyTorch sees no CUDA device")
        return 0
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name(0)}, batch {args.batch}")

    def timed(fn, iters):
        for _ in range(3):
            fn()
        times = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    rows = []
    print(f"{'layer':<12} {'mode':<8} {'fwd ms':>9} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    for i, (label, c, hw, k, rs, pad, stride) in enumerate(LAYERS):
        block = torch.nn.Sequential(
            torch.nn.Conv2d(c, k, rs, stride=stride, padding=pad, bias=False),
            torch.nn.BatchNorm2d(k), torch.nn.ReLU(inplace=True),
        ).to(dev).to(memory_format=torch.channels_last)
        x = torch.randn(args.batch, c, hw, hw, device=dev).to(memory_format=torch.channels_last)
        x.requires_grad_(i > 0)
        out_hw = (hw + 2 * pad - rs) // stride + 1
        flops = 2.0 * args.batch * k * out_hw * out_hw * c * rs * rs
        modes = [("eager", block)]
        if i < args.compile_layers:
            modes.append(("compile", torch.compile(block)))
        for mode, m in modes:
            def fwd():
                with torch.autocast("cuda", dtype=torch.float16):
                    return m(x)

            def fwd_bwd():
                y = fwd()
                y.backward(torch.ones_like(y))

            f = timed(fwd, args.iters)
            fb = timed(fwd_bwd, args.iters)
            tflops = 3 * flops / (fb * 1e-3) / 1e12
            print(f"{label:<12} {mode:<8} {f:>9.3f} {fb:>11.3f} {tflops:>8.1f}")
            rows.append({"layer": label, "mode": mode, "fwd_ms": f"{f:.4f}",
                         "fwd_bwd_ms": f"{fb:.4f}", "tflops": f"{tflops:.2f}"})
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "torch_cbr.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
