"""The compilelm Dynamo backend: Dynamo graph -> aten -> whole-graph passes -> split -> Inductor
per unique piece -> one stitched Python function.

    Dynamo FX graph (torch-level, parameters lifted to inputs)
      | AOTAutograd, inference only: functional aten ops, Inductor's decompositions; once per
      | distinct layer, copied in at every layer (lower.py; whole-graph AOT as the fallback)
    whole-model aten graph  -- whole-graph passes (fusions spanning attention live here)
      | split at the splitting ops
    pieces  -- Inductor each (post-grad PassManager), once per unique piece, symbolic + static sizes
      | stitch
    graph(*inputs) -> (hidden,)

The first call Dynamo makes with the traced function is a *dry run* (`compile_model` traces with
dummy inputs, before any KV cache exists): it returns placeholders instead of running.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.decomposition import select_decomp_table
from tqdm import tqdm

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.graphs.counters import compile_counters
from compilelm.graphs.inductor import PieceRunner, bypass_caches, compile_piece, piece_key, token_arg
from compilelm.graphs.lower import lower_to_aten
from compilelm.graphs.split import split_graph
from compilelm.graphs.stitch import build_graph, graph_code, input_recipe
from compilelm.passes.base import describe

SENTINEL = torch.empty(0)  # what the dry run returns in place of each graph output


class CompilelmBackend:
    def __init__(self, config, manager, cache, recorder, arg_names: list[str], dumper=None):
        self.config = config
        self.manager = manager
        self.cache = cache
        self.recorder = recorder
        self.arg_names = arg_names
        self.dumper = dumper
        # --dump and --verify compile everything, bypassing every cache, so every pass runs
        self.fresh = dumper is not None or config.verify_passes
        self.dry_run = True
        self.mutated_inputs: list[int] = []  # whole-graph AOT: inputs whose new values lead the outputs
        self.recipe: list | None = None
        self.graph_fn = None
        self.runners: dict[str, PieceRunner] = {}  # call site -> runner
        self.manifest: dict = {}
        self.pieces: list[dict] = []  # per call site, for the report
        self.times = {"dynamo": 0.0, "aot": 0.0, "whole_graph_passes": 0.0, "split": 0.0,
                      "post_grad_passes": 0.0, "inductor": 0.0, "load": 0.0}
        self._t = time.perf_counter()

    def start(self) -> None:
        self._t = time.perf_counter()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        compile_counters.dynamo_traces += 1
        self.times["dynamo"] += time.perf_counter() - self._t
        self.recipe = input_recipe(gm, self.arg_names)
        if self.dumper:
            self.dumper.write("01_dynamo_graph.py", gm.print_readable(print_output=False))
        self._t = time.perf_counter()
        aten = lower_to_aten(gm, self.config.splitting_ops)
        if aten is not None:  # a plain function of its inputs: called as it is, no AOT wrappers
            self.times["aot"] += time.perf_counter() - self._t
            self._compile_aten(aten)
            return self._run
        return aot_autograd(fw_compiler=self._compile_whole, decompositions=select_decomp_table())(gm, example_inputs)

    def _compile_whole(self, gm: torch.fx.GraphModule, example_inputs):
        """AOTAutograd's forward compiler, when the whole graph had to go through it."""
        self.times["aot"] += time.perf_counter() - self._t
        meta = torch._guards.TracingContext.get().fw_metadata
        plain = meta is not None and not meta.tokens and all(
            not (i.mutates_data or i.mutates_metadata) for i in meta.input_info
        ) and all(o.output_type.name == "non_alias" for o in meta.output_info)
        if not plain:  # inputs mutated / outputs aliasing: keep Dynamo + AOT's wrappers in the loop
            self.recipe = None
            self.mutated_inputs = list(meta.mutated_inp_runtime_indices)
        self._compile_aten(gm)
        return make_boxed_func(self._run)

    def _compile_aten(self, gm: torch.fx.GraphModule) -> None:
        """Whole-graph passes, split, Inductor per distinct piece, stitch."""
        if self.dumper:
            self.dumper.write("02_aten_graph.py", gm.print_readable(print_output=False))
        t = time.perf_counter()
        self.recorder.graph = "whole_graph"
        self.manager.run_whole_graph(gm)
        self.times["whole_graph_passes"] += time.perf_counter() - t
        if self.dumper:
            self.dumper.write("03_after_whole_graph_passes.py", gm.print_readable(print_output=False))

        t = time.perf_counter()
        top, pieces = split_graph(gm, self.config.splitting_ops)
        self.times["split"] += time.perf_counter() - t
        runners, table = self._compile_pieces(pieces)
        self.runners = runners
        src, ops = graph_code(top)
        self.graph_fn = build_graph(src, ops, {name: r.entry for name, r in runners.items()})
        self.n_outputs = len(next(n for n in reversed(top.graph.nodes) if n.op == "output").args[0])
        self.manifest = {
            "format": 1, "graph_code": src, "ops": ops,
            "call_sites": {p.name: runners[p.name].key for p in pieces},
            "pieces": table, "arg_names": self.arg_names, "n_outputs": self.n_outputs,
        }
        if self.dumper:
            self.dumper.write("04_split_graph.py", top.print_readable(print_output=False))
            self.dumper.write("05_stitched_graph.py", src)

    def _run(self, *args):
        if self.dry_run:  # mutated inputs come back unchanged: AOT's epilogue copies them onto themselves
            return (tuple(args[i] for i in self.mutated_inputs)
                    + (SENTINEL,) * (self.n_outputs - len(self.mutated_inputs)))
        return self.graph_fn(*args)

    def _compile_pieces(self, pieces) -> tuple[dict[str, PieceRunner], dict]:
        groups: dict[str, list] = {}
        for piece in pieces:
            groups.setdefault(piece_key(piece), []).append(piece)
        compile_counters.pieces += len(pieces)
        compile_counters.unique_pieces += len(groups)
        sizes = [None, *self.config.compile_sizes]
        runners, table = {}, {}
        bar = tqdm(total=len(groups) * len(sizes), desc="compilelm: compiling pieces", unit="graph",
                   disable=True if get_tp_rank() > 0 else None)  # one bar: rank 0's
        for key, group in groups.items():
            first, compiled, files = group[0], {}, {}
            for size in sizes:
                tag = "dyn" if size is None else str(size)
                files[tag] = f"{key}-{tag}.bin"
                t = time.perf_counter()
                artifact = None if self.fresh else self.cache.load_artifact(files[tag])
                if artifact is not None:
                    compile_counters.artifacts_loaded += 1
                    self.times["load"] += time.perf_counter() - t
                else:
                    artifact = self._inductor(first, size, tag)
                    if not self.fresh:  # a cache-less compile cannot be saved
                        self.cache.save_artifact(files[tag], artifact)
                compiled[size] = artifact
                bar.update()
            runner = PieceRunner(first.name, key, compiled[None], {s: compiled[s] for s in sizes[1:]}, token_arg(first))
            table[key] = {"files": files, "token_arg": runner.token_arg}
            for piece in group:
                runners[piece.name] = runner
        bar.close()
        for piece in pieces:
            self.pieces.append({
                "name": piece.name, "key": runners[piece.name].key, "compiled_as": runners[piece.name].name,
                "inputs": [describe(v) for v in piece.inputs], "outputs": [describe(v) for v in piece.outputs],
                "ops": op_counts(piece.gm),
            })
        return runners, table

    def _inductor(self, piece, size: int | None, tag: str):
        self.recorder.graph = piece.name if size is None else f"{piece.name}.size{tag}"
        passes_before = sum(r.seconds for r in self.recorder.records)
        t = time.perf_counter()
        options = dict(self.config.inductor_options)
        if self.dumper:  # bypass Inductor's caches so every pass runs; keep its generated code
            caches = self.dumper.inductor_trace(f"{piece.name}-{tag}")
        else:
            caches = bypass_caches() if self.fresh else contextlib.nullcontext({})
        with caches as patches:
            artifact = compile_piece(piece, self.manager, size, self.config.max_autotune, {**options, **patches})
        passes = sum(r.seconds for r in self.recorder.records) - passes_before
        self.times["post_grad_passes"] += passes
        self.times["inductor"] += time.perf_counter() - t - passes
        compile_counters.inductor_compiles += 1
        return artifact


def op_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            t = node.target
            name = str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
            name = name.replace("aten.", "").replace(".default", "")
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))
