"""`compile_model`: turn a model into a compiled `forward(input_ids, positions)`, or load it.

Warm start (the cache holds this key): load every unique piece's Inductor artifact and rebuild
the stitched function from its stored source — no Dynamo, no Inductor. `--dump` and `--verify`
never start warm: they compile fresh, past every cache, so that every pass runs (and is checked).

Cold start: Dynamo traces `model.forward` once, on dummy inputs, with the token dimension
marked dynamic and every guard dropped; the compilelm backend compiles (see backend.py); the
traced call itself is a dry run. When every graph input is a model tensor or a forward
argument, the returned function calls the stitched graph directly (no Dynamo frame evaluation
on the serving path); otherwise it is the guard-free Dynamo function. Either way nothing can
recompile while serving.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters as torch_counters

import compilelm.graphs.lazy_templates  # noqa: F401  (before Inductor's kernel modules load)
from compilelm.graphs.backend import SENTINEL, CompilelmBackend
from compilelm.graphs.cache import CompileCache, cache_key_factors
from compilelm.graphs.config import CompileConfig
from compilelm.graphs.counters import compile_counters
from compilelm.graphs.dump import Dumper, write_report
from compilelm.graphs.inductor import PieceRunner, inductor_patches
from compilelm.graphs.stitch import build_graph, entry_function
from compilelm.graphs.torch_trace import torch_trace
from compilelm.passes import PassManager, PassRecorder

TRACE_TOKENS = 16  # dummy batch for tracing: >= 2, so Dynamo does not specialise on 0/1


def compile_model(model: torch.nn.Module, config: CompileConfig, cache_key_factors: dict) -> Callable:
    """`fn(input_ids int64 [num_tokens], positions int64 [num_tokens]) -> hidden [num_tokens, hidden]`
    for any num_tokens >= 1. Level 0 returns `model.forward` unchanged."""
    if config.level == 0:
        return model.forward
    return CompiledModel(model, config, cache_key_factors).compile()


class CompiledModel:
    """One compilation of one model, and the record of what it did (for reports and tests)."""

    def __init__(self, model: torch.nn.Module, config: CompileConfig, model_factors: dict):
        self.model = model
        self.config = config
        self.arg_names = [p for p in inspect.signature(model.forward).parameters][:2]
        self.manager = PassManager(config.passes, config.custom_passes)
        inductor_patches(self.manager, dict(config.inductor_options))  # unknown settings fail here, early
        self.dumper = Dumper(config.dump_dir) if config.dump_dir else None
        self.recorder = PassRecorder(self.dumper.path("passes") if self.dumper else None, config.verify_passes,
                                     stand_in_ops=config.splitting_ops)
        self.manager.set_recorder(self.recorder)
        self.factors = cache_key_factors(model, config, self.manager.uuids(), model_factors)
        self.cache = CompileCache(config, self.factors)
        self.backend: CompilelmBackend | None = None
        self.mode = ""  # "warm" (loaded, no Dynamo), "cold" or "cold (dynamo runtime)"
        self.times: dict[str, float] = {}
        self.counters: dict[str, int] = {}
        self.inductor_counters: dict[str, int] = {}
        self.depyf_error: str | None = None
        self.load_rewrites: list[str] = []  # what the passes' prepare_model hooks did to the model
        self.profile: dict | None = None  # compile --profile: graphs/profile.py's tables
        self.forward: Callable | None = None
        self.graph_fn: Callable | None = None  # the stitched graph (its globals hold the pieces)
        self.runners: dict[str, PieceRunner] = {}  # call site ("submod_2") -> its compiled piece

    def compile(self) -> Callable:
        t0 = time.perf_counter()
        before, inductor_before = compile_counters.snapshot(), dict(torch_counters["inductor"])
        trace = torch_trace(self.dumper.path("trace")) if self.dumper else contextlib.nullcontext()
        with self.cache.inductor_env(), torch.no_grad(), trace:
            self.load_rewrites += self.manager.prepare_model(self.model)  # warm or cold: the pieces expect it
            # --dump / --verify compile fresh: a load from the cache would run (and check) no pass
            fresh = self.dumper is not None or self.config.verify_passes
            fn = None if fresh else self._load()
            if fn is None:
                compile_counters.cache_misses += 1
                fn = self._compile()
        self.times["total"] = time.perf_counter() - t0
        self.counters = compile_counters.delta(before)
        self.inductor_counters = {k: v - inductor_before.get(k, 0) for k, v in torch_counters["inductor"].items()
                                  if v != inductor_before.get(k, 0)}
        self.forward = fn
        if self.dumper:
            write_report(self)
        return fn

    def _load(self) -> Callable | None:
        manifest = self.cache.load_manifest()
        if manifest is None or manifest.get("inputs") is None:
            return None  # miss, or a model that needs Dynamo at run time (its pieces still load)
        t = time.perf_counter()
        runners = {}
        for key, entry in manifest["pieces"].items():
            loaded = {tag: self.cache.load_artifact(f) for tag, f in entry["files"].items()}
            if any(a is None for a in loaded.values()):
                return None
            static = {int(tag): a for tag, a in loaded.items() if tag != "dyn"}
            runners[key] = PieceRunner(key, key, loaded["dyn"], static, entry["token_arg"])
        compile_counters.artifacts_loaded += sum(len(e["files"]) for e in manifest["pieces"].values())
        self.runners = {site: runners[key] for site, key in manifest["call_sites"].items()}
        self.graph_fn = build_graph(manifest["graph_code"], manifest["ops"],
                                    {site: r.entry for site, r in self.runners.items()})
        fn = entry_function(self.graph_fn, manifest["inputs"], self.arg_names, self.model)
        compile_counters.cache_hits += 1
        compile_counters.dynamo_free_starts += 1
        self.mode = "warm"
        self.times["load"] = time.perf_counter() - t
        self.manifest = manifest
        return fn

    def _compile(self) -> Callable:
        backend = self.backend = CompilelmBackend(
            self.config, self.manager, self.cache, self.recorder, self.arg_names, self.dumper)
        code = type(self.model).forward.__code__
        _reset_dynamo(code)  # a guard-free entry from another model of this class must not match
        dynamo_fn = torch.compile(self.model.forward, backend=backend, fullgraph=True, dynamic=False,
                                  options={"guard_filter_fn": _skip_all_guards})
        device = next(iter(self.model.parameters())).device
        input_ids = torch.zeros(TRACE_TOKENS, dtype=torch.long, device=device)
        positions = torch.arange(TRACE_TOKENS, device=device)
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        backend.start()
        out = dynamo_fn(input_ids, positions)  # traces + compiles; the call itself is a dry run
        backend.dry_run = False
        if self.dumper:
            self._decompile_bytecode(code)
        direct = backend.recipe is not None and backend.n_outputs == 1 and out is SENTINEL
        manifest = dict(backend.manifest, inputs=backend.recipe if direct else None)
        self.cache.save_manifest(manifest)
        self.manifest = manifest
        self.times.update(backend.times)
        self.graph_fn, self.runners = backend.graph_fn, backend.runners
        if direct:
            self.mode = "cold"
            _reset_dynamo(code)
            return entry_function(backend.graph_fn, backend.recipe, self.arg_names, self.model)
        self.mode = "cold (dynamo runtime)"
        return dynamo_fn

    def wrap_pieces(self, wrap: Callable[[str, PieceRunner], Callable]) -> None:
        """Route each piece call site through `wrap(site, runner)`: the hook for piecewise CUDA
        graphs, captured per call site (each layer feeds its own weights) and per padded batch
        size. Nothing wraps pieces on CPU."""
        for site, runner in self.runners.items():
            self.graph_fn.__globals__[f"piece_{site}"] = wrap(site, runner)

    def _decompile_bytecode(self, code) -> None:
        """depyf's decompilation of the bytecode Dynamo generated for forward, into the dump."""
        try:
            import depyf

            entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
            text = "\n\n".join(depyf.decompile(e.code) for e in entries)
            self.dumper.write("06_dynamo_bytecode_decompiled.py", text or "# no cache entry\n")
        except Exception as e:  # depyf lags behind new torch releases
            self.depyf_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            self.dumper.write("06_dynamo_bytecode_decompiled.py", f"# depyf failed: {self.depyf_error}\n")


def _skip_all_guards(guard_entries) -> list[bool]:
    return [False] * len(guard_entries)


def _reset_dynamo(code) -> None:
    torch._C._dynamo.eval_frame.reset_code(code)
