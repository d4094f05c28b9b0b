"""Command line: `python -m dtp_kernels prune|check|demo` (also the `dtp` console script).

dtp prune --config dtp_kernels/configs/digits.yaml --set prune.ratios=0.9 --out runs/digits
dtp paper table1-resnet56 --seeds 0 1 2 --set data.root=DIR --set model.weights=FILE
dtp tokenize TEXT_DIR --tokenizer MODEL_DIR   # train.txt/val.txt -> train.npy/val.npy
dtp check            # every backend present against the literal reference
dtp bench            # the mask step of every backend present, timed interleaved
dtp demo             # DTP vs L1 on digits at 50% and 90%
"""

from __future__ import annotations

import argparse
import json
import sys


def check() -> int:
    """Compare every available backend with the reference on ragged segments."""
    import torch

    from . import TransportState, available_backends, transport_mask

    sizes, keep = [1, 3, 17, 1025], [1.0, 1.5, 5.0, 100.0]
    scores = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(0))
    want = transport_mask(
        scores.double(), keep, TransportState(sizes, dtype=torch.float64), backend="reference"
    )
    worst = 0.0
    for backend in available_backends("cpu"):
        got = transport_mask(scores, keep, TransportState(sizes), backend=backend)
        error = float((got.double() - want).abs().max())
        worst = max(worst, error)
        print(f"{backend:>10}: max |mask - reference| = {error:.2e}")
    return 0 if worst < 1e-4 else 1


def bench_command(device: str, rounds: int) -> int:
    """Print the interleaved fwd + bwd timing of the mask step on ResNet-50's groups."""
    import torch

    from .benchmarking import bench_mask_step

    if rounds < 2:
        raise SystemExit(f"--rounds = {rounds}; it must be at least 2")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    print(
        f"mask step fwd + bwd, ResNet-50's 32 groups (7552 channels), {device}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'backend':>10} {'median us':>10} {'x vs reference':>15} {'x vs torch':>11}")
    for row in bench_mask_step(device, rounds):
        print(
            f"{row['backend']:>10} {row['median_us']:10.1f} {row['x_vs_reference']:15.1f} "
            f"{row['x_vs_torch']:11.2f}"
        )
    return 0


def paper_command(args: argparse.Namespace) -> int:
    """List the paper's experiments, or run one's rows over the seeds and print the table."""
    from .pipeline.experiments import EXPERIMENTS, results_table, run_experiment

    if args.experiment is None:
        for name, experiment in EXPERIMENTS.items():
            labels = ", ".join(row.label for row in experiment.rows)
            recipe = f"dtp_kernels/configs/paper/{experiment.config}"
            print(f"{name:<30} {experiment.source} ({recipe}): {labels}")
        return 0
    out = args.out or f"runs/paper/{args.experiment}"
    results = run_experiment(args.experiment, args.seeds, out, args.set, args.rows)
    if results:
        print(results_table(EXPERIMENTS[args.experiment], results), end="")
    return 0


