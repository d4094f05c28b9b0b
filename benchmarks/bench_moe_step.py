"""What DTP's expert and head masks cost in training: a mixture-of-experts language
model's training step (forward, backward, SGD step, state commit) with DTP masks on half
of every expert's neurons and half the heads, against the same step without masks,
interleaved in one run, under transformers' default experts implementation (grouped_mm)
and its loop over experts (eager).

    python benchmarks/bench_moe_step.py [--device cpu|cuda] [--rounds N] [--save]

CPU: a Mixtral of width 256, 8 heads (4 key/value), 2 layers of 8 experts of 512
neurons, 2 chosen per token; batch 4 x 64 tokens, fp32. CUDA: width 1024, 16 heads (8),
4 layers of 8 experts of 2816; batch 8 x 512 tokens, bf16 autocast. The experts' mask
multiplies each expert's down-projection columns (made once per forward), the heads'
the output projection's columns. The overhead is median(dtp) / median(dense) - 1;
writes benchmarks/results/moe_step_<device>.md and appends to moe_step.csv.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Sweep, step_overhead_main, training_step_cases

SIZES = {
    "cpu": dict(hidden=256, heads=8, kv=4, layers=2, width=512, batch=4, tokens=64, amp=None),
    "cuda": dict(
        hidden=1024, heads=16, kv=8, layers=4, width=2816, batch=8, tokens=512, amp=torch.bfloat16
    ),
}
IMPLEMENTATIONS = ("grouped_mm", "eager")
VOCAB, EXPERTS, TOP_K = 1024, 8, 2


def setup(point: dict, device: torch.device) -> dict:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=point["hidden"],
        intermediate_size=point["width"],
        num_attention_heads=point["heads"],
        num_key_value_heads=point["kv"],
        num_hidden_layers=point["layers"],
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        experts_implementation=point["implementation"],
    )
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(config).to(device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (point["batch"], point["tokens"]), generator=gen).to(device)

    return training_step_cases(
        base,
        lambda model: model(ids, labels=ids).loss,
        (ids[:1],),
        {"heads": 0.5, "experts": 0.5},
        point["amp"],
    )


def sweep(device: torch.device) -> Sweep:
    sizes = SIZES[device.type]
    points = [
        {
            **sizes,
            "implementation": implementation,
            "shape": (
                f"{implementation}: width {sizes['hidden']}, {sizes['layers']} layers of "
                f"{EXPERTS} experts of {sizes['width']}, batch {sizes['batch']}x{sizes['tokens']}"
            ),
            "dtype": str(sizes["amp"] or torch.float32),
        }
        for implementation in IMPLEMENTATIONS
    ]
    return Sweep(
        op="moe_training_step",
        title="Mixtral training step: DTP masks on half of every expert and half the heads",
        points=points,
        setup=setup,
        baselines=["dense"],
        warmup=3,
        note="DTP's overhead is 1 / (x vs dense) - 1.",
    )


if __name__ == "__main__":
    step_overhead_main(__doc__, sweep, "moe_step", rounds=20)
