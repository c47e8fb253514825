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
