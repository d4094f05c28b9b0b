"""Helpers the tests share: the backends that run here, the ragged segment layout, the
training loop that compares a backend with the literal reference, and the low-precision
check. Imported after conftest.py has set TRITON_INTERPRET (pyproject's pythonpath puts
tests/ on sys.path, so every test folder imports it as `utils`)."""

import os
import socket
import sys
from pathlib import Path

import torch
from torch import nn

import dtp_kernels
from dtp_kernels import TransportState, transport_mask

# Backends that run on CPU tensors here, besides the reference oracle.
FAST_CPU_BACKENDS = [b for b in dtp_kernels.available_backends("cpu") if b != "reference"]
ALL_CPU_BACKENDS = dtp_kernels.available_backends("cpu")
CUDA = torch.device("cuda")


def cuda_backends() -> list[str]:
    """The GPU backends present: triton, and cuda when the CUDA kernels are built."""
    if not torch.cuda.is_available():
        return []
    return [b for b in dtp_kernels.available_backends(CUDA) if b in ("triton", "cuda")]


def require_backend(backend: str, device) -> None:
    """Skip the calling test unless `backend` runs on `device` here."""
    import pytest

    if backend not in dtp_kernels.available_backends(device):
        pytest.skip(f"backend {backend!r} is not available on {device}")


# (n, k) per segment: ragged sizes, k from 0 to n with both ends, fractional k.
RAGGED_LAYOUT = [
    (1, 0.0),
    (1, 1.0),
    (2, 0.0),
    (2, 1.0),
    (2, 2.0),
    (3, 1.5),
    (3, 3.0),
    (17, 0.0),
    (17, 5.0),
    (17, 17.0),
    (1023, 511.5),
    (1025, 1.0),
    (4096, 1000.0),
    (4096, 4096.0),
]


# Tolerances of a backend computing in `dtype` against the float64 reference. In float32
# the carried log-odds grow with the step count (about |2s - 1| / eps per step), so their
# rounding error grows too: after 200 steps masks and score gradients differ by up to 2e-4
# with eager torch and 2e-5 with the C++ kernels (the README states these figures).
TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-3, 3e-4)}


def run_loop(
    backend,
    dtype,
    iters,
    steps,
    layout=RAGGED_LAYOUT,
    lr=0.05,
    seed=0,
    device="cpu",
    worst=None,
    **options,
):
    """Train scores on a fixed linear loss; compare each step with the reference.
    ``options`` go to the backend's transport_mask call (e.g. blocks_per_segment).

    Both paths see the same scores every step (updated with the reference gradient), so
    a difference is the backend's alone; the two states evolve independently.
    """
    gen = torch.Generator().manual_seed(seed)
    sizes = [n for n, _ in layout]
    keep = torch.tensor([k for _, k in layout], dtype=torch.float64)
    total = sum(sizes)
    scores = torch.rand(total, generator=gen, dtype=torch.float64)
    weights = torch.randn(total, generator=gen, dtype=torch.float64)
    ref_state = TransportState(sizes, dtype=torch.float64)
    state = TransportState(sizes, dtype=dtype, device=device)
    rtol, atol = TOLERANCES[dtype]
    for step in range(steps):
        s_ref = scores.clone().requires_grad_(True)
        k_ref = keep.clone().requires_grad_(True)
        m_ref = transport_mask(s_ref, k_ref, ref_state, iters=iters, backend="reference")
        (weights * m_ref).sum().backward()

        s = scores.to(device, dtype).clone().requires_grad_(True)
        k = keep.to(device, dtype).clone().requires_grad_(True)
        m = transport_mask(s, k, state, iters=iters, backend=backend, **options)
        (weights.to(device, dtype) * m).sum().backward()

        msg = f"{backend} step {step}"
        got = (m.detach(), s.grad, k.grad)
        want = (m_ref.detach(), s_ref.grad, k_ref.grad)
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(a.double().cpu(), b, rtol=rtol, atol=atol, msg=msg)
            if worst is not None:  # the largest error of mask, score and keep gradients
                worst[index] = max(worst[index], float((a.double().cpu() - b).abs().max()))
        ref_state.commit()
        state.commit()
        scores = scores - lr * s_ref.grad
    torch.testing.assert_close(state.shift.double().cpu(), ref_state.shift, rtol=rtol, atol=atol)
    return state, ref_state


