"""Bad input gets a GSSError that names the problem and the fix, never a torch traceback."""

import pytest
import torch

import gss
from gss import GSSError

from .helpers import random_ids


def test_wrong_layer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match="layer 5 is out of range"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=5, progress=False)


def test_mismatched_tokenizer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", vocab=100)
    with pytest.raises(GSSError, match="same base model"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=0, progress=False)


def test_empty_memorized_set(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match=r"nothing to steer against\. Lower omega_threshold"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=0, omega_threshold=1e9, progress=False)


def test_the_model_passed_as_its_own_reference(make_model):
    model = make_model("gpt2")
    twin = make_model("gpt2")  # the same weights loaded twice
    for ref in (model, twin):
        with pytest.raises(GSSError, match=r"omega = 0 everywhere.*started from"):
            gss.calibrate(model, ref, random_ids(4, 8), layer=0, progress=False)
        with pytest.raises(GSSError, match="omega = 0 everywhere"):
            gss.scan_layers(model, ref, random_ids(4, 8), progress=False)
    # the quantile rule cannot pick a top share of all-equal omegas either
    with pytest.raises(GSSError, match="omega = 0 everywhere"):
        gss.calibrate(
            model, twin, random_ids(4, 8), layer=0, memorized_quantile=0.2, progress=False
        )


def test_nan_activations(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.bias.fill_(float("nan"))
    with pytest.raises(GSSError, match="the model gives NaN or infinite log-probabilities"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=0, progress=False)


def test_strings_without_tokenizer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match="pass the model's tokenizer"):
        gss.calibrate(model, ref, ["some text"], layer=0, progress=False)


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ([{"content": "a b"}, {"content": "c"}], r"keys \['content'\].*dataset\['column'\]"),
        ([3, 4, 5], r"wrap it in a list \(\[ids\]\)"),
        (["a b", [3, 4]], "all texts or all token ids; sequence 1 is a list among texts"),
        ([3.5], "sequence 0 is of type float"),
        ([[3, 4.5]], r"sequence 0 holds a float \(4\.5\) among its token ids"),
    ],
)
def test_texts_of_the_wrong_kind_say_what_to_pass(make_model, texts, message):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match=message):
        gss.calibrate(model, ref, texts, layer=0, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gate": "soft"}, "gate must be one of"),
        ({"coefficient": "magic"}, "coefficient must be one of"),
        ({"delta": 0.0}, "delta must be > 0"),
        ({"rank": 0}, "rank must be an integer >= 1"),
        ({"rank": 2.5}, "rank must be an integer >= 1"),
        ({"memorized_quantile": 1.5}, "memorized_quantile"),
        ({"threshold_percentile": 100.0}, "threshold_percentile"),
        ({"threshold_percentile": float("nan")}, "threshold_percentile must be a finite number"),
        ({"delta": float("inf")}, "delta must be a finite number"),
        ({"ridge_delta": -1.0}, "ridge_delta must be > 0"),
        ({"gate_share": 1.0}, "gate_share must be in"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"strength": 2.0}, r"unknown calibration option\(s\) \['strength'\]"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ],
)
def test_bad_options(make_model, kwargs, message):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match=message):
        gss.calibrate(model, ref, random_ids(6, 8), layer=0, progress=False, **kwargs)


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ("w1 w2 w3", "the texts are one str"),
        (b"w1 w2", "the texts are one bytes"),
        ({"text": "w1 w2"}, "the texts are one dict"),
        ([], "no sequences given"),
    ],
)
def test_texts_that_are_not_a_list_of_rows(make_model, texts, message):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match=message):
        gss.calibrate(model, ref, texts, layer=0, progress=False)


def test_a_reference_that_gives_nan_is_named(make_model):
    """NaN log-probabilities made every comparison false, which read as 'no token passed the
    memorized-token rule': the cause is named instead."""
    import torch

    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with torch.no_grad():
        ref.lm_head.weight[5].fill_(float("nan"))
    with pytest.raises(GSSError, match="the reference gives NaN or infinite log-probabilities"):
        gss.calibrate(model, ref, random_ids(6, 8), layer=0, progress=False)
