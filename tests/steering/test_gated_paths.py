"""Every way a steer runs computes the same output, bit for bit.

A steer's first call on a block takes the checked path, later calls the fused fast path (when
the steer has one), ``track_gates=True`` the checked path with the gates counted beside it,
and ``gss.steer`` whatever ``attach`` runs. Evaluate, sweep and generate use those, so the
numbers they report are the numbers of the path a user runs. Checked over every gate and
coefficient, with thresholds that make the fused form (positive and finite), that leave it
(zero, infinite) and extreme ones (1e-30: folded tensors of ~1e30; 1e30: a gate that
never opens), in float32 and bfloat16.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch
from torch import Tensor

import gss
from gss.steering.gated import GatedSteer

from ..helpers import random_ids, tiny_model

LAYER = 1
GATES = ("hard", "relu", "none")
COEFFICIENTS = ("projection", "ridge", "paper-constant")
# negative thresholds are refused by the artifact (test_negative_thresholds_are_refused)
THRESHOLDS = ("calibrated", "zero", "infinite", "1e-30", "1e30")
DTYPES = (torch.float32, torch.bfloat16)
DEVICES = ("cpu", *(["cuda"] if torch.cuda.is_available() else []))
IDS = random_ids(3, 9, seed=4)


@pytest.fixture(scope="module")
def calibrated():
    model = tiny_model("llama", seed=3, layers=2)
    ref = tiny_model("llama", seed=11, layers=2)
    art = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=LAYER, rank=2, progress=False)
    return model, art


def _thresholds(art, kind: str) -> Tensor:
    eps = art.thresholds.clone()
    assert bool((eps > 0).all()) and bool(torch.isfinite(eps).all())
    if kind == "zero":
        return torch.zeros_like(eps)
    if kind == "infinite":
        return torch.full_like(eps, float("inf"))
    if kind in ("1e-30", "1e30"):
        return torch.full_like(eps, float(kind))
    return eps


def _block_outputs(model, art, options):
    """The steered block's output on every path, and the untracked steer and gate counts."""
    block = gss.find_decoder_blocks(model)[LAYER]
    ids = IDS.to(next(model.parameters()).device)
    seen: dict[str, Tensor] = {}
    name = ["plain"]

    def record(module, args, output):
        seen[name[0]] = (output if isinstance(output, Tensor) else output[0]).detach().clone()

    recorder = block.register_forward_hook(record)
    try:
        with torch.no_grad():
            model(ids)
            with art.attach(model, **options) as handle:
                name[0] = "first call"
                model(ids)
                steer = handle.hook
                built_fast = steer._fast is not None
                name[0] = "later call"
                model(ids)
            with art.attach(model, track_gates=True, **options) as tracked:
                name[0] = "track_gates"
                model(ids)
                stats = tracked.gate_stats()
            with gss.steer(model, art, **options):
                name[0] = "gss.steer"
                model(ids)
    finally:
        recorder.remove()
    return seen, steer, built_fast, stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("thresholds", THRESHOLDS)
def test_every_path_gives_the_same_bits(calibrated, thresholds, dtype, device):
    base, art = calibrated
    art = dataclasses.replace(art, thresholds=_thresholds(art, thresholds))
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    for gate, coefficient in itertools.product(GATES, COEFFICIENTS):
        case = f"gate={gate}, coefficient={coefficient}"
        options = {"gate": gate, "coefficient": coefficient}
        seen, steer, built_fast, stats = _block_outputs(model, art, options)
        plain, first = seen.pop("plain"), seen["first call"]
        assert first.dtype == dtype
        for path, out in seen.items():
            assert torch.equal(out, first), f"{case}: {path} differs from the first call"
        # the fast path exists exactly for the fused form, and only the paper's case is fused
        fused_case = coefficient == "projection" and (
            gate == "none" or (gate == "hard" and thresholds in ("calibrated", "1e-30", "1e30"))
        )
        assert steer._fused == fused_case == built_fast, case
        never_opens = gate != "none" and thresholds in ("infinite", "1e30")
        if never_opens:
            assert torch.equal(first, plain), f"{case}: a closed gate changed the output"
            assert stats["any_open_share"] == 0.0, case
        elif gate == "none":
            assert stats["any_open_share"] == 1.0, case
            if coefficient != "ridge":  # ridge may skip a direction that is nearly orthogonal
                assert not torch.equal(first, plain), f"{case}: an open steer changed nothing"


def test_negative_or_nan_thresholds_are_refused(calibrated):
    _, art = calibrated
    negative = torch.where(torch.arange(art.rank) == 0, -art.thresholds, art.thresholds)
    with pytest.raises(gss.GSSError, match="negative gate thresholds"):
        dataclasses.replace(art, thresholds=negative)
    with pytest.raises(gss.GSSError, match="thresholds holds NaN"):
        dataclasses.replace(art, thresholds=torch.full_like(art.thresholds, float("nan")))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_closed_tokens_stay_exact_on_every_path(calibrated, dtype):
    """With calibrated thresholds some tokens open a gate and some do not: the ones that do not
    come out bit-identical, whichever path steered them."""
    base, art = calibrated
    model = copy.deepcopy(base).to(dtype=dtype)
    for gate, coefficient in itertools.product(("hard", "relu"), COEFFICIENTS):
        options = {"gate": gate, "coefficient": coefficient}
        seen, steer, _, stats = _block_outputs(model, art, options)
        plain = seen.pop("plain")
        assert 0.0 < stats["any_open_share"] < 1.0, (gate, coefficient)
        steer.track_gates = True  # the gates the steer's own arithmetic opened
        _, is_open = steer.steer_hidden(plain)
        closed = ~is_open.any(-1)
        assert closed.any() and (~closed).any()
        for path, out in seen.items():
            assert torch.equal(out[closed], plain[closed]), (gate, coefficient, path)


def test_the_relu_gate_gates_the_projection_steer():
    """Before, gate="relu" with the projection coefficient took the fused form, whose only gate
    is the hard one's hardshrink, and ran ungated: identical to gate="none"."""
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(2, 8, generator=gen)
    steer = torch.nn.functional.normalize(torch.randn(2, 8, generator=gen), dim=-1)
    hidden = torch.randn(4, 5, 8, generator=gen)
    eps = torch.tensor([0.5, 1.0])
    relu = GatedSteer(probe, steer, eps, gate="relu")
    ungated = GatedSteer(probe, steer, eps, gate="none")
    assert not relu._fused
    s = hidden @ probe.t()
    expected = hidden - ((s - eps).clamp_min(0) @ steer)  # ReLU(s_k - eps_k) v_k
    for _ in range(2):  # the first call and any later one
        out = relu(None, None, hidden)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert not torch.equal(out, ungated(None, None, hidden))
