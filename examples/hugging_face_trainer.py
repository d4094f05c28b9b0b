"""Prune a Hugging Face causal language model with DTP inside transformers' Trainer.

One callback goes into an ordinary Trainer: DTPTrainerCallback(example inputs, ratios).
The Trainer's checkpoints hold the pruner's state, so a stopped run resumes where it
stopped; at the end `callback.pruner.export()` is the smaller model, saved with
`save_pretrained` and loaded back with `from_pretrained`. Run it as it is (a small Llama
built here, trained on generated token sequences, on the GPU when there is one), with
your own model directory (`--model DIR`), or copy the marked lines:

    python examples/hugging_face_trainer.py --out runs/llama --steps 60

Stopped (Ctrl-C, a scheduler's time limit) after a checkpoint, the same command with
`--resume` goes on from the last one, as if it had not stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from dtp_kernels.integrations.huggingface import DTPTrainerCallback


def my_model(path: str | None) -> transformers.PreTrainedModel:
    """Your pretrained model (`--model DIR`), or a small Llama built here."""
    if path is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def my_data(vocab: int, count: int = 256, length: int = 32) -> list[dict]:
    """Stands for your dataset: sequences that count up from a random token."""
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, vocab, (count, 1), generator=generator)
    ids = (starts + torch.arange(length)) % vocab
    return [{"input_ids": row, "labels": row} for row in ids]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the Trainer's output directory")
    parser.add_argument("--model", default=None, help="a Hugging Face model directory")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--resume", action="store_true", help="from the last checkpoint")
    args = parser.parse_args(argv)
    model = my_model(args.model)
    data = my_data(model.config.vocab_size)

    # 1. The callback: inputs to trace the model with, and the ratios (half the heads,
    #    key/value heads with their query heads, and half of every MLP's neurons).
    example = {"input_ids": data[0]["input_ids"][None]}
    callback = DTPTrainerCallback(example, {"heads": 0.5, "mlp": 0.5}, score_lr=0.05)
    training = transformers.TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=2e-3, warmup_steps=5, save_strategy="steps", save_steps=args.save_steps,
        report_to=[], logging_steps=10, disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),
    )  # fmt: skip
    # 2. The Trainer, as ever, with the callback.
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=data, callbacks=[callback]
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    # 3. The physically smaller model, with its config updated: save_pretrained and
    #    from_pretrained as any model; fine-tune it with a Trainer of its own.
    pruned = callback.pruner.export()
    pruned.save_pretrained(Path(args.out) / "pruned")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(Path(args.out) / "pruned")
    before = sum(p.numel() for p in model.parameters())
    after = sum(p.numel() for p in loaded.parameters())
    config = loaded.config
    print(
        f"heads {config.num_attention_heads} (key/value {config.num_key_value_heads}), "
        f"MLP neurons {config.intermediate_size}; parameters {before} -> {after}; "
        f"trained {trainer.state.global_step} steps"
    )
    return {"model": loaded, "steps": trainer.state.global_step, "pruner": callback.pruner}


if __name__ == "__main__":
    main()
