"""Steered generation is the same alone, inside a left-padded batch, and without the KV cache."""

import pytest
import torch

import gss

from .conftest import ARCHITECTURES, random_ids


def _steered_artifact(model, make_model, arch):
    ref = make_model(arch, seed=11)
    art = gss.calibrate(
        model,
        ref,
        random_ids(16, 14, seed=2),
        layer=1,
        rank=2,
        threshold_percentile=50.0,
        progress=False,
    )
    return art.with_options(delta=25.0)  # strong enough to change greedy choices


def _generate(model, ids, mask, use_cache=True):
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
            min_new_tokens=8,
        )[:, ids.shape[1] :]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_alone_equals_left_padded_batch_equals_no_cache(make_model, arch):
    model = make_model(arch, seed=3)
    art = _steered_artifact(model, make_model, arch)
    prompts = [random_ids(1, n, seed=20 + n)[0] for n in (5, 9, 7)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    unsteered = _generate(model, ids, mask)
    with gss.steer(model, art):
        batched = _generate(model, ids, mask)
        for i, p in enumerate(prompts):
            one = p.unsqueeze(0)
            alone = _generate(model, one, torch.ones_like(one))
            no_cache = _generate(model, one, torch.ones_like(one), use_cache=False)
            assert torch.equal(alone[0], batched[i]), f"prompt {i}: batch differs from alone"
            assert torch.equal(alone[0], no_cache[0]), f"prompt {i}: KV cache changes the output"
    assert not torch.equal(batched, unsteered), "the steer should change some continuation"
