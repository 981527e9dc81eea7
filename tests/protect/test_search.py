"""gss protect: the search stays within the budget, never reads the held-out rows before the
final report, reaches the target on a model that memorized planted rows, and writes what it
chose."""

from __future__ import annotations

import copy
import importlib
import json
import warnings

import pytest
import torch

import gss
from gss import GSSError, GSSWarning
from gss.cli import main
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.intervals import clopper_pearson
from gss.protect import SearchSpace, protect

protect_module = importlib.import_module("gss.protect")  # gss.protect is the function
split_module = importlib.import_module("gss.protect.split")
heldout_module = importlib.import_module("gss.protect.heldout")
general_module = importlib.import_module("gss.protect.general")
measure_module = importlib.import_module("gss.protect.measure")


@pytest.fixture(scope="module")
def protected(memorizer):
    model, reference, planted, general = memorizer
    texts = torch.cat([planted, general[:20]]).tolist()
    seen: list[list[int]] = []
    phase = {"search": False}

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if phase["search"] and ids is not None:
            for j, row in enumerate(ids.tolist()):
                keep = (  # a cached decoding step passes one token and the whole mask
                    row
                    if mask is None
                    else [t for t, m in zip(row, mask[j].tolist()[-len(row) :], strict=True) if m]
                )
                seen.append(keep)

    original_audit, original_leaked = split_module.audit, heldout_module.leaked

    def audit(*a, **kw):
        result = original_audit(*a, **kw)
        phase["search"] = True  # from here until the final report
        return result

    def leaked(*a, **kw):
        phase["search"] = False
        return original_leaked(*a, **kw)

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    split_module.audit, heldout_module.leaked = audit, leaked
    try:
        result = protect(
            model,
            reference,
            texts,
            general=general[20:80].tolist(),
            k=4,
            n=16,
            search=SearchSpace(reply_check=3),  # step 7 too, under the held-out watch
            progress=False,
        )
    finally:
        hook.remove()
        split_module.audit = original_audit
        heldout_module.leaked = original_leaked
    return result, seen, texts


def test_protect_reaches_the_target_within_the_budget(protected):
    result, _, _ = protected
    assert result.chosen is not None and result.chosen.within_budget
    assert result.chosen.utility <= result.budget["limit"]
    assert result.before["memorized"] == 100.0  # held-out rows are memorized ones
    assert result.chosen.memorized == 0.0  # the target, reached on the tuning rows
    assert result.after["memorized"] < 100.0  # and carried, in part at least, to unseen rows
    assert result.reached == (result.after["memorized"] <= result.max_extractable)
    assert result.after["utility"] <= result.budget["limit"] * 1.05  # measured on other text
    # the attacker who samples, before and after (issue 70): the planted rows are learned so
    # well that 100 draws reproduce each, and the steer takes that down as it does greedy's
    assert result.before["sampled"] == {"temperature_1": 100.0, "top_p": 100.0}
    assert result.after["sampled"]["temperature_1"] < 100.0
    assert "Sampled (100 draws from each held-out prompt" in result.markdown()
    # near-verbatim (no tokenizer: by token ids): the fine-tune says every held-out window,
    # and the steered replies fewer, never more than they say exactly plus the near misses
    quality = result.after["quality"]
    assert quality["near_verbatim_fine_tune"] == 100.0
    assert quality["near_verbatim_steered"] >= result.after["leaks"]["exact"]
    # what the target counts (leak_modes, default exact or near-verbatim, teacher-forced): a
    # row in either mode, on the tuning rows of every point and on the held-out rows
    assert result.after["leak_modes"] == ["exact", "near-verbatim"]
    for side in (result.before, result.after):
        exact, near = side["leaks"]["exact"], side["leaks"]["near-verbatim"]
        assert max(exact, near) <= side["memorized"] <= exact + near
    for t in result.trials:
        assert max(t.leaks.values()) <= t.memorized <= sum(t.leaks.values()) + 1e-9
    assert "counts as extractable when it is in any of: exact, near-verbatim" in result.markdown()
    assert "Near-verbatim (a held-out window said by the greedy reply" in result.markdown()
    # other prompts (no tokenizer: the longer prefix alone): the fine-tune, given more of each
    # held-out row, still says the rest of it; the protected model says no more than it
    other = result.after["other_prompts"]
    longer = other["before"]["variants"]["longer prefix"]
    assert longer["rows"] == len(result.heldout) and longer["leaked"] == longer["rows"]
    assert longer["reference_leaked"] == 0
    assert other["after"]["any"]["leaked"] <= other["before"]["any"]["leaked"]
    assert "| longer prefix | " in result.markdown()
    stages = {t.stage for t in result.trials}
    assert "block" in stages and len({t.blocks for t in result.trials}) >= 2  # blocks searched
    deltas = {t.deltas[0] for t in result.trials if t.blocks == result.chosen.blocks}
    assert len(deltas) > 8  # a bisection, not a handful of grid points
    assert set(result.tuning).isdisjoint(result.heldout)
    assert len(result.tuning) + len(result.heldout) == len(result.audit.memorized)


