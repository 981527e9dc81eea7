"""`gss evaluate` and `gss sweep`: memorization, perplexity and lm-eval's tasks, steered against
unsteered, and the strength trade-off."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gss.artifact.files import check_outputs, check_target, record_outputs
from gss.cli.inputs import (
    check_delta,
    check_results,
    load_model_and_tokenizer,
    read_rows,
    resolve_max_length,
    warn_same_source,
)
from gss.cli.options import (
    DATA_HELP,
    HUB_ID,
    add_batch_args,
    add_command,
    add_data_args,
    add_groups,
    add_model_args,
    add_out_args,
    add_window_args,
    directory,
    parse_floats,
)
from gss.config import EVALUATION_BATCH_SIZE
from gss.errors import GSSError, GSSWarning

if TYPE_CHECKING:
    from gss.artifact.stack import Steer
    from gss.cli.options import Commands
    from gss.evaluate.inputs import EvaluationRows, SecretsCheck

# what `gss evaluate` and `gss sweep` run on: the model, its tokenizer, the artifact (None
# without --steer), the rows and the secrets check (None when no row has secrets)
EvaluationInputs = tuple[Any, Any, "Steer | None", "EvaluationRows", "SecretsCheck | None"]


def _steered_model(args: argparse.Namespace) -> tuple[Any, Any, Steer | None]:
    """Model, tokenizer and artifact (None without --steer), checked against each other
    (`gss evaluate --lm-eval` without --memorized needs no more)."""
    from gss.artifact.stack import load

    artifact = load(args.steer) if args.steer else None
    if artifact is not None:
        check_delta(artifact, getattr(args, "delta", None))
    model, tokenizer = load_model_and_tokenizer(args)
    resolve_max_length(args, model)
    if artifact is not None:
        artifact.check_model(model)  # refuse a foreign artifact before the slow part
    return model, tokenizer, artifact


def _evaluation_inputs(args: argparse.Namespace) -> EvaluationInputs:
    """Model, tokenizer, artifact (None without --steer), the rows to evaluate on and the
    secrets check (None when no --memorized row has secrets), for `gss evaluate` and
    `gss sweep`."""
    from gss.evaluate.inputs import evaluation_rows, secrets_check

    memorized = read_rows(args, "--memorized", main=True)  # rows keep their secrets
    heldout = read_rows(args, "--heldout", keep_rows=False)  # both before the model loads
    warn_same_source(
        args,
        "--heldout",
        "--memorized",
        "held-out perplexity would be measured on the memorized rows, where steering raises "
        "it by design, and say nothing of text the model was not tuned on. Give held-out text.",
    )
    model, tokenizer, artifact = _steered_model(args)
    window = {"k": args.k, "n": args.n, "reply": args.reply}
    rows = evaluation_rows(memorized, heldout, tokenizer, max_length=args.max_length, **window)
    progress = not args.no_progress
    check = secrets_check(
        memorized, tokenizer, batch_size=args.batch_size, progress=progress, **window
    )
    return model, tokenizer, artifact, rows, check


def _report(args: argparse.Namespace, result: Any, headline: str, stem: str) -> None:
    """Print a comparison of `gss evaluate` (its headline, table and gate share) and, with
    --out, write it as ``STEM.json`` and ``STEM.md``."""
    from gss.report import write_json

    table = result.table()
    gates = (
        ""
        if result.gate_open_share is None
        else f"(the gate opened on {100 * result.gate_open_share:.1f}% of positions)\n"
    )
    text = f"{headline}\n\n{table}" + (f"\n{gates}" if gates else "")
    print(text, end="")
    if args.out:
        out = Path(args.out)
        write_json(out / f"{stem}.json", result.record(args.model, args.steer))
        (out / f"{stem}.md").write_text(text)  # what was printed
        record_outputs(out, [f"{stem}.json", f"{stem}.md"])
        print(f"wrote {out}/{stem}.json and {stem}.md")


def evaluate_command(args: argparse.Namespace) -> int:
    from gss.audit import check_window
    from gss.evaluate.compare import evaluate_steering

    lm_eval = args.lm_eval is not None
    memorization = not lm_eval or args.memorized is not None or args.heldout is not None
    if memorization and (args.memorized is None or args.heldout is None):
        raise GSSError(
            "give --memorized and --heldout (memorization and held-out perplexity), "
            "--lm-eval TASKS (lm-eval tasks), or both"
            if args.memorized is None and args.heldout is None
            else f"--memorized and --heldout go together: give --"
            f"{'heldout' if args.heldout is None else 'memorized'} too."
        )
    outputs = ["evaluation.json", "evaluation.md"] if memorization else []
    outputs += ["lm_eval.json", "lm_eval.md"] if lm_eval else []
    if args.other_prompts:
        if not memorization or args.steer is None:
            raise GSSError(
                "--other-prompts asks the --memorized rows another way, with and without the "
                "steer: give --steer DIR, --memorized and --heldout with it."
            )
        outputs += ["other_prompts.json", "other_prompts.md"]
    check_results(args, outputs)
    if args.delta is not None and args.steer is None:
        raise GSSError("--delta sets the steer's strength: give --steer DIR with it.")
    tasks = _lm_eval_tasks(args)  # None without --lm-eval; checked before any model loads
    if memorization:
        check_window(args.k, args.n)  # before the model loads
    if not memorization:
        model, tokenizer, artifact = _steered_model(args)
        return _lm_eval_command(args, model, tokenizer, artifact, tasks)
    model, tokenizer, artifact, rows, check = _evaluation_inputs(args)
    result = evaluate_steering(
        model,
        artifact,
        rows,
        delta=args.delta,
        secrets=check,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    _report(args, result, result.headline(), "evaluation")
    if args.other_prompts and artifact is not None:
        _other_prompts(args, model, tokenizer, artifact, rows)
    if tasks is not None:
        return _lm_eval_command(args, model, tokenizer, artifact, tasks)
    return 0


def _other_prompts(
    args: argparse.Namespace, model: Any, tokenizer: Any, artifact: Steer, rows: Any
) -> None:
    """`gss evaluate --other-prompts`: the memorized rows asked another way, unsteered and
    steered; printed and, with --out, written as other_prompts.json / .md."""
    from gss.artifact.steering_artifact import SteeringArtifact
    from gss.evaluate.other_prompts import side_by_side, steered_other_prompts
    from gss.report import write_json

    steer = artifact  # --delta on a stack was refused before the model loaded (check_delta)
    if args.delta is not None and isinstance(artifact, SteeringArtifact):
        steer = artifact.with_options(delta=args.delta)
    found = steered_other_prompts(
        model,
        steer,
        rows.memorized,
        tokenizer=tokenizer,
        k=rows.k,
        n=rows.n,
        pad_id=rows.pad_id,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    summary = {side: report.summary() for side, report in found.items()}
    text = (
        f"Other prompts, unsteered: {found['before'].headline()}\n"
        f"Other prompts, steered: {found['after'].headline()}\n\n"
        f"{side_by_side(summary['before'], summary['after'])}\n"
    )
    print(text, end="")
    if args.out:
        out = Path(args.out)
        write_json(
            out / "other_prompts.json", {"model": args.model, "steer": args.steer, **summary}
        )
        (out / "other_prompts.md").write_text(text)
        record_outputs(out, ["other_prompts.json", "other_prompts.md"])
        print(f"wrote {out}/other_prompts.json and other_prompts.md")


def _lm_eval_tasks(args: argparse.Namespace) -> Any:
    """--lm-eval's tasks checked (lm-eval installed, every name known, the settings valid),
    or None without --lm-eval: all before any model loads."""
    from gss.evaluate.lm_eval_bridge import check_settings, lm_eval_tasks

    given = [
        f for f in ("include", "limit", "fewshot") if getattr(args, f"lm_eval_{f}") is not None
    ]
    if args.lm_eval is None:
        if given:
            raise GSSError(
                f"--lm-eval-{given[0]} is for --lm-eval: name the tasks (--lm-eval TASKS), "
                "or leave it out."
            )
        return None
    check_settings(args.lm_eval_limit, args.lm_eval_fewshot)  # before int(): inf, NaN
    limit = args.lm_eval_limit
    if limit is not None and limit >= 1 and limit == int(limit):
        args.lm_eval_limit = int(limit)  # a count of documents, recorded as one
    return lm_eval_tasks(args.lm_eval, args.lm_eval_include)


def _lm_eval_command(
    args: argparse.Namespace, model: Any, tokenizer: Any, artifact: Steer | None, tasks: Any
) -> int:
    """`gss evaluate --lm-eval`: the tasks unsteered and steered, printed and saved."""
    from gss.evaluate.lm_eval_bridge import lm_eval_steering

    result = lm_eval_steering(
        model,
        artifact,
        tasks,
        tokenizer=tokenizer,
        limit=args.lm_eval_limit,
        num_fewshot=args.lm_eval_fewshot,
        batch_size=args.batch_size,
        delta=args.delta,
        progress=not args.no_progress,
    )
    _report(args, result, f"lm-eval: {', '.join(result.tasks)}", "lm_eval")
    return 0


def _save_dir(args: argparse.Namespace) -> Path | None:
    """--save's directory, checked before any model loads; None without it."""
    if args.save is not None and not args.save.strip():
        raise GSSError("--save is empty: give the directory to save the selected point into.")
    save = Path(args.save) if args.save else None
    if save is not None:  # before any model loads
        out_dir, save_dir = Path(args.out).resolve(), save.resolve()
        if save_dir == out_dir or save_dir in out_dir.parents:
            raise GSSError(
                f"--save {save} holds --out {args.out}: the artifact needs a directory of its "
                "own (e.g. --save DIR/selected beside the sweep's files)."
            )
        if Path(args.steer).exists() and save_dir == Path(args.steer).resolve():
            raise GSSError(
                f"--save {save} is --steer: saving the selected point there would replace the "
                "artifact the sweep varies. Give --save another directory."
            )
        check_target(save, overwrite=True)  # a file, or a folder with other files, is refused
        if save.is_dir() and any(save.iterdir()) and not args.overwrite:
            raise GSSError(
                f"--save {save} already holds a gss artifact: pass --overwrite to replace it, "
                "or choose another directory."
            )
    return save


