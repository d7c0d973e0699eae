import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200; see docs/gpu-tests.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
