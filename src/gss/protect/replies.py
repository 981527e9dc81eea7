"""What a steered model says instead of the memorized text: step 7's check of the best points'
replies for loops, and the held-out report's repeated 4-grams, perplexity and examples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from torch import nn

from gss.artifact.stack import Steer
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.near_verbatim import near_verbatim, near_verbatim_ids
from gss.evaluate.recital import data_runs, recited_start, recites
from gss.evaluate.sampled import likely_shares
from gss.evaluate.utility import perplexity, repetition
from gss.inference.handoff import reference_where_open
from gss.protect.clock import Clock
from gss.protect.measure import Candidate, Judge, prompt_and_target
from gss.protect.result import Trial
from gss.protect.space import SearchSpace

HANDOVER = "hand-over generations"
"""The report's time part for the generations with the reference kept (both rules)."""


def least_looping(
    model: nn.Module,
    reference: nn.Module,
    judge: Judge,
    target: float,
    rows: Sequence[Candidate],
    space: SearchSpace,
    k: int,
    n: int,
    pad_id: int,
    batch_size: int,
) -> tuple[Trial, dict[str, Any]]:
    """Step 7: of the ``space.reply_check`` best points equal on the target, the first (in the
    search's order) whose greedy continuations of the tuning prompts say what the reference
    might: at most ``space.loop_tolerance`` points of repeated 4-grams above the reference's
    own continuations, and a perplexity under the reference at most ``space.fluency_ratio``
    times theirs (issue 72's goal; fewer repeats alone also reward replies that stop reading
    as language). Where none passes, the one furthest inside both (the larger of its two
    overshoots, each relative to its allowance, smallest). Teacher-forced measures alone
    pick a steer that may stop a leak by breaking the reply into a loop."""
    ranked = judge.ranked(judge.trials, target)
    gap = max(ranked[0].memorized - target, 0.0)
    pool = [t for t in ranked if max(t.memorized - target, 0.0) == gap][: space.reply_check]
    prompts = [prompt_and_target(r, k, n)[0] for r in rows]

    def replies(m: nn.Module) -> tuple[float, float]:
        out = greedy_generate(m, prompts, n - k, pad_id=pad_id, batch_size=batch_size)
        return repetition(out), reference_ppl(reference, prompts, out, pad_id, batch_size)

    own, own_ppl = replies(reference)
    if math.isnan(own):  # windows shorter than a 4-gram: nothing to judge
        return ranked[0], {}
    judged = []
    for trial in pool:
        with judge.steer_of(trial).attach(model):
            judged.append(replies(model))

    def overshoot(point: tuple[float, float]) -> float:
        return reply_overshoot(point, (own, own_ppl), space)

    passing = [i for i, p in enumerate(judged) if overshoot(p) <= 0]
    chosen = passing[0] if passing else min(range(len(judged)), key=lambda i: overshoot(judged[i]))
    record = {
        "reference": own,
        "reference_ppl": own_ppl,
        "tolerance": space.loop_tolerance,
        "fluency_ratio": space.fluency_ratio,
        "passed": bool(passing),
        "chosen": chosen,
        "points": [
            {**asdict(t), "repeated_4grams": rep, "reference_ppl": ppl}
            for t, (rep, ppl) in zip(pool, judged, strict=True)
        ],
    }
    return pool[chosen], record


def reply_overshoot(
    replies: tuple[float, float], own: tuple[float, float], space: SearchSpace
) -> float:
    """How far (repeated 4-grams %, perplexity under the reference) passes step 7's allowances
    of the reference's own replies ``own``, the larger of the two, each relative to its
    allowance: at most 0 where both hold."""
    (rep, ppl), (own_rep, own_ppl) = replies, own
    loops, most = own_rep + space.loop_tolerance, own_ppl * space.fluency_ratio
    return max((rep - loops) / max(space.loop_tolerance, 1.0), (ppl - most) / most)


def reference_ppl(
    reference: nn.Module,
    prompts: Sequence[Sequence[int]],
    replies: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int,
) -> float:
    """The replies' perplexity under the reference, given their prompts."""
    rows = [list(p) + list(r) for p, r in zip(prompts, replies, strict=True)]
    lengths = [len(p) for p in prompts]
    return perplexity(reference, rows, pad_id, batch_size=batch_size, prompt_lengths=lengths)


