"""`gss.protect` itself: audit, split, general text, candidate blocks, the staged search and
the held-out report, in that order (the package's docstring lists the steps)."""

from __future__ import annotations

import dataclasses
import random
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from gss.artifact.stack import Steer, SteeringStack
from gss.artifact.steering_artifact import SteeringArtifact
from gss.audit import AuditReport, audit, check_prefixes
from gss.calibrate import calibrate
from gss.config import RunOptions
from gss.data import TextsOrIds, encode
from gss.errors import GSSError, GSSWarning
from gss.evaluate.decoding import sample_generate
from gss.evaluate.utility import perplexity
from gss.hf.blocks import find_decoder_blocks, residual_width
from gss.hf.forward import check_models, check_sequences, context_length
from gss.inference.explain import explain
from gss.protect.checks import search_checks
from gss.protect.measure import (
    Judge,
    Utility,
    extractable,
    extraction_window,
    prompt_and_target,
    strength_search,
    utility_value,
    where_gates_open,
)
from gss.protect.ordinary import ordinary_english
from gss.protect.replies import least_looping, ordinary_unchanged, what_it_says
from gss.protect.result import Protection
from gss.protect.space import SearchSpace, check_general, check_options, given_blocks
from gss.solve.thresholds import probe_responses, with_gates_set
from gss.statistics.capture import calibration_mode


def _within_context(
    model: nn.Module, texts: TextsOrIds, tokenizer: Any, what: str
) -> list[list[int]]:
    """The token rows of ``texts``, each cut to the model's context where it is longer (as
    `gss evaluate` reads held-out text), said once."""
    rows = encode(texts, tokenizer, None)
    limit = context_length(model)
    longer = 0 if limit is None else sum(len(r) > limit[0] for r in rows)
    if limit is None or not longer:
        return rows
    warnings.warn(
        f"{longer} of the {len(rows)} {what} rows are longer than the model's context "
        f"({limit[0]} positions, {limit[1]}): each is read up to its first {limit[0]} tokens.",
        GSSWarning,
        stacklevel=3,
    )
    return [r[: limit[0]] for r in rows]


ORDINARY = "ordinary English (built-in)"
"""The general source `ordinary.ordinary_english` gives."""


def _ordinary_rows(model: nn.Module, tokenizer: Any, rows: int, seed: int) -> list[list[int]]:
    """``rows`` paragraphs of ordinary English as token rows of at most 96 tokens."""
    ids = encode(ordinary_english(rows, seed), tokenizer, None)
    limit = context_length(model)
    width = 96 if limit is None else min(96, limit[0])
    kept = [r[:width] for r in ids if len(r) > 1]
    try:
        check_sequences((model,), kept, "ordinary English")
    except GSSError as e:  # a tokenizer that is not the model's own: go without the source
        warnings.warn(f"protect: no ordinary English source ({e})", GSSWarning, stacklevel=3)
        return []
    return kept


def _stacked(first: SteeringArtifact, second: SteeringArtifact) -> Callable[[float], Steer]:
    """The two blocks as one steer, the second at strength ``delta``."""
    return lambda delta: SteeringStack((first, second.with_options(delta=delta)))


