"""What the protected model says instead (issue 72): gates set so that no general source opens
them more than asked, the checks every point is held to (the data's clean rows, the
reference's continuations), the choice of the point that says what the reference would, and
the report's side-by-side continuations and ordinary prompts."""

from __future__ import annotations

import pytest
import torch

import gss
from gss import GSSError, calibrate, reference_where_open
from gss.config import RunOptions
from gss.evaluate.decoding import greedy_generate
from gss.evaluate.utility import perplexity
from gss.inference.handoff import recommended_gates
from gss.protect import SearchSpace, Trial, protect
from gss.protect.checks import DOMAIN, DomainRows
from gss.protect.config import ProtectConfig, Setting
from gss.protect.general import DATA, ORDINARY, GeneralText
from gss.protect.handover import choose
from gss.protect.measure import FOLLOWS, Judge, prompt_and_target
from gss.protect.ordinary import ordinary_english
from gss.protect.replies import ordinary_unchanged
from gss.protect.stages import gated
from gss.solve.thresholds import probe_responses


def test_ordinary_english_is_prose_seeded_and_offline():
    pytest.importorskip("pydoc_data.topics")  # a Python built without them: no source
    first, again, other = ordinary_english(8, 0), ordinary_english(8, 0), ordinary_english(8, 1)
    assert len(first) == 8 and first == again and first != other
    assert all(len(p) >= 300 and ">>>" not in p and "\n" not in p for p in first)
    assert len(ordinary_english(10_000)) < 10_000  # as many as there are, no more


def test_gates_hold_on_every_source(memorizer):
    """Each source's own thresholds, the highest kept: no source opens the gates on more than
    the share asked, where pooling would let the largest source decide."""
    model, reference, planted, general = memorizer
    art = _artifact(model, reference, planted, general)
    sources = {"a": general[:40].tolist(), "b": planted.tolist()}  # b: where the gates open
    gated = _gated(model, art, sources, 0.05, 8)
    shares = gated.provenance.gate_open_share
    assert set(shares["per_source"]) == {"a", "b"}
    for name, rows in sources.items():
        r = probe_responses(model, gated, rows).abs()
        opened = float((r > gated.thresholds).any(-1).double().mean())
        assert opened == pytest.approx(shares["per_source"][name])
        assert opened <= 0.05 + 1e-9
    pooled = _gated(model, art, {"all": [*sources["a"], *sources["b"]]}, 0.05, 8)
    assert torch.all(gated.thresholds >= pooled.thresholds - 1e-6)
    one = _gated(model, art, {"a": sources["a"], "empty": []}, 0.05, 8)
    assert "per_source" not in one.provenance.gate_open_share  # one source: its own rule


def _gated(model, art, sources, share, batch_size):
    return gated(Setting(model, model, None, 0, RunOptions(batch_size)), art, sources, share)


def _artifact(model, reference, planted, general):
    return calibrate(
        model,
        reference,
        planted.tolist(),
        "gss",
        layer=1,
        rank=2,
        gen_texts=general[60:].tolist(),
        progress=False,
    )


class _Bar:
    def update(self, _: int) -> None: ...

    def set_postfix_str(self, *_: object, **__: object) -> None: ...


def test_a_check_over_its_limit_puts_a_point_out_of_the_budget(memorizer):
    model, reference, planted, general = memorizer
    art = _artifact(model, reference, planted, general)
    rows = planted[:4].tolist()

    def judge(limit: float | None) -> Judge:
        return Judge(
            model,
            rows,
            lambda m: 1.0,
            2.0,
            k=4,
            n=16,
            pad_id=0,
            batch_size=8,
            bar=_Bar(),
            checks={"seven": (lambda m: 7.0, limit)},
        )

    assert judge(None)(art, "block", "gss").within_budget  # recorded, not bounded
    assert judge(8.0)(art, "block", "gss").within_budget
    out = judge(6.0)(art, "block", "gss")
    assert not out.within_budget and out.checks == {"seven": 7.0}


def _trial(memorized: float, match: float, follows: float) -> Trial:
    return Trial(
        "block", "gss", (0,), (1.0,), 4, "hard", memorized, match, 1.0, True, {FOLLOWS: follows}
    )


def test_prefer_reference_takes_the_point_that_follows_the_reference(memorizer):
    judge = Judge(
        memorizer[0], [], lambda m: 1.0, 2.0, k=4, n=16, pad_id=0, batch_size=8, bar=_Bar()
    )
    strong, gentle, short = _trial(0.0, 20.0, 9.0), _trial(0.0, 60.0, 3.0), _trial(10.0, 90.0, 1.0)
    trials = [strong, gentle, short]
    judge.prefer = "reference"
    assert judge.ranked(trials) == [gentle, strong, short]  # the target first, then follows
    judge.prefer = "margin"
    assert judge.ranked(trials) == [strong, gentle, short]


