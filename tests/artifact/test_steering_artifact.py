import dataclasses
import json

import pytest
import torch

import gss
from gss import GSSError
from gss.artifact.files import sha256_of
from gss.statistics import soundness

from ..helpers import random_ids, sealed


@pytest.fixture
def calibrated(make_model):
    model, ref = make_model("llama", seed=0), make_model("llama", seed=1)
    art = gss.calibrate(model, ref, random_ids(12, 12), layer=1, rank=2, progress=False)
    return model, ref, art


def test_round_trip(tmp_path, calibrated):
    model, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["README.md", "gss_config.json", "gss_tensors.safetensors"]  # + the card
    loaded = gss.load(tmp_path / "a")
    for name in ("probe", "steer", "thresholds", "offset"):
        assert torch.equal(getattr(loaded, name), getattr(art, name))
    assert loaded.config == art.config and loaded.provenance == art.provenance
    assert loaded == art and [art].index(loaded) == 0 and hash(loaded) != hash(art)
    assert loaded != art.with_options(delta=2.0) and art != art.with_options(rank=1)
    assert gss.SteeringStack((loaded,)) == gss.SteeringStack((art,))
    ids = random_ids(2, 8, seed=9)
    with torch.no_grad():
        with gss.steer(model, art, gate="none"):
            a = model(input_ids=ids).logits
        with gss.steer(model, loaded, gate="none"):
            b = model(input_ids=ids).logits
    assert torch.equal(a, b)
    saved = json.loads((tmp_path / "a" / "gss_config.json").read_text())
    assert saved["format_version"] == 3
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
    with pytest.warns(gss.GSSWarning, match="format 1, whose config no checksum covers"):
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
    path.write_text(json.dumps(sealed({**saved, "config": {**saved["config"], "strength": 3}})))
    with pytest.raises(GSSError, match=r"unknown calibration option.*strength"):
        gss.load(tmp_path / "a")
    path.write_text(json.dumps(sealed({**saved, "provenance": {**saved["provenance"], "note": 1}})))
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


def test_a_delta_whose_probes_overflow_is_refused_by_name(calibrated):
    _, _, art = calibrated
    with pytest.raises(GSSError, match=r"delta must be at most 1e\+12, got 1e\+308"):
        art.with_options(delta=1e308)


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


def test_fewer_directions_carry_their_own_soundness_evidence(calibrated):
    """`gss show` on a steer cut to fewer directions (protect's choice of rank) tells the kept
    directions' spectrum and problems, not those of all the calibration solved for."""
    _, _, art = calibrated
    few = {**art.provenance.soundness, "memorized_tokens": 5}  # < 4 a direction at rank 2
    two = dataclasses.replace(art, provenance=dataclasses.replace(art.provenance, soundness=few))
    assert any("for 2 directions" in w for w in soundness.problems(few, 2))
    one = two.with_options(rank=1).provenance.soundness
    assert one["spectrum_ratio"] == 1.0 and one["memorized_tokens"] == 5
    assert not any("directions" in w for w in one["warnings"])
    assert one["warnings"] == soundness.problems(one, 1)


def test_saving_never_replaces_or_writes_into_what_it_should_not(tmp_path, calibrated):
    _, _, art = calibrated
    first = art.with_options(delta=4.0)
    first.save_pretrained(tmp_path / "a")
    with pytest.raises(GSSError, match="already holds a gss artifact: pass overwrite=True"):
        art.save_pretrained(tmp_path / "a")
    assert gss.load(tmp_path / "a").config.delta == 4.0  # untouched
    art.save_pretrained(tmp_path / "a", overwrite=True)
    assert gss.load(tmp_path / "a").config.delta == art.config.delta
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    for overwrite in (False, True):  # a model's own folder: never, even with overwrite
        with pytest.raises(GSSError, match=r"holds files that are not a gss artifact's"):
            art.save_pretrained(model_dir, overwrite=overwrite)
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(GSSError, match="is a file, not a directory"):
        art.save_pretrained(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    art.save_pretrained(tmp_path / "empty")  # an empty directory is fine
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_an_interrupted_save_leaves_the_old_artifact(tmp_path, calibrated, monkeypatch):
    from gss.artifact import steering_artifact

    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        steering_artifact.json, "dumps", crash
    )  # after the tensors, before the config
    with pytest.raises(KeyboardInterrupt):
        art.with_options(delta=9.0).save_pretrained(tmp_path / "a", overwrite=True)
    monkeypatch.undo()
    assert gss.load(tmp_path / "a").config.delta == art.config.delta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_the_two_files_must_come_from_one_save(tmp_path, calibrated):
    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    art.with_options(delta=9.0).save_pretrained(tmp_path / "b")
    (tmp_path / "a" / "gss_tensors.safetensors").write_bytes(
        (tmp_path / "b" / "gss_tensors.safetensors").read_bytes()
    )
    with pytest.raises(GSSError, match=r"not the file gss_config\.json was saved with"):
        gss.load(tmp_path / "a")
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "b").iterdir()}
    assert len(set(modes.values())) == 1, modes  # both files written alike


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "gss_config.json").write_text("{not json"), "is not valid JSON"),
        (lambda d: (d / "gss_config.json").write_text("[1, 2]"), "does not hold a JSON object"),
        (lambda d: (d / "gss_config.json").write_bytes(b"\xff\xfe"), "is not valid JSON"),
        (lambda d: (d / "gss_tensors.safetensors").unlink(), "is not a gss artifact directory"),
    ],
)
def test_a_damaged_artifact_is_refused_in_one_line(tmp_path, calibrated, damage, message):
    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    damage(tmp_path / "a")
    with pytest.raises(GSSError, match=message):
        gss.load(tmp_path / "a")


