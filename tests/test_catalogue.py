"""Bad inputs to the command line: each ends in one error line that names the problem (and the
fix), never a traceback, and before the expensive work where it can be known then.

A growing catalogue (issue 42): every case here was a traceback or a silently wrong result once.
"""

from __future__ import annotations

import json

import pytest

from gss.cli import main

from .helpers import tiny_model
from .test_cli import _tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalogue")
    for name, seed in (("model", 0), ("ref", 1)):
        tiny_model("llama", seed=seed).save_pretrained(root / name)
        _tokenizer().save_pretrained(root / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    (root / "latin1.txt").write_bytes("caf\xe9 w1 w2\n".encode("latin-1"))
    (root / "empty.txt").write_text("\n\n")
    (root / "rows.jsonl").write_text(json.dumps({"txt": "w1"}) + "\n")
    (root / "data.csv").write_text("text\nw1 w2\n")
    args = ["calibrate", "--model", str(root / "model"), "--reference", str(root / "ref")]
    args += ["--data", str(root / "data.txt"), "--layer", "1", "--rank", "2"]
    assert main([*args, "--out", str(root / "art"), "--no-progress"]) == 0
    return root


def _cases():
    m, r, d = "{root}/model", "{root}/ref", "{root}/data.txt"
    calibrate = ["calibrate", "--model", m, "--reference", r, "--data", d, "--layer", "1"]
    out = ["--out", "{root}/new"]
    generate = ["generate", "--model", m, "--steer", "{root}/art"]
    evaluate = ["evaluate", "--model", m, "--steer", "{root}/art", "--memorized", d]
    evaluate += ["--heldout", d, "--k", "4", "--n", "8"]
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
            [*calibrate[:5], "--data", "{root}/data.csv", "--layer", "1", *out],
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
            [*calibrate, *out, "--ridge-delta", "0"],
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
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(root, capsys, name):
    argv, message = CASES[name]
    argv = [a.format(root=root) for a in argv]
    try:
        code = main([*argv, "--no-progress"])
    except SystemExit as exit_info:  # argparse's own errors
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0], err
    assert not (root / "new").exists()  # nothing written
