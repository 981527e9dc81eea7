"""Fixtures shared by the benchmark harness's tests."""

import pytest


@pytest.fixture(scope="session")
def tinymem_cache(tmp_path_factory):
    """One TinyMem model cache for the session: each quick setting trains once (the TinyMem
    run's tests and `gss bench perf --quick --only protect` read the same models)."""
    return tmp_path_factory.mktemp("tinymem-cache")
