"""Exact per-position gradients, and the toward-reference target."""

import pytest
import torch

import gss
from gss.hf.blocks import resolve_layer
from gss.statistics.capture import tapped
from gss.statistics.collect import collect_statistics, objective
from gss.statistics.gradients import per_position_gradients

from ..helpers import random_ids


def _naive(model, block, ids, row, pos, cotangent=None):
    """One forward and one backward for one position, from that position's objective only."""
    with torch.enable_grad(), tapped(block, stop=False, leaf=True) as tap:
        logits = model(input_ids=ids[row : row + 1]).logits
    logp = torch.log_softmax(logits[0, pos], -1)
    value = logp[ids[row, pos + 1]] if cotangent is None else (logits[0, pos] * cotangent).sum()
    (grad,) = torch.autograd.grad(value, tap.hidden)
    return tap.hidden[0, pos].detach(), grad[0, pos]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_per_position_equals_one_backward_per_position(make_model, arch):
    model = make_model(arch, layers=3)
    for p in model.parameters():
        p.requires_grad_(False)
    _, block = resolve_layer(model, 0)
    ids = random_ids(3, 10)
    mask = torch.ones_like(ids)
    rows = torch.tensor([0, 0, 1, 2, 2])
    positions = torch.tensor([2, 7, 0, 4, 8])
    h, g = per_position_gradients(model, block, ids, mask, rows, positions, chunk=2)
    for i in range(5):
        h_ref, g_ref = _naive(model, block, ids, int(rows[i]), int(positions[i]))
        assert torch.allclose(h[i], h_ref, atol=1e-6)
        assert torch.allclose(g[i], g_ref, atol=1e-6)


def test_summed_is_exact_at_the_last_block(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    ids = random_ids(8, 12)
    kw = dict(layer=-1, batch_size=4, progress=False)
    summed = collect_statistics(model, ref, ids, gradient="summed", **kw)
    exact = collect_statistics(model, ref, ids, gradient="per-position", **kw)
    assert torch.allclose(summed.memorization.value, exact.memorization.value, atol=1e-9)
    early = [
        collect_statistics(
            model, ref, ids, layer=0, gradient=g, batch_size=4, progress=False
        ).memorization.value
        for g in ("summed", "per-position")
    ]
    assert not torch.allclose(*early, atol=1e-6)  # below the last block they differ


def test_toward_reference_gradient_is_onehot_minus_reference_at_the_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen, requires_grad=True)
    ref_logits = torch.randn(2, 5, 7, generator=gen)
    ids = torch.randint(0, 7, (2, 5), generator=gen)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    mem = torch.ones(2, 4, dtype=torch.bool)
    (grad,) = torch.autograd.grad(
        objective("toward-reference", logits, lp, ref_logits, mem), logits
    )
    expected = torch.nn.functional.one_hot(ids[:, 1:], 7) - torch.softmax(ref_logits[:, :-1], -1)
    assert torch.allclose(grad[:, :-1], expected, atol=1e-6)


def test_toward_reference_per_position_is_the_pullback_of_onehot_minus_reference(make_model):
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    for p in model.parameters():
        p.requires_grad_(False)
    _, block = resolve_layer(model, 0)
    ids = random_ids(2, 9)
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    rows, positions = torch.tensor([0, 1]), torch.tensor([3, 6])
    _, g = per_position_gradients(
        model,
        block,
        ids,
        torch.ones_like(ids),
        rows,
        positions,
        target="toward-reference",
        ref_logits=ref_logits,
    )
    for i in range(2):
        r, p = int(rows[i]), int(positions[i])
        cot = torch.nn.functional.one_hot(ids[r, p + 1], 48) - torch.softmax(ref_logits[r, p], -1)
        _, g_ref = _naive(model, block, ids, r, p, cotangent=cot)
        assert torch.allclose(g[i], g_ref, atol=1e-5)


def test_calibrate_records_gradient_and_target(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    art = gss.calibrate(
        model,
        ref,
        random_ids(8, 10),
        layer=0,
        rank=2,
        gradient="per-position",
        target="toward-reference",
        memorized_quantile=0.2,
        progress=False,
    )
    assert art.config.gradient == "per-position" and art.config.target == "toward-reference"


def test_presets(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    ids = random_ids(8, 10)
    ours = gss.calibrate(model, ref, ids, "gss-tr", layer=0, rank=2, progress=False)
    default = gss.calibrate(model, ref, ids, layer=0, rank=2, progress=False)
    assert torch.equal(ours.probe, default.probe)  # "gss-tr" is calibrate()'s default
    assert ours.config == default.config == gss.preset("gss-tr", layer=0, rank=2)
    paper = gss.calibrate(model, ref, ids, "gss", layer=0, rank=2, progress=False)
    assert paper.config == gss.CalibrationConfig(layer=0, rank=2)  # the paper's, by name
    config = gss.preset("gss-tr", omega_threshold=0.2)
    art = gss.calibrate(model, ref, ids, config, layer=0, rank=2, progress=False)
    by_name = gss.calibrate(
        model, ref, ids, "gss-tr", layer=0, rank=2, omega_threshold=0.2, progress=False
    )
    assert torch.equal(art.probe, by_name.probe) and art.config == by_name.config
    assert (art.config.gate, art.config.target, art.config.gradient) == (
        "hard",
        "toward-reference",
        "summed",
    )
    with pytest.raises(gss.GSSError, match="unknown preset 'magic'"):
        gss.preset("magic")
