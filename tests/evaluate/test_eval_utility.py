import math

import pytest
import torch
import torch.nn.functional as F

from gss.evaluate import perplexity, token_accuracy

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


def test_model_mode_is_restored(gpt2_factory):
    model = gpt2_factory().train()
    token_accuracy(model, _rows(), PAD)
    assert model.training