def check_fixed_scores_against_reference(
    backend, sizes, keep, scores, eps, dtype, steps=3, device="cpu", **options
):
    """The same float64 scores every step, at a small `eps`: masks and score gradients
    against the float64 reference (on the CPU), score gradients held to `dtype`'s rounding
    at their scale (about 2 / eps). ``options`` go to the backend's transport_mask call.
    Returns the backend's state."""
    gen = torch.Generator().manual_seed(0)
    weights = torch.randn(sum(sizes), generator=gen, dtype=torch.float64)
    state = TransportState(sizes, dtype=dtype, device=device)
    ref_state = TransportState(sizes, dtype=torch.float64)
    rtol, atol = (1e-9, 1e-10) if dtype == torch.float64 else (1e-4, 1e-5)
    for step in range(steps):
        s = scores.to(device=device, dtype=dtype, copy=True).requires_grad_(True)
        s_ref = scores.clone().requires_grad_(True)
        mask = transport_mask(s, keep, state, eps=eps, backend=backend, **options)
        ref = transport_mask(s_ref, keep, ref_state, eps=eps, backend="reference")
        (weights.to(device=device, dtype=dtype) * mask).sum().backward()
        (weights * ref).sum().backward()
        torch.testing.assert_close(mask.double().cpu(), ref.detach(), rtol=rtol, atol=atol)
        scale = float(s_ref.grad.abs().max())
        torch.testing.assert_close(
            s.grad.double().cpu(), s_ref.grad, rtol=rtol, atol=atol * scale, msg=f"step {step}"
        )
        state.commit()
        ref_state.commit()
    return state


def check_low_precision(backend, dtype, device="cpu", layout=RAGGED_LAYOUT, **options):
    """fp16/bf16 scores: math in fp32; the result only carries the output rounding.
    ``options`` go to the backend's transport_mask call."""
    tolerance = {
        torch.float16: (2e-3, 1e-3),
        torch.bfloat16: (1.6e-2, 8e-3),
        torch.float32: (2e-5, 2e-6),
    }
    rtol, atol = tolerance[dtype]
    sizes = [n for n, _ in layout]
    keep = [k for _, k in layout]
    gen = torch.Generator().manual_seed(2)
    scores = torch.rand(sum(sizes), generator=gen).to(dtype)
    ref = transport_mask(scores.double(), keep, TransportState(sizes), backend="reference")
    s = scores.to(device).requires_grad_(True)
    state = TransportState(sizes, device=device)
    mask = transport_mask(s, keep, state, backend=backend, **options)
    assert mask.dtype == dtype
    torch.testing.assert_close(mask.double().cpu(), ref, rtol=rtol, atol=atol)
    mask.float().pow(2).sum().backward()
    assert s.grad.dtype == dtype and torch.isfinite(s.grad.float()).all()


# -- running `dtp prune` in a subprocess, as the resume and preemption tests do ----------

ROOT = Path(__file__).resolve().parents[1]
DIGITS_RECIPE = ROOT / "dtp_kernels" / "configs" / "digits.yaml"


def prune_argv(out: Path, overrides: list[str], *extra: str) -> list[str]:
    """The `dtp prune` arguments for the digits recipe with `overrides`, into `out`."""
    sets = [arg for s in overrides for arg in ("--set", s)]
    config = str(DIGITS_RECIPE)
    return ["prune", "--config", config, *sets, "--out", str(out), *extra]