def test_protect_says_where_the_gates_open_on_memorized_rows(protected):
    result, _, _ = protected
    where = result.gates["memorized_rows"]
    assert len(where["per_row"]) == len(result.heldout)
    assert where["window"] == pytest.approx(sum(where["per_row"]) / len(where["per_row"]))
    assert where["window"] > 0  # the steer that removed rows opened on their windows
    assert 0.0 <= where["prompt"] <= 1.0
    assert "of the positions that choose the memorized tokens" in result.markdown()


def test_protect_checks_the_best_points_replies_for_loops(protected, memorizer):
    """Step 7: the best points equal on the target, in the search's order, each with the
    repeated 4-grams of its greedy continuations of the tuning prompts and their perplexity
    under the reference; the first within both allowances (the reference's own repeats plus
    ``loop_tolerance`` points, ``fluency_ratio`` times its own perplexity) is chosen, else the
    one that overshoots them least."""
    from dataclasses import asdict

    from gss.evaluate.decoding import greedy_generate
    from gss.evaluate.utility import perplexity, repetition
    from gss.protect.measure import FOLLOWS

    result, _, texts = protected
    r = result.replies
    points = r["points"]
    assert 1 <= len(points) <= 3 and {p["memorized"] for p in points} == {0.0}
    # the search's order: the reference's continuations likeliest first
    follows = [p["checks"][FOLLOWS] for p in points]
    assert follows == sorted(follows)
    looped = [p["repeated_4grams"] for p in points]
    loops, most = r["reference"] + r["tolerance"], r["reference_ppl"] * r["fluency_ratio"]

    def overshoot(i: int) -> float:
        return max(
            (looped[i] - loops) / max(r["tolerance"], 1.0),
            (points[i]["reference_ppl"] - most) / most,
        )

    passing = [i for i in range(len(points)) if overshoot(i) <= 0]
    assert r["passed"] == bool(passing)
    assert r["chosen"] == (passing[0] if passing else min(range(len(points)), key=overshoot))
    measured = ("repeated_4grams", "reference_ppl")
    chosen = {key: v for key, v in points[r["chosen"]].items() if key not in measured}
    assert asdict(result.chosen) == chosen
    model = memorizer[0]
    prompts = [texts[i][:4] for i in result.tuning]  # k = 4, n = 16
    with result.steer.attach(model):
        replies = greedy_generate(model, prompts, 12, pad_id=0, batch_size=8)
    assert repetition(replies) == pytest.approx(looped[r["chosen"]])
    reference = memorizer[1]
    rows = [p + q for p, q in zip(prompts, replies, strict=True)]
    ppl = perplexity(reference, rows, 0, batch_size=8, prompt_lengths=[4] * len(rows))
    assert ppl == pytest.approx(points[r["chosen"]]["reference_ppl"])
    assert "Replies checked (step 7)" in result.markdown()
    assert result.summary()["reply_check"] == r


def test_protect_never_reads_the_heldout_rows_while_choosing(protected):
    result, seen, texts = protected
    assert seen  # the search did run the model
    held = [texts[i] for i in result.heldout]
    tuned = [texts[i] for i in result.tuning]
    assert any(row[:16] == t[: len(row[:16])] for row in seen for t in tuned)
    for row in seen:
        for h in held:
            assert row[:4] != h[:4], "a held-out row's prompt reached the model during the search"


