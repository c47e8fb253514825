"""Compile the toy model in a separate process (for the concurrency test); prints counters as JSON."""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402

from compilelm.graphs import CompileConfig, CompiledModel, compile_counters  # noqa: E402
from tests.compile.toy_model import SPLIT_OP, ToyModel, inputs  # noqa: E402

if __name__ == "__main__":
    cache_dir, inductor_dir, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = ToyModel(num_layers=layers)
    config = CompileConfig(splitting_ops=(SPLIT_OP,), cache_dir=cache_dir, inductor_cache_dir=inductor_dir)
    cm = CompiledModel(model, config, {"toy": "concurrent"})
    fn = cm.compile()
    with torch.no_grad():
        ids, pos = inputs(9)
        err = (fn(ids, pos) - model(ids, pos)).abs().max().item()
    print(json.dumps({"key": cm.cache.key, "mode": cm.mode, "max_error": err, **compile_counters.snapshot()}))
