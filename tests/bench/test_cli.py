"""gss-bench, the benchmark package's own command: it runs what `gss bench`, `gss models` and
`gss baselines` forward to, with the same output and errors."""

import sys
from pathlib import Path

import pytest

from gss.cli import main as gss_main
from gss_bench import cli
from gss_bench.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "argv", [["baselines"], ["baselines", "--family", "steering"], ["models", "list"]]
)
def test_gss_bench_prints_what_gss_prints(argv, capsys):
    assert main(argv) == 0
    ours = capsys.readouterr()
    assert gss_main(argv) == 0
    assert capsys.readouterr() == ours and ours.out


def test_errors_are_one_line_named_for_the_command(capsys):
    assert main(["baselines", "--family", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gss-bench: error: --family 'nope' has no method") and err[-1] == "\n"
    assert gss_main(["baselines", "--family", "nope"]) == 2
    assert capsys.readouterr().err == err.replace("gss-bench:", "gss:", 1)
    assert main(["models", "get"]) == 2
    assert "gss-bench models get NAME: name one of" in capsys.readouterr().err
    assert gss_main(["models", "get"]) == 2
    assert "gss: error: gss models get NAME: name one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tinymen"])
    assert "invalid choice: 'tinymen'" in capsys.readouterr().err


def test_a_benchmark_gets_its_options_as_given(monkeypatch):
    import gss_bench.perf.run as perf

    seen = []
    monkeypatch.setattr(perf, "main", lambda argv: seen.append(argv) or 0)
    options = ["--quick", "--only", "overhead", "--out", "x"]
    assert main(["perf", *options]) == 0
    assert gss_main(["bench", "perf", *options]) == 0
    assert seen == [options, options]
    assert set(cli.BENCHMARKS) == {"tinymem", "canaries", "perf"}


def test_the_console_script_is_declared():
    text = (ROOT / "benchmarks" / "pyproject.toml").read_text()  # tomllib: Python 3.11+
    scripts = text.split("[project.scripts]\n", 1)[1].split("\n\n", 1)[0]
    assert scripts == 'gss-bench = "gss_bench.cli:main"'
    assert "gss-bench tinymem" in (ROOT / "Makefile").read_text()


def test_gss_bench_help_names_every_command(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gss-bench", "--help"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gss-bench") and all(name in out for name in cli.COMMANDS)
