"""What the pass manager remembers while compiling: per-graph, per-pass match counts and times,
and — for `compilelm compile --dump/--verify` — each graph before and after every pass and the
numeric difference the pass made."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from compilelm.passes.debug.verify import max_error, snapshot


@dataclass
class PassRecord:
    graph: str  # "whole_graph" or the piece name
    index: int  # position of the pass in that graph's pipeline
    name: str
    matches: int
    seconds: float
    max_error: float | None = None  # --verify: max |after - before| on random inputs
    verify_error: str | None = None  # why verification could not run


class PassRecorder:
    def __init__(self, dump_dir: str | None = None, verify: bool = False, stand_in_ops: tuple[str, ...] = ()):
        self.dump_dir = dump_dir
        self.verify = verify
        self.stand_in_ops = stand_in_ops  # ops replaced by a stand-in when verifying (attention)
        self.graph = "whole_graph"  # the graph being compiled; set by the backend
        self.records: list[PassRecord] = []

    def before(self, p, graph: torch.fx.Graph):
        if self.dump_dir is None and not self.verify:
            return None
        return snapshot(graph)

    def after(self, p, graph: torch.fx.Graph, before, matches: int, seconds: float) -> None:
        index = sum(r.graph == self.graph for r in self.records)
        rec = PassRecord(self.graph, index, p.name, matches, seconds)
        if before is not None and self.dump_dir is not None:
            prefix = os.path.join(self.dump_dir, self.graph, f"{index:02d}.{p.name}")
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            _write(prefix + ".before.py", before.print_readable(print_output=False))
            _write(prefix + ".after.py", snapshot(graph).print_readable(print_output=False))
        if before is not None and self.verify:
            try:
                rec.max_error = max_error(before, snapshot(graph), stand_in_ops=self.stand_in_ops)
            except Exception as e:  # a graph we cannot run eagerly on random data
                rec.verify_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        self.records.append(rec)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
