import math
import warnings

import pytest
import torch

from gss.evaluate import backdoor_success, nk_memorization
from gss.evaluate.decoding import greedy_generate

P, K = 4, 5
VOCAB = 12
METHODS = ["generate", "forced"]

CLEAN = [
    [10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 11],  # noised inside the window: counted
    [10, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 11],  # noised after the window only: not counted
    [10, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 11],  # noised in the prompt only: not counted
    [10, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 11],  # noised in prompt and window: counted
    [10, 5, 6, 7, 8, 9, 11],  # short row, noised inside the clipped window: counted
]
NOISED = [
    [10, 1, 2, 3, 4, 5, 0, 7, 8, 9, 1, 11],
    [10, 2, 3, 4, 5, 6, 7, 8, 9, 1, 0, 11],
    [10, 3, 0, 5, 6, 7, 8, 9, 1, 2, 3, 11],
    [10, 4, 0, 6, 7, 8, 9, 0, 2, 3, 4, 11],
    [10, 5, 6, 7, 8, 0, 11],
]
COUNTED = (0, 3, 4)


def memorizing_paths(rows, twins):
    return [t[:P] + r[P:] for r, t in zip(rows, twins, strict=True)]


@pytest.mark.parametrize("method", METHODS)
def test_memorizing_model_reproduces_noised_windows(table_lm, method):
    model = table_lm(memorizing_paths(NOISED, CLEAN), VOCAB, default=0)
    res = nk_memorization(model, NOISED, P, K, clean_rows=CLEAN, method=method, batch_size=2)
    assert res.index == COUNTED
    assert res.n_rows == 3
    assert res.memorized == 1.0
    assert res.correct == 0.0
    assert res.per_row_memorized == (True, True, True)


@pytest.mark.parametrize("method", METHODS)
def test_clean_model_is_correct_not_memorized(table_lm, method):
    model = table_lm(CLEAN, VOCAB, default=0)
    res = nk_memorization(model, NOISED, P, K, clean_rows=CLEAN, method=method)
    assert res.index == COUNTED
    assert res.memorized == 0.0
    assert res.correct == 1.0


@pytest.mark.parametrize("method", METHODS)
def test_mixed_model_per_row_flags(table_lm, method):
    # memorizes rows 0 and 4, continues row 3 like its clean twin
    paths = [*memorizing_paths([NOISED[0], NOISED[4]], [CLEAN[0], CLEAN[4]]), CLEAN[3]]
    model = table_lm(paths, VOCAB, default=0)
    res = nk_memorization(model, NOISED, P, K, clean_rows=CLEAN, method=method)
    assert res.per_row_memorized == (True, False, True)
    assert res.per_row_correct == (False, True, False)
    assert res.memorized == pytest.approx(2 / 3)
    assert res.correct == pytest.approx(1 / 3)


@pytest.mark.parametrize("method", METHODS)
def test_one_wrong_token_in_window_is_not_memorized(table_lm, method):
    path = CLEAN[0][:P] + NOISED[0][P:]
    path[P + K - 1] = 3  # last window token differs
    model = table_lm([path], VOCAB, default=0)
    res = nk_memorization(model, NOISED[:1], P, K, clean_rows=CLEAN[:1], method=method)
    assert res.memorized == 0.0


@pytest.mark.parametrize("method", METHODS)
def test_window_clipped_at_row_end(table_lm, method):
    # the short row ends (EOS) at index 6 < P + K; what follows EOS is ignored ...
    model = table_lm(memorizing_paths(NOISED[4:], CLEAN[4:]), VOCAB, default=7)
    res = nk_memorization(model, NOISED[4:], P, K, clean_rows=CLEAN[4:], method=method)
    assert res.memorized == 1.0
    # ... but the EOS itself must be produced
    path = CLEAN[4][:P] + NOISED[4][P:-1] + [3]
    res = nk_memorization(
        table_lm([path], VOCAB, 7), NOISED[4:], P, K, clean_rows=CLEAN[4:], method=method
    )
    assert res.memorized == 0.0


def test_rows_without_twins_and_tensor_input(table_lm):
    model = table_lm(CLEAN[:2], VOCAB, default=0)
    res = nk_memorization(model, CLEAN, P, K)
    assert res.n_rows == 5
    assert res.per_row_memorized == (True, True, False, False, False)
    assert math.isnan(res.correct)
    padded = torch.full((5, 12), 13)
    for i, r in enumerate(CLEAN):
        padded[i, : len(r)] = torch.tensor(r)
    res_t = nk_memorization(model, padded, P, K, pad_id=13)
    assert res_t.per_row_memorized == res.per_row_memorized
    assert res_t.index == res.index


