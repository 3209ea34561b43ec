import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/builders.py: model builders

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def device():
    """The compute device: CPU here, CUDA when present and TIERCACHE_TEST_CUDA=1."""
    if torch.cuda.is_available() and os.environ.get("TIERCACHE_TEST_CUDA") == "1":
        return torch.device("cuda")
    return torch.device("cpu")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