def test_damaged_tensors_are_refused(tmp_path, calibrated):
    from safetensors.torch import save_file

    _, _, art = calibrated
    cases = {
        "NaN": {"probe": torch.full_like(art.probe, float("nan"))},
        "shape": {"thresholds": torch.ones(art.rank + 1)},
        "unit vectors": {"steer": art.steer * 2},
        "lacks the tensors": {"offset": None},
    }
    messages = {
        "NaN": "probe holds NaN or infinite",
        "shape": "thresholds has shape",
        "unit vectors": "must be unit vectors",
        "lacks the tensors": r"lacks the tensors \['offset'\]",
    }
    for name, change in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        art.save_pretrained(folder)
        path = folder / "gss_tensors.safetensors"
        tensors = {
            key: getattr(art, key).float()
            for key in ("probe", "steer", "thresholds", "offset", "singular_values")
        }
        tensors.update(change)
        save_file({k: v for k, v in tensors.items() if v is not None}, str(path))
        config = json.loads((folder / "gss_config.json").read_text())
        config["tensors_sha256"] = sha256_of(path)  # only the values are wrong
        (folder / "gss_config.json").write_text(json.dumps(sealed(config)))
        with pytest.raises(GSSError, match=messages[name]):
            gss.load(folder)


def test_nesting_the_same_artifact_warns(calibrated):
    model, _, art = calibrated
    with gss.steer(model, art):
        with pytest.warns(gss.GSSWarning, match="already steers this block"), gss.steer(model, art):
            pass
        other = art.with_options(delta=2.0)  # another steer on the same block: no warning
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", gss.GSSWarning)
            other.attach(model).remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", gss.GSSWarning)
        art.attach(model).remove()  # removed before: attaching again is fine


def test_a_fine_tune_of_the_same_base_is_refused(calibrated):
    """Another fine-tune of the same base has the base's embeddings, which the embedding check
    alone let through: the sample of every block's weights tells it apart, in any dtype."""
    import copy

    model, _, art = calibrated
    other = copy.deepcopy(model)
    block = gss.find_decoder_blocks(other)[1]
    with torch.no_grad():
        for weight in block.parameters():
            weight.add_(0.05 * torch.randn_like(weight))  # a fine-tune of the top block
    with pytest.raises(GSSError, match=r"weights of decoder block\(s\) \[1\] differ"):
        art.attach(other)
    for dtype in (torch.bfloat16, torch.float16):
        art.attach(copy.deepcopy(model).to(dtype)).remove()  # the same weights: accepted


def test_a_save_stopped_between_its_two_renames_puts_the_old_artifact_back(
    tmp_path, calibrated, monkeypatch
):
    from pathlib import Path

    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    rename, calls = Path.rename, []

    def stop_at_the_second(self, target):
        calls.append(target)
        if len(calls) == 2:  # the old one moved aside, the new one not yet in place
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        art.with_options(delta=9.0).save_pretrained(tmp_path / "a", overwrite=True)
    monkeypatch.undo()
    assert gss.load(tmp_path / "a").config.delta == art.config.delta
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_link_is_saved_through_and_a_link_to_nothing_is_refused(tmp_path, calibrated):
    _, _, art = calibrated
    art.save_pretrained(tmp_path / "a")
    (tmp_path / "link").symlink_to(tmp_path / "a")
    art.with_options(delta=9.0).save_pretrained(tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink() and gss.load(tmp_path / "a").config.delta == 9.0
    (tmp_path / "nowhere").symlink_to(tmp_path / "missing")
    with pytest.raises(GSSError, match=r"is a link to .*missing, which does not exist"):
        art.save_pretrained(tmp_path / "nowhere")
    with pytest.raises(GSSError, match="directory to save into is empty"):
        art.save_pretrained("")


def test_measurements_of_a_steer_do_not_travel_to_a_changed_copy(calibrated):
    """protect's and sweep's records measured the steer as it was: a copy with other options
    or thresholds (gss sweep --save) must not show them as its own, in its card above all."""
    import dataclasses

    _, _, art = calibrated
    measured = {"protect": {"after": {"memorized": 40.0}}, "sweep": {"memorized": 0.0}, "x": 1}
    art = dataclasses.replace(art, provenance=dataclasses.replace(art.provenance, extra=measured))
    assert art.with_options(delta=art.config.delta).provenance.extra == measured  # the same steer
    for changed in (
        art.with_options(delta=2.0),
        art.with_options(gate="relu"),
        art.with_thresholds(art.thresholds * 2, {"kind": "percentile", "percentile": 90}),
    ):
        assert changed.provenance.extra == {"x": 1}
