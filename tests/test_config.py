"""The typed config: one place for every calibration option, its default and its check."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import gss
from gss import config as config_module
from gss.config import (
    EVALUATION_BATCH_SIZE,
    METRIC_BATCH_SIZE,
    PRESETS,
    RUN_OPTION_NAMES,
    CalibrationConfig,
    RunOptions,
    resolve,
    run_options,
)
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
        ({"max_length": 10**20}, "max_length must be at most 2147483647 tokens"),
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


# ---- RunOptions, taken by every entry point (issue 71) ----------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gss"


def _literal_int(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
    )


def _literal_batch_sizes(tree: ast.AST) -> list[int]:
    """Lines of ``tree`` where a batch size's default is an integer literal: a parameter named
    ``batch_size``, a class's ``batch_size`` field (``= 8`` or ``field(default=8)``), a
    ``--batch-size`` flag's ``default=``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs = list(
                zip(positional[len(positional) - len(a.defaults) :], a.defaults, strict=True)
            )
            pairs += [
                (arg, d)
                for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
                if d is not None
            ]
            found += [d.lineno for arg, d in pairs if arg.arg == "batch_size" and _literal_int(d)]
        elif isinstance(node, ast.ClassDef) and node.name != "RunOptions":  # the one home
            for item in node.body:
                if not (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and item.target.id == "batch_size"
                ):
                    continue
                value = item.value
                if isinstance(value, ast.Call):
                    value = next((k.value for k in value.keywords if k.arg == "default"), None)
                if _literal_int(value):
                    found.append(item.lineno)
        elif isinstance(node, ast.Call) and any(
            isinstance(x, ast.Constant) and x.value == "--batch-size" for x in node.args
        ):
            found += [
                k.value.lineno
                for k in node.keywords
                if k.arg == "default" and _literal_int(k.value)
            ]
    return found


