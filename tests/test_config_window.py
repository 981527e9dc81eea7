"""`gss.Window`: the (n, k)-extraction window, its defaults written once and checked once."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import gss
from gss.cli import build_parser
from gss.evaluate import evaluate_model, steering_sweep
from gss.evaluate.inputs import EvaluationRows, evaluation_rows, secrets_check

SRC = Path(__file__).resolve().parents[1] / "src" / "gss"

# a k or n default (or flag default) written as a number instead of read from `Window`
LITERAL = re.compile(r"\b(?:k: int = 32|n: int = 72|k=32|n=72|default=(?:32|72))\b")


def test_defaults_are_the_papers_and_pass_their_check():
    window = gss.Window()
    assert (window.k, window.n) == (32, 72)
    assert gss.Window(k=8, n=9) == gss.Window(8, 9)


@pytest.mark.parametrize(
    ("k", "n", "message"),
    [
        (0, 8, r"k must be an integer >= 1, got 0: the prompt is a row's first k tokens \(--k\)"),
        (-1, 8, r"k must be an integer >= 1, got -1"),
        (2.5, 8, r"k must be an integer >= 1, got 2\.5"),
        (True, 8, r"k must be an integer >= 1, got True"),
        ("32", 72, r"k must be an integer >= 1, got '32'"),
        (8, 8, r"n must be an integer > k = 8, got 8: .*raise n \(--n\) above k or lower k"),
        (8, 4, r"n must be an integer > k = 8, got 4"),
        (8, 72.0, r"n must be an integer > k = 8, got 72\.0"),
        (8, None, r"n must be an integer > k = 8, got None"),
    ],
)
def test_a_bad_window_is_refused_with_the_fix(k, n, message):
    with pytest.raises(gss.GSSError, match=message):
        gss.Window(k, n)


def test_protect_config_checks_its_window_through_window():
    config = gss.ProtectConfig()
    assert (config.k, config.n) == (gss.Window().k, gss.Window().n)
    assert gss.ProtectConfig(k=8, n=40).k == 8  # still its own fields, saved in protect.json
    with pytest.raises(gss.GSSError, match=r"n must be an integer > k = 8, got 8: "):
        gss.ProtectConfig(k=8, n=8)


@pytest.mark.parametrize(
    "function",
    [gss.audit, evaluate_model, steering_sweep, evaluation_rows, secrets_check, EvaluationRows],
    ids=lambda f: f.__name__,
)
def test_every_k_and_n_default_is_windows(function):
    params = inspect.signature(function).parameters
    assert (params["k"].default, params["n"].default) == (gss.Window().k, gss.Window().n)


def test_cli_window_flags_default_to_window_and_show_it():
    window = gss.Window()
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    seen = []
    for name, command in commands.items():
        flags = {a.dest: a for a in command._actions if a.dest in ("k", "n")}
        if not flags:
            continue
        seen.append(name)
        assert (flags["k"].default, flags["n"].default) == (window.k, window.n), name
        shown = command.format_help()
        assert f"(default: {window.k})" in shown and f"(default: {window.n})" in shown, name
    assert {"audit", "evaluate", "protect"} <= set(seen)


def test_no_window_default_is_written_outside_config():
    """32 and 72 are written once, in `gss.Window` (src/gss/config.py); everything else reads
    them from there, so a new default cannot drift from the others."""
    found = [
        f"{path.relative_to(SRC)}:{number}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        if path.name != "config.py" or path.parent != SRC
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if LITERAL.search(line)
    ]
    assert found == []
    config = (SRC / "config.py").read_text(encoding="utf-8")
    assert "default=32" in config and "default=72" in config  # the pattern does match a default


def test_window_is_public():
    assert "Window" in gss.__all__
    assert gss.Window is gss.config.Window
