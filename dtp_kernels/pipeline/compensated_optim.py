"""SGD and AdamW that update bfloat16 (or float16) weights without losing small steps.

A bfloat16 weight has 8 bits of precision: an update smaller than half its spacing
(w * 2**-8) rounds away, so fine-tuning a bfloat16 model with a small learning rate
leaves most weights where they were. These optimizers compute each update in float32
and keep, per low-precision weight, the part of it that the rounding dropped (a
compensation buffer in the weight's dtype, 2 bytes a weight for bfloat16), adding it to
the next update: compensated (Kahan) summation. The weights then follow the float32
trajectory to within about one bfloat16 spacing, for 2 bytes a weight instead of the 4
of a float32 master copy. Float32 (and float64) parameters are updated exactly as
torch.optim.SGD and AdamW update them, with no buffer.

The moments (AdamW) and momentum buffer (SGD) are held in the parameter's dtype, as
torch.optim holds them, or with `state_dtype=torch.float32` in float32, for 4 more
bytes a weight each: a bfloat16 second moment cannot follow its gradients (with beta2 =
0.999 a step moves it by 0.1% of the difference, below half its spacing, so it rises
only when g**2 is several times it and never falls), a float32 one can.

Each weight's update is one compiled kernel (torch.compile: C++ on the CPU, Triton on a
GPU), its float32 values never held in memory; with `fused=False` it runs eager, a
dozen passes over memory, in chunks of `chunk_size` elements so that the float32
working copies stay small whatever the layer's size.
"""

from __future__ import annotations

import abc
import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import overload

import torch

from ..pruning.base import SHARDED

LOW_PRECISION = (torch.bfloat16, torch.float16)
STATE_NAMES = ("momentum_buffer", "exp_avg", "exp_avg_sq")  # held in state_dtype


def _dense(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s elements fill its memory with no gap or overlap, in some order
    of its dimensions (contiguous, channels_last, ...)."""
    expected = 1
    dims = zip(tensor.stride(), tensor.shape, strict=True)
    for stride, size in sorted((stride, n) for stride, n in dims if n > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over `tensor`'s dense memory, in memory order: not a view of it (set_
    on its storage), so a compiled update does not guard on the shape it came from."""
    flat = tensor.new_empty(0)
    return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))


def _pieces(tensors: list[torch.Tensor], chunk_size: int) -> Iterator[list[torch.Tensor]]:
    """The same element range of every tensor of `tensors` (all of one shape), in flat
    chunks of `chunk_size` elements in memory order when all are laid out alike in dense
    memory (contiguous, or all channels_last), else whole. The updates are elementwise,
    so a flat view computes what the shaped tensors do, and the compiled update sees one
    dimension of one stride whatever the layer's rank and memory format: one compilation
    where each would guard on its own (eight of them stop a fullgraph compile)."""
    first = tensors[0]
    alike = all(t.shape == first.shape and t.stride() == first.stride() for t in tensors)
    if not (alike and _dense(first)):
        yield tensors
        return
    flat = [_flat(t) for t in tensors]
    for start in range(0, flat[0].numel(), chunk_size):
        yield [t[start : start + chunk_size] for t in flat]


def _compensate(weight: torch.Tensor, exact: torch.Tensor, compensation: torch.Tensor) -> None:
    """weight = `exact` (a float32 temporary, consumed) rounded to the weight's dtype;
    compensation = what the rounding dropped."""
    weight.copy_(exact)
    compensation.copy_(exact.sub_(weight))


# The low-precision updates work on float32 copies, in place to spare memory passes in
# eager mode. A float32 state tensor's .float() is the tensor itself: its new value is
# made out of place (mul, lerp), written back with copy_.


def sgd_low_precision(weight, grad, buffer, compensation, lr, momentum, decay) -> None:
    """One SGD update of a low-precision `weight` (and its momentum `buffer`, None
    without momentum), computed in float32 with the carried `compensation`."""
    w = weight.float()
    change = grad.float().add_(w * decay)
    if buffer is not None:
        change = buffer.float().mul(momentum).add_(change)
        buffer.copy_(change)
    _compensate(weight, change.mul_(-lr).add_(compensation.float()).add_(w), compensation)


def adamw_low_precision(
    weight, grad, mean, square, compensation, lr, beta1, beta2, eps, step_size, root, decay
) -> None:
    """One AdamW update of a low-precision `weight` and its moments, computed in float32
    with the carried `compensation`."""
    g, w = grad.float(), weight.float()
    m = mean.float().lerp(g, 1 - beta1)
    v = square.float().mul(beta2).add_(g.mul_(g).mul_(1 - beta2))
    mean.copy_(m)
    square.copy_(v)
    change = m.div_(v.sqrt_().div_(root).add_(eps)).mul_(-step_size)
    change.sub_(w * (lr * decay)).add_(compensation.float()).add_(w)
    _compensate(weight, change, compensation)


