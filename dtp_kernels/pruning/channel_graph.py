"""Torch-Pruning's DependencyGraph of a model, and its searches bounded.

The graph is traced through the model's forward (with the workarounds of
graph_workarounds.py, frozen parameters recorded, the key/value cache off) and its
autograd nodes let go when the block ends; each search for the channels coupled to a
layer ends within a bound or raises an error naming the layer. Where the graph cannot
be built or searched, the errors here say so and what to do (groups.py's callers
catch them).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
import warnings
from collections.abc import Iterator

import torch
import torch_pruning as tp
from torch import nn

from .channel_affines import channel_affine_pruners
from .example_inputs import call_model
from .fixed_filters import fixed_filter_pruners
from .frozen_norms import frozen_norm_pruners
from .graph_workarounds import (
    region_pooling_reads_features_only,
    slice_widths_inferred,
    tuple_returning_linears,
    unknown_concat_widths_left_unmapped,
    unmappable_reshapes_marked,
)
from .group_search import LARGEST_TENSOR, LargestTensor, coupled_group
from .recurrent_readers import STATE_READERS, reader_pruners, run_as_one_op


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or tuples, lists and dicts of them, as
    Hugging Face's ModelOutput), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in output_tensors(item)]
    return []


def _traced_outputs(output) -> list[torch.Tensor]:
    return [t for t in output_tensors(output) if t.grad_fn is not None]


@contextlib.contextmanager
def leaf_outputs_recorded(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, the tensors (with a gradient function) that the model's modules
    holding parameters and no submodules return are added to the list yielded."""
    recorded: list[torch.Tensor] = []

    def record(_module, _args, output) -> None:
        recorded.extend(t for t in output_tensors(output) if t.grad_fn is not None)

    leaves = [
        m
        for m in model.modules()
        if next(m.children(), None) is None and next(m.parameters(recurse=False), None) is not None
    ]
    handles = [m.register_forward_hook(record) for m in leaves]
    try:
        yield recorded
    finally:
        for handle in handles:
            handle.remove()


def dropped_outputs(outputs: list[torch.Tensor], recorded: list[torch.Tensor]) -> list:
    """The tensors of `recorded` that none of `outputs` was computed from: what layers the
    model runs and then drops computed."""
    reached, stack = set(), [t.grad_fn for t in outputs]
    while stack:
        function = stack.pop()
        if function is None or function in reached:
            continue
        reached.add(function)
        stack.extend(next_function for next_function, _ in function.next_functions)
    return [t for t in recorded if t.grad_fn not in reached]


@contextlib.contextmanager
def without_cache(model: nn.Module) -> Iterator[None]:
    """The Hugging Face models in `model` run without their key/value cache within the
    block: the cache serves generation, and Torch-Pruning cannot follow the
    concatenations into it (GPT-2's) or never ends its search through them (Phi-3's)."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    cached = [c for c in configs.values() if getattr(c, "use_cache", None) is True]
    for config in cached:
        config.use_cache = False
    try:
        yield
    finally:
        for config in cached:
            config.use_cache = True


# the graph's attribute holding the gradient functions of the tensors the model returns
RETURNED = "dtp_returned_functions"


class ChannelGraphError(ValueError):
    """Torch-Pruning's DependencyGraph cannot follow the model's channels: building it, or
    its search for the channels coupled to one layer, fails or does not end."""


class GraphBuildError(ChannelGraphError):
    """Torch-Pruning's DependencyGraph cannot be built on the model at all."""


class SearchFailedError(ChannelGraphError):
    """Torch-Pruning's search for the channels coupled to `layer` raised (`why`)."""

    def __init__(self, message: str, layer: nn.Module, why: str) -> None:
        super().__init__(message)
        self.layer, self.why = layer, why


def failed_searches(failed: dict[nn.Module, str], names: dict[nn.Module, str]) -> str:
    """The error for the layers whose searches failed, with Torch-Pruning's errors."""
    named = {names.get(m, type(m).__name__): why for m, why in failed.items()}
    if len(named) == 1:
        ((name, why),) = named.items()
        return (
            f"the search for the channels coupled to layer {name!r} fails ({why}): "
            "Torch-Pruning's graph cannot follow what the model does with that layer's "
            "output. Leave the layer whole with ignored_layers=[...]"
        )
    listed = ", ".join(f"{name!r} ({why})" for name, why in named.items())
    return (
        f"the searches for the channels coupled to layers {listed} fail: Torch-Pruning's "
        "graph cannot follow what the model does with their outputs. Leave these layers "
        f"whole with ignored_layers=[...] (the modules named {list(named)})"
    )


