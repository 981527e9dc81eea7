"""`gss audit` and `gss protect`: which rows come out verbatim, and the steer chosen for them
within a utility budget."""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

from gss.artifact.files import check_outputs
from gss.cli.inputs import check_against_config, check_reference, load_models, read_rows
from gss.errors import GSSError, GSSWarning


def _replies(rows: Any, tokenizer: Any, args: argparse.Namespace) -> Any:
    """--reply: each conversation (or prompt/completion row) as (prompt ids, reply ids)."""
    from gss.data import encode_replies

    return encode_replies(rows, tokenizer, max_reply=args.n - args.k)


def _check_replies(args: argparse.Namespace, texts: Any) -> None:
    """--reply: a row with no reply to separate is refused before the models load."""
    from gss.data import check_replies

    if args.reply and isinstance(texts, list):
        try:
            check_replies(texts)
        except GSSError as err:
            raise GSSError(f"--data: {err}") from None


def _prefixes(args: argparse.Namespace) -> list[int] | None:
    """--prefixes and --memorized-from, checked before the models load."""
    from gss.audit import check_prefixes
    from gss.cli.options import parse_prefixes

    prefixes = parse_prefixes(args.prefixes)
    if args.reply and prefixes is not None:
        raise GSSError(
            "--prefixes scores plain rows; with --reply each reply is prompted with its whole "
            "conversation: leave --prefixes out."
        )
    try:
        check_prefixes(prefixes, args.k, args.n, args.memorized_from)
    except GSSError as err:
        raise GSSError(f"--prefixes: {err}") from None
    return prefixes


def _lines_of(data: str, rows: int) -> list[str] | None:
    """Each row's "file:line" where ``data`` is a .txt or .jsonl file of ``rows`` rows, so
    that a report names the line a leak is on; None for other data."""
    from gss.data import numbered_rows
    from gss.data_sources import LINE_FORMATS

    path = Path(data)
    if not path.is_file() or path.suffix.lower() not in LINE_FORMATS:
        return None
    places = [where for where, _ in numbered_rows(path)]
    return places if len(places) == rows else None


def audit_command(args: argparse.Namespace) -> int:
    from gss.audit import OUTPUTS, audit, check_window

    check_window(args.k, args.n)  # before the models load
    prefixes = _prefixes(args)
    check_outputs(args.out, OUTPUTS, args.overwrite)
    texts = read_rows(args, "--data", main=True, keep_rows=args.reply)
    _check_replies(args, texts)
    check_reference(args)
    check_against_config(args)
    args.max_length = args.n  # rows are read up to n tokens
    model, tokenizer, reference = load_models(args)
    report = audit(
        model,
        reference,
        _replies(texts, tokenizer, args) if args.reply else texts,
        tokenizer=tokenizer,
        k=args.k,
        n=args.n,
        prefixes=prefixes,
        memorized_from=args.memorized_from,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    report.sources = _lines_of(args.data, len(texts))
    print(report.headline())
    print(report.table())
    report.write(args.out, overwrite=args.overwrite)
    print(
        f"wrote {args.out}: audit.jsonl, audit.md, audit.png, memorized.jsonl (gss evaluate "
        "--memorized), extractable.jsonl (the reference's extractable rows too)"
    )
    return 0


def _max_extractable(args: argparse.Namespace) -> float:
    """protect's goal, from --max-extractable, or from --target (its old name, which
    calibrate's --target, g's objective, made ambiguous) with a warning."""
    if args.old_target is None:
        return 0.0 if args.max_extractable is None else float(args.max_extractable)
    if args.max_extractable is not None:
        raise GSSError("give --max-extractable only (--target is its old name).")
    warnings.warn(
        "gss protect --target is now --max-extractable (calibrate's --target is g's "
        "objective); --target will be removed.",
        GSSWarning,
        stacklevel=2,
    )
    return float(args.old_target)


def protect_command(args: argparse.Namespace) -> int:
    from gss.protect import SearchSpace, check_options, check_report_dir, protect
    from gss.protect.space import check_general

    shares = {} if args.gate_share is None else {"gate_share": args.gate_share}
    space = SearchSpace(max_blocks=args.max_blocks, **shares)
    goal = _max_extractable(args)
    # before the models load
    check_options(space, args.budget, "relative", goal, args.k, args.n, args.seed)
    prefixes = _prefixes(args)
    check_report_dir(args.out, args.overwrite)
    texts = read_rows(args, "--data", main=True)
    _check_replies(args, texts)
    check_reference(args)
    general = read_rows(args, "--general") if args.general else None
    if isinstance(general, list):
        try:
            check_general(len(general))
        except GSSError as err:
            raise GSSError(f"--general: {err}") from None
    heldout = read_rows(args, "--heldout") if args.heldout else None
    check_against_config(args)
    args.max_length = args.n
    model, tokenizer, reference = load_models(args)
    result = protect(
        model,
        reference,
        _replies(texts, tokenizer, args) if args.reply else texts,
        tokenizer=tokenizer,
        general=general,
        heldout=heldout,
        budget=args.budget,
        target=goal,
        k=args.k,
        n=args.n,
        prefixes=prefixes,
        memorized_from=args.memorized_from,
        search=space,
        seed=args.seed,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    result.write(args.out, overwrite=args.overwrite)
    print(result.markdown().split("## The points searched")[0].rstrip())
    where = f"{args.out}/steer" if result.steer is not None else "no steer (none within budget)"
    print(f"wrote {args.out}: protect.json, protect.md, frontier.png, rows.png; {where}")
    return 0 if result.steer is not None else 1
