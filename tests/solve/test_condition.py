"""The discriminant gate (`gss.solve.condition`): its direction is Fisher's discriminant, its
threshold opens on the asked share of general tokens, it steers exactly what it says (every
direction by its own response where the condition passes, nothing elsewhere), and it survives
save, load and the options that change how an artifact is applied."""

from __future__ import annotations

import pytest
import torch

import gss
from gss import GSSError
from gss.solve.condition import condition_direction, condition_threshold
from gss.steering.gated import GatedSteer

from ..helpers import random_ids, tiny_model


def test_the_direction_is_fishers_discriminant():
    gen = torch.Generator().manual_seed(0)
    d = 6
    mix = torch.randn(d, d, generator=gen)
    sigma = mix @ mix.T + 0.1 * torch.eye(d)
    mu_gen, mu_mem = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    want = torch.linalg.solve(sigma.double(), (mu_mem - mu_gen).double())
    got = condition_direction(sigma, mu_mem, mu_gen)
    assert got.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.nn.functional.cosine_similarity(got.double(), want, dim=0) > 1 - 1e-6
    # it separates two Gaussian classes with that covariance better than the mean gap does
    chol = torch.linalg.cholesky(sigma)
    general = mu_gen + torch.randn(4000, d, generator=gen) @ chol.T
    memorized = mu_mem + torch.randn(4000, d, generator=gen) @ chol.T
    gap = (mu_mem - mu_gen) / (mu_mem - mu_gen).norm()

    def caught(w):  # memorized rows caught when the gate opens on 5% of general ones
        level, _ = condition_threshold(general @ w, None, 0.05)
        return float(((memorized @ w) > level).double().mean())

    assert caught(got) > caught(gap)
    with pytest.raises(GSSError, match="same mean"):
        condition_direction(sigma, mu_gen, mu_gen)


def test_the_threshold_opens_on_the_asked_share():
    responses = torch.arange(1000, dtype=torch.float32)
    level, shares = condition_threshold(responses, 95.0, None)
    assert shares["condition"] == pytest.approx(0.05, abs=0.002)
    level2, shares2 = condition_threshold(responses, 95.0, 0.2)  # the share wins
    assert level2 < level and shares2["union"] == pytest.approx(0.2, abs=0.002)


def test_the_steer_moves_every_direction_where_the_condition_passes():
    gen = torch.Generator().manual_seed(1)
    k, d = 3, 8
    probe = torch.randn(k, d, generator=gen)
    steer = torch.nn.functional.normalize(torch.randn(k, d, generator=gen), dim=-1)
    w = torch.nn.functional.normalize(torch.randn(d, generator=gen), dim=0)
    hook = GatedSteer(
        probe,
        steer,
        torch.full((k,), 1e9),  # the per-direction thresholds play no part
        gate="discriminant",
        condition=w,
        condition_threshold=0.3,
    )
    h = torch.randn(64, d, generator=gen)
    out, is_open = hook.steer_hidden(h)
    passed = (h @ w) > 0.3
    assert 0 < int(passed.sum()) < 64
    assert torch.equal(is_open, passed[:, None].expand(-1, k))
    assert torch.equal(out[~passed], h[~passed])  # closed: bit for bit
    want = h - (h @ probe.T) @ steer
    assert torch.allclose(out[passed], want[passed], atol=1e-5)
    with pytest.raises(GSSError, match="condition direction"):
        GatedSteer(probe, steer, torch.ones(k), gate="discriminant")
    with pytest.raises(GSSError, match="condition direction"):
        GatedSteer(probe, steer, torch.ones(k), condition=w, condition_threshold=0.0)


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_model("llama", seed=3)
    ref = tiny_model("llama", seed=11)
    rows = random_ids(16, 14, seed=2)
    art = gss.calibrate(model, ref, rows, layer=1, rank=2, gate="discriminant", progress=False)
    return model, art


def test_calibration_sets_the_condition_on_general_tokens(calibrated):
    model, art = calibrated
    assert art.condition is not None and art.condition.shape == (art.probe.shape[1],)
    shares = art.provenance.gate_open_share
    assert shares["condition"] == pytest.approx(0.05, abs=0.03)  # the 95th percentile
    assert art.provenance.threshold_rule["condition"] == art.condition_threshold
    hard = art.with_options(gate="hard")  # the hard gate's thresholds are there too
    assert bool((hard.thresholds > 0).all())
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with art.attach(model, track_gates=True) as handle:
            steered = model(input_ids=ids).logits
            assert 0 < handle.gate_stats()["any_open_share"] < 1
    assert not torch.equal(plain, steered)
    with pytest.raises(GSSError, match="none: calibrate with gate='discriminant'"):
        gss.calibrate(
            model,
            tiny_model("llama", seed=11),
            random_ids(16, 14, seed=2),
            layer=1,
            rank=2,
            progress=False,
        ).with_options(gate="discriminant")


def test_the_condition_survives_save_load_and_options(calibrated, tmp_path):
    model, art = calibrated
    art.save_pretrained(tmp_path / "a")
    loaded = gss.load(tmp_path / "a")
    assert torch.equal(loaded.condition, art.condition)
    assert loaded.condition_threshold == art.condition_threshold
    ids = random_ids(2, 9, seed=5)
    for a, b in ((art, loaded), (art.with_options(delta=4.0), loaded.with_options(delta=4.0))):
        with torch.no_grad(), a.attach(model):
            want = model(input_ids=ids).logits
        with torch.no_grad(), b.attach(model):
            assert torch.equal(model(input_ids=ids).logits, want)
    moved = art.with_thresholds(art.thresholds, {"kind": "test"}, condition_threshold=1e6)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with moved.attach(model):  # a level no token passes: nothing changes
            assert torch.equal(model(input_ids=ids).logits, plain)
