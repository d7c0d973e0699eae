"""The CLI through CliRunner with stub builds, for the tests of this folder."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fa4aot import settings
from fa4aot.cli import main


@pytest.fixture
def run(tmp_path):
    """run(*args, **settings) -> the CliRunner result; builds use the stub compiler, and the
    default layer points into tmp_path: nothing here touches the user's cache."""
    runner = CliRunner(env={"FA4AOT_DEBUG": None, "FA4AOT_CACHE_DIR": None})

    def invoke(*args, **overrides):
        with settings.scope(stub_compiler="1", stub_delay="0", progress="0",
                            cache_dir=str(tmp_path / "default"), **overrides):
            return runner.invoke(main, list(args), catch_exceptions=False)

    return invoke
