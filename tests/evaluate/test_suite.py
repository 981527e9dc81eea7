"""evaluate_model and the deviation score: exact answers from a lookup-table LM."""

import json
import math

import pytest
import torch

from gss.errors import GSSError
from gss.evaluate import perplexity
from gss.evaluate.suite import deviation_score, evaluate_model

VOCAB = 12


def test_deviation_score_is_the_papers_formula():
    # m = 0.5, PPLDeg = 0.1: 100 sqrt(0.25 + 0.1 * 0.01)
    assert deviation_score(50.0, 22.0, 20.0, 0.1) == pytest.approx(100 * math.sqrt(0.251))
    # a perplexity below the base is no degradation
    assert deviation_score(10.0, 15.0, 20.0, 0.05) == pytest.approx(10.0)
    with pytest.raises(GSSError, match="base perplexity"):
        deviation_score(10.0, 15.0, 0.0, 0.05)


def test_memorized_token_match_and_perplexity_are_exact(table_lm):
    known = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 3, 5, 7, 9, 11, 2, 4]]
    # the model knows the first six tokens of this one, then says 0: 2 of 4 window tokens match
    half = [1, 4, 4, 4, 4, 4, 9, 9]
    model = table_lm([*known, half[:6]], VOCAB, default=0)
    short = [1, 2, 3]  # not longer than k: cannot be prompted, not counted
    heldout = [[1, 2, 3, 4], [5, 6, 7]]
    report = evaluate_model(model, [*known, short, half], heldout, k=4, n=8, batch_size=2)
    assert report.rows == 3 and report.index == (0, 1, 3)
    assert report.per_row == (True, True, False)
    assert report.memorized == pytest.approx(200 / 3)
    assert report.token_match == pytest.approx(100 * (4 + 4 + 2) / 12)
    assert report.perplexity == pytest.approx(perplexity(model, heldout))
    assert report.heldout_tokens == 5
    assert set(report.seconds) == {"memorization", "perplexity"}
    forced = evaluate_model(model, [*known, short, half], heldout, k=4, n=8, method="forced")
    assert forced.per_row == report.per_row and forced.perplexity == report.perplexity
    # n cuts rows: with n = 6 the window of `half` is tokens 4-5, which the model knows
    assert evaluate_model(model, [half], heldout, k=4, n=6).memorized == 100.0
    base = evaluate_model(model, [short, half], heldout, k=2, n=8)
    ds = report.deviation_scores(base)
    assert ds["DS_0.1"] == pytest.approx(report.memorized)  # same model: no degradation


def test_prompt_and_continuation_pairs_are_prompted_with_their_own_prompts(table_lm):
    # replies of different prompt lengths; the model knows the first reply, half the second
    pairs = [([1, 2], [3, 4, 5]), ([6, 7, 8, 9], [10, 11, 2]), ([4, 4, 4], [5])]
    model = table_lm([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 0], [4, 4, 4, 5]], VOCAB, default=0)
    for method in ("generate", "forced"):
        report = evaluate_model(model, pairs, [[1, 2, 3]], k=1, n=3, method=method)
        # n - k = 2: each reply's first two tokens count (all of a shorter one)
        assert report.per_row == (True, False, True) and report.rows == 3
        assert report.token_match == pytest.approx(100 * 4 / 5)
    assert evaluate_model(model, pairs, [[1, 2, 3]], k=1, n=4).per_row == (True, False, True)
    with pytest.raises(GSSError, match="empty prompt or reply"):
        evaluate_model(model, [([1], [])], [[1, 2, 3]], k=1, n=3)


def test_bad_windows_say_what_to_change(table_lm):
    model = table_lm([[1, 2, 3]], VOCAB, default=0)
    with pytest.raises(GSSError, match="k < n"):
        evaluate_model(model, [[1, 2, 3]], [[1, 2]], k=4, n=4)
    with pytest.raises(GSSError, match="smaller --k"):
        evaluate_model(model, [[1, 2, 3]], [[1, 2]], k=3, n=8)
    with pytest.raises(GSSError, match="held-out"):
        evaluate_model(model, [[1, 2, 3, 4]], [[1]], k=2, n=4)