def test_no_batch_size_default_is_a_literal():
    """Each default batch size is written once, in gss.config (`RunOptions.batch_size`,
    `EVALUATION_BATCH_SIZE`, `METRIC_BATCH_SIZE`): a signature, a field or a flag names it."""
    literal = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _literal_batch_sizes(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert literal == [], "name a gss.config constant for these batch size defaults"
    # and the rule sees what it looks for
    assert _literal_batch_sizes(ast.parse("def f(*, batch_size: int = 8): ...")) == [1]
    assert _literal_batch_sizes(ast.parse("class C:\n    batch_size: int = 16")) == [2]
    flag = "p.add_argument('--batch-size', type=int, default=8)"
    assert _literal_batch_sizes(ast.parse(flag)) == [1]


def test_the_named_batch_sizes_are_the_defaults_the_functions_had():
    assert (RunOptions.batch_size, RunOptions.progress) == (8, True)
    assert (EVALUATION_BATCH_SIZE, METRIC_BATCH_SIZE) == (16, 64)


class _Stop(Exception):
    pass


class _Artifact:  # stands for a SteeringArtifact where only the run options are read
    pass


def _call(target: str, *args, **kwargs):
    module, name = target.rsplit(".", 1)

    def call():
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = target  # the test's id: the same in every process (pytest-xdist's workers)
    return call


# (the module that resolves the run options, the call, its defaults before issue 71)
ENTRY_POINTS = [
    ("gss.audit", _call("gss.audit.audit", None, None, []), (8, True)),
    ("gss.evaluate.suite", _call("gss.evaluate.evaluate_model", None, [], []), (16, True)),
    ("gss.evaluate.compare", _call("gss.evaluate.evaluate_steering", None, None, None), (16, True)),
    (
        "gss.evaluate.compare",
        _call("gss.evaluate.sweep_and_select", None, _Artifact(), None),
        (16, True),
    ),
    (
        "gss.evaluate.sweep",
        _call("gss.evaluate.steering_sweep", None, _Artifact(), [], []),
        (16, True),
    ),
    ("gss.evaluate.other_prompts", _call("gss.evaluate.other_prompts", None, []), (16, False)),
    (
        "gss.evaluate.other_prompts",
        _call("gss.evaluate.other_prompts.steered_other_prompts", None, None, []),
        (16, False),
    ),
    (
        "gss.evaluate.leaks",
        _call("gss.evaluate.secrets_said", None, None, [], [], max_new_tokens=4),
        (16, False),
    ),
    (
        "gss.evaluate.exposure",
        _call("gss.evaluate.exposure.exposure", None, None, [1], "x"),
        (64, False),
    ),
    ("gss.evaluate.inputs", _call("gss.evaluate.secrets_check", [], None), (16, True)),
    (
        "gss.evaluate.signal_report",
        _call("gss.evaluate.omega_of_texts", None, None, [], None),
        (8, True),
    ),
    ("gss.solve.thresholds", _call("gss.calibrate_thresholds", None, _Artifact(), []), (8, False)),
]


@pytest.mark.parametrize(
    ("where", "call", "default"), ENTRY_POINTS, ids=lambda x: getattr(x, "__name__", str(x))
)
def test_each_entry_point_runs_as_it_did_by_default(monkeypatch, where, call, default):
    """With neither ``run=`` nor a keyword, each entry point resolves the batch size and
    progress it always had (read where it resolves them, before any pass)."""
    seen: list[RunOptions] = []

    def spy(*args, **kwargs):
        seen.append(run_options(*args, **kwargs))
        raise _Stop

    monkeypatch.setattr(importlib.import_module(where), "run_options", spy)
    for module in ("gss.evaluate.sweep", "gss.solve.thresholds"):  # any artifact will do
        monkeypatch.setattr(importlib.import_module(module), "require_artifact", lambda *a: None)
    with pytest.raises(_Stop):
        call()
    assert (seen[0].batch_size, seen[0].progress) == default


@pytest.mark.parametrize(
    "function",
    [
        gss.calibrate,
        gss.scan_layers,
        gss.protect,
        gss.audit,
        gss.AuditReport.other_prompts,
        gss.calibrate_thresholds,
        gss.evaluate.evaluate_model,
        gss.evaluate.evaluate_steering,
        gss.evaluate.sweep_and_select,
        gss.evaluate.steering_sweep,
        gss.evaluate.other_prompts,
        gss.evaluate.secrets_said,
        gss.evaluate.secrets_check,
        gss.evaluate.omega_of_texts,
    ],
    ids=lambda f: f.__qualname__,
)
def test_every_entry_point_takes_run_options(function):
    params = inspect.signature(function).parameters
    assert params["run"].default is None
    if "batch_size" in params:  # else given as keywords in **overrides, as calibrate's
        assert params["batch_size"].default is None and params["progress"].default is None


def test_run_options_keywords_win_over_defaults_and_must_agree_with_run():
    assert run_options(None, batch_default=16) == RunOptions(batch_size=16)
    assert run_options(None, 3, False, batch_default=16) == RunOptions(3, False)
    run = RunOptions(batch_size=4, progress=False)
    assert run_options(run, batch_default=16) is run  # taken whole
    assert run_options(run, 4, False) is run  # the same values said twice
    with pytest.raises(GSSError, match=r"batch_size=8 contradicts run=RunOptions\(batch_size=4\)"):
        run_options(run, 8)
    with pytest.raises(GSSError, match="batch_size must be an integer >= 1"):
        run_options(run, 0)
    with pytest.raises(GSSError, match=r"run must be a gss\.RunOptions"):
        run_options({"batch_size": 4})  # type: ignore[arg-type]
    _, resolved = resolve(None, {"batch_size": 4}, run)
    assert resolved is run
    with pytest.raises(
        GSSError, match=r"progress=True contradicts run=RunOptions\(progress=False\)"
    ):
        resolve(None, {"progress": True}, run)


def test_a_contradicting_keyword_fails_before_any_pass():
    run = RunOptions(batch_size=4)
    clash = r"batch_size=2 contradicts run=RunOptions\(batch_size=4\)"
    calls = [
        lambda: gss.calibrate(object(), object(), [], layer=0, run=run, batch_size=2),
        lambda: gss.protect(object(), object(), [], run=run, batch_size=2),
        lambda: gss.audit(object(), object(), [], run=run, batch_size=2),
        lambda: gss.evaluate.evaluate_model(object(), [], [], run=run, batch_size=2),
        lambda: gss.evaluate.other_prompts(object(), [], run=run, batch_size=2),
    ]
    for call in calls:
        with pytest.raises(GSSError, match=clash):
            call()  # type: ignore[arg-type]


def test_run_gives_what_its_keywords_give(make_model):
    model = make_model("gpt2")
    rows = [list(r) for r in random_ids(6, 12).tolist()]
    options = {"k": 4, "n": 10}
    given = gss.evaluate.evaluate_model(model, rows, rows, batch_size=3, progress=False, **options)
    run = gss.evaluate.evaluate_model(model, rows, rows, run=RunOptions(3, False), **options)
    assert (run.memorized, run.perplexity, run.per_row) == (
        given.memorized,
        given.perplexity,
        given.per_row,
    )
    assert config_module.RunOptions is gss.RunOptions
