"""DTP under FSDP2 (`fully_shard`), two gloo ranks on CPU: a pruner made before the model
is sharded trains as it does under DistributedDataParallel (a Llama by heads and MLP
neurons, also under activation checkpointing or compiled block by block without a
graph break; a CIFAR ResNet-20 by filters, whose BN parameters the pruner otherwise
folds before the forward: sharded, each BN masks its own in its forward), every rank
holding the same scores and transport state (also computing in bfloat16, FSDP's mixed
precision: the scores float32, near the float32 run's); the sharded model's export()
is refused, and export_sharded() gathers the weights into the model built again and
exports what the DDP run exports."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from utils import free_port

pytestmark = pytest.mark.slow  # processes of their own: `make test-fast` leaves it out
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

IDS = torch.randint(0, 61, (12, 12), generator=torch.Generator().manual_seed(1))
IMAGES = torch.randn(12, 3, 32, 32, generator=torch.Generator().manual_seed(2))
LABELS = torch.randint(0, 10, (12,), generator=torch.Generator().manual_seed(3))


def llama():
    """A tiny Llama, its example, its blocks (what fully_shard wraps), its loss on rows
    `rows` of the data, the ratios and an input to compare exports on."""
    from utils import tiny_llama

    def loss(model, rows):
        ids = IDS[rows]
        return model(input_ids=ids, labels=ids).loss

    model = tiny_llama()
    blocks = list(model.model.layers)
    return model, {"input_ids": IDS[:1]}, blocks, loss, {"heads": 0.5, "mlp": 0.5}, IDS[:2]


def resnet20():
    from dtp_kernels.models import get_model

    def loss(model, rows):
        return torch.nn.functional.cross_entropy(model(IMAGES[rows]), LABELS[rows])

    torch.manual_seed(0)
    model = get_model("resnet20")
    blocks = [model.layer1, model.layer2, model.layer3]
    return model, IMAGES[:1], blocks, loss, 0.5, IMAGES[:2]


MODELS = {"llama": llama, "resnet20": resnet20}


def logits(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output


def worker(rank: int, port: int, out: str, kind: str, sharding: str) -> None:
    """Three steps on this rank's rows (rank r of step s: rows 4s + 2r, 4s + 2r + 1)
    under `sharding` ("fsdp": fully_shard each block and the model after the pruner is
    made; "fsdp-bf16": the same computing in bfloat16, FSDP's MixedPrecisionPolicy;
    "fsdp-root": the model alone, one unit gathering every parameter;
    "fsdp-checkpointed": a Llama's blocks under activation checkpointing;
    "fsdp-compiled": each block under torch.compile; "ddp"). Each
    rank saves the pruner's state, the whole weights (rank 0's gathered), the model
    export_sharded gathered into and the outputs of its export (export() of rank 0's
    under DDP)."""
    from torch._dynamo.utils import counters
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dtp_kernels import DTPPruner
    from dtp_kernels.pruning.prepare import join_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, example, blocks, loss, ratios, probe = MODELS[kind]()
        pruner = DTPPruner(model, example, ratios)
        initial = pruner.scores.detach().clone()
        with torch.no_grad():  # an evaluation before sharding: its folded BN parameters
            model.eval()  # must not be read after it
            logits(model(**example) if isinstance(example, dict) else model(example))
            model.train()
        if sharding.startswith("fsdp"):
            if sharding == "fsdp-checkpointed":  # the blocks recomputed in the backward
                kwargs = {"use_reentrant": False}
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            computing = torch.bfloat16 if sharding == "fsdp-bf16" else None
            policy = MixedPrecisionPolicy(param_dtype=computing, reduce_dtype=torch.float32)
            for block in [] if sharding == "fsdp-root" else blocks:
                fully_shard(block, mp_policy=policy)
                if sharding == "fsdp-compiled":  # each block compiled, as torchtitan does
                    block.compile()
            trained = fully_shard(model, mp_policy=policy)
        else:
            trained = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        join_optimizer(pruner, optimizer, score_lr=0.05)
        for step in range(3):
            optimizer.zero_grad()
            loss(trained, [4 * step + 2 * rank, 4 * step + 2 * rank + 1]).backward()
            optimizer.step()
        refused, small, built = None, None, None
        if sharding.startswith("fsdp"):
            try:
                pruner.export()
            except ValueError as error:
                refused = str(error)
            if rank == 0 or kind == "resnet20":  # the Llama's rank 1 only helps gather
                built = MODELS[kind]()[0]
            small = pruner.export_sharded(built)
        elif rank == 0:
            small = pruner.export()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)  # (rank 0's; all take part)
        saved = {"pruner": pruner.state_dict(), "refused": refused, "initial": initial}
        saved["weights"], saved["small"] = weights, small is not None
        saved["graph_breaks"] = sum(counters["graph_break"].values())
        if built is not None:  # left holding the gathered weights, without masks
            saved["built"] = built.state_dict()
        if small is not None:
            with torch.no_grad():
                saved["exported"] = logits(small.eval()(probe))
        torch.save(saved, f"{out}/{sharding}-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def magnitude_worker(rank: int, port: int, out: str) -> None:
    """scores="magnitude" (|w| read before every forward) and fully_shard: the first
    forward's error, saved by rank 0."""
    from torch.distributed.fsdp import fully_shard

    from dtp_kernels import DTPPruner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, example, blocks, loss, _, _ = resnet20()
        DTPPruner(model, example, 0.5, granularity="weight", scores="magnitude")
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        try:
            loss(model, [rank])
        except ValueError as error:
            if rank == 0:
                Path(out, "error.txt").write_text(str(error))
    finally:
        dist.destroy_process_group()


