import pytest
import torch

from compilelm.graphs import CompileConfig
from tests.compile.toy_model import SPLIT_OP


@pytest.fixture(scope="session")
def inductor_dir(tmp_path_factory):
    """Inductor's own cache (built C++ kernels), shared by the session so each test does not
    rebuild the same kernels; compilelm's compile cache stays per test (tmp_path)."""
    return str(tmp_path_factory.mktemp("inductor"))


@pytest.fixture
def make_config(tmp_path, inductor_dir):
    def make(**overrides) -> CompileConfig:
        fields = dict(splitting_ops=(SPLIT_OP,), cache_dir=str(tmp_path / "cache"), inductor_cache_dir=inductor_dir)
        return CompileConfig(**{**fields, **overrides})
    return make


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
