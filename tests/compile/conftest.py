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


@pytest.fixture(scope="session")
def default_model_dump(tmp_path_factory, inductor_dir):
    """`compilelm compile --dump DIR --verify --profile` of the default model (the CI path), once
    a session: the report tests and the browser test read it."""
    import json

    from compilelm.entrypoints.cli import main as cli_main

    root = tmp_path_factory.mktemp("default_model")
    cc = json.dumps({"cache_dir": str(root / "cache"), "inductor_cache_dir": inductor_dir})
    args = ["compile", "--dump", str(root / "dump"), "--verify", "--profile", "--profile-decode", "4x64",
            "--profile-prefill", "1x64", "-cc", cc]
    assert cli_main(args) == 0
    return root / "dump"