def refusal_worker(rank: int, port: int, out: str) -> None:
    """export_sharded() given models it cannot take, on one rank and then the other;
    each rank saves what it raised, and whether an export that can go on went on after
    (no rank left waiting in a gather the other skipped)."""
    from torch.distributed.fsdp import fully_shard

    from dtp_kernels import DTPPruner
    from utils import tiny_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model, example, blocks, _, ratios, _ = llama()
        pruner = DTPPruner(model, example, ratios)
        for block in blocks:
            fully_shard(block)
        fully_shard(model)
        with torch.device("meta"):
            unmade = tiny_llama()
        raised = []  # rank 1: narrower; rank 0: sharded; rank 1: on the meta device
        for wrong, where in ((tiny_llama(heads=2), 1), (model, 0), (unmade, 1)):
            given = wrong if rank == where else llama()[0]
            try:
                pruner.export_sharded(given)
            except ValueError as error:
                raised.append(str(error))
        small = pruner.export_sharded(llama()[0])
        saved = {"raised": raised, "exported": small is not None}
        torch.save(saved, f"{out}/refused-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run(tmp_path: Path, kind: str, sharding: str) -> list[dict]:
    mp.spawn(worker, args=(free_port(), str(tmp_path), kind, sharding), nprocs=2, join=True)
    return [torch.load(tmp_path / f"{sharding}-rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_pruner_made_before_fully_shard_trains_as_under_ddp(tmp_path, kind):
    if kind == "llama":
        pytest.importorskip("transformers")
    fsdp, fsdp_other = run(tmp_path, kind, "fsdp")
    ddp, _ = run(tmp_path, kind, "ddp")
    for key in fsdp["pruner"]:  # the scores' gradients averaged: every rank alike
        assert torch.equal(fsdp["pruner"][key], fsdp_other["pruner"][key]), key
    assert int(fsdp["pruner"]["state.steps"]) == 3
    assert not torch.equal(fsdp["pruner"]["scores"], fsdp["initial"])  # they learned
    for part in ("pruner", "weights"):  # FSDP's reduce-scatter rounds as DDP's all-reduce
        assert fsdp[part].keys() == ddp[part].keys()
        for key in fsdp[part]:
            torch.testing.assert_close(fsdp[part][key], ddp[part][key], rtol=1e-4, atol=1e-6)
    assert fsdp["refused"].startswith("export() copies the model whole, and FSDP shards")
    assert "pruner.export_sharded(model) on every rank" in fsdp["refused"]
    unmasked = {  # gathered into the model built, under its own keys
        re.sub(r"\.parametrizations\.(\w+)\.original$", r".\1", key): value
        for key, value in fsdp["weights"].items()
    }
    assert fsdp["built"].keys() == unmasked.keys()
    for key, value in unmasked.items():
        assert torch.equal(fsdp["built"][key], value), key
    torch.testing.assert_close(fsdp["exported"], ddp["exported"], rtol=1e-4, atol=1e-5)
    if kind == "resnet20":  # both ranks built one: the same export (rank 0's BN statistics)
        assert torch.equal(fsdp_other["exported"], fsdp["exported"])
    else:  # rank 1 passed None: it helped gather and got None
        assert not fsdp_other["small"]
    # every BN in the root unit, gathered by its pre-forward; the Llama's blocks gathered
    # again to be recomputed in the backward, reading the forward's masks, or compiled
    others = ["fsdp-root"] if kind == "resnet20" else ["fsdp-checkpointed", "fsdp-compiled"]
    for sharding in others:
        other = run(tmp_path, kind, sharding)[0]
        for key in ddp["pruner"]:
            torch.testing.assert_close(
                other["pruner"][key], ddp["pruner"][key], rtol=1e-4, atol=0, msg=sharding
            )
        torch.testing.assert_close(other["exported"], ddp["exported"], rtol=1e-4, atol=1e-5)
        assert other["graph_breaks"] == 0, sharding


def test_mixed_precision_computes_in_bfloat16_and_learns_the_scores_in_float32(tmp_path):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16): each layer multiplies its
    gathered bfloat16 weight by its mask cast to bfloat16 (a float32 product would fail
    the bfloat16 matmul); the scores and transport state stay float32, learn, and end
    near the float32 run's (bfloat16's rounding: within a tenth of how far they moved)."""
    pytest.importorskip("transformers")
    half, half_other = run(tmp_path, "llama", "fsdp-bf16")
    ddp, _ = run(tmp_path, "llama", "ddp")
    for key in half["pruner"]:
        assert torch.equal(half["pruner"][key], half_other["pruner"][key]), key
        assert half["pruner"][key].dtype == ddp["pruner"][key].dtype, key
    assert half["pruner"]["scores"].dtype == torch.float32
    assert half["exported"].dtype == torch.float32  # the gathered weights: float32
    moved = (ddp["pruner"]["scores"] - half["initial"]).abs().max()
    assert moved > 0.05
    apart = (half["pruner"]["scores"] - ddp["pruner"]["scores"]).abs().max()
    assert 0 < apart < 0.1 * moved  # computed in bfloat16, yet near the float32 run


def test_an_unsharded_model_one_rank_cannot_take_is_refused_on_every_rank(tmp_path):
    pytest.importorskip("transformers")
    mp.spawn(refusal_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"refused-rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0] == ranks[1]  # the same errors on both ranks, and the export after
    narrower, sharded, unmade = ranks[0]["raised"]
    assert narrower.startswith("unsharded (rank 1's): 'model.embed_tokens.weight' is (61, 16)")
    assert "the sharded model's is (61, 32)" in narrower
    assert sharded == (
        "unsharded (rank 0's): its parameters are sharded: build it again and do not shard it"
    )
    assert unmade == (
        "unsharded (rank 1's): its tensors are on the meta device: build it where the "
        "weights can be copied"
    )
    assert ranks[0]["exported"]


def test_export_sharded_of_a_model_not_sharded_says_to_call_export():
    from dtp_kernels import DTPPruner
    from dtp_kernels.models import get_model

    model = get_model("resnet20")
    pruner = DTPPruner(model, IMAGES[:1], 0.5)
    with pytest.raises(
        ValueError, match=r"ZeRO-3 partitions, and no parameter of CifarResNet is: call export\(\)"
    ):
        pruner.export_sharded(get_model("resnet20"))


def test_a_model_built_into_other_groups_is_refused_naming_them():
    """The groups of the pruner made on the model built again must be the trained
    pruner's (here a stage left whole in one and not the other)."""
    from dtp_kernels import DTPPruner
    from dtp_kernels.models import get_model
    from dtp_kernels.pruning.sharded_export import refuse_other_groups

    model = get_model("resnet20")  # ignored layers given as modules (once: a generator)
    trained = DTPPruner(model, IMAGES[:1], 0.5, ignored_layers=(m for m in [model.layer1]))
    assert trained.made_with()["ignored_layers"] == ["layer1"]  # made again by name
    again = DTPPruner(get_model("resnet20"), IMAGES[:1], 0.5)
    with pytest.raises(ValueError, match="unsharded: a pruner made on it has the groups"):
        refuse_other_groups(again, trained)
    refuse_other_groups(DTPPruner(get_model("resnet20"), **trained.made_with()), trained)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"granularity": "n:m", "nm": (2, 8), "scores": "magnitude", "eps": 0.5, "iters": 3},
    ],
    ids=["filter", "nm-magnitude"],
)
def test_made_with_makes_the_same_pruner_again(options):
    """The arguments export_sharded makes its pruner with are the first pruner's."""
    from dtp_kernels import DTPPruner
    from dtp_kernels.models import get_model

    ratio = {"conv1": 0.0, "*": 0.75} if options else 0.5  # (the stem's 3 inputs: no 2:8)
    first = DTPPruner(get_model("resnet20"), IMAGES[:1], ratio, **options)
    again = DTPPruner(get_model("resnet20"), **first.made_with())
    mine, its = first.made_with(), again.made_with()
    assert mine.pop("example_inputs") is not None and its.pop("example_inputs") is not None
    assert mine == its
    assert mine["ratios"] == ratio and mine["eps"] == options.get("eps", 1.0)
    assert mine["scores"] == options.get("scores", "learned")
    assert mine["nm"] == options.get("nm", (2, 4)) and mine["iters"] == options.get("iters", 1)
    assert [g.name for g in again.groups] == [g.name for g in first.groups]


def test_magnitude_scores_of_sharded_weights_are_refused_naming_the_layer(tmp_path):
    mp.spawn(magnitude_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    error = (tmp_path / "error.txt").read_text()
    assert error.startswith("scores='magnitude' reads |w| of 'layer1.0.conv1' before every")
    assert "FSDP (or ZeRO-3) shards its weight" in error
