"""Protect's cost: the search issue 72 made beside the search as it was before, side by side.

Issue 72 holds every searched point to more than the budget (the perplexity of the data's
clean rows, the reference's continuations), checks the best points' replies, sets the gates
on ordinary English too and ranks points by what the reference would say; its goal for the
cost: at most 1.5x the search before it on the canaries. Two arms on the same models and rows,
run in turn (a fresh order each round):

- ``issue 72``: `gss.protect`'s defaults;
- ``before issue 72``: the choice rules before it (``prefer="margin"``, no replies check, no
  ordinary English among the gates' sources, gates set for 5% of general tokens, the strength
  range ending at delta 100) and no per-point checks (`search_checks` returns none).

Both arms run today's code otherwise (the audit, the cached reference text, the replayed
blocks below a steer, the held-out report), so the ratio is the cost of issue 72's search, not
of everything that changed since. Each arm records protect's own split of its time: its steps,
the search's stages and the search's kinds of work (`Protection.search_seconds`).

The real run is the plain canary fine-tune of `gss bench canaries` (SmolLM2-135M, seed 0; fine-
tuned once if not cached), protected as that bench does; ``--quick`` the TinyMem quick models
of math noise (trained into the TinyMem cache, ``$GSS_CACHE_DIR``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from torch import nn

from gss.protect import SearchSpace, protect
from gss.report import markdown_table
from gss_bench.perf.common import interleaved, log, paired_ratios, summary

BEFORE = "before issue 72"
AFTER = "issue 72"
# the search space before issue 72 (docs/protect.md): what its arm changes from the defaults
BEFORE_SPACE = SearchSpace(
    prefer="margin",
    reply_check=0,
    ordinary_english=0,
    gate_share=0.05,
    delta_ceiling=100.0,
    handoff_unchanged=None,  # no step 8 before issue 72
)
QUICK_SPACE: dict[str, Any] = {"max_blocks": 1, "ranks": (4,), "gates": ("hard",), "steps": 3}


@contextmanager
def without_point_checks() -> Iterator[None]:
    """Protect's search with no per-point check besides the utility (as before issue 72)."""
    from gss.protect import stages
    from gss.protect.checks import DomainRows

    original = stages.search_checks

    def none(s: Any, config: Any, split: Any) -> tuple[dict[str, Any], DomainRows]:
        return {}, DomainRows([], [], s.pad_id, s.batch_size)

    stages.search_checks = none
    try:
        yield
    finally:
        stages.search_checks = original


def canary_setup() -> tuple[nn.Module, nn.Module, dict[str, Any], str]:
    """The plain canary fine-tune, its base and protect's arguments as `gss bench canaries
    --protect` passes them."""
    from gss.hf.blocks import find_decoder_blocks
    from gss_bench.canaries.finetune import FinetuneConfig
    from gss_bench.canaries.protection import protect_arguments
    from gss_bench.canaries.run import (
        CALIBRATION_CLEAN_ROWS,
        PPL_TOLERANCE,
        default_cache,
        default_setup,
        default_train_blocks,
        finetuned,
    )

    base_path, base, tokenizer, data, pad = default_setup()
    blocks = default_train_blocks(len(find_decoder_blocks(base)))
    config = FinetuneConfig(train_blocks=blocks, seed=0)
    model, info = finetuned(base, base_path, data, config, pad, default_cache(), tokenizer)
    rows = [*data.canary_rows, *data.finetune_rows[:CALIBRATION_CLEAN_ROWS]]
    arguments = protect_arguments(data, tokenizer, rows, PPL_TOLERANCE, batch_size=16)
    return (
        model,
        base,
        arguments,
        f"canaries, plain fine-tune of {base_path.name} ({info['cache']})",
    )


def quick_setup() -> tuple[nn.Module, nn.Module, dict[str, Any], str]:
    """TinyMem's quick math-noise models (trained once into the TinyMem cache)."""
    from gss_bench.tinymem.protection import protect_arguments
    from gss_bench.tinymem.train import get_models

    model, reference, data, _ = get_models("math_noise", "quick", 0, progress=False)
    return model, reference, protect_arguments(data, 64), "TinyMem quick, math noise, seed 0"