def prune_command(out: Path, overrides: list[str], *extra: str) -> list[str]:
    """`python -m dtp_kernels prune` in a subprocess (see prune_argv)."""
    return [sys.executable, "-m", "dtp_kernels", *prune_argv(out, overrides, *extra)]


def checkout_environment(**variables: str) -> dict:
    """This environment with the checkout first on PYTHONPATH (entries already there, such
    as a folder of carried wheels, kept), plus `variables`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **variables}


def free_port() -> int:
    """A TCP port of this machine free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_environment() -> dict:
    """This environment with the checkout importable and two threads (bitwise runs)."""
    return checkout_environment(OMP_NUM_THREADS="2")


def lose_the_node_at(call: int, function):
    """`function`, except that its `call`-th call raises RuntimeError("node lost") (a
    crash with no signal: nothing is saved at it)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError("node lost")
        return function(*args, **kwargs)

    return wrapped


def final_state(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor a finished run ends with: each stage's model, and the DTP stage's
    pruner (scores, transport state)."""
    tensors = {}
    for stage in ("pretrain", "dtp", "finetune"):
        payload = torch.load(out / "checkpoints" / f"{stage}.pt", weights_only=True)
        assert payload["done"], f"{stage} did not finish"
        for part in ("model", "pruner"):
            for key, value in (payload[part] or {}).items():
                tensors[f"{stage}/{part}/{key}"] = value
    return tensors


def causal_lm(family: str, sizes: dict, seed: int = 0) -> torch.nn.Module:
    """transformers' `{family}ForCausalLM` built from a `{family}Config` of `sizes`
    (save_pruned's builder entry point "utils:causal_lm")."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**sizes)
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def tiny_bitnet(kv_heads: int = 2) -> torch.nn.Module:
    """transformers' BitNet of 2 layers of 4 heads of 8 (`kv_heads` key/value heads),
    its norms' parameters random: RMS norms over its attention output (attn_sub_norm) and
    its MLPs' hidden width (ffn_sub_norm)."""
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=8)
    heads = dict(num_attention_heads=4, num_key_value_heads=kv_heads)
    tokens = dict(vocab_size=LLAMA_VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return random_params(causal_lm("BitNet", sizes | heads | tokens), "norm")


def tiny_t5(family: str = "T5", model: str | None = None, seed: int = 0, **sizes):
    """transformers' `{model or family}ForConditionalGeneration` of 2 encoder and 2
    decoder layers of 4 heads of 8 from a `{family}Config` (T5 v1.1's gated MLP unless
    `sizes` says otherwise), with example inputs (input ids, no attention mask, decoder
    input ids)."""
    import transformers

    options = dict(
        feed_forward_proj="gated-gelu",
        vocab_size=LLAMA_VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=2,
    )
    config = getattr(transformers, f"{family}Config")(**(options | sizes))
    torch.manual_seed(seed)
    built = getattr(transformers, f"{model or family}ForConditionalGeneration")(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA_VOCAB, (2, 9), generator=generator)
    return built, (ids, None, torch.randint(0, LLAMA_VOCAB, (2, 5), generator=generator))


def tiny_mamba2(groups: int = 2) -> torch.nn.Module:
    """A Mamba-2 language model of two mixers of 8 heads of 8 channels in `groups` groups
    (hidden 32, expand 2), its norm weights and conv biases drawn away from 1 and 0
    (save_pruned's builder entry point "utils:tiny_mamba2")."""
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        num_heads=8,
        head_dim=8,
        n_groups=groups,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        chunk_size=8,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("norm.weight", "conv1d.bias")):
                parameter.uniform_(0.5, 1.5)
    return model


