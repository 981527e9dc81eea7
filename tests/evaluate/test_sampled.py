"""Sampled extraction (issue 70): the chance that N samples reproduce a window, read off one
teacher-forced pass, checked on distributions whose answer is known and on a tiny memorizer."""

from __future__ import annotations

import math

import pytest
import torch

from gss import GSSError
from gss.audit import audit
from gss.evaluate.sampled import likely_shares, row_logprobs, sampled_chance, window_logprobs
from gss.hf.forward import token_logprobs
from gss.inference.handoff import reference_where_open


def _logits(probs: list[list[float]]) -> torch.Tensor:
    """(1, T + 1, V) logits whose position t predicts with ``probs[t]`` (last row unused)."""
    rows = [*probs, probs[-1]]
    return torch.tensor(rows).log().unsqueeze(0)


def test_temperature_one_is_the_product_of_the_window_tokens_probabilities():
    logits = _logits([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    ids = torch.tensor([[0, 1, 3]])  # window: token 1 (p 0.3) then token 3 (p 0.4)
    got = window_logprobs(logits, ids, 1, 3)
    assert float(got[0]) == pytest.approx(math.log(0.3 * 0.4), abs=1e-6)
    assert float(window_logprobs(logits, ids, 2, 3)[0]) == pytest.approx(math.log(0.4), abs=1e-6)


def test_top_p_renormalises_over_the_nucleus_and_is_zero_outside_it():
    """0.5, 0.3, 0.15, 0.05 at top-p 0.9: the first three are kept (mass 0.95)."""
    probs = [[0.5, 0.3, 0.15, 0.05]]
    inside = window_logprobs(_logits(probs), torch.tensor([[0, 2]]), 1, 2, top_p=0.9)
    assert float(inside[0]) == pytest.approx(math.log(0.15 / 0.95), abs=1e-6)
    outside = window_logprobs(_logits(probs), torch.tensor([[0, 3]]), 1, 2, top_p=0.9)
    assert float(outside[0]) == -math.inf
    # a nucleus smaller than the top token's probability keeps it alone: p = 1
    top = window_logprobs(_logits(probs), torch.tensor([[0, 0]]), 1, 2, top_p=0.2)
    assert float(top[0]) == pytest.approx(0.0, abs=1e-6)


def test_the_chance_matches_sampling():
    """What `sampled_chance` says N draws do, N draws from the same distribution do."""
    probs = torch.tensor([0.2, 0.5, 0.3])
    logprob = float(window_logprobs(_logits([probs.tolist()] * 2), torch.tensor([[1, 0, 2]]), 1, 3))
    assert logprob == pytest.approx(math.log(0.2 * 0.3), abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    draws = torch.multinomial(probs.expand(20000 * 2, 3), 1, True, generator=gen).view(-1, 2)
    hit = ((draws[:, 0] == 0) & (draws[:, 1] == 2)).float().view(-1, 10)  # 2000 attackers
    seen = float(hit.any(-1).float().mean())  # each draws 10 samples
    assert seen == pytest.approx(sampled_chance(logprob, 10), abs=0.03)
    assert sampled_chance(math.log(0.01), 100) == pytest.approx(1 - 0.99**100)
    assert sampled_chance(-math.inf, 100) == 0.0 and sampled_chance(0.0, 1) == 1.0


def test_bad_windows_and_options_are_refused():
    logits, ids = _logits([[0.5, 0.5]]), torch.tensor([[0, 1]])
    with pytest.raises(GSSError, match="a window needs"):
        window_logprobs(logits, ids, 0, 2)
    with pytest.raises(GSSError, match="top_p must be in"):
        window_logprobs(logits, ids, 1, 2, top_p=1.5)
    with pytest.raises(GSSError, match="samples must be an integer"):
        sampled_chance(-1.0, 0)


def test_the_audit_reports_the_sampled_attacker(memorizer):
    """Each row's window log-probability is the sum of its teacher-forced token log-probs; a
    greedily extractable row is inside every nucleus; planted rows are sampled, general ones
    less often, and the headline and summary say so with an interval."""
    model, reference, planted, general = memorizer
    rows = torch.cat([planted, general[:10]])
    report = audit(model, reference, rows.tolist(), k=4, n=16, progress=False)
    with torch.no_grad():
        lp = token_logprobs(model(rows).logits, rows)
    for row in report.rows:
        assert row.sampled_logprob == pytest.approx(float(lp[row.index, 3:16].sum()), abs=1e-3)
        assert row.nucleus_logprob is not None and row.reference_sampled_logprob is not None
        if row.extractable:
            assert math.isfinite(row.nucleus_logprob)
            assert row.nucleus_logprob >= row.sampled_logprob - 1e-5
    sampled = report.summary()["sampled"]
    assert sampled["rows"] == len(rows) and sampled["samples"] == 100
    planted_rows = [r for r in report.rows if r.index < len(planted)]
    assert all(r.sample_extractable() for r in planted_rows if r.memorized)
    assert sampled["extractable"] >= len(report.extractable)  # greedy's rows are likely too
    low, high = report.summary()["memorized_interval"]
    assert 0.0 <= low <= len(report.memorized) / len(rows) <= high <= 1.0
    assert "sampled from the first k tokens (100 draws" in report.headline()


def _no_immediate_repeat(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A processor whose answer depends on the steps before: the last token may not follow."""
    return scores.scatter(-1, ids[:, -1:], float("-inf"))


def test_a_processor_is_read_step_by_step(memorizer):
    """Through a processor, the window is forced step by step and the processed scores read:
    with one that changes nothing it is the one-pass answer, with one that reads the ids so far
    the answer by hand (prompts and windows of several lengths); with the hand-over at every
    step it is the reference's own (a second model and its cache behind the processor)."""
    model, reference, planted, general = memorizer
    rows = torch.cat([planted, general[:5]]).tolist()
    pairs = [
        (r[:k], r[k : k + w]) for r, k, w in zip(rows, [3, 4, 5] * 4, [6, 9] * 6, strict=False)
    ]
    for top_p in (None, 0.9):
        plain = row_logprobs(model, pairs, 0, 4, top_p)
        same = row_logprobs(model, pairs, 0, 4, top_p, processor=lambda ids, scores: scores)
        assert same == pytest.approx(plain, abs=1e-4)
    by_hand = []
    with torch.no_grad():
        for prompt, window in pairs:
            seq = torch.tensor([prompt + window])
            logits = model(seq).logits[0]
            total = 0.0
            for t in range(len(prompt), seq.shape[1]):
                scores = _no_immediate_repeat(seq[:, :t], logits[t - 1 : t])
                total += float(scores.log_softmax(-1)[0, seq[0, t]])
            by_hand.append(total)
    got = row_logprobs(model, pairs, 0, 4, processor=_no_immediate_repeat)
    assert got == pytest.approx(by_hand, abs=1e-4)
    reference.train()  # left in training mode: the hand-over still runs it without dropout
    try:
        with reference_where_open(
            model, None, reference, min_signal=-1e9, min_confidence=None, no_repeat_ngram=None
        ) as processor:
            handed = row_logprobs(model, pairs, 0, 4, processor=processor)
            shares = likely_shares(model, pairs, 0, 4, processor=processor)
        assert reference.training  # and its mode is given back
    finally:
        reference.eval()
    assert handed == pytest.approx(row_logprobs(reference, pairs, 0, 4), abs=1e-4)
    assert handed != pytest.approx(row_logprobs(model, pairs, 0, 4), abs=1e-2)
    assert shares == likely_shares(reference, pairs, 0, 4)
