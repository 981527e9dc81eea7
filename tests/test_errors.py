"""Bad input gets a GSSError that names the problem and the fix, never a torch traceback."""

import pytest
import torch

import gss
from gss import GSSError

from .conftest import random_ids


def test_wrong_layer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match="layer 5 is out of range"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=5, progress=False)


def test_mismatched_tokenizer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", vocab=100)
    with pytest.raises(GSSError, match="same base model"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=0, progress=False)


def test_empty_memorized_set(make_model):
    model = make_model("gpt2")
    with pytest.raises(GSSError, match="reference model is not the fine-tuned model itself"):
        gss.calibrate(model, model, random_ids(4, 8), layer=0, progress=False)


def test_nan_activations(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_proj.bias.fill_(float("nan"))
    with pytest.raises(GSSError, match="NaN or Inf"):
        gss.calibrate(model, ref, random_ids(4, 8), layer=0, progress=False)


def test_strings_without_tokenizer(make_model):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match="pass the model's tokenizer"):
        gss.calibrate(model, ref, ["some text"], layer=0, progress=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gate": "soft"}, "gate must be one of"),
        ({"coefficient": "magic"}, "coefficient must be one of"),
        ({"delta": 0.0}, "delta must be > 0"),
        ({"rank": 0}, "rank must be a positive integer"),
        ({"memorized_quantile": 1.5}, "memorized_quantile"),
        ({"threshold_percentile": 100.0}, "threshold_percentile"),
    ],
)
def test_bad_options(make_model, kwargs, message):
    model, ref = make_model("gpt2"), make_model("gpt2", seed=1)
    with pytest.raises(GSSError, match=message):
        gss.calibrate(model, ref, random_ids(6, 8), layer=0, progress=False, **kwargs)