def test_protect_writes_the_steer_and_the_report(protected, memorizer, tmp_path):
    result, _, _ = protected
    model, *_ = memorizer
    written = result.write(tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == ["frontier.png", "protect.json", "protect.md", "rows.png", "steer"]
    steer = gss.load(tmp_path / "out" / "steer")
    rows = [result.audit.ids[i] for i in result.heldout]
    with gss.steer(model, steer):  # the saved steer is the one measured
        modes = result.config.leak_modes
        measured = measure_module.leaked(model, rows, 4, 16, 0, 8, modes)
        assert measured[0] == result.after["memorized"]
    data = json.loads((tmp_path / "out" / "protect.json").read_text())
    assert data["reached"] == result.reached
    members = steer.artifacts if isinstance(steer, gss.SteeringStack) else (steer,)
    record = members[0].provenance.extra["protect"]  # the held-out report travels with it
    assert record["after"]["memorized"] == result.after["memorized"]
    assert record["heldout_rows"] == len(result.heldout) and record["reached"] == result.reached
    card = (tmp_path / "out" / "steer" / "README.md").read_text()
    assert "held-out memorized rows the search never saw" in card
    assert data["chosen"]["blocks"] == list(result.chosen.blocks)
    report = (tmp_path / "out" / "protect.md").read_text()
    assert "never seen by the search" in report
    # where the time went: the run's steps, the search's stages and its kinds of work
    steps = {"audit", "general_text", "search", "handover", "report", "total"}
    assert set(data["seconds"]) == steps
    parts = data["report_seconds"]  # the report's own parts, its hand-over generations apart
    assert {"before", "after", "what it says", "hand-over generations"} <= set(parts)
    assert parts["hand-over generations"] <= parts["what it says"] + parts["ordinary prompts"]
    assert (
        sum(v for k, v in parts.items() if k != "hand-over generations")
        <= data["seconds"]["report"] + 1e-6
    )
    assert data["handover"]["gates"] == record["handoff"]["gates"]
    stages, work = data["search_seconds"]["stages"], data["search_seconds"]["work"]
    assert {"candidate blocks", "block stage"} <= set(stages)
    assert {"calibration", "gate thresholds", "extraction (tuning rows)", "utility"} <= set(work)
    assert sum(stages.values()) <= data["seconds"]["search"] + 1e-6
    assert all(v >= 0 for v in [*stages.values(), *work.values()])
    assert "The search by stage: candidate blocks" in report
    with pytest.raises(GSSError, match="already holds"):
        result.write(tmp_path / "out")
    with pytest.raises(GSSError, match="is empty"):  # not the working directory
        result.write("")


def test_protect_refuses_bad_options(memorizer):
    model, reference, planted, _ = memorizer
    rows = planted.tolist()
    for kwargs, message in [
        ({"budget": -1}, "budget must be >= 0"),
        ({"budget": float("nan")}, "budget must be >= 0"),
        ({"max_extractable": 101}, r"max_extractable \(gss protect --max-extractable\) is a %"),
        ({"target": 0.0}, "protect's target is now max_extractable"),
        ({"treshold": 0.0}, r"unknown option\(s\) treshold: give fields of gss.ProtectConfig"),
        ({"config": {"budget": 0.1}}, "config must be a gss.ProtectConfig"),
        ({"reference_rows": 0}, r"reference_rows must be an integer in \[1, 2\^63\)"),
        ({"k": 8, "n": 8}, "n must be an integer > k"),
        ({"search": SearchSpace(presets=("nope",))}, "presets must be among"),
        ({"search": SearchSpace(delta_range=(1.0, 0.1))}, "delta_range"),
        ({"search": SearchSpace(delta_ceiling=10.0)}, "delta_ceiling"),
        ({"search": SearchSpace(gate_share=1.0)}, "gate_share"),
        ({"search": SearchSpace(coefficient="clip")}, "coefficient must be one of"),
        ({"search": SearchSpace(centering="mean")}, "centering must be one of"),
        ({"search": SearchSpace(prefer="speed")}, "prefer must be"),  # type: ignore[arg-type]
        ({"search": SearchSpace(loop_tolerance=float("nan"))}, "loop_tolerance"),
        ({"search": SearchSpace(fluency_ratio=-0.1)}, "fluency_ratio"),
        ({"search": SearchSpace(ordinary_english=-1)}, "ordinary_english must be"),
        ({"search": SearchSpace(domain_budget=float("inf"))}, "domain_budget must be"),
        ({"search": SearchSpace(follow_tolerance=-1.0)}, "follow_tolerance must be"),
        ({"leak_modes": ("greedy",)}, "leak_modes must name some of exact, near-verbatim"),
        ({"leak_modes": ()}, "leak_modes must name some of"),
        ({"leak_modes": "exact"}, "leak_modes must name some of"),
        ({"leak_modes": ("exact", "exact")}, "each once"),
        ({"seed": 2**70}, r"seed must be an integer in \[0, 2\^63\)"),
        ({"utility": lambda m: float("nan"), "k": 4, "n": 16}, r"returned nan, not a finite"),
        ({"utility": lambda m: None, "k": 4, "n": 16}, r"returned None, not a finite"),
        ({"search": SearchSpace(blocks=(9,)), "k": 4, "n": 16}, r"blocks \[9\] are out of"),
        ({"general": planted[:1].tolist()}, r"the general text has 1 row\(s\)"),
        ({"heldout": [[99, 3, 4]]}, r"heldout: token id 99 is outside the model's vocabulary"),
        # the wrong types: one message each, before the audit, never a TypeError from inside
        ({"budget": "0.05"}, "budget must be >= 0"),
        ({"max_extractable": "0"}, r"max_extractable \(gss protect --max-extractable\) is a %"),
        ({"search": {"blocks": (1,)}}, "search must be a gss.SearchSpace"),
        ({"search": SearchSpace(blocks=())}, "blocks must be block indices"),
        ({"search": SearchSpace(blocks=1)}, "blocks must be block indices"),  # type: ignore[arg-type]
        ({"search": SearchSpace(ranks=(True,))}, "ranks must be integers >= 1"),
        ({"search": SearchSpace(delta_range=("a", "b"))}, "delta_range must be two finite"),  # type: ignore[arg-type]
        ({"search": SearchSpace(delta_range=(1, 2, 3))}, "delta_range must be two finite"),  # type: ignore[arg-type]
        ({"search": SearchSpace(steps=2.5)}, "steps, max_blocks"),  # type: ignore[arg-type]
        ({"search": SearchSpace(reply_check=float("nan"))}, "reply_check must be"),  # type: ignore[arg-type]
        # each block is calibrated once at the largest rank: one too large would skip them all
        ({"search": SearchSpace(ranks=(4, 2, 1000))}, "go past the model's hidden size"),
    ]:
        with pytest.raises(GSSError, match=message):
            protect(model, reference, rows, progress=False, **kwargs)


def test_general_rows_longer_than_the_context_are_cut_to_it(memorizer):
    """As `gss evaluate` reads held-out text (gss protect has no --max-length to cut them)."""
    model = memorizer[0]
    context = model.config.max_position_embeddings
    with pytest.warns(GSSWarning, match=r"1 of the 2 general rows are longer than the model's"):
        rows = general_module.within_context(model, [[3] * (context + 9), [4] * 5], None, "general")
    assert [len(r) for r in rows] == [context, 5]


def test_protect_says_when_there_is_nothing_to_protect(memorizer):
    model, reference, _, general = memorizer
    with pytest.raises(GSSError, match="too few to tune on and hold out"):
        protect(model, reference, general[:10].tolist(), k=4, n=16, progress=False)


def test_protect_never_holds_out_a_copy_of_a_tuning_row(memorizer, tmp_path):
    """Rows repeated in the data (as fine-tuning data often repeats them) are one row: tuned on
    or held out, never both, so the held-out report is about rows the search never saw; the
    split is written down."""
    model, reference, planted, general = memorizer
    texts = torch.cat([planted, planted, planted, general[:20]]).tolist()
    space = SearchSpace(presets=("gss",), ranks=(1,), gates=("hard",), steps=2, max_blocks=1)
    with pytest.warns(gss.GSSWarning, match="repeat another's window"):
        result = protect(
            model, reference, texts, general=general[20:60].tolist(), k=4, n=16, search=space,
            progress=False,
        )  # fmt: skip
    window = [tuple(texts[i][:16]) for i in range(len(texts))]
    tuned = {window[i] for i in result.tuning}
    assert tuned and not tuned & {window[i] for i in result.heldout}
    distinct = {window[r.index] for r in result.audit.memorized}
    assert len(result.tuning) + len(result.heldout) == len(distinct) < len(result.audit.memorized)
    result.write(tmp_path / "out")
    split = json.loads((tmp_path / "out" / "protect.json").read_text())["split"]
    assert split == {"tuning": result.tuning, "heldout": result.heldout}


def test_a_relative_budget_on_a_negative_utility_allows_a_rise(memorizer):
    """``-accuracy`` (the docstring's example) with the default relative budget: the limit is
    the base raised by 5% of its size, not the base times 1.05 (which would lie below it)."""
    model, reference, planted, general = memorizer
    held = general[100:140].tolist()
    space = SearchSpace(presets=("gss",), ranks=(1,), gates=("hard",), steps=2, max_blocks=1)
    result = protect(
        model, reference, torch.cat([planted, general[:26]]).tolist(), k=4, n=16,
        utility=lambda m: -gss.evaluate.token_accuracy(m, held), search=space, progress=False,
    )  # fmt: skip
    base = result.budget["base"]
    assert base < 0 and result.budget["limit"] == pytest.approx(base + 0.05 * abs(base))
    assert result.steer is not None


def test_audit_refuses_the_model_as_its_own_reference(memorizer):
    model, _, planted, _ = memorizer
    with pytest.raises(GSSError, match="omega = 0 everywhere"):
        gss.audit(model, model, planted.tolist(), k=4, n=16, progress=False)


def test_audit_says_when_no_row_can_be_checked(memorizer):
    model, reference, planted, _ = memorizer
    with pytest.warns(gss.GSSWarning, match="no row has more than its prompt's tokens"):
        report = gss.audit(model, reference, planted.tolist(), k=16, n=20, progress=False)
    assert report.extractable == []
    with pytest.raises(GSSError, match=r"n = 200 passes the model's context \(128 positions\)"):
        gss.audit(model, reference, planted.tolist(), k=4, n=200, progress=False)
    short = copy.deepcopy(reference)  # the reference's context is the shorter one: named
    short.config.max_position_embeddings = 32
    with pytest.raises(GSSError, match=r"n = 64 passes the reference's context \(32 positions\)"):
        gss.audit(model, short, planted.tolist(), k=4, n=64, progress=False)


def _tight_budget(memorizer, search: SearchSpace | None = None):
    """A small search under a budget one block cannot meet: a second block is searched too."""
    model, reference, planted, general = memorizer
    return protect(
        model,
        reference,
        torch.cat([planted, general[:20]]).tolist(),
        general=general[20:60].tolist(),
        k=4,
        n=16,
        # the budget binds on the general text alone: the data's clean rows get their own
        # (gates set for 5% of the general tokens: the scenario was built before 1% was default)
        search=search
        or SearchSpace(
            presets=("gss",),
            ranks=(1,),
            gates=("hard",),
            steps=3,
            domain_budget=9,
            gate_share=0.05,
        ),
        budget=0.001,
        progress=False,
    )


def test_protect_adds_a_block_when_one_is_not_enough(memorizer):
    result = _tight_budget(memorizer)
    single = [t for t in result.trials if t.stage == "block" and t.within_budget]
    best_single = min(single, key=lambda t: (t.memorized, t.token_match, t.utility))
    assert best_single.memorized > 0  # one block cannot reach the target in this budget
    second = [t for t in result.trials if t.stage == "second block"]
    assert second and all(
        t.blocks == (best_single.blocks[0], 1 - best_single.blocks[0]) for t in second
    )
    heads = {t.deltas[0] for t in second}  # the first block gives up part of the budget
    assert heads == {best_single.deltas[0], best_single.deltas[0] / 2}
    assert isinstance(result.steer, gss.SteeringStack) == (len(result.chosen.blocks) == 2)


def test_protect_refines_the_best_pairs_it_is_asked_to(memorizer):
    """Stages 2 and 3 (other ranks, other gates) run on `SearchSpace.refine` of stage 1's best
    (variant, block) pairs, best first."""
    space = dict(presets=("gss",), ranks=(1, 2), gates=("hard", "relu"), steps=2, max_blocks=1)
    space["domain_budget"] = 9
    refined = {}
    for refine in (1, 2):
        result = _tight_budget(memorizer, SearchSpace(**space, refine=refine))
        refined[refine] = {t.blocks for t in result.trials if t.stage in ("rank", "gate")}
    assert len(refined[1]) == 1 and len(refined[2]) == 2 and refined[1] < refined[2]


def _strength_points(limit: float, memorized_above: float, **space) -> list[float]:
    """The deltas `strength_search` measures on a model whose utility cost is delta itself
    (within the budget up to `limit`) and whose rows stay extractable above delta
    `memorized_above`, in the order measured."""
    measured: list[float] = []

    def judge(delta, stage, preset):
        measured.append(delta)
        return protect_module.Trial(
            stage, preset, (0,), (delta,), 1, "hard",
            memorized=10.0 if delta < memorized_above else 0.0,
            token_match=50.0, utility=delta, within_budget=delta <= limit,
        )  # fmt: skip

    measure_module.strength_search(judge, float, SearchSpace(**space), "block", "gss", 0.0)
    return measured


def test_strength_search_raises_a_range_the_budget_does_not_bound():
    """A gate open on few general tokens can afford far stronger steers than delta_range's
    top (docs/protect.md): the range is raised two decades at a time while its strongest point
    is within the budget and short of the target, then bisected."""
    default = _strength_points(limit=10.0, memorized_above=1e9, steps=3)
    assert default[:2] == [100.0, 0.001] and len(default) == 5  # bounded: as before
    raised = _strength_points(limit=3e3, memorized_above=1e9, steps=3)
    assert raised[:3] == pytest.approx([100.0, 1e4, 10**3])  # then between 1e2 and 1e4
    assert len(raised) == 5 and max(d for d in raised if d <= 3e3) > 1e3
    # at the target already, or no room above the range: never raised
    assert _strength_points(limit=3e3, memorized_above=50.0, steps=3) == [100.0]
    assert _strength_points(limit=3e3, memorized_above=1e9, steps=3, delta_ceiling=100.0) == [100.0]
    # still within the budget at the ceiling: stops there
    assert _strength_points(limit=1e9, memorized_above=1e9, delta_ceiling=1e5) == pytest.approx(
        [100.0, 1e4, 1e5]
    )


def test_general_text_made_of_the_memorized_rows_is_warned_about(protected, memorizer):
    result, _, texts = protected
    memorized = [texts[r.index] for r in result.audit.memorized]
    general = memorizer[3][20:40].tolist()
    with pytest.warns(GSSWarning, match=r"\d+ of the \d+ general rows are rows the model repro"):
        split_module._warn_if_general_is_memorized([*memorized, *general], result.audit, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GSSWarning)
        split_module._warn_if_general_is_memorized(general, result.audit, 16)


def test_the_rows_figure_without_a_steer_shows_the_rows_as_they_were(protected, tmp_path):
    import dataclasses

    from matplotlib.axes import Axes

    result = dataclasses.replace(protected[0], chosen=None, after={})
    drawn, bar = [], Axes.bar

    def record(self, x, height, *args, **kwargs):
        drawn.append((list(x), list(height)))
        return bar(self, x, height, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Axes, "bar", record)
        importlib.import_module("gss.protect.result").figures(result, tmp_path)
    assert drawn == [(["before", "after (no steer)"], [result.before["memorized"]] * 2)]


def test_protect_replays_the_blocks_below_each_steer_to_the_same_result(memorizer, monkeypatch):
    """The search replays blocks below a steered block (gss.steering.prefix_replay) rather than run
    them for every point: the points it measures, and so what it chooses, are the same to the
    last bit as with every block run every time."""
    from contextlib import nullcontext

    from gss.steering.prefix_replay import BlockPrefixReplay

    made: list[BlockPrefixReplay] = []

    class Recorded(BlockPrefixReplay):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(measure_module, "BlockPrefixReplay", Recorded)
    replayed = _tight_budget(memorizer)
    assert made and made[0].replayed > 0 and not made[0].off
    monkeypatch.setattr(Recorded, "below", lambda self, layer: nullcontext())
    computed = _tight_budget(memorizer)
    assert replayed.trials == computed.trials and replayed.chosen == computed.chosen
    assert replayed.after == computed.after and replayed.gates == computed.gates


def test_protect_command(memorizer, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from ..helpers import WORDS, word_tokenizer

    model, reference, planted, general = memorizer
    for name, m in (("model", model), ("ref", reference)):
        m.save_pretrained(tmp_path / name)
        word_tokenizer(WORDS[:24]).save_pretrained(tmp_path / name)  # the memorizer's 24 ids
    rows = torch.cat([planted, general[:20]]).tolist()
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    (tmp_path / "general.jsonl").write_text(
        "".join(json.dumps({"input_ids": r}) + "\n" for r in general[20:60].tolist())
    )
    args = ["protect", "--model", str(tmp_path / "model"), "--reference", str(tmp_path / "ref")]
    args += ["--data", str(tmp_path / "data.jsonl"), "--general", str(tmp_path / "general.jsonl")]
    args += ["--k", "4", "--n", "16", "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*args, "--gate-share", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "Held-out memorized rows" in out and (tmp_path / "out" / "steer").is_dir()
    saved = gss.load(tmp_path / "out" / "steer")
    for member in saved if isinstance(saved, gss.SteeringStack) else [saved]:  # as asked
        assert member.provenance.threshold_rule["target"] == 0.2
    assert main(args) == 2  # --out holds a run: refused before the models load
    assert "--overwrite" in capsys.readouterr().err
    import dataclasses

    import gss.cli.protection as command

    package = importlib.import_module("gss.protect")  # the subpackage, not gss.protect()

    found = package.protect  # a run that finds no steer: its report, and exit 3 (not a bug's 1)
    monkeypatch.setattr(
        package, "protect", lambda *a, **k: dataclasses.replace(found(*a, **k), steer=None)
    )
    assert main([*args, "--overwrite"]) == command.EXIT_NO_STEER == 3
    assert "no steer (none within budget)" in capsys.readouterr().out
    assert not (tmp_path / "out" / "steer").exists()


def test_protect_takes_replies_given_their_prompt(memorizer):
    model, reference, planted, general = memorizer
    rows = torch.cat([planted, general[:10]]).tolist()
    pairs = [(r[:6], r[6:]) for r in rows]
    space = SearchSpace(presets=("gss-tr",), ranks=(4,), gates=("hard",), max_blocks=1)
    result = protect(
        model,
        reference,
        pairs,
        general=general[20:60].tolist(),
        k=4,
        n=14,
        search=space,
        progress=False,
    )
    assert result.before["memorized"] == 100.0 and result.chosen is not None
    assert result.after["memorized"] <= result.before["memorized"]
    assert result.replies["points"]  # step 7 is on by default
    assert result.examples and result.examples[0]["original"]


def test_reference_text_is_seeded_and_needs_only_a_forward(memorizer):
    from gss.protect import reference_text

    _, reference, _, _ = memorizer

    class ForwardOnly(torch.nn.Module):  # as gss.adapters_off(model): no generate()
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask)

    starts = [[3], [5], [7]]
    a = reference_text(reference, starts, length=6, seed=1, batch_size=2)
    wrapped = ForwardOnly(reference).eval()  # as the model it wraps (the fixture's, shared)
    assert a == reference_text(wrapped, starts, length=6, seed=1, batch_size=2)
    assert [r[:1] for r in a] == starts and all(len(r) == 7 for r in a)
    assert a != reference_text(reference, starts, length=6, seed=2, batch_size=2)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (benchmarks/scripts/gpu_checks.sh)"
)
def test_protect_on_cuda(memorizer, tmp_path):
    """protect runs where the models are: the search, the report and the saved steer on a GPU."""
    import copy

    model, reference, planted, general = (copy.deepcopy(m) for m in memorizer)
    model, reference = model.cuda(), reference.cuda()
    texts = torch.cat([planted, general[:20]]).tolist()
    result = protect(
        model, reference, texts, general=general[20:80].tolist(), k=4, n=16, progress=False
    )
    assert result.chosen is not None and result.chosen.within_budget
    assert result.before["memorized"] == 100.0 and result.after["memorized"] < 100.0
    result.write(tmp_path / "out")
    rows = [result.audit.ids[i] for i in result.heldout]
    with gss.steer(model, gss.load(tmp_path / "out" / "steer")):
        modes = result.config.leak_modes
        measured = measure_module.leaked(model, rows, 4, 16, 0, 8, modes)
        assert measured[0] == result.after["memorized"]


def test_protect_report_says_which_window_each_heldout_row_was_scored_on(protected, tmp_path):
    result, _, _ = protected
    windows = result.heldout_windows()
    assert [w["row"] for w in windows] == result.heldout  # no row left out: positions = indices
    assert {(w["prompt_tokens"], w["window_tokens"]) for w in windows} == {(4, 12)}
    assert f"first 4 tokens ({len(result.heldout)} rows), each on the next 12" in result.markdown()
    result.write(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "protect.json").read_text())["heldout_windows"] == windows


