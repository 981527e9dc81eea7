"""scan_layers: every block's signal strength from one pass equals a calibration at that block."""

import pytest

from gss.calibrate import collect_statistics
from gss.errors import GSSError
from gss.layer_scan import scan_layers, signal_strength

from .conftest import random_ids, tiny_model


def _alone(model, ref, ids, layer, **options):
    stats = collect_statistics(
        model, ref, ids, layer=layer, batch_size=5, progress=False, **options
    )
    return signal_strength(stats.memorization.value, stats.sigma.covariance)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
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
