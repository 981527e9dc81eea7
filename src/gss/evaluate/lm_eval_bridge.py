"""lm-eval tasks on a model unsteered and with a steer attached, in one call.

Held-out perplexity is the utility gss measures itself; what users ask of a protected model is
usually a benchmark score: accuracy on multiple-choice questions, exact match on generated
answers. EleutherAI's lm-evaluation-harness (``lm-eval``, an optional dependency:
``pip install 'gated-subspace-steering[lm-eval]'``) runs those tasks; this module runs the same
tasks on the same loaded model twice, once as it is and once inside `gss.steer`, and tables the
two (`LMEvalComparison`). ``gss evaluate --lm-eval TASKS`` is the same call.

What keeps the two runs comparable: each wraps the already-loaded model in a fresh
``lm_eval.models.huggingface.HFLM`` (nothing is reloaded, and no state carries from one run to
the next); lm-eval's result cache (``use_cache``, an sqlite file keyed by the request alone,
not the model) is never used, so the steered run cannot read the unsteered run's answers;
``simple_evaluate`` re-seeds Python, NumPy and torch with the same seeds before each run, so
both see the same documents and few-shot examples. lm-eval is imported only here, and only
when called.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.metadata
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from gss.artifact.stack import Steer, steer
from gss.config import RunOptions
from gss.errors import GSSError
from gss.evaluate.decoding import eval_mode
from gss.report import markdown_table

__all__ = [
    "LM_EVAL_MISSING",
    "LMEvalComparison",
    "LMEvalTasks",
    "MetricRow",
    "check_settings",
    "lm_eval_steering",
    "lm_eval_tasks",
    "run_lm_eval",
]

LM_EVAL_MISSING = (
    "running lm-eval tasks (gss evaluate --lm-eval, gss.evaluate.lm_eval_steering) needs "
    "lm-eval (EleutherAI's lm-evaluation-harness), which is not installed: pip install "
    "'gated-subspace-steering[lm-eval]' (or pip install 'lm-eval[hf]')."
)
# how to find a task's name, said wherever one is not found
FIND_TASKS = (
    "`lm-eval ls tasks` lists lm-eval's tasks (older lm-eval: `lm_eval --tasks list`); a task "
    "of your own is a YAML file in a directory given as include_path (--lm-eval-include DIR)"
)
# simple_evaluate's arguments that lm_eval_steering sets itself, or that would break the
# comparison (use_cache: a result cache keyed by the request, not the model)
RESERVED = frozenset(
    {"model", "model_args", "tasks", "task_manager", "limit", "num_fewshot", "batch_size"}
    | {"use_cache", "bootstrap_iters"}
)
# the entries of a task's results that are not metrics
NOT_METRICS = frozenset({"alias", "name", "sample_len", "samples", " "})


def import_lm_eval() -> ModuleType:
    """``lm_eval``, or one `GSSError` saying how to install it: it is an optional dependency."""
    try:
        import lm_eval
    except ImportError:
        raise GSSError(LM_EVAL_MISSING) from None
    return lm_eval


@dataclass(frozen=True)
class LMEvalTasks:
    """Task names checked against lm-eval's index (globs expanded), and the ``TaskManager``
    that indexed them: built once, before any model loads, and used for every run."""

    names: tuple[str, ...]
    include_path: tuple[str, ...] = ()
    manager: Any = field(default=None, repr=False, compare=False)


def _split(tasks: str | Sequence[str]) -> list[str]:
    if not isinstance(tasks, str | Sequence) or any(not isinstance(t, str) for t in tasks):
        raise GSSError(
            f"lm-eval tasks are names: a string (hellaswag,arc_easy) or a list of them, got "
            f"{tasks!r}. {FIND_TASKS}."
        )
    parts = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [n.strip() for part in parts for n in str(part).split(",") if n.strip()]
    if not names:
        raise GSSError(
            f"no lm-eval task named: give task names, e.g. hellaswag,arc_easy. {FIND_TASKS}."
        )
    return names


def _expand(names: Sequence[str], known: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the names found, globs expanded, in order, once each; the names not found)."""
    index = set(known)
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        matches = sorted(fnmatch.filter(known, name)) if any(c in name for c in "*?[") else [name]
        matches = [m for m in matches if m in index]
        if not matches:
            missing.append(name)
        found += [m for m in matches if m not in found]
    return found, missing


