"""A harness for testing a pass on a toy module: trace it the way compilelm does, run the
passes, count matches and ops before/after, and compare the rewritten graph with eager.

    from compilelm.passes.debug.testing import check_pass

    result = check_pass(MyModule(), [torch.randn(5, 64)], [MySiluMulFusionPass()],
                        matches={"MySiluMulFusionPass": 1},
                        ops_before={"aten.silu.default": 1}, ops_after={"compilelm.silu_and_mul.default": 1})
    print(result.graph.code)

The module is traced by Dynamo with dim 0 of every input dynamic (the token count), then by
AOTAutograd with Inductor's decompositions: the same functional aten IR both pass stages see.
No-op elimination runs first, as in the pass manager. The rewritten graph is then *run* (op by
op, not compiled) on the same inputs, so the numbers compared are those of the rewrite itself.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.decomposition import select_decomp_table
from torch.utils._pytree import tree_leaves

from compilelm.passes.base import CompilePass
from compilelm.passes.utility.noop_elimination import NoOpEliminationPass


@dataclass
class PassTestResult:
    matches: dict[str, int]  # pass name -> rewrites it made
    ops_before: collections.Counter  # "aten.mul.Tensor" -> count, after no-op elimination
    ops_after: collections.Counter
    max_error: float  # max |rewritten graph - eager| over every output
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)  # the rewritten graph


def op_counts(graph: torch.fx.Graph) -> collections.Counter:
    """Op name ("aten.add.Tensor", "compilelm.rope.default") -> number of calls."""
    return collections.Counter(_op_name(n.target) for n in graph.nodes if n.op == "call_function")


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def run_passes(fn: Callable, inputs: list, passes: list[CompilePass],
               context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> PassTestResult:
    """Trace `fn(*inputs)`, apply `passes` in order, run the result and eager under `context()`."""
    seen: dict = {}

    def compiler(gm: torch.fx.GraphModule, example_inputs):
        NoOpEliminationPass()(gm.graph)
        seen["before"] = op_counts(gm.graph)
        for p in passes:
            p(gm.graph)
        gm.graph.lint()
        gm.recompile()
        seen["after"], seen["graph"] = op_counts(gm.graph), gm
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=compiler, decompositions=select_decomp_table())
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            torch._dynamo.mark_dynamic(t, 0)
    with torch.no_grad(), context():
        actual = tree_leaves(compiled(*inputs))
    with torch.no_grad(), context():
        expected = tree_leaves(fn(*inputs))
    torch._dynamo.reset()
    err = max((float((a.float() - e.float()).abs().max()) for a, e in zip(actual, expected)
               if isinstance(e, torch.Tensor) and e.numel()), default=0.0)
    return PassTestResult({p.name: p.matches for p in passes}, seen["before"], seen["after"], err, seen["graph"])


def check_pass(fn: Callable, inputs: list, passes: list[CompilePass], *, matches: dict[str, int] | None = None,
               ops_before: dict[str, int] | None = None, ops_after: dict[str, int] | None = None,
               atol: float = 1e-5, context: Callable = contextlib.nullcontext) -> PassTestResult:
    """`run_passes`, then assert the match counts, the given op counts and `max_error <= atol`."""
    result = run_passes(fn, inputs, passes, context)
    for name, n in (matches or {}).items():
        assert result.matches.get(name) == n, f"{name}: {result.matches.get(name)} matches, expected {n}"
    for label, want, got in (("before", ops_before, result.ops_before), ("after", ops_after, result.ops_after)):
        for op, n in (want or {}).items():
            assert got[op] == n, f"{op} {label} the passes: {got[op]} calls, expected {n}\n{result.graph.code}"
    assert result.max_error <= atol, f"max error vs eager {result.max_error:.3g} > {atol}"
    return result
