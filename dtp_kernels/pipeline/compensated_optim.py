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
torch.optim holds them. Large parameters are updated in chunks of `chunk_size`
elements, so the float32 working copies stay small whatever the layer's size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _pieces(tensors: list[torch.Tensor], chunk_size: int) -> Iterator[list[torch.Tensor]]:
    """The same element range of every tensor of `tensors` (all of one shape), in chunks of
    `chunk_size` elements when all are contiguous, else whole."""
    if not all(t.is_contiguous() for t in tensors):
        yield tensors
        return
    flat = [t.view(-1) for t in tensors]
    for start in range(0, flat[0].numel(), chunk_size):
        yield [t[start : start + chunk_size] for t in flat]


def _apply(weight: torch.Tensor, delta: torch.Tensor, compensation: torch.Tensor) -> None:
    """weight += delta (float32), carrying the rounding error in `compensation`."""
    exact = delta.add_(compensation.float()).add_(weight.float())
    weight.copy_(exact)
    compensation.copy_(exact.sub_(weight.float()))


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if not (low <= value and (high is None or value < high)):
        allowed = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} = {value!r}; allowed: {allowed}")


class _Compensated(torch.optim.Optimizer):
    """Shared parts: the step loop over low-precision and full-precision parameters."""

    def __init__(self, params: Iterable, defaults: dict, chunk_size: int) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size = {chunk_size!r}; allowed: an integer >= 1")
        self.chunk_size = chunk_size
        super().__init__(params, defaults)

    def _state(self, p: torch.Tensor, names: tuple[str, ...]) -> list[torch.Tensor | None]:
        """The parameter's state tensors `names`, created as zeros on its first step, and
        its compensation buffer (None for a float32 or float64 parameter)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for name in names:
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if p.dtype in LOW_PRECISION:
                state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        return [state[name] for name in names] + [state.get("compensation")]

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """One update of every parameter that has a gradient; returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not take sparse gradients")
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError


class CompensatedSGD(_Compensated):
    """torch.optim.SGD (momentum, weight decay added to the gradient) whose bfloat16 and
    float16 parameters keep the rounding error of each update for the next one.

    Args:
        params: parameters or parameter groups, as for torch.optim.SGD.
        lr: learning rate, > 0.
        momentum: momentum factor in [0, 1); 0 keeps no buffer.
        weight_decay: L2 penalty >= 0, added to the gradient.
        chunk_size: elements updated at once (bounds the float32 working memory).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        chunk_size: int = 1 << 22,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        super().__init__(
            params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}, chunk_size
        )

    def _update(self, p: torch.Tensor, group: dict) -> None:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        *buffers, compensation = self._state(p, ("momentum_buffer",) if momentum else ())
        tensors = [p, p.grad, *buffers] + ([compensation] if compensation is not None else [])
        for piece in _pieces(tensors, self.chunk_size):
            weight, grad, rest = piece[0], piece[1], piece[2:]
            change = grad.to(torch.float32, copy=True)
            if decay:
                change.add_(weight.float(), alpha=decay)
            if momentum:
                # the buffer starts at zero: its first value is the gradient, as torch's
                buffer = rest.pop(0)
                change = buffer.float().mul_(momentum).add_(change)
                buffer.copy_(change)
            if not rest:  # float32: torch.optim.SGD's last operation
                weight.add_(change, alpha=-lr)
                continue
            _apply(weight, change * -lr, rest[0])


class CompensatedAdamW(_Compensated):
    """torch.optim.AdamW (decoupled weight decay, bias-corrected moments) whose bfloat16
    and float16 parameters keep the rounding error of each update for the next one.

    Args:
        params: parameters or parameter groups, as for torch.optim.AdamW.
        lr: learning rate, > 0.
        betas: the moments' decay rates, each in [0, 1).
        eps: added to the second moment's root, > 0.
        weight_decay: decoupled weight decay >= 0.
        chunk_size: elements updated at once (bounds the float32 working memory).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        chunk_size: int = 1 << 22,
    ) -> None:
        _check("lr", lr, 0.0)
        _check("betas[0]", betas[0], 0.0, 1.0)
        _check("betas[1]", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, chunk_size)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        decay = group["weight_decay"]
        first, second, compensation = self._state(p, ("exp_avg", "exp_avg_sq"))
        step = float(self.state[p]["step"])
        step_size = lr / (1 - beta1**step)
        root = (1 - beta2**step) ** 0.5
        tensors = [p, p.grad, first, second] + ([compensation] if compensation is not None else [])
        for piece in _pieces(tensors, self.chunk_size):
            weight, grad, m, v = piece[:4]
            # .float() is the state itself for a float32 parameter: updated in place
            g = grad.float()
            mean = m.float().lerp_(g, 1 - beta1)
            square = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m.copy_(mean)
            v.copy_(square)
            denominator = square.sqrt().div_(root).add_(eps)
            if len(piece) == 4:  # float32: torch.optim.AdamW's operations, in its order
                weight.mul_(1 - lr * decay).addcdiv_(mean, denominator, value=-step_size)
                continue
            change = mean.div(denominator).mul_(-step_size)
            if decay:
                change.add_(weight.float(), alpha=-lr * decay)
            _apply(weight, change, piece[4])
