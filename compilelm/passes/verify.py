"""Run a graph before and after a pass on the same random inputs and measure the difference.

Used by `compilelm compile --verify` and by the pass tests. Symbolic sizes take their hint (the
size the model was traced with); float inputs are random, integer inputs are zeros (always
valid indices).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_leaves


def snapshot(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """An independent, runnable copy of `graph` (node metadata included)."""
    new = torch.fx.Graph()
    new.output(new.graph_copy(graph, {}))
    root = graph.owning_module if graph.owning_module is not None else torch.nn.Module()
    return torch.fx.GraphModule(root, new)


def random_inputs(gm: torch.fx.GraphModule, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [_hint(s) for s in val.shape]
            if val.dtype.is_floating_point:
                t = torch.randn(shape, generator=gen).to(val.dtype)
            else:
                t = torch.zeros(shape, dtype=val.dtype)
            args.append(t.to(val.device))
        elif isinstance(val, (int, torch.SymInt)):
            args.append(_hint(val))
        else:
            args.append(val)
    return args


def _hint(size, fallback: int = 8) -> int:
    """The concrete value of a (possibly symbolic) size, as seen when tracing."""
    if isinstance(size, int):
        return size
    hint = getattr(size.node, "hint", None)
    return int(hint) if hint is not None else fallback


def max_error(before: torch.fx.GraphModule, after: torch.fx.GraphModule, seed: int = 0) -> float:
    with unset_fake_temporarily(), torch.no_grad():  # compile-time code may run under a fake mode
        args = random_inputs(before, seed)
        expected = tree_leaves(before(*args))
        actual = tree_leaves(after(*args))
        if len(expected) != len(actual):
            return float("inf")
        err = 0.0
        for e, a in zip(expected, actual):
            if isinstance(e, torch.Tensor) and e.dtype.is_floating_point:
                err = max(err, (e.float() - a.float()).abs().max().item() if e.numel() else 0.0)
            elif isinstance(e, torch.Tensor):
                err = max(err, 0.0 if torch.equal(e, a) else float("inf"))
            elif e != a:
                err = float("inf")
        return err