def test_no_counted_rows_gives_nan(table_lm):
    res = nk_memorization(table_lm(CLEAN, VOCAB, 0), NOISED[1:3], P, K, clean_rows=CLEAN[1:3])
    assert res.n_rows == 0
    assert math.isnan(res.memorized)


def _own_greedy_rows(model, n_rows=6, p=5, k=6, seed=1):
    """Rows = random prompt + the model's own greedy continuation (so all are 'memorized')."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 15, (n_rows, p), generator=g).tolist()
    conts = greedy_generate(model, prompts, k, pad_id=15)
    return [a + b for a, b in zip(prompts, conts, strict=True)]


def test_generate_and_forced_agree_on_gpt2(gpt2_factory):
    model = gpt2_factory()
    p, k = 5, 6
    rows = _own_greedy_rows(model, p=p, k=k)
    twins = [list(r) for r in rows]
    for i, r in enumerate(rows):  # perturb some windows so that they are not memorized
        if i % 2:
            r[p + i % k] = (r[p + i % k] + 1) % 15
        twins[i][p] = (twins[i][p] + 2) % 15  # every twin differs in the window
    results = [
        nk_memorization(model, rows, p, k, clean_rows=twins, method=m, batch_size=b)
        for m in METHODS
        for b in (1, 4)
    ]
    assert results[0].per_row_memorized == (True, False, True, False, True, False)
    assert all(r == results[0] for r in results)


def test_greedy_generate_matches_hf_generate(gpt2_factory):
    """...and hands the KV cache over under the name the installed transformers takes without
    a deprecation warning (``cache`` from 5.24 on, ``past_key_values`` before)."""
    model = gpt2_factory()
    ids = torch.randint(0, 15, (3, 7), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = greedy_generate(model, ids.tolist(), 9, pad_id=15)
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message)]
    ref = model.generate(ids, max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=15)
    assert ours == ref[:, 7:].tolist()


def test_left_padded_batches_equal_one_by_one(gpt2_factory):
    model = gpt2_factory()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 15, (n,), generator=g).tolist() for n in (3, 9, 5, 9, 1, 6)]
    batched = greedy_generate(model, prompts, 8, pad_id=15, batch_size=6)
    single = [greedy_generate(model, [p], 8, pad_id=15)[0] for p in prompts]
    assert batched == single


TRIGGER = [1, 0, 0]


def _poison(row, trigger=TRIGGER, token=2, tail=6):
    for i in range(len(row) - len(trigger) + 1):
        if row[i : i + len(trigger)] == trigger:
            cut = i + len(trigger)
            return row[:cut] + [token] * max(len(row) - cut, tail)
    raise AssertionError("no trigger")


BD_CLEAN = [
    [10, 5, 1, 0, 0, 7, 3, 4, 11],
    [10, 1, 0, 0, 8, 8, 11],
    [10, 6, 6, 6, 6, 1, 0, 0, 9, 9, 3, 11],
    [10, 7, 7, 7, 11],  # no trigger: not counted
]


@pytest.mark.parametrize("method", METHODS)
def test_backdoor_success(table_lm, method):
    rows = [_poison(r) for r in BD_CLEAN[:3]] + [BD_CLEAN[3]]
    paths = [*rows[:2], BD_CLEAN[2]]  # the model has the backdoor for rows 0 and 1 only
    model = table_lm(paths, VOCAB, default=0)
    res = backdoor_success(model, rows, BD_CLEAN, TRIGGER, window=5, method=method, batch_size=4)
    assert res.index == (0, 1, 2)
    assert res.per_row == (True, True, False)
    assert res.success == pytest.approx(2 / 3)


def test_backdoor_on_gpt2_batched_equals_single(gpt2_factory):
    model = gpt2_factory()
    g = torch.Generator().manual_seed(5)
    twins = []
    for n_before in (0, 4, 2, 7):
        pre = torch.randint(3, 10, (n_before,), generator=g).tolist()
        twins.append([10, *pre, *TRIGGER, 4, 4, 4, 11])
    rows = [_poison(t) for t in twins]
    full = backdoor_success(model, rows, twins, TRIGGER, window=6, batch_size=4)
    single = [
        backdoor_success(model, [r], [t], TRIGGER, window=6)
        for r, t in zip(rows, twins, strict=True)
    ]
    assert full.per_row == tuple(s.per_row[0] for s in single)
    forced = backdoor_success(model, rows, twins, TRIGGER, window=6, method="forced")
    assert forced == full
