"""Run a graph before and after a pass on the same random inputs and measure the difference.

Used by `compilelm compile --verify` and by the pass tests. Symbolic sizes take their hint (the
size the model was traced with); float inputs are random, integer inputs are zeros (always
valid indices). Ops that cannot run outside serving (attention reads the KV cache from the
forward context) are replaced, in both graphs alike, by a deterministic stand-in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._ops import OpOverload
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


def stand_in(*args):
    """Shaped like the op's first tensor argument (true of attention), depends on every input."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out = torch.tanh(tensors[0].float())
    for t in tensors[1:]:
        out = out + t.float().mean()
    return out.to(tensors[0].dtype)


# Fused attention ops stand in as their prologue followed by `stand_in` (op name -> function),
# so that a fusion pass verifies to the same numbers as the graph it rewrote. Ops listed here
# that are not splitting ops (they write the KV cache inside a piece) are replaced as well.
STAND_INS: dict[str, Callable] = {}


def replace_ops(gm: torch.fx.GraphModule, ops: tuple[str, ...]) -> torch.fx.GraphModule:
    """Point every call of an op named in `ops` ("namespace::name") or in STAND_INS at its stand-in."""
    names = set(ops) | set(STAND_INS)
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpOverload) and node.target._schema.name in names:
            node.target = STAND_INS.get(node.target._schema.name, stand_in)
    gm.recompile()
    return gm


def max_error(before: torch.fx.GraphModule, after: torch.fx.GraphModule, seed: int = 0,
              stand_in_ops: tuple[str, ...] = ()) -> float:
    if stand_in_ops:
        before, after = replace_ops(before, stand_in_ops), replace_ops(after, stand_in_ops)
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