def arms(
    model: nn.Module, reference: nn.Module, arguments: dict[str, Any], quick: bool
) -> tuple[dict[str, Callable[[], float]], dict[str, dict[str, Any]]]:
    """The two arms (each returns its wall seconds) and where each arm's last run keeps
    protect's own record of its time and its choice."""
    narrow = QUICK_SPACE if quick else {}
    spaces = {AFTER: replace(SearchSpace(), **narrow), BEFORE: replace(BEFORE_SPACE, **narrow)}
    records: dict[str, dict[str, Any]] = {}

    def arm(name: str) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            checks = without_point_checks() if name == BEFORE else _nothing()
            with checks:
                result = protect(model, reference, search=spaces[name], progress=False, **arguments)
            seconds = time.perf_counter() - start
            c = result.chosen
            records[name] = {
                "seconds": result.seconds,
                "search_seconds": result.search_seconds,
                "points": len(result.trials),
                "chosen": None
                if c is None
                else f"{c.preset} {'+'.join(map(str, c.blocks))}, delta "
                f"{'+'.join(f'{d:.3g}' for d in c.deltas)}, rank {c.rank}, {c.gate}",
                "heldout_after": result.after.get("memorized"),
            }
            return seconds

        return run

    return {name: arm(name) for name in spaces}, records


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def run(repeats: int | None, progress: bool, quick: bool) -> dict[str, Any]:
    model, reference, arguments, name = quick_setup() if quick else canary_setup()
    timed, records = arms(model, reference, arguments, quick)
    # each arm is a whole protect run (minutes on the canaries): no warm-up round
    times = interleaved(timed, repeats=repeats or 1, warmup=0, desc="protect", progress=progress)
    ratio = summary(paired_ratios(times[AFTER], times[BEFORE]))
    log(f"protect on {name}: issue 72's search / before = {ratio['median']:.2f}x")
    return {
        "setup": name,
        "seconds": {arm: summary(ts) for arm, ts in times.items()},
        "ratio": ratio,
        "arms": records,
        "before_space": {k: v for k, v in asdict(BEFORE_SPACE).items() if k in _CHANGED},
        "goal": "issue 72's search at most 1.5x the search before it (ratio <= 1.5)",
    }


_CHANGED = (
    "prefer",
    "reply_check",
    "ordinary_english",
    "gate_share",
    "delta_ceiling",
    "handoff_unchanged",
)


def table(result: dict[str, Any]) -> str:
    """One row per arm: wall time, protect's steps, and the search's stages and work."""
    body = []
    for arm, record in result["arms"].items():
        steps, split = record["seconds"], record["search_seconds"]
        body.append(
            [
                arm,
                f"{result['seconds'][arm]['median']:.0f}",
                *(
                    f"{steps.get(k, 0.0):.0f}"
                    for k in ("audit", "general_text", "search", "handover", "report")
                ),
                _parts(split.get("stages", {})),
                _parts(split.get("work", {})),
                str(record["points"]),
                record["chosen"] or "-",
            ]
        )
    head = ["arm", "wall s", "audit s", "general text s", "search s", "hand-over rule s"]
    head += ["report s"]
    head += ["search by stage (s)", "search by kind of work (s)", "points", "chosen"]
    ratio = result["ratio"]
    return (
        f"On {result['setup']}. Issue 72's search over the search before it: "
        f"**{ratio['median']:.2f}x** wall time (range {ratio['min']:.2f}-{ratio['max']:.2f} over "
        f"{ratio['n']} round(s)).\n\n" + markdown_table(head, body) + "\n"
    )


def _parts(seconds: dict[str, float]) -> str:
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {value:.0f}" for name, value in ranked) or "-"


def figure(result: dict[str, Any], path: Path) -> Path:
    """Each arm's search split by kind of work (stacked bars)."""
    from gss.report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(result["arms"])
    kinds = list(
        dict.fromkeys(
            k for r in result["arms"].values() for k in r["search_seconds"].get("work", {})
        )
    )
    left = [0.0] * len(names)
    for kind in kinds:
        widths = [result["arms"][n]["search_seconds"].get("work", {}).get(kind, 0.0) for n in names]
        ax.barh(names, widths, left=left, label=kind)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds of the search")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"gss protect: where the search's time goes ({result['setup'][:40]})", fontsize=9)
    return save_figure(fig, path)