def _grid(
    args: argparse.Namespace,
) -> tuple[list[float] | None, list[float] | None, list[int] | None]:
    """The grid over --steer's options: --deltas, --percentiles, --ranks (None: not given),
    checked against the artifact (one, not a stack) before the model loads."""
    from gss.artifact.stack import SteeringStack, load
    from gss.evaluate.sweep import check_grid

    steer = load(args.steer)
    if isinstance(steer, SteeringStack):
        raise GSSError(
            f"{args.steer} is a steering stack (several blocks chosen together): gss sweep "
            "varies one artifact's options. Give one of its steer-<i> directories, or run gss "
            "evaluate on the stack."
        )
    deltas = parse_floats(args.deltas, "--deltas")
    percentiles = parse_floats(args.percentiles, "--percentiles")
    ranks = parse_floats(args.ranks, "--ranks")
    if ranks and any(r != int(r) for r in ranks):
        raise GSSError(f"--ranks takes whole numbers (directions kept), got {args.ranks!r}.")
    if percentiles and not args.general:
        raise GSSError(
            "--percentiles sets the gates' thresholds on general text: give it with --general "
            "FILE (text like what the model serves)."
        )
    if args.general and not percentiles:
        raise GSSError(
            "--general is read only to set thresholds at --percentiles: give --percentiles too, "
            "or leave --general out."
        )
    whole = [int(r) for r in ranks] if ranks else None
    # every grid value the artifact cannot take fails before the model loads
    check_grid(steer, deltas, percentiles, whole)
    return deltas, percentiles, whole


