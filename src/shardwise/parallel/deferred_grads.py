"""Weight gradients left for later: the ops of zero bubble's W pass (Qi et al. 2023, §2).

While `deferring()` is active, the forward's linear layers and norm scales run as the
autograd Functions below. Their backward computes the input gradient only; with a sink open
(`collect`, during the I pass) the weight gradient is kept as a closure over the gradient
that arrived and the input the forward saved (the ZB paper's "WeightGradStore"), and W runs
the closures: one matmul per linear layer, with no walk of the autograd graph. Without a
sink their backward is the ordinary one.

Without this, W restarted autograd at every weight's node of the graph, and each restart
walks the whole graph below that node down to the chunk's input: W's cost grew with the
square of the chunk's depth (measured on 4 and 16 blocks: 15 ms and 130-170 ms more than the
backward's weight matmuls).

The Functions save exactly the tensors the plain ops save (a linear layer its input and
weight; RMSNorm, built here as rms_norm without a weight times the weight, what the
composite op saves; LayerNorm its input, mean and rstd), so the activation accounting does
not change. W hands each weight its gradient through autograd (`torch.autograd.backward` on
the weight tensor itself), so gradients accumulate into `.grad` and the reducers' hooks fire
as after an ordinary backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Deferred = Callable[[], list[tuple[torch.Tensor, torch.Tensor]]]

# the open sink; a module global, not thread-local: CUDA backward runs on autograd's threads
_sink: list[Deferred] | None = None


def _defer(weights: tuple, compute: Callable[[], tuple]) -> tuple:
    """Weight gradients of `weights` (None where no gradient is wanted): kept for W when a
    sink is open (and None returned for autograd), computed now otherwise."""
    if _sink is None:
        grads = zip(weights, compute(), strict=True)
        return tuple(g if w is not None and w.requires_grad else None for w, g in grads)

    def run() -> list[tuple[torch.Tensor, torch.Tensor]]:
        pairs = zip(weights, compute(), strict=True)
        return [(w, g) for w, g in pairs if w is not None and w.requires_grad]

    _sink.append(run)
    return (None,) * len(weights)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)  # what F.linear saves
        ctx.targets = (weight, bias)  # the tensors W hands gradients to
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None

        def compute() -> tuple:
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            return g2.t().mm(x2), None if ctx.targets[1] is None else g2.sum(0)

        return grad_x, *_defer(ctx.targets, compute)


class _Scale(torch.autograd.Function):
    """y = x̂ · w: the weight of a norm whose normalisation ran as its own ops."""

    @staticmethod
    def forward(ctx, xhat, weight):
        ctx.save_for_backward(xhat, weight)  # what the composite rms_norm's last mul saves
        ctx.targets = (weight,)
        return xhat * weight

    @staticmethod
    def backward(ctx, grad):
        xhat, weight = ctx.saved_tensors
        grad_x = grad * weight if ctx.needs_input_grad[0] else None
        compute = lambda: ((grad * xhat).sum_to_size(weight.shape),)  # noqa: E731
        return grad_x, *_defer(ctx.targets, compute)


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shape, weight, bias, eps):
        y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd, weight, bias)  # what F.layer_norm saves
        ctx.shape, ctx.targets = shape, (weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mean, rstd, weight, bias = ctx.saved_tensors

        def part(mask: list[bool]) -> tuple:
            args = (grad, x, ctx.shape, mean, rstd, weight, bias, mask)
            return torch.ops.aten.native_layer_norm_backward(*args)

        grad_x = part([True, False, False])[0] if ctx.needs_input_grad[0] else None
        compute = lambda: part([False, weight is not None, bias is not None])[1:]  # noqa: E731
        return grad_x, None, *_defer(ctx.targets, compute), None


def _linear_args(input, weight, bias=None):  # F.linear's signature
    return input, weight, bias


def _rms_norm_args(input, normalized_shape, weight=None, eps=None):  # F.rms_norm's
    return input, normalized_shape, weight, eps


def _layer_norm_args(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # F.layer_norm's
    return input, normalized_shape, weight, bias, eps


def _trains(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


class _Deferring(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, b = _linear_args(*args, **kwargs)
            if _trains(w, b):
                return _Linear.apply(x, w, b)
        elif func is F.rms_norm:
            x, shape, w, eps = _rms_norm_args(*args, **kwargs)
            if _trains(w):
                return _Scale.apply(F.rms_norm(x, shape, None, eps), w)
        elif func is F.layer_norm:
            x, shape, w, b, eps = _layer_norm_args(*args, **kwargs)
            if _trains(w, b):
                return _LayerNorm.apply(x, list(shape), w, b, eps)
        return func(*args, **kwargs)


_active = False  # a forward (or its recomputation) runs under `deferring()`


@contextlib.contextmanager
def deferring() -> Iterator[None]:
    """Run a forward with deferrable weight gradients (once: nested uses are no-ops)."""
    global _active
    if _active:
        yield
        return
    _active = True
    try:
        with _Deferring():
            yield
    finally:
        _active = False


class _Again:
    """`deferring()` for each recomputation (a backward that keeps its graph may recompute a
    region twice, and one generator context cannot be entered twice)."""

    def __enter__(self) -> None:
        self._context = deferring()
        self._context.__enter__()

    def __exit__(self, *exc) -> None:
        self._context.__exit__(*exc)


def recompute_context() -> contextlib.AbstractContextManager:
    """The context a recomputed forward (activation checkpointing) must run in: the one its
    forward ran in, or its Functions would save other tensors than the forward saved."""
    return _Again() if _active else contextlib.nullcontext()


@contextlib.contextmanager
def collect() -> Iterator[list[Deferred]]:
    """Open the sink for one I pass: the deferred weight gradients land in the list."""
    global _sink
    outer, _sink = _sink, []
    try:
        yield _sink
    finally:
        _sink = outer


def is_deferred(node) -> bool:
    """Whether an autograd node is one of the Functions above (its weights are W's already)."""
    return isinstance(node, (_Linear._backward_cls, _Scale._backward_cls, _LayerNorm._backward_cls))


def run_deferred(deferred: list[Deferred]) -> None:
    """W: compute the kept weight gradients and hand them to their weights through autograd."""
    pairs = [pair for run in deferred for pair in run()]
    deferred.clear()
    if pairs:
        weights, grads = zip(*pairs, strict=True)
        torch.autograd.backward(list(weights), list(grads))
