"""Walking an autograd graph for the leaves a backward would accumulate into."""

from __future__ import annotations

from typing import List

from torch import Tensor


def graph_leaves(t: Tensor) -> List[Tensor]:
    """The leaf tensors that a backward from ``t`` accumulates into (its graph's ``AccumulateGrad``
    nodes): registered parameters, and trainable tensors a model does not register (a projection in
    ``get_rep_fn``, weights passed through ``functional_call``). Cost: one visit per graph node."""
    out, seen, todo = [], set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor):
            out.append(variable)
        todo.extend(n for n, _ in node.next_functions)
    return out
