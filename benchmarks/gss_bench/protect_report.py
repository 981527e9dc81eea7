"""Where a benchmark keeps `gss protect`'s report: a folder of the benchmark's own results.

`Protection.write(..., overwrite=True)` replaces only the files a gss run recorded writing
(`gss.artifact.files.check_outputs`), and a committed results folder carries no such record, so
rerunning a benchmark refused to write its report after the whole search. The benchmark owns its
folder: it checks, before any work, that the report's folder holds nothing but a protect report,
writes the new one beside it and then puts it in its place."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gss.artifact.files import WRITTEN
from gss.errors import GSSError
from gss.protect.result import OUTPUTS

REPORT_NAMES = frozenset({*OUTPUTS, WRITTEN})


def check_report_dir(directory: Path) -> None:
    """Refuse, before any work, a report folder that holds anything but a protect report."""
    if not directory.exists() and not directory.is_symlink():
        return
    if directory.is_symlink() or not directory.is_dir():
        raise GSSError(f"{directory} is not a folder of its own: move it, or choose another --out.")
    other = sorted(p.name for p in directory.iterdir() if p.name not in REPORT_NAMES)
    if other:
        raise GSSError(
            f"{directory} holds {', '.join(other[:3])}, which a protect report does not: the "
            "benchmark replaces only its own report there. Move them, or choose another --out."
        )


def write_report(result: Any, directory: Path) -> None:
    """Write ``result``'s report (a `gss.Protection`) into ``directory``, replacing the protect
    report a previous run left there."""
    check_report_dir(directory)
    fresh = directory.with_name(directory.name + ".partial")
    if fresh.exists():
        shutil.rmtree(fresh)
    result.write(fresh)
    if directory.exists():
        shutil.rmtree(directory)
    fresh.rename(directory)
