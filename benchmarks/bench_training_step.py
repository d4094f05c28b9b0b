"""What DTP costs in training: a full training step (forward, backward, SGD step, state
commit) with DTP masks against the same model without masks, interleaved in one run.

    python benchmarks/bench_training_step.py [--device cpu|cuda] [--rounds N]
        [--model NAME] [--provider NAME ...]

CPU: CIFAR ResNet-56 (batch 64, 32x32) and the digits CNN (batch 64, 8x8).
CUDA: torchvision ResNet-50 (batch 64, 224x224, bf16 autocast, channels_last).

Masking strategies (docs/design.md section 2): "fold" puts the masks on the BN affine
parameters (mask_at="parameters"); "epilogue" multiplies the activations with the fused
masked-channel epilogue; "eager-act" does the same with eager torch ops. Each runs with
every mask-step backend present. The overhead is median(masked) / median(dense) - 1.

On CUDA the table also gives the time the host spends issuing one step (`host ms`), and
--graph times every step captured in a CUDA graph instead (replays: no dispatch cost).

--model and --provider narrow the run to one workload and some providers (dense always
runs): the rounds then go where the question is, e.g. `--model resnet56 --provider
fold/cpu --rounds 300` for the CPU overhead of folded masks.

Appends rows to benchmarks/results/training_step.csv and writes
benchmarks/results/training_step_<device>.md (training_step_cuda_graph.md with --graph;
a narrowed run adds its model and providers to the name).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, append_rows, environment, interleaved, paired_overhead, summarize

import dtp_kernels
from dtp_kernels import DTPPruner
from dtp_kernels.models import get_model
from dtp_kernels.pipeline.step import compile_model as compile_for_training
from dtp_kernels.pipeline.step import training_step
from dtp_kernels.pipeline.train import make_optimizer

# strategy -> (mask_at, epilogue backend: None = the mask-step backend's own)
STRATEGIES = {
    "fold": ("parameters", None),
    "epilogue": ("activation", None),
    "eager-act": ("activation", "torch"),
}


def workloads(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [
            dict(
                model="torchvision.resnet50",
                batch=64,
                size=224,
                classes=1000,
                amp=torch.bfloat16,
                channels_last=True,
                inner=5,
            )
        ]
    return [
        dict(
            model="resnet56", batch=64, size=32, classes=10, amp=None, channels_last=False, inner=1
        ),
        dict(
            model="digits_cnn",
            batch=64,
            size=8,
            classes=10,
            amp=None,
            channels_last=False,
            inner=20,
        ),
    ]


def make_case(
    work: dict,
    base: torch.nn.Module,
    device: torch.device,
    strategy,
    backend,
    graph=False,
    compile_model=False,
):
    """A step function for the dense model (strategy None) or one DTP configuration;
    graph=True captures the whole step in a CUDA graph and returns its replay;
    compile_model=True runs the model under torch.compile (default mode), as
    `run.compile: true` does."""
    model = copy.deepcopy(base).to(device)
    channels = 1 if work["model"] == "digits_cnn" else 3
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(work["batch"], channels, work["size"], work["size"], generator=gen)
    labels = torch.randint(0, work["classes"], (work["batch"],), generator=gen)
    images, labels = images.to(device), labels.to(device)
    if work["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(memory_format=torch.channels_last)
    pruner = None
    if strategy is not None:
        mask_at, epilogue = STRATEGIES[strategy]
        epilogue = epilogue or (backend if backend != "torch" else "torch")
        pruner = DTPPruner(
            model, images[:1], 0.5, mask_at=mask_at, backend=backend, epilogue_backend=epilogue
        )
    optimizer = make_optimizer(model, {"lr": 0.01}, pruner)
    if pruner is not None:
        pruner.attach(optimizer)
    model.train()
    net = compile_for_training(model) if compile_model else model

    def step() -> None:
        training_step(net, optimizer, images, labels, pruner, amp=work["amp"])

    if not graph:
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(captured):
        step()

    def replay() -> None:
        captured.replay()

    # The graph reads and writes the model's, optimizer's and pruner's tensors without
    # owning them: keep them alive with the replay (freed, the replay writes freed memory).
    replay.step = step
    return replay


def host_overhead(cases: dict, device: torch.device, rounds: int = 5) -> dict[str, float]:
    """Per case: the seconds the host spends issuing one step (no sync inside), against
    the samples' full step time; near 1 means the step is host-bound."""
    import time

    host = {}
    for name, (fn, _inner) in cases.items():
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        torch.cuda.synchronize(device)
        host[name] = sorted(times)[len(times) // 2]
    return host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=None, help="default: 15 CPU, 20 CUDA")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument(
        "--graph", action="store_true", help="CUDA: time steps captured in CUDA graphs"
    )
    parser.add_argument("--model", default=None, help="run this workload only")
    parser.add_argument(
        "--provider",
        action="append",
        default=None,
        help="run this provider (strategy/backend) besides dense; repeat for more",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    rounds = args.rounds or (20 if device.type == "cuda" else 15)
    if args.graph and device.type != "cuda":
        raise SystemExit("--graph needs --device cuda")
    env = environment(device)
    backends = [b for b in dtp_kernels.available_backends(device) if b not in ("reference",)]
    if device.type == "cpu":
        backends = [b for b in backends if b != "triton"]  # interpreted Triton: not a CPU path
    print(env)
    rows, lines = [], []
    chosen = workloads(device)
    if args.model is not None:
        chosen = [w for w in chosen if w["model"] == args.model]
        if not chosen:
            names = [w["model"] for w in workloads(device)]
            raise SystemExit(f"--model {args.model!r}: the workloads on {device} are {names}")
    known = [
        f"{strategy}/{backend}"
        for strategy in STRATEGIES
        for backend in backends
        if strategy == "fold" or backend != "torch"
    ]
    unknown = sorted(set(args.provider or []) - set(known))
    if unknown:
        raise SystemExit(f"--provider {unknown}: the providers on {device} are {known}")
    for work in chosen:
        torch.manual_seed(0)
        base = get_model(work["model"], num_classes=work["classes"])
        dense_step = make_case(work, base, device, None, None, args.graph)
        cases = {"dense": (dense_step, work["inner"])}
        for strategy in STRATEGIES:
            for backend in backends:
                if strategy != "fold" and backend == "torch":
                    continue  # activation strategies: one mask-step backend is enough
                name = f"{strategy}/{backend}"
                if args.provider is not None and name not in args.provider:
                    continue
                print(f"setting up {name}", flush=True)  # which case, should one crash
                step = make_case(work, base, device, strategy, backend, args.graph)
                cases[name] = (step, work["inner"])
        samples = interleaved(cases, rounds, device, warmup=2)
        host = host_overhead(cases, device) if device.type == "cuda" and not args.graph else {}
        dense = summarize(samples["dense"])["median_us"]
        shape = (
            f"{work['model']} batch {work['batch']} {work['size']}x{work['size']}"
            + (" bf16 channels_last" if work["amp"] else "")
            + (" CUDA graph" if args.graph else "")
        )
        lines += [
            f"## {shape}",
            "",
            "| provider | median ms | p20 ms | p80 ms | overhead vs dense | paired overhead "
            "[95% CI] | host ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for name, values in samples.items():
            stats = summarize(values)
            overhead = 100 * (stats["median_us"] / dense - 1)
            dtype = "bfloat16" if work["amp"] else "float32"
            mode = "graph-step" if args.graph else "step"
            rows.append(
                dict(
                    op="training_step",
                    provider=name,
                    mode=mode,
                    shape=shape,
                    dtype=dtype,
                    **stats,
                    **env,
                )
            )
            issued = f"{host[name] * 1e3:.2f}" if name in host else "-"
            paired, low, high = paired_overhead(values, samples["dense"])
            lines.append(
                f"| {name} | {stats['median_us'] / 1e3:.2f} | {stats['p20_us'] / 1e3:.2f} "
                f"| {stats['p80_us'] / 1e3:.2f} | {overhead:+.2f}% "
                f"| {paired:+.2f}% [{low:+.2f}, {high:+.2f}] | {issued} |"
            )
        lines.append("")
    header = [
        "# DTP training-step overhead",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}; {rounds} interleaved rounds",
        "",
        "fold = masks on the BN affine parameters; epilogue = fused masked-channel epilogue "
        "on the activations; eager-act = the same in eager torch. `provider` is "
        "strategy/mask-step backend. `host ms` (CUDA): time the host spends issuing one "
        "step; close to the median, the step is host-bound. `paired overhead`: the median "
        "of the per-round ratios to dense (the rounds are interleaved), with a 95% "
        "bootstrap interval of that median.",
        "",
    ]
    report = "\n".join(header + lines)
    print(report)
    if not args.no_save:
        append_rows(RESULTS / "training_step.csv", rows)
        suffix = "_graph" if args.graph else ""
        if args.model is not None or args.provider is not None:
            parts = [args.model or "all", *(args.provider or [])]
            suffix += "_" + "_".join(p.replace("/", "-") for p in parts)
        (RESULTS / f"training_step_{device.type}{suffix}.md").write_text(report)


if __name__ == "__main__":
    main()
