import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (GPU tier runs on the device machine: scripts/gpu_tier.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