def what_it_says(
    model: nn.Module,
    reference: nn.Module,
    steer: Steer,
    rows: Sequence[Candidate],
    k: int,
    n: int,
    pad_id: int,
    batch_size: int,
    tokenizer: Any,
    clock: Clock | None = None,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """The steered continuations of held-out memorized prompts beside the reference's own:
    repeated 4-grams and perplexity under the reference (a steer that breaks the reply into a
    loop is not the same as one that answers like the base model)."""
    windows = [prompt_and_target(r, k, n) for r in rows]
    prompts, originals = [p for p, _ in windows], [t for _, t in windows]
    width = n - k
    with steer.attach(model):
        steered = greedy_generate(model, prompts, width, pad_id=pad_id, batch_size=batch_size)
    own = greedy_generate(reference, prompts, width, pad_id=pad_id, batch_size=batch_size)
    tuned = greedy_generate(model, prompts, width, pad_id=pad_id, batch_size=batch_size)
    # the same gates with the reference's token where one opens (gss.reference_where_open):
    # how close the steer gets to saying what the reference would; and with no gate, the
    # signal alone deciding at every step (where the gates find few memorized tokens)
    with (clock or Clock()).part(HANDOVER):
        handed, alone = (
            handed_continuations(model, gates, reference, prompts, width, pad_id, batch_size)
            for gates in (steer, None)
        )
        sampled = handed_sampled(model, steer, reference, prompts, originals, pad_id, batch_size)

    def ppl(replies: list[list[int]]) -> float:
        return reference_ppl(reference, prompts, replies, pad_id, batch_size)

    text = _decoder(tokenizer)

    def near(replies: list[list[int]]) -> float:
        """% of the held-out windows a reply says near-verbatim (issue 70's mode: with a
        tokenizer case and spacing aside, or most of it in one run; else by token ids)."""
        flags = [
            near_verbatim(text(o), text(r)) if tokenizer is not None else near_verbatim_ids(o, r)
            for o, r in zip(originals, replies, strict=True)
            if o and (tokenizer is None or text(o).strip())
        ]
        return 100.0 * sum(flags) / len(flags) if flags else float("nan")

    quality = {
        "near_verbatim_fine_tune": near(tuned),
        "near_verbatim_steered": near(steered),
        "near_verbatim_reference_where_open": near(handed),
        "memorized_reference_where_open": reproduced(handed, originals),
        "repeated_4grams_steered": repetition(steered),
        "repeated_4grams_reference": repetition(own),
        "repeated_4grams_reference_where_open": repetition(handed),
        "reference_ppl_steered": ppl(steered),
        "reference_ppl_reference": ppl(own),
        "reference_ppl_reference_where_open": ppl(handed),
        "recited_start_fine_tune": recited_start(tuned, originals, own),
        "recited_start_steered": recited_start(steered, originals, own),
        "recited_start_reference_where_open": recited_start(handed, originals, own),
        "recited_start_signal_alone": recited_start(alone, originals, own),
        "near_verbatim_signal_alone": near(alone),
        "memorized_signal_alone": reproduced(alone, originals),
        "repeated_4grams_signal_alone": repetition(alone),
        "reference_ppl_signal_alone": ppl(alone),
        **sampled,
    }

    said = {"fine-tune": tuned, "steered": steered, "reference": own}
    said |= {"reference where open": handed, "reference at any step": alone}
    return quality, _examples(text, prompts, originals, said)


def _examples(
    text: Any,
    prompts: list[list[int]],
    originals: list[list[int]],
    said: dict[str, list[list[int]]],
    count: int = 4,
) -> list[dict[str, Any]]:
    """The first ``count`` held-out prompts, their windows and each way's reply, as text."""
    return [
        {"prompt": text(p), "original": text(o), **{k: text(r[i]) for k, r in said.items()}}
        for i, (p, o) in enumerate(zip(prompts[:count], originals[:count], strict=True))
    ]


def reproduced(replies: Sequence[Sequence[int]], originals: Sequence[Sequence[int]]) -> float:
    """% of the rows whose greedy reply still starts with the row's own window."""
    same = [list(r[: len(o)]) == list(o) for r, o in zip(replies, originals, strict=True)]
    return 100.0 * sum(same) / max(len(same), 1)


def handed_continuations(
    model: nn.Module,
    steer: Steer | None,
    reference: nn.Module,
    prompts: Sequence[Sequence[int]],
    width: int,
    pad_id: int,
    batch_size: int,
) -> list[list[int]]:
    """Greedy continuations with the reference's token where `gss.reference_where_open` (its
    defaults) hands a step over: where ``steer``'s gates open, or with None at any step."""
    with reference_where_open(model, steer, reference) as processor:
        return greedy_generate(
            model, prompts, width, pad_id=pad_id, batch_size=batch_size, processor=processor
        )


def handed_sampled(
    model: nn.Module,
    steer: Steer,
    reference: nn.Module,
    prompts: Sequence[Sequence[int]],
    windows: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int,
) -> dict[str, float]:
    """The attacker who samples through the hand-over (issue 70): ``sampled_<sampler>_<rule>``,
    % of the (prompt, window) pairs that `SAMPLES` draws through `gss.reference_where_open`
    (its defaults) reproduce with a chance of `LIKELY` or more, for the gates of ``steer``
    (``reference_where_open``) and at any step (``signal_alone``)."""
    pairs = [(p, w) for p, w in zip(prompts, windows, strict=True) if p and w]
    out: dict[str, float] = {}
    for rule, gates in (("reference_where_open", steer), ("signal_alone", None)):
        with reference_where_open(model, gates, reference) as processor:
            shares = likely_shares(model, pairs, pad_id, batch_size, processor=processor)
        out.update({f"sampled_{name}_{rule}": share for name, share in shares.items()})
    return out


def ordinary_prompts(rows: Sequence[Sequence[int]], prompt: int = 16) -> list[list[int]]:
    """The first ``prompt`` tokens of each row of two or more, or its first half if shorter."""
    return [list(r[: min(prompt, len(r) // 2)]) for r in rows if len(r) >= 2]


def _decoder(tokenizer: Any) -> Any:
    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))

    return text


def ordinary_unchanged(
    model: nn.Module,
    steer: Steer,
    rows: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int,
    tokenizer: Any,
    reference: nn.Module | None = None,
    data: Sequence[Sequence[int]] = (),
    prompt: int = 16,
    width: int = 32,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """Everywhere else it says what the fine-tune says: the share of ordinary prompts (the
    first ``prompt`` tokens of each row, or its first half where it is shorter) whose
    ``width``-token greedy continuation is the same steered as unsteered, and a few that
    changed. With ``reference``, the same with its token where a gate opens
    (`gss.reference_where_open`'s defaults), and at any step (no gate: the signal alone).
    With ``data`` (the fine-tuning rows), the shares again over the prompts whose unsteered
    continuation recites none of it (`recites`): where the fine-tune recites on an ordinary
    prompt, a change is the point."""
    prompts = ordinary_prompts(rows, prompt)
    if not prompts:
        return {}
    plain = greedy_generate(model, prompts, width, pad_id=pad_id, batch_size=batch_size)
    with steer.attach(model):
        steered = greedy_generate(model, prompts, width, pad_id=pad_id, batch_size=batch_size)
    runs = data_runs(data)
    reciting = [recites(u, runs) for u in plain]

    def shares(said: list[list[int]]) -> dict[str, Any]:
        same = [a == b for a, b in zip(plain, said, strict=True)]
        clean = [s for s, r in zip(same, reciting, strict=True) if not r]
        return {
            "identical": sum(same) / len(same),
            "identical_not_reciting": sum(clean) / len(clean) if clean else None,
            "changed_reciting": (
                sum(not s for s, r in zip(same, reciting, strict=True) if r) / sum(reciting)
                if any(reciting)
                else None
            ),
        }

    text = _decoder(tokenizer)
    changed = [
        {"prompt": text(p), "fine-tune": text(a), "steered": text(b)}
        for p, a, b in zip(prompts, plain, steered, strict=True)
        if a != b
    ]
    result = {"rows": len(prompts), "reciting": sum(reciting), **shares(steered)}
    if reference is not None:  # the reference where a gate opens; at any step (no gate)
        with (clock or Clock()).part(HANDOVER):
            for name, gates in (("reference_where_open", steer), ("signal_alone", None)):
                result[name] = shares(
                    handed_continuations(
                        model, gates, reference, prompts, width, pad_id, batch_size
                    )
                )
    return {**result, "changed": changed[:3]}
