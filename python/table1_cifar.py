"""Paper Table 1 on CIFAR: ResNet-56 on CIFAR-10 and VGG-19 on CIFAR-100 with the
appendix's settings (configs/cifar10_resnet56.yaml, configs/cifar100_vgg19.yaml), one
`dtp prune` run per row. Needs the data sets (python format, extracted):

    python python/table1_cifar.py --cifar10 DIR/cifar-10-batches-py --cifar100 DIR/cifar-100-python

Without them it prints the commands it would run. Each run takes 240 epochs: hours on a
GPU, out of reach on CPU. --epochs N shortens both stages for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = [  # (recipe, data set, ratios, label)
    ("configs/cifar10_resnet56.yaml", "cifar10", 0.5, "ResNet-56, CIFAR-10, p = 0.5"),
    ("configs/cifar10_resnet56.yaml", "cifar10", 0.7, "ResNet-56, CIFAR-10, p = 0.7"),
    ("configs/cifar100_vgg19.yaml", "cifar100", "[0:0, 1-15:0.7]", "VGG-19, CIFAR-100, 0.7"),
    ("configs/cifar100_vgg19.yaml", "cifar100", "[0:0, 1-15:0.9]", "VGG-19, CIFAR-100, 0.9"),
]


def commands(roots: dict, epochs: int | None, out: Path) -> list[tuple[str, list[str]]]:
    runs = []
    for index, (config, data, ratio, label) in enumerate(ROWS):
        args = ["prune", "--config", config, "--set", f"prune.ratios={json.dumps(ratio)}",
                "--set", f"data.root={roots.get(data) or '<' + data + ' dir>'}",
                "--out", str(out / f"row{index}")]  # fmt: skip
        if epochs is not None:
            args += ["--set", f"prune.epochs={epochs}", "--set", f"finetune.epochs={epochs}"]
        runs.append((label, args))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar10", help="the cifar-10-batches-py directory")
    parser.add_argument("--cifar100", help="the cifar-100-python directory")
    parser.add_argument("--epochs", type=int, default=None, help="shorten both stages")
    parser.add_argument("--out", default="runs/table1")
    args = parser.parse_args()
    roots = {"cifar10": args.cifar10, "cifar100": args.cifar100}
    runs = commands(roots, args.epochs, Path(args.out))
    if not all(roots.values()):
        print("Table 1 needs the CIFAR data sets; the commands (python -m dtp_kernels ...):")
        for label, argv in runs:
            print(f"# {label}\npython -m dtp_kernels {shlex.join(argv)}")
        return
    from dtp_kernels.cli import main as dtp

    results = []
    for label, argv in runs:
        dtp(argv)
        summary = json.loads((Path(argv[argv.index("--out") + 1]) / "summary.json").read_text())
        results.append((label, summary))
    print(f"{'row':<32} {'accuracy':>9} {'params pruned':>14} {'FLOPs speed-up':>15}")
    for label, s in results:
        print(f"{label:<32} {s['accuracy']:>9.2%} {s['sparsity']:>14.2%} {s['speedup']:>14.2f}x")


if __name__ == "__main__":
    main()