def test_domain_rows_are_the_clean_ones_split_in_two(memorizer):
    model, reference, planted, general = memorizer
    from gss import audit

    texts = [*planted.tolist(), *general[:6].tolist()]
    report = audit(model, reference, texts, k=4, n=16, progress=False)
    domain = DomainRows.of(report, 0, 8)
    flagged = {tuple(report.ids[r.index]) for r in report.memorized}
    clean = [*domain.search, *domain.report]
    assert clean and not flagged & {tuple(r) for r in clean}
    assert len(domain.search) - len(domain.report) in (0, 1)
    assert domain.measure(model)["domain_perplexity"] > 1


def test_ordinary_prompts_unchanged_by_a_steer_that_never_opens(memorizer):
    model, reference, planted, general = memorizer
    art = _artifact(model, reference, planted, general)
    rows = general[:6].tolist()
    closed = art.with_thresholds(torch.full_like(art.thresholds, 1e9), {"kind": "test"})
    out = ordinary_unchanged(model, closed, rows, 0, 8, None, prompt=4, width=8)
    assert out == {
        "rows": 6,
        "reciting": 0,
        "identical": 1.0,
        "identical_not_reciting": 1.0,
        "changed_reciting": None,
        "changed": [],
    }
    wide = art.with_options(gate="none", delta=50.0)  # steers every token, hard
    out = ordinary_unchanged(model, wide, rows, 0, 8, None, prompt=4, width=8)
    assert out["identical"] < 1.0 and out["changed"][0]["prompt"]
    assert ordinary_unchanged(model, closed, [[1]], 0, 8, None, prompt=4) == {}
    # the prompts whose unsteered continuation recites the data are counted apart
    plain = greedy_generate(model, [r[:4] for r in rows], 8, pad_id=0, batch_size=8)
    out = ordinary_unchanged(model, wide, rows, 0, 8, None, data=plain[:2], prompt=4, width=8)
    reciting = {tuple(p) for p in plain[:2]}
    assert out["reciting"] == sum(tuple(p) in reciting for p in plain) >= 2
    with wide.attach(model):
        steered = greedy_generate(model, [r[:4] for r in rows], 8, pad_id=0, batch_size=8)
    same = [a == b for a, b in zip(plain, steered, strict=True)]
    clean = [s for s, p in zip(same, plain, strict=True) if tuple(p) not in reciting]
    assert out["identical_not_reciting"] == sum(clean) / len(clean)
    # with the reference: its token where a gate opens; the model as its own reference says
    # what it says unsteered, gate or not
    always = art.with_thresholds(torch.full_like(art.thresholds, 1e-30), {"kind": "test"})
    out = ordinary_unchanged(model, always, rows, 0, 8, None, model, prompt=4, width=8)
    assert out["reference_where_open"]["identical"] == 1.0
    # with no gate (the signal alone, at any step): the same where the reference is the model;
    # with another reference, at least as many steps handed over as through closed gates
    assert out["signal_alone"]["identical"] == 1.0
    out = ordinary_unchanged(model, closed, rows, 0, 8, None, reference, prompt=4, width=8)
    assert out["reference_where_open"]["identical"] == 1.0  # closed gates hand nothing over
    with reference_where_open(model, None, reference) as processor:
        alone = greedy_generate(
            model, [r[:4] for r in rows], 8, pad_id=0, batch_size=8, processor=processor
        )
    same = [a == b for a, b in zip(plain, alone, strict=True)]
    assert out["signal_alone"]["identical"] == sum(same) / len(same)


