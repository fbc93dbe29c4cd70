"""Backward in two halves: the inputs' gradients first, the weights' gradients later.

A pipeline stage's upstream neighbour waits only for the gradients of the inputs it sent; the
gradients of the stage's own weights are needed only by the optimizer step. Computing the input
half first and replying at once lets the upstream stage start its backward earlier, and the
weight half fills time the stage would otherwise sit idle (the end of the step, where the first
stages still do their last backwards). Zero-bubble pipeline schedules rest on the same split.

How: the autograd graph from the outputs is walked once. A node is on the *input path* if it
leads to one of the inputs; a *boundary* node is on the input path and also has an edge into a
part of the graph that leads only to weights (a linear layer's node: one edge to its input, one
to its weight). The input half is ``torch.autograd.grad`` to the inputs, which runs only what
the inputs need; a hook on every boundary node keeps the gradient flowing into it. The weight
half then starts from those nodes with the kept gradients, one autograd call per group of
boundary nodes that share weights, so that no call reaches back into the input path (which
would compute the input half a second time).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

WHOLE_ONLY = frozenset({"CheckpointFunctionBackward"})
"""Nodes whose backward refuses ``torch.autograd.grad`` and ``inputs=``: reentrant activation
checkpointing (``checkpoint(..., use_reentrant=True)``) runs its own ``backward`` inside. A graph
holding one runs whole."""


@functools.cache
def _saved_attributes(node_type: type) -> tuple[str, ...]:
    return tuple(name for name in dir(node_type) if name.startswith("_raw_saved_"))


def _recomputes(node: Node) -> bool:
    """Whether ``node``'s saved tensors are recomputed when unpacked (non-reentrant activation
    checkpointing): every autograd call through it would recompute its region again, and the
    weight half makes one call per group, so such a graph runs whole."""
    for name in _saved_attributes(type(node)):
        try:
            hook = getattr(getattr(node, name), "unpack_hook", None)
        except RuntimeError:  # freed, or not a tensor
            continue
        if "_checkpoint_hook" in getattr(hook, "__qualname__", ""):
            return True
    return False


@dataclass(eq=False)
class WeightGroup:
    """One autograd call of the weight half: where it starts, with which gradients, and the
    weights it accumulates into."""

    roots: list[GradientEdge | torch.Tensor]
    grads: list[torch.Tensor]
    weights: list[torch.Tensor]


@dataclass(eq=False)
class WeightHalf:
    """The weight half of a split backward. It keeps the outputs, and with them the graph,
    until it has run."""

    groups: list[WeightGroup]
    keep_alive: list[torch.Tensor] = field(default_factory=list, repr=False)

    def run(self, between: Callable[[], None] = lambda: None) -> None:
        """Accumulate every group's weight gradients, once; ``between`` runs between two
        groups' autograd calls."""
        while self.groups:
            group = self.groups.pop(0)
            # roots may be GradientEdges, which backward takes though its types say Tensors
            torch.autograd.backward(group.roots, group.grads, inputs=group.weights)  # type: ignore[arg-type]
            if self.groups:
                between()
        self.keep_alive.clear()


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _walk(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node reachable from ``roots``, each after all of its children (post-order), and
    each node's children (read once: every ``next_functions`` makes new Python objects)."""
    order: list[Node] = []
    children: dict[Node, list[Node]] = {}
    stack: list[tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        below = children[node] = _children(node)
        stack.append((node, True))
        for child in below:
            if child not in children:
                stack.append((child, False))
    return order, children


@functools.cache
def _accumulate_grad() -> type:
    """The type of the nodes that accumulate into leaf tensors (``AccumulateGrad``)."""
    return type(get_gradient_edge(torch.empty(0, requires_grad=True)).node)


def _weight_parents(roots: list[Node]) -> list[Node]:
    """The nodes reachable from ``roots`` that have an ``AccumulateGrad`` child, found in one
    plain pass (the leader walks its whole graph at every microbatch's backward)."""
    accumulate = _accumulate_grad()
    seen = set(roots)
    stack = list(roots)
    found = []
    while stack:
        node = stack.pop()
        weighted = False
        for child, _ in node.next_functions:
            if type(child) is accumulate:
                weighted = True
            elif child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
        if weighted:
            found.append(node)
    return found


def _variable(node: Node) -> torch.Tensor | None:
    """The leaf tensor an ``AccumulateGrad`` node accumulates into, else None."""
    if type(node) is not _accumulate_grad():
        return None
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def backward_inputs_first(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    weights: Iterable[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightHalf]:
    """The gradients of the leaf tensors ``inputs`` (None where unused), and the weight half
    still to run.

    Together the two halves accumulate exactly what ``torch.autograd.backward(outputs, grads)``
    would into the ``.grad`` of ``weights`` (the inputs' ``.grad`` is left alone; other leaves
    get nothing: the runtime's own helper leaves must not make a node run twice); run the
    weight half before reading them. A custom ``autograd.Function`` on the input path that
    also takes a weight runs in both halves. Where a weight is reached both from a node and
    from another node below it on the input path (a layer applied to its own output), no start
    of the weight half could avoid computing the input path again: the backward then runs whole
    here and the weight half is empty; so does a graph with a :data:`WHOLE_ONLY` node or a
    checkpointed region (:func:`_recomputes`).
    """
    root_edges = [get_gradient_edge(out) for out in outputs]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    wanted = {id(w) for w in weights}

    def is_weight(node: Node) -> bool:
        variable = _variable(node)
        return variable is not None and id(variable) in wanted

    order, children_of = _walk([edge.node for edge in root_edges])
    for node in order:
        if node.name() in WHOLE_ONLY or _recomputes(node):
            return _whole(outputs, grads, inputs), WeightHalf([])
    on_input_path: set[Node] = set()
    weights_below: dict[Node, frozenset[Node]] = {}
    """For nodes off the input path: the weight (AccumulateGrad) nodes they lead to."""
    for node in order:  # children first
        children = children_of[node]
        if node in input_nodes or not on_input_path.isdisjoint(children):
            on_input_path.add(node)
            continue
        below: set[Node] = set()
        if is_weight(node):
            below.add(node)
        for child in children:
            below |= weights_below[child]
        weights_below[node] = frozenset(below)

    boundary: dict[Node, frozenset[Node]] = {}
    for node in on_input_path:
        reached = frozenset[Node]().union(
            *(weights_below[c] for c in children_of[node] if c not in on_input_path)
        )
        if reached:
            boundary[node] = reached
    roots = [
        (out, grad, weights_below[edge.node])
        for out, edge, grad in zip(outputs, root_edges, grads, strict=True)
        if edge.node not in on_input_path and weights_below[edge.node]
    ]
    groups = _groups(
        [(below, node) for node, below in boundary.items()]
        + [(below, (out, grad)) for out, grad, below in roots]
    )
    if any(_reaches_another(group, on_input_path) for group in groups):
        return _whole(outputs, grads, inputs), WeightHalf([])

    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keeper(node: Node) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
        def keep(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            kept[node] = tuple(grad_outputs)

        return keep

    handles = [node.register_prehook(keeper(node)) for node in boundary]
    try:
        input_grads = torch.autograd.grad(
            list(outputs), list(inputs), list(grads), retain_graph=True, allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    half = WeightHalf([], list(outputs))
    for weight_nodes, members in groups:
        group = WeightGroup([], [], [v for v in map(_variable, weight_nodes) if v is not None])
        for member in members:
            if isinstance(member, tuple):  # an output off the input path
                group.roots.append(member[0])
                group.grads.append(member[1])
                continue
            for index, grad in enumerate(kept.get(member, ())):
                if grad is not None:
                    group.roots.append(GradientEdge(member, index))
                    group.grads.append(grad)
        if group.roots:
            half.groups.append(group)
    return list(input_grads), half


_Start = Node | tuple[torch.Tensor, torch.Tensor]
"""Where a weight group starts: a boundary node, or an output off the input path and its
gradient."""


def _groups(starts: list[tuple[frozenset[Node], _Start]]) -> list[tuple[set[Node], list[_Start]]]:
    """Merge the starts that reach a common weight (tied weights) into one group each: its
    weight nodes and its starts."""
    groups: list[tuple[set[Node], list[_Start]]] = []
    for below, start in starts:
        reach, members = set(below), [start]
        for other in [g for g in groups if g[0] & reach]:
            groups.remove(other)
            reach |= other[0]
            members += other[1]
        groups.append((reach, members))
    return groups


def _reaches_another(group: tuple[set[Node], list[_Start]], on_input_path: set[Node]) -> bool:
    """Whether a boundary node of the group reaches another one down the input path."""
    nodes = {m for m in group[1] if not isinstance(m, tuple)}
    if len(nodes) < 2:
        return False
    for node in nodes:
        stack = [c for c in _children(node) if c in on_input_path]
        seen: set[Node] = set()
        while stack:
            current = stack.pop()
            if current in nodes:
                return True
            if current not in seen:
                seen.add(current)
                stack.extend(c for c in _children(current) if c in on_input_path)
    return False


def _whole(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """One ordinary backward; the inputs' gradients are returned, their ``.grad`` kept."""
    before = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    torch.autograd.backward(list(outputs), list(grads))
    found = [t.grad for t in inputs]
    for t, grad in zip(inputs, before, strict=True):
        t.grad = grad
    return found


def backward_giving_way(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    give_way: Callable[[], None],
) -> None:
    """``torch.autograd.backward(outputs, grads)``, calling ``give_way`` before each node that
    accumulates into a weight: a long backward (the leader's, which nothing waits for once its
    remote parts are done) can let more urgent work compute at its layers' boundaries.

    Measured on a GPT-2 whose tied head stays on partition 0: a 120 ms backward of the first
    blocks, started just before the head's input came back, held that head's forward, and with
    it the last partition, idle for 100 ms."""
    roots = [out.grad_fn for out in outputs if out.grad_fn is not None]
    handles = [node.register_prehook(lambda _grads: give_way()) for node in _weight_parents(roots)]
    try:
        torch.autograd.backward(list(outputs), list(grads))
    finally:
        for handle in handles:
            handle.remove()