def sweep_command(args: argparse.Namespace) -> int:
    from gss.artifact.steering_artifact import SteeringArtifact
    from gss.audit import check_window
    from gss.data import encode
    from gss.evaluate.compare import sweep_and_select
    from gss.evaluate.sweep import check_tolerance
    from gss.evaluate.tables import SWEEP_OUTPUTS

    check_outputs(args.out, SWEEP_OUTPUTS, args.overwrite)
    check_window(args.k, args.n)  # before the model loads
    save = _save_dir(args)
    check_tolerance(args.tolerance)  # a bad --tolerance fails before any work
    deltas, percentiles, ranks = _grid(args)
    general_rows = read_rows(args, "--general", keep_rows=False) if args.general else None
    model, tokenizer, artifact, rows, check = _evaluation_inputs(args)
    assert isinstance(artifact, SteeringArtifact)  # --steer is required, and not a stack
    general = encode(general_rows, tokenizer, args.max_length) if general_rows is not None else None
    with warnings.catch_warnings():  # said once, by the check above
        warnings.filterwarnings("ignore", "tolerance .* lets perplexity rise", GSSWarning)
        result = sweep_and_select(
            model,
            artifact,
            rows,
            deltas=deltas,
            percentiles=percentiles,
            ranks=ranks,
            general=general,
            tolerance=args.tolerance,
            secrets=check,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
    print(result.table())
    result.write(args.out, overwrite=args.overwrite)
    print(f"wrote {Path(args.out)}/sweep.json, sweep.md and sweep.png")
    if save is not None:
        _save_selected(args, result, save)
    return 0


def _save_selected(args: argparse.Namespace, result: Any, save: Path) -> None:
    """--save: the selected point as an artifact in ``save``, or an error when no point is
    within the tolerance."""
    chosen = result.selected_artifact(args.steer)
    if chosen is None:
        raise GSSError(
            f"no point of the sweep is within the perplexity tolerance "
            f"(+{100 * args.tolerance:g}%): nothing saved to {save}. Sweep weaker "
            "strengths (smaller --deltas, higher --percentiles) or allow more (--tolerance)."
        )
    chosen.save_pretrained(save, overwrite=args.overwrite)
    o = result.points[result.selected].options
    threshold = (
        "" if o["threshold_percentile"] is None else f", gates at p{o['threshold_percentile']:g}"
    )
    print(
        f"saved the selected point (delta {o['delta']:g}, rank {o['rank']}{threshold}) to "
        f"{save}: gss generate / gss evaluate --steer {save}"
    )


def add_evaluate_parser(sub: Commands) -> None:
    summary = "(n,k)-memorization, held-out perplexity and DS, steered vs unsteered"
    p = add_command(sub, "evaluate", summary, evaluate_command)
    titles = ("the model", "the steer", "data", "the (n, k) window", "lm-eval", "run", "output")
    model, steer, data, window, lm_eval, run, output = add_groups(p, *titles)
    add_model_args(model, run=run)
    steer.add_argument("--steer", help=f"artifact directory ({HUB_ID}): also evaluate with it")
    steer.add_argument("--delta", type=float, help="override the artifact's strength")
    # --memorized and --heldout go together; with --lm-eval they may be left out
    data.add_argument("--memorized", help=f"candidate sequences: {DATA_HELP}")
    data.add_argument(
        "--heldout",
        help="held-out text for perplexity (given with --memorized; with --lm-eval both may "
        "be left out)",
    )
    add_data_args(data, main="--memorized")
    add_window_args(window, "--memorized")
    data.add_argument(
        "--other-prompts",
        action="store_true",
        help="also ask for each --memorized row another way (a longer prefix, the chat "
        "template, questions), with and without --steer, and count the replies that say its "
        "window near-verbatim, into other_prompts.json / .md (greedy generation, slower)",
    )
    add_batch_args(run, batch_size=EVALUATION_BATCH_SIZE, length_help="held-out tokens per row")
    lm_eval.add_argument(
        "--lm-eval",
        metavar="TASKS",
        help="also run these lm-eval tasks (comma-separated; globs such as mmlu_* expand) "
        "unsteered and steered, into lm_eval.json and lm_eval.md (needs lm-eval: pip install "
        "'gated-subspace-steering[lm-eval]')",
    )
    lm_eval.add_argument(
        "--lm-eval-include",
        metavar="DIR",
        action="append",
        help="a directory of lm-eval task YAML files of your own (repeatable)",
    )
    lm_eval.add_argument(
        "--lm-eval-limit",
        type=float,
        metavar="N",
        help="documents per lm-eval task (a number below 1: that share of them)",
    )
    lm_eval.add_argument(
        "--lm-eval-fewshot", type=int, metavar="N", help="few-shot examples (default: the task's)"
    )
    add_out_args(
        output, "directory for evaluation.json and evaluation.md (lm_eval.json, lm_eval.md)"
    )


def add_sweep_parser(sub: Commands) -> None:
    summary = "memorization vs perplexity over delta/threshold/rank"
    p = add_command(sub, "sweep", summary, sweep_command)
    titles = ("the model", "the steer", "data", "the grid", "the (n, k) window", "run", "output")
    model, steer, data, grid, window, run, output = add_groups(p, *titles)
    add_model_args(model, run=run)
    steer.add_argument("--steer", required=True, help=f"artifact directory, {HUB_ID}")
    data.add_argument("--memorized", required=True, help=f"candidate sequences: {DATA_HELP}")
    data.add_argument("--heldout", required=True, help="held-out text for perplexity")
    data.add_argument("--general", help="general text for re-set thresholds (with --percentiles)")
    add_data_args(data, main="--memorized")
    grid.add_argument("--deltas", default="0.25,1,4,16", help="comma-separated strengths")
    grid.add_argument(
        "--percentiles",
        help="comma-separated threshold percentiles, e.g. 90,95,99 (set on --general's text)",
    )
    grid.add_argument("--ranks", help="comma-separated ranks <= the artifact's, e.g. 1,2,4")
    grid.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="relative perplexity increase the selected point may cost (0.05: +5%%)",
    )
    add_window_args(window, "--memorized")
    data.add_argument(
        "--other-prompts",
        action="store_true",
        help="also ask for each --memorized row another way (a longer prefix, the chat "
        "template, questions), with and without --steer, and count the replies that say its "
        "window near-verbatim, into other_prompts.json / .md (greedy generation, slower)",
    )
    add_batch_args(run, batch_size=EVALUATION_BATCH_SIZE, length_help="held-out tokens per row")
    output.add_argument(
        "--out", type=directory, required=True, help="directory for sweep.json, sweep.md, sweep.png"
    )
    output.add_argument(
        "--save",
        metavar="DIR",
        help="save the selected point (its delta, rank and thresholds) as an artifact in DIR, "
        "for --steer DIR",
    )
    output.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what an earlier run wrote in --out (and the artifact in --save)",
    )


# each command's parser, by name (`gss.cli.parser` puts them in `gss --help`'s order)
PARSERS: dict[str, Callable[[Commands], None]] = {
    "evaluate": add_evaluate_parser,
    "sweep": add_sweep_parser,
}
