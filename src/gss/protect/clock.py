"""Where a protect run's time goes: seconds summed per named part, over every call.

Issue 72 made each searched point measure more (the data's clean rows, the reference's
continuations) and added the replies check; the report says which step and which kind of work
the time went to, so that a slower search shows what made it slower.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Clock"]


class Clock:
    """Seconds per part name, summed over calls; parts may nest (a stage holds calibrations)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
