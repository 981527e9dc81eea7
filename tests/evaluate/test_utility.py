import math

import pytest
import torch
import torch.nn.functional as F

from gss.errors import GSSError
from gss.evaluate import perplexity, repetition, token_accuracy

PAD = 15


def _rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 15, (n,), generator=g).tolist() for n in (5, 12, 2, 9, 12, 7)]


def _reference(model, rows):
    """Row by row, unpadded: (accuracy, perplexity) over every next-token target."""
    hits = n = 0
    nll = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r])
            logits = model(input_ids=ids).logits[0, :-1]
            t = ids[0, 1:]
            hits += int((logits.argmax(-1) == t).sum())
            nll += float(F.cross_entropy(logits, t, reduction="sum"))
            n += len(r) - 1
    return hits / n, math.exp(nll / n)


@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_accuracy_and_perplexity_match_row_by_row(gpt2_factory, batch_size):
    model = gpt2_factory()
    rows = _rows()
    acc, ppl = _reference(model, rows)
    assert token_accuracy(model, rows, PAD, batch_size=batch_size) == pytest.approx(acc, abs=1e-12)
    assert perplexity(model, rows, PAD, batch_size=batch_size) == pytest.approx(ppl, rel=1e-5)


def test_padding_is_excluded_in_every_input_form(gpt2_factory):
    model = gpt2_factory()
    rows = _rows(1)
    acc, ppl = _reference(model, rows)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    assert token_accuracy(model, ids, PAD) == pytest.approx(acc, abs=1e-12)
    assert perplexity(model, ids, PAD) == pytest.approx(ppl, rel=1e-5)
    assert token_accuracy(model, (ids, mask)) == pytest.approx(acc, abs=1e-12)
    assert perplexity(model, (ids, mask)) == pytest.approx(ppl, rel=1e-5)


def test_perplexity_is_token_weighted_not_batch_averaged(gpt2_factory):
    model = gpt2_factory()
    short, long_ = [1, 2], list(range(14))
    _, p_short = _reference(model, [short])
    _, p_long = _reference(model, [long_])
    got = perplexity(model, [short, long_], PAD, batch_size=1)
    expected = math.exp((math.log(p_short) * 1 + math.log(p_long) * 13) / 14)
    assert got == pytest.approx(expected, rel=1e-5)


def test_perplexity_past_a_float_is_infinite_not_an_error(gpt2_factory):
    """A model that gives the text no chance (MemFree at n = 4 bans the held-out text's
    4-grams: a mean NLL past 709 nats) has an infinite perplexity, not an OverflowError."""
    model = gpt2_factory()
    with torch.no_grad():
        model.lm_head.weight.mul_(1e6)  # logits ~1e6 apart: most targets ~1e6 nats away
    got = perplexity(model, _rows(), PAD)
    assert got == math.inf


def test_model_mode_is_restored(gpt2_factory):
    model = gpt2_factory().train()
    token_accuracy(model, _rows(), PAD)
    assert model.training


def test_perplexity_after_a_prompt_scores_only_the_reply(gpt2_factory):
    """With prompt lengths, a row's perplexity is that of its tokens after the prompt: the
    reference is the row-by-row NLL of those targets alone."""
    model = gpt2_factory()
    rows, prompts = _rows(2), [3, 4, 1, 9, 0, 7]  # row 3 is all prompt, row 5 has no token past
    nll = 0.0
    n = 0
    with torch.no_grad():
        for r, p in zip(rows, prompts, strict=True):
            ids = torch.tensor([r])
            logits = model(input_ids=ids).logits[0, :-1]
            first = max(p, 1)  # position of the first target scored
            nll += float(F.cross_entropy(logits[first - 1 :], ids[0, first:], reduction="sum"))
            n += max(len(r) - first, 0)
    got = perplexity(model, rows, PAD, batch_size=4, prompt_lengths=prompts)
    assert got == pytest.approx(math.exp(nll / n), rel=1e-5)
    # prompt length 1 (or 0) is the plain perplexity
    assert perplexity(model, rows, PAD, prompt_lengths=[1] * 6) == perplexity(model, rows, PAD)
    with pytest.raises(GSSError, match="6 rows but 2 prompt lengths"):
        perplexity(model, rows, PAD, prompt_lengths=[1, 2])


def test_repetition_counts_ngrams_seen_before_in_the_same_row():
    # row 0: 4-grams (1,2,3,4) (2,3,4,1) (3,4,1,2) (4,1,2,3) (1,2,3,4): the last repeats the
    # first; row 1 has no repeat (the 4-gram of row 0 in it is another row's); row 2 is short
    rows = [[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 4, 5], [7, 7, 7]]
    assert repetition(rows) == pytest.approx(100 * 1 / 7)
    assert repetition([[5, 5, 5, 5, 5, 5]], n=2) == pytest.approx(80.0)  # 4 of 5 bigrams
    assert math.isnan(repetition([[1, 2]]))
    with pytest.raises(GSSError, match="n must be >= 1"):
        repetition(rows, n=0)
