"""The pass manager: the ordered list of passes built from a `PassConfig`, installed as
Inductor's `post_grad_custom_post_pass` for every piece.

Order (fixed; compilelm/passes/config.py lists the built-in passes in it):

    whole graph (before the split):  NoOpElimination, AllReduceRMSNorm, RopeAttention, <custom whole-graph>
    post-grad (per piece):           NoOpElimination, UnfuseResidualAddmm, RouteLinear (linear routing),
                                     RMSNormLinear, SiluMulLinear, QKVRope, NormGemm, RMSNormQuant,
                                     SiluMulQuant, <custom post-grad>,
                                     then always the tail: Cleanup, InplaceLowering, Cleanup

Custom passes ("module:Class", optionally ",stage=whole_graph|post_grad" and ",before=Pass" or
",after=Pass") go at the end of their stage, or next to the named pass.

Fusions target functional ops; the tail turns them into in-place kernels once, at the very end
(no pass may run after it). `uuid()` combines every pass's uuid, so editing any pass — or
switching one on — changes Inductor's cache key and compilelm's compile cache key.

Before tracing, the compiler calls `prepare_model`: each pass's load-time rewrite of the model
(CompilePass.prepare_model), in pass order.
"""

from __future__ import annotations

import hashlib
import importlib

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from compilelm.passes.base import CompilePass
from compilelm.passes.config import PassConfig, builtin_passes, parse_pass_spec
from compilelm.passes.utility.cleanup import CleanupPass


class PassManager(CustomGraphPass):
    def __init__(self, config: PassConfig, custom_passes: tuple[str, ...] = ()):
        self.config = config
        self.whole_graph: list[CompilePass] = []
        self.post_grad: list[CompilePass] = []
        self.tail: list[CompilePass] = [CleanupPass(config)]
        for switch, path, stages in builtin_passes():
            if not getattr(config, switch):
                continue
            cls = load_pass(f"{__package__}.{path}")
            for stage in stages or (cls.stage,):
                if stage == "tail":
                    self.tail += [cls(config), CleanupPass(config)]
                else:
                    (self.whole_graph if stage == "whole_graph" else self.post_grad).append(cls(config))
        for spec in custom_passes:
            self._add_custom(spec)

    def _add_custom(self, spec: str) -> None:
        """Custom pass "module:Class[,stage=...][,before=Pass|after=Pass]": by default at the end
        of its class's stage, else next to the named pass of that stage."""
        path, stage, where = parse_pass_spec(spec)
        p = load_pass(path)(self.config)
        p.stage = stage or p.stage
        passes = self.whole_graph if p.stage == "whole_graph" else self.post_grad
        if where is None:
            passes.append(p)
            return
        side, anchor = where
        names = [q.name for q in passes]
        if anchor not in names:
            raise ValueError(f"custom_passes: {spec!r}: no pass {anchor!r} in the {p.stage} stage "
                             f"(it has: {', '.join(names) or 'none'})")
        i = names.index(anchor) if side == "before" else len(names) - names[::-1].index(anchor)
        passes.insert(i, p)

    @property
    def passes(self) -> list[CompilePass]:
        return self.whole_graph + self.post_grad + self.tail

    def prepare_model(self, model: nn.Module) -> list[str]:
        """Runs every pass's load-time rewrite on `model`; returns what they did, "Pass: what" each."""
        done = []
        for p in self.passes:
            what = p.prepare_model(model)
            if what:
                done.append(f"{p.name}: {what}")
        return done

    def set_recorder(self, recorder) -> None:
        for p in self.passes:
            p.recorder = recorder

    def run_whole_graph(self, gm: torch.fx.GraphModule) -> None:
        for p in self.whole_graph:
            p(gm.graph)
        gm.graph.lint()
        gm.recompile()

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.post_grad + self.tail:
            p(graph)

    def uuid(self) -> str:
        h = hashlib.sha256()
        for stage, passes in (("whole_graph", self.whole_graph), ("post_grad", self.post_grad + self.tail)):
            for p in passes:
                h.update(f"{stage}:{p.name}:{p.uuid()};".encode())
        return h.hexdigest()

    def uuids(self) -> dict[str, str]:
        """Pass name -> uuid, for the cache-key factors and the report."""
        stages = (("whole_graph", self.whole_graph), ("post_grad", self.post_grad + self.tail))
        return {f"{stage}.{p.name}": p.uuid() for stage, passes in stages for p in passes}


def load_pass(spec: str) -> type[CompilePass]:
    """Resolve a custom pass given as "package.module:ClassName"."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"custom_passes entries must look like 'package.module:ClassName', got {spec!r}")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"custom_passes: cannot load {spec!r}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, CompilePass)):
        raise ValueError(f"custom_passes: {spec!r} is not a compilelm.passes.CompilePass subclass")
    return cls
