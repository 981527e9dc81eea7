"""Ctrl-C while the ``gss`` command starts: one line and exit 130, as later on.

``import gss`` loads torch and transformers (seconds); the command's own handler
(`gss.cli.main`) is not in place before they load. `interruptible` wraps those imports: in the
``gss`` command (the console script, ``python -m gss``, ``torchrun -m gss``) an interrupt there
prints ``gss: interrupted`` and exits 130; anywhere else (``import gss`` in a program, a
notebook) it is left to propagate as Python's own ``KeyboardInterrupt``. Standard library only:
this module runs before anything heavy.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Iterator

INTERRUPTED = "gss: interrupted"  # the line `gss.cli.main` prints too
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def is_command() -> bool:
    """Whether this process is the ``gss`` command (the console script or ``-m gss``)."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.splitext(os.path.basename(argv0))[0] == "gss":  # the console script
        return True
    orig = list(getattr(sys, "orig_argv", []))  # the interpreter's own: python [opts] -m gss
    return any(a == "-m" and b in ("gss", "gss.__main__") for a, b in itertools.pairwise(orig))


def interrupted() -> None:
    """Say so in one line and leave with 130, no traceback."""
    with contextlib.suppress(OSError, ValueError):  # stderr may be closed
        print(INTERRUPTED, file=sys.stderr, flush=True)
    raise SystemExit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """In the ``gss`` command, turn a Ctrl-C inside the block into `interrupted`."""
    try:
        yield
    except KeyboardInterrupt:
        if not is_command():
            raise
        interrupted()