# what Torch-Pruning warns, building the graph and searching it, where it cannot infer a
# width (a detection head's box decoding): nothing for the user to do
RECURSION_WARNING = "Maximum recursive depth reached"


@contextlib.contextmanager
def traced_graph(model: nn.Module, example_inputs) -> Iterator[tp.DependencyGraph]:
    """Torch-Pruning's DependencyGraph of the model; its autograd nodes are let go when
    the block ends.

    The graph keeps the autograd nodes of its tracing forward (the parameters'
    AccumulateGrad among them) in reference cycles. Left to the garbage collector they
    outlive the block on the stream they were made on, and a later CUDA-graph capture of
    a training step fails on the cross-stream dependency. Cutting the graph's references
    to them frees them at once, without a full garbage collection (a quarter of a second
    in a process that has imported transformers); tests/reliability/test_no_host_sync.py
    checks that none is left.
    """
    # Torch-Pruning updates its index mappings on every search too, not only when built
    with (
        unknown_concat_widths_left_unmapped(),
        unmappable_reshapes_marked(),
        slice_widths_inferred(),
    ):
        # the graph is traced through autograd: also when called under torch.no_grad(), and
        # through frozen parameters (requires_grad False), which autograd would not record
        with (
            torch.enable_grad(),
            warnings.catch_warnings(),
            region_pooling_reads_features_only(),
            without_cache(model),
            all_parameters_recorded(model),
            run_as_one_op(model) as states,
        ):
            # norms that are not nn.LayerNorm (RMSNorm) are "unwrapped parameters" to it;
            # groups through them are refused or left alone here, never pruned
            warnings.filterwarnings("ignore", message="Unwrapped parameters detected")
            warnings.filterwarnings("ignore", message=RECURSION_WARNING)
            hooks = {module: set(module._forward_hooks) for module in model.modules()}
            largest = LargestTensor()
            returned: set[object] = set()  # the gradient functions of the tensors the model returns

            def forward(model: nn.Module, inputs):
                with largest, leaf_outputs_recorded(model) as recorded:
                    output = call_model(model, inputs)
                returned.update(t.grad_fn for t in _traced_outputs(output))
                # the outputs of layers the model runs and drops (MobileNetV2's last conv
                # under a segmentation head) are traced too: the readers of the channels
                # a group cuts include them, or export leaves them too wide to run
                # and the initial hidden states recurrent layers read, each to its marker
                return output, dropped_outputs(_traced_outputs(output), recorded), states.tensors

            try:
                graph = tp.DependencyGraph().build_dependency(
                    model,
                    example_inputs=example_inputs,
                    forward_fn=forward,
                    output_transform=_traced_outputs,
                    ignored_layers=tuple_returning_linears(model, example_inputs),
                    customized_pruners={
                        **frozen_norm_pruners(model),
                        **channel_affine_pruners(model),
                        **fixed_filter_pruners(model),
                        **reader_pruners(model),
                    },
                )
            except Exception as error:  # its own errors say nothing of the model or what to do
                _remove_new_hooks(hooks)  # a failed trace leaves its hooks on the model
                raise GraphBuildError(
                    f"cannot find the prunable groups of {type(model).__name__}: Torch-Pruning's "
                    f"DependencyGraph, which follows its channels, fails on it "
                    f"({type(error).__name__}: {error}). Heads, experts, Mamba mixers and MLP "
                    "modules do not need it: a dict of ratios for 'heads', 'experts', 'mamba' and "
                    "'mlp' alone (or their layers' names) prunes those. The models dtp_kernels "
                    "prunes are listed in docs/architectures.md and the README's 'What it prunes'"
                ) from error
        # the pruner's own search of the graph (group_search.py): each channel followed
        # once, ended where the graph maps an index past a layer's width, or where a
        # view would map one past its tensor or the largest tensor the forward made
        setattr(graph, LARGEST_TENSOR, largest.numel)
        setattr(graph, RETURNED, returned)
        setattr(graph, STATE_READERS, states.readers)
        graph.get_pruning_group = functools.partial(coupled_group, graph)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=RECURSION_WARNING)
                yield graph
        finally:
            for node in graph.module2node.values():
                node.grad_fn = None
                if isinstance(node.module, tp.ops._SliceOp):
                    node.module.grad_fn = None
            vars(graph).clear()


