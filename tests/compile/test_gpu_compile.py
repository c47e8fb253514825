"""The compile pipeline on CUDA (Triton kernels): compiled == eager, warm start from the cache."""

import pytest
import torch

from compilelm.graphs import CompiledModel
from tests.compile.toy_model import ToyModel, inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_equals_eager_and_warm_start(make_config, dtype):
    model = ToyModel(num_layers=3).to("cuda", dtype)
    cold = CompiledModel(model, make_config(compile_sizes=(4,)), {"toy": "cuda", "dtype": str(dtype)})
    fn = cold.compile()
    assert cold.counters["unique_pieces"] == 3 and cold.counters["inductor_compiles"] == 6
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        for n in (1, 4, 33):
            ids, pos = (t.cuda() for t in inputs(n))
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), **tol)
    warm = CompiledModel(model, make_config(compile_sizes=(4,)), {"toy": "cuda", "dtype": str(dtype)})
    fn = warm.compile()
    assert warm.mode == "warm" and warm.counters["inductor_compiles"] == 0 and warm.counters["artifacts_loaded"] == 6
    assert warm.factors["device"]["type"] == "cuda"
    with torch.no_grad():
        ids, pos = (t.cuda() for t in inputs(4))
        torch.testing.assert_close(fn(ids, pos), model(ids, pos), **tol)