def _words_tokenizer():
    """A word-level tokenizer inside the memorizer's 24 ids: English reads as ``<unk>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def test_protect_reports_the_domain_and_the_ordinary_prompts(memorizer):
    """With a tokenizer, ordinary English is a general source: its own thresholds, its own
    open share in the report, and the ordinary prompts read from its held-out half."""
    pytest.importorskip("pydoc_data.topics")
    model, reference, planted, general = memorizer
    space = SearchSpace(
        presets=("gss-tr",), ranks=(2,), gates=("hard",), max_blocks=1, steps=3, gate_on_data=True
    )
    result = protect(
        model,
        reference,
        torch.cat([planted, general[:20]]).tolist(),
        tokenizer=_words_tokenizer(),
        general=general[20:60].tolist(),
        k=4,
        n=16,
        search=space,
        progress=False,
    )
    assert result.chosen is not None
    assert set(result.gates["open_share"]) == {
        "general (given)",
        "reference-generated",
        ORDINARY,
        DATA,  # gate_on_data: gates set on the user's own domain too
    }
    assert result.steer.provenance.threshold_rule["sources"] == list(result.gates["open_share"])
    assert {DOMAIN, FOLLOWS} <= set(result.chosen.checks)
    assert result.chosen.checks[DOMAIN] <= result.before["domain_perplexity"] * 1.05 + 1e-9
    assert "domain_perplexity" in result.after
    ordinary = result.after["ordinary_prompts"]
    assert ordinary["rows"] > 0 and 0.0 <= ordinary["identical"] <= 1.0
    handed = ordinary["reference_where_open"]["identical"]
    text = result.markdown()
    assert "Ordinary prompts:" in text and "held-out clean rows of the data" in text
    assert f"where a gate opens (gss generate --reference-where-open): {100 * handed:.1f}%" in text
    assert "fine-tune" in result.examples[0] and "reference where open" in result.examples[0]
    assert f"  - reference at any step: `{result.examples[0]['reference at any step']}" in text
    assert "gss generate --reference-where-open" in text  # the option, with what it would say
    assert result.after["quality"]["repeated_4grams_reference_where_open"] >= 0.0
    assert 0.0 <= result.after["quality"]["memorized_reference_where_open"] <= 100.0
    assert "of the held-out memorized rows reproduced greedily" in text
    quality = result.after["quality"]
    assert 0.0 <= quality["memorized_signal_alone"] <= 100.0
    assert "--handoff-gates none; the reference runs at every step): " in text
    assert f"{quality['memorized_signal_alone']:.1f}% reproduced" in text
    assert "with the signal alone (--handoff-gates none): " in text
    for rule in ("reference_where_open", "signal_alone"):  # the sampler through the hand-over
        for sampler in ("temperature_1", "top_p"):
            assert 0.0 <= quality[f"sampled_{sampler}_{rule}"] <= 100.0
    assert "with the reference kept (its processor step by step), where a gate opens " in text
    assert 0.0 <= ordinary["signal_alone"]["identical"] <= 1.0
    # step 8: both hand-over rules measured on the tuning rows; the choice is `choose`'s and
    # travels with the steer, where gss generate reads it
    handover = result.handover
    assert set(handover["rules"]) == {"steer", "none"}
    assert handover["gates"] == choose(handover["rules"], 0.95, result.max_extractable)
    assert handover["tuning_rows"] == len(result.tuning) and handover["ordinary_prompts"] > 0
    assert recommended_gates(result.steer) == handover["gates"]
    prompts = [prompt_and_target(result.audit.candidate(i), 4, 16) for i in result.tuning]
    with gss.reference_where_open(model, None, reference) as processor:  # the "none" rule
        said = greedy_generate(model, [p for p, _ in prompts], 12, pad_id=0, processor=processor)
    kept = [list(r[: len(t)]) == list(t) for r, (_, t) in zip(said, prompts, strict=True)]
    assert handover["rules"]["none"]["reproduced"] == pytest.approx(100 * sum(kept) / len(kept))
    # its replies' perplexity under the reference, and whether within step 7's allowances
    rows = [list(p) + list(r) for (p, _), r in zip(prompts, said, strict=True)]
    ppl = perplexity(reference, rows, 0, prompt_lengths=[len(p) for p, _ in prompts])
    assert handover["rules"]["none"]["reference_ppl"] == pytest.approx(ppl, rel=1e-5)
    own = handover["reference_ppl"]
    fluent = handover["rules"]["none"]["fluent"]
    assert fluent is None or fluent == (
        ppl <= 1.5 * own
        and handover["rules"]["none"]["repeated_4grams"]
        <= handover["reference_repeated_4grams"] + 3.0
    )
    late = [rule["recited_start"] for rule in handover["rules"].values()]
    assert all(0.0 <= v <= 100.0 for v in late) and "open with the window's first tokens" in text
    assert 0.0 <= quality["recited_start_reference_where_open"] <= 100.0
    assert "more than the reference's own (it acts late; the fine-tune: " in text
    assert f"chose **{handover['gates']}**" in text and "the reference's own replies: " in text
    assert "hand-over generations" in result.report_seconds
    assert result.seconds["handover"] > 0 and "The report by part" in text
    assert result.steer_for(result.trials[0]) is result.steers[0]
    with pytest.raises(GSSError, match="not one of this protect run's trials"):
        result.steer_for(_trial(0.0, 0.0, 0.0))


def test_without_the_documentation_topics_there_is_no_ordinary_source(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)  # import fails
    assert ordinary_english(8) == []


@pytest.mark.parametrize(("option", "value"), [("coefficient", "bounded"), ("centering", "full")])
def test_a_search_option_calibrates_every_point_with_it(memorizer, option, value):
    """SearchSpace(coefficient="bounded") / (centering="full"), issue 72's ablations: every
    point searched, and the chosen steer, are calibrated with the option; centred probes read
    their response from the general text's mean (a non-zero offset)."""
    model, reference, planted, general = memorizer
    space = SearchSpace(
        presets=("gss-tr",),
        ranks=(2,),
        gates=("hard",),
        max_blocks=1,
        steps=2,
        reply_check=0,
        handoff_unchanged=None,  # step 8 left out: no rule measured, none recorded
        **{option: value},
    )
    result = protect(
        model,
        reference,
        torch.cat([planted, general[:20]]).tolist(),
        general=general[20:60].tolist(),
        k=4,
        n=16,
        search=space,
        progress=False,
    )
    assert result.steer is not None and getattr(result.steer.config, option) == value
    assert all(getattr(s.config, option) == value for s in result.steers if s is not None)
    assert result.handover == {} and "handoff" not in result.steer.provenance.extra["protect"]
    if option == "centering":
        assert all(bool(s.offset.abs().sum() > 0) for s in result.steers if s is not None)


