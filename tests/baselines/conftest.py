"""A tiny GPT-2 that has memorized a few random rows: something for the baselines to remove."""

from __future__ import annotations

import pytest
import torch

from gss_bench.baselines import MitigationData

from ..helpers import tiny_model
from .helpers import PAD, PROMPT, fit, random_rows


@pytest.fixture(scope="session")
def memorizer_setup():
    """(model, data): a 2-layer GPT-2 (ReLU MLP, like TinyMem's) fitted to 6 memorized rows
    and 24 clean rows; the clean twins share the memorized rows' prompts."""
    torch.manual_seed(0)
    model = tiny_model("gpt2", seed=0)
    model.config.activation_function = "relu"
    for block in model.transformer.h:
        block.mlp.act = torch.nn.ReLU()
    memorized = random_rows(6, 12, seed=1)
    clean = random_rows(24, 12, seed=2)
    twins = [row[:PROMPT] + other[PROMPT:] for row, other in zip(memorized, clean, strict=False)]
    fit(model, memorized + clean, steps=150)
    data = MitigationData(
        memorized=memorized, clean=clean, pad_id=PAD, clean_twins=twins, prompt_len=PROMPT
    )
    return model, data


@pytest.fixture
def memorizer(memorizer_setup):
    """The fitted model and data, with a check afterwards that no test changed the model."""
    model, data = memorizer_setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    yield model, data
    after = model.state_dict()
    changed = [k for k, v in before.items() if not torch.equal(v, after[k])]
    assert not changed, f"a baseline modified the original model: {changed[:3]}"
