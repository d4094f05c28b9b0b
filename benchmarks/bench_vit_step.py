"""What DTP's head and neuron masks cost in training: a ViT training step (forward,
backward, SGD step, state commit) with DTP masks on half its heads and half its MLP
neurons, against the same step without masks, interleaved in one run.

    python benchmarks/bench_vit_step.py [--device cpu|cuda] [--rounds N] [--save]

CPU: a timm ViT of DeiT-Tiny's width (192) with 4 heads of 48 and 4 blocks, on 32x32
images in 4x4 patches (65 tokens), batch 32. CUDA: DeiT-Small (384, 6 heads, 12
blocks), 224x224 in 16x16 patches, batch 64, bf16 autocast. The heads' mask multiplies
the output projection's columns, the neurons' mask the first MLP layer's rows and bias.
The overhead is median(dtp) / median(dense) - 1; writes
benchmarks/results/vit_step_<device>.md and appends to vit_step.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Sweep, step_overhead_main, training_step_cases

POINTS = {
    "cpu": dict(embed=192, heads=4, depth=4, image=32, patch=4, batch=32, amp=None),
    "cuda": dict(embed=384, heads=6, depth=12, image=224, patch=16, batch=64, amp=torch.bfloat16),
}


def setup(point: dict, device: torch.device) -> dict:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    base = VisionTransformer(
        img_size=point["image"],
        patch_size=point["patch"],
        embed_dim=point["embed"],
        depth=point["depth"],
        num_heads=point["heads"],
        num_classes=10,
    ).to(device)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(point["batch"], 3, point["image"], point["image"], generator=gen)
    labels = torch.randint(0, 10, (point["batch"],), generator=gen)
    images, labels = images.to(device), labels.to(device)

    return training_step_cases(
        base,
        lambda model: torch.nn.functional.cross_entropy(model(images), labels),
        (images[:1],),
        {"heads": 0.5, "mlp": 0.5},
        point["amp"],
    )


def sweep(device: torch.device) -> Sweep:
    point = POINTS[device.type]
    shape = (
        f"embed {point['embed']}, {point['heads']} heads, {point['depth']} blocks, "
        f"{point['image']}px/{point['patch']}, batch {point['batch']}"
    )
    return Sweep(
        op="vit_training_step",
        title="ViT training step: DTP masks on half the heads and MLP neurons vs dense",
        points=[{**point, "shape": shape, "dtype": str(point["amp"] or torch.float32)}],
        setup=setup,
        baselines=["dense"],
        warmup=3,
        note="DTP's overhead is 1 / (x vs dense) - 1.",
    )


if __name__ == "__main__":
    step_overhead_main(__doc__, sweep, "vit_step", rounds=30)