def test_protect_shows_one_explain_table_without_being_asked(memorizer):
    model, reference, planted, general = memorizer
    space = SearchSpace(presets=("gss-tr",), ranks=(2,), gates=("hard",), max_blocks=1, steps=2)
    result = protect(
        model,
        reference,
        torch.cat([planted, general[:20]]).tolist(),
        general=general[20:60].tolist(),
        k=4,
        n=16,
        search=space,
        progress=False,
    )
    assert "gates open" in result.explanation and "|dh|/|h|" in result.explanation
    assert "## Where the gates opened: one held-out memorized prompt" in result.markdown()


def test_the_report_counts_apart_the_ordinary_prompts_that_recite_the_data():
    from gss.protect.result import _ordinary_line

    said = {"identical": 0.5, "identical_not_reciting": 0.75, "changed_reciting": 1.0}
    line = _ordinary_line({"rows": 6, "reciting": 2, **said, "reference_where_open": said})
    assert line == (
        "Ordinary prompts: 50.0% (75.0% of the 4 that recite none of the data; 100.0% of the 2 "
        "that do changed) of 6 greedy continuations (32 tokens) are the unsteered fine-tune's, "
        "word for word; with the reference's token where a gate opens (gss generate "
        "--reference-where-open): 50.0% (75.0% of the 4 that recite none of the data; 100.0% "
        "of the 2 that do changed)."
    )
    # TinyMem's math prompts all recite the data: no share of none is printed ("? of the 0")
    assert _ordinary_line({"rows": 6, "reciting": 6, **said, "identical_not_reciting": None}) == (
        "Ordinary prompts: 50.0% (every one recites some of the data: 100.0% of them changed) "
        "of 6 greedy continuations (32 tokens) are the unsteered fine-tune's, word for word."
    )
    assert _ordinary_line({"rows": 6, "reciting": 0, **said}) == (
        "Ordinary prompts: 50.0% of 6 greedy continuations (32 tokens) are the unsteered "
        "fine-tune's, word for word."
    )


def test_the_data_sets_gates_but_is_neither_calibration_nor_utility_text():
    """`SearchSpace.gate_on_data`: the data's clean rows are a source the thresholds are set on
    and the open share is measured on, but not the calibration's general text (Sigma_gen) nor
    the default utility's text (the domain check reads them)."""
    text = GeneralText(
        fit={"reference-generated": [[1, 2]], DATA: [[3, 4]]},
        measure={"reference-generated": [[5, 6]], DATA: [[7, 8]]},
    )
    assert text.fit_rows == [[1, 2]] and text.measure_rows == [[5, 6]]
    assert SearchSpace().gate_on_data is False  # measured: results/protect-says/gate-on-data
    with pytest.raises(GSSError, match="gate_on_data must be True or False"):
        SearchSpace(gate_on_data="yes").check()  # type: ignore[arg-type]


