"""`gss audit` and `gss protect`: which rows come out verbatim, and the steer chosen for them
within a utility budget."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_outputs
from gss.cli.inputs import (
    check_against_config,
    check_reference,
    load_models,
    read_rows,
    warn_same_source,
)
from gss.cli.options import (
    DATA_HELP,
    add_command,
    add_data_args,
    add_groups,
    add_model_args,
    add_out_args,
    add_prefix_args,
    add_reference_arg,
    add_window_args,
    positive_int,
)
from gss.config import RunOptions
from gss.errors import GSSError

if TYPE_CHECKING:
    from gss.cli.options import Commands


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
        other_prompts=args.other_prompts,
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


def _protect_config(args: argparse.Namespace) -> Any:
    """The `gss.ProtectConfig` of the flags, checked before the models load."""
    from gss.protect import ProtectConfig, SearchSpace

    shares = {} if args.gate_share is None else {"gate_share": args.gate_share}
    prefixes = _prefixes(args)
    return ProtectConfig(
        max_extractable=args.max_extractable,
        leak_modes=_leak_modes(args.leak_modes),
        budget=args.budget,
        k=args.k,
        n=args.n,
        prefixes=None if prefixes is None else tuple(prefixes),
        memorized_from=args.memorized_from,
        search=SearchSpace(max_blocks=args.max_blocks, **shares),
        seed=args.seed,
    )


def _check_rows(args: argparse.Namespace, texts: list[Any], **others: Any) -> None:
    """What the rows alone tell, refused before the weights load: too few rows of --data to
    split into tuning and held-out halves, or (plain text) no row longer than --k, so no
    window; ``others`` (flag: rows, e.g. ``--general``) of plain text with no row of 2 tokens,
    so nothing to predict (else refused after the weights load, naming no flag)."""
    if len(texts) < 2:
        raise GSSError(
            f"--data has {len(texts)} row: protect tunes on half of the memorized rows and "
            "measures the other half. Give at least 2 (better dozens)."
        )
    from gss.hf.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model, getattr(args, "model_revision", None))
    for flag, rows in others.items():
        if rows and all(isinstance(t, str) for t in rows):
            most = max(len(ids) for ids in tokenizer(list(rows))["input_ids"])
            if most < 2:
                raise GSSError(
                    f"{flag}: every row has at most {most} token: nothing to predict. Give "
                    "rows of ordinary text (a sentence or more each)."
                )
    if args.reply or not all(isinstance(t, str) for t in texts):
        return  # conversations and pairs: the audit reads their windows
    longest = max(len(ids) for ids in tokenizer(list(texts))["input_ids"])
    if longest <= args.k:
        raise GSSError(
            f"every row of --data has at most {longest} tokens, none past --k {args.k}: no "
            f"row has a window to check. Lower --k and --n (e.g. --k {max(1, longest // 2)} "
            f"--n {longest}), or give longer rows."
        )


def _leak_modes(text: str) -> tuple[str, ...]:
    """--leak-modes: comma-separated names (checked by `ProtectConfig`, before the models)."""
    try:
        from gss.protect.space import check_leak_modes

        modes = tuple(m.strip() for m in text.split(","))
        check_leak_modes(modes)
    except GSSError as err:
        raise GSSError(f"--leak-modes: {err}") from None
    return modes


def protect_command(args: argparse.Namespace) -> int:
    from gss.protect import check_report_dir, protect
    from gss.protect.space import check_general

    config = _protect_config(args)  # before the models load
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
    warn_same_source(
        args,
        "--heldout",
        "--data",
        "the utility budget would be measured on the fine-tuning rows, where steering raises "
        "perplexity by design. Give held-out text, or leave --heldout out.",
    )
    warn_same_source(
        args,
        "--general",
        "--data",
        "the gates would be set to stay closed on the very rows the steer must act on. Give "
        "ordinary text, or leave --general out.",
    )
    check_against_config(args)
    _check_rows(args, texts, **{"--general": general, "--heldout": heldout})
    args.max_length = args.n
    model, tokenizer, reference = load_models(args)
    result = protect(
        model,
        reference,
        _replies(texts, tokenizer, args) if args.reply else texts,
        config,
        tokenizer=tokenizer,
        general=general,
        heldout=heldout,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    result.write(args.out, overwrite=args.overwrite)
    print(result.markdown().split("## The points searched")[0].rstrip())
    where = f"{args.out}/steer" if result.steer is not None else "no steer (none within budget)"
    print(f"wrote {args.out}: protect.json, protect.md, frontier.png, rows.png; {where}")
    return 0 if result.steer is not None else EXIT_NO_STEER


EXIT_NO_STEER = 3
"""`gss protect`'s exit status when no point was within the budget: its report is written,
and no steer (1 is a bug's, 2 a refused input's; docs/errors.md)."""


def add_audit_parser(sub: Commands) -> None:
    summary = "which training rows the model reproduces verbatim, ranked"
    p = add_command(sub, "audit", summary, audit_command)
    titles = ("the models", "data", "the (n, k) window", "run", "output")
    models, data, window, run, output = add_groups(p, *titles)
    add_model_args(models, reference=True, run=run)
    add_reference_arg(models)
    data.add_argument("--data", required=True, help=f"the fine-tuning rows: {DATA_HELP}")
    add_data_args(data)
    add_window_args(window)
    add_prefix_args(window)
    window.add_argument(
        "--other-prompts",
        action="store_true",
        help="also ask for each memorized row another way (a longer prefix, the chat template, "
        "questions) and count the replies that say its window near-verbatim "
        "(gss.evaluate.other_prompts; greedy generation, slower)",
    )
    run.add_argument(
        "--batch-size",
        type=positive_int,
        default=RunOptions.batch_size,
        help="rows per forward pass",
    )
    add_out_args(
        output,
        "directory for audit.jsonl, audit.md, audit.png, memorized.jsonl and extractable.jsonl",
        required=True,
    )


def add_protect_parser(sub: Commands) -> None:
    summary = "audit, then choose and save the steer that removes what it finds"
    p = add_command(sub, "protect", summary, protect_command)
    titles = ("the models", "data", "the goal", "the (n, k) window", "the search", "run")
    models, data, goal, window, search, run = add_groups(p, *titles)
    (output,) = add_groups(p, "output")
    add_model_args(models, reference=True, run=run)
    add_reference_arg(models)
    data.add_argument("--data", required=True, help=f"the fine-tuning rows: {DATA_HELP}")
    data.add_argument(
        "--general",
        help="a sample of the text the model will serve (the gate thresholds come from it and "
        f"from text the reference writes): {DATA_HELP}",
    )
    data.add_argument(
        "--heldout",
        help=f"text whose perplexity is the utility (default: general text): {DATA_HELP}",
    )
    add_data_args(data)
    goal.add_argument(
        "--budget",
        type=float,
        default=0.05,
        help="utility budget: held-out perplexity may rise by this fraction (0.05: +5%%)",
    )
    goal.add_argument(
        "--max-extractable",
        type=float,
        default=0.0,
        metavar="PCT",
        help="the goal: %% of held-out memorized rows that may stay extractable",
    )
    goal.add_argument(
        "--leak-modes",
        default="exact,near-verbatim",
        metavar="MODES",
        help="what counts as extractable toward --max-extractable, comma-separated among "
        "exact, near-verbatim (80%% of the window in one run), sampled (100 draws likely say "
        "it); teacher-forced (default: exact,near-verbatim)",
    )
    add_window_args(window)
    add_prefix_args(window)
    search.add_argument("--max-blocks", type=positive_int, default=2, help="blocks steered at most")
    search.add_argument(
        "--gate-share",
        type=float,
        help="thresholds: some gate opens on at most this share of each general source's "
        "tokens (default 0.01, SearchSpace.gate_share)",
    )
    search.add_argument("--seed", type=int, default=0, help="the tuning / held-out split")
    run.add_argument(
        "--batch-size",
        type=positive_int,
        default=RunOptions.batch_size,
        help="rows per forward pass",
    )
    add_out_args(
        output, "directory for steer/ (the artifact), protect.json, protect.md and figures", True
    )


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "audit": add_audit_parser,
    "protect": add_protect_parser,
}
