"""Topological sort + dead-code elimination: pattern replacements may leave both behind."""

from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import stable_topological_sort

from compilelm.passes.base import CompilePass


class CleanupPass(CompilePass):
    def run(self, graph: torch.fx.Graph) -> int:
        before = len(graph.nodes)
        stable_topological_sort(graph)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
