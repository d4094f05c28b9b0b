"""Prune a Hugging Face causal LM with DTP while FSDP2 shards it, in your own loop.

The pruner is made on the model before `fully_shard` (its masks then live in the
layers, which FSDP gathers and shards with the weights), the optimizer after it, and at
the end `pruner.export_sharded(...)` gathers the weights into the model built again
and exports the smaller model, which rank 0 saves with `save_pretrained`. Run it as it
is (a small Llama on generated text; NCCL with a GPU per process, else gloo on the
CPUs) or with your model's directory:

    torchrun --nproc_per_node 2 examples/fsdp2_llama.py --steps 40 --out pruned-llama
    torchrun --nproc_per_node 8 examples/fsdp2_llama.py --model PATH --out pruned
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard

from dtp_kernels import DTPPruner
from dtp_kernels.pruning.prepare import join_optimizer


def my_model(path: str | None) -> transformers.PreTrainedModel:
    """Stands for your pretrained model: the same weights on every rank."""
    if path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def my_batches(steps: int, rank: int, ranks: int, vocab: int, device: torch.device):
    """Stands for your data loader, sharded over the ranks: sequences that count up by
    one modulo the vocabulary from a random start (the next token is learnable)."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        starts = torch.randint(0, vocab, (4 * ranks, 1), generator=generator)
        ids = (starts + torch.arange(32)) % vocab
        yield ids[4 * rank : 4 * rank + 4].to(device)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a directory from_pretrained reads (default: small)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", required=True, help="where rank 0 saves the pruned model")
    args = parser.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", "0"))  # a GPU per process, or the CPUs
    cuda = torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    try:
        model = my_model(args.model).to(device)
        vocab = model.config.vocab_size
        example = {"input_ids": torch.zeros(1, 8, dtype=torch.long, device=device)}

        # 1. The pruner, on the unsharded model: half the heads and MLP neurons per layer.
        pruner = DTPPruner(model, example, {"heads": 0.5, "mlp": 0.5}, eps=0.25)
        # 2. FSDP2 after it: each decoder layer a unit, then the model.
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        # 3. The optimizer after fully_shard, as FSDP asks; the scores join it (their
        #    gradients averaged over the ranks, the transport state committed each step).
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        join_optimizer(pruner, optimizer, score_lr=0.05)

        model.train()
        losses = []
        for ids in my_batches(args.steps, rank, ranks, vocab, device):  # your loop
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())

        # 4. The smaller model: every rank gathers; rank 0 builds the model again to
        #    receive the weights (the others pass None) and saves the export.
        report = pruner.report()
        pruned = pruner.export_sharded(my_model(args.model).to(device) if rank == 0 else None)
        result = {"first_loss": losses[0], "last_loss": losses[-1], "report": report}
        if rank == 0:
            pruned.save_pretrained(args.out)
            print(
                json.dumps(
                    {
                        "kept": [g["k"] for g in report["groups"]],
                        "of": [g["n"] for g in report["groups"]],
                        "params": [report["params_before"], report["params_after"]],
                        "loss": [round(losses[0], 3), round(losses[-1], 3)],
                        "saved": args.out,
                    }
                )
            )
        return {**result, "model": pruned}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
