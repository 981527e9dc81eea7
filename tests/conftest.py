"""The tests' fixtures; what they build comes from ``helpers.py``."""

from __future__ import annotations

import pytest
import torch

from .helpers import general_rows, tiny_model, train


@pytest.fixture
def make_model():
    return tiny_model


@pytest.fixture(scope="session")
def memorizer():
    """A tiny GPT-2 that memorized 6 planted random rows, and a reference trained without them.

    Returns (model, reference, planted rows, general rows).
    """
    gen = torch.Generator().manual_seed(0)
    vocab, length = 24, 16
    general = general_rows(256, length, gen, vocab)
    planted = torch.randint(3, vocab, (6, length), generator=gen)
    train_rows = torch.cat([general, planted.repeat(24, 1)])
    model = tiny_model("gpt2", seed=1, vocab=vocab, hidden=48)
    reference = tiny_model("gpt2", seed=1, vocab=vocab, hidden=48)
    train(model, train_rows, steps=150, seed=0)
    train(reference, general, steps=150, seed=0)
    return model, reference, planted, general