def tokenize_command(args: argparse.Namespace) -> int:
    """Write the token ids of a text directory's train.txt and val.txt as .npy files."""
    from pathlib import Path

    import numpy as np

    from .pipeline.errors import UsageError
    from .pipeline.text_data import ID_FILES, TEXT_FILES
    from .pipeline.tokenize_text import id_dtype, model_encoder, token_arrays, write_npy

    root, out = Path(args.root), Path(args.out or args.root)
    sources = [root / name for name in TEXT_FILES]
    targets = [out / name for name in ID_FILES]
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        raise UsageError(f"dtp tokenize: no {' or '.join(missing)} (UTF-8 text)")
    if not out.is_dir():
        raise UsageError(f"dtp tokenize: --out {str(out)!r} is not a directory")
    there = [str(path) for path in targets if path.exists()]
    if there and not args.overwrite:
        raise UsageError(f"dtp tokenize: {', '.join(there)} exist; --overwrite replaces them")
    if args.tokenizer == "bytes":
        dtype = np.dtype(np.uint8)

        def arrays(path: Path):
            with open(path, "rb") as file:
                while block := file.read(1 << 20):
                    yield np.frombuffer(block, np.uint8)
    else:
        encode, vocab_size = model_encoder(args.tokenizer, "--tokenizer", "--tokenizer bytes")
        dtype = id_dtype(vocab_size)

        def arrays(path: Path):
            return token_arrays(path, encode, dtype)

    written = {}
    for source, target in zip(sources, targets, strict=True):
        count = write_npy(arrays(source), target, dtype)
        written[str(target)] = {"tokens": count, "dtype": dtype.name}
    print(json.dumps(written, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dtp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prune = sub.add_parser("prune", help="run a pruning recipe")
    prune.add_argument("--config", help="YAML recipe (e.g. dtp_kernels/configs/*.yaml)")
    prune.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, e.g. prune.ratios=0.9",
    )
    prune.add_argument("--out", default=None, help="output directory")
    prune.add_argument(
        "--resume", action="store_true", help="continue from the checkpoints in --out/checkpoints"
    )
    prune.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out (deletes its checkpoints, metrics and outputs)",
    )
    prune.add_argument(
        "--amp",
        choices=["bf16", "fp16"],
        default=None,
        help="mixed precision (torch.autocast); = --set run.amp=...",
    )
    prune.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    prune.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    prune.add_argument(
        "--plan",
        action="store_true",
        help="check the recipe, model, data and --out, print what would be pruned and the "
        "training state per stage, and stop: nothing trains, nothing is written",
    )
    paper = sub.add_parser("paper", help="run a paper experiment's rows over seeds")
    paper.add_argument("experiment", nargs="?", help="its name; none: list them")
    paper.add_argument("--seeds", type=int, nargs="+", default=[0])
    paper.add_argument("--rows", nargs="+", default=None, help="row labels (default: all)")
    paper.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field of every row's recipe",
    )
    paper.add_argument("--out", default=None, help="output directory (runs/paper/<name>)")
    tokenize = sub.add_parser(
        "tokenize",
        help="write a text directory's train.txt and val.txt as token ids (train.npy, val.npy) "
        "for data.tokenizer=pretokenized",
    )
    tokenize.add_argument("root", help="the directory holding train.txt and val.txt")
    tokenize.add_argument(
        "--tokenizer",
        required=True,
        help="a directory holding a saved tokenizer (the model's, save_pretrained), or 'bytes'",
    )
    tokenize.add_argument("--out", default=None, help="where train.npy and val.npy go (root)")
    tokenize.add_argument("--overwrite", action="store_true", help="replace .npy files there")
    sub.add_parser("check", help="compare every backend with the reference")
    bench = sub.add_parser("bench", help="time the mask step of every backend present")
    bench.add_argument("--device", default="cpu", help="cpu or cuda")
    bench.add_argument("--rounds", type=int, default=20)
    sub.add_parser("demo", help="DTP vs L1 on digits")
    args = parser.parse_args(argv)
    from .pipeline.errors import RunError, UsageError

    try:
        return _dispatch(args, argv)
    except (UsageError, FileNotFoundError) as error:  # a mistake in the input: no traceback
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    except RunError as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1


def _one_line(error: Exception) -> str:
    """The error's message; for one raised in a DataLoader worker, which torch re-raises
    with the worker's traceback in the message, the original message (its last line)."""
    text = str(error).strip()
    if "Original Traceback" in text:
        last = text.splitlines()[-1]
        return last.split(": ", 1)[1] if ": " in last else last
    return text


def _dispatch(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.command == "check":
        return check()
    if args.command == "bench":
        return bench_command(args.device, args.rounds)
    if args.command == "paper":
        return paper_command(args)
    if args.command == "tokenize":
        return tokenize_command(args)
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
    from .pipeline import distributed
    from .pipeline.preemption import Preempted

    if args.plan:
        from pathlib import Path

        from .pipeline import out_dir
        from .pipeline.plan import plan

        recipe = recipes.load(args.config, overrides)
        if args.out is not None:
            out_dir.check(Path(args.out), args.resume, args.overwrite)
        print(json.dumps(plan(recipe), indent=2))
        return 0
    try:
        recipe = recipes.load(args.config, overrides)
        summary = run(recipe, args.out, resume=args.resume, overwrite=args.overwrite)
    except Preempted as stop:
        if distributed.is_main():
            again = " ".join(["dtp", *(argv if argv is not None else sys.argv[1:])])
            again += "" if args.resume else " --resume"
            print(f"dtp prune: {stop}. Resume with:\n  {again}", file=sys.stderr)
        distributed.end()  # (every rank stops at the same step)
        return 128 + stop.signum

    if distributed.is_main():
        print(json.dumps({k: v for k, v in summary.items() if k != "model"}, indent=2))
    distributed.end()
    return 0