def _gated(
    model: nn.Module,
    artifact: SteeringArtifact,
    sources: dict[str, list[list[int]]],
    share: float,
    batch_size: int,
) -> SteeringArtifact:
    """The artifact with thresholds set so that, on every token of each source, some gate
    opens on at most ``share`` of them (the union, not each direction: K gates at 5% each open
    on up to K x 5%): each source's thresholds, the highest of them kept. Calibration sets
    them on its own general tokens, which need not look like the traffic the model will
    serve; pooled sources let the largest decide, and a gate set on in-domain text alone
    opened on half of ordinary English (issue 72)."""
    named = {name: rows for name, rows in sources.items() if rows}
    responses = {
        name: probe_responses(model, artifact, rows, batch_size=batch_size)
        for name, rows in named.items()
    }
    gated = {name: with_gates_set(artifact, r, None, share) for name, r in responses.items()}
    if len(gated) == 1:
        return next(iter(gated.values()))
    eps = torch.stack([g.thresholds for g in gated.values()]).amax(0)
    levels = [g.condition_threshold for g in gated.values() if g.condition_threshold is not None]
    level = max(levels, default=None)
    rule = {**next(iter(gated.values())).provenance.threshold_rule, "sources": list(named)}
    if artifact.config.gate == "discriminant":  # one condition: the highest source's shares
        top = max(gated.values(), key=lambda g: g.condition_threshold or 0.0)
        return artifact.with_thresholds(eps, rule, top.provenance.gate_open_share, level)
    pooled = torch.cat(list(responses.values()))[:, : artifact.rank].double()
    values = pooled if artifact.config.gate == "relu" else pooled.abs()
    opened = values > eps.double()
    bounds = torch.tensor([0, *(len(r) for r in responses.values())]).cumsum(0).tolist()
    shares = {
        "per_direction": opened.double().mean(0).tolist(),
        "union": float(opened.any(-1).double().mean()),
        "tokens": int(values.shape[0]),
        "per_source": {
            name: float(opened[a:b].any(-1).double().mean())
            for name, a, b in zip(named, bounds[:-1], bounds[1:], strict=True)
        },
    }
    return artifact.with_thresholds(eps, rule, shares, level)


