"""Prune your own model in your own training loop with DTP, without the command line.

Four lines go into an ordinary PyTorch loop: build a DTPPruner on the model, give the
optimizer the pruner's scores, `pruner.attach(optimizer)`, and `pruner.export()` at the
end for the physically smaller model. Run it as it is (a small CNN on generated data, on
the GPU when there is one) or copy the marked lines into your loop:

    python examples/own_training_loop.py --steps 200
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from dtp_kernels import DTPPruner


def my_model() -> nn.Module:
    """Stands for your network: any model Torch-Pruning can trace."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


def my_batches(steps: int, device: torch.device):
    """Stands for your data loader: images whose class is their mean colour."""
    generator = torch.Generator().manual_seed(0)
    palette = torch.rand(10, 3, 1, 1, generator=generator)
    for _ in range(steps):
        labels = torch.randint(0, 10, (32,), generator=generator)
        noise = 0.3 * torch.randn(32, 3, 16, 16, generator=generator)
        yield (palette[labels] + noise).to(device), labels.to(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ratio", type=float, default=0.5, help="filters pruned per layer")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = my_model().to(device)  # in practice: your pretrained model

    # 1. The pruner: one example input to trace the model, the ratios (a float, a dict of
    #    layer names, or the paper's per-stage lists), eps as the paper's appendix sets it.
    pruner = DTPPruner(model, torch.randn(1, 3, 16, 16, device=device), args.ratio, eps=1.0)
    # 2. The optimizer trains the model's weights and the pruner's scores (no decay on them).
    optimizer = torch.optim.SGD(
        [{"params": model.parameters()}, {"params": pruner.parameters(), "weight_decay": 0.0}],
        lr=0.05,
        momentum=0.9,
        weight_decay=5e-4,
    )
    # 3. Commit the transport state after every optimizer step.
    pruner.attach(optimizer)

    model.train()
    for images, labels in my_batches(args.steps, device):  # your loop, unchanged
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    # 4. The physically smaller model, with exactly the kept counts asked for; fine-tune
    #    it with your loop as any model.
    report = pruner.report()
    pruned = pruner.export()
    images, labels = next(my_batches(1, device))
    with torch.no_grad():
        pruned.eval()
        accuracy = (pruned(images).argmax(1) == labels).float().mean().item()
    print(
        f"kept filters per layer: {[g['k'] for g in report['groups']]} of "
        f"{[g['n'] for g in report['groups']]}; params {report['params_before']} -> "
        f"{report['params_after']}; FLOPs speed-up {report['speedup']:.2f}x; "
        f"accuracy of the pruned model before fine-tuning {accuracy:.0%}"
    )
    return {"report": report, "model": pruned, "accuracy": accuracy}


if __name__ == "__main__":
    main()
