"""Speed you can deploy: the forward of an exported 2:4 Linear layer as a semi-structured
sparse tensor (`dtp_kernels.pruning.to_semi_structured`) against the same layer dense,
at transformer shapes, interleaved. Needs a GPU of compute capability 8.0 or later.

    python benchmarks/bench_semi_structured.py --device cuda [--rounds N] [--no-save]

Rows go to results/semi_structured.csv, the table to results/semi_structured_cuda.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import Cases, Sweep, main

from dtp_kernels.pruning import DTPPruner, to_semi_structured


def setup(point: dict, device: torch.device) -> Cases:
    if device.type != "cuda":
        raise SystemExit("bench_semi_structured.py: semi-structured sparsity needs --device cuda")
    out_features, in_features, tokens = point["out"], point["in"], point["tokens"]
    layer = nn.Sequential(nn.Linear(in_features, out_features, bias=False)).to(device)
    example = torch.randn(1, in_features, device=device)
    sparse = DTPPruner(layer, example, 0.5, granularity="n:m", nm=(2, 4)).export()
    sparse = sparse.to(torch.bfloat16).eval()
    dense = nn.Linear(in_features, out_features, bias=False).to(device, torch.bfloat16).eval()
    to_semi_structured(sparse)
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)

    def forward(module: nn.Module):
        @torch.no_grad()
        def run() -> None:
            module(x)

        return run

    return {
        ("dense", "forward"): (forward(dense), 10),
        ("2:4 sparse", "forward"): (forward(sparse), 10),
    }


SWEEP = Sweep(
    op="linear_2_4",
    title="Linear forward, bf16: 2:4 semi-structured against dense",
    points=[
        {"shape": f"{o}x{i}, {t} tokens", "dtype": "bfloat16", "out": o, "in": i, "tokens": t}
        for o, i in ((4096, 4096), (11008, 4096), (4096, 11008))
        for t in (2048, 8192)
    ],
    setup=setup,
    baselines=["dense"],
    note="Weights from DTPPruner(granularity='n:m').export(); x vs dense > 1: sparse is faster.",
)


if __name__ == "__main__":
    main(SWEEP, "semi_structured", __doc__.splitlines()[0], rounds=20)
