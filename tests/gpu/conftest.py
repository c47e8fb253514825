import pytest
import torch


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 for the test (greedy tokens are compared exactly)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old
