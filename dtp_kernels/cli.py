"""Command line: `python -m dtp_kernels prune|check|demo` (also the `dtp` console script).

dtp prune --config configs/digits.yaml --set prune.ratios=0.9 --out runs/digits
dtp check            # every backend present against the literal reference
dtp demo             # DTP vs L1 on digits at 50% and 90%
"""

from __future__ import annotations

import argparse
import json


def check() -> int:
    """Compare every available backend with the reference on ragged segments."""
    import torch

    from . import TransportState, available_backends, transport_mask

    sizes, keep = [1, 3, 17, 1025], [1.0, 1.5, 5.0, 100.0]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    want = transport_mask(scores.double(), keep, TransportState(sizes, dtype=torch.float64),
                          backend="reference")  # fmt: skip
    worst = 0.0
    for backend in available_backends("cpu"):
        got = transport_mask(scores, keep, TransportState(sizes), backend=backend)
        error = float((got.double() - want).abs().max())
        worst = max(worst, error)
        print(f"{backend:>10}: max |mask - reference| = {error:.2e}")
    return 0 if worst < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prune = sub.add_parser("prune", help="run a pruning recipe")
    prune.add_argument("--config", help="YAML recipe (configs/*.yaml)")
    prune.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a recipe field, e.g. prune.ratios=0.9")  # fmt: skip
    prune.add_argument("--out", default=None, help="output directory")
    prune.add_argument("--resume", action="store_true",
                       help="continue from the checkpoints in --out/checkpoints")  # fmt: skip
    prune.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                       help="mixed precision (torch.autocast); = --set run.amp=...")  # fmt: skip
    prune.add_argument("--channels-last", action="store_true",
                       help="channels_last memory format")  # fmt: skip
    prune.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    sub.add_parser("check", help="compare every backend with the reference")
    sub.add_parser("demo", help="DTP vs L1 on digits")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check()
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main([])
        return 0
    from .pipeline import recipe as recipes
    from .pipeline.run import run

    overrides = list(args.set)
    if args.amp:
        overrides.append(f"run.amp={args.amp}")
    if args.channels_last:
        overrides.append("run.channels_last=true")
    if args.no_progress:
        overrides.append("run.progress=false")
    summary = run(recipes.load(args.config, overrides), args.out, resume=args.resume)
    print(json.dumps({k: v for k, v in summary.items() if k != "model"}, indent=2))
    return 0