def lm_eval_tasks(
    tasks: str | Sequence[str], include_path: str | Path | Sequence[str | Path] | None = None
) -> LMEvalTasks:
    """Check lm-eval task names (a comma-separated string or a list; globs such as
    ``mmlu_*`` expand) against lm-eval's built-in tasks and the YAML tasks under
    ``include_path``; unknown names raise one `GSSError` naming the closest ones.

    Indexing lm-eval's ~15,000 built-in tasks takes seconds, so when every name is a task under
    ``include_path`` only that directory is indexed (a group or a tag there may name built-in
    tasks, so naming one indexes everything)."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    names = _split(tasks)
    paths = [include_path] if isinstance(include_path, (str, Path)) else list(include_path or [])
    for p in paths:
        if not Path(p).is_dir():
            raise GSSError(
                f"lm-eval include path {p} is not a directory: give the directory that holds "
                "the tasks' YAML files."
            )
    include = [str(p) for p in paths]
    if include:
        local = TaskManager(include_path=include, include_defaults=False)
        subtasks = getattr(local, "all_subtasks", None)  # lm-eval >= 0.4.5 tells tasks apart
        found, missing = _expand(names, subtasks or [])
        if subtasks and not missing:
            return LMEvalTasks(tuple(found), tuple(include), local)
    manager = TaskManager(include_path=include or None)
    found, missing = _expand(names, manager.all_tasks)
    if missing:
        close = sorted(
            {c for m in missing for c in difflib.get_close_matches(m, manager.all_tasks)}
        )
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        where = f" nor under {', '.join(include)}" if include else ""
        raise GSSError(
            f"lm-eval has no task, group or tag {', '.join(map(repr, missing))} among its own"
            f"{where}{hint}: {FIND_TASKS}."
        )
    return LMEvalTasks(tuple(found), tuple(include), manager)


def check_settings(limit: float | None, num_fewshot: int | None) -> None:
    """A bad ``limit`` or ``num_fewshot`` fails before any model loads or runs."""
    if limit is not None and (
        isinstance(limit, bool)
        or not isinstance(limit, (int, float))
        or not 0 < limit < float("inf")
    ):
        raise GSSError(
            f"the lm-eval limit must be a number > 0 (documents per task, or a share of them "
            f"below 1), got {limit!r}."
        )
    if limit is not None and limit > 1 and limit != int(limit):
        raise GSSError(
            f"the lm-eval limit {limit!r} is neither a count of documents (a whole number) nor a "
            f"share of them (below 1): lm-eval would run {int(limit)} and the record say "
            f"{limit!r}. Give {int(limit)}, or a share such as 0.5."
        )
    if num_fewshot is not None and (
        isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0
    ):
        raise GSSError(
            f"the lm-eval few-shot count must be an integer >= 0 (0: none), got {num_fewshot!r}."
        )


def _evaluate_args(
    evaluate_args: Mapping[str, Any] | None, bootstrap_iters: int | None
) -> dict[str, Any]:
    """``simple_evaluate``'s further arguments, refusing those that are set here or that would
    break the comparison."""
    extra = dict(evaluate_args or {})
    if clash := sorted(RESERVED & set(extra)):
        raise GSSError(
            f"evaluate_args may not set {', '.join(clash)}: pass them as the arguments of their "
            "own name (use_cache is refused: its results, keyed by the request alone, would "
            "carry one run's answers into the other)."
        )
    import inspect

    from lm_eval import simple_evaluate

    known = inspect.signature(simple_evaluate).parameters
    if unknown := sorted(set(extra) - set(known)):
        raise GSSError(
            f"evaluate_args {unknown} are not arguments of lm_eval.simple_evaluate (this "
            f"lm-eval takes {', '.join(sorted(set(known) - RESERVED))})."
        )
    if bootstrap_iters is not None:
        whole = isinstance(bootstrap_iters, int) and not isinstance(bootstrap_iters, bool)
        if not whole or bootstrap_iters < 0:  # -1 would drop the stderr from the table
            raise GSSError(f"bootstrap_iters must be an integer >= 0, got {bootstrap_iters!r}.")
        extra["bootstrap_iters"] = bootstrap_iters
    extra.setdefault("log_samples", False)  # per-document outputs: kept only when asked
    return extra


def _check_hflm(batch_size: int | str, model_args: Mapping[str, Any] | None) -> None:
    """lm-eval's model wrapper's arguments that gss sets, or that it would refuse from deep
    inside, refused before any run."""
    counted = isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1
    if not (counted or isinstance(batch_size, str)):
        raise GSSError(
            f"batch_size must be an integer >= 1 (or lm-eval's 'auto'), got {batch_size!r}."
        )
    if clash := sorted({"pretrained", "tokenizer", "batch_size"} & set(model_args or {})):
        raise GSSError(
            f"model_args may not set {', '.join(clash)}: the model is the one given, and "
            "tokenizer and batch_size are arguments of their own name."
        )


@contextmanager
def _quiet_hflm() -> Iterator[None]:
    """lm-eval warns, on every wrap of a loaded model, that model arguments are ignored: here
    none are given, so that warning says nothing."""
    logger = logging.getLogger("lm_eval.models.huggingface")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# lm-eval's modules that draw progress bars with the tqdm they import
_BAR_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


@contextmanager
def _bars(progress: bool) -> Iterator[None]:
    """With ``progress`` False, lm-eval's progress bars (and those of `datasets`, loading the
    tasks' data) off while it runs: lm-eval has no switch for them, so the ``tqdm`` its modules
    imported, and the package's own (imported inside its bootstrap), is one that is disabled,
    for the run only."""
    if progress:
        yield
        return
    import importlib

    import datasets
    import tqdm

    modules = [importlib.import_module(m) for m in _BAR_MODULES]
    saved = [(m, m.tqdm) for m in (*modules, tqdm) if hasattr(m, "tqdm")]

    def quiet(bar: Any) -> Any:  # a subclass: code may subclass or isinstance-check tqdm
        class Quiet(bar):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "disable": True})

        return Quiet

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    for module, bar in saved:
        module.tqdm = quiet(bar)
    try:
        yield
    finally:
        for module, bar in saved:
            module.tqdm = bar
        if shown:
            datasets.enable_progress_bars()


def run_lm_eval(
    model: torch.nn.Module,
    tasks: str | Sequence[str] | LMEvalTasks,
    *,
    tokenizer: Any = None,
    include_path: str | Path | Sequence[str | Path] | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = RunOptions.batch_size,
    bootstrap_iters: int | None = None,
    model_args: Mapping[str, Any] | None = None,
    evaluate_args: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """One lm-eval run of ``model`` as it is now (inside ``gss.steer(model, artifact)`` it runs
    steered): lm-eval's ``simple_evaluate`` on ``HFLM(pretrained=model, tokenizer=...)``.

    ``tokenizer``: the model's (None: lm-eval loads the one saved with it); ``limit``: documents
    per task (a fraction below 1); ``num_fewshot``: None for each task's own;
    ``bootstrap_iters``: None for lm-eval's default (100,000 resamples for the stderr of
    metrics that are not means; 0 skips them); ``model_args``: more ``HFLM`` arguments
    (``max_length``, ``add_bos_token``, ...); ``evaluate_args``: more ``simple_evaluate``
    arguments (``apply_chat_template``, ``gen_kwargs``, ...), never ``use_cache``;
    ``progress``: False turns lm-eval's progress bars off for the run.
    Returns lm-eval's result dict (``results``, ``higher_is_better``, ``n-samples``, ...)."""
    lm_eval = import_lm_eval()
    try:
        from lm_eval.models.huggingface import HFLM
    except ImportError as e:  # lm-eval without its [hf] extra lacks accelerate
        raise GSSError(
            f"lm-eval's transformers model (HFLM) does not import ({e}): pip install "
            "'gated-subspace-steering[lm-eval]' (or pip install 'lm-eval[hf]')."
        ) from None

    if not isinstance(model, torch.nn.Module):
        raise GSSError(
            f"the model must be a loaded torch.nn.Module, got {type(model).__name__}: load it "
            "first (gss.hf.loading.load_model(path) or AutoModelForCausalLM.from_pretrained)."
        )
    check_settings(limit, num_fewshot)
    extra = _evaluate_args(evaluate_args, bootstrap_iters)
    _check_hflm(batch_size, model_args)
    selected = tasks if isinstance(tasks, LMEvalTasks) else lm_eval_tasks(tasks, include_path)
    with eval_mode(model):  # HFLM puts the model in eval mode; its own mode comes back after
        with _quiet_hflm():
            lm = HFLM(
                pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **(model_args or {})
            )
        try:
            with _bars(progress):
                results = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=list(selected.names),
                    task_manager=selected.manager,
                    limit=limit,
                    num_fewshot=num_fewshot,
                    **extra,
                )
        except (FileNotFoundError, ConnectionError) as err:  # datasets, loading a task's data
            raise GSSError(
                f"lm-eval could not load the data of {', '.join(selected.names)}: {err}. A local "
                "task's data_files must exist; a Hub dataset must be reachable, or, offline "
                "(HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), in your datasets cache: run it once "
                "online."
            ) from None
    if results is None:  # a rank other than 0 of a distributed run
        raise GSSError("lm-eval returned no results: run it in one process.")
    return dict(results)


