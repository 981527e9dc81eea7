"""The ``gss`` command (``gss = gss.cli:main``, ``python -m gss``): thin wrappers over the
library, no logic of their own.

`main` parses the command line (`gss.cli.parser.build_parser`), runs the command (one module
a family of commands: `gss.cli.calibration`, `protection`, `evaluation`, `artifacts`,
`inference`, `benchmarks`; each adds its own subcommands to the parser) and turns gss's errors
and warnings into one-line messages (`run`, which ``gss-bench`` runs its commands with too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from gss._startup import EXIT_INTERRUPTED, INTERRUPTED, interruptible
from gss.errors import GSSError, GSSWarning

with interruptible():  # the command's modules load before `main` can catch a Ctrl-C
    from gss.cli.parser import build_parser

__all__ = ["build_parser", "main", "run"]

_default_showwarning = warnings.showwarning


def _warning_shower(prog: str) -> Callable[..., None]:
    """``warnings.showwarning`` for the command ``prog``: gss's own warnings as one line, like
    its errors; others as Python prints them."""

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, GSSWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            _default_showwarning(message, category, *args, **kwargs)

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gss`` with ``argv`` (default: the process's arguments); the exit status: 0, or 2
    after a `GSSError`, printed as one line; 130 after a Ctrl-C, from start-up on."""
    return run(build_parser, argv, "gss")


def run(build: Callable[[], argparse.ArgumentParser], argv: Sequence[str] | None, prog: str) -> int:
    """Parse ``argv`` (default: the process's arguments) with the parser ``build`` makes and
    run the command it names (its ``func``), as the command ``prog`` (``gss``; ``gss-bench``
    runs its commands so too): a `GSSError` or a gss warning is one line, the exit status 0
    or the command's, 2 after a `GSSError`, 130 after a Ctrl-C, 141 when the reader leaves."""
    interrupted = INTERRUPTED if prog == "gss" else f"{prog}: interrupted"
    try:
        args = build().parse_args(argv)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED
    args.argv = list(sys.argv[1:] if argv is None else argv)
    quiet = False
    try:
        if getattr(args, "no_progress", False):
            from transformers.utils import logging as transformers_logging

            quiet = transformers_logging.is_progress_bar_enabled()
            transformers_logging.disable_progress_bar()
        with warnings.catch_warnings():
            warnings.showwarning = _warning_shower(prog)
            return int(args.func(args))
    except GSSError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever it landed
        print(interrupted, file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `gss ... | head`: the reader left; nothing more to say
        with contextlib.suppress(OSError, ValueError):  # stdout may have no descriptor
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141
    finally:
        if quiet:  # `main` called in-process: leave transformers' bars as they were
            transformers_logging.enable_progress_bar()
