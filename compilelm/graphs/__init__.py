"""compilelm's compiler: Dynamo backend, whole-graph passes, piecewise split, Inductor per piece,
compile cache and dumps. Entry point: `compile_model(model, CompileConfig(...), cache_key_factors)`.

`CompiledModel` and `compile_model` are imported on first use: they bring in Dynamo, Inductor
and the pass manager, a large share of startup (docs/perf.md, "Compile and warm start"), which
an eager engine (`-O0`) or reading a `CompileConfig` never needs."""

from compilelm.graphs.config import CompileConfig, default_cache_dir
from compilelm.graphs.counters import compile_counters

__all__ = ["CompileConfig", "CompiledModel", "compile_counters", "compile_model", "default_cache_dir"]


def __getattr__(name):
    if name in ("CompiledModel", "compile_model"):
        from compilelm.graphs import compiler
        return getattr(compiler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
