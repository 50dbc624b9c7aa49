"""The backward pass split in two, for zero-bubble pipelining (Qi et al. 2023, §2).

I (input gradient) runs autograd from the chunk's output to its input only: the engine then
skips every weight-gradient matmul. The linear layers and norms of a forward run under
`deferred_grads.deferring()` keep their weight gradients as closures that W (weight
gradient) runs directly. Any other weight (of an op that module does not know) goes the
general way: on the way I records, at each *departure* node — a node on the input path with a
child that leads to weights without returning to the input path — the gradient arriving
there, and W restarts autograd from each departure node with that gradient, towards its own
weights only (which walks the graph below that node again); the graph is then kept alive
between the two (retain_graph), so W reuses the activations the forward saved. Weight
gradients accumulate into `.grad` through autograd either way, so the gradient reducers'
hooks fire as for an ordinary backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from shardwise.errors import ShardwiseError
from shardwise.parallel.deferred_grads import (
    Deferred,
    collect,
    is_deferred,
    run_deferred,
)


@dataclass
class Pending:
    """What I leaves for W: the deferred weight gradients; per departure node, the gradients
    that arrived and its weights."""

    deferred: list[Deferred] = field(default_factory=list)
    departures: list[tuple[Node, tuple, list[torch.Tensor]]] = field(default_factory=list)


def _reach(root: Node, input_node: Node, weight_nodes: set[Node]) -> dict[Node, tuple]:
    """For every node under `root`: (leads to the input, leads to a weight)."""
    memo: dict[Node, tuple[bool, bool]] = {}
    order: list[tuple[Node, bool]] = [(root, False)]
    while order:  # iterative post-order: decoder graphs are deeper than Python's recursion
        node, expanded = order.pop()
        if node in memo and not expanded:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            order.append((node, True))
            order += [(c, False) for c in children if c not in memo]
            continue
        to_in, to_w = node is input_node, node in weight_nodes
        for c in children:
            a, b = memo[c]
            to_in, to_w = to_in or a, to_w or b
        memo[node] = (to_in, to_w)
    return memo


def _weights_below(node: Node, memo: dict, weights: dict[Node, torch.Tensor]) -> list:
    """Weights reached from `node` through children off the input path."""
    out, seen = [], set()
    stack = [c for c, _ in node.next_functions if c is not None and not memo[c][0]]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        if c in weights:
            out.append(weights[c])
        stack += [g for g, _ in c.next_functions if g is not None]
    return out


def backward_input(
    root: torch.Tensor | GradientEdge,
    grad: torch.Tensor | None,
    inputs: torch.Tensor,
    weights: list[torch.Tensor],
) -> Pending:
    """I: accumulate d(root)/d(inputs) into `inputs.grad` and keep what W needs."""
    root_node = root.node if isinstance(root, GradientEdge) else root.grad_fn
    nodes = {get_gradient_edge(w).node: w for w in weights if w.requires_grad}
    memo = _reach(root_node, get_gradient_edge(inputs).node, set(nodes))
    pending, owner = Pending(), {}
    caught: dict[Node, tuple] = {}
    handles = []
    for node, (to_in, _) in memo.items():
        if not to_in or is_deferred(node):
            continue
        off_path = [c for c, _ in node.next_functions if c is not None and not memo[c][0]]
        if not any(memo[c][1] for c in off_path):
            continue
        below = _weights_below(node, memo, nodes)
        for w in below:
            if id(w) in owner:  # a weight used at two places: W would count it twice
                raise ShardwiseError(
                    "parallel.pp_schedule='zb' needs every weight of a chunk used once, but a "
                    f"weight of shape {tuple(w.shape)} is used at two places. Fix: "
                    "--parallel.pp_schedule=1f1b."
                )
            owner[id(w)] = node
        pending.departures.append((node, (), below))
        handles.append(node.register_prehook(lambda g, n=node: caught.__setitem__(n, g)))
    try:
        with collect() as pending.deferred:
            retain = bool(pending.departures)  # else W needs nothing of the graph
            torch.autograd.backward(root, grad, inputs=[inputs], retain_graph=retain)
    finally:
        for h in handles:
            h.remove()
    pending.departures = [(n, caught[n], w) for n, _, w in pending.departures if n in caught]
    return pending


def backward_weight(pending: Pending) -> None:
    """W: accumulate the weight gradients that I left out."""
    run_deferred(pending.deferred)
    for node, grads, weights in pending.departures:
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        values = [g for g in grads if g is not None]
        if edges and weights:
            torch.autograd.backward(edges, values, inputs=weights, retain_graph=True)
    pending.departures.clear()
