"""The typed config: one place for every calibration option, its default and its check."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import gss
from gss.config import PRESETS, RUN_OPTION_NAMES, CalibrationConfig, RunOptions, resolve
from gss.errors import GSSError

from .helpers import random_ids


def test_calibrate_takes_a_config_and_few_parameters():
    params = inspect.signature(gss.calibrate).parameters
    assert len(params) <= 8
    assert list(params)[:4] == ["model", "reference", "texts", "config"]
    assert params["config"].default == "gss-tr"  # the preset that measured best


def test_every_field_has_a_help_string_and_a_valid_default():
    for f in dataclasses.fields(CalibrationConfig):
        assert f.metadata["help"], f.name
    for f in dataclasses.fields(RunOptions):
        assert f.metadata["help"], f.name
    CalibrationConfig()  # the defaults pass their own checks


def test_presets_differ_from_the_paper_only_where_they_say():
    assert PRESETS["gss"] == CalibrationConfig()
    changed = {
        f.name
        for f in dataclasses.fields(CalibrationConfig)
        if getattr(PRESETS["gss-tr"], f.name) != getattr(PRESETS["gss"], f.name)
    }
    assert changed == {"target"}
    assert gss.preset("gss-tr", rank=8).rank == 8
    with pytest.raises(GSSError, match="unknown preset"):
        gss.preset("GSS-TR")


def test_resolve_splits_config_from_run_options_and_checks_first():
    config, run = resolve("gss-tr", {"rank": 2, "batch_size": 3, "progress": False})
    assert config == PRESETS["gss-tr"].replace(rank=2)
    assert run == RunOptions(batch_size=3, progress=False)
    assert not set(RUN_OPTION_NAMES) & {f.name for f in dataclasses.fields(CalibrationConfig)}
    with pytest.raises(GSSError, match="config must be a CalibrationConfig or a preset"):
        resolve(42, {})  # type: ignore[arg-type]
    with pytest.raises(GSSError, match=r"unknown calibration option\(s\) \['rnak'\]"):
        resolve(None, {"rnak": 2})
    # as the command line refuses the flags: given together, one would be silently ignored
    with pytest.raises(GSSError, match="memorized_quantile replaces omega_threshold's rule"):
        resolve(None, {"omega_threshold": 5.0, "memorized_quantile": 0.9})
    with pytest.raises(GSSError, match="gate_share replaces threshold_percentile's rule"):
        resolve(None, {"threshold_percentile": 50.0, "gate_share": 0.05})
    with pytest.raises(GSSError, match="ridge_delta sets the ridge coefficient's regulariser"):
        resolve(None, {"ridge_delta": 2.0})
    assert resolve(None, {"ridge_delta": 2.0, "coefficient": "ridge"})[0].ridge_delta == 2.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gate": "soft"}, "gate must be one of"),
        ({"target": "reference"}, "target must be one of"),
        ({"solve_method": "svd"}, "solve_method must be one of"),
        ({"rank": True}, "rank must be an integer"),
        ({"delta": float("nan")}, "delta must be a finite number"),
        ({"jitter": -1.0}, "jitter must be >= 0"),
        ({"max_length": 1}, "max_length must be an integer >= 2"),
        ({"max_threshold_samples": 0}, "max_threshold_samples must be an integer >= 1"),
        ({"replies_only": "yes"}, "replies_only must be True or False"),
        ({"block_path": 3}, "block_path must be a dotted path"),
        ({"layer": 1.0}, "layer must be an integer"),
    ],
)
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(GSSError, match=message):
        CalibrationConfig(**changes)


def test_config_round_trips_and_refuses_unknown_keys():
    config = gss.preset("gss-tr", layer=-1, rank=3, gate_share=0.05)
    assert CalibrationConfig.from_dict(config.to_dict()) == config
    with pytest.raises(GSSError, match="unknown calibration option"):
        CalibrationConfig.from_dict({**config.to_dict(), "extra": 1})


def test_the_artifact_saves_the_config_not_the_run_options(make_model, tmp_path):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    art = gss.calibrate(
        model, ref, random_ids(8, 10), "gss-tr", layer=-1, rank=2, batch_size=3, progress=False
    )
    assert art.config == PRESETS["gss-tr"].replace(layer=1, rank=2)  # the layer resolved
    art.save_pretrained(tmp_path / "a")
    text = (tmp_path / "a" / "gss_config.json").read_text()
    assert "batch_size" not in text and "progress" not in text
    assert gss.load(tmp_path / "a").config == art.config


def test_build_artifact_refuses_options_the_pass_fixed(make_model):
    from gss.calibrate import build_artifact
    from gss.statistics.collect import collect_statistics

    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    stats = collect_statistics(model, ref, random_ids(8, 10), layer=1, progress=False)
    same = build_artifact(model, stats, rank=2, layer=-1, progress=False)  # the same block
    assert same.config.layer == 1 and same.config.rank == 2
    with pytest.raises(GSSError, match="collected with other target"):
        build_artifact(model, stats, "gss", progress=False)
    with pytest.raises(GSSError, match="collected with other layer"):
        build_artifact(model, stats, layer=0, progress=False)


def test_a_bad_option_fails_before_any_pass(make_model):
    """The config is checked before the models run: a wrong model would fail later."""
    with pytest.raises(GSSError, match="delta must be"):
        gss.calibrate(object(), object(), [], layer=0, delta=-1.0)  # type: ignore[arg-type]
