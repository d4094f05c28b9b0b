"""Whole training epochs with the data loader in the loop: dense against a DTP soft-mask
epoch, interleaved round by round in one run, as `dtp prune` trains.

    python benchmarks/bench_pipeline.py [--device cpu|cuda] [--rounds N] [--workers N]
        [--images N] [--compile] [--workload NAME]...

CPU: CIFAR ResNet-56 (batch 256) on a generated CIFAR-10 directory (python format).
CUDA: CIFAR ResNet-56 (batch 256) on a generated 50,000-image CIFAR-10 directory, and
torchvision ResNet-50 (batch 64, bf16 autocast, channels_last) on an ImageFolder of
generated JPEGs (RandomResizedCrop(224) + flip, as for ImageNet).

Per epoch: images per second (wall time, loader included); the fraction of the wall time
the training loop waited for the next batch; on CUDA, the fraction of the wall time the
GPU spent inside training steps (CUDA events around every step: the time the GPU did
not wait for data or the host). The rounds alternate which epoch runs first; DTP's
throughput relative to dense is the median of the per-round ratios, with a 95% bootstrap
interval (pairing by round removes the machine's drift between rounds).
--compile runs both models under torch.compile (default mode), as `run.compile: true`
does in `dtp prune`; the warm-up epoch compiles them. After every workload, appends its
rows to results/pipeline.csv and writes results/pipeline_<device>[_compiled].md, so a
run stopped in a later workload keeps the finished ones (with --workload, the file name
ends in the workloads' names: a partial run does not replace the full table).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, append_rows, environment, paired_overhead

from dtp_kernels import DTPPruner
from dtp_kernels.models import get_model
from dtp_kernels.pipeline import data, synthetic
from dtp_kernels.pipeline.step import compile_model, training_step
from dtp_kernels.pipeline.train import RunOptions, make_optimizer


def workloads(device: torch.device, images: int | None) -> list[dict]:
    if device.type == "cuda":
        return [
            dict(
                name="resnet56",
                data="cifar10",
                images=images or 50_000,
                batch=256,
                amp=None,
                channels_last=False,
            ),
            dict(
                name="torchvision.resnet50",
                data="imagefolder",
                images=images or 6_400,
                batch=64,
                amp="bf16",
                channels_last=True,
            ),
        ]
    return [
        dict(
            name="resnet56",
            data="cifar10",
            images=images or 2_048,
            batch=256,
            amp=None,
            channels_last=False,
        )
    ]


def make_loader(work: dict, root: Path, workers: int | None, pin: bool):
    if work["data"] == "cifar10":
        folder = synthetic.write_cifar(root, "cifar10", train=work["images"], test=256)
        train, test = data.cifar(folder, "cifar10")
    else:
        classes = 100
        synthetic.write_image_folder(
            root, classes=classes, per_class=work["images"] // classes, size=256, val_per_class=1
        )
        train, test = data.image_folder(root)
    loader, _ = data.loaders(train, test, work["batch"], num_workers=workers, pin_memory=pin)
    return loader


def run_epoch(case: dict, loader, options: RunOptions, epoch: int) -> dict:
    """One epoch of `case`: wall seconds, seconds waiting for batches, GPU in-step time."""
    model, optimizer, pruner = case["net"], case["optimizer"], case["pruner"]
    cuda = options.device.type == "cuda"
    events = []
    loader.sampler.set_epoch(epoch)
    waited, count = 0.0, 0
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    batches = iter(loader)
    while True:
        before = time.perf_counter()
        try:
            images, labels = next(batches)
        except StopIteration:
            break
        waited += time.perf_counter() - before
        if cuda:
            events.append(
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            )
            events[-1][0].record()
        training_step(
            model,
            optimizer,
            options.images(images),
            options.labels(labels),
            pruner,
            amp=options.amp_dtype,
        )
        if cuda:
            events[-1][1].record()
        count += len(labels)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    busy = sum(a.elapsed_time(b) for a, b in events) / 1e3 if cuda else float("nan")
    return {"wall": wall, "images": count, "waited": waited, "busy": busy}


def make_case(work: dict, dense: torch.nn.Module, options: RunOptions, dtp: bool) -> dict:
    model = copy.deepcopy(dense).to(options.device)
    if options.channels_last:
        model.to(memory_format=torch.channels_last)
    pruner = None
    if dtp:
        size = 32 if work["data"] == "cifar10" else 224
        example = torch.randn(1, 3, size, size, device=options.device)
        pruner = DTPPruner(model, example, 0.5, eps=1.0 if work["name"] == "resnet56" else 0.25)
    settings = {"lr": 0.01, "momentum": 0.9, "weight_decay": 5e-4}
    optimizer = make_optimizer(model, settings, pruner)
    if pruner is not None:
        pruner.attach(optimizer)
    model.train()
    # default mode: the pruner's hooks and ops trace without graph breaks (docs/pipeline.md)
    net = compile_model(model) if options.compile else model
    return {"net": net, "optimizer": optimizer, "pruner": pruner}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="default: the pipeline's")
    parser.add_argument("--images", type=int, default=None, help="training images per epoch")
    parser.add_argument("--compile", action="store_true", help="torch.compile both models")
    parser.add_argument(
        "--workload",
        action="append",
        choices=["resnet56", "torchvision.resnet50"],
        help="run only this workload (repeatable; default: every one of the device's)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    lines = [
        f"# Training epochs with the data loader, {env['device']}",
        "",
        f"torch {env['torch']}, triton {env['triton']}, {env['threads']} threads, "
        f"{env['date']}; {args.rounds} interleaved rounds (median, p20-p80); "
        f"{'torch.compile (default mode)' if args.compile else 'eager'}.",
        "",
    ]
    rows = []
    only = "".join(f"_{name.rsplit('.', 1)[-1]}" for name in args.workload or [])
    out = RESULTS / f"pipeline_{device.type}{'_compiled' if args.compile else ''}{only}.md"
    for work in workloads(device, args.images):
        if args.workload and work["name"] not in args.workload:
            continue
        options = RunOptions(
            work["amp"], work["channels_last"], device=device, compile=args.compile
        )
        with tempfile.TemporaryDirectory() as root:
            loader = make_loader(work, Path(root), args.workers, device.type == "cuda")
            torch.manual_seed(0)
            dense = get_model(work["name"], 10 if work["data"] == "cifar10" else 1000)
            cases = {
                "dense": make_case(work, dense, options, False),
                "dtp": make_case(work, dense, options, True),
            }
            for case in cases.values():  # warm-up: workers, cuDNN, allocator
                run_epoch(case, loader, options, epoch=0)
            results: dict[str, list[dict]] = {name: [] for name in cases}
            order = list(cases.items())
            for index in range(args.rounds):  # dense first in even rounds, dtp in odd ones
                for name, case in order if index % 2 == 0 else order[::-1]:
                    results[name].append(run_epoch(case, loader, options, epoch=index + 1))
        workers = loader.num_workers
        lines += [
            f"## {work['name']}, {work['data']} ({work['images']} images, batch "
            f"{work['batch']}, {work['amp'] or 'fp32'}, {workers} loader workers)",
            "",
            "| epoch | images/s | p20-p80 | waiting for data | GPU in steps |",
            "| --- | --- | --- | --- | --- |",
        ]
        medians = {}
        for name, epochs in results.items():
            rates = [e["images"] / e["wall"] for e in epochs]
            walls = [e["wall"] for e in epochs]
            medians[name] = statistics.median(rates)
            low, high = np.percentile(rates, [20, 80])
            waited = statistics.median(e["waited"] / e["wall"] for e in epochs)
            busy = statistics.median(e["busy"] / e["wall"] for e in epochs)
            busy_text = f"{busy:.1%}" if device.type == "cuda" else "-"
            lines.append(
                f"| {name} | {medians[name]:.1f} | {low:.1f}-{high:.1f} | "
                f"{waited:.1%} | {busy_text} |"
            )
            rows.append(
                {
                    "op": "pipeline-epoch",
                    "provider": name,
                    "mode": "train-compiled" if args.compile else "train",
                    "shape": f"{work['name']} {work['data']} n{work['images']} "
                    f"b{work['batch']} w{workers}",
                    "dtype": work["amp"] or "fp32",
                    "median_us": statistics.median(walls) * 1e6,
                    "p20_us": np.percentile(walls, 20) * 1e6,
                    "p80_us": np.percentile(walls, 80) * 1e6,
                    **env,
                }
            )
        # per round, dtp's epoch time over dense's: throughput ratio = 1 / (1 + overhead)
        overhead, low, high = paired_overhead(
            [e["wall"] / e["images"] for e in results["dtp"]],
            [e["wall"] / e["images"] for e in results["dense"]],
        )
        lines += [
            "",
            f"DTP epoch throughput: {1 / (1 + overhead / 100):.1%} of dense, the median of "
            f"the rounds' ratios (95% interval {1 / (1 + high / 100):.1%}-"
            f"{1 / (1 + low / 100):.1%}); ratio of the medians "
            f"{medians['dtp'] / medians['dense']:.1%}.",
            "",
        ]
        print("\n".join(lines[-len(results) - 6 :]))
        # after every workload: a run stopped in the next one keeps this one's results
        append_rows(RESULTS / "pipeline.csv", rows)
        rows = []
        out.write_text("\n".join(lines))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
