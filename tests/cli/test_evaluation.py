"""gss sweep --save: the point the sweep selects, saved as an artifact that reproduces it.

The saved artifact reloads with the selected point's delta, rank and percentile thresholds,
and the model steered by it measures what the sweep measured at that point (in the library,
teacher-forced as the sweep measures, and through `gss evaluate --steer`, greedy). The target
directory is checked before any model loads; a sweep with no point within the tolerance says
so and saves nothing.
"""

from __future__ import annotations

import json

import pytest

import gss
from gss.cli import main

from ..helpers import tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep-save")
    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    heldout = [" ".join(f"w{(i * 5 + j * 11) % 44}" for j in range(12)) for i in range(12)]
    (root / "heldout.txt").write_text("\n".join(heldout) + "\n")
    model, ref = (tiny_model("llama", seed=s) for s in (0, 1))
    art = gss.calibrate(
        model, ref, lines, tokenizer=word_tokenizer(), layer=1, rank=2, progress=False
    )
    art.save_pretrained(root / "artifact")
    return root


def _sweep_args(workdir, out):
    args = ["sweep", "--model", str(workdir / "model"), "--steer", str(workdir / "artifact")]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "heldout.txt")]
    args += ["--k", "4", "--n", "10", "--deltas", "1e-6,1,50", "--ranks", "1,2"]
    args += ["--percentiles", "80,95", "--general", str(workdir / "heldout.txt")]
    return [*args, "--out", str(out), "--no-progress"]


def test_the_saved_point_reloads_and_measures_what_the_sweep_did(workdir, capsys):
    from gss.evaluate import evaluate_model, evaluation_rows
    from gss.hf.loading import load_model

    out, saved = workdir / "sweep", workdir / "selected"
    assert main([*_sweep_args(workdir, out), "--save", str(saved)]) == 0
    printed = capsys.readouterr().out
    sweep = json.loads((out / "sweep.json").read_text())
    chosen = sweep["points"][sweep["selected"]]
    options = chosen["options"]
    assert f"saved the selected point (delta {options['delta']:g}" in printed
    assert str(saved) in printed

    artifact = gss.load(saved)
    assert artifact.config.delta == pytest.approx(options["delta"])
    assert artifact.rank == options["rank"]
    rule = artifact.provenance.threshold_rule
    assert rule == {"kind": "percentile", "percentile": options["threshold_percentile"]}
    assert artifact.provenance.extra["sweep"]["options"] == options

    # teacher-forced, as the sweep measured it
    model, tokenizer = load_model(workdir / "model")
    rows = evaluation_rows(
        workdir / "data.txt", workdir / "heldout.txt", tokenizer, k=4, n=10, max_length=128
    )
    with artifact.attach(model):
        report = evaluate_model(
            model, rows.memorized, rows.heldout, k=4, n=10, method="forced", progress=False
        )
    assert report.memorized == chosen["memorized"]
    assert report.perplexity == pytest.approx(chosen["perplexity"], rel=1e-9)

    # gss evaluate --steer with the saved artifact: greedy decoding, the same verdicts
    evaluation = workdir / "evaluation"
    args = ["evaluate", "--model", str(workdir / "model"), "--steer", str(saved)]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "heldout.txt")]
    assert main([*args, "--k", "4", "--n", "10", "--no-progress", "--out", str(evaluation)]) == 0
    steered = json.loads((evaluation / "evaluation.json").read_text())["steered"]
    assert steered["memorized"] == chosen["memorized"]
    assert steered["perplexity"] == pytest.approx(chosen["perplexity"], rel=1e-9)

    # an existing artifact is replaced only with --overwrite
    capsys.readouterr()
    before = (saved / "gss_config.json").read_bytes()
    assert main([*_sweep_args(workdir, workdir / "sweep-2"), "--save", str(saved)]) == 2
    assert "already holds a gss artifact: pass --overwrite" in capsys.readouterr().err
    assert (saved / "gss_config.json").read_bytes() == before
    assert not (workdir / "sweep-2").exists()  # refused before any work


def test_save_is_checked_before_any_model_loads(workdir, capsys):
    args = _sweep_args(workdir, workdir / "sweep-refused")
    args[args.index("--model") + 1] = str(workdir / "nowhere")  # would fail when loaded
    assert main([*args, "--save", str(workdir / "model")]) == 2
    assert "holds files that are not a gss artifact's" in capsys.readouterr().err
    assert main([*args, "--save", str(workdir / "sweep-refused")]) == 2
    assert "needs a directory of its own" in capsys.readouterr().err
    (workdir / "a-file").write_text("x")
    assert main([*args, "--save", str(workdir / "a-file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_no_point_within_the_tolerance_saves_nothing(workdir, capsys, monkeypatch):
    import gss.evaluate.compare as compare

    monkeypatch.setattr(compare, "select_point", lambda *a, **k: None)
    out, saved = workdir / "sweep-none", workdir / "selected-none"
    assert main([*_sweep_args(workdir, out), "--save", str(saved)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gss: error: no point of the sweep is within")
    assert "nothing saved" in err[0]
    assert not saved.exists()
    assert json.loads((out / "sweep.json").read_text())["selected"] is None  # the sweep is kept


def test_evaluate_other_prompts_writes_both_sides(workdir, capsys):
    """gss evaluate --other-prompts: the --memorized rows asked another way, unsteered and
    steered, printed and written beside evaluation.json (issue 70)."""
    out = workdir / "other"
    args = ["evaluate", "--model", str(workdir / "model"), "--steer", str(workdir / "artifact")]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "heldout.txt")]
    args += ["--k", "4", "--n", "10", "--other-prompts", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Other prompts, unsteered: under other prompts" in printed
    assert "| prompt | unsteered | steered |" in printed
    saved = json.loads((out / "other_prompts.json").read_text())
    for side in ("before", "after"):
        longer = saved[side]["variants"]["longer prefix"]
        assert longer["rows"] == 20  # every row has tokens past k + m
        assert 0 <= longer["leaked"] <= longer["rows"]
    # a word tokenizer without a chat template: the two questions run as plain text
    assert set(saved["before"]["variants"]) == {"longer prefix", "question 1", "question 2"}
    assert (out / "other_prompts.md").read_text().startswith("Other prompts, unsteered")


def test_evaluate_other_prompts_needs_a_steer(workdir, capsys):
    args = ["evaluate", "--model", str(workdir / "model"), "--other-prompts"]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "heldout.txt")]
    assert main(args) == 2
    assert "--other-prompts asks the --memorized rows another way" in capsys.readouterr().err
