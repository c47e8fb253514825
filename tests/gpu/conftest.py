import pytest
import torch


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 for the test (greedy tokens are compared exactly)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(params=["tensor_cores", "cuda_cores"])
def decode_kernel(request):
    """Decode attention outside clusters on tensor cores (bf16/fp16, head_size 64/128, groups up
    to 16) or on CUDA cores (torch.ops.compilelm.set_decode_mma; fp32 and head_size 256 always)."""
    import compilelm.ops  # noqa: F401 (loads the kernels)

    previous = torch.ops.compilelm.set_decode_mma(request.param == "tensor_cores")
    yield request.param
    torch.ops.compilelm.set_decode_mma(previous)
