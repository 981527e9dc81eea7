"""Each method's chosen point on TinyMem, leaked the ways an attacker finds (issue 70).

The table counts a row memorized when greedy decoding from its prompt reproduces its window
exactly: the weakest attacker, and the one an exact n-gram filter (MemFree) defeats by
construction. ``gss bench tinymem --leak-modes`` measures the same rows, for every method's
chosen point, in each mode of `MODES`:

- greedy exact: the table's own count, decoded again here (the same rows, the same verdicts);
- near-verbatim: one run of 80% of the window's tokens anywhere in the greedy reply (the window
  and `EXTRA_TOKENS` more): a filter that changes one token in n does not hide the rest;
- sampled: 100 draws at temperature 1, or with top-p 0.9, reproduce the window with a chance of
  50% or more (`gss.evaluate.sampled`, exact and teacher-forced; through the hand-over's
  processor step by step);
- longer prefix: the prompt and the window's first quarter given; the rest near-verbatim;
- shorter prefix: the prompt without its first quarter (a backdoor's trigger, at its end, kept);
  the window near-verbatim in the reply.

TinyMem's vocabularies have no chat template and its rows no structured secret, so the chat,
question and exposure modes are the canaries' (`results/canaries-protect`). A noised math row
shares most of its tokens with the clean sequence any model continues, so near-verbatim and
the prefix modes find rows in the reference too: each share comes with the rows the reference,
trained without them, does not also leak, and every count with its rows and exact 95% interval.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import nn

from gss.artifact.stack import Steer
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.intervals import clopper_pearson
from gss.evaluate.leaks import EXTRA_TOKENS
from gss.evaluate.memorization import CountedWindow, nk_windows, trigger_windows
from gss.evaluate.near_verbatim import near_verbatim_ids
from gss.evaluate.sampled import LIKELY, TOP_P, Processor, sampled_chance, sampler_logprobs
from gss.hf.forward import context_length
from gss.inference.handoff import recommended_gates, reference_where_open
from gss.report import markdown_table
from gss_bench.baselines import Mitigation, MitigationData, get_method
from gss_bench.tinymem.data import TinyMemData
from gss_bench.tinymem.protection import PROTECT

GREEDY = "greedy exact"
NEAR = "near-verbatim"
SAMPLED = "sampled, T = 1"
NUCLEUS = f"sampled, top-p {TOP_P:g}"
LONGER = "longer prefix"
SHORTER = "shorter prefix"
MODES = (GREEDY, NEAR, SAMPLED, NUCLEUS, LONGER, SHORTER)
ANY = "any mode"
REFERENCE = "Reference"  # the method whose leaks every other's are read against

# how a method is set up for the measure: a context that yields the model to decode and the
# processor its generations run (None: none), undone on leaving
Setup = Callable[[], AbstractContextManager[tuple[nn.Module, Processor | None]]]


@dataclass(frozen=True)
class Measured:
    """A method to measure: how to set it up, its table utility (None: not measured by the
    table's rule) and its chosen point, in words."""

    setup: Setup
    utility: float | None = None
    point: str = ""


def windows(data: TinyMemData) -> list[CountedWindow]:
    """The rows the table counts, prompted as it prompts them (`gss.evaluate.memorization`):
    noise, the clean twin's first tokens and the noised row's window where it differs from the
    twin's; backdoor, the clean twin up to its trigger and the backdoored row after it."""
    cfg = data.config
    if data.noised:
        return nk_windows(data.noised, data.clean_twins, cfg.prompt_len, cfg.window)
    return trigger_windows(data.poison_test, data.poison_clean_twins, data.trigger, cfg.window)


def leaks(
    model: nn.Module,
    rows: Sequence[CountedWindow],
    pad_id: int,
    batch_size: int,
    processor: Processor | None = None,
) -> dict[str, list[bool]]:
    """Per mode, whether each row leaks from ``model`` as it is now (hooks included); every
    step's scores through ``processor`` where given (`gss.reference_where_open`'s)."""

    limit = context_length(model)

    def replies(prompts: list[list[int]], width: int) -> list[list[int]]:
        # the extra tokens stop at the model's context (a row and its window fit in it)
        room = width if limit is None else limit[0] - max(len(p) for p in prompts)
        return greedy_generate(
            model,
            prompts,
            min(width, room),
            pad_id=pad_id,
            batch_size=batch_size,
            processor=processor,
        )

    width = max(len(w.target) for w in rows) + EXTRA_TOKENS
    said = replies([w.prompt for w in rows], width)
    out = {
        GREEDY: [s[: len(w.target)] == w.target for s, w in zip(said, rows, strict=True)],
        NEAR: [near_verbatim_ids(w.target, s) for s, w in zip(said, rows, strict=True)],
    }
    pairs = [(w.prompt, w.target) for w in rows]
    logprobs = sampler_logprobs(model, pairs, pad_id, batch_size, processor)
    for name, sampler in ((SAMPLED, "temperature_1"), (NUCLEUS, "top_p")):
        out[name] = [sampled_chance(lp) >= LIKELY for lp in logprobs[sampler]]
    # the longer prefix: a quarter of the window more; rows whose window that would empty
    # count as not leaking under it (a window of one token is the greedy mode's)
    cut = [max(len(w.target) // 4, 1) for w in rows]
    longer = replies([w.prompt + w.target[:m] for w, m in zip(rows, cut, strict=True)], width)
    out[LONGER] = [
        len(w.target) > m and near_verbatim_ids(w.target[m:], s)
        for w, m, s in zip(rows, cut, longer, strict=True)
    ]
    drop = [len(w.prompt) // 4 for w in rows]
    shorter = replies([w.prompt[d:] for w, d in zip(rows, drop, strict=True)], width)
    out[SHORTER] = [near_verbatim_ids(w.target, s) for w, s in zip(rows, shorter, strict=True)]
    return out


def setups(
    model: nn.Module,
    reference: nn.Module,
    record: dict[str, Any],
    steer: Steer | None,
    mitigated: dict[str, tuple[Mitigation, MitigationData]],
) -> dict[str, Measured]:
    """The methods a run measured, set up as chosen: the unmitigated model and the reference,
    gss protect's steer and its hand-over by the rule step 8 recorded (where it chose one),
    and each baseline's chosen point (``mitigated``: its Mitigation and data, a hook method
    run again)."""
    methods = record["methods"]

    def plain(m: nn.Module) -> Setup:
        return lambda: nullcontext((m, None))

    out = {
        "Unmitigated": Measured(plain(model), record["unmitigated"]["utility"]),
        REFERENCE: Measured(plain(reference), record["reference"]["utility"]),
    }
    if steer is not None:
        protected = methods[PROTECT]["selected"]
        point = " ".join(f"{k}={v}" for k, v in protected["params"].items())

        @contextmanager
        def steered() -> Iterator[tuple[nn.Module, None]]:
            with steer.attach(model):
                yield model, None

        out[PROTECT] = Measured(steered, protected["eval"]["utility"], point)
        rule = recommended_gates(steer)
        if rule is not None:

            @contextmanager
            def handed() -> Iterator[tuple[nn.Module, Processor]]:
                gates = steer if rule == "steer" else None
                with reference_where_open(model, gates, reference) as processor:
                    yield model, processor

            out[f"{PROTECT}, the reference where open"] = Measured(handed, None, f"rule {rule}")
    for name, (made, data) in mitigated.items():
        chosen = methods[name]["selected"]

        @contextmanager
        def mitigation(
            made: Mitigation = made, data: MitigationData = data, name: str = name
        ) -> Iterator[tuple[nn.Module, None]]:
            again = made.model is model  # a hook method: its hook was removed after the sweep
            used = get_method(name).run(model, data, **made.params) if again else made
            try:
                yield used.model, None
            finally:
                used.remove()

        params = " ".join(f"{k}={v}" for k, v in chosen.get("params", {}).items())
        out[name] = Measured(mitigation, chosen["eval"]["utility"], params)
    return out


def measure(
    methods: dict[str, Measured],
    data: TinyMemData,
    batch_size: int,
    heldout: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Every method's leaks per mode on the counted rows (``methods`` holds `REFERENCE`), and
    their counts over all rows and over ``heldout`` (row indices: the rows gss protect held
    out of its search)."""
    rows = windows(data)
    flags: dict[str, dict[str, list[bool]]] = {}
    for name, method in methods.items():
        with method.setup() as (model, processor):
            flags[name] = leaks(model, rows, data.pad_id, batch_size, processor)
    subsets = {"all": [True] * len(rows)}
    if heldout is not None:
        wanted = set(heldout)
        subsets["heldout"] = [w.index in wanted for w in rows]
    return {
        "rows": len(rows),
        "heldout_rows": sum(subsets["heldout"]) if "heldout" in subsets else None,
        "methods": {
            name: {
                "utility": method.utility,
                "point": method.point,
                "summary": {
                    subset: summary(flags[name], flags[REFERENCE], keep)
                    for subset, keep in subsets.items()
                },
                "per_row": {mode: [int(f) for f in v] for mode, v in flags[name].items()},
            }
            for name, method in methods.items()
        },
        "index": [w.index for w in rows],
    }


def summary(
    flags: dict[str, list[bool]], reference: dict[str, list[bool]], keep: Sequence[bool]
) -> dict[str, dict[str, Any]]:
    """Per mode and for any mode, over the rows ``keep`` marks: how many leak, of how many, the
    95% interval of the share, and how many of them the reference does not also leak."""

    def one(mine: list[bool], theirs: list[bool]) -> dict[str, Any]:
        kept = [(a, b) for a, b, k in zip(mine, theirs, keep, strict=True) if k]
        leaked = sum(a for a, _ in kept)
        low, high = clopper_pearson(leaked, len(kept))
        return {
            "leaked": leaked,
            "rows": len(kept),
            "share": 100.0 * leaked / len(kept) if kept else float("nan"),
            "interval": [100.0 * low, 100.0 * high],
            "beyond_reference": sum(a and not b for a, b in kept),
        }

    out = {mode: one(flags[mode], reference[mode]) for mode in MODES}
    pooled = [any(f) for f in zip(*(flags[m] for m in MODES), strict=True)]
    pooled_ref = [any(f) for f in zip(*(reference[m] for m in MODES), strict=True)]
    out[ANY] = one(pooled, pooled_ref)
    return out


HEADER = """# Leaks the ways an attacker finds them (`gss bench tinymem --leak-modes`)

Each method at its chosen point, on the rows the table counts: `leaked/rows (95% interval)` per
mode (gss_bench/tinymem/leak_modes.py says each), any mode, and how many of any mode's rows the
reference, trained without them, does not also leak. Utility is the table's (test half); the
hand-over changes generation only, and the table's utility is teacher-forced: "-".

"""


def cell(entry: dict[str, Any]) -> str:
    """``leaked/rows`` with the share's 95% interval."""
    low, high = entry["interval"]
    return f"{entry['leaked']}/{entry['rows']} ({low:.1f}-{high:.1f}%)"


def table(by_method: dict[str, dict[str, Any]], subset: str) -> str:
    """One row per method over ``subset`` ("all" or "heldout" rows): each mode's leaks, any
    mode's, and those the reference does not also leak."""
    header = ["method", "utility", *MODES, ANY, "any, not by the reference"]
    body = []
    for name, measured in by_method.items():
        counts = measured["summary"][subset]
        body.append(
            [
                name + (f" ({measured['point']})" if measured.get("point") else ""),
                "-" if measured["utility"] is None else f"{measured['utility']:.2f}",
                *(cell(counts[m]) for m in (*MODES, ANY)),
                str(counts[ANY]["beyond_reference"]),
            ]
        )
    return markdown_table(header, body)


def tables(records: Sequence[dict[str, Any]]) -> str:
    """Every run's leak-mode tables (those measured with ``--leak-modes``), all rows and, for
    the noise settings, the rows `gss protect` held out of its search."""
    parts = []
    for r in records:
        measured = r.get("leak_modes")
        if not measured:
            continue
        title = f"{r['setting']}, seed {r['seed']}"
        parts.append(f"### {title}: every counted row\n\n" + table(measured["methods"], "all"))
        if measured.get("heldout_rows"):
            parts.append(
                f"### {title}: the {measured['heldout_rows']} rows gss protect held out\n\n"
                + table(measured["methods"], "heldout")
            )
    return "\n\n".join(parts)
