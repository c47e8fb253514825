import gc
import os

import pytest

# Keep CPU tests from oversubscribing the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    """An engine freezes everything alive at its startup (LLMEngine.__init__); after each test
    the frozen objects go back to the collector, so engines that tests drop can be collected."""
    yield
    gc.unfreeze()
