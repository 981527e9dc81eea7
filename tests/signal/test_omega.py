import copy
import math

import pytest
import torch

from gss import GSSError, memorization_signal, signal_statistics

from ..helpers import random_ids, word_tokenizer


def _logprob(model, row):
    """Independent computation: one unpadded row, model's own loss machinery."""
    logits = model(input_ids=row.unsqueeze(0)).logits[0, :-1]
    return -torch.nn.functional.cross_entropy(logits, row[1:], reduction="none")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_omega_is_a_logprob_difference(make_model, arch):
    model, ref = make_model(arch, seed=0), make_model(arch, seed=1)
    ids = random_ids(3, 12)
    omega = memorization_signal(model, ref, ids)
    assert omega.shape == (3, 11) and omega.dtype == torch.float32
    with torch.no_grad():
        for i in range(3):
            expected = _logprob(model, ids[i]) - _logprob(ref, ids[i])
            assert torch.allclose(omega[i], expected, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_exact_under_left_and_right_padding(make_model, arch):
    model, ref = make_model(arch, seed=0), make_model(arch, seed=1)
    short, long = random_ids(1, 6, seed=1)[0], random_ids(1, 10, seed=2)[0]
    alone = memorization_signal(model, ref, short.unsqueeze(0))[0]
    for side in ("left", "right"):
        ids = torch.zeros(2, 10, dtype=torch.long)
        mask = torch.zeros(2, 10, dtype=torch.long)
        ids[0], mask[0] = long, 1
        if side == "left":
            ids[1, 4:], mask[1, 4:] = short, 1
            got = memorization_signal(model, ref, ids, mask)[1, 4:]
            assert torch.isnan(memorization_signal(model, ref, ids, mask)[1, :4]).all()
        else:
            ids[1, :6], mask[1, :6] = short, 1
            got = memorization_signal(model, ref, ids, mask)[1, :5]
        assert torch.allclose(got, alone, atol=1e-5), side


def test_refuses_different_vocabularies(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", vocab=60)
    with pytest.raises(GSSError, match="vocabulary"):
        memorization_signal(model, ref, random_ids(1, 5))


def test_rows_padded_past_the_tokenizer_take_no_probability(make_model):
    """A copy of the model whose embeddings are padded past the tokenizer's 48 ids is the same
    model on those ids: omega is 0, not the share of probability the padded rows would take."""
    model = make_model("llama")
    padded = copy.deepcopy(model)
    padded.resize_token_embeddings(48, pad_to_multiple_of=64, mean_resizing=False)
    ids = random_ids(3, 10)
    for ref in (padded, model):
        omega = memorization_signal(model, ref, ids, tokenizer=word_tokenizer())
        assert torch.equal(omega, torch.zeros_like(omega))
    assert not torch.equal(padded(ids).logits[..., 48:], torch.zeros(3, 10, 16))


def test_pilot_statistics_on_a_hand_built_signal():
    nan = float("nan")
    omega = torch.tensor(
        [[1.0, 2.0, -1.0, 3.0, -1.0, -1.0, 5.0], [nan, nan, 1.0, -2.0, 1.0, 1.0, 1.0]]
    )
    stats = signal_statistics(omega)
    # bursts: [2, 1, 1] in row 0 and [1, 3] in row 1
    assert stats.burst_count == 5
    assert stats.burst_histogram == {1: 3, 2: 1, 3: 1}
    assert math.isclose(stats.burst_mean_length, 8 / 5)
    assert math.isclose(stats.burst_single_share, 3 / 5)
    assert stats.tokens == 12
    assert stats.share_above_mean == pytest.approx(8 / 12)


def test_a_model_with_nan_weights_is_said_to_be_so(make_model):
    from gss.evaluate import perplexity

    model, ref = make_model("llama"), make_model("llama", seed=1)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(GSSError, match="the model gives NaN or infinite log-probabilities"):
        memorization_signal(model, ref, random_ids(2, 6))
    with pytest.raises(GSSError, match="model gives NaN or infinite log-probabilities on the rows"):
        perplexity(model, random_ids(2, 6).tolist())
