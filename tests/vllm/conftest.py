"""tests/vllm runs only where vLLM imports (its own environment); elsewhere it is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # ImportError, or a vLLM that cannot start on this machine
    HAVE_VLLM = False

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed: tests/vllm runs in a vLLM environment")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
