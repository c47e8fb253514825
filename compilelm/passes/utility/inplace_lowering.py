"""Late in-place lowering: a functional op whose input dies at it becomes its in-place kernel.

Fusion passes rewrite to *functional* ops (every output a new tensor), so patterns stay free of
`auto_functionalized` nodes and tuple indexing. Once every pattern has run, this pass lowers
`out = op(x, ...)` to `op_(x, ...)` (out is written into x) wherever overwriting x cannot be
observed: x is computed inside this graph (not a graph input, not a view of something), and
nothing — x itself or any view of it — is read after this node.

    before:  y: "f32[s0, 64]" = compilelm.fused_add_rms_norm(x, residual, w, 1e-6)   # x dead after
             z = aten.mm(y, w2)
    after:   compilelm.fused_add_rms_norm_(x, residual, w, 1e-6)
             z = aten.mm(x, w2)

Pairs are declared once with `register_inplace(functional, inplace, {output_index: arg_name})`.
Inductor's own reinplacing runs after this and handles any `auto_functionalized` it created.
"""

from __future__ import annotations

import operator

import torch
from torch._ops import OpOverload
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compilelm.passes.base import CompilePass

# functional op -> (in-place op, {functional output index: in-place argument it is written to})
INPLACE_OPS: dict[OpOverload, tuple[OpOverload, dict[int, str]]] = {}


def register_inplace(functional: OpOverload, inplace: OpOverload, mutated: dict[int, str]) -> None:
    """Declare that `inplace(same args)` writes functional output i into argument mutated[i].
    Every output of `functional` must be mapped, and each mapped argument must be `Tensor(a!)`."""
    n_out = len(functional._schema.returns)
    if sorted(mutated) != list(range(n_out)):
        raise ValueError(f"mutated must map every output 0..{n_out - 1} of {functional}, got {mutated}")
    writable = {a.name for a in inplace._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    bad = sorted(set(mutated.values()) - writable)
    if bad:
        raise ValueError(f"mutated names {bad} are not mutable (Tensor(a!)) arguments of {inplace}")
    INPLACE_OPS[functional] = (inplace, dict(mutated))


class InplaceLoweringPass(CompilePass):
    def run(self, graph: torch.fx.Graph) -> int:
        order = {n: i for i, n in enumerate(graph.nodes)}
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in INPLACE_OPS:
                continue
            inplace, mutated = INPLACE_OPS[node.target]
            bound = _bind(node)
            outputs = _outputs(node)
            targets = {i: bound.get(name) for i, name in mutated.items()}
            if len({id(t) for t in targets.values()}) != len(targets):
                continue  # two outputs cannot be written into one tensor
            vals = node.meta.get("val")
            vals = vals if isinstance(vals, (list, tuple)) else [vals]
            if not all(_can_overwrite(t, node, order) and _same_layout(t, vals[i]) for i, t in targets.items()):
                continue
            with graph.inserting_before(node):
                new = graph.call_function(inplace, node.args, dict(node.kwargs))
            order[new] = order[node]
            for i, out in outputs.items():
                out.replace_all_uses_with(targets[i])
                if out is not node:
                    graph.erase_node(out)
            graph.erase_node(node)
            count += 1
        return count


def _bind(node: torch.fx.Node) -> dict:
    names = [a.name for a in node.target._schema.arguments]
    return {**dict(zip(names, node.args)), **node.kwargs}


def _outputs(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    """Output index -> the node carrying it: the node itself, or its getitem users."""
    if len(node.target._schema.returns) == 1 and not isinstance(node.meta.get("val"), (list, tuple)):
        return {0: node}
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def _aliases_input(node: torch.fx.Node) -> bool:
    """Is `node` a view (its storage belongs to another tensor)?"""
    if node.target is operator.getitem:
        node = node.args[0]
    if not isinstance(node.target, OpOverload):
        return True  # unknown callable: assume the worst
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _can_overwrite(t, node: torch.fx.Node, order: dict) -> bool:
    if not isinstance(t, torch.fx.Node) or t.op != "call_function" or _aliases_input(t):
        return False
    # Every reader of t's storage — t and, transitively, its views — must run at or before node.
    stack, seen = [t], set()
    while stack:
        cur = stack.pop()
        for user in cur.users:
            if user is node or user in seen:
                continue
            seen.add(user)
            if user.op == "output" or order.get(user, -1) > order[node]:
                return False
            if user.op == "call_function" and _aliases_input(user):
                stack.append(user)
    return True


def _same_layout(t: torch.fx.Node, b) -> bool:
    a = t.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.dtype != b.dtype:
        return False
    pairs = list(zip(a.shape, b.shape)) + list(zip(a.stride(), b.stride()))
    return a.dim() == b.dim() and all(statically_known_true(x == y) for x, y in pairs)