def test_protect_report_gives_the_heldout_rate_its_exact_intervals(protected):
    """Issue 70: "0 of N" with its two-sided 95% interval and its one-sided upper bound."""
    result, _, _ = protected
    count = len(result.heldout)
    left = round(result.after["memorized"] * count / 100)
    lo, hi = clopper_pearson(left, count)
    _, bound = clopper_pearson(left, count, one_sided=True)
    assert result.heldout_interval() == [100 * lo, 100 * hi]
    assert result.summary()["heldout_upper_bound"] == [0.0, 100 * bound] and bound < hi
    line = f"({left} of {count}; 95% interval {100 * lo:.1f}-{100 * hi:.1f}%"
    assert line in result.markdown()
    assert f"one-sided 95% upper bound {100 * bound:.1f}%" in result.markdown()


def test_protect_measures_rows_from_the_shortest_prompt_that_extracts_them(memorizer):
    """Issue 72: rows whose first k tokens already hold part of what is memorized; scored from
    k, none is found; with memorized_from="shortest" each is tuned on or held out and measured
    from the prompt that extracts it, and the report says so."""
    from ..test_audit import _cut_late

    model, reference, planted, general = memorizer
    texts = [_cut_late(r) for r in planted.tolist()] + general[:20].tolist()
    space = SearchSpace(presets=("gss",), ranks=(1,), gates=("hard",), steps=2, max_blocks=1)
    options = dict(general=general[20:60].tolist(), k=8, n=16, prefixes=[4], search=space)
    with pytest.raises(GSSError, match=r"too few to tune on and hold out"):
        protect(model, reference, texts, progress=False, **options)
    result = protect(model, reference, texts, memorized_from="shortest", progress=False, **options)
    assert sorted(result.tuning + result.heldout) == list(range(len(planted)))
    assert {(w["prompt_tokens"], w["window_tokens"]) for w in result.heldout_windows()} == {(4, 8)}
    assert result.before["memorized"] == 100.0  # from 4 tokens: all of them
    assert result.chosen is not None
    with result.steer.attach(model):  # what "after" counts: greedy from the first 4 tokens
        out = greedy_generate(model, [texts[i][:4] for i in result.heldout], 8, pad_id=0)
    left = [o == texts[i][4:12] for o, i in zip(out, result.heldout, strict=True)]
    assert result.after["memorized"] == pytest.approx(100 * sum(left) / len(left))
    assert "Held-out rows scored from their first 4 tokens" in result.markdown()
    record = result.steer.provenance.extra["protect"]
    assert record["memorized_from"] == "shortest"


