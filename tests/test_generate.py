"""Steered generation is the same alone, inside a left-padded batch, and without the KV cache."""

import pytest
import torch

import gss

from .helpers import ARCHITECTURES, calibrated_llama, random_ids, tiny_model


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


STRATEGIES = {
    "beam search": dict(num_beams=3, do_sample=False),
    "sampling": dict(do_sample=True, top_k=8, num_return_sequences=2),
    "beam sampling": dict(do_sample=True, num_beams=2),
    "prompt lookup": dict(do_sample=False, prompt_lookup_num_tokens=2),
    "assisted": dict(do_sample=False),  # + an assistant model, below
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_decoding_strategy_follows_the_steer(strategy):
    """gss.steer gives the tokens of the same steer hung on the block with torch's own forward
    hook: beams that reorder the cache, sampled rows and several-token verification steps
    (assisted decoding, prompt lookup) all pass through it."""
    model, art = calibrated_llama()
    options = dict(STRATEGIES[strategy], max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    if strategy == "assisted":
        options["assistant_model"] = tiny_model("llama", seed=5)
    prompt = random_ids(2, 6, seed=9)
    prompt[:, 3:] = prompt[:, :3]  # a repeat for prompt lookup to find
    if strategy in ("assisted", "prompt lookup"):
        prompt = prompt[:1]  # transformers verifies candidates for one row at a time

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(input_ids=prompt, **options)

    block = model.model.layers[art.layer]
    handle = block.register_forward_hook(art.make_hook())
    by_torch_hook = run()
    handle.remove()
    with gss.steer(model, art):
        by_gss = run()
    assert torch.equal(by_gss, by_torch_hook)
    assert not torch.equal(by_gss, run()), "the steer should change some continuation"
