"""Paper Table 2: ResNet-50 on ImageNet with the appendix's settings
(configs/imagenet_resnet50.yaml: 90 + 90 epochs, weight decay 1e-4). Needs ImageNet as an
ImageFolder tree (train/ and val/ under --root):

    python python/table2_imagenet.py --root DIR/imagenet

Without it, it prints the commands. On GPUs add --amp bf16 --channels-last (as the
training-step benchmark does); --epochs N shortens both stages for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RATIOS = ["[0, 0.3, 0.3, 0.3, 0.3]", "[0, 0.5, 0.5, 0.5, 0.5]", "[0, 0.7, 0.7, 0.7, 0.7]"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="ImageFolder root with train/ and val/")
    parser.add_argument("--epochs", type=int, default=None, help="shorten both stages")
    parser.add_argument("--gpu", action="store_true", help="add --amp bf16 --channels-last")
    parser.add_argument("--out", default="runs/table2")
    args = parser.parse_args()
    runs = []
    for index, ratio in enumerate(RATIOS):
        argv = ["prune", "--config", "configs/imagenet_resnet50.yaml",
                "--set", f"prune.ratios={json.dumps(ratio)}",
                "--set", f"data.root={args.root or '<dir>'}",
                "--out", str(Path(args.out) / f"row{index}")]  # fmt: skip
        if args.epochs is not None:
            argv += [
                "--set",
                f"prune.epochs={args.epochs}",
                "--set",
                f"finetune.epochs={args.epochs}",
            ]
        if args.gpu:
            argv += ["--amp", "bf16", "--channels-last"]
        runs.append((ratio, argv))
    if not args.root:
        print("Table 2 needs ImageNet; the commands (python -m dtp_kernels ...):")
        for _ratio, argv in runs:
            print(f"python -m dtp_kernels {shlex.join(argv)}")
        return
    from dtp_kernels.cli import main as dtp

    print(f"{'ratios':<26} {'top-1':>7} {'params pruned':>14} {'FLOPs speed-up':>15}")
    for ratio, argv in runs:
        dtp(argv)
        s = json.loads((Path(argv[argv.index("--out") + 1]) / "summary.json").read_text())
        print(f"{ratio:<26} {s['accuracy']:>7.2%} {s['sparsity']:>14.2%} {s['speedup']:>14.2f}x")


if __name__ == "__main__":
    main()
