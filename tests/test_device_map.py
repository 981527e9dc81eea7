"""Calibration and steering under an `accelerate` device_map give the un-dispatched results.

With no GPU the blocks are split over "cpu" placements (with hooks forced on) or offloaded to
"disk", the case where a block's weights sit on the "meta" device between calls and the steered
block's execution device has to come from its dispatch hook. With a GPU, the steered block and
the final norm also run on it while the rest stays on the CPU ("gpu-split").
"""

import pytest
import torch

import gss

from .helpers import random_ids, tiny_model

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
FINAL_NORM = {"llama": "model.norm", "gpt2": "transformer.ln_f"}
EMBEDDINGS = {"llama": "model.embed_tokens", "gpt2": "transformer.wpe"}  # wte: tied, kept


def _device_map(arch: str, placement: str) -> dict[str, str | int]:
    device_map: dict[str, str | int] = dict(PLACEMENTS[arch])
    if placement == "disk-offload":
        device_map[STEERED_BLOCK[arch]] = "disk"
    elif placement == "disk-embeddings":  # on "meta" between calls: gss reads the offloaded copy
        device_map[EMBEDDINGS[arch]] = "disk"
    elif placement == "gpu-split":
        device_map[STEERED_BLOCK[arch]] = device_map[FINAL_NORM[arch]] = 0
    return device_map


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
@pytest.mark.parametrize(
    "placement",
    [
        "cpu-split",
        "disk-offload",
        "disk-embeddings",
        pytest.param(
            "gpu-split",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ],
)
def test_dispatched_model_calibrates_and_steers_like_the_plain_one(tmp_path, arch, placement):
    plain_art, plain_logits, plain_gen, unsteered = _steer_and_generate(
        tiny_model(arch, seed=3), tiny_model(arch, seed=11)
    )
    device_map = _device_map(arch, placement)
    model = accelerate.dispatch_model(
        tiny_model(arch, seed=3), device_map, offload_dir=str(tmp_path), force_hooks=True
    )
    reference_map = device_map if placement == "gpu-split" else PLACEMENTS[arch]
    reference = accelerate.dispatch_model(
        tiny_model(arch, seed=11), reference_map, force_hooks=True
    )
    if placement in ("disk-offload", "disk-embeddings"):
        offloaded = STEERED_BLOCK[arch] if placement == "disk-offload" else EMBEDDINGS[arch]
        params = model.get_submodule(offloaded).parameters()
        assert {p.device.type for p in params} == {"meta"}

    art, logits, generated, _ = _steer_and_generate(model, reference)

    for name in ("probe", "steer", "thresholds", "singular_values"):
        got, expected = getattr(art, name).double(), getattr(plain_art, name).double()
        if placement == "gpu-split":  # a GPU's float32 kernels sum in another order
            assert (got - expected).norm() <= 1e-4 * expected.norm(), name
        else:
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), name
    tol = 1e-4 if placement == "gpu-split" else 1e-5
    logits = logits.cpu()
    assert torch.allclose(logits, plain_logits, rtol=tol, atol=tol)
    assert torch.equal(generated.cpu(), plain_gen)
    assert not torch.allclose(plain_logits, unsteered), "the steer should change the logits"