def test_the_data_is_dropped_from_the_gates_sources_where_no_point_reaches_the_goal(monkeypatch):
    """On a model that learned every row alike, gates set on the data's clean rows stay shut on
    the memorized rows too: each artifact is searched again without them, only then."""
    from gss.protect import stages

    calls: list[list[str]] = []

    def fake_gated(s, art, sources, share):
        calls.append(list(sources))
        return art

    def fake_search(judge, make, space, stage, preset, goal):
        reached = DATA not in calls[-1] or preset == "reaches with the data"
        return [Trial(stage, preset, (0,), (1.0,), 2, "hard", 0.0 if reached else 50.0, 0, 1, True)]

    monkeypatch.setattr(stages, "gated", fake_gated)
    monkeypatch.setattr(stages, "strength_search", fake_search)
    search = stages.Search.__new__(stages.Search)
    search.general = GeneralText(fit={"reference-generated": [[1]], DATA: [[2]]}, measure={})
    search.s, search.space, search.judge = None, SearchSpace(), None
    search.stages, search.work = stages.Clock(), stages.Clock()
    search.config = ProtectConfig(max_extractable=0.0)
    search.explore(object(), "block", "reaches with the data")  # type: ignore[arg-type]
    assert calls == [["reference-generated", DATA]]
    search.explore(object(), "block", "gss-tr")  # type: ignore[arg-type]
    assert calls[1:] == [["reference-generated", DATA], ["reference-generated"]]


@pytest.mark.parametrize(
    ("rules", "chosen"),
    [  # measured (results/protect-says/handoff-signal-alone): (reproduced %, unchanged share)
        ({"steer": (64.6, 0.992), "none": (11.0, 0.914)}, "none"),  # math noise: 65.4 vs 19.6
        ({"steer": (1.5, 0.977), "none": (0.0, 0.320)}, "steer"),  # language noise: 3.8 vs 68
        ({"steer": (0.0, 0.992), "none": (0.0, 0.859)}, "steer"),  # math backdoor: both goals
        ({"steer": (0.0, 1.0), "none": (0.0, 0.936)}, "steer"),  # 216 canaries
        ({"steer": (0.0, 0.992), "none": (0.0, 0.992)}, "steer"),  # a tie: the gates
        ({"steer": (5.0, 0.99), "none": (0.0, 0.96)}, "none"),  # only one meets both
        ({"steer": (5.0, None), "none": (5.0, 0.9)}, "steer"),  # nothing to read: unchanged
        # the LoRA canaries (results/canaries-lora-protect): both goals met, the gates' replies
        # 1.72x the reference's perplexity, any step's 1.24x: the fluent one
        ({"steer": (0.0, 1.0, False), "none": (0.0, 0.969, True)}, "none"),
        ({"steer": (0.0, 1.0, False), "none": (0.0, 0.90, True)}, "steer"),  # fluent, changed
        ({"steer": (0.0, 1.0, False), "none": (0.0, 0.969, False)}, "steer"),  # neither fluent
        ({"steer": (0.0, 1.0, None), "none": (0.0, 0.969, True)}, "steer"),  # not judged
        # both fluent there on the tuning prompts, the gates handing over after the secret's
        # first digits on all 15, any step on 3: the earlier (results/canaries-lora-protect)
        ({"steer": (0.0, 1.0, True, 100.0), "none": (0.0, 0.969, True, 20.0)}, "none"),
        # the plain canaries: 2 and 1 of 16 late, a row apart (none of either held out): a tie
        ({"steer": (0.0, 1.0, True, 12.5), "none": (0.0, 1.0, True, 6.25)}, "steer"),
        ({"steer": (0.0, 1.0, True, 12.5), "none": (0.0, 0.99, True, 5.0)}, "steer"),
        ({"steer": (0.0, 1.0, True, 12.5), "none": (0.0, 0.99, True, 0.0)}, "none"),  # 12.5 apart
        ({"steer": (0.0, 1.0, True, 0.0), "none": (0.0, 0.969, True, 0.0)}, "steer"),
        ({"steer": (0.0, 1.0, False, 0.0), "none": (0.0, 0.969, True, 25.0)}, "none"),  # fluent
        ({"steer": (5.0, 0.99, True, 10.0), "none": (5.0, 0.99, True, 0.0)}, "none"),  # errors
    ],
)
def test_the_hand_over_rule_keeps_ordinary_prompts_first_then_leaks_least(rules, chosen):
    keys = ("reproduced", "unchanged", "fluent", "recited_start")
    table = {r: dict(zip(keys, v, strict=False)) for r, v in rules.items()}
    assert choose(table, 0.95) == chosen


def test_the_hand_over_rule_can_be_left_unmeasured_and_is_checked():
    with pytest.raises(GSSError, match="handoff_unchanged must be a share"):
        SearchSpace(handoff_unchanged=1.5).check()
    with pytest.raises(GSSError, match="handoff_unchanged must be a share"):
        SearchSpace(handoff_unchanged=True).check()  # type: ignore[arg-type]
    SearchSpace(handoff_unchanged=None).check()
