"""Benchmarks: runnable studies that measure gss on models with known memorization."""

from __future__ import annotations


def baseline_names(text: str, bench: str) -> list[str]:
    """The baselines a ``--baselines`` option names; an unknown one exits with its message
    (``gss bench <bench>: ...``) before any work starts."""
    from gss.errors import GSSError
    from gss_bench.baselines import resolve_method_names

    try:
        return resolve_method_names(text)
    except GSSError as err:
        raise SystemExit(f"gss bench {bench}: {err}") from None


def transformers_bars_off() -> None:
    """Hide transformers' own bars (from_pretrained's loading, save_pretrained's writing) for
    the rest of a ``--no-progress`` benchmark process."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
