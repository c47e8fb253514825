"""compilelm's compiler: Dynamo backend, whole-graph passes, piecewise split, Inductor per piece,
compile cache and dumps. Entry point: `compile_model(model, CompileConfig(...), cache_key_factors)`."""

from compilelm.graphs.compiler import CompiledModel, compile_model
from compilelm.graphs.config import CompileConfig, default_cache_dir
from compilelm.graphs.counters import compile_counters

__all__ = ["CompileConfig", "CompiledModel", "compile_counters", "compile_model", "default_cache_dir"]