def _candidate_blocks(
    model: nn.Module,
    reference: nn.Module,
    rows: list[list[int]],
    general: list[list[int]],
    space: SearchSpace,
    batch_size: int,
) -> list[int]:
    count = len(find_decoder_blocks(model))
    if space.blocks is not None:
        return given_blocks(space.blocks, count)
    if count <= space.max_candidates:
        return list(range(count))
    from gss.layer_scan import scan_layers

    scan = scan_layers(
        model, reference, rows, "gss-tr", gen_texts=general, batch_size=batch_size, progress=False
    )
    frozen = set(scan.unchanged)  # blocks whose output equals the reference's: not the strongest
    ranked = sorted(set(scan.strengths) - frozen, key=lambda b: -scan.strengths[b])
    strongest = ranked[: space.max_candidates // 2]
    spaced = [
        round(i * (count - 1) / (space.max_candidates // 2))
        for i in range(1, space.max_candidates // 2 + 1)
    ]
    return sorted(set(strongest) | {min(b, count - 1) for b in spaced})


def reference_text(
    reference: nn.Module,
    starts: Sequence[Sequence[int]],
    *,
    length: int = 48,
    seed: int = 0,
    batch_size: int = 16,
    progress: bool = False,
) -> list[list[int]]:
    """Text the reference writes (sampled at temperature 1, seeded) after each of ``starts``:
    general text in the reference's own distribution, with no data to download. Any causal LM
    forward will do (`gss.adapters_off(model)` included): no ``generate`` is needed; its KV
    cache is used where it returns one."""
    gen = torch.Generator().manual_seed(seed)
    with calibration_mode(reference):
        text = sample_generate(
            reference,
            starts,
            length,
            generator=gen,
            batch_size=batch_size,
            progress=progress,
            desc="gss: the reference's text",
        )
    return [[*s, *t] for s, t in zip(starts, text, strict=True)]


def protect(
    model: nn.Module,
    reference: nn.Module,
    texts: TextsOrIds,
    *,
    tokenizer: Any = None,
    general: TextsOrIds | None = None,
    heldout: TextsOrIds | None = None,
    utility: Utility | None = None,
    utility_name: str = "utility",
    budget: float = 0.05,
    budget_mode: Literal["relative", "absolute"] = "relative",
    target: float = 0.0,
    k: int = 32,
    n: int = 72,
    prefixes: Sequence[int] | None = None,
    memorized_from: Literal["k", "shortest"] = "k",
    search: SearchSpace | None = None,
    seed: int = 0,
    reference_rows: int = 64,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
) -> Protection:
    """Audit ``texts`` (the fine-tuning data), then choose and build the steer that leaves at
    most ``target`` % of the memorized rows extractable within the utility ``budget``.

    Args:
        model, reference, texts, tokenizer: as for `gss.calibrate` (``adapters_off(model)``
            is a reference for an adapter fine-tune).
        general: a sample of the text the model will serve (the gate thresholds come from it
            and from text the reference generates); optional.
        heldout: text whose perplexity is the default utility (default: the measuring half of
            the general text).
        utility: ``utility(model) -> float``, lower is better (e.g. ``lambda m: -accuracy(m)``);
            default: perplexity on ``heldout``. ``utility_name`` labels it in the report.
        budget, budget_mode: the utility may rise to ``base + budget * |base|`` ("relative", the
            default: +5%) or ``base + budget`` ("absolute").
        target: % of held-out memorized rows allowed to stay extractable (default 0).
        k, n: (n, k)-extraction: prompted with k tokens, reproduce tokens k..n-1.
        prefixes, memorized_from: the audit's (`gss.audit`): with ``"shortest"`` a row is
            memorized from the shortest scored prompt that extracts it, and is tuned on or
            held out and measured from there; the report says which window each held-out
            row was scored on.
        search: what may be chosen (`SearchSpace`).
        seed: the tuning/held-out split and the reference's text.
    """
    space = search or SearchSpace()
    check_models(model, reference)  # a path, or weights left on "meta": before any pass
    check_options(space, budget, budget_mode, target, k, n, seed)
    check_prefixes(prefixes, k, n, memorized_from)
    RunOptions(batch_size=batch_size, progress=progress)  # checks both
    if space.blocks is not None:  # in range, before any pass
        given_blocks(space.blocks, len(find_decoder_blocks(model)))
    width = residual_width(model)
    if max(space.ranks) > width:  # each block is calibrated once, at the largest rank
        raise GSSError(
            f"ranks {space.ranks} go past the model's hidden size ({width}): give ranks in "
            f"1..{width} (SearchSpace(ranks=...))."
        )
    if budget_mode == "relative" and budget > 1:
        warnings.warn(
            f"budget {budget:g} lets the utility rise by {100 * budget:.0f}%: a relative budget "
            "is a fraction (0.05 = +5%).",
            GSSWarning,
            stacklevel=2,
        )
    # the texts given besides the data, read and checked before the audit
    general_rows = (
        None if general is None else _within_context(model, general, tokenizer, "general")
    )
    heldout_rows = (
        None if heldout is None else _within_context(model, heldout, tokenizer, "heldout")
    )
    for what, rows in (("general", general_rows), ("heldout", heldout_rows)):
        if rows is not None:
            check_sequences((model,), rows, what)
    if general_rows is not None:
        check_general(len(general_rows))
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    report = audit(
        model,
        reference,
        texts,
        tokenizer=tokenizer,
        k=k,
        n=n,
        prefixes=prefixes,
        memorized_from=memorized_from,
        batch_size=batch_size,
        progress=progress,
    )
    seconds["audit"] = time.perf_counter() - started
    _warn_if_general_is_memorized(general_rows, report, n)
    # each distinct window once: a copy of a tuning row held out would not be unseen
    firsts: dict[Any, int] = {}
    for r in report.memorized:
        firsts.setdefault(extraction_window(report.candidate(r.index), k, n), r.index)
    order = list(firsts.values())
    repeats = len(report.memorized) - len(order)
    if repeats:
        warnings.warn(
            f"{repeats} memorized row(s) repeat another's window (the same tokens up to n): "
            "each distinct row is tuned on or held out once, never both.",
            GSSWarning,
            stacklevel=2,
        )
    if len(order) < 2:
        rule = f"({n},{k})-extraction" if report.by_k else "from the shortest prompt scored"
        raise GSSError(
            f"the audit found {len(order)} distinct memorized row(s) of {len(report.rows)} "
            f"({rule}, not extracted by the reference): too few to tune on and hold out. "
            "Lower k or n, or pass more of the fine-tuning data."
        )
    random.Random(seed).shuffle(order)
    half = len(order) // 2
    tuning, held = sorted(order[:half]), sorted(order[half:])
    tune_rows = [report.ids[i] for i in tuning]  # calibrated on
    tune_candidates = [report.candidate(i) for i in tuning]  # measured on

    # general text: the user's sample and the reference's own, each split fit / measure
    seen = [i for i in range(len(report.ids)) if i not in set(held)]  # never a held-out row
    starts = [
        report.ids[i][:1]
        for i in random.Random(seed + 1).sample(seen, min(reference_rows, len(seen)))
    ]
    sources: dict[str, list[list[int]]] = {
        "reference-generated": reference_text(
            reference, starts, length=max(8, n - 1), seed=seed, progress=progress
        )
    }
    if general_rows is not None:
        sources = {"general (given)": general_rows, **sources}
    if space.ordinary_english and tokenizer is not None:
        ordinary = _ordinary_rows(model, tokenizer, space.ordinary_english, seed)
        if len(ordinary) > 1:
            sources[ORDINARY] = ordinary
    fit_sources = {name: rows[::2] for name, rows in sources.items()}
    fit = [r for rows in fit_sources.values() for r in rows]
    # a source of one row (the reference's text, from as few rows) has nothing left to measure
    measure = {name: rows[1::2] for name, rows in sources.items() if len(rows) > 1}
    utility_rows = (
        heldout_rows if heldout_rows is not None else [r for rows in measure.values() for r in rows]
    )
    if utility is None and not utility_rows:
        raise GSSError(
            "no text is left to measure the utility on (the reference's text came from one "
            "row): pass heldout= (gss protect --heldout) or general= (--general)."
        )
    if utility is None:

        def utility(m: nn.Module) -> float:
            return perplexity(m, utility_rows, pad_id, batch_size=batch_size)

        measure_name = "perplexity on " + ("heldout" if heldout is not None else "general text")
    else:
        measure_name = utility_name
    base = utility_value(utility, model, measure_name)
    # relative: by a share of the base's size, a negative utility (minus accuracy) too
    rise = 1 + budget if base >= 0 else 1 - budget
    limit = base * rise if budget_mode == "relative" else base + budget
    checks, domain = search_checks(
        model,
        reference,
        report,
        tune_candidates,
        space,
        budget,
        budget_mode,
        k,
        n,
        pad_id,
        batch_size,
    )
    seconds["general_text"] = time.perf_counter() - started - seconds["audit"]

    bar = tqdm(desc="gss: protect", unit="point", disable=not progress)
    judge = Judge(
        model,
        tune_candidates,
        utility,
        limit,
        k=k,
        n=n,
        pad_id=pad_id,
        batch_size=batch_size,
        bar=bar,
        prefer=space.prefer,
        checks=checks,
    )
    candidates = _candidate_blocks(model, reference, tune_rows, fit, space, batch_size)

    def calibrated(preset: str, layer: int, rank: int) -> SteeringArtifact | None:
        try:
            with warnings.catch_warnings():
                # its soundness warnings are of the largest rank, before a rank is chosen, and
                # protect measures what they foretell (rows left, gates open on general text);
                # the chosen steer records its own directions' (`gss show`)
                warnings.filterwarnings("ignore", "calibration: ", GSSWarning)
                return calibrate(
                    model,
                    reference,
                    tune_rows,
                    preset,
                    layer=layer,
                    rank=rank,
                    gen_texts=fit,
                    # the condition direction too, when some point may use the discriminant gate
                    gate="discriminant" if "discriminant" in space.gates else "hard",
                    coefficient=space.coefficient,
                    batch_size=batch_size,
                    progress=False,
                )
        except GSSError as e:  # a block with nothing to steer against, say
            warnings.warn(
                f"protect: skipped block {layer} ({preset}): {e}", GSSWarning, stacklevel=3
            )
            return None

    def explore(art: SteeringArtifact, stage: str, preset: str) -> None:
        try:
            art = _gated(model, art, fit_sources, space.gate_share, batch_size)
        except GSSError as e:  # thresholds this gate cannot have here: the others are searched
            warnings.warn(
                f"protect: skipped block {art.layer}, {art.config.gate} gate ({preset}): {e}",
                GSSWarning,
                stacklevel=3,
            )
            return
        strength_search(judge, lambda d: art.with_options(delta=d), space, stage, preset, target)

    # stage 1: every (preset, candidate block) at the first rank
    made: dict[tuple[str, int], SteeringArtifact] = {}
    for preset in space.presets:
        for layer in candidates:
            bar.set_description_str(f"gss: protect ({preset}, block {layer})")
            art = calibrated(preset, layer, max(space.ranks))
            if art is not None:
                made[preset, layer] = art
                first = art.with_options(rank=min(space.ranks[0], art.rank), gate=space.gates[0])
                explore(first, "block", preset)
    best = judge.best(judge.trials, target)
    # stages 2 and 3: the other ranks, then the other gates, on the best (variant, block) pairs
    if best is not None and best.memorized > target:
        ranked = judge.ranked(judge.trials, target)
        pairs = list(dict.fromkeys((t.preset, t.blocks[0]) for t in ranked))
        for preset, layer in pairs[: space.refine]:
            # the gate stage 1 used (the artifact's own is "discriminant" when that may be tried)
            full = made[preset, layer].with_options(gate=space.gates[0])
            for rank in space.ranks[1:]:
                if rank <= full.rank:
                    explore(full.with_options(rank=rank), "rank", preset)
            here = [t for t in judge.trials if (t.preset, t.blocks) == (preset, (layer,))]
            local = judge.best(here, target)
            current = full if local is None else full.with_options(rank=local.rank)
            for gate in space.gates:
                if gate != current.config.gate:
                    explore(current.with_options(gate=gate), "gate", preset)
        best = judge.best(judge.trials, target) or best
    # stage 4: a second block, calibrated on the model steered by the first
    if best is not None and best.memorized > target and space.max_blocks >= 2:
        head = judge.steer_of(best)
        assert isinstance(head, SteeringArtifact)
        by_block: dict[int, float] = {}
        for t in judge.trials:
            if t.stage == "block" and t.within_budget and t.blocks[0] != head.layer:
                by_block[t.blocks[0]] = min(by_block.get(t.blocks[0], 100.0), t.memorized)
        for layer in sorted(by_block, key=by_block.__getitem__)[:3]:
            bar.set_description_str(f"gss: protect (block {head.layer} + block {layer})")
            with head.attach(model):
                second = calibrated(best.preset, layer, head.rank)
                if second is not None:
                    second = second.with_options(gate=head.config.gate)
                    second = _gated(model, second, fit_sources, space.gate_share, batch_size)
            if second is None:
                continue
            for share in (1.0, 0.5):  # the first block gives up part of the budget
                first = head.with_options(delta=head.config.delta * share)
                strength_search(
                    judge,
                    _stacked(first, second),
                    space,
                    "second block",
                    best.preset,
                    target,
                )
        best = judge.best(judge.trials, target) or best
    replies: dict[str, Any] = {}
    if best is not None and space.reply_check > 1:
        bar.set_description_str("gss: protect (replies)")
        best, replies = least_looping(
            model, reference, judge, target, tune_candidates, space, k, n, pad_id, batch_size
        )
    chosen_steer = None if best is None else judge.steer_of(best)
    if chosen_steer is None:
        warnings.warn(
            f"protect: no steer stayed within the utility budget ({measure_name} at most "
            f"{limit:.4g}, from {base:.4g}): nothing is chosen. Allow more (a larger budget).",
            GSSWarning,
            stacklevel=2,
        )
    bar.close()
    seconds["search"] = time.perf_counter() - started - seconds["audit"] - seconds["general_text"]

    held_rows = [report.candidate(i) for i in held]
    before = {
        "memorized": extractable(model, held_rows, k, n, pad_id, batch_size),
        "utility": base,
        **domain.measure(model),
    }
    after: dict[str, Any] = {}
    gates: dict[str, Any] = {}
    examples: list[dict[str, Any]] = []
    explanation = ""
    if chosen_steer is not None:
        with chosen_steer.attach(model, track_gates=True) as handle:
            after = {
                "memorized": extractable(model, held_rows, k, n, pad_id, batch_size),
                "utility": float(utility(model)),
                **domain.measure(model),
            }
            gates = {"open_share": {}}
            for name, rows in measure.items():
                handle.reset_stats()
                perplexity(model, rows, pad_id, batch_size=batch_size)
                gates["open_share"][name] = handle.gate_stats().get("any_open_share")
        gates["memorized_rows"] = where_gates_open(model, chosen_steer, held_rows, k, n)
        after["quality"], examples = what_it_says(
            model, reference, chosen_steer, held_rows, k, n, pad_id, batch_size, tokenizer
        )
        ordinary = measure.get(ORDINARY) or next(iter(measure.values()), [])
        after["ordinary_prompts"] = ordinary_unchanged(
            model, chosen_steer, ordinary, pad_id, batch_size, tokenizer, reference, report.ids
        )
        if held_rows:  # one --explain table: where the gates opened on a held-out prompt
            shown = prompt_and_target(held_rows[0], k, n)[0]
            explanation = explain(
                model, chosen_steer, shown, max_new_tokens=n - k, tokenizer=tokenizer
            ).render()
        _warn_open(gates, space.gate_share)
    seconds["total"] = time.perf_counter() - started
    if chosen_steer is not None:  # the held-out report travels with the steer (its model card)
        chosen_steer = _with_record(
            chosen_steer,
            {
                "heldout_rows": len(held),
                "k": k,
                "n": n,
                "memorized_from": report.memorized_from,
                "before": {"memorized": before["memorized"], "utility": base},
                "after": {"memorized": after["memorized"], "utility": after["utility"]},
                "budget": {"measure": measure_name, "limit": limit},
                "target": target,
                "reached": after["memorized"] <= target,
                "gate_open_share": gates.get("open_share", {}),
            },
        )
    return Protection(
        steer=chosen_steer,
        audit=report,
        tuning=tuning,
        heldout=held,
        budget={
            "measure": measure_name,
            "base": base,
            "budget": budget,
            "mode": budget_mode,
            "limit": limit,
        },
        target=target,
        trials=judge.trials,
        chosen=best,
        before=before,
        after=after,
        gates=gates,
        examples=examples,
        seconds=seconds,
        replies=replies,
        steers=judge.steers,
        explanation=explanation,
    )


def _with_record(steer: Steer, record: dict[str, Any]) -> Steer:
    """``steer`` with what protect measured on the held-out rows in each member's
    ``provenance.extra["protect"]``: saved and pushed with it (`gss.artifact.card`)."""

    def one(a: SteeringArtifact) -> SteeringArtifact:
        extra = {**a.provenance.extra, "protect": record}
        return dataclasses.replace(a, provenance=dataclasses.replace(a.provenance, extra=extra))

    if isinstance(steer, SteeringStack):
        return SteeringStack(tuple(one(a) for a in steer))
    return one(steer)


def _warn_if_general_is_memorized(
    general_rows: list[list[int]] | None, report: AuditReport, n: int
) -> None:
    """Warn when the general text is largely rows the model memorized (``--general`` given
    the fine-tuning data): thresholds and utility would then be measured on memorized text."""
    if not general_rows or not report.memorized:
        return
    memorized = {tuple(report.ids[r.index][:n]) for r in report.memorized}
    shared = sum(tuple(row[:n]) in memorized for row in general_rows)
    if 10 * shared >= len(general_rows):
        warnings.warn(
            f"{shared} of the {len(general_rows)} general rows are rows the model reproduces "
            f"(their first {n} tokens are memorized rows'): the gates' thresholds and the "
            "utility are then measured on memorized text. Give as general text what the model "
            "will serve but was not fine-tuned on.",
            GSSWarning,
            stacklevel=3,
        )


def _warn_open(gates: dict[str, Any], expected: float) -> None:
    """Warn when the gates open far more often on some general text than the thresholds ask:
    the text they were set on does not look like that one."""
    for name, share in gates.get("open_share", {}).items():
        if share is not None and share > 3 * expected + 0.02:
            warnings.warn(
                f"the gates open on {100 * share:.0f}% of held-out {name} tokens (set for "
                f"about {100 * expected:.0f}%): the general text the thresholds came from does "
                "not look like this text. Pass a (larger) sample of the text the model will "
                "serve (general=, gss protect --general).",
                GSSWarning,
                stacklevel=3,
            )
