"""Prune timm and torchvision models at a float ratio and check each export: FLOPs and
parameter reduction, the export's largest difference from the hard-masked model,
parameters against the report, whether the layers it leaves their shapes are the ones
`pruner.left_whole` lists (`python benchmarks/model_prune_check.py [model ...]`;
a timm model by its name, a torchvision one as "torchvision.<name>", on 224 x 224
images).

Random weights (nothing is downloaded), BN statistics drawn away from the identity and
random scores, so every kept channel shows in the output; the classifier has 5 classes.
A model the pruner refuses, or whose export its check refuses, gets the error's first
words in the table."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
import warnings
from pathlib import Path

import timm
import torch
import torchvision
from _harness import RESULTS, environment

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.base import ExportMismatchError
from dtp_kernels.pruning.cost import count_params

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from utils import drawn_statistics, layer_shapes, randomised, whole_as_listed

MODELS = [
    # the group search (dtp_kernels/pruning/group_search.py) made these prunable
    "rexnet_100",
    "focalnet_tiny_srf",
    "efficientvit_m0",
    "efficientvim_m1",
    "efficientformerv2_s0",
    "iformer_t",
    "coatnet_nano_rw_224",
    "visformer_tiny",
    "shvit_s1",
    # their attention layers export to a class of their own (torchvision_attention.py,
    # timm_attention.py)
    "torchvision.swin_t",
    "torchvision.swin_v2_t",
    "torchvision.maxvit_t",
    "tiny_vit_5m_224",
    "efficientformer_l1",
    "vit_small_patch16_dinov3",
    "eva02_tiny_patch14_224",
    "eva02_base_patch14_224",
    "vit_base_patch16_rope_reg1_gap_256",
    "beit_base_patch16_224",
    "swinv2_tiny_window8_256",
    "davit_tiny",
    "xcit_nano_12_p16_224",
    "edgenext_xx_small",
    "volo_d1_224",
    "vit_relpos_small_patch16_224",
    "nextvit_small",
    "pvt_v2_b0",
    "twins_svt_small",
    "twins_pcpvt_small",
    "swinv2_cr_tiny_224",
    "nest_tiny",
    "convit_tiny",
    "cait_xxs24_224",
    "fastvit_sa12",
    # their heads by form, with no class of their own
    "levit_128s",
    "maxvit_nano_rw_256",
    # its attention pool (separate q, k, v) prunes its heads as it is
    "resnet50_clip.openai",
    # the 1x1 convs that feed its lambda layers are refused by name, the rest prunes
    "lambda_resnet26t",
    # its attention pooling's search ends at once, where it did not within a minute
    "gcresnet33ts",
    # its star MLPs (gated, in convolutions) are groups
    "starnet_s1",
]

# layers left whole (ratio 0) where the float ratio would be refused: PVT v2's and Twins'
# convolutions reducing the keys' and values' tokens feed a LayerNorm over their channels;
# the lambda ResNet's 1x1 convs feed a LambdaLayer, which reshapes its output to their width;
LEFT_WHOLE = dict.fromkeys(["pvt_v2_b0", "twins_svt_small", "twins_pcpvt_small"], ("*.attn.sr",))
LEFT_WHOLE["lambda_resnet26t"] = ("stages.2.1.conv1_1x1.conv", "stages.3.*.conv1_1x1.conv")
# and GCNet's context MLPs normalize their hidden width with a LayerNorm
LEFT_WHOLE["gcresnet33ts"] = ("*.attn.mlp_add.fc1",)


def ratios(name: str, ratio: float) -> float | dict[str, float]:
    """The ratios `name` is pruned at: `ratio`, with the layers of LEFT_WHOLE at 0."""
    return {**dict.fromkeys(LEFT_WHOLE[name], 0), "*": ratio} if name in LEFT_WHOLE else ratio


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The model `name` names with random weights and 5 classes, and an input of two."""
    if name.startswith("torchvision."):
        model = getattr(torchvision.models, name.removeprefix("torchvision."))(num_classes=5)
        return model, torch.randn(2, 3, 224, 224)
    model = timm.create_model(name, pretrained=False, num_classes=5)
    return model, torch.randn(2, *model.pretrained_cfg.get("input_size", (3, 224, 224)))


def check(name: str, ratio: float) -> list[str]:
    """One table row for `name` pruned at `ratio`."""
    torch.manual_seed(0)
    model, x = build(name)
    model = drawn_statistics(model).eval()
    for head in model.modules():  # an output away from zero, so every channel shows
        if isinstance(head, torch.nn.Linear) and head.out_features == 5:
            torch.nn.init.normal_(head.weight, std=0.1)
    shapes = layer_shapes(model)
    start = time.monotonic()
    try:
        pruner = randomised(DTPPruner(model, (x[:1],), ratios(name, ratio)))
    except ValueError as error:
        return [name, "refused: " + str(error)[:80].replace("|", "/")] + [""] * 6
    seconds = time.monotonic() - start
    with torch.no_grad(), pruner.hard_masked():
        want = model(x)
    try:
        exported = pruner.export().eval()
    except ExportMismatchError as error:  # export's own check refused it
        return [name, "export refused: " + str(error)[:80].replace("|", "/")] + [""] * 6
    with torch.no_grad():
        error = ((exported(x) - want).abs().max() / want.abs().max()).item()
    report = pruner.report()
    return [
        name,
        str(len(pruner.groups)),
        f"{report['flops_before'] / report['flops_after']:.2f}x",
        f"{report['params_before'] / report['params_after']:.2f}x",
        f"{error:.1e}",
        "yes" if count_params(exported) == report["params_after"] else "NO",
        "yes" if whole_as_listed(exported, shapes, pruner.left_whole) else "NO",
        f"{seconds:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=MODELS)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    env = environment(torch.device("cpu"))
    header = [
        "model",
        "groups",
        "FLOPs fewer",
        "params fewer",
        "export error",
        "params = report",
        "whole = listed",
        "find groups (s)",
    ]
    lines = [
        "# timm and torchvision models pruned and exported (`benchmarks/model_prune_check.py`)",
        "",
        f"{env['device']}; torch {env['torch']}, timm {timm.__version__}, torchvision "
        f"{torchvision.__version__}, torch-pruning "
        f"{importlib.metadata.version('torch-pruning')}; {env['date']}; float ratio "
        f"{args.ratio} ("
        + ", ".join(
            f"{name}: {', '.join(map(repr, patterns))} at 0"
            for name, patterns in LEFT_WHOLE.items()
        )
        + "). Export error: largest difference from the hard-masked model, relative to its "
        "largest output. Whole = listed: whether the layers the export leaves their shapes "
        "are the ones pruner.left_whole lists.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
    ]
    for name in args.models:
        lines.append("| " + " | ".join(check(name, args.ratio)) + " |")
        print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_save:
        (RESULTS / "model_prune_check_cpu.md").write_text(report)


if __name__ == "__main__":
    main()
