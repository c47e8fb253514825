"""The pass base classes: every graph pass has a name, an identity, a match count and a time.

`CompilePass` is an Inductor `CustomGraphPass`: `__call__(graph)` rewrites an FX graph in place
and `uuid()` identifies the pass for Inductor's cache and compilelm's compile cache. The uuid is
a hash of the source file that defines the pass (so editing a pattern function invalidates the
cache — nothing is listed by hand) plus the pass's own config slice.

`FusionPass` (fusion_pass.py) is the pattern-matching flavour.

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
from typing import Any, ClassVar

import torch
from torch import nn
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
