"""The gss command end to end on a tiny model and a tokenizer built here."""

import json

import pytest

import gss
from gss.cli import main

from ..helpers import WORDS, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    for name, seed in (("model", 0), ("reference", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    (root / "data.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in lines) + "\n")
    return root


def test_calibrate_then_generate(workdir, capsys):
    out = workdir / "artifact"
    code = main(
        [
            "calibrate",
            "--model",
            str(workdir / "model"),
            "--reference",
            str(workdir / "reference"),
            "--data",
            str(workdir / "data.jsonl"),
            "--layer",
            "1",
            "--rank",
            "2",
            "--out",
            str(out),
            "--threshold-percentile",
            "90",
        ]
    )
    assert code == 0
    assert (out / "gss_config.json").is_file()
    printed = capsys.readouterr().out
    assert "memorized tokens" in printed and f"`gss show {out}` for the details" in printed
    code = main(
        [
            "generate",
            "--model",
            str(workdir / "model"),
            "--steer",
            str(out),
            "--prompt",
            "w1 w2 w3",
            "--max-new-tokens",
            "5",
            "--compare",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "steered:" in printed and "unsteered:" in printed


def _truncated_artifact(workdir):
    """An artifact calibrated with --solve-method truncated (once per module)."""
    out = workdir / "artifact-truncated"
    if not out.is_dir():
        args = ["--model", str(workdir / "model"), "--reference", str(workdir / "reference")]
        args += ["--data", str(workdir / "data.txt"), "--layer", "1", "--rank", "2"]
        assert main(["calibrate", *args, "--solve-method", "truncated", "--out", str(out)]) == 0
    return out


def test_show_describes_an_artifact_and_prints_its_config(workdir, capsys):
    out = _truncated_artifact(workdir)
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads((out / "gss_config.json").read_text())
    config = saved["provenance"]
    shares = config["gate_open_share"]
    assert "model: LlamaForCausalLM (llama), 2 blocks, d = 32" in text
    assert "steer: block 1, K = 2, delta = 1, gate hard" in text
    assert f"any open on {100 * shares['union']:.1f}%" in text
    iterations = config["solve"]["power_iters"]
    assert config["solve"]["method"] == "truncated"  # chosen by --solve-method
    assert f"solve: truncated, {iterations} subspace iterations, settled" in text
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == {"config": saved["config"], "provenance": saved["provenance"]}


def test_signal_writes_statistics_and_figure(workdir, capsys):
    out = workdir / "signal"
    code = main(
        [
            "signal",
            "--model",
            str(workdir / "model"),
            "--reference",
            str(workdir / "reference"),
            "--data",
            str(workdir / "data.txt"),
            "--normal-data",
            str(workdir / "data.jsonl"),
            "--out",
            str(out),
            "--plot",
        ]
    )
    assert code == 0
    report = json.loads((out / "signal.json").read_text())
    stats = report["data"]
    assert {"share_above_mean", "burst_mean_length", "burst_single_share"} <= set(stats)
    assert report["normal"]["tokens"] == stats["tokens"]  # the same lines in both files
    assert stats["burst_count"] <= stats["tokens"]
    assert (out / "signal.png").stat().st_size > 1000
    shown = capsys.readouterr().err
    assert "gss: omega" in shown  # a progress bar over the batches
    assert "omega is 0 on every token" not in shown
    same = ["signal", "--model", str(workdir / "model"), "--reference", str(workdir / "model")]
    assert main([*same, "--data", str(workdir / "data.txt")]) == 0
    assert "omega is 0 on every token" in capsys.readouterr().err


def test_errors_are_messages_not_tracebacks(workdir, capsys):
    code = main(
        [
            "calibrate",
            "--model",
            str(workdir / "nope"),
            "--reference",
            str(workdir / "reference"),
            "--data",
            str(workdir / "data.txt"),
            "--layer",
            "0",
            "--out",
            str(workdir / "x"),
        ]
    )
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
    code = main(
        [
            "calibrate",
            "--model",
            str(workdir / "model"),
            "--reference",
            str(workdir / "reference"),
            "--data",
            str(workdir / "data.txt"),
            "--layer",
            "7",
            "--out",
            str(workdir / "x"),
        ]
    )
    assert code == 2
    assert "layer 7 is out of range" in capsys.readouterr().err


def test_a_reference_with_another_tokenizer_is_refused(workdir, capsys):
    # the same vocabulary size, two words' ids swapped: only the tokenizers tell them apart
    other = workdir / "reference-other-tokenizer"
    tiny_model("llama", seed=1).save_pretrained(other)
    word_tokenizer([*WORDS[:4], "w1", "w0", *WORDS[6:]]).save_pretrained(other)
    for command in ("calibrate", "signal", "layers"):
        args = [command, "--model", str(workdir / "model"), "--reference", str(other)]
        args += ["--data", str(workdir / "data.txt")]
        args += ["--layer", "0", "--out", str(workdir / "x")] if command == "calibrate" else []
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "tokenizers disagree on 2 of 44 regular tokens" in err and "'w0': 4 vs 5" in err


def test_tokens_a_fine_tune_added_do_not_count_as_another_tokenizer():
    from gss.data import check_same_tokenizer

    tuned = word_tokenizer()
    tuned.add_tokens(["<|im_start|>"], special_tokens=True)
    check_same_tokenizer(tuned, word_tokenizer())
    check_same_tokenizer(word_tokenizer(), tuned)


def test_preset_sets_options_and_explicit_flags_win(workdir):
    out = workdir / "artifact-tr"
    common = ["calibrate", "--model", str(workdir / "model"), "--reference"]
    common += [str(workdir / "reference"), "--data", str(workdir / "data.txt"), "--layer", "1"]
    args = [*common, "--rank", "2", "--preset", "gss-tr", "--omega-threshold", "0.05"]
    assert main([*args, "--gate", "none", "--out", str(out)]) == 0
    config = json.loads((out / "gss_config.json").read_text())["config"]
    assert config["target"] == "toward-reference" and config["gradient"] == "summed"
    assert config["gate"] == "none"  # given explicitly: overrides the preset's hard gate
    assert config["omega_threshold"] == 0.05


def test_cli_flags_are_the_config_fields_with_their_defaults():
    """Every calibration option is a `gss calibrate` flag whose type, choices and default
    are the config's own (written once); flags not given leave the preset's values."""
    import dataclasses

    from gss.cli import build_parser

    calibrate = build_parser()._subparsers._group_actions[0].choices["calibrate"]
    flags = {a.dest: a for a in calibrate._actions}
    defaults = gss.preset("gss-tr")  # --preset's default: what a flag left out takes
    for field in dataclasses.fields(gss.CalibrationConfig):
        if field.name == "max_length":  # the CLI's own default: 512 or the model's context
            continue
        action = flags[field.name]
        assert action.option_strings[0] == "--" + field.name.replace("_", "-")
        assert action.help.startswith(field.metadata["help"])
        if field.metadata["choices"]:
            assert tuple(action.choices) == field.metadata["choices"]
        default = getattr(defaults, field.name)
        if field.name != "layer" and default not in (None, False):
            paper = getattr(gss.preset("gss"), field.name)
            also = "" if paper == default else f"; --preset gss: {paper}"
            assert f"(default: {default}{also})" in action.help
    required = ["--model", "m", "--reference", "r", "--data", "d", "--layer", "1", "--out", "o"]
    args = build_parser().parse_args(
        ["calibrate", *required, "--gate", "relu", "--no-replies-only"]
    )
    from gss.cli.options import config_overrides

    expected = {"layer": 1, "gate": "relu", "replies_only": False, "max_length": None}
    assert config_overrides(args) == expected  # max_length: resolved by the command
    assert args.preset == "gss-tr" and args.batch_size == 8


@pytest.fixture(scope="module")
def steer(workdir):
    """A rank-2 artifact at block 1 of the model, for the commands that apply one."""
    out = workdir / "artifact-k2"
    args = ["calibrate", "--model", str(workdir / "model"), "--reference"]
    args += [str(workdir / "reference"), "--data", str(workdir / "data.txt"), "--layer", "1"]
    assert main([*args, "--rank", "2", "--out", str(out)]) == 0
    return out


def test_evaluate_compares_steered_with_unsteered(workdir, steer, capsys):
    common = ["--model", str(workdir / "model")]
    out = workdir / "evaluation"
    args = ["evaluate", *common, "--memorized", str(workdir / "data.txt")]
    args += ["--heldout", str(workdir / "data.jsonl"), "--k", "4", "--n", "10"]
    assert main([*args, "--steer", str(steer), "--delta", "50", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| steered |" in printed and "| unsteered |" in printed
    record = json.loads((out / "evaluation.json").read_text())
    base, steered = record["unsteered"], record["steered"]
    assert base["rows"] == steered["rows"] == 20
    assert base["DS_0.1"] == pytest.approx(base["memorized"])  # against itself: no degradation
    assert steered["perplexity"] != base["perplexity"]  # the steer was attached
    assert 0.0 <= steered["gate_open_share"] <= 1.0
    assert record["options"] == {"delta": 50.0}  # the numbers are the steer's at --delta
    written = (out / "evaluation.md").read_text()
    assert "DS 0.05" in written and written.startswith("(10,4)-memorization of 20 sequences")
    assert "; steered with delta 50\n" in written
    assert "\n\n(the gate opened on" in written  # what was printed, the share apart from the table
    # without --steer: the unsteered run alone; bad windows are a message
    assert main(args) == 0
    assert "steered" not in capsys.readouterr().out.replace("unsteered", "")
    assert main([*args[:-4], "--k", "40", "--n", "50"]) == 2
    assert "smaller --k" in capsys.readouterr().err


def test_evaluate_looks_for_the_secrets_rows_carry(workdir, steer, capsys):
    from transformers import AutoModelForCausalLM

    from gss.evaluate.leaks import secrets_said

    lines = (workdir / "data.txt").read_text().splitlines()[:4]
    tok = word_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(workdir / "model")
    prompt = tok(lines[0])["input_ids"][:4]
    (said,) = secrets_said(model, tok, [prompt], [["x"]], max_new_tokens=6).continuations
    # row 0's secret is what the model says after its first 4 tokens; the others never come
    secrets = [" ".join(said.split()[1:3]), "zzz", "yyy", "xxx"]
    rows = [{"text": t, "secrets": [s]} for t, s in zip(lines, secrets, strict=True)]
    path = workdir / "secrets.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*rows, {"text": lines[0]}]) + "\n")
    out = workdir / "leaks"
    args = ["evaluate", "--model", str(workdir / "model"), "--memorized", str(path)]
    args += ["--heldout", str(workdir / "data.jsonl"), "--k", "4", "--n", "8", "--out", str(out)]
    assert main([*args, "--steer", str(steer), "--no-progress"]) == 0
    assert "| % secrets said | % 4-grams repeated |" in capsys.readouterr().out
    record = json.loads((out / "evaluation.json").read_text())
    unsteered = record["unsteered"]["secrets"]
    assert 0 <= unsteered["repetition"] <= 100  # how much the decoded continuations loop
    assert unsteered["said"] == [[True], [False], [False], [False]]
    assert len(unsteered["others"]) == 4  # which rows said another row's secret
    assert unsteered["secrets_leaked"] == 25.0 and "secrets" in record["steered"]
    # gss sweep: the same check, unsteered and at every point
    sweep = ["sweep", "--steer", str(steer), "--deltas", "1e-6,1", *args[1:-2], "--out", str(out)]
    assert main([*sweep, "--no-progress"]) == 0
    table = capsys.readouterr().out
    header = "| % memorized | % secrets said | % saying another row's | % 4-grams repeated |"
    assert header in table
    leaks = json.loads((out / "sweep.json").read_text())["secrets"]
    assert len(leaks) == 3 and leaks[0]["said"] == unsteered["said"]
    assert leaks[1]["said"] == unsteered["said"]  # delta 1e-6: nothing changes
    path.write_text(json.dumps({"text": "w1 w2", "secrets": ["w3"]}) + "\n")
    assert main([*args, "--overwrite"]) == 2
    assert "has at most k=4 tokens" in capsys.readouterr().err
    # "secrets" not a list of texts: one message naming the row (was a TypeError, or nan)
    for bad in (1234, [], "w3", [""], [None], [True]):
        rows = [{"text": lines[1]}, {"text": lines[0], "secrets": bad}]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        assert main([*args, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert '--memorized row 2: "secrets" must be a non-empty list of strings' in err, bad


def test_no_progress_silences_every_bar_and_only_for_the_command(workdir, steer, capsys):
    from transformers.utils import logging as transformers_logging

    args = ["evaluate", "--model", str(workdir / "model"), "--steer", str(steer)]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "data.jsonl")]
    args += ["--k", "4", "--n", "10"]
    assert main(args) == 0
    assert "gss: greedy decoding" in capsys.readouterr().err
    hf = transformers_logging
    for switch in (hf.disable_progress_bar, hf.enable_progress_bar):  # as other code left it
        switch()
        before = hf.is_progress_bar_enabled()
        assert main([*args, "--no-progress"]) == 0
        assert capsys.readouterr().err == ""
        assert hf.is_progress_bar_enabled() == before  # restored after the command


def test_layers_writes_strengths_and_plot(workdir, capsys):
    out = workdir / "scan"
    args = ["layers", "--model", str(workdir / "model"), "--reference", str(workdir / "reference")]
    args += ["--data", str(workdir / "data.txt")]
    assert main([*args, "--out", str(out)]) == 0
    assert "<- steer here" in capsys.readouterr().out
    scan = json.loads((out / "layers.json").read_text())
    assert set(scan["strengths"]) == {"0", "1"} and (out / "layers.png").is_file()
    assert main([*args, "--layers", "x"]) == 2
    assert "--layers takes" in capsys.readouterr().err


def test_block_path_names_the_blocks_for_calibrate_and_layers(workdir, capsys):
    common = ["--model", str(workdir / "model"), "--reference", str(workdir / "reference")]
    common += ["--data", str(workdir / "data.txt")]
    out = workdir / "artifact-block-path"
    calibrate = ["calibrate", *common, "--layer", "1", "--rank", "2", "--out", str(out)]
    assert main([*calibrate, "--block-path", "model.layers"]) == 0
    saved = json.loads((out / "gss_config.json").read_text())
    assert saved["config"]["block_path"] == "model.layers"
    for command in ([*calibrate, "--overwrite"], ["layers", *common]):
        capsys.readouterr()
        assert main([*command, "--block-path", "model.nothing"]) == 2
        assert "'model.nothing' does not name" in capsys.readouterr().err


def test_sweep_writes_grid_front_and_plot(workdir, steer, capsys):
    common = ["--model", str(workdir / "model")]
    out = workdir / "sweep"
    args = ["sweep", *common, "--steer", str(steer), "--memorized", str(workdir / "data.txt")]
    args += ["--heldout", str(workdir / "data.jsonl"), "--k", "4", "--n", "10"]
    args += ["--deltas", "1,50", "--ranks", "1,2", "--out", str(out)]
    assert main([*args, "--percentiles", "90", "--general", str(workdir / "data.txt")]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert len(sweep["points"]) == 4
    assert {(p["options"]["delta"], p["options"]["rank"]) for p in sweep["points"]} == {
        (1.0, 1),
        (1.0, 2),
        (50.0, 1),
        (50.0, 2),
    }
    assert "yes" in (out / "sweep.md").read_text() and (out / "sweep.png").is_file()
    # the selected point: the rule over the points written (no secrets in these rows)
    limit = 1.05 * sweep["unsteered"]["perplexity"]
    within = [i for i, p in enumerate(sweep["points"]) if p["perplexity"] <= limit]
    key = lambda i: (sweep["points"][i]["memorized"], sweep["points"][i]["perplexity"])  # noqa: E731
    assert sweep["selected"] == min(within, key=key, default=None)
    assert "selected: perplexity within +5%" in capsys.readouterr().out
    assert main([*args, "--tolerance", "-1", "--overwrite"]) == 2
    assert "tolerance must be >= 0" in capsys.readouterr().err
    assert main([*args, "--percentiles", "90", "--overwrite"]) == 2
    assert "give it with --general FILE" in capsys.readouterr().err


def test_version_and_help_show_defaults(capsys):
    import gss

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"gss {gss.__version__}"
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "directions K (default: 4)" in help_text
    assert "are memorized (default: 0.0)" in help_text  # a zero default is still shown
    assert "(default: None)" not in help_text and "(default: False)" not in help_text


def test_an_adapter_directory_without_peft_installed_says_what_to_install(
    tmp_path, monkeypatch, capsys
):
    import importlib.util

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base"}))
    (tmp_path / "data.txt").write_text("w1 w2 w3\n")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    args = ["--model", str(adapter), "--reference", "adapters-off", "--data"]
    assert main(["signal", *args, str(tmp_path / "data.txt")]) == 2
    assert "needs peft: pip install" in capsys.readouterr().err


def test_gss_warnings_print_as_one_line_like_errors(workdir, capsys, monkeypatch):
    import warnings

    from gss import GSSWarning
    from gss.artifact.steering_artifact import SteeringArtifact

    def describe(self):
        warnings.warn("the solve did not settle", GSSWarning, stacklevel=2)
        return "described"

    out = _truncated_artifact(workdir)
    capsys.readouterr()
    monkeypatch.setattr(SteeringArtifact, "describe", describe)
    assert main(["show", str(out)]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == "described"
    assert printed.err.strip() == "gss: warning: the solve did not settle"


def test_benchmark_commands_without_gss_bench_say_how_to_install(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gss_bench" else find_spec(name, *a),
    )
    for argv in (["bench", "perf"], ["models", "list"], ["baselines"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"gss {argv[0]} needs the gss_bench package" in err
        assert "pip install -e ./benchmarks" in err and "Traceback" not in err


def test_the_library_gives_what_gss_evaluate_writes(workdir, steer, capsys):
    """The loading, rows and tables `gss evaluate` uses are the library's own."""
    from gss.evaluate import evaluate_steering, evaluation_rows
    from gss.hf.loading import default_max_length, load_model

    out = workdir / "evaluation-library"
    args = ["evaluate", "--model", str(workdir / "model"), "--steer", str(steer)]
    args += ["--memorized", str(workdir / "data.txt"), "--heldout", str(workdir / "data.jsonl")]
    assert main([*args, "--k", "4", "--n", "10", "--no-progress", "--out", str(out)]) == 0
    model, tokenizer = load_model(workdir / "model")
    assert default_max_length(model) == 128  # 512, cut to the tiny model's context
    rows = evaluation_rows(
        workdir / "data.txt", workdir / "data.jsonl", tokenizer, k=4, n=10, max_length=128
    )
    result = evaluate_steering(model, gss.load(steer), rows, progress=False)
    record = result.record(str(workdir / "model"), str(steer))
    written = json.loads((out / "evaluation.json").read_text())
    for run in ("unsteered", "steered"):  # all but the wall times
        del record[run]["seconds"], written[run]["seconds"]
    assert record == written
    assert result.headline() in capsys.readouterr().out


def test_out_is_never_replaced_without_overwrite(workdir, capsys):
    """An existing artifact or result files in --out are refused before the models load (the
    model path here does not exist: the --out error comes first); --overwrite replaces them; a
    model's own folder is never written into."""
    common = ["--model", str(workdir / "nowhere"), "--reference", str(workdir / "nowhere")]
    calibrate = ["calibrate", *common, "--data", str(workdir / "data.txt"), "--layer", "1"]
    artifact = workdir / "artifact-kept"
    assert main([*calibrate, "--out", str(workdir / "model")]) == 2
    assert "holds files that are not a gss artifact's" in capsys.readouterr().err
    real = ["--model", str(workdir / "model"), "--reference", str(workdir / "reference")]
    real_calibrate = ["calibrate", *real, "--data", str(workdir / "data.txt"), "--layer", "1"]
    assert main([*real_calibrate, "--rank", "2", "--out", str(artifact)]) == 0
    before = (artifact / "gss_config.json").read_bytes()
    capsys.readouterr()
    assert main([*calibrate, "--out", str(artifact)]) == 2
    err = capsys.readouterr().err
    assert "already holds a gss artifact" in err and "--overwrite" in err
    assert (artifact / "gss_config.json").read_bytes() == before
    args = [*real_calibrate, "--rank", "1", "--out", str(artifact), "--overwrite"]
    assert main(args) == 0
    assert gss.load(artifact).config.rank == 1
    results = workdir / "results-kept"
    results.mkdir()
    (results / "layers.json").write_text("{}")
    layers = ["layers", *common, "--data", str(workdir / "data.txt"), "--out", str(results)]
    capsys.readouterr()
    assert main(layers) == 2
    assert "already holds layers.json: pass --overwrite" in capsys.readouterr().err
    assert (results / "layers.json").read_text() == "{}"


def test_abbreviated_flags_are_refused(workdir, capsys):
    args = ["calibrate", "--model", "m", "--reference", "r", "--data", "d", "--layer", "1"]
    with pytest.raises(SystemExit) as exit_code:
        main([*args, "--out", "o", "--targ", "loglik"])
    assert exit_code.value.code == 2
    assert "unrecognized arguments: --targ loglik" in capsys.readouterr().err


def test_a_secret_inside_the_prompt_is_said_to_be_uncountable(workdir, capsys):
    """A row whose secret sits inside its first k tokens can never leak it after the prompt:
    gss evaluate says so instead of counting it as kept."""
    lines = (workdir / "data.txt").read_text().splitlines()[:3]
    rows = [{"text": t, "secrets": [t.split()[1]]} for t in lines]  # the 2nd word: in the prompt
    path = workdir / "secrets-in-prompt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = ["evaluate", "--model", str(workdir / "model"), "--memorized", str(path)]
    args += ["--heldout", str(workdir / "data.jsonl"), "--k", "4", "--n", "8", "--no-progress"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "gss: warning: 3 of 3 rows with secrets have a secret inside their first k=4" in err


def test_negative_numbers_in_scientific_notation_are_values():
    from gss.cli.parser import build_parser

    argv = ["calibrate", "--model", "m", "--reference", "r", "--data", "d", "--layer", "1"]
    argv += ["--out", "o"]
    for text, value in (("-1e-3", -1e-3), ("-0.5", -0.5), ("-2", -2.0), ("-.5E+1", -5.0)):
        args = build_parser().parse_args([*argv, "--omega-threshold", text])
        assert args.omega_threshold == value


def test_an_unknown_baseline_family_is_refused(capsys):
    pytest.importorskip("gss_bench")
    assert main(["baselines", "--family", "nope"]) == 2
    assert "--family 'nope' has no method: one of" in capsys.readouterr().err


def test_a_stray_world_size_is_one_message(tmp_path, monkeypatch, capsys):
    """WORLD_SIZE without torchrun's other variables (or not a number) is refused before
    anything loads, not a ValueError from torch.distributed."""
    args = ["calibrate", "--model", str(tmp_path / "m"), "--reference", str(tmp_path / "r")]
    args += ["--data", str(tmp_path / "d.txt"), "--layer", "1", "--out", str(tmp_path / "out")]
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    assert main(args) == 2
    assert "WORLD_SIZE='abc' in the environment is not a number" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not" in err
    assert "torchrun" in err


def test_protect_flags_make_one_checked_config(capsys):
    """gss protect's flags become one `ProtectConfig`, refused before the models load; its
    goal is --max-extractable (calibrate's --target is g's objective: no alias of it here)."""
    from gss.cli.parser import build_parser
    from gss.cli.protection import _protect_config
    from gss.errors import GSSError
    from gss.protect import ProtectConfig, SearchSpace

    argv = ["protect", "--model", "m", "--reference", "r", "--data", "d", "--out", "o"]
    parse = build_parser().parse_args
    assert _protect_config(parse(argv)) == ProtectConfig()
    config = _protect_config(parse([*argv, "--max-extractable", "2.5", "--gate-share", "0.05"]))
    assert config == ProtectConfig(max_extractable=2.5, search=SearchSpace(gate_share=0.05))
    with pytest.raises(GSSError, match=r"max_extractable \(gss protect --max-extractable\)"):
        _protect_config(parse([*argv, "--max-extractable", "200"]))
    with pytest.raises(SystemExit):
        parse([*argv, "--target", "5"])
    with pytest.raises(SystemExit):
        main(["protect", "--help"])
    shown = capsys.readouterr().out
    assert "--max-extractable PCT" in shown and "--target" not in shown
