"""MemFree, the decoding-time n-gram filter (issue 70's first peer)."""

from __future__ import annotations

import pytest
import torch

from gss.evaluate.decoding import greedy_generate
from gss_bench.baselines import get_method
from gss_bench.baselines.decoding import NgramFilter, ngram_index

from .helpers import PROMPT


def _ngrams(seq, n):
    return {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}


def test_the_index_lists_each_context_and_the_tokens_that_complete_it():
    index = ngram_index([[1, 2, 3, 4], [1, 2, 5]], 3)
    assert index == {(1, 2): {3, 5}, (2, 3): {4}}


def test_memfree_never_says_an_indexed_ngram_and_leaves_the_model_alone(memorizer):
    model, data = memorizer
    n = 4
    result = get_method("memfree").run(model, data, n=n)
    assert result.model is not model and result.handle is None
    prompts = [row[:PROMPT] for row in data.memorized]
    width = len(data.memorized[0]) - PROMPT
    plain = greedy_generate(model, prompts, width, pad_id=data.pad_id)
    filtered = greedy_generate(result.model, prompts, width, pad_id=data.pad_id)
    indexed = set().union(*(_ngrams(list(r), n) for r in data.memorized))
    reproduced = sum(p == list(r[PROMPT:]) for p, r in zip(plain, data.memorized, strict=True))
    assert reproduced >= 4  # the tiny model recites its rows unfiltered
    for prompt, out in zip(prompts, filtered, strict=True):
        assert not (_ngrams(list(prompt) + out, n) - _ngrams(list(prompt), n)) & indexed
    assert all(f != list(r[PROMPT:]) for f, r in zip(filtered, data.memorized, strict=True))


def test_the_filter_keeps_the_scores_of_every_unbanned_token(memorizer):
    model, data = memorizer
    filtered = NgramFilter(model, data.memorized, 3)
    ids = torch.tensor([list(data.memorized[0]), list(data.clean[0])])
    with torch.no_grad():
        inner = model(ids).logits
        outer = filtered(ids)
    banned = outer < inner - 1000
    assert banned[0].any()  # the memorized row completes its own trigrams
    assert torch.equal(outer[~banned], inner[~banned])
    # a banned position is one whose two tokens before it are a context of the memorized rows
    b, t, _ = banned.nonzero()[0].tolist()
    assert tuple(ids[b, t - 1 : t + 1].tolist()) in filtered.index


def test_teacher_forced_extraction_reads_what_filtered_greedy_decoding_says(memorizer):
    from gss.evaluate.memorization import nk_memorization

    model, data = memorizer
    filtered = get_method("memfree").run(model, data, n=10).model
    rows = [*data.memorized, *data.clean]
    width = len(rows[0]) - PROMPT
    forced = nk_memorization(filtered, rows, PROMPT, width, pad_id=data.pad_id, method="forced")
    generated = nk_memorization(filtered, rows, PROMPT, width, pad_id=data.pad_id)
    assert forced.per_row_memorized == generated.per_row_memorized


@pytest.mark.parametrize("n", [3, 4])
def test_greedy_decoding_with_the_cache_says_what_the_whole_sequence_says(memorizer, n):
    """The filter decodes with the model's KV cache (the n-grams' contexts kept across steps),
    as the whole sequence read again at every step would: MemFree at 200 canaries took 19 min a
    grid point without it."""
    from gss.hf.forward import accepts

    model, data = memorizer
    filtered = NgramFilter(model, data.memorized, n)
    prompts = [row[:2] for row in [*data.memorized, *data.clean]]  # most steps after the prompt
    width = len(data.memorized[0]) - 2
    cached = greedy_generate(filtered, prompts, width, pad_id=data.pad_id)

    class Uncached(torch.nn.Module):  # the same filter, offered no cache
        def __init__(self):
            super().__init__()
            self.filtered = filtered

        def forward(self, input_ids, attention_mask=None):
            return self.filtered(input_ids, attention_mask)

    uncached = Uncached().train(filtered.training)  # eval_mode restores it onto the model
    assert accepts(filtered, "use_cache") and not accepts(uncached, "use_cache")
    assert cached == greedy_generate(uncached, prompts, width, pad_id=data.pad_id)
    assert not model.training  # the shared model left in the mode it was in
