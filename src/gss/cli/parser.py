"""The ``gss`` command line: the subcommands of the modules that run them, in one parser.

Each command's module (`gss.cli.calibration`, `gss.cli.protection`, ...) adds its own
subcommands, their flags and help (its ``PARSERS``); the options shared by several commands
come from `gss.cli.options`. Built in one place so that ``gss --help``, the README's examples
(tests/test_readme.py) and the commands agree.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gss.cli import artifacts, benchmarks, calibration, evaluation, inference, protection

if TYPE_CHECKING:
    from gss.cli.options import Commands

# the subcommands in the order `gss --help` lists them
COMMANDS = (
    "calibrate",
    "show",
    "push",
    "generate",
    "signal",
    "evaluate",
    "sweep",
    "layers",
    "audit",
    "protect",
    "serve",
    "models",
    "baselines",
    "bench",
)
MODULES = (calibration, artifacts, inference, evaluation, protection, benchmarks)


class Parser(argparse.ArgumentParser):
    """argparse, reading ``-1e-3`` as a negative number (argparse takes it for an option, and
    ``--omega-threshold -1e-3`` failed with "expected one argument"); subcommands inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def build_parser() -> argparse.ArgumentParser:
    """The ``gss`` parser: one subcommand per command, each setting ``func``, what it runs."""
    from gss import __version__

    parser = Parser(
        allow_abbrev=False,  # --targ must not stand for --target
        prog="gss",
        description="Gated Subspace Steering: remove verbatim memorization at inference time.",
        epilog="`gss COMMAND --help` describes each command; the README and docs/ have examples.",
    )
    parser.add_argument("--version", action="version", version=f"gss {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    adders: dict[str, Callable[[Commands], None]] = {}
    for module in MODULES:
        adders.update(module.PARSERS)
    assert sorted(adders) == sorted(COMMANDS), "give each command its place in COMMANDS"
    for name in COMMANDS:
        adders[name](sub)
    return parser