def test_rows_as_tensors_give_a_report_of_plain_numbers_and_texts_are_refused(table_lm):
    model = table_lm([[1, 2, 3, 4, 5, 6]], VOCAB, default=0)
    rows = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 0]])
    report = evaluate_model(model, rows, rows, k=2, n=6, progress=False).to_dict()
    lists = evaluate_model(model, rows.tolist(), rows.tolist(), k=2, n=6, progress=False)
    assert {**report, "seconds": 0} == {**lists.to_dict(), "seconds": 0}
    json.dumps(report)  # no tensor in it
    with pytest.raises(GSSError, match=r"heldout row 0 is a text.*gss\.data\.encode"):
        evaluate_model(model, rows, ["w1 w2"], k=2, n=6, progress=False)
    with pytest.raises(GSSError, match=r"memorized row 1 holds a float"):
        evaluate_model(model, [[1, 2, 3], [1.5, 2, 3]], rows, k=2, n=6, progress=False)


def test_progress_bars_count_the_batches_of_each_part_and_can_be_turned_off(table_lm, capsys):
    model = table_lm([[1, 2, 3, 4, 5, 6]], VOCAB, default=0)
    rows, heldout = [[1, 2, 3, 4, 5, 6]] * 3, [[1, 2, 3, 4]] * 3
    evaluate_model(model, rows, heldout, k=2, n=6, batch_size=2)
    shown = capsys.readouterr().err
    assert "gss: greedy decoding" in shown and "gss: held-out perplexity" in shown
    assert "0/2 " in shown  # 3 rows in batches of 2: two batches to count
    evaluate_model(model, rows, heldout, k=2, n=6, batch_size=2, method="forced")
    assert "gss: teacher-forced pass" in capsys.readouterr().err
    quiet = evaluate_model(model, rows, heldout, k=2, n=6, batch_size=2, progress=False)
    assert capsys.readouterr().err == ""
    assert quiet.per_row == (True, True, True)


def test_the_sampled_attacker_reads_the_windows_probabilities(table_lm, memorizer):
    """The lookup table puts logit 1 on its token and 0 on the others: greedy reproduces every
    window, one sample a 4-token window with p = (e / (e + V - 1))^4, so 100 draws rarely do;
    the tiny memorizer's planted rows are learned sharply enough that 100 draws reproduce each."""
    known = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 3, 5, 7, 9, 11, 2, 4]]
    model = table_lm(known, VOCAB, default=0)
    report = evaluate_model(model, known, [[1, 2, 3]], k=4, n=8, sampled=True, progress=False)
    p = (math.e / (math.e + VOCAB - 1)) ** 4
    assert report.memorized == 100.0 and 1 - (1 - p) ** 100 < 0.5
    assert report.sampled == {"temperature_1": 0.0, "top_p": 0.0}
    assert evaluate_model(model, known, [[1, 2, 3]], k=4, n=8, progress=False).sampled is None
    tiny, _, planted, general = memorizer
    sharp = evaluate_model(tiny, planted.tolist(), general[:2].tolist(), k=4, n=16, sampled=True)
    assert sharp.memorized == 100.0 and sharp.sampled == {"temperature_1": 100.0, "top_p": 100.0}


def test_near_verbatim_is_one_run_of_most_of_the_window(table_lm):
    """Teacher-forced, a row is near-verbatim when most of its window (80%) is predicted right
    in one run: given the row up to the run, the model says the rest. Decoded greedily, the
    run must be in the output, which a wrong first token sends elsewhere."""
    late = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3]  # its first window token wrong
    middle = [2, 5, 6, 7, 8, 9, 10, 11, 3, 4, 6, 7]  # its sixth window token wrong
    model = table_lm([late, middle], VOCAB, default=0)
    model.table[(1, 2)] = 0  # the first of late's 10 window tokens: 9 right in a run after it
    model.table[tuple(middle[:7])] = 0  # middle's runs: 5 and 4 of its 10
    forced = evaluate_model(model, [late, middle], [[1, 2]], k=2, n=12, method="forced")
    assert forced.per_row == (False, False) and forced.per_row_near == (True, False)
    assert forced.near_verbatim == 50.0
    greedy = evaluate_model(model, [late, middle], [[1, 2]], k=2, n=12)
    assert greedy.per_row_near == (False, False)  # 0 after the wrong token: no run
    known = evaluate_model(model, [[1, 2, 0]], [[1, 2]], k=2, n=3)
    assert known.per_row == known.per_row_near == (True,)  # exact is near-verbatim too
    assert "per_row_near" in forced.to_dict()
