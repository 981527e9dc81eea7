"""scan_layers: every block's signal strength from one pass equals a calibration at that block."""

import copy
import warnings

import pytest
import torch

from gss.errors import GSSError, GSSWarning
from gss.layer_scan import scan_layers, signal_strength
from gss.statistics.collect import collect_statistics

from .helpers import random_ids, tiny_model


def _alone(model, ref, ids, layer, **options):
    stats = collect_statistics(
        model, ref, ids, layer=layer, batch_size=5, progress=False, **options
    )
    return signal_strength(stats.memorization.value, stats.sigma.covariance)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "opt"])
@pytest.mark.parametrize("target", ["loglik", "toward-reference"])
def test_one_pass_equals_a_calibration_per_block(arch, target):
    model, ref = tiny_model(arch, seed=0, layers=3), tiny_model(arch, seed=1, layers=3)
    ids, gen = random_ids(12, 10), random_ids(8, 10, seed=3)
    for gen_texts in (None, gen):
        scan = scan_layers(
            model, ref, ids, target=target, gen_texts=gen_texts, batch_size=5, progress=False
        )
        assert sorted(scan.strengths) == [0, 1, 2]
        for layer, value in scan.strengths.items():
            want = _alone(model, ref, ids, layer, target=target, gen_texts=gen_texts)
            assert value == pytest.approx(want, rel=1e-4)
        assert scan.best == max(scan.strengths, key=scan.strengths.get)
    assert all(p.requires_grad for p in model.parameters())  # weights left as they were


def test_chosen_blocks_and_bad_ones(tmp_path):
    model, ref = tiny_model("gpt2", seed=0, layers=3), tiny_model("gpt2", seed=1, layers=3)
    ids = random_ids(6, 10)
    scan = scan_layers(model, ref, ids, layers=[-1, 0], progress=False)
    assert sorted(scan.strengths) == [0, 2]
    assert scan.plot(tmp_path / "layers.png").stat().st_size > 1000
    with pytest.raises(GSSError, match="out of range"):
        scan_layers(model, ref, ids, layers=[5], progress=False)
    with pytest.raises(GSSError, match="memorized-token set is empty"):
        scan_layers(model, ref, ids, omega_threshold=1e9, progress=False)


def test_blocks_the_fine_tune_did_not_reach_are_not_picked(tmp_path):
    ref = tiny_model("llama", seed=1, layers=4)
    model = copy.deepcopy(ref)
    with torch.no_grad():  # a "fine-tune" of the top two blocks only
        for p in model.model.layers[2:].parameters():
            p.add_(0.05 * torch.randn_like(p))
    scan = scan_layers(model, ref, random_ids(8, 10), progress=False)
    assert scan.unchanged == [0, 1]
    assert scan.difference[0] == 0.0 and scan.difference[2] > 1e-3
    assert scan.best == max((2, 3), key=scan.strengths.get)
    assert scan.to_dict()["unchanged"] == [0, 1]
    assert scan.plot(tmp_path / "layers.png").stat().st_size > 1000
    other = tiny_model("llama", seed=1, layers=3)  # not a fine-tune of the model: no comparison
    assert scan_layers(model, other, random_ids(8, 10), progress=False).difference == {}


def test_too_few_general_tokens_for_sigma_gen_are_said():
    """As calibrate says it: with fewer general tokens than dimensions the strengths are set by
    Sigma_gen's regularisation, not the data."""
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = random_ids(12, 10)
    with pytest.warns(GSSWarning, match=r"Sigma_gen rests on 6 general tokens for 32 dimensions"):
        scan_layers(model, ref, ids, gen_texts=random_ids(2, 4, seed=3), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GSSWarning)  # enough of them: nothing said
        scan_layers(model, ref, ids, gen_texts=random_ids(8, 10, seed=3), progress=False)
