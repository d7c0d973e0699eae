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


@pytest.fixture(autouse=True)
def _settings_restored():
    """Whatever a test overrode (scopes, monkeypatch.setitem in build_stub, in any teardown
    order), the next test starts from the settings it found: torn down last of the function
    fixtures, so no interleaving of undos can leak an override (e.g. stub_compiler) onward."""
    from fa4aot import settings

    saved = settings.settings.overrides()
    yield
    settings.settings._overrides.clear()
    settings.settings.apply(saved)


@pytest.fixture
def knobs():
    """Override fa4aot settings for one test, as monkeypatch does for attributes:
    `knobs(stub_compiler="1")`; every scope is left at teardown. Tests never edit os.environ
    for FA4AOT_* variables (subprocesses get theirs through `env=`)."""
    import contextlib

    from fa4aot import settings

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(settings.scope(**values))
