"""How far a bfloat16 model's export parts from its hard-masked model by rounding alone,
against its depth: Llama models at TinyLlama's width (2048, MLPs of 5632, 32 heads over
4 key/value heads, a vocabulary of 32000) with random weights, a float ratio of 0.5 and
random scores, on 16 tokens. Each row gives the logits' largest difference and the
difference's norm relative to theirs, in bfloat16 and with the same weights in float32,
and whether the bfloat16 outputs are within the export check's half-precision tolerance
(without the float32 re-check, the ones that are not were refused).

    python benchmarks/bf16_export_check.py [--layers 2 8 22]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import transformers
from _harness import RESULTS, environment

from dtp_kernels.pruning import DTPPruner
from dtp_kernels.pruning.precision import float32_weights
from dtp_kernels.pruning.proof import TOLERANCES, close


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.double()


def row(layers: int) -> list[str]:
    """The table row of a model of `layers` layers."""
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    pruner = DTPPruner(model, (ids,), 0.5)
    with torch.no_grad():
        pruner.scores.copy_(torch.rand(pruner.scores.shape, generator=torch.Generator()))
    exported = pruner.export()  # checked: in float32 where bfloat16 rounds too far apart
    cells = [str(layers), f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}"]
    for widen in (False, True):
        with pruner.hard_masked():
            if widen:
                with float32_weights(model):
                    want = logits(model, ids)
            else:
                want = logits(model, ids)
        if widen:
            with float32_weights(exported):
                got = logits(exported, ids)
        else:
            got = logits(exported, ids)
        cells += [
            f"{float((got - want).abs().max()):.2g}",
            f"{float((got - want).norm() / want.norm()):.2g}",
        ]
        if not widen:
            cells.append("yes" if close(got.bfloat16(), want.bfloat16()) else "no")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 22])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    env = environment(torch.device("cpu"))
    rtol, atol = TOLERANCES[torch.bfloat16]
    lines = [
        "# bfloat16 exports against their hard-masked models (`benchmarks/bf16_export_check.py`)",
        "",
        f"{env['device']}; torch {env['torch']}, transformers {transformers.__version__}; "
        f"{env['date']}. Llama at TinyLlama's width, random weights and scores, float ratio "
        f"0.5, 16 tokens. Within tolerance: the bfloat16 logits within the export check's "
        f"half-precision tolerance ({rtol} relative, {atol} of the largest absolute); "
        "where they are not, the check compares the float32 columns.",
        "",
        "| layers | parameters (B) | bf16 max diff | bf16 norm diff | within tolerance "
        "| fp32 max diff | fp32 norm diff |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for layers in args.layers:
        lines.append("| " + " | ".join(row(layers)) + " |")
        print(lines[-1], flush=True)
    (RESULTS / "bf16_export_check_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
