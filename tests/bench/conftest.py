"""Fixtures shared by the benchmark harness's tests."""

import os

import pytest


@pytest.fixture(scope="session")
def tinymem_cache(tmp_path_factory):
    """One TinyMem model cache for the whole run: each quick setting trains once (the TinyMem
    run's tests and `gss bench perf --quick --only protect` read the same models), shared by
    pytest-xdist's workers (the run's common temporary folder; the harness locks each model
    while one worker trains it, so the others load it)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # no xdist: this process alone
        return tmp_path_factory.mktemp("tinymem-cache")
    shared = tmp_path_factory.getbasetemp().parent / "tinymem-cache"
    shared.mkdir(exist_ok=True)
    return shared