def group_norm_net(width: int = 8, classes: int = 4) -> torch.nn.Module:
    """conv -> GroupNorm -> ReLU -> conv -> BN -> ReLU -> pool -> linear: a model a user's
    function builds (save_pruned's builder entry point "utils:group_norm_net")."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, width, 3, padding=1),
        torch.nn.GroupNorm(width // 4, width),
        torch.nn.ReLU(),
        torch.nn.Conv2d(width, width, 3, padding=1),
        torch.nn.BatchNorm2d(width),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(width, classes),
    )


LLAMA_VOCAB = 61

# a Hugging Face vision transformer's config fields, tiny: 16 x 16 images in 4 x 4 patches,
# two layers of 4 heads of 8 and MLPs of 64
TINY_HF_VIT = dict(
    image_size=16,
    patch_size=4,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
)


# a Hugging Face BERT's config fields, tiny: two layers of 4 heads of 8 and MLPs of 64
TINY_BERT = dict(
    vocab_size=LLAMA_VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
)


def tiny_llama(heads=4, kv_heads=2, layers=2, seed=0, vocab=LLAMA_VOCAB):
    """A Llama of head_dim 8, hidden MLP 48 (Hugging Face transformers, built here)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=8 * heads,  # head_dim 8
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def tiny_mixtral(vocab=LLAMA_VOCAB, experts=8, top_k=2, seed=0):
    """A Mixtral of 4 heads (2 key/value), `experts` experts of 32 (`top_k` per token)."""
    import transformers

    sizes = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    config = transformers.MixtralConfig(
        **sizes, vocab_size=vocab, intermediate_size=32, num_hidden_layers=2
    )
    config.num_local_experts, config.num_experts_per_tok = experts, top_k
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config)