RECOMPILE_LIMIT = 64  # compilations of one fused update in a process


class _Fused:
    """`update` under torch.compile, one kernel per weight (the float32 working values stay
    in registers), compiled at its first call in a process. Sizes are symbolic, and the
    settings (learning rate, AdamW's step size...) reach it as 0-d tensors on the weight's
    device, never as Python floats, which torch.compile may specialize (torch 2.11 on CUDA
    guarded on AdamW's step size and compiled again every step): a new learning rate never
    compiles again. Where torch.compile cannot build it (no C++ compiler for the CPU, no
    Triton for the GPU) it warns once and runs eager."""

    def __init__(self, update: Callable) -> None:
        self.update, self.eager = update, False
        self.compiled: Callable | None = None
        self._settings: tuple | None = None  # (floats, device, their tensors): the last ones

    def settings(self, values: tuple[float, ...], device: torch.device) -> tuple:
        """`values` as 0-d float64 tensors on `device` (in the update's arithmetic a 0-d
        tensor is cast to the float32 it computes in, as a Python float is). One copy a
        step: the weights of a parameter group share them."""
        last = self._settings
        if last is None or last[0] != values or last[1] != device:
            host = torch.tensor(values, dtype=torch.float64)
            if device.type == "cuda":  # pinned: the copy is asynchronous
                host = host.pin_memory()
            tensors = host.to(device, non_blocking=True).unbind()
            self._settings = last = (values, device, tensors)
        return last[2]

    def __call__(self, *args) -> None:
        if not self.eager:
            if self.compiled is None:  # made here: importing stays light
                # emulate_precision_casts: round to bfloat16 where the code rounds; by
                # default inductor keeps the float32 value, and the compensation would
                # always be zero
                self.compiled = torch.compile(
                    self.update,
                    dynamic=True,
                    fullgraph=True,
                    options={"emulate_precision_casts": True},
                )
            # tensors (or None) first, then the settings
            start = next(i for i, a in enumerate(args) if isinstance(a, (int, float)))
            values = tuple(float(v) for v in args[start:])
            settings = self.settings(values, args[0].device)
            try:
                return self.compiled(*args[:start], *settings)
            except torch._dynamo.exc.BackendCompilerFailed as error:
                cause = error.inner_exception
                first = (str(cause).strip().splitlines() or [""])[0]
                warnings.warn(
                    f"{self.update.__name__}: torch.compile failed ({type(cause).__name__}: "
                    f"{first}); the compensated updates run eager (correct, several times "
                    "slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.eager = True
        return self.update(*args)


FUSED = {update: _Fused(update) for update in (sgd_low_precision, adamw_low_precision)}


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if not (low <= value and (high is None or value < high)):
        allowed = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} = {value!r}; allowed: {allowed}")