@dataclass(frozen=True)
class MetricRow:
    """One metric of one task: unsteered, steered (None without a steer) and their stderr
    (None where lm-eval gives none); `filter`: lm-eval's answer filter ("none" for most)."""

    task: str
    metric: str
    filter: str
    unsteered: float | None
    steered: float | None = None
    unsteered_stderr: float | None = None
    steered_stderr: float | None = None
    higher_is_better: bool | None = None

    @property
    def difference(self) -> float | None:
        """steered - unsteered, when both are numbers."""
        if self.unsteered is None or self.steered is None:
            return None
        return self.steered - self.unsteered

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "metric": self.metric,
            "filter": self.filter,
            "unsteered": self.unsteered,
            "unsteered_stderr": self.unsteered_stderr,
            "steered": self.steered,
            "steered_stderr": self.steered_stderr,
            "difference": self.difference,
            "higher_is_better": self.higher_is_better,
        }


def _number(value: Any) -> float | None:
    """A finite metric value as a float; None for lm-eval's "N/A" and for NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _plain(value: Any) -> Any:
    """lm-eval's result dict as JSON: numbers (NumPy's too; NaN as null), strings, lists, dicts;
    anything else (a task's Python functions) as its repr."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return _number(value) if isinstance(value, float) else value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # a NumPy scalar
        return _plain(value.item())
    return repr(value)


def _metrics(
    results: Mapping[str, Any],
) -> dict[tuple[str, str, str], tuple[float | None, float | None]]:
    """(task, metric, filter) -> (value, stderr), in lm-eval's order."""
    out: dict[tuple[str, str, str], tuple[float | None, float | None]] = {}
    for task, entries in results.get("results", {}).items():
        for key, value in entries.items():
            if key in NOT_METRICS or "," not in key or "_stderr," in key:
                continue
            metric, filter_ = key.split(",", 1)
            stderr = entries.get(f"{metric}_stderr,{filter_}")
            out[(task, metric, filter_)] = (_number(value), _number(stderr))
    return out


# what is kept of lm-eval's result dict in the record (its configs, samples and environment
# are lm-eval's own report, not the comparison's)
KEPT = (
    "results",
    "groups",
    "group_subtasks",
    "higher_is_better",
    "n-shot",
    "n-samples",
    "versions",
)


@dataclass(frozen=True)
class LMEvalComparison:
    """lm-eval's results on the model unsteered and, with a steer, steered.

    `unsteered`, `steered`: lm-eval's result dicts (`run_lm_eval`; `steered` None without a
    steer); `gate_open_share`: the share of positions where the steered run's gate opened;
    `settings`: how the runs were made (the steer's options the steered run overrode, its
    ``delta``; limit, few-shot, batch size, lm-eval's version).
    """

    tasks: tuple[str, ...]
    unsteered: dict[str, Any] = field(repr=False)
    steered: dict[str, Any] | None = field(default=None, repr=False)
    gate_open_share: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def rows(self) -> list[MetricRow]:
        """One row per task and metric, in lm-eval's order."""
        base = _metrics(self.unsteered)
        steered = _metrics(self.steered) if self.steered is not None else {}
        better = self.unsteered.get("higher_is_better", {})
        rows = []
        for (task, metric, filter_), (value, stderr) in base.items():
            s_value, s_stderr = steered.get((task, metric, filter_), (None, None))
            higher = better.get(task, {}).get(metric)
            rows.append(
                MetricRow(
                    task,
                    metric,
                    filter_,
                    value,
                    s_value,
                    stderr,
                    s_stderr,
                    higher if isinstance(higher, bool) else None,
                )
            )
        return rows

    def table(self) -> str:
        """A Markdown table: task, metric, unsteered, steered, steered - unsteered, and which
        way is better; a value's stderr follows it (±) where lm-eval gives one."""

        def shown(value: float | None, stderr: float | None = None) -> str:
            if value is None:
                return "n/a"
            return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")

        with_steer = self.steered is not None
        rows = []
        for r in self.rows():
            metric = r.metric if r.filter == "none" else f"{r.metric} ({r.filter})"
            row = [r.task, metric, shown(r.unsteered, r.unsteered_stderr)]
            if with_steer:
                d = r.difference
                row += [shown(r.steered, r.steered_stderr), "n/a" if d is None else f"{d:+.4f}"]
            row.append({True: "higher", False: "lower", None: ""}[r.higher_is_better])
            rows.append(row)
        header = ["task", "metric", "unsteered"]
        header += ["steered", "difference"] if with_steer else []
        return markdown_table([*header, "better"], rows)

    def record(self, model: str | None = None, steer: str | None = None) -> dict[str, Any]:
        """The JSON record: what was evaluated (``model``, ``steer``: as given), the settings,
        the rows, the gate open share, and the part of lm-eval's own result dicts that holds
        the numbers (results, groups, higher_is_better, n-shot, n-samples, versions)."""
        runs = {"unsteered": self.unsteered, "steered": self.steered}
        return {
            "model": model,
            "steer": steer,
            "tasks": list(self.tasks),
            **_plain(self.settings),
            "gate_open_share": self.gate_open_share,
            "rows": [r.to_dict() for r in self.rows()],
            "lm_eval": {
                name: None if run is None else {k: _plain(run[k]) for k in KEPT if k in run}
                for name, run in runs.items()
            },
        }


def lm_eval_steering(
    model: torch.nn.Module,
    artifact: Steer | None,
    tasks: str | Sequence[str] | LMEvalTasks,
    *,
    tokenizer: Any = None,
    include_path: str | Path | Sequence[str | Path] | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    batch_size: int | str = RunOptions.batch_size,
    delta: float | None = None,
    bootstrap_iters: int | None = None,
    model_args: Mapping[str, Any] | None = None,
    evaluate_args: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> LMEvalComparison:
    """lm-eval ``tasks`` on ``model`` unsteered, then with ``artifact`` (a `SteeringArtifact`
    or a `SteeringStack`; None: the unsteered run alone) attached at strength ``delta`` (None:
    its own): the same documents, few-shot examples and seeds, so the table's differences are
    the steer's. The arguments are `run_lm_eval`'s; ``tasks`` is checked before any run."""
    import_lm_eval()
    check_settings(limit, num_fewshot)
    _evaluate_args(evaluate_args, bootstrap_iters)  # refused before any run
    _check_hflm(batch_size, model_args)
    options: dict[str, Any] = {"delta": delta} if delta is not None else {}
    if artifact is not None:
        artifact.check_model(model)  # a foreign artifact fails before the unsteered run
        if options:
            artifact.attach(model, **options).remove()  # a bad delta fails before it too
    selected = tasks if isinstance(tasks, LMEvalTasks) else lm_eval_tasks(tasks, include_path)

    def run() -> dict[str, Any]:
        return run_lm_eval(
            model,
            selected,
            tokenizer=tokenizer,
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            bootstrap_iters=bootstrap_iters,
            model_args=model_args,
            evaluate_args=evaluate_args,
            progress=progress,
        )

    unsteered = run()
    steered = None
    share = None
    if artifact is not None:
        with steer(model, artifact, track_gates=True, **options) as handle:
            steered = run()
            share = handle.gate_stats()["any_open_share"]
    settings = {
        **({"options": options} if artifact is not None and options else {}),  # the delta
        "limit": limit,
        "num_fewshot": num_fewshot,
        "batch_size": batch_size,
        "include_path": list(selected.include_path),
        "lm_eval_version": importlib.metadata.version("lm_eval"),
    }
    return LMEvalComparison(selected.names, unsteered, steered, share, settings)