def tiny_deepseek(version: int = 3, q_lora_rank: int | None = 20, seed: int = 0):
    """A DeepSeek-V{version} causal LM with latent attention of 4 heads (query 8 + 4 rotary,
    value 6; query latent `q_lora_rank`, or a plain q_proj with None), a dense first
    layer (MLP 64), then 4 experts of 16 (2 per token) beside a shared expert."""
    import transformers

    config = getattr(transformers, f"DeepseekV{version}Config")(
        vocab_size=LLAMA_VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        intermediate_size=64,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=6,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return getattr(transformers, f"DeepseekV{version}ForCausalLM")(config)


def tiny_dbrx(ffn_hidden_size: int = 32, experts: int = 2):
    """DBRX: 2 layers of 4 query heads of 8 over 2 key/value heads (its fused Wqkv), and
    `experts` experts of `ffn_hidden_size` per block, in its raw 2-D w1, v1 and w2."""
    import transformers

    config = transformers.DbrxConfig(
        vocab_size=LLAMA_VOCAB,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={
            "hidden_size": 32,
            "ffn_hidden_size": ffn_hidden_size,
            "moe_num_experts": experts,
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.DbrxForCausalLM(config).eval()


def tiny_deepseek_v4(vocab: int = LLAMA_VOCAB):
    """DeepSeek-V4 at 8 query heads of 16 reading one key/value head, its output
    projection block-diagonal over 2 groups of 4 heads; a sliding-window layer, then one
    of compressed sparse attention with an indexer of 2 heads of its own."""
    import transformers

    config = transformers.DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=32,
        num_attention_heads=8,
        head_dim=16,
        q_lora_rank=20,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "compressed_sparse_attention"],
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        o_groups=2,
        o_lora_rank=12,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=4,
        sliding_window=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def tiny_gemma_sharing_kv(family: str, sparsity: float = 0.0, vocab: int = 256):
    """Gemma 3n or Gemma 4 ("gemma3n", "gemma4"): 4 layers of 4 query heads of 16 over 2
    key/value heads, the last 2 reading the keys and values of the first 2 (one of each
    type); Gemma 3n's first MLP with activation sparsity `sparsity`."""
    import transformers

    sizes = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=16,
        sliding_window=8,
    )
    if family == "gemma3n":
        config = transformers.Gemma3nTextConfig(
            **sizes, laurel_rank=8, activation_sparsity_pattern=[sparsity, 0.0, 0.0, 0.0]
        )
        build = transformers.Gemma3nForCausalLM
    else:
        config = transformers.Gemma4TextConfig(**sizes, global_head_dim=16)
        build = transformers.Gemma4ForCausalLM
    torch.manual_seed(0)
    return build(config).eval()


def tiny_kimi_linear(vocab: int = LLAMA_VOCAB, layers: int = 3, seed: int = 0):
    """Kimi Linear: Kimi Delta Attention layers (4 heads of 8) around a latent-attention
    layer, mixture-of-experts MLPs after the first layer."""
    import transformers

    config = transformers.KimiLinearConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        linear_head_dim=8,
        linear_num_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"][:layers],
        mlp_layer_types=["dense", "sparse", "sparse"][:layers],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return transformers.KimiLinearForCausalLM(config)


def random_params(model: torch.nn.Module, part: str, std: float = 0.5) -> torch.nn.Module:
    """The model with every parameter whose name contains `part` drawn from N(0, std)
    (seeded): a norm's weight and bias start at an identity that would leave its
    rescaling at export untested."""
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if part in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


def randomised(pruner):
    """The pruner with its scores drawn at random (seeded), away from their initial order,
    so the kept units differ from group to group."""
    with torch.no_grad():
        pruner.scores.copy_(
            torch.rand(pruner.scores.shape, generator=torch.Generator().manual_seed(3))
        )
    return pruner


def layer_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The weight shape of each conv and linear layer of `model`, by name."""
    from dtp_kernels.pruning.cost import COSTED

    return {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, COSTED)}


def whole_as_listed(exported: nn.Module, shapes: dict, left_whole: dict) -> bool:
    """Whether the conv and linear layers `exported` leaves the shapes they had before
    (`shapes`: layer_shapes of the model) are exactly the ones a pruner's `left_whole`
    lists, among those it still holds by name (export replaces some attention layers
    with classes of their own)."""
    held = {n: s for n, s in layer_shapes(exported).items() if n in shapes}
    unchanged = {n for n, s in held.items() if s == shapes[n]}
    return unchanged == set(left_whole) & set(held)


def bf16_step_and_export(pruner, model, inputs: tuple):
    """One bf16-autocast training step of a causal LM on the GPU, then its fp32 export
    (IEEE matmuls) checked equal to the hard-masked model: (the scores' gradients, the
    exported model)."""
    model.train()
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(*inputs, labels=inputs[0]).loss
    loss.backward()
    exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return pruner.scores.grad, exported


def bfloat16_trained_and_exported(model: nn.Module, x: torch.Tensor, ratios) -> None:
    """`model` in bfloat16 pruned at `ratios`, trained three SGD steps on `x` (its soft
    masks with it), and exported: checked equal to the hard-masked model within
    bfloat16's rounding."""
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    from dtp_kernels.pruning import DTPPruner

    pruner = DTPPruner(model, (x[:1],), ratios)
    optimizer = torch.optim.SGD([*model.parameters(), pruner.scores], lr=0.05)
    pruner.attach(optimizer)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        model(x).float().square().mean().backward()
        optimizer.step()
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(x).float()
    with torch.no_grad():
        got = pruner.export().eval()(x).float()
    torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2)


def hard_masked_and_exported(pruner, model, inputs: tuple):
    """(exported model, its logits, the hard-masked model's logits) on `inputs`."""
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs).logits
    exported = pruner.export().eval()
    with torch.no_grad():
        got = exported(*inputs).logits
    return exported, got, want


def exported_as_masked(pruner, model: nn.Module, inputs: tuple, atol: float = 1e-5):
    """The pruner's export, checked to compute on `inputs` what the hard-masked model
    computes (eval, float32 tolerances)."""
    model.eval()
    with torch.no_grad(), pruner.hard_masked():
        want = model(*inputs)
    exported = pruner.export().eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(*inputs), want, rtol=1e-5, atol=atol)
    return exported