@contextlib.contextmanager
def all_parameters_recorded(model: nn.Module) -> Iterator[None]:
    """Every parameter of `model` requires a gradient inside the block, so that autograd
    records the operations on frozen ones too; each frozen one is frozen again after."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    for parameter in frozen:
        parameter.requires_grad_(True)
    try:
        yield
    finally:
        for parameter in frozen:
            parameter.requires_grad_(False)


def _remove_new_hooks(before: dict[nn.Module, set[int]]) -> None:
    """Remove the forward hooks each module got since `before` (its hooks' ids then)."""
    for module, ids in before.items():
        for hook_id in set(module._forward_hooks) - ids:
            del module._forward_hooks[hook_id]
            module._forward_hooks_with_kwargs.pop(hook_id, None)
            module._forward_hooks_always_called.pop(hook_id, None)


# the search for one root's group takes milliseconds; each channel is followed once
# (group_search.py), and a graph that maps channels past a layer's width ends it. Were a
# graph to grow without end all the same, each root's search gets this long.
GROUP_SEARCH_SECONDS = 60.0


class _SearchExpiredError(BaseException):
    """Raised by the SIGALRM handler; not an Exception, so that no `except Exception` on
    the search's path takes it for an error of its own."""


# after the bound, the alarm repeats this often until the search ends: an expiry raised
# where Python ignores exceptions (a finalizer run by the garbage collector) is followed
# by the next
EXPIRY_REPEAT_SECONDS = 0.05


@contextlib.contextmanager
def bounded_search(graph: tp.DependencyGraph, names: dict[nn.Module, str]) -> Iterator[None]:
    """Within the block, each graph.get_pruning_group call ends within GROUP_SEARCH_SECONDS
    or raises a ChannelGraphError naming its root layer, as it does when Torch-Pruning's
    search itself fails. The bound is a SIGALRM timer: only in the main thread, and only
    when no other timer is set (else the search is unbounded)."""
    timed = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
    )
    search, searching = graph.get_pruning_group, [False]
    root: list[nn.Module] = []

    def layer_name() -> str:
        return repr(names.get(root[0], type(root[0]).__name__))

    def bounded(module, handler, idxs):
        root[:], searching[0] = [module], True
        if timed:
            signal.setitimer(signal.ITIMER_REAL, GROUP_SEARCH_SECONDS, EXPIRY_REPEAT_SECONDS)
        try:
            return search(module, handler, idxs)
        except Exception as error:  # its own errors say nothing of the layer
            why = f"{type(error).__name__}: {error}"
            raise SearchFailedError(failed_searches({module: why}, names), module, why) from error
        finally:
            searching[0] = False
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)

    def expire(_signum, _frame):
        if searching[0]:  # not in the clean-up after the search
            raise _SearchExpiredError

    hook = sys.unraisablehook

    def drop_expiry(unraisable) -> None:
        # an expiry that struck a finalizer was ignored there and the alarm repeats: not
        # the user's to see ("Exception ignored in ..."), nor a test runner's to report
        if not isinstance(unraisable.exc_value, _SearchExpiredError):
            hook(unraisable)

    previous = signal.signal(signal.SIGALRM, expire) if timed else None
    if timed:
        sys.unraisablehook = drop_expiry
    graph.get_pruning_group = bounded  # get_all_groups calls it through the instance
    try:
        yield
    except _SearchExpiredError:
        raise ChannelGraphError(
            f"the search for the channels coupled to layer {layer_name()} did not end "
            f"within {GROUP_SEARCH_SECONDS:g} s: Torch-Pruning's graph cannot follow what the "
            "model does with that layer's output. Leave the layer whole with "
            "ignored_layers=[...]"
        ) from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            sys.unraisablehook = hook
        graph.get_pruning_group = search
