"""Calibration and steering under an `accelerate` device_map give the un-dispatched results.

With no GPU the blocks are split over "cpu" placements (with hooks forced on) or offloaded to
"disk", the case where a block's weights sit on the "meta" device between calls and the steered
block's execution device has to come from its dispatch hook.
"""

import pytest
import torch

import gss

from .conftest import random_ids, tiny_model

accelerate = pytest.importorskip("accelerate")

PLACEMENTS = {
    "llama": {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    },
    "gpt2": {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h.0": "cpu",
        "transformer.h.1": "cpu",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    },
}
STEERED_BLOCK = {"llama": "model.layers.1", "gpt2": "transformer.h.1"}


def _steer_and_generate(model, reference):
    art = gss.calibrate(
        model,
        reference,
        random_ids(16, 14, seed=2),
        layer=1,
        rank=2,
        threshold_percentile=50.0,
        progress=False,
    ).with_options(delta=25.0)  # strong enough to change greedy choices
    ids = random_ids(3, 9, seed=5)
    with gss.steer(model, art), torch.no_grad():
        logits = model(input_ids=ids).logits
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    return art, logits, generated, plain


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("placement", ["cpu-split", "disk-offload"])
def test_dispatched_model_calibrates_and_steers_like_the_plain_one(tmp_path, arch, placement):
    plain_art, plain_logits, plain_gen, unsteered = _steer_and_generate(
        tiny_model(arch, seed=3), tiny_model(arch, seed=11)
    )
    device_map = dict(PLACEMENTS[arch])
    if placement == "disk-offload":
        device_map[STEERED_BLOCK[arch]] = "disk"
    model = accelerate.dispatch_model(
        tiny_model(arch, seed=3), device_map, offload_dir=str(tmp_path), force_hooks=True
    )
    reference = accelerate.dispatch_model(
        tiny_model(arch, seed=11), PLACEMENTS[arch], force_hooks=True
    )
    if placement == "disk-offload":
        block = model.get_submodule(STEERED_BLOCK[arch])
        assert {p.device.type for p in block.parameters()} == {"meta"}

    art, logits, generated, _ = _steer_and_generate(model, reference)

    for name in ("probe", "steer", "thresholds", "singular_values"):
        assert torch.allclose(
            getattr(art, name).double(), getattr(plain_art, name).double(), rtol=1e-5, atol=1e-6
        ), name
    assert torch.allclose(logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(generated, plain_gen)
    assert not torch.allclose(plain_logits, unsteered), "the steer should change the logits"