def described_export(pruner, model, inputs: tuple) -> tuple[nn.Module, torch.Tensor]:
    """(exported model, its logits), checked: the export computes what the hard-masked
    model computes and export gave no warning that the config cannot describe it."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported, got, want = hard_masked_and_exported(pruner, model, inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not [w for w in caught if "config cannot describe" in str(w.message)]
    return exported, got


def check_export(
    pruner,
    model: nn.Module,
    x: torch.Tensor,
    atol: float | None = None,
    example: tuple | None = None,
) -> nn.Module:
    """The exported model of a pruner over an image model checked: the hard masks change
    the output, the export computes what the hard-masked model computes (to `atol`,
    by default 1e-5 of the output's scale), and its parameters and FLOPs (on `example`,
    the pruner's example inputs: by default `x[:1]`) are the report's."""
    from dtp_kernels.pruning.cost import count_flops, count_params

    model.eval()
    with torch.no_grad():
        dense = model(x)
        with pruner.hard_masked():
            want = model(x)
    scale = want.abs().max()  # torchvision's MobileNetV3 head gives outputs near 1e-4
    assert (want - dense).abs().max() > 0.01 * scale  # the masks change the output
    exported = pruner.export().eval()
    with torch.no_grad():
        atol = 1e-5 * scale if atol is None else atol
        torch.testing.assert_close(exported(x), want, rtol=1e-5, atol=atol)
    report = pruner.report()
    assert count_params(exported) == report["params_after"]
    assert count_flops(exported, example or (x[:1],)) == report["flops_after"]
    return exported


def drawn_statistics(model: nn.Module) -> nn.Module:
    """BN statistics and affine parameters away from the identity (and from the zeros
    some inits give the last BN of a block), so every kept channel shows in the output."""
    generator = torch.Generator().manual_seed(5)
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm2d, nn.BatchNorm3d)):
            for tensor, low, high in (
                (module.weight.data, 0.5, 1.5),
                (module.bias.data, -0.2, 0.2),
                (module.running_mean, -0.2, 0.2),
                (module.running_var, 0.5, 1.5),
            ):
                tensor.copy_(torch.empty(tensor.shape).uniform_(low, high, generator=generator))
    return model


def small_regnet_y() -> nn.Module:
    """torchvision's RegNetY (grouped convs, squeeze-and-excitation), four blocks."""
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(
        depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25
    )
    return RegNet(params, num_classes=5, stem_width=16)


class HFLogits(nn.Module):
    """A Hugging Face image classifier returning its logits tensor (check_export compares
    tensors)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


class ChannelAffine(nn.Module):
    """x * weight + bias per channel, over the last dimension (MobileBERT's NoNorm by
    another name): parameters of a GRN's shape, but no rescaling of the weight keeps it
    exact as channels go (the kept channels would be scaled)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class ScaledByWidth(nn.Module):
    """Scaled by its input's width: runs cut to fewer channels, and computes other values
    (a group it reads is refused by enclosing_readers' proof)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).softmax(1) * x.shape[1] ** -0.5


class PassedOn(nn.Module):
    """Its input concatenated to its output: cut, its output is narrower (left to the
    export's check)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(width, width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.proj(x).softmax(1)], 1)


def tiny_speech_encoder(family: str, **options) -> nn.Module:
    """transformers' `{family}ForSequenceClassification` (Wav2Vec2, Hubert,
    Wav2Vec2Conformer) of 2 layers of 4 heads of 8 and a feature extractor of two
    convs, seeded; `options` set other config fields or replace these."""
    import transformers

    sizes = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=[16, 16],
        conv_stride=[5, 2],
        conv_kernel=[10, 3],
        num_feat_extract_layers=2,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        classifier_proj_size=16,
        num_labels=5,
    )
    config = getattr(transformers, f"{family}Config")(**(sizes | options))
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForSequenceClassification")(config)