def test_protect_report_says_when_heldout_rows_leak_before_k(memorizer):
    """Scored from k, the report counts the held-out rows a shorter prompt extracts too."""
    from gss.protect import Protection

    model, reference, planted, _ = memorizer
    report = gss.audit(model, reference, planted.tolist(), k=8, n=16, prefixes=[4])
    result = Protection(
        steer=None, audit=report, tuning=[0, 1, 2], heldout=[3, 4, 5],
        budget={"measure": "perplexity", "limit": 2.0}, max_extractable=0.0, trials=[], chosen=None,
        before={"memorized": 100.0, "utility": 1.0}, after={}, gates={},
    )  # fmt: skip
    line = result.windows_line()
    assert line.startswith("Held-out rows scored from their first 8 tokens (3 rows)")
    assert "3 of them are extracted from a shorter prompt too" in line
    assert "--memorized-from shortest" in result.markdown()


@pytest.mark.parametrize(
    ("max_candidates", "expected"),
    [(6, [0, 1, 2, 3, 5, 7]), (1, [0]), (3, [0, 1, 7]), (2, [0, 7])],
)
def test_candidate_blocks_are_the_strongest_and_evenly_spaced_ones(
    monkeypatch, max_candidates, expected
):
    """Step 4 on an 8-block model: half of ``max_candidates`` evenly spaced blocks, the rest
    (at least one: ``max_candidates=1`` searched nothing) the strongest signal's."""
    from types import SimpleNamespace

    import gss.layer_scan
    from gss.protect import stages

    from ..helpers import tiny_model

    strengths = {0: 0.9, 1: 0.8, 2: 0.1, 3: 0.7, 4: 0.2, 5: 0.3, 6: 1.0, 7: 0.05}  # 6: frozen
    scan = SimpleNamespace(strengths=strengths, unchanged=[6])
    monkeypatch.setattr(gss.layer_scan, "scan_layers", lambda *a, **k: scan)
    search = stages.Search.__new__(stages.Search)
    search.s = SimpleNamespace(model=tiny_model("llama", layers=8), reference=None, batch_size=1)
    search.space = SearchSpace(max_candidates=max_candidates)
    search.split = SimpleNamespace(tune_rows=[])
    search.general = SimpleNamespace(fit_rows=[])
    search.work = stages.Clock()
    assert search.candidate_blocks() == expected
