"""The pass base classes: every graph pass has a name, an identity, a match count and a time.

`CompilePass` is an Inductor `CustomGraphPass`: `__call__(graph)` rewrites an FX graph in place
and `uuid()` identifies the pass for Inductor's cache and compilelm's compile cache. The uuid is
a hash of the source file that defines the pass (so editing a pattern function invalidates the
cache — nothing is listed by hand) plus the pass's own config slice.

`FusionPass` is the pattern-matching flavour. A fusion is two module-level functions with the
same signature, registered in `register()`:

    def pattern_silu_mul(x):                      # what to find (traced to aten ops)
        a, b = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * b

    def replace_silu_mul(x):                      # what to put instead
        return torch.ops.compilelm.silu_and_mul(x)

    class SiluMulFusionPass(FusionPass):
        def register(self):
            self.replace(pattern_silu_mul, replace_silu_mul, [torch.empty(4, 16)])

`stage` says where a pass runs: "post_grad" (inside Inductor, once per piece) or "whole_graph"
(on the aten graph of the whole model before the piecewise split, where a pattern may span
the attention op). Both stages see the same functional, decomposed aten IR.

Two optional hooks: `applies_to(graph)` (False: the graph is skipped and not even recorded, e.g.
a CUDA-only pass on a CPU graph) and `prepare_model(model)`, the pass's load-time rewrite of the
model (say, folding weights into the layout its fused op wants), which the compiler runs once
before tracing and before loading cached pieces. A pass owns such a rewrite: it decides there
which layers it will take, from the model alone, and nothing else in compilelm repeats that.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass

from compilelm.passes.config import PassConfig


class CompilePass(CustomGraphPass):
    stage: ClassVar[str] = "post_grad"  # or "whole_graph"

    def __init__(self, config: PassConfig | None = None):
        self.config = config if config is not None else PassConfig()
        self.matches = 0  # total over every graph this instance has seen
        self.seconds = 0.0
        self.recorder = None  # set by PassManager: dumps, per-piece stats, --verify
        self._uuid: str | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    def run(self, graph: torch.fx.Graph) -> int:
        """Rewrite `graph` in place; return how many rewrites were made."""
        raise NotImplementedError

    def config_dict(self) -> dict[str, Any]:
        """The config values this pass depends on (they enter the uuid)."""
        return {}

    def applies_to(self, graph: torch.fx.Graph) -> bool:
        """Whether to run on (and record) this graph: a cheap check, e.g. for a node it rewrites."""
        return True

    def prepare_model(self, model: nn.Module) -> str | None:
        """The load-time rewrite this pass needs, applied to `model` in place; returns what it did
        (a line for `compile --dump`'s report), or None if it left the model alone. Runs on every
        compile, warm or cold, before tracing; must be idempotent and import no compiler module."""
        return None

    def __call__(self, graph: torch.fx.Graph) -> None:
        if not self.applies_to(graph):
            return
        before = self.recorder.before(self, graph) if self.recorder is not None else None
        start = time.perf_counter()
        n = int(self.run(graph) or 0)
        seconds = time.perf_counter() - start
        self.matches += n
        self.seconds += seconds
        if self.recorder is not None:
            self.recorder.after(self, graph, before, n, seconds)

    def uuid(self) -> str:
        # Computed once: the identity of the code this instance runs, even if the file changes later.
        if self._uuid is None:
            self._uuid = pass_uuid(type(self), self.config_dict())
        return self._uuid


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
    from compilelm.passes.utility.noop_elimination import NoOpEliminationPass

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


def pass_uuid(cls: type, config: dict[str, Any]) -> str:
    """sha256 of the file defining `cls` (patterns, helpers and all) + its name + its config."""
    h = hashlib.sha256(cls.__qualname__.encode())
    with open(inspect.getsourcefile(cls), "rb") as f:
        h.update(f.read())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    return h.hexdigest()


def describe(v) -> str:
    """'f32[s72, 64]/[64, 1]@cpu' for a tensor, 'Sym(s72)' for a SymInt, repr otherwise."""
    if isinstance(v, torch.Tensor):
        dtype = str(v.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(map(str, v.shape))}]/[{', '.join(map(str, v.stride()))}]@{v.device}"
    if isinstance(v, torch.SymInt):
        return f"Sym({v})"
    return repr(v)
