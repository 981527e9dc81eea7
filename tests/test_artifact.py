import json

import pytest
import torch

import gss
from gss import GSSError

from .helpers import random_ids


@pytest.fixture
def calibrated(make_model):
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    art = gss.calibrate(model, ref, random_ids(12, 12), layer=1, rank=2, progress=False)
    return model, ref, art


def test_round_trip(tmp_path, calibrated):
    model, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["gss_config.json", "gss_tensors.safetensors"]
    loaded = gss.load(tmp_path / "a")
    for name in ("probe", "steer", "thresholds", "offset"):
        assert torch.equal(getattr(loaded, name), getattr(art, name))
    assert loaded.config == art.config and loaded.provenance == art.provenance
    ids = random_ids(2, 8, seed=9)
    with torch.no_grad():
        with gss.steer(model, art, gate="none"):
            a = model(input_ids=ids).logits
        with gss.steer(model, loaded, gate="none"):
            b = model(input_ids=ids).logits
    assert torch.equal(a, b)
    saved = json.loads((tmp_path / "a" / "gss_config.json").read_text())
    assert saved["format_version"] == 2
    assert saved["config"] == art.config.to_dict()  # every option, and nothing else
    for key in ("fingerprint", "hook_point", "threshold_rule", "token_counts", "timings"):
        assert key in saved["provenance"]
    assert saved["provenance"]["solve"] == {"method": "full", "power_iters": 0, "converged": True}


def test_format_1_still_loads(tmp_path, calibrated):
    """An artifact saved before the config and provenance were apart (format 1, one flat
    dict) loads with the same options and measurements."""
    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "gss_config.json"
    saved = json.loads(path.read_text())
    flat = {
        **saved["provenance"],
        **{
            k: saved["config"][k]
            for k in (
                "layer",
                "rank",
                "delta",
                "gate",
                "coefficient",
                "ridge_delta",
                "centering",
                "block_path",
                "target",
                "gradient",
            )
        },
    }
    flat["memorized_rule"] = {"kind": "omega_above", "omega_threshold": 0.0, "quantile": None}
    path.write_text(json.dumps({**flat, "format_version": 1}))
    old = gss.load(tmp_path / "a")
    assert old.config == art.config.replace(jitter=old.config.jitter)
    assert old.provenance.token_counts == art.provenance.token_counts
    assert old.provenance.jitter == art.provenance.jitter
    assert torch.equal(old.thresholds, art.thresholds)


def test_unknown_entries_are_refused_or_warned(tmp_path, calibrated):
    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "gss_config.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps({**saved, "config": {**saved["config"], "strength": 3}}))
    with pytest.raises(GSSError, match=r"unknown calibration option.*strength"):
        gss.load(tmp_path / "a")
    path.write_text(json.dumps({**saved, "provenance": {**saved["provenance"], "note": 1}}))
    with pytest.warns(gss.GSSWarning, match=r"unknown artifact entries.*note"):
        gss.load(tmp_path / "a")


def test_refuses_another_model(calibrated, make_model):
    _, _, art = calibrated
    other_weights = make_model("llama", seed=5)
    with pytest.raises(GSSError, match="input embeddings differ"):
        art.attach(other_weights)
    with pytest.warns(gss.GSSWarning, match="another model"):
        art.attach(other_weights, strict=False).remove()
    with pytest.raises(GSSError, match="hidden_size: artifact 32, model 64"):
        art.attach(make_model("llama", hidden=64))
    with pytest.raises(GSSError, match="model_type"):
        art.attach(make_model("qwen2"))


def test_same_model_in_another_dtype_is_accepted(calibrated):
    model, _, art = calibrated
    art.attach(model.to(torch.bfloat16)).remove()
    model.float()


def test_delta_rescaling_equals_recalibration(make_model):
    model, ref = make_model("gpt2", seed=0), make_model("gpt2", seed=1)
    ids = random_ids(12, 12)
    a1 = gss.calibrate(model, ref, ids, layer=0, rank=2, delta=1.0, progress=False)
    a4 = gss.calibrate(model, ref, ids, layer=0, rank=2, delta=4.0, progress=False)
    scaled = a1.with_options(delta=4.0)
    assert torch.allclose(scaled.probe, a4.probe, atol=1e-5)
    assert torch.allclose(scaled.thresholds, a4.thresholds, atol=1e-4)
    assert scaled.config.delta == 4.0


def test_unknown_format_version_is_refused(tmp_path, calibrated):
    _, _, art = calibrated
    art.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "gss_config.json").read_text())
    cfg["format_version"] = 99
    (tmp_path / "gss_config.json").write_text(json.dumps(cfg))
    with pytest.raises(GSSError, match="format version 99"):
        gss.load(tmp_path)
    with pytest.raises(GSSError, match="not a gss artifact"):
        gss.load(tmp_path / "missing")


def test_repr_is_one_line_and_describe_tells_the_calibration(calibrated):
    _, _, art = calibrated
    line = repr(art)
    assert "\n" not in line and "tensor" not in line
    assert line.startswith("SteeringArtifact(model=LlamaForCausalLM, layer=1, rank=2, d=32")
    union = art.provenance.gate_open_share["union"]
    assert f"gates open on {100 * union:.1f}% of general tokens" in line
    text = art.describe()
    counts = art.provenance.token_counts
    assert f"{counts['memorized']} memorized ({100 * counts['memorized_share']:.1f}%)" in text
    assert "each direction's 95th percentile on general tokens" in text
    assert "solve: full;" in text  # d = 32: the full SVD


def test_fewer_directions_keep_their_gate_shares_but_not_the_union(calibrated):
    _, _, art = calibrated
    one = art.with_options(rank=1)
    shares = one.provenance.gate_open_share
    assert shares["per_direction"] == art.provenance.gate_open_share["per_direction"][:1]
    assert shares["union"] is None  # measured over both directions: not this steer's
    assert "gates open" not in repr(one) and "any open" not in one.describe()
    assert art.with_options(rank=2).provenance.gate_open_share == art.provenance.gate_open_share