class _Compensated(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Shared parts: the step loop over low-precision and full-precision parameters;
    each subclass's `_update(p, group)` updates one parameter."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        chunk_size: int,
        fused: bool,
        state_dtype: torch.dtype | None,
    ) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size = {chunk_size!r}; allowed: an integer >= 1")
        if not isinstance(fused, bool):
            raise ValueError(f"fused = {fused!r}; allowed: True or False")
        if state_dtype not in (None, torch.float32):
            raise ValueError(
                f"state_dtype = {state_dtype!r}; allowed: None (the parameter's dtype) or "
                "torch.float32"
            )
        self.chunk_size, self.fused, self.state_dtype = chunk_size, fused, state_dtype
        super().__init__(params, defaults)

    def _low_precision(self, update: Callable, tensors: list[torch.Tensor]):
        """`update` (compiled when fused) and the pieces of `tensors` it takes: each whole
        when fused (no float32 copies to bound), else chunks of chunk_size. Shards of
        FSDP's DTensors are updated where they lie (the update is elementwise, and the
        parameter, its gradient and its state are sharded alike)."""
        # (mypy cannot narrow to DTensor through SHARDED, empty without torch.distributed)
        tensors = [
            t.to_local() if isinstance(t, SHARDED) else t  # type: ignore[attr-defined]
            for t in tensors
        ]
        if self.fused:
            return FUSED[update], _pieces(tensors, max(tensors[0].numel(), 1))
        return update, _pieces(tensors, self.chunk_size)

    def _state(
        self, p: torch.Tensor, names: tuple[str, ...]
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The parameter's state tensors `names`, created as zeros on its first step, and
        its compensation buffer (None for a float32 or float64 parameter)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in names:
                state[name] = torch.zeros_like(
                    p, dtype=self.state_dtype or p.dtype, memory_format=torch.preserve_format
                )
            if p.dtype in LOW_PRECISION:
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        return [state[name] for name in names], state.get("compensation")

    @abc.abstractmethod
    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        """One step of `p` with its gradient `grad` under `group`'s settings (each
        optimizer's own update)."""

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state tensor to its parameter's dtype,
        then the moments and momentum buffers as they were saved (float32 under
        state_dtype=torch.float32)."""
        super().load_state_dict(state_dict)
        saved = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for index, p in zip(saved, params, strict=True):
            for name, value in state_dict["state"].get(index, {}).items():
                if name in STATE_NAMES and value.dtype != self.state[p][name].dtype:
                    self.state[p][name] = value.to(device=p.device, copy=True)

    @overload
    def step(self, closure: None = None) -> None: ...
    @overload
    def step(self, closure: Callable[[], float]) -> float: ...
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # one fused function serves every weight: a compilation per mix of dtypes (weight,
        # gradient, state) and momentum or none, more than the 8 torch allows a function
        # by default in a run that mixes them (set once a step: 18 us a patch)
        limit = (
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)
            if self.fused
            else contextlib.nullcontext()
        )
        with limit:
            for group in self.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is None:
                        continue
                    if grad.is_sparse:
                        raise ValueError(f"{type(self).__name__} does not take sparse gradients")
                    self._update(p, grad, group)
        return loss


class CompensatedSGD(_Compensated):
    """torch.optim.SGD (momentum, weight decay added to the gradient) whose bfloat16 and
    float16 parameters keep the rounding error of each update for the next one.

    Args:
        params: parameters or parameter groups, as for torch.optim.SGD.
        lr: learning rate, >= 0.
        momentum: momentum factor in [0, 1); 0 keeps no buffer.
        weight_decay: L2 penalty >= 0, added to the gradient.
        chunk_size: elements the eager update takes at once (bounds its float32
            working memory; the fused kernel takes each weight whole).
        fused: the low-precision update compiled by torch.compile, one kernel per weight
            (at the first step); False runs it eager, several times slower.
        state_dtype: the momentum buffer's dtype: None, the parameter's (as torch), or
            torch.float32.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        chunk_size: int = 1 << 22,
        fused: bool = True,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(params, defaults, chunk_size, fused, state_dtype)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        buffers, compensation = self._state(p, ("momentum_buffer",) if momentum else ())
        if compensation is None:  # float32: torch.optim.SGD's operations, in its order
            change = grad if not decay else grad.add(p, alpha=decay)
            if buffers:
                buffers[0].mul_(momentum).add_(change)
                change = buffers[0]
            p.add_(change, alpha=-lr)
            return
        tensors = [p, grad, *buffers, compensation]
        update, pieces = self._low_precision(sgd_low_precision, tensors)
        for weight, grad, *buffer, kept in pieces:
            update(weight, grad, buffer[0] if buffer else None, kept, lr, momentum, decay)


class CompensatedAdamW(_Compensated):
    """torch.optim.AdamW (decoupled weight decay, bias-corrected moments) whose bfloat16
    and float16 parameters keep the rounding error of each update for the next one.

    Args:
        params: parameters or parameter groups, as for torch.optim.AdamW.
        lr: learning rate, >= 0.
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the second moment's root, >= 0.
        weight_decay: decoupled weight decay >= 0.
        chunk_size: elements the eager update takes at once (bounds its float32
            working memory; the fused kernel takes each weight whole).
        fused: the low-precision update compiled by torch.compile, one kernel per weight
            (at the first step); False runs it eager, several times slower.
        state_dtype: the moments' dtype: None, the parameter's (as torch), or
            torch.float32 (a bfloat16 second moment cannot follow its gradients).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        chunk_size: int = 1 << 22,
        fused: bool = True,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, chunk_size, fused, state_dtype)

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        decay = group["weight_decay"]
        (mean, square), compensation = self._state(p, ("exp_avg", "exp_avg_sq"))
        step = float(self.state[p]["step"])
        step_size = lr / (1 - beta1**step)
        root = (1 - beta2**step) ** 0.5
        if compensation is None:  # float32: torch.optim.AdamW's operations, in its order
            mean.lerp_(grad, 1 - beta1)
            square.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denominator = (square.sqrt() / root).add_(eps)
            p.mul_(1 - lr * decay).addcdiv_(mean, denominator, value=-step_size)
            return
        settings = (lr, beta1, beta2, eps, step_size, root, decay)
        tensors = [p, grad, mean, square, compensation]
        update, pieces = self._low_precision(adamw_low_precision, tensors)
        for piece in pieces:
            update(*piece, *settings)
