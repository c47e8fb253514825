"""`FusionPass`: a pass made of pattern / replacement pairs, on Inductor's pattern matcher.

A fusion is two module-level functions with the same signature, registered in `register()`:

    def pattern_silu_mul(x):                      # what to find (traced to aten ops)
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * b

    def replace_silu_mul(x):                      # what to put instead
        return torch.ops.compilelm.silu_and_mul(x)

    class SiluMulFusionPass(FusionPass):
        def register(self):
            self.replace(pattern_silu_mul, replace_silu_mul, [torch.empty(4, 16)])

`trace_pattern` traces patterns the way the graphs they are matched against look (Inductor's
decompositions, then no-op elimination).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch._inductor import pattern_matcher as pm

from compilelm.passes.base import CompilePass, describe
from compilelm.passes.config import PassConfig
from compilelm.passes.utility.noop_elimination import NoOpEliminationPass


class FusionPass(CompilePass):
    """A pass made of `pattern_<what>` / `replace_<what>` pairs (see the module docstring).

    `register()` runs on first use of `patterns`, not at construction: tracing a pattern (make_fx
    of the pattern and of its replacement, per dtype) is startup time (docs/perf.md, "Compile and
    warm start"), and most passes never see a graph they apply to (FP8 fusions on a bf16 model, the
    all-reduce fusion at TP 1, every pass on a warm start that loads its pieces from the compile
    cache)."""

    def __init__(self, config: PassConfig | None = None):
        super().__init__(config)
        self._patterns: pm.PatternMatcherPass | None = None

    @property
    def patterns(self) -> pm.PatternMatcherPass:
        if self._patterns is None:
            self._patterns = pm.PatternMatcherPass(pass_name=self.name)
            self.register()
        return self._patterns

    @patterns.setter
    def patterns(self, value: pm.PatternMatcherPass) -> None:
        self._patterns = value

    def register(self) -> None:
        raise NotImplementedError

    def replace(
        self,
        pattern: Callable,
        replacement: Callable,
        example_inputs: list,
        extra_check: Callable[[pm.Match], bool] | None = None,
        scalar_workaround: dict[str, float] | None = None,
        into: pm.PatternMatcherPass | None = None,
    ) -> None:
        """Register one pair. Example inputs need only the right rank, dtype and device.
        `into` picks another `PatternMatcherPass` than `self.patterns` (for passes that apply
        groups of patterns in order). Identical patterns (e.g. from two dtypes) count once."""
        pm.register_replacement(
            pattern,
            replacement,
            example_inputs,
            trace_pattern,
            into if into is not None else self.patterns,
            extra_check=extra_check or (lambda match: True),
            scalar_workaround=scalar_workaround or {},
            skip_duplicates=True,
        )

    def run(self, graph: torch.fx.Graph) -> int:
        return self.patterns.apply(graph)


def trace_pattern(fn: Callable, args, **kwargs) -> torch.fx.GraphModule:
    """Trace a pattern to aten ops the way the graphs it is matched against look: Inductor's
    decompositions, then no-op elimination (which runs first in both stages).

    The matcher retraces the pattern and its replacement for every match, with the match's
    shapes, to check it; in a whole-model graph the 30 layers' matches have the same shapes. So
    traces are kept per fake mode (one compile) and key (the function, and each argument's
    dtype / shape / stride / device or value), and each caller gets its own copy of the graph."""
    mode, key = torch._guards.detect_fake_mode(args), _trace_key(fn, args, kwargs)
    if mode is None or key is None:
        return _trace(fn, args, kwargs)
    traces = _traces.setdefault(mode, {})
    if key not in traces:
        traces[key] = _trace(fn, args, kwargs)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(traces[key].graph, {}))
    return torch.fx.GraphModule(traces[key], graph)


_traces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> {key: traced graph}


def _trace(fn: Callable, args, kwargs) -> torch.fx.GraphModule:
    gm = pm.fwd_only(fn, args, run_functional_passes=False, **kwargs)
    NoOpEliminationPass().run(gm.graph)
    gm.recompile()
    return gm


def _trace_key(fn: Callable, args, kwargs) -> tuple | None:
    """What a trace depends on, or None if that cannot be told (then it is not kept). The
    matcher's wrappers are fresh closures per match: the functions they close over count."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(id(c.cell_contents) for c in fn.__closure__ or () if callable(c.cell_contents))

    def arg_key(a):
        if isinstance(a, torch.Tensor):
            return describe(a), a.requires_grad
        if isinstance(a, (torch.SymInt, torch.SymFloat, int, float, bool, str, type(None))):
            return type(a).__name__, str(a)
        raise TypeError

    try:
        return code, cells, tuple(arg_key(a) for a in args), tuple((k, id(v)) for k, v in sorted(kwargs.items()))
    except TypeError:
        return None
