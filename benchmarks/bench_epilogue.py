"""The masked-channel epilogue, out = relu((y + bias[c]) * mask[c]), per backend against a
plain copy of the same bytes (the memory limit), measured interleaved in one run.

    python benchmarks/bench_epilogue.py [--device cpu|cuda] [--rounds 10]

On CPU: C++ vs eager; on CUDA: Triton vs eager vs torch.compile of the eager expression.

Modes: fwd, bwd (backward only, producing dy, dmask and dbias), full (fwd + bwd).
Appends rows to benchmarks/results/epilogue.csv; writes
benchmarks/results/epilogue_<device>.md and a bar plot epilogue_<device>.png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _harness import RESULTS, append_rows, environment, interleaved, summarize

import dtp_kernels
from dtp_kernels import masked_channel_epilogue

SHAPE = (64, 256, 28, 28)


def make_cases(layout: str, dtype: torch.dtype, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype)
    if layout == "channels_last":
        y = y.to(memory_format=torch.channels_last)
    mask = torch.rand(SHAPE[1], generator=gen).to(device).requires_grad_(True)
    bias = torch.randn(SHAPE[1], generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(SHAPE, generator=gen).to(device=device, dtype=dtype)
    if layout == "channels_last":
        grad = grad.to(memory_format=torch.channels_last)
    y.requires_grad_(True)
    # The memory limit of an out-of-place op: allocate the output, read y, write it.
    cases = {"copy": {"fwd": lambda: y.detach().clone()}}
    backends = [b for b in dtp_kernels.available_backends(device) if b != "reference"]
    for backend in backends:

        def fwd(backend=backend):
            return masked_channel_epilogue(y, mask, bias, "relu", backend=backend)

        graph_out = fwd()

        def bwd(graph_out=graph_out):
            torch.autograd.grad(graph_out, (y, mask, bias), grad, retain_graph=True)

        def full(fwd=fwd):
            torch.autograd.grad(fwd(), (y, mask, bias), grad)

        cases[backend] = {"fwd": fwd, "bwd": bwd, "full": full}
    if device.type == "cuda":  # eager epilogue compiled by inductor: the baseline to beat
        compiled = torch.compile(
            lambda y, mask, bias: masked_channel_epilogue(y, mask, bias, "relu", backend="torch")
        )
        graph_out = compiled(y, mask, bias)
        cases["torch.compile"] = {
            "fwd": lambda: compiled(y, mask, bias),
            "bwd": lambda: torch.autograd.grad(graph_out, (y, mask, bias), grad, retain_graph=True),
            "full": lambda: torch.autograd.grad(compiled(y, mask, bias), (y, mask, bias), grad),
        }
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    print(env)
    rows = []
    configs = [("nchw", torch.float32), ("channels_last", torch.float32), ("nchw", torch.bfloat16)]
    for layout, dtype in configs:
        cases = make_cases(layout, dtype, device)
        flat = {
            (provider, mode): (fn, 1)
            for provider, modes in cases.items()
            for mode, fn in modes.items()
        }
        samples = interleaved(flat, args.rounds, device, warmup=1)
        dtype_name = str(dtype).removeprefix("torch.")
        for (provider, mode), s in samples.items():
            rows.append(
                dict(op="masked_channel_epilogue", provider=provider, mode=mode,
                     shape=f"{'x'.join(map(str, SHAPE))} {layout}", dtype=dtype_name,
                     **summarize(s), **env)
            )  # fmt: skip

    lines = [
        f"# masked_channel_epilogue (relu, with bias), {'x'.join(map(str, SHAPE))}",
        "",
        f"device: {env['device']}; threads: {env['threads']}; torch {env['torch']}; "
        f"triton {env['triton']}; date {env['date']}",
        "",
        "| layout | dtype | mode | provider | median ms | p20 ms | p80 ms | x copy | x vs torch |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    index = {(r["shape"], r["dtype"], r["provider"], r["mode"]): r for r in rows}
    for r in rows:
        if r["provider"] == "copy":
            continue
        copy = index[(r["shape"], r["dtype"], "copy", "fwd")]["median_us"]
        eager = index[(r["shape"], r["dtype"], "torch", r["mode"])]["median_us"]
        lines.append(
            f"| {r['shape'].split()[1]} | {r['dtype']} | {r['mode']} | {r['provider']} "
            f"| {r['median_us'] / 1e3:.2f} | {r['p20_us'] / 1e3:.2f} | {r['p80_us'] / 1e3:.2f} "
            f"| {r['median_us'] / copy:.2f} | {eager / r['median_us']:.2f} |"
        )
    report = (
        "\n".join(lines) + "\n\n`x copy`: time over one out-of-place copy of y (`y.clone()`); "
        "`x vs torch`: eager time over this provider's time.\n"
    )
    print(report)
    if args.no_save:
        return
    append_rows(RESULTS / "epilogue.csv", rows)
    (RESULTS / f"epilogue_{device.type}.md").write_text(report)
    plot(rows, RESULTS / f"epilogue_{device.type}.png", env)


def plot(rows: list[dict], path: Path, env: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["shape"].split()[1], r["dtype"]) for r in rows})
    providers = [p for p in dict.fromkeys(r["provider"] for r in rows) if p != "copy"]
    modes = ["fwd", "bwd", "full"]
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
    for ax, (layout, dtype) in zip(axes[0], configs, strict=True):
        sel = {(r["provider"], r["mode"]): r["median_us"] / 1e3 for r in rows
               if r["shape"].split()[1] == layout and r["dtype"] == dtype}  # fmt: skip
        width = 0.8 / len(providers)
        for i, provider in enumerate(providers):
            xs = [m + i * width for m in range(len(modes))]
            ax.bar(xs, [sel.get((provider, mode), 0) for mode in modes], width, label=provider)
        ax.axhline(sel[("copy", "fwd")], color="k", ls="--", lw=1, label="copy (fwd)")
        ax.set_xticks([m + width * (len(providers) - 1) / 2 for m in range(len(modes))], modes)
        ax.set_title(f"{layout}, {dtype}")
        ax.set_ylabel("median ms")
        ax.legend()
    fig.suptitle(f"masked_channel_epilogue {SHAPE}: {env['device']}, torch {env['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
