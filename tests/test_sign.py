"""The steer must *raise* the loss of truly memorized tokens (METHOD-NOTES 2.1 and 5).

The loss of all omega > 0 tokens is no sign test (any damage raises it), so this uses a model
trained here to memorize planted rows and measures the loss on those rows' tokens, at a
small strength where the first-order effect dominates. (When the memorized tokens are fully
saturated, p ~ 1, their gradient nearly vanishes and at layer 0 the summed-backward
approximation no longer gives the right sign: see docs/method.md.)
"""

import dataclasses

import pytest
import torch

import gss


def _planted_loss(model, planted, skip=3):
    with torch.no_grad():
        logits = model(input_ids=planted).logits[:, skip - 1 : -1]
        return float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), planted[:, skip:].reshape(-1)
            )
        )


def steered_losses(model, reference, planted, general, layer, gate):
    """The planted rows' loss steered, unsteered and with the steer's sign flipped, for a steer
    calibrated on them and 40 general rows at a small strength."""
    art = gss.calibrate(
        model,
        reference,
        torch.cat([planted, general[:40]]),
        layer=layer,
        rank=2,
        delta=1e-3,
        threshold_percentile=50.0,
        gate=gate,
        progress=False,
    )
    base = _planted_loss(model, planted)
    with gss.steer(model, art):
        steered = _planted_loss(model, planted)
    with gss.steer(model, dataclasses.replace(art, steer=-art.steer)):
        opposite = _planted_loss(model, planted)
    return steered, base, opposite


@pytest.mark.parametrize(("layer", "gate"), [(1, "none"), (1, "hard"), (0, "none")])
def test_steering_raises_memorized_loss_and_the_opposite_sign_lowers_it(memorizer, layer, gate):
    model, ref, planted, general = memorizer
    steered, base, opposite = steered_losses(model, ref, planted, general, layer, gate)
    assert steered > base > opposite, (steered, base, opposite)


def test_the_tiny_model_really_memorized(memorizer):
    model, ref, planted, _ = memorizer
    assert _planted_loss(model, planted) < 0.1 < _planted_loss(ref, planted)
