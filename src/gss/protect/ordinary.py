"""Ordinary English that every Python ships (the prose of its own documentation,
``pydoc_data.topics``): a general source for the gate thresholds that no user has to supply
and no download brings.

A gate set only on the user's in-domain text and on the reference's own samples opened on
half of an ordinary licence text (issue 72): thresholds must also hold on the English the
model will meet outside its domain. This text is that third source; protect sets the gates so
that no source opens them more than it asks, and measures each on a held-out half.
"""

from __future__ import annotations

import random
import re

__all__ = ["ordinary_english"]


def _paragraphs() -> list[str]:
    """The documentation's prose paragraphs (code, tables and short lines left out)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its documentation topics
        return []
    out = []
    for key in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[key]):
            lines = block.split("\n")
            if any(line.startswith((" ", "\t")) for line in lines):  # code, lists, tables
                continue
            text = " ".join(line.strip() for line in lines)
            if len(text) >= 300 and ">>>" not in text and not text.startswith("*"):
                out.append(text)
    return out


def ordinary_english(rows: int = 64, seed: int = 0) -> list[str]:
    """Up to ``rows`` prose paragraphs of Python's documentation, a seeded sample in a fixed
    order (empty where this Python has none: protect then goes without the source)."""
    paragraphs = _paragraphs()
    return random.Random(seed).sample(paragraphs, min(rows, len(paragraphs)))
